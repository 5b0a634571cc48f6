#!/usr/bin/env bash
# The first-GPU check, one command, within 300 s (scripts/gpu_check.py says what it checks): a
# preflight, then each check in its own process with its own limit; the error's last line per
# failure; full tracebacks, the log and summary.json in $GPU_CHECK_OUT (default gpu_check_out).
#   bash scripts/gpu_check.sh [--dry-run] [NAME ...]   (--dry-run: no GPU needed; NAME: one check again)
# Fails (exit 1), never skips, when no CUDA GPU is visible. Needs torch with CUDA, pytest and
# pytest-timeout in $PYTHON (default python3); the library runs from src/.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
exec timeout 300 "${PYTHON:-python3}" scripts/gpu_check.py "$@"
