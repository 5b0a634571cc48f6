#!/usr/bin/env bash
# Creates .venv (if needed) and installs torch 2.13.0 (CPU), the package and
# its test/benchmark extras. Idempotent: a second run installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."
# The multi-host tests (tests/test_multinode.py) need `ip` and `tc`: install
# iproute2 where they are missing and we can (root, apt-get); elsewhere those
# tests skip, saying why.
PATH="$PATH:/usr/sbin:/sbin"
if { ! command -v ip || ! command -v tc; } >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  { apt-get install -y -qq iproute2 || { apt-get update -qq && apt-get install -y -qq iproute2; }; } >/dev/null 2>&1 \
    || echo "setup.sh: could not install iproute2; tests/test_multinode.py will skip" >&2
fi
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.torchreplicate-installed
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
  # torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
  .venv/bin/python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[test,bench]"
  echo "$want" > "$stamp"
fi
