"""The first-GPU check (scripts/gpu_check.sh runs it): a preflight, then one line per check, then a summary.

    python scripts/gpu_check.py [--dry-run | --cpu] [NAME ...]

Built for one short run on one GPU (torch 2.11 on Python 3.12, or 2.13):

- a preflight first (versions, NumPy, the import, one all-reduce on NCCL; at
  most ``PREFLIGHT_S``): where it fails, nothing else runs;
- then each check in its own process, with its own limit (``CHECKS``: name,
  ranks, seconds; how each limit was set is written next to them), killed
  at it; rerun one alone by naming it; a check that would end past
  ``BUDGET_S`` (counted from this process's start) is not started, and the
  summary says so;
- what was found is on disk the moment it is found: in the folder
  ``$GPU_CHECK_OUT`` names (default ``gpu_check_out``), ``summary.json``,
  ``log.txt`` and ``tracebacks.txt`` are rewritten whole after the preflight,
  before each check (``summary.json``'s ``"running"`` names it) and after
  it; a run killed at any point (the shell's ``timeout 300``, the machine's
  limit) leaves every finished check's result and the name of the one that
  was running. Stopped by SIGTERM or SIGINT, the run asks the running check
  where it is (SIGUSR1), kills it and its ranks, and records it as stopped;
- every failure prints its error's last line; its full traceback, and what a
  killed check had printed (stdout and stderr), go to ``tracebacks.txt``;
- a check that hangs says where: faulthandler, in the check's process and
  in each rank it launches, writes every thread's stack a moment before
  the limit (``DUMP_LEAD_S``, ``RANK_DUMP_LEAD_S``) to ``hang_NAME.txt`` and
  ``hang_NAME.rankR.txt`` in ``$GPU_CHECK_OUT`` (kept only where something
  was written; a fatal signal writes there too); a failed check's line ends
  with the innermost frame each stack hung at, and ``tracebacks.txt`` holds
  the stacks;
- ``--dry-run`` (no GPU needed) lists every check with its limit and runs
  the preflight's CPU part (versions, NumPy, the import, one gloo all-reduce);
- ``--cpu`` runs every check's body on the CPU with gloo and small models
  (scripts/gpu_checks.py): a mistake in a check shows here, not in the GPU's
  minutes; a body with nothing to run on a CPU says "n/a on the CPU"; its
  limits are ``SCALE`` times the GPU's, and each line gives the seconds the
  check took (how the GPU limits were measured).

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
7. ``memory``: peak CUDA memory of 3 steps, each engine in its own process
   (the two processes at once).
8. ``pytest_cuda``: tests/test_cuda.py alone (not the whole suite), each
   test limited: NCCL at world size 1 with a reducer forced, 2 gloo ranks
   sharing the GPU, both over several buckets, and the first step's bucket
   rebuild on a side stream with the default stream reusing memory; a test
   that skips fails the check.
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

import glob
import json
import os
import re
import signal
import subprocess
import sys
import time
import traceback
from typing import Any, Callable, NamedTuple, Optional

STARTED = time.monotonic()  # BUDGET_S counts from here: this process's own (cold) import of torch is in it
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, os.path.join(ROOT, "tests")]  # gpu_checks; the tests' helpers
if "--cpu" in sys.argv:
    os.environ["GPU_CHECK_CPU"] = "1"  # before gpu_checks is imported: its bodies run on the CPU

import gpu_checks as body  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from local_ranks import die_with_parent  # noqa: E402


class Check(NamedTuple):
    name: str
    fn: Callable[[], str]
    ranks: int  # launched ranks (0: in the check's own process)
    limit_s: int  # the check's process is killed past it
    gpu_only: str = ""  # why its body has nothing to run on a CPU ("": it runs there with --cpu)


# In order of risk. How each limit was set: the check's seconds with --cpu on a 2-core machine (torch
# 2.13 CPU; the process's imports, a spawned rank's imports and the gloo body: nearly all Python), plus
# 6 s for a cold CUDA context and NCCL communicator in each new process (the first, and coldest, is the
# preflight's) and CUDA torch's heavier import, plus the GPU-only work, rounded up. A launched
# rank gets what is left at its launch less LAUNCH_LEAD_S: about the limit less 5 s (ws1_bitwise and
# observers: 25 s, so 20 s for the rank's imports, context and NCCL set-up). The sum, with the
# preflight, is BUDGET_S (the test checks it).
CHECKS = [
    # CPU 8 s + 6 + ~2 s of sync-debug steps (13 shapes x 3) -> 20
    Check("sync_audit", body.check_sync_audit, 1, 20),
    # CPU 7 s + 6 = 13 -> 25, for its rank's 20 s
    Check("ws1_bitwise", body.check_ws1_bitwise, 1, 25),
    # CPU 8 s + 6 + ~0.5 s of device sleeps (17 x 20 ms) -> 18
    Check("stressed", body.check_stressed, 1, 18),
    # CPU 8 s + 6 -> 18
    Check("precision", body.check_precision, 1, 18),
    # CPU 6 s (its 2 ranks start at once) + 6 (their 2 contexts come up at once) -> 15
    Check("gloo2_vs_ddp", body.check_gloo2_vs_ddp, 2, 15),
    # CPU 6 s (small models, few steps) + 6 + ~3 s of timed GPU rounds (~500 steps of ~3 ms) -> 18
    Check("overhead", body.check_overhead, 1, 18),
    # GPU only: the process's imports 4 s + one rank's 4 s (both engines' ranks at once) + 6 + 3 steps -> 20
    Check("memory", body.check_memory, 0, 20, "peak CUDA memory"),
    # CPU: pytest's start and collection of the one file 4-7 s (its tests skip); GPU: + 3 tests of one
    # spawn each (4 s of imports + 6 s of context + < 1 s of steps) -> 36 (each test 25 s at most)
    Check("pytest_cuda", body.run_pytest, 0, 36, "the CUDA-marked tests skip without a GPU"),
    # CPU 12 s (inductor's C++ kernels, cached) + 6 + a cold inductor and Triton compile of the split
    # graphs, ours and DDP's (20-40 s cold) -> 60
    Check("compile", body.check_compile, 1, 60),
    # CPU 7 s + 6 + 5 device-slept steps of 30 ms and the link calibration = 14 -> 25, for its rank's 20 s
    Check("observers", body.check_observers, 1, 25),
    # GPU only: as ws1_bitwise (7 s + 6) + the 3 s stall + the first step -> 20
    Check("stall", body.check_stall, 1, 20, "on a CPU the in-step read waits on gloo, not on a device event"),
]
# For tests/test_gpu_check.py only, run by name and never in a full run: a check that hangs, in its own
# process and in a launched rank, so that the test sees it killed and the stacks that say where.
TEST_CHECKS = [
    Check("_hang_rank", body.hang_for_test, 1, 6),
    Check("_hang", body.hang_for_test, 0, 6),
]
CHECKS_BY_NAME = {check.name: check for check in CHECKS + TEST_CHECKS}
PREFLIGHT_S = 15  # CPU 3 s + the first cold CUDA context and NCCL communicator of the machine
SCALE = 1 if body.CUDA else 3  # --cpu: 2 cores spawn and import slower; a limit there is not the GPU's
# The preflight and every check, counted from this process's start (its cold import of torch included):
# 10 s under scripts/gpu_check.sh's timeout (300 s), the backstop, for the last writes
BUDGET_S = 290
DUMP_LEAD_S = 0.5  # a check's own process writes its stacks this long before it is killed
LAUNCH_LEAD_S = 1.0  # its launched ranks are killed this long before (launch's TimeoutError names them)
RANK_DUMP_LEAD_S = 2.5  # and write their stacks this long before
FRAME = re.compile(r'File "(?P<file>.+)", line (?P<line>\d+) in (?P<fn>\S+)')


class Stopped(Exception):
    """The run was ended by a signal (SIGTERM from ``timeout``, SIGINT) while ``trace`` was gathered."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"the run was stopped by {signal.Signals(signum).name}")
        self.trace = ""


def stop_on_signal(signum: int, frame: Any) -> None:
    """The run's SIGTERM and SIGINT handler: raises ``Stopped`` where the run is (in_own_process's wait)."""
    raise Stopped(signum)


def last_line(text: str) -> str:
    """An error's last non-empty line: where a traceback says what went wrong."""
    return next((line.strip() for line in reversed(text.splitlines()) if line.strip()), "(no message)")


def hang_path(hang_dir: Optional[str], name: str) -> Optional[str]:
    """Where a check's (or a rank's) faulthandler stacks go: ``hang_NAME.txt`` in ``hang_dir``; None: stderr."""
    return os.path.join(hang_dir, f"hang_{name}.txt") if hang_dir else None


def hang_files(hang_dir: str, name: str) -> list[str]:
    """The stack files of check ``name``: its process's, then its ranks', by rank."""
    own = os.path.join(hang_dir, f"hang_{name}.txt")
    ranks = sorted(glob.glob(os.path.join(hang_dir, f"hang_{name}.rank*.txt")))
    return [path for path in [own, *ranks] if os.path.exists(path)]


def where_hung(dump: str) -> str:
    """The innermost frame of faulthandler's last thread (the main thread: the oldest, written last),
    in this repository where one of its frames is there: "scripts/gpu_checks.py:120 in hang_for_test"."""
    threads = [block for block in dump.split("\n\n") if FRAME.search(block)]
    if not threads:
        return "no Python frame"
    frames = list(FRAME.finditer(threads[-1]))
    ours = [f for f in frames if f["file"].startswith(ROOT) and os.sep + ".venv" + os.sep not in f["file"]]
    frame = (ours or frames)[0]
    where = os.path.relpath(frame["file"], ROOT) if ours else frame["file"]
    return f"{where}:{frame['line']} in {frame['fn']}"


def read_stacks(hang_dir: Optional[str], name: str) -> tuple[str, str]:
    """Check ``name``'s faulthandler stacks: ("its process at X; rank 0 at Y", the stacks in full);
    an empty file (a process killed before it wrote) is removed."""
    wheres, texts = [], []
    for path in hang_files(hang_dir, name) if hang_dir else []:
        with open(path) as file:
            text = file.read()
        if not text.strip():
            os.remove(path)
            continue
        rank = re.search(r"\.rank(\d+)\.txt$", path)
        wheres.append(f"{'rank ' + rank[1] if rank else 'its process'} at {where_hung(text)}")
        texts.append(f"-- faulthandler, {os.path.basename(path)}:\n{text}")
    return "; ".join(wheres), "\n".join(texts)


def preflight_body(backend: str) -> str:
    """Versions, NumPy (the accelerated reducer reads its staged sums through it: reducer/flags.py), the
    import, and one all-reduce on ``backend`` at world size 1 (in its own process)."""
    import numpy

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
        f"NumPy {numpy.__version__}, torchreplicate {torchreplicate.__version__}: one {backend} all-reduce"
    )


def end_group(process: subprocess.Popen[str], first: Optional[int]) -> tuple[str, str]:
    """Ends a check's process and the ranks it launched (its process group: it leads its own session):
    ``first`` (SIGUSR1: faulthandler writes every stack) and half a second to write, then SIGKILL;
    returns what the process had printed (stdout, stderr)."""
    for signum in [first, signal.SIGKILL] if first else [signal.SIGKILL]:
        try:
            os.killpg(process.pid, signum)
        except ProcessLookupError:
            break
        if signum != signal.SIGKILL:
            time.sleep(0.5)
    try:
        return process.communicate(timeout=5)
    except subprocess.TimeoutExpired:  # a straggler outside the group still holds the pipes
        return "", ""


def in_own_process(argv: list[str], limit_s: float, hang_dir: Optional[str] = None) -> tuple[bool, str, str]:
    """Runs this script with ``argv`` in a new process, killed after ``limit_s``: (ok, line, traceback).

    The process and its ranks write their faulthandler stacks shortly before ``limit_s`` to files in
    ``hang_dir`` (to their stderr where None); a failure's line says where each hung, its traceback holds
    the stacks and, for a killed process, its stdout and stderr. Stopped here (``Stopped``), it kills
    the process after asking for its stacks, and raises with them in ``Stopped.trace``."""
    name = argv[1].split(":", 1)[0] if argv[1:] else "?"  # "preflight:nccl": "preflight"
    for stale in hang_files(hang_dir, name) if hang_dir else []:
        os.remove(stale)
    env = {**os.environ, "GPU_CHECK_DEADLINE": str(time.time() + limit_s)}
    if hang_dir:
        env["GPU_CHECK_HANG_DIR"] = hang_dir
    command = [sys.executable, os.path.abspath(__file__), *argv]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, env=env
    )
    try:
        stdout, stderr = process.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        stdout, stderr = end_group(process, None)
        ok, line, trace = False, f"timed out after {limit_s:g} s (killed)", f"{stdout}\n{stderr}"
    except Stopped as stopped:
        stdout, stderr = end_group(process, signal.SIGUSR1)
        stopped.trace = f"{stdout}\n{stderr}\n{read_stacks(hang_dir, name)[1]}"
        raise
    else:  # its ranks, if any were left behind, die with it (local_ranks.die_with_parent)
        ok, line, trace = False, f"exit {process.returncode}: {last_line(stderr or stdout)}", stderr
        for out_line in reversed(stdout.splitlines()):
            if out_line.startswith("RESULT "):
                result = json.loads(out_line[len("RESULT ") :])
                ok, line, trace = result["ok"], result["line"], result["traceback"]
                break
    wheres, stacks = read_stacks(hang_dir, name)
    if not ok and wheres:
        line, trace = f"{line}; stacks: {wheres}", f"{trace}\n{stacks}"
    return ok, line, trace


def run_check(check: Check, deadline: float, hang_dir: Optional[str]) -> str:
    """A check's body: in this process, or in ``check.ranks`` launched ranks (rank 0's line), each rank
    writing its stacks ``RANK_DUMP_LEAD_S`` before ``deadline`` and killed ``LAUNCH_LEAD_S`` before it."""
    if not check.ranks:
        return check.fn()
    template = hang_path(hang_dir, check.name + ".rank{rank}")
    args = (check.fn, deadline - RANK_DUMP_LEAD_S, template)
    timeout_s = round(max(1.0, deadline - LAUNCH_LEAD_S - time.time()), 1)
    return str(body.launch(body.rank_with_hang_dump, check.ranks, args, timeout_s=timeout_s)[0])


def run_one(argv: list[str]) -> int:
    """In a check's own process: runs one check (or the preflight) and prints its RESULT line; dies with
    the run; its stacks are written ``DUMP_LEAD_S`` before its deadline (``GPU_CHECK_DEADLINE``)."""
    die_with_parent()
    what = argv[0]
    name = what.split(":", 1)[0]
    deadline = float(os.environ.get("GPU_CHECK_DEADLINE", time.time() + 600))
    hang_dir = os.environ.get("GPU_CHECK_HANG_DIR")
    with body.hang_dump(hang_path(hang_dir, name), deadline - DUMP_LEAD_S):
        try:
            if what.startswith("preflight:"):
                line = preflight_body(what.split(":", 1)[1])
            else:
                line = run_check(CHECKS_BY_NAME[what], deadline, hang_dir)
            result = {"ok": True, "line": line, "traceback": ""}
        except Exception as error:  # the line: the error's last line (for a rank's error, its own last line)
            text = "".join(traceback.format_exception(error))
            result = {"ok": False, "line": last_line(str(error)) or last_line(text), "traceback": text}
    print("RESULT " + json.dumps(result), flush=True)
    return 0


class Report:
    """The run's findings so far, on disk in ``out`` at every step: ``summary.json`` (the results, and
    the check running now), ``log.txt`` and ``tracebacks.txt``, each rewritten whole through a
    temporary file and a rename (a run killed while writing leaves the previous version)."""

    def __init__(self, out: str, dry: bool, cpu: bool) -> None:
        self.out, self.dry, self.cpu = out, dry, cpu
        self.results: list[dict[str, Any]] = []
        self.log: list[str] = []
        self.tracebacks: list[str] = []
        self.running: Optional[str] = None

    def say(self, line: str) -> None:
        """Prints ``line`` and keeps it for log.txt."""
        print(line, flush=True)
        self.log.append(line)

    def start(self, name: str) -> None:
        """Check ``name`` starts: the summary says so before it runs."""
        self.running = name
        self.write()

    def add(self, result: dict[str, Any], trace: Optional[str] = None) -> None:
        """A check's result (and its traceback), written at once."""
        self.results.append(result)
        if trace is not None:
            self.tracebacks.append(f"== {result['name']}\n{trace}")
        self.running = None
        self.write()

    def write(self, finished: bool = False) -> None:
        """Rewrites the three files."""
        summary = {"torch": torch.__version__, "python": sys.version.split()[0], "dry_run": self.dry}
        summary.update(cpu=self.cpu, finished=finished, running=self.running)
        summary.update(seconds=round(time.monotonic() - STARTED, 1), results=self.results)
        self.replace("summary.json", json.dumps(summary, indent=1))
        self.replace("tracebacks.txt", "\n".join(self.tracebacks))
        self.replace("log.txt", "\n".join(self.log) + "\n")

    def replace(self, name: str, text: str) -> None:
        """Writes ``text`` to ``out/name`` through a temporary file and a rename."""
        path = os.path.join(self.out, name)
        with open(path + ".tmp", "w") as file:
            file.write(text)
        os.replace(path + ".tmp", path)


def run_checks(report: Report, checks: list[Check], cpu: bool) -> None:
    """Each check in its own process, its result written as it ends; one past the budget is not run."""
    for check in checks:
        if cpu and check.gpu_only:
            report.say(f"N/A {check.name}: n/a on the CPU ({check.gpu_only})")
            report.add({"name": check.name, "ok": True, "line": f"n/a on the CPU: {check.gpu_only}"})
            continue
        if not cpu and time.monotonic() - STARTED + check.limit_s > BUDGET_S:
            report.say(f"NOT RUN {check.name}: its {check.limit_s} s would pass the {BUDGET_S} s budget")
            report.add({"name": check.name, "ok": False, "line": "not run: budget"})
            continue
        report.start(check.name)
        at = time.monotonic()
        ok, line, trace = in_own_process(["--one", check.name], check.limit_s * SCALE, report.out)
        seconds = round(time.monotonic() - at, 1)
        report.say(f"{'PASS' if ok else 'FAIL'} {check.name} ({seconds:.0f} s): {line}")
        report.add({"name": check.name, "ok": ok, "line": line, "seconds": seconds}, trace)


def main(argv: list[str]) -> int:
    """The run: the preflight, then the checks (all, or those named), each result on disk as it ends."""
    if argv[:1] == ["--one"]:
        return run_one(argv[1:])
    dry, cpu = "--dry-run" in argv, "--cpu" in argv
    only = [name for name in argv if name not in ("--dry-run", "--cpu")]
    unknown = [name for name in only if name not in CHECKS_BY_NAME]
    if unknown:
        print(f"gpu_check: no check named {unknown}; the checks: {', '.join(c.name for c in CHECKS)}")
        return 2
    out = os.path.abspath(os.environ.get("GPU_CHECK_OUT", "gpu_check_out"))
    os.makedirs(out, exist_ok=True)
    report = Report(out, dry, cpu)
    if dry:
        for check in CHECKS:
            report.say(f"check {check.name}: {check.limit_s} s, {check.ranks or 'no'} launched ranks")
        report.say(f"preflight {PREFLIGHT_S} s + checks {sum(c.limit_s for c in CHECKS)} s; budget {BUDGET_S} s")
    elif not cpu and not torch.cuda.is_available():
        nothing = "gpu_check: FAILED: no CUDA GPU is visible (torch.cuda.is_available() is False); nothing was checked"
        report.say(nothing)
        report.write(finished=True)
        return 1
    signal.signal(signal.SIGTERM, stop_on_signal)
    signal.signal(signal.SIGINT, stop_on_signal)
    try:
        report.start("preflight")
        backend = "gloo" if dry or cpu else "nccl"
        ok, line, trace = in_own_process(["--one", f"preflight:{backend}"], PREFLIGHT_S * SCALE, out)
        report.say(f"{'PASS' if ok else 'FAIL'} preflight ({time.monotonic() - STARTED:.0f} s): {line}")
        report.add({"name": "preflight", "ok": ok, "line": line}, trace)
        if ok and not dry:
            run_checks(report, [c for c in CHECKS + TEST_CHECKS if c.name in only] if only else CHECKS, cpu)
    except Stopped as stopped:
        report.say(f"STOPPED {report.running}: {stopped}; it was killed and its stacks kept")
        report.add({"name": report.running, "ok": False, "line": f"stopped: {stopped}"}, stopped.trace)
    failed = [r["name"] for r in report.results if not r["ok"]]
    report.say(
        f"\ngpu_check: {len(report.results) - len(failed)} of {len(report.results)} passed in "
        f"{time.monotonic() - STARTED:.0f} s" + (f"; failed or not run: {failed}" if failed else "")
    )
    report.write(finished=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
