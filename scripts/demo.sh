#!/usr/bin/env bash
# Sets up .venv if needed, then trains a small model on 2 local CPU ranks.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m torchreplicate.launcher --nproc-per-node 2 --timeout 600 examples/train.py "$@"
