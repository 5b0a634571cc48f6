#!/usr/bin/env bash
# The first-GPU check, one command, under 10 minutes: the CUDA-marked tests
# (NCCL at world size 1, 2 gloo ranks sharing the GPU with CUDA tensors,
# each against a one-process reference), the world-size-1 NCCL overhead
# against plain local training and DDP, and a short table. Fails (exit 1),
# never skips, when no CUDA GPU is visible. Needs torch with CUDA, pytest and
# pytest-timeout in $PYTHON (default python3); the library runs from src/.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
exec timeout 560 "${PYTHON:-python3}" scripts/gpu_check.py "$@"
