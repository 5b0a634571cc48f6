#!/usr/bin/env bash
# Records how long the README's two commands take from nothing, on this machine, at this commit:
# a fresh clone of HEAD each time (no .venv), then
#   demo: bash scripts/setup.sh --demo (timed), the .venv's size, bash scripts/demo.sh (timed: set-up
#         does nothing then, so this is the demo's run);
#   dev:  bash scripts/setup.sh (the development set, timed), the .venv's size;
#   with --suite also bash scripts/test.sh (timed; and the tests alone, from pytest's own last line).
# Writes benchmarks/results/setup_times.json and .md (the README quotes them, tests/test_doc_numbers.py
# checks each quoted number against its cell). Takes about 4 minutes on 2 cores without --suite.
#   bash scripts/record_times.sh [--suite]
set -euo pipefail
cd "$(dirname "$0")/.."
suite=no
case "${1:-}" in
  "") ;;
  --suite) suite=yes ;;
  *) echo "record_times.sh: unknown argument '$1'; use --suite or nothing" >&2; exit 2 ;;
esac
if [ -n "$(git status --porcelain -- src scripts pyproject.toml)" ]; then
  echo "record_times.sh: src/, scripts/ or pyproject.toml has uncommitted changes; commit first (a clone of HEAD is timed)" >&2
  exit 2
fi
scratch=$(mktemp -d "${TMPDIR:-/tmp}/record-times.XXXXXX")
trap 'rm -rf "$scratch"' EXIT
seconds() { python3 -c 'import sys, time; print(round(time.time() - float(sys.argv[1]), 1))' "$1"; }
gigabytes() { du -sb "$1" | python3 -c 'import sys; print(round(int(sys.stdin.read().split()[0]) / 1e9, 2))'; }
load() { cut -d' ' -f1-3 /proc/loadavg | tr ' ' ','; }
load_start=$(load)
git clone -q --no-hardlinks . "$scratch/demo"
git clone -q --no-hardlinks . "$scratch/dev"
start=$(date +%s.%N); (cd "$scratch/demo" && bash scripts/setup.sh --demo >"$scratch/demo-setup.log" 2>&1)
demo_setup_s=$(seconds "$start"); demo_venv_gb=$(gigabytes "$scratch/demo/.venv")
start=$(date +%s.%N); (cd "$scratch/demo" && bash scripts/demo.sh >"$scratch/demo-run.log" 2>&1)
demo_run_s=$(seconds "$start")
start=$(date +%s.%N); (cd "$scratch/dev" && bash scripts/setup.sh >"$scratch/dev-setup.log" 2>&1)
dev_setup_s=$(seconds "$start"); dev_venv_gb=$(gigabytes "$scratch/dev/.venv")
suite_s=null tests_s=null
if [ "$suite" = yes ]; then
  start=$(date +%s.%N); (cd "$scratch/dev" && bash scripts/test.sh -q >"$scratch/suite.log" 2>&1) || true
  suite_s=$(seconds "$start")
  tests_s=$(grep -oE 'in [0-9.]+s' "$scratch/suite.log" | tail -1 | grep -oE '[0-9.]+' || echo null)
fi
python3 - "$(git rev-parse HEAD)" "$load_start" "$(load)" "$(nproc)" "$demo_setup_s" "$demo_venv_gb" \
  "$demo_run_s" "$dev_setup_s" "$dev_venv_gb" "$suite_s" "$tests_s" <<'PY'
import json, platform, sys, time
head, load_start, load_end, cpus, *values = sys.argv[1:]
number = lambda text: None if text == "null" else float(text)
demo_setup, demo_gb, demo_run, dev_setup, dev_gb, suite, tests = map(number, values)
report = {
    "env": {
        "git": {"head": head, "src_status": ""},
        "recorded": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpus": int(cpus),
        "python": platform.python_version(),
        "loadavg_start": [float(x) for x in load_start.split(",")],
        "loadavg_end": [float(x) for x in load_end.split(",")],
        "how": "bash scripts/record_times.sh: fresh clones of HEAD, no .venv, this machine's pip sources",
    },
    "demo": {"setup_s": demo_setup, "venv_gb": demo_gb, "run_s": demo_run},
    "dev": {"setup_s": dev_setup, "venv_gb": dev_gb},
    "suite": {"test_sh_s": suite, "tests_s": tests},
}
with open("benchmarks/results/setup_times.json", "w") as out:
    json.dump(report, out, indent=2)
    out.write("\n")
env = report["env"]
lines = [
    f"_At {head[:12]}, {env['recorded']}, {cpus} CPUs, Python {env['python']}, load average (1/5/15 min)"
    f" {'/'.join(map(str, env['loadavg_start']))} at start, {'/'.join(map(str, env['loadavg_end']))} at end;"
    " fresh clones of HEAD, set up from nothing (`bash scripts/record_times.sh`)._",
    "",
    "| command | set-up s | .venv GB | run s |",
    "|---|---|---|---|",
    f"| `bash scripts/demo.sh` | {demo_setup} | {demo_gb} | {demo_run} |",
    f"| `bash scripts/test.sh` | {dev_setup} | {dev_gb} | {'not recorded' if suite is None else suite} |",
    "",
    f"The tests alone (pytest's own count): {'not recorded (run with --suite)' if tests is None else f'{tests} s'}.",
]
with open("benchmarks/results/setup_times.md", "w") as out:
    out.write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
