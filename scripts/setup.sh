#!/usr/bin/env bash
# Creates .venv (if needed) and installs torch 2.13.0 (CPU), the package and
# its test/benchmark extras. Idempotent: a second run installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."
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
