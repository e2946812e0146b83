#!/usr/bin/env bash
# Deploy the larql-edge grid (deploy/swarm/larql-grid.yaml) to an EXISTING Docker Swarm.
#
#   deploy/swarm/deploy.sh [options]
#
#   1. images: tags this engine's larql-<role>:TAG images as REGISTRY/larql-<role>:AS and pushes
#      them (only layers the registry lacks travel), then removes those extra tags again;
#      with --start-registry, first starts Debian's `docker-registry` on REGISTRY if nothing answers
#   2. the grid key: the Swarm secret larql_grid_key, created if missing from $LARQL_GRID_KEY_FILE
#      (a file), else $LARQL_GRID_KEY, else a new random key; an existing secret is kept (secrets
#      are immutable: rotate by creating a new name and setting LARQL_GRID_KEY_SECRET)
#   3. with --tls DIR: the grid's certificates become Swarm secrets (larql-grid.tls.yaml)
#   4. `docker stack deploy --resolve-image never` (no registry lookups at deploy time: each node
#      pulls REGISTRY/larql-<role>:AS when a task lands on it), then waits until every service has
#      its replicas running and healthy and no update under way (bounded by --wait; an update this
#      run started that ends rolled back or paused: exit 1)
#
# Idempotent: a rerun pushes nothing new, keeps the secret, and changes no service whose spec did
# not change. A rebuilt image under the SAME tag is not rolled out (Swarm compares the image
# string): give each release its own --as TAG (e.g. a git sha), or `docker service update --force`.
#
# Options (environment twin in brackets):
#   --stack NAME          stack name (default larql)                               [LARQL_STACK]
#   --manager HOST        docker -H of a swarm manager (default: the CLI's engine) [LARQL_SWARM_MANAGER]
#   --source HOST         docker -H of the engine holding the larql-* images       [LARQL_SWARM_SOURCE]
#   --registry ADDR       registry the NODES pull from (default 127.0.0.1:5000)    [LARQL_REGISTRY]
#   --push-registry ADDR  the same registry as this machine reaches it, when that  [LARQL_PUSH_REGISTRY]
#                         differs (default: --registry); a loopback address needs no
#                         insecure-registries entry on the pushing engine
#   --start-registry      start `docker-registry` on --push-registry if none answers (storage
#                         $LARQL_REGISTRY_DIR, default ~/.cache/larql-edge/registry)
#   --no-push             the images are already on every node (docker load): deploy plain
#                         larql-<role>:AS names
#   --tag TAG             tag of the local images (default latest)                 [LARQL_IMAGE_TAG]
#   --as TAG              tag to push and deploy (default: --tag)                  [LARQL_TAG]
#   --roles "R ..."       images to push (default: router embed ffn serve edge prometheus; a
#                         missing larql-serve is skipped with a warning and scaled to 0)
#   --tls DIR             TLS on every hop (larql-grid.tls.yaml merged over the stack): DIR is  [LARQL_TLS_DIR]
#                         what `larql-grid certs` makes, ca.crt and {router,embed,ffn,serve,edge,
#                         prometheus}/{tls.crt,tls.key}, each certificate covering its service's
#                         name and `larql-grid` (the command is in larql-grid.tls.yaml); the files
#                         become Swarm secrets named by content, so renewed files roll out
#   -c FILE               an extra compose file merged over the stack (repeatable)
#   --wait SECONDS        wait this long for convergence (default 600; 0: do not wait)
#   --dry-run             print what would be done, change nothing
#   -h, --help
#
# Every other LARQL_* variable the stack file reads (replicas, ports, monitor times) passes through.
set -Eeuo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
STACK=${LARQL_STACK:-larql}
MANAGER=${LARQL_SWARM_MANAGER:-}
SOURCE=${LARQL_SWARM_SOURCE:-}
REGISTRY=${LARQL_REGISTRY:-127.0.0.1:5000}
PUSH_REGISTRY=${LARQL_PUSH_REGISTRY:-}
START_REGISTRY=0
PUSH=1
TAG=${LARQL_IMAGE_TAG:-latest}
AS=${LARQL_TAG:-}
ROLES="router embed ffn serve edge prometheus"
EXTRA=()
WAIT=600
DRY=0
SECRET=${LARQL_GRID_KEY_SECRET:-larql_grid_key}
TLS_DIR=${LARQL_TLS_DIR:-}
TLS_SERVICES="router embed ffn serve edge prometheus"

T0=$(date +%s)
log() { printf '[deploy %4ss] %s\n' "$(( $(date +%s) - T0 ))" "$*" >&2; }
die() { printf 'deploy.sh: error: %s\n' "$*" >&2; exit 1; }
usage() { sed -n '2,/^set -Eeuo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --stack) STACK=${2:?--stack needs a value}; shift 2 ;;
    --manager) MANAGER=${2:?--manager needs a value}; shift 2 ;;
    --source) SOURCE=${2:?--source needs a value}; shift 2 ;;
    --registry) REGISTRY=${2:?--registry needs a value}; shift 2 ;;
    --push-registry) PUSH_REGISTRY=${2:?--push-registry needs a value}; shift 2 ;;
    --start-registry) START_REGISTRY=1; shift ;;
    --no-push) PUSH=0; shift ;;
    --tag) TAG=${2:?--tag needs a value}; shift 2 ;;
    --as) AS=${2:?--as needs a value}; shift 2 ;;
    --roles) ROLES=${2:?--roles needs a value}; shift 2 ;;
    --tls) TLS_DIR=${2:?--tls needs a folder}; shift 2 ;;
    -c) [[ -f ${2:-} ]] || die "-c: no such file: ${2:-}"; EXTRA+=(-c "$2"); shift 2 ;;
    --wait) WAIT=${2:?--wait needs a value}; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument: $1 (see --help)" ;;
  esac
done
AS=${AS:-$TAG}
PUSH_REGISTRY=${PUSH_REGISTRY:-$REGISTRY}
[[ $WAIT =~ ^[0-9]+$ ]] || die "--wait must be a number of seconds"
[[ $STACK =~ ^[a-zA-Z0-9][a-zA-Z0-9_.-]*$ ]] || die "--stack: not a valid stack name: $STACK"
for r in $ROLES; do
  [[ " router embed ffn serve edge prometheus " == *" $r "* ]] || die "--roles: unknown role '$r'"
done

dm() { docker ${MANAGER:+-H "$MANAGER"} "$@"; }   # the swarm manager
ds() { docker ${SOURCE:+-H "$SOURCE"} "$@"; }     # the engine holding the images
run() { if [[ $DRY == 1 ]]; then echo "+ $*" >&2; else "$@"; fi; }

command -v docker >/dev/null || die "docker CLI not found"
state=$(dm info --format '{{.Swarm.LocalNodeState}} {{.Swarm.ControlAvailable}}' 2>/dev/null) \
  || die "no Docker engine at ${MANAGER:-the default engine} (docker info failed)"
[[ $state == "active true" ]] || die "${MANAGER:-this engine} is not a swarm manager (state: $state); run \`docker swarm init\` or point --manager at a manager"
log "swarm manager: ${MANAGER:-default engine} ($(dm info --format '{{.Swarm.Nodes}}') nodes)"

# ---- 1. images ----------------------------------------------------------------------------------
PRESENT=()
for r in $ROLES; do
  if ds image inspect "larql-$r:$TAG" >/dev/null 2>&1; then
    PRESENT+=("$r")
  elif [[ $r == serve ]]; then
    log "warning: no larql-serve:$TAG on ${SOURCE:-this engine}: the serve service is scaled to 0"
    export LARQL_SERVE_REPLICAS=0
  elif [[ $PUSH == 1 ]]; then
    die "larql-$r:$TAG is not on ${SOURCE:-this engine} (docker/build-images.sh builds it)"
  fi
done

registry_up() { curl -fsS -o /dev/null --max-time 3 "http://$1/v2/" 2>/dev/null; }
if [[ $PUSH == 1 ]]; then
  if ! registry_up "$PUSH_REGISTRY"; then
    [[ $START_REGISTRY == 1 ]] || die "no registry answers at http://$PUSH_REGISTRY/v2/ (--start-registry starts one)"
    command -v docker-registry >/dev/null || die "--start-registry needs docker-registry (apt-get install docker-registry)"
    dir=${LARQL_REGISTRY_DIR:-$HOME/.cache/larql-edge/registry}
    run mkdir -p "$dir"
    cfg="$dir/config-${PUSH_REGISTRY//[:\/]/-}.yml"
    if [[ $DRY == 0 ]]; then
      printf 'version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: %s\n  delete:\n    enabled: true\nhttp:\n  addr: %s\n' \
        "$dir/data" "$PUSH_REGISTRY" >"$cfg"
      nohup docker-registry serve "$cfg" >"$dir/registry.log" 2>&1 &
      echo $! >"$dir/registry.pid"
      for _ in $(seq 1 50); do registry_up "$PUSH_REGISTRY" && break; sleep 0.2; done
      registry_up "$PUSH_REGISTRY" || die "docker-registry did not start on $PUSH_REGISTRY (see $dir/registry.log)"
      log "started docker-registry on $PUSH_REGISTRY (pid $(cat "$dir/registry.pid"), storage $dir/data)"
    else
      echo "+ docker-registry serve $cfg &" >&2
    fi
  fi
  for r in "${PRESENT[@]}"; do
    ref="$PUSH_REGISTRY/larql-$r:$AS"
    t=$(date +%s)
    run ds tag "larql-$r:$TAG" "$ref"
    # only our extra tag goes again, whatever happens; the image itself stays
    if ! run ds push -q "$ref" >/dev/null; then run ds rmi "$ref" >/dev/null 2>&1 || true; die "push of $ref failed"; fi
    run ds rmi "$ref" >/dev/null 2>&1 || true
    log "pushed larql-$r:$TAG as $ref ($(( $(date +%s) - t ))s)"
  done
  export LARQL_IMAGE_PREFIX="$REGISTRY/"
else
  export LARQL_IMAGE_PREFIX=""
  log "--no-push: deploying larql-<role>:$AS, which every node must already have"
fi
export LARQL_TAG=$AS

# ---- 2. the grid key ----------------------------------------------------------------------------
if dm secret inspect "$SECRET" >/dev/null 2>&1; then
  log "secret $SECRET exists: kept"
else
  if [[ -n ${LARQL_GRID_KEY_FILE:-} ]]; then
    [[ -s $LARQL_GRID_KEY_FILE ]] || die "LARQL_GRID_KEY_FILE=$LARQL_GRID_KEY_FILE: no such file, or empty"
    src="the file \$LARQL_GRID_KEY_FILE"
    key_cmd() { cat "$LARQL_GRID_KEY_FILE"; }
  elif [[ -n ${LARQL_GRID_KEY:-} ]]; then
    src="\$LARQL_GRID_KEY"
    key_cmd() { printf '%s' "$LARQL_GRID_KEY"; }
  else
    src="a new random key (read it back only from inside a task: it is never printed)"
    key_cmd() { od -An -N32 -tx1 /dev/urandom | tr -d ' \n'; }
  fi
  # The key goes through a pipe: never argv, never a log line.
  if [[ $DRY == 1 ]]; then echo "+ docker secret create $SECRET - < ($src)" >&2
  else key_cmd | dm secret create --label org.larql-edge=grid-key "$SECRET" - >/dev/null; fi
  log "secret $SECRET created from $src"
fi
export LARQL_GRID_KEY_SECRET=$SECRET
unset LARQL_GRID_KEY  # the stack never needs the key itself

# ---- 3. TLS (--tls): the certificates as secrets, named by content -------------------------------
PROM_CONFIG="$HERE/prometheus.yml"
if [[ -n $TLS_DIR ]]; then
  [[ -d $TLS_DIR ]] || die "--tls $TLS_DIR: no such folder (make it with larql-grid certs: see larql-grid.tls.yaml)"
  TLS_DIR=$(cd "$TLS_DIR" && pwd)
  for f in ca.crt $(for s in $TLS_SERVICES; do echo "$s/tls.crt $s/tls.key"; done); do
    [[ -s $TLS_DIR/$f ]] || die "--tls $TLS_DIR: $f is missing or empty (larql-grid certs makes it: see larql-grid.tls.yaml)"
  done
  h() { sha256sum "$1" | cut -c1-12; }
  export LARQL_TLS_DIR=$TLS_DIR
  export LARQL_TLS_CA_NAME="${STACK}_tls_ca_$(h "$TLS_DIR/ca.crt")"
  for s in $TLS_SERVICES; do
    up=$(tr '[:lower:]' '[:upper:]' <<<"$s")
    # both named by the certificate's hash: a key is only ever renewed with its certificate, and
    # no digest of key material ends up in a name
    sum=$(h "$TLS_DIR/$s/tls.crt")
    export "LARQL_TLS_${up}_CRT_NAME=${STACK}_tls_${s}_crt_$sum" "LARQL_TLS_${up}_KEY_NAME=${STACK}_tls_${s}_key_$sum"
  done
  EXTRA=(-c "$HERE/larql-grid.tls.yaml" "${EXTRA[@]}")
  PROM_CONFIG="$HERE/prometheus-tls.yml"
  log "TLS: certificates from $TLS_DIR (CA $(h "$TLS_DIR/ca.crt")); every hop https, mutual TLS on router, embed, ffn"
fi

# ---- 4. deploy ----------------------------------------------------------------------------------
# Swarm configs are immutable: name the Prometheus config by its content, so an edit deploys.
sum=$(sha256sum "$PROM_CONFIG" | cut -c1-12)
export LARQL_PROMETHEUS_CONFIG="${STACK}_prometheus_$sum"
DEPLOYED_AT=$(date +%s)
run dm stack deploy --resolve-image never --detach=true -c "$HERE/larql-grid.yaml" "${EXTRA[@]}" "$STACK" >&2
log "stack $STACK deployed (images ${LARQL_IMAGE_PREFIX}larql-<role>:$LARQL_TAG)"
[[ $DRY == 0 && $WAIT -gt 0 ]] || exit 0

# Converged: every service has its replicas running (healthy) AND no update is under way. A changed
# service (a new image, a renewed certificate) is updated start-first: its old task keeps running, so
# the replica count alone reads n/n before the new task has even started. An update this run started
# that ended rolled back or paused is a failed deploy (an older one, e.g. a past rollback, is not).
update_states() {
  local names
  names=$(dm stack services "$STACK" --format '{{.Name}}')
  [[ -n $names ]] || return 0
  # shellcheck disable=SC2086
  dm service inspect --format '{{.Spec.Name}} {{with .UpdateStatus}}{{.State}} {{with .StartedAt}}{{.Unix}}{{end}}{{end}}' $names
}
deadline=$(( $(date +%s) + WAIT ))
while :; do
  pending=$(dm stack services "$STACK" --format '{{.Name}} {{.Replicas}}' | awk '{split($2, r, "/"); sub(/ .*/, "", r[2]); if (r[1] != r[2]) print $1 " " $2}')
  while read -r name state started; do
    case $state in
      updating|rollback_started) pending+="${pending:+$'\n'}$name $state" ;;
      rollback_completed|rollback_paused|paused)
        if [[ ${started:-0} -ge $DEPLOYED_AT ]]; then
          log "the update of $name failed: $state"
          dm service inspect --format '  {{with .UpdateStatus}}{{.Message}}{{end}}' "$name" >&2
          dm service ps --no-trunc --format '  {{.Name}} {{.Node}} {{.CurrentState}} {{.Error}}' "$name" | head -n 6 >&2
          exit 1
        fi ;;
    esac
  done < <(update_states)
  [[ -z $pending ]] && break
  if (( $(date +%s) > deadline )); then
    log "not converged after ${WAIT}s:"; echo "$pending" >&2
    for s in $(awk '{print $1}' <<<"$pending"); do dm service ps --no-trunc --format '  {{.Name}} {{.Node}} {{.CurrentState}} {{.Error}}' "$s" | head -n 4 >&2; done
    exit 1
  fi
  sleep 2
done
log "converged:"
dm stack services "$STACK" --format '  {{.Name}} {{.Replicas}} {{.Image}} {{.Ports}}' >&2
