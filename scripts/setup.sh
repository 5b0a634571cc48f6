#!/usr/bin/env bash
# Creates .venv (if needed) and installs torch 2.13.0 and the package into it.
#   bash scripts/setup.sh          the development set: the test, bench and docs extras (ruff, mypy,
#                                  lightning, torchft, mkdocs, ...), and as root the Debian packages
#                                  some tests need; what scripts/test.sh (so CI) uses
#   bash scripts/setup.sh --demo   only what scripts/demo.sh needs: torch, the package and matplotlib
#                                  (the trace's picture); no root needed
# torch comes from PyTorch's CPU index where no NVIDIA GPU is seen, else from pip's own sources;
# TORCH_INDEX_URL overrides that (scripts/torch_index.sh says how). PYTHON picks the interpreter
# (default python3; >= 3.10). Idempotent: a second run installs nothing new, and the development set
# includes the demo's; a .venv left without pip by a failed first run is rebuilt.
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
# CI as root, where tests/test_docs_site.py fails without chromium: this script would have installed it):
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
# The interpreter the venv is made from: PYTHON=python3.11 (any >= 3.10) where python3 is older.
PYTHON=${PYTHON:-python3}
new_enough='import sys; sys.exit(sys.version_info < (3, 10))'
venv_works() { .venv/bin/python -c 'import sys, pip; sys.exit(sys.version_info < (3, 10))' >/dev/null 2>&1; }
# A first run that failed (Debian/Ubuntu without python3-venv: `python -m venv` stops at ensurepip)
# leaves a .venv without pip, which later runs would reuse and fail on: rebuild it.
if [ -e .venv ] && ! venv_works; then
  echo "setup.sh: .venv has no working pip or a Python older than 3.10 (a first run that failed?); rebuilding it" >&2
  rm -rf .venv
fi
if [ ! -x .venv/bin/python ]; then
  if ! "$PYTHON" -c "$new_enough" >/dev/null 2>&1; then
    echo "setup.sh: '$PYTHON' is missing or older than Python 3.10; install a newer one and run" \
      "PYTHON=python3.11 bash scripts/$(basename "$0") (any python >= 3.10)" >&2
    exit 1
  fi
  if ! "$PYTHON" -m venv .venv || ! venv_works; then
    rm -rf .venv
    echo "setup.sh: '$PYTHON -m venv' made no venv with pip; on Debian/Ubuntu install the venv module" \
      "(apt-get install python3-venv, or python3.X-venv for PYTHON=python3.X) and run this again" >&2
    exit 1
  fi
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
