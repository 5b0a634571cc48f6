#!/usr/bin/env bash
# Creates .venv (if needed) and installs torch 2.13.0 (CPU), the package and
# its test/benchmark/docs extras. Idempotent: a second run installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."
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
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
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
stamp=.venv/.torchreplicate-installed
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
  # torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
  .venv/bin/python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[test,bench,docs]"
  echo "$want" > "$stamp"
fi
