#!/usr/bin/env bash
# Sets up .venv if needed, then lints (ruff), type-checks src/ and tools/hostnet (mypy), checks
# the import contracts (import-linter), builds the docs site with warnings as errors (mkdocs
# --strict, into site/) and runs the whole test suite. Extra arguments go to pytest.
# TORCH_VERSION=2.14.1 (any release of the range; PYTHON picks the interpreter) runs pytest alone, with
# that torch, in a venv cached outside the checkout (scripts/torch_env.sh); e.g. `-m core`, the core subset.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${TORCH_VERSION:-}" ] && [ "$TORCH_VERSION" != 2.13.0 ]; then
  env=$(bash scripts/torch_env.sh "$TORCH_VERSION" "${PYTHON:-python3}")
  exec "$env/bin/python" -m pytest -p no:cacheprovider "$@"
fi
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
.venv/bin/lint-imports --no-cache  # pyproject's [tool.importlinter]: layers, and no import cycles
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet  # mkdocs.yml: broken links and anchors are errors
exec .venv/bin/python -m pytest "$@"
