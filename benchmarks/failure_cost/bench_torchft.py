"""A replica lost and replaced under torchft: ``replicate_ft`` against torchft's own DDP wrapper.

    python benchmarks/failure_cost/bench_torchft.py [--hidden 256] [--steps 40] [--die-at 10]

The scenario of tests/test_torchft.py (tests/torchft_runs.py: a lighthouse,
three replica groups of one process, one SIGKILLed in step ``--die-at``, a
fresh one healed in from a live peer) with each engine in turn, then the
same model without torchft (``replicate`` and torch's DDP on a gloo group of
three processes). Per engine: steps lost (attempts a survivor did not
commit), time from the kill to the first committed step after it, the
newcomer's heal (its first quorum, checkpoint fetch included) and its start
to first commit, and the median step time before the kill, with torchft and
without. Timings on a shared 2-core machine are indicative; they are never
test assertions. Writes ``results/torchft_recovery.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: benchlib
from benchlib.report import RESULTS_DIR, finish_report, run_env
from local_ranks import free_port

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tests"))
import torchft_runs  # noqa: E402  (tests/: the scenario the test runs, shared)

ENGINES = {"ours": "plain_ours", "torchft_ddp": "plain_ddp"}  # with torchft -> the same without


def summarize_run(run: dict[str, Any], die_at: int) -> dict[str, Any]:
    """The numbers of one scenario run, from what its workers recorded."""
    records = run["records"]
    killed = records["r2"][-1]["killed"]
    survivors = [records[name] for name in ("r0", "r1")]
    lost = max(sum(1 for row in rows if not row["committed"]) for rows in survivors)
    # the first step committed at or after the one the victim died in (a survivor may commit the
    # step before a moment after a victim killed between steps)
    after = [row["end"] for rows in survivors for row in rows if row["committed"] and row["step"] >= die_at]
    before = [row["end"] - row["start"] for row in survivors[0] if row["committed"] and 1 <= row["step"] < die_at]
    newcomer = records["r3"]
    first_commit = min(row["end"] for row in newcomer if row["committed"])
    steady = [
        row["end"] - row["start"] for row in survivors[0] if row["committed"] and row["step"] > newcomer[0]["step"]
    ]
    return {
        "steps_lost": lost,
        "kill_to_first_commit_s": min(after) - killed,
        "newcomer_heal_s": newcomer[0]["quorum_s"],
        "newcomer_start_to_first_commit_s": first_commit - run["newcomer_started"],
        "step_ms_before_kill": 1000 * statistics.median(before),
        "step_ms_after_heal": 1000 * statistics.median(steady) if steady else None,
    }


def plain_step_ms(engine: str, hidden: int, steps: int, out: Path) -> float:
    """Median step time of the same model without torchft: three processes on one gloo group."""
    init = f"tcp://127.0.0.1:{free_port()}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    script = str(Path(torchft_runs.__file__))
    args = ["plain", "--engine", engine, "--out", str(out), "--steps", str(steps), "--hidden", str(hidden)]
    processes = [
        subprocess.Popen([sys.executable, script, *args, "--init", init, "--rank", str(r), "--world", "3"], env=env)
        for r in range(3)
    ]
    try:
        for process in processes:
            if process.wait(timeout=120) != 0:
                raise RuntimeError(f"bench_torchft: the {engine} run failed")
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    times = json.loads((out / f"{engine}.json").read_text())[3:]  # warm-up steps out
    return 1000 * statistics.median(times)


KILLS = {
    "backward": "killed mid-step (after its forward: the peers' all-reduce fails)",
    "between": "killed between steps (before its quorum: no all-reduce in flight)",
}


def failure_line(error: BaseException) -> str:
    """What a crashed survivor died of: the exception and the innermost frame of its traceback."""
    lines = [line.strip().removeprefix("[rank0]:").strip() for line in str(error).splitlines()]
    lines = [line for line in lines if line]
    if not lines:
        return repr(error)
    frames = [i for i, line in enumerate(lines) if re.match(r'File ".*", line \d+', line)]
    if not frames:
        return lines[-1]
    match = re.match(r'File "(.*)", line (\d+)', lines[frames[-1]])
    assert match is not None
    code = lines[frames[-1] + 1] if frames[-1] + 1 < len(lines) else ""
    return f"{lines[-1]} at {match.group(1).split('site-packages/')[-1]}:{match.group(2)} ({code})"


def table(report: dict) -> str:
    """The report as markdown."""
    rows = [
        "| engine | kill | steps lost | kill -> first commit (s) | newcomer heal (s) "
        "| newcomer start -> first commit (s) | step ms, torchft | step ms, no torchft | ratio |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for engine, runs in report["engines"].items():
        plain = runs["plain_step_ms"]
        for kill in KILLS:
            r = runs[kill]
            if "failed" in r:
                rows.append(f"| {engine} | {kill} | survivors crashed: `{r['failed']}` | | | | | {plain:.2f} | |")
                continue
            rows.append(
                f"| {engine} | {kill} | {r['steps_lost']} | {r['kill_to_first_commit_s']:.2f} "
                f"| {r['newcomer_heal_s']:.3f} | {r['newcomer_start_to_first_commit_s']:.2f} "
                f"| {r['step_ms_before_kill']:.2f} | {plain:.2f} | {r['step_ms_before_kill'] / plain:.2f} |"
            )
    rows += ["", *(f"- {kill}: {text}" for kill, text in KILLS.items())]
    rows.append(
        "- Lighthouse: min_replicas=2, join_timeout 1 s, heartbeat timeout 2 s (kill -> first commit is "
        "mostly these). Steps lost: attempts a survivor did not commit. Newcomer heal: its first quorum, "
        "checkpoint fetch included; start -> first commit includes starting Python and importing torch. "
        "Step ms: median of the committed steps before the kill; 'no torchft': replicate() / torch DDP on "
        "one gloo group of the same 3 processes."
    )
    return "\n".join(rows)


def main() -> None:
    """Runs both engines, prints the table and writes results/torchft_recovery.{md,json}."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256, help="hidden width of the 3-layer MLP (default 256)")
    parser.add_argument("--steps", type=int, default=40, help="committed steps per run (default 40)")
    parser.add_argument("--die-at", type=int, default=10, help="the step whose middle the victim dies in")
    parser.add_argument("--out", default=RESULTS_DIR)
    args = parser.parse_args()
    started = time.time()
    report: dict[str, Any] = {
        "env": run_env(hidden=args.hidden, steps=args.steps, die_at=args.die_at),
        "engines": {},
    }
    with tempfile.TemporaryDirectory() as scratch:
        for engine, plain in ENGINES.items():
            runs: dict[str, Any] = {}
            for kill in KILLS:
                out = Path(scratch) / f"{engine}-{kill}"
                try:
                    run = torchft_runs.run_scenario(
                        engine, out, num_steps=args.steps, die_at=args.die_at, hidden=args.hidden, die_in=kill
                    )
                    runs[kill] = summarize_run(run, args.die_at)
                except RuntimeError as error:  # a survivor crashed: that is the result
                    runs[kill] = {"failed": failure_line(error)}
                print(engine, kill, json.dumps(runs[kill]), flush=True)
            runs["plain_step_ms"] = plain_step_ms(plain, args.hidden, args.steps, Path(scratch))
            report["engines"][engine] = runs
    finish_report(report, started, None, table, args.out, "torchft_recovery")


if __name__ == "__main__":
    main()
