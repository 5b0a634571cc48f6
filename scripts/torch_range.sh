#!/usr/bin/env bash
# Runs the core and DDP-comparison subsets (`-m "core or ddp"`, tests/conftest.py's SUBSETS) on each
# torch release given, each in its own cached venv (scripts/torch_env.sh: the development release
# too, without the development extras), and records which tests passed on which release, at which commit, in
# benchmarks/results/torch_range.json and .md. tests/test_torch_range.py fails once
# src/torchreplicate/torch_internals.py differs from what the recorded runs tested.
#   bash scripts/torch_range.sh 2.9.1 2.11.0:python3.12 2.13.0 2.14.1   (VERSION[:PYTHON] each)
# About 5 minutes a release on 2 cores, plus a first download of a CUDA torch (several GB).
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -gt 0 ] || { echo "torch_range.sh: give torch versions, e.g. 2.9.1 2.11.0:python3.12" >&2; exit 2; }
out=benchmarks/results/torch_range.json
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
status=0
for spec in "$@"; do
  version=${spec%%:*}
  python=python3
  [ "$spec" = "$version" ] || python=${spec#*:}
  echo "== torch $version ($python)" >&2
  env=$(bash scripts/torch_env.sh "$version" "$python")  # 2.13.0 too: the package as a user installs it
  runner=("$env/bin/python" -m pytest -p no:cacheprovider)
  "${runner[@]}" -q -m "core or ddp" --junitxml="$tmp/$version.xml" || status=1
  "${runner[0]}" scripts/range_record.py "$out" "$tmp/$version.xml" "$python"
done
exit $status
