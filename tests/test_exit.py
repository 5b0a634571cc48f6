"""Clean exits under load: short torchrun runs of examples/train.py never abort at interpreter exit.

Issue 28: once, on a loaded CI machine, a rank aborted at exit ("terminate
called without an active exception", SIGABRT). A few runs next to busy
loops (benchmarks/bench_exit.py runs many more and prints the counts).
"""

from __future__ import annotations

import multiprocessing
import time

import pytest

from harness import TORCHRUN, run_command

NUM_RUNS = 5
NUM_BUSY = 2  # busy loops alongside, one core each


def _busy(stop_at: float) -> None:
    x = 0
    while time.monotonic() < stop_at:
        x = (x * 1103515245 + 12345) % 2**31


@pytest.mark.timeout(240)
def test_short_runs_under_cpu_load_exit_cleanly():
    context = multiprocessing.get_context("spawn")
    burners = [context.Process(target=_busy, args=(time.monotonic() + 200,), daemon=True) for _ in range(NUM_BUSY)]
    for burner in burners:
        burner.start()
    command = [*TORCHRUN, "--standalone", "--nproc-per-node", "2", "examples/train.py", "--steps", "10"]
    try:
        for run in range(NUM_RUNS):
            done = run_command(command, env={"OMP_NUM_THREADS": "1"}, timeout=40)  # kills torchrun's workers too
            output = done.stdout + done.stderr
            assert "terminate called" not in output and "SIGABRT" not in output, f"run {run}: {output[-3000:]}"
            assert done.returncode == 0, f"run {run} exited {done.returncode}: {output[-3000:]}"
            assert "identical: True" in done.stdout, f"run {run}: {done.stdout[-2000:]}"
    finally:
        for burner in burners:
            burner.terminate()
            burner.join(5)
