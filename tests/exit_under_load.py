"""Exit under load: many short 2-rank runs of examples/train.py while busy loops hold every core.

Issue 28: once, on a loaded CI machine, a rank of ``examples/train.py``
aborted at interpreter exit (``terminate called without an active
exception``, SIGABRT). That is ``std::terminate`` in a thread at exit: a
C++ thread (gloo's, or a Python thread inside a pybind call that released
the GIL) coming back to Python after finalization began. Load widens the
window, so this script runs many short runs next to ``--load`` busy
processes and counts how each ended. Run::

    .venv/bin/python tests/exit_under_load.py --runs 40 --load 4

It prints one line per run and the counts; the exit status is 1 when any run
aborted or failed, so it doubles as a stress test (tests/test_exit.py runs a
few runs like them, with its busy loops).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ABORT_TEXT = "terminate called"


def busy(stop_at: float) -> None:
    # one core's worth of load, until stop_at
    x = 0
    while time.monotonic() < stop_at:
        x = (x * 1103515245 + 12345) % 2**31


def one_run(steps: int, timeout_s: float) -> tuple[str, float, str]:
    """One torchrun of examples/train.py on 2 ranks; (how it ended, seconds, the output's last lines)."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(ROOT / "examples" / "train.py"), "--steps", str(steps),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    started = time.monotonic()
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # torchrun and its workers, whole
        output, _ = process.communicate()
        return "timeout", time.monotonic() - started, output.decode(errors="replace")[-2000:]
    text = output.decode(errors="replace")
    seconds = time.monotonic() - started
    if ABORT_TEXT in text or "SIGABRT" in text or "Signal 6" in text:
        return "abort", seconds, text[-2000:]
    return ("ok" if process.returncode == 0 else f"exit {process.returncode}"), seconds, text[-2000:]


def run(num_runs: int, load: int, steps: int, timeout_s: float = 120.0, verbose: bool = True) -> Counter[str]:
    """``num_runs`` runs next to ``load`` busy processes; counts of how they ended."""
    counts: Counter[str] = Counter()
    stop_at = time.monotonic() + num_runs * timeout_s
    context = multiprocessing.get_context("spawn")
    burners = [context.Process(target=busy, args=(stop_at,), daemon=True) for _ in range(load)]
    for burner in burners:
        burner.start()
    try:
        for index in range(num_runs):
            how, seconds, tail = one_run(steps, timeout_s)
            counts[how] += 1
            if verbose:
                print(f"run {index + 1:3d}/{num_runs}: {how:8s} {seconds:5.1f} s", flush=True)
            if how != "ok" and verbose:
                print(tail, flush=True)
    finally:
        for burner in burners:
            burner.terminate()
            burner.join(5)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--load", type=int, default=max(2, os.cpu_count() or 2), help="busy processes alongside")
    parser.add_argument("--steps", type=int, default=30)
    options = parser.parse_args()
    counts = run(options.runs, options.load, options.steps)
    print(f"{options.runs} runs of examples/train.py (2 ranks, {options.steps} steps) under {options.load} busy loops:")
    print("  " + ", ".join(f"{how}: {n}" for how, n in sorted(counts.items())))
    raise SystemExit(0 if counts["ok"] == options.runs else 1)


if __name__ == "__main__":
    main()
