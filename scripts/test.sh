#!/usr/bin/env bash
# Sets up .venv if needed, then lints (ruff), type-checks src/ (mypy) and runs
# the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
exec .venv/bin/python -m pytest "$@"
