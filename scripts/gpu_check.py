"""The first-GPU check (scripts/gpu_check.sh runs it): a preflight, then one line per check, then a summary.

    python scripts/gpu_check.py [--dry-run | --cpu] [NAME ...]

Built for one short run on one GPU (torch 2.11 on Python 3.12, or 2.13):

- a preflight first (versions, the import, one all-reduce on NCCL; at most
  ``PREFLIGHT_S``): where it fails, nothing else runs;
- then each check in its own process, with its own limit (``CHECKS``: name,
  ranks, seconds), killed at it; rerun one alone by naming it; a check that
  would end past ``BUDGET_S`` is not started, and the summary says so;
- every failure prints its error's last line; the full tracebacks (and what
  a killed check had printed), the log and ``summary.json`` go to the folder
  ``$GPU_CHECK_OUT`` names (default ``gpu_check_out``), three files;
- ``--dry-run`` (no GPU needed) lists every check with its limit and runs
  the preflight's CPU part (versions, the import, one gloo all-reduce);
- ``--cpu`` runs every check's body on the CPU with gloo and small models
  (scripts/gpu_checks.py): a mistake in a check shows here, not in the GPU's
  minutes; a body with nothing to run on a CPU says "n/a on the CPU".

The checks, in order of risk (bodies in scripts/gpu_checks.py); where one
compares, it compares with plain local training or with DDP on the device:

1. ``sync_audit``: world size 1 on NCCL with a reducer forced to exist (at
   world size 1 ``replicate()`` builds none), over every shape of issue 47's
   item 1 (plain, BatchNorm, ``no_sync``, bf16 ``mp_policy``, a comm hook,
   copied gradients, tied, unused on some steps, the tied split,
   ``graph="dynamic"``): the CPU-side read counter (tests/host_reads.py)
   equals the expected reads (none, or the one inherent read), and
   ``torch.cuda.set_sync_debug_mode("warn")`` sees no synchronisation
   beyond them; each one found is named by file and line.
2. ``ws1_bitwise``: 5 steps against local training, bitwise.
3. ``stressed``: the same with the whole step on a side stream (the rebuild
   too) and ``torch.cuda._sleep`` before every bucket's all-reduce.
4. ``precision``: DDP's fp16 hook on both engines, and ``reduce_dtype=bf16``
   against DDP's bf16 hook, bitwise; bf16 compute within rounding of fp32.
5. ``gloo2_vs_ddp``: 2 gloo ranks sharing the GPU with CUDA tensors (NCCL
   refuses two ranks on one GPU), ours against DDP, 5 steps, bitwise.
6. ``overhead``: ours, DDP and local training at world size 1 on NCCL, a
   compute-bound MLP (8 x 4096, batch 256) and a launch-bound one (48 x 64):
   interleaved rounds timed by CUDA events; ours/DDP and each against local.
7. ``memory``: peak CUDA memory of 3 steps, each engine in its own process.
8. ``pytest_cuda``: the suite's CUDA-marked tests (tests/test_cuda.py).
9. ``compile``: ``torch.compile`` (inductor) of the replicated model against
   DDP's compiled job: both split into the same graphs at 1 MiB buckets,
   gradients bitwise equal (against eager, inductor's kernels round
   differently, by how much depends on the device).
10. ``observers``: the step recorder on the device's clock (CUDA events on
    the stream): records one step late, a 30 ms device sleep per step in
    its step time while the host runs ahead; the tuned layout's link
    calibration timed on the device.
11. ``stall``: last, a 3 s device stall in a step with ``stall_timeout=1``:
    the in-step read polls its event through the watchdog (the host does
    not spin); printed stage by stage, so a killed run still says where.

Exits 1, saying why, when no CUDA GPU is visible (except with --dry-run or
--cpu): nothing is skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from typing import Callable, NamedTuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "tests")]  # gpu_checks; the tests' helpers
if "--cpu" in sys.argv:
    os.environ["GPU_CHECK_CPU"] = "1"  # before gpu_checks is imported: its bodies run on the CPU

import gpu_checks as body  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


class Check(NamedTuple):
    name: str
    fn: Callable[[], str]
    ranks: int  # launched ranks (0: in the check's own process)
    limit_s: int  # the check's process is killed past it
    gpu_only: str = ""  # why its body has nothing to run on a CPU ("": it runs there with --cpu)


# In order of risk; the limits add up to BUDGET_S with the preflight (scripts/gpu_check.sh: 300 s in all).
CHECKS = [
    Check("sync_audit", body.check_sync_audit, 1, 30),
    Check("ws1_bitwise", body.check_ws1_bitwise, 1, 15),
    Check("stressed", body.check_stressed, 1, 20),
    Check("precision", body.check_precision, 1, 20),
    Check("gloo2_vs_ddp", body.check_gloo2_vs_ddp, 2, 25),
    Check("overhead", body.check_overhead, 1, 35),
    Check("memory", body.check_memory, 0, 30, "peak CUDA memory"),
    Check("pytest_cuda", lambda: body.run_pytest(30 - 5), 0, 30, "the CUDA-marked tests skip without a GPU"),
    Check("compile", body.check_compile, 1, 30),
    Check("observers", body.check_observers, 1, 15),
    Check("stall", body.check_stall, 1, 20, "on a CPU the in-step read waits on gloo, not on a device event"),
]
CHECKS_BY_NAME = {check.name: check for check in CHECKS}
PREFLIGHT_S = 15
SCALE = 1 if body.CUDA else 3  # --cpu: 2 cores spawn and import slower; a limit there is not the GPU's
BUDGET_S = 285  # the preflight and every check; the shell's timeout (300 s) is the backstop


def last_line(text: str) -> str:
    """An error's last non-empty line: where a traceback says what went wrong."""
    return next((line.strip() for line in reversed(text.splitlines()) if line.strip()), "(no message)")


def preflight_body(backend: str) -> str:
    """Versions, the import, and one all-reduce on ``backend`` at world size 1 (in its own process)."""
    import torchreplicate

    store = dist.HashStore()
    dist.init_process_group(backend, store=store, rank=0, world_size=1)
    device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    one = torch.ones(4, device=device)
    dist.all_reduce(one)
    assert one.sum().item() == 4.0, one
    dist.destroy_process_group()
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if backend == "nccl" else "-"
    return (
        f"Python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}, "
        f"torchreplicate {torchreplicate.__version__}: one {backend} all-reduce"
    )


def in_own_process(argv: list[str], limit_s: int) -> tuple[bool, str, str]:
    """Runs this script with ``argv`` in a new process, killed after ``limit_s``: (ok, line, traceback)."""
    try:
        done_ = subprocess.run(
            [sys.executable, os.path.abspath(__file__), *argv],
            capture_output=True,
            text=True,
            timeout=limit_s,
            start_new_session=True,
        )
    except subprocess.TimeoutExpired as expired:
        out = (expired.stdout or b"").decode() if isinstance(expired.stdout, bytes) else (expired.stdout or "")
        return False, f"timed out after {limit_s} s (killed)", out
    for line in reversed(done_.stdout.splitlines()):
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT ") :])
            return result["ok"], result["line"], result["traceback"]
    return False, f"exit {done_.returncode}: {last_line(done_.stderr or done_.stdout)}", done_.stderr


def run_one(argv: list[str]) -> int:
    """In a check's own process: runs one check (or the preflight) and prints its RESULT line."""
    what = argv[0]
    try:
        if what.startswith("preflight:"):
            line = preflight_body(what.split(":", 1)[1])
        else:
            check = CHECKS_BY_NAME[what]
            launched = body.launch(check.fn, check.ranks, timeout_s=check.limit_s * SCALE - 5) if check.ranks else None
            line = check.fn() if launched is None else launched[0]
        result = {"ok": True, "line": line, "traceback": ""}
    except Exception as error:  # the line: the error's last line (for a rank's error, its own last line)
        text = "".join(traceback.format_exception(error))
        result = {"ok": False, "line": last_line(str(error)) or last_line(text), "traceback": text}
    print("RESULT " + json.dumps(result), flush=True)
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["--one"]:
        return run_one(argv[1:])
    dry, cpu = "--dry-run" in argv, "--cpu" in argv
    only = [name for name in argv if name not in ("--dry-run", "--cpu")]
    unknown = [name for name in only if name not in CHECKS_BY_NAME]
    if unknown:
        print(f"gpu_check: no check named {unknown}; the checks: {', '.join(CHECKS_BY_NAME)}")
        return 2
    out = os.environ.get("GPU_CHECK_OUT", "gpu_check_out")
    os.makedirs(out, exist_ok=True)
    log: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        log.append(line)

    started, results, tracebacks = time.monotonic(), [], []
    if dry:
        for check in CHECKS:
            say(f"check {check.name}: {check.limit_s} s, {check.ranks or 'no'} launched ranks")
        say(f"preflight {PREFLIGHT_S} s + checks {sum(c.limit_s for c in CHECKS)} s; budget {BUDGET_S} s")
    elif not cpu and not torch.cuda.is_available():
        say("gpu_check: FAILED: no CUDA GPU is visible (torch.cuda.is_available() is False); nothing was checked")
        return 1
    ok, line, trace = in_own_process(["--one", f"preflight:{'gloo' if dry or cpu else 'nccl'}"], PREFLIGHT_S)
    say(f"{'PASS' if ok else 'FAIL'} preflight ({time.monotonic() - started:.0f} s): {line}")
    results.append({"name": "preflight", "ok": ok, "line": line})
    tracebacks.append(f"== preflight\n{trace}")
    for check in [] if dry or not ok else [c for c in CHECKS if not only or c.name in only]:
        if not cpu and time.monotonic() - started + check.limit_s > BUDGET_S:
            say(f"NOT RUN {check.name}: its {check.limit_s} s would pass the {BUDGET_S} s budget")
            results.append({"name": check.name, "ok": False, "line": "not run: budget"})
            continue
        if cpu and check.gpu_only:
            say(f"N/A {check.name}: n/a on the CPU ({check.gpu_only})")
            results.append({"name": check.name, "ok": True, "line": f"n/a on the CPU: {check.gpu_only}"})
            continue
        at = time.monotonic()
        ok_, line_, trace_ = in_own_process(["--one", check.name], check.limit_s * SCALE)
        say(f"{'PASS' if ok_ else 'FAIL'} {check.name} ({time.monotonic() - at:.0f} s): {line_}")
        results.append({"name": check.name, "ok": ok_, "line": line_, "seconds": round(time.monotonic() - at, 1)})
        tracebacks.append(f"== {check.name}\n{trace_}")
    failed = [r["name"] for r in results if not r["ok"]]
    say(
        f"\ngpu_check: {len(results) - len(failed)} of {len(results)} passed in {time.monotonic() - started:.0f} s"
        + (f"; failed or not run: {failed}" if failed else "")
    )
    summary = {"torch": torch.__version__, "python": sys.version.split()[0], "dry_run": dry, "cpu": cpu}
    summary["results"] = results
    with open(os.path.join(out, "summary.json"), "w") as file:
        json.dump(summary, file, indent=1)
    with open(os.path.join(out, "tracebacks.txt"), "w") as file:
        file.write("\n".join(tracebacks))
    with open(os.path.join(out, "log.txt"), "w") as file:
        file.write("\n".join(log) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
