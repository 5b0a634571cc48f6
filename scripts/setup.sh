#!/usr/bin/env bash
# Creates .venv (if needed) and installs torch 2.13.0 and the package into it.
#   bash scripts/setup.sh          the development set: the test, bench and docs extras (ruff, mypy,
#                                  lightning, torchft, mkdocs, ...), and as root the Debian packages
#                                  some tests need; what scripts/test.sh (so CI) uses
#   bash scripts/setup.sh --demo   only what scripts/demo.sh needs: torch, the package and matplotlib
#                                  (the trace's picture); no root needed
# torch comes from PyTorch's CPU index where no NVIDIA GPU is seen, else from pip's own sources;
# TORCH_INDEX_URL overrides that (scripts/torch_index.sh says how). Idempotent: a second run installs
# nothing new, and the development set includes the demo's.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/torch_index.sh
case "${1:-dev}" in
  dev | --dev) mode=dev extras="test,bench,docs" ;;
  --demo) mode=demo extras="plot" ;;
  *) echo "setup.sh: unknown argument '$1'; use --demo, or nothing for the development set" >&2; exit 2 ;;
esac
# Debian packages some tests need, installed where they are missing and we
# can (root, apt-get); elsewhere those tests skip, saying why (except under
# CI, where tests/test_docs_site.py fails without chromium):
# - iproute2 (`ip`, `tc`): the multi-host tests (tests/test_multinode.py);
# - chromium: the docs site opened in a headless browser (tests/test_docs_site.py).
PATH="$PATH:/usr/sbin:/sbin"
apt_install() {  # apt_install PACKAGE: install it, updating the package lists once if needed
  export DEBIAN_FRONTEND=noninteractive
  { apt-get install -y -qq "$1" || { apt-get update -qq && apt-get install -y -qq "$1"; }; } >/dev/null 2>&1 \
    || echo "setup.sh: could not install $1; the tests that need it will skip" >&2
}
if [ "$mode" = dev ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  if ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
    apt_install iproute2
  fi
  if ! command -v chromium >/dev/null; then
    apt_install chromium
  fi
fi
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
gpu=no
if nvidia_gpu_present; then gpu=yes; fi
index_args=()
while IFS= read -r arg; do index_args+=("$arg"); done \
  < <(torch_index_args "$gpu" "${TORCH_INDEX_URL+yes}" "${TORCH_INDEX_URL-}")
want="$(cat pyproject.toml scripts/setup.sh scripts/torch_index.sh | sha256sum | cut -c1-16) ${index_args[*]}"
installed() { [ "$(cat ".venv/.torchreplicate-$1" 2>/dev/null || true)" = "$want" ]; }
if ! installed "$mode" && ! installed dev; then
  # torch first and pinned, alone from its index (--no-deps: its dependencies, and everything
  # after, come from pip's own sources, so an index that does not answer costs one lookup);
  # an unpinned torch would pull whatever build the index prefers.
  .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps "${index_args[@]}" "torch==2.13.0"
  .venv/bin/python -m pip install --quiet --disable-pip-version-check "torch==2.13.0" -e ".[$extras]"
  echo "$want" > ".venv/.torchreplicate-$mode"
fi
