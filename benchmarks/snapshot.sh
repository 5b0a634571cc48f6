#!/bin/sh
# Copies the committed tree (git archive HEAD) to DIR (default /tmp/torchreplicate-snap-<sha>)
# and writes the commit to DIR/SNAPSHOT_COMMIT, so a benchmark measures that commit even if
# src/ is edited meanwhile. Prints the PYTHONPATH to use:
#
#   export PYTHONPATH=$(sh benchmarks/snapshot.sh)
#   python benchmarks/ddp_here/bench_ddp.py
set -e
repo=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
sha=$(git -C "$repo" rev-parse HEAD)
dir=${1:-/tmp/torchreplicate-snap-$(echo "$sha" | cut -c1-7)}
mkdir -p "$dir"
git -C "$repo" archive HEAD | tar -x -C "$dir"
echo "$sha" > "$dir/SNAPSHOT_COMMIT"
echo "$dir/src"
