#!/usr/bin/env bash
# Build the larql-edge base image (Debian bookworm + Python 3.11) WITHOUT pulling
# from any container registry: debootstrap a minimal root filesystem from the
# Debian mirror the host's apt already uses, then `docker import` it.
#
#   docker/base/build-base-image.sh [--tag larql-base:bookworm] [--force]
#                                   [--mirror URL] [--security-mirror URL]
#                                   [--extra-packages "pkg1 pkg2"] [--keep-rootfs]
#                                   [--rootfs-cache FILE]
#
# Idempotent: if the tag already exists and --force is not given, it says so and
# exits 0 at once. Needs root (debootstrap, chroot) and a reachable Docker engine.
#
# The image has: python3 (3.11, Debian's) with venv and pip, ca-certificates,
# tini (PID 1: use ENTRYPOINT ["tini", "--"]), curl (for HEALTHCHECK).
# --extra-packages makes the variants docker/build-images.sh uses: nginx (larql-base-nginx),
# prometheus (larql-base-prometheus), varnish (larql-base-varnish; Debian's varnish brings gcc, which
# compiles its VCL at start).
# --rootfs-cache FILE: the root filesystem after debootstrap and apt-get upgrade, before the
# packages, as a tarball: made when FILE is missing, unpacked instead of a new debootstrap when it
# exists. docker/build-images.sh builds its four bases from one debootstrap so.
# No libopenblas/libgomp: the manylinux numpy wheels bundle their own OpenBLAS
# (numpy.libs/), checked with ldd in tests/test_base_image.py.
#
# Environment twins: LARQL_BASE_TAG, LARQL_DEBIAN_MIRROR, LARQL_DEBIAN_SECURITY_MIRROR,
# LARQL_BASE_EXTRA_PACKAGES, LARQL_BASE_WORKDIR (where the rootfs is built; default /var/tmp),
# LARQL_BASE_ROOTFS_CACHE.
set -Eeuo pipefail

SUITE=bookworm
TAG="${LARQL_BASE_TAG:-larql-base:bookworm}"
FORCE=0
KEEP_ROOTFS=0
OLD_ID=
MIRROR="${LARQL_DEBIAN_MIRROR:-}"
SECURITY_MIRROR="${LARQL_DEBIAN_SECURITY_MIRROR:-}"
EXTRA_PACKAGES="${LARQL_BASE_EXTRA_PACKAGES:-}"
ROOTFS_CACHE="${LARQL_BASE_ROOTFS_CACHE:-}"
PACKAGES="python3 python3-venv python3-pip ca-certificates tini curl"

START_TS=$(date +%s)
log()  { printf '[build-base-image %4ss] %s\n' "$(( $(date +%s) - START_TS ))" "$*" >&2; }
die()  { printf '[build-base-image] ERROR: %s\n' "$*" >&2; exit 1; }
usage() { sed -n '2,27p' "$0" | sed 's/^# \{0,1\}//'; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --tag) [[ $# -ge 2 ]] || die "--tag needs a value"; TAG="$2"; shift 2 ;;
    --tag=*) TAG="${1#*=}"; shift ;;
    --force) FORCE=1; shift ;;
    --mirror) [[ $# -ge 2 ]] || die "--mirror needs a value"; MIRROR="$2"; shift 2 ;;
    --mirror=*) MIRROR="${1#*=}"; shift ;;
    --security-mirror) [[ $# -ge 2 ]] || die "--security-mirror needs a value"; SECURITY_MIRROR="$2"; shift 2 ;;
    --security-mirror=*) SECURITY_MIRROR="${1#*=}"; shift ;;
    --extra-packages) [[ $# -ge 2 ]] || die "--extra-packages needs a value"; EXTRA_PACKAGES="$2"; shift 2 ;;
    --extra-packages=*) EXTRA_PACKAGES="${1#*=}"; shift ;;
    --keep-rootfs) KEEP_ROOTFS=1; shift ;;
    --rootfs-cache) [[ $# -ge 2 ]] || die "--rootfs-cache needs a value"; ROOTFS_CACHE="$2"; shift 2 ;;
    --rootfs-cache=*) ROOTFS_CACHE="${1#*=}"; shift ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; die "unknown argument: $1" ;;
  esac
done

trap 'rc=$?; printf "[build-base-image] FAILED (exit %s) at line %s: %s\n" "$rc" "$LINENO" "$BASH_COMMAND" >&2' ERR

command -v docker >/dev/null || die "docker CLI not found"
docker version --format '{{.Server.Version}}' >/dev/null 2>&1 || die "no Docker engine reachable (docker version failed)"

# ---- idempotency: fast exit --------------------------------------------------
if docker image inspect "$TAG" >/dev/null 2>&1; then
  if [[ $FORCE -eq 0 ]]; then
    log "image $TAG already exists ($(docker image inspect -f '{{.Id}}' "$TAG" | cut -c1-19)); nothing to do (use --force to rebuild)"
    exit 0
  fi
  OLD_ID=$(docker image inspect -f '{{.Id}}' "$TAG")
  log "image $TAG exists; --force given, rebuilding"
fi

[[ $(id -u) -eq 0 ]] || die "must run as root (debootstrap and chroot need it)"

# ---- mirrors: the same ones the host's apt uses -------------------------------
# Prints "URI SUITE" pairs from /etc/apt/sources.list (one-line format) and
# /etc/apt/sources.list.d/*.list|*.sources (deb822), the files apt itself reads.
apt_sources() {
  local f
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [[ -f $f ]] || continue
    awk '$1=="deb" { i=2; if ($2 ~ /^\[/) { while ($i !~ /\]$/) i++; i++ } print $i, $(i+1) }' "$f"
  done
  for f in /etc/apt/sources.list.d/*.sources; do
    [[ -f $f ]] || continue
    awk 'BEGIN{RS=""; FS="\n"}
      { types=""; uris=""; suites=""; enabled="yes"
        for (j=1;j<=NF;j++) { line=$j; if (line ~ /^#/) continue
          k=tolower(substr(line,1,index(line,":")-1)); v=substr(line,index(line,":")+1); gsub(/^[ \t]+|[ \t]+$/,"",v)
          if (k=="types") types=v; else if (k=="uris") uris=v; else if (k=="suites") suites=v; else if (k=="enabled") enabled=tolower(v) }
        if (enabled=="no" || types !~ /(^| )deb( |$)/) next
        nu=split(uris,U," "); ns=split(suites,S," ")
        for (a=1;a<=nu;a++) for (b=1;b<=ns;b++) print U[a], S[b] }' "$f"
  done
}
if [[ -z $MIRROR || -z $SECURITY_MIRROR ]]; then
  SOURCES=$(apt_sources || true)
  [[ -n $MIRROR ]] || MIRROR=$(awk -v s="$SUITE" '$2==s {print $1; exit}' <<<"$SOURCES")
  [[ -n $SECURITY_MIRROR ]] || SECURITY_MIRROR=$(awk -v s="$SUITE-security" '$2==s || $2==s"/updates" {print $1; exit}' <<<"$SOURCES")
fi
if [[ -z $MIRROR ]]; then
  MIRROR=http://deb.debian.org/debian
  log "no '$SUITE' entry in the host's apt sources; falling back to $MIRROR"
fi
MIRROR=${MIRROR%/}; SECURITY_MIRROR=${SECURITY_MIRROR%/}
log "tag:             $TAG"
log "mirror:          $MIRROR ($SUITE, $SUITE-updates)"
log "security mirror: ${SECURITY_MIRROR:-<none: security updates not applied>}"

# The host's apt may be set not to check Release dates (snapshot mirrors); do the same.
APT_OPTS=(-o Acquire::Check-Valid-Until=false -o Acquire::Retries=3 -o APT::Install-Recommends=false -o Dpkg::Use-Pty=0)

# ---- debootstrap --------------------------------------------------------------
if ! command -v debootstrap >/dev/null; then
  log "installing debootstrap (apt-get)"
  apt-get "${APT_OPTS[@]}" update -qq || die "apt-get update failed"
  DEBIAN_FRONTEND=noninteractive apt-get "${APT_OPTS[@]}" install -y -qq debootstrap debian-archive-keyring >/dev/null \
    || die "apt-get install debootstrap failed"
fi
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
if [[ ! -f $KEYRING ]]; then
  log "installing debian-archive-keyring"
  apt-get "${APT_OPTS[@]}" update -qq && DEBIAN_FRONTEND=noninteractive apt-get "${APT_OPTS[@]}" install -y -qq debian-archive-keyring >/dev/null \
    || die "cannot install debian-archive-keyring"
fi

WORKDIR=$(mktemp -d "${LARQL_BASE_WORKDIR:-/var/tmp}/larql-base.XXXXXX")
ROOTFS="$WORKDIR/rootfs"

umount_under() {  # unmount everything mounted below $1, deepest first
  local m
  for m in $(awk -v r="$1" '$2 == r || index($2, r"/") == 1 {print $2}' /proc/mounts | sort -r); do
    umount -l "$m" 2>/dev/null || true
  done
}
cleanup() {
  local rc=$?
  umount_under "$ROOTFS"
  if [[ $rc -ne 0 ]] && compgen -G "$WORKDIR/*.log" >/dev/null; then
    mkdir -p "$WORKDIR-logs" && cp "$WORKDIR"/*.log "$WORKDIR-logs/" 2>/dev/null || true
    [[ -f $ROOTFS/debootstrap/debootstrap.log ]] && cp "$ROOTFS/debootstrap/debootstrap.log" "$WORKDIR-logs/rootfs-debootstrap.log"
    printf '[build-base-image] full logs kept in %s\n' "$WORKDIR-logs" >&2
  fi
  if [[ $KEEP_ROOTFS -eq 1 ]]; then log "rootfs kept at $ROOTFS"; return; fi
  if awk -v r="$ROOTFS" 'index($2, r"/") == 1 || $2 == r {found=1} END {exit !found}' /proc/mounts; then
    printf '[build-base-image] WARNING: mounts remain under %s; not deleting it\n' "$ROOTFS" >&2
    return
  fi
  rm -rf --one-file-system "$WORKDIR"
}
trap cleanup EXIT

in_chroot() { LC_ALL=C.UTF-8 LANG=C.UTF-8 DEBIAN_FRONTEND=noninteractive PATH=/usr/sbin:/usr/bin:/sbin:/bin chroot "$ROOTFS" "$@"; }
TAR_OPTS=(--numeric-owner --xattrs --xattrs-include='*')

# (the body is not indented: its here-documents end at column 0)
new_rootfs() {  # debootstrap, apt sources and settings, apt-get update + upgrade
log "debootstrap --variant=minbase $SUITE into $ROOTFS (this is the slow step)"
# Only a minimal set here; the rest goes through apt in the chroot, whose resolver
# handles dependencies (and --no-install-recommends) properly and sees security updates.
if ! debootstrap --variant=minbase --keyring="$KEYRING" --include=ca-certificates \
      "$SUITE" "$ROOTFS" "$MIRROR" >"$WORKDIR/debootstrap.log" 2>&1; then
  tail -n 30 "$WORKDIR/debootstrap.log" >&2
  [[ -f $ROOTFS/debootstrap/debootstrap.log ]] && tail -n 30 "$ROOTFS/debootstrap/debootstrap.log" >&2
  die "debootstrap failed"
fi
log "debootstrap done ($(du -sh --one-file-system "$ROOTFS" | cut -f1))"

# ---- configure the rootfs ---------------------------------------------------
{
  echo "Types: deb"
  echo "URIs: $MIRROR"
  echo "Suites: $SUITE $SUITE-updates"
  echo "Components: main"
  echo "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg"
  if [[ -n $SECURITY_MIRROR ]]; then
    echo
    echo "Types: deb"
    echo "URIs: $SECURITY_MIRROR"
    echo "Suites: $SUITE-security"
    echo "Components: main"
    echo "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg"
  fi
} >"$ROOTFS/etc/apt/sources.list.d/debian.sources"
: >"$ROOTFS/etc/apt/sources.list"

# Slim, container-style dpkg/apt settings (as Debian's official images do).
cat >"$ROOTFS/etc/dpkg/dpkg.cfg.d/docker-slim" <<'CFG'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/groff/*
path-exclude /usr/share/linda/*
path-exclude /usr/share/lintian/*
path-exclude /usr/share/locale/*
CFG
cat >"$ROOTFS/etc/apt/apt.conf.d/docker-clean" <<'CFG'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
CFG
cat >"$ROOTFS/etc/apt/apt.conf.d/docker-no-recommends" <<'CFG'
APT::Install-Recommends "false";
APT::Install-Suggests "false";
CFG
printf '#!/bin/sh\nexit 101\n' >"$ROOTFS/usr/sbin/policy-rc.d"; chmod 755 "$ROOTFS/usr/sbin/policy-rc.d"
cp /etc/resolv.conf "$ROOTFS/etc/resolv.conf"   # for apt in the chroot; emptied before import

mount -t proc proc "$ROOTFS/proc"

log "apt-get update + upgrade ($SUITE-updates${SECURITY_MIRROR:+, $SUITE-security})"
in_chroot apt-get "${APT_OPTS[@]}" update -qq || die "apt-get update in the rootfs failed"
in_chroot apt-get "${APT_OPTS[@]}" -y -qq upgrade >"$WORKDIR/apt-upgrade.log" 2>&1 \
  || { tail -n 30 "$WORKDIR/apt-upgrade.log" >&2; die "apt-get upgrade in the rootfs failed"; }
}

if [[ -n $ROOTFS_CACHE && -s $ROOTFS_CACHE ]]; then
  log "rootfs from $ROOTFS_CACHE (debootstrap + upgrade of an earlier build; no new debootstrap)"
  mkdir -p "$ROOTFS"
  tar "${TAR_OPTS[@]}" -C "$ROOTFS" -xf "$ROOTFS_CACHE" || die "cannot unpack $ROOTFS_CACHE"
  cp /etc/resolv.conf "$ROOTFS/etc/resolv.conf"
  mount -t proc proc "$ROOTFS/proc"
else
  new_rootfs
  if [[ -n $ROOTFS_CACHE ]]; then
    # written under another name and renamed: a build beside this one sees a whole file or none
    umount_under "$ROOTFS"
    tar "${TAR_OPTS[@]}" -C "$ROOTFS" -cf "$ROOTFS_CACHE.$$" . && mv -f "$ROOTFS_CACHE.$$" "$ROOTFS_CACHE" \
      || { rm -f "$ROOTFS_CACHE.$$"; die "cannot write the rootfs cache $ROOTFS_CACHE"; }
    log "rootfs cached in $ROOTFS_CACHE ($(du -h "$ROOTFS_CACHE" | cut -f1))"
    mount -t proc proc "$ROOTFS/proc"
  fi
fi

log "apt-get install --no-install-recommends $PACKAGES $EXTRA_PACKAGES"
# shellcheck disable=SC2086
in_chroot apt-get "${APT_OPTS[@]}" -y -qq install $PACKAGES $EXTRA_PACKAGES >"$WORKDIR/apt-install.log" 2>&1 \
  || { tail -n 30 "$WORKDIR/apt-install.log" >&2; die "apt-get install in the rootfs failed"; }

PYVER=$(in_chroot python3 -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])') || die "python3 does not run in the rootfs"
in_chroot python3 -c 'import sys, venv, ensurepip; assert sys.version_info[:2] == (3, 11), sys.version' \
  || die "expected Python 3.11 with venv/ensurepip in the rootfs, got $PYVER"
in_chroot sh -c 'command -v tini && command -v curl' >/dev/null || die "tini or curl missing from the rootfs"
log "python $PYVER, tini, curl present"

# ---- clean ----------------------------------------------------------------------
log "cleaning apt caches, docs, logs"
in_chroot apt-get "${APT_OPTS[@]}" clean
umount_under "$ROOTFS"
rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/* "$ROOTFS"/var/cache/debconf/*-old \
       "$ROOTFS"/var/log/apt/* "$ROOTFS"/var/log/dpkg.log "$ROOTFS"/var/log/alternatives.log \
       "$ROOTFS"/var/log/bootstrap.log "$ROOTFS"/var/lib/dpkg/*-old "$ROOTFS"/tmp/* "$ROOTFS"/var/tmp/* \
       "$ROOTFS"/root/.cache "$ROOTFS"/debootstrap
find "$ROOTFS/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete 2>/dev/null || true
find "$ROOTFS/usr/share/doc" -mindepth 1 -type d -empty -delete 2>/dev/null || true
rm -rf "$ROOTFS"/usr/share/man/* "$ROOTFS"/usr/share/info/* "$ROOTFS"/usr/share/locale/*
: >"$ROOTFS/etc/resolv.conf"; : >"$ROOTFS/etc/hostname"; : >"$ROOTFS/etc/machine-id" 2>/dev/null || true
# docker mounts its own /dev; leave an empty one
if awk -v r="$ROOTFS" 'index($2, r"/") == 1 {found=1} END {exit !found}' /proc/mounts; then
  die "mounts remain under $ROOTFS after cleanup"
fi
find "$ROOTFS/dev" -mindepth 1 -delete
log "rootfs ready ($(du -sh --one-file-system "$ROOTFS" | cut -f1))"

# ---- import -------------------------------------------------------------------
log "docker import -> $TAG"
CREATED=$(date -u +%Y-%m-%dT%H:%M:%SZ)
IMAGE_ID=$(tar "${TAR_OPTS[@]}" -C "$ROOTFS" -cf - . | docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'ENV LC_ALL=C.UTF-8' \
  --change 'ENV PYTHONUNBUFFERED=1' \
  --change 'ENV PIP_DISABLE_PIP_VERSION_CHECK=1' \
  --change 'WORKDIR /' \
  --change "LABEL org.opencontainers.image.title=larql-base org.opencontainers.image.base.name=debian:$SUITE org.opencontainers.image.created=$CREATED larql.base.python=$PYVER larql.base.mirror=$MIRROR" \
  --change 'CMD ["python3"]' \
  --message "larql-edge base: debootstrap $SUITE minbase + $PACKAGES $EXTRA_PACKAGES" \
  - "$TAG") || die "docker import failed"
log "imported $TAG ($IMAGE_ID, $(docker image inspect -f '{{.Size}}' "$TAG" | awk '{printf "%.0f MB", $1/1e6}'))"

docker run --rm "$TAG" python3 -c 'import sys; print("smoke test: python", sys.version.split()[0])' >&2 \
  || die "smoke test of $TAG failed (docker run)"
if [[ -n ${OLD_ID:-} && $OLD_ID != "$IMAGE_ID" ]]; then
  # the replaced image, now untagged; kept (silently) if other tags or child images use it
  docker rmi "$OLD_ID" >/dev/null 2>&1 && log "removed the replaced image ${OLD_ID:7:12}" || true
fi
log "done in $(( $(date +%s) - START_TS ))s"
