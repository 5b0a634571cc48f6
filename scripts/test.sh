#!/usr/bin/env bash
# Sets up .venv if needed, then lints (ruff), type-checks src/ and tools/hostnet (mypy), checks
# the import contracts (import-linter), builds the docs site with warnings as errors (mkdocs
# --strict, into site/) and runs the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
.venv/bin/lint-imports --no-cache  # pyproject's [tool.importlinter]: layers, and no import cycles
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet  # mkdocs.yml: broken links and anchors are errors
exec .venv/bin/python -m pytest "$@"
