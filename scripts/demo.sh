#!/usr/bin/env bash
# Sets up .venv with only what the demo needs (scripts/setup.sh --demo: torch, the package,
# matplotlib), then trains a small model on 2 local CPU ranks, in small gradient buckets
# (several per step), tracing every step (the trace and its plot go to $TRACE, printed at
# the end), logging a summary across ranks every 100 steps and checking the replicas.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --demo  # torch, the package, matplotlib: no linters, docs or integrations
TRACE=${TRACE:-${TMPDIR:-/tmp}/torchreplicate-demo/trace.json}
# torch's profiler (kineto) prints "USDT: ... profiler_start" and "profiler_stop" on stderr at each start
# and stop, at a level no setting turns off (checked on torch 2.13): the demo drops those two lines only
exec timeout 600 .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 2 examples/train.py \
  --bucket-cap-mb 0.04 --trace "$TRACE" --summary-every 100 --verify-every 100 "$@" \
  2> >(grep --line-buffered -v -E '^USDT:.*profiler_(start|stop)$' >&2)
