#!/usr/bin/env bash
# Make `docker compose` work on this machine (CI runs this before the container tests).
#
#   docker/install-compose.sh [--check]
#
# 1. `docker compose` already works (Compose v2 plugin): nothing to do.
# 2. apt offers Compose v2 (docker-compose-plugin from Docker's repository, docker-compose-v2 on
#    Ubuntu, docker-compose >= 2 on Debian 13): install it.
# 3. Otherwise (Debian 12: only Compose v1, package docker-compose 1.29): install v1 and a CLI
#    plugin shim, /usr/local/lib/docker/cli-plugins/docker-compose, so `docker compose ARGS` runs
#    `docker-compose ARGS`. compose.yaml is written for both (no top-level `name`, no `up --wait`).
# --check only reports which of these holds (exit 1 when `docker compose` does not work).
# Idempotent; needs root for the installs. Debian packages only (no download from anywhere else).
set -Eeuo pipefail
log() { printf '[install-compose] %s\n' "$*" >&2; }
die() { printf '[install-compose] ERROR: %s\n' "$*" >&2; exit 1; }

SHIM_DIR=/usr/local/lib/docker/cli-plugins
SHIM=$SHIM_DIR/docker-compose

works() { docker compose version >/dev/null 2>&1; }
if works; then
  log "docker compose works: $(docker compose version 2>/dev/null | head -n1)"
  exit 0
fi
[[ ${1:-} == --check ]] && { log "docker compose does not work here"; exit 1; }
command -v docker >/dev/null || die "docker CLI not found"
[[ $(id -u) -eq 0 ]] || die "must run as root (apt-get install)"

APT=(-o Acquire::Retries=3 -o Dpkg::Use-Pty=0)
candidate() { apt-cache policy "$1" 2>/dev/null | awk '/Candidate:/ {print $2}'; }
[[ -n $(candidate docker-compose) ]] || apt-get "${APT[@]}" update -qq || die "apt-get update failed"

for pkg in docker-compose-plugin docker-compose-v2; do
  c=$(candidate "$pkg")
  if [[ -n $c && $c != "(none)" ]]; then
    log "installing $pkg $c (Compose v2)"
    DEBIAN_FRONTEND=noninteractive apt-get "${APT[@]}" install -y -qq "$pkg" >/dev/null && works && exit 0
  fi
done
c=$(candidate docker-compose)
[[ -n $c && $c != "(none)" ]] || die "apt has no Compose package (docker-compose, docker-compose-v2, docker-compose-plugin)"
if ! command -v docker-compose >/dev/null; then
  log "installing docker-compose $c"
  DEBIAN_FRONTEND=noninteractive apt-get "${APT[@]}" install -y -qq docker-compose >/dev/null || die "apt-get install docker-compose failed"
fi
V=$(docker-compose version --short 2>/dev/null || true)
if [[ $V == 2.* ]]; then  # Debian 13's docker-compose is v2: expose it as the plugin
  mkdir -p "$SHIM_DIR" && ln -sf "$(command -v docker-compose)" "$SHIM"
else
  log "only Compose v1 ($V) is installable here: installing the \`docker compose\` shim $SHIM"
  mkdir -p "$SHIM_DIR"
  cat >"$SHIM.tmp" <<'SH'
#!/bin/sh
# `docker compose` -> Compose v1 (`docker-compose`), installed by larql-edge's docker/install-compose.sh
# because this machine's package manager only offers Compose v1. The docker CLI runs a plugin as
# `PLUGIN compose ARGS...` and asks it for metadata first.
if [ "${1:-}" = docker-cli-plugin-metadata ]; then
    v=$(docker-compose version --short 2>/dev/null || echo 1)
    printf '{"SchemaVersion":"0.1.0","Vendor":"larql-edge (shim)","Version":"%s","ShortDescription":"Docker Compose v1 (docker-compose) through a shim"}\n' "$v"
    exit 0
fi
[ "${1:-}" = compose ] && shift
exec docker-compose "$@"
SH
  chmod 755 "$SHIM.tmp" && mv "$SHIM.tmp" "$SHIM"
fi
works || die "docker compose still does not work"
log "docker compose works: $(docker compose version 2>/dev/null | head -n1)"
