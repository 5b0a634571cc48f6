"""The first-GPU check (scripts/gpu_check.sh runs it): a preflight, then one line per check, then a summary.

    python scripts/gpu_check.py [--dry-run] [NAME ...]

Built for one short run on one GPU (torch 2.11 on Python 3.12, or 2.13):

- a preflight first (versions, the import, one all-reduce on NCCL; at most
  ``PREFLIGHT_S``): where it fails, nothing else runs;
- then each check in its own process, with its own limit (``CHECKS``: name,
  ranks, seconds), killed at it; rerun one alone by naming it; a check that
  would end past ``BUDGET_S`` is not started, and the summary says so;
- every failure prints its error's last line; the full tracebacks, the log
  and ``summary.json`` go to the folder ``$GPU_CHECK_OUT`` names (default
  ``gpu_check_out``), three files;
- ``--dry-run`` (no GPU needed) lists every check with its limit and runs
  the preflight's CPU part (versions, the import, one gloo all-reduce).

The checks, in order of risk; where one compares, it compares with plain
local training or with DDP on the same device:

1. ``sync_free``: world size 1 on NCCL with a reducer forced to exist (at
   world size 1 ``replicate()`` builds none), a model with BatchNorm at the
   defaults; ``torch.cuda.set_sync_debug_mode("error")`` around 3 steady
   steps: any host synchronisation in a step raises, and the line says where.
2. ``ws1_bitwise``: the same, 5 steps, against local training: bitwise.
3. ``comm_hook``, ``bf16``: DDP's ``fp16_compress_hook`` on both, bitwise;
   mp_policy (bf16 compute, fp32 averaging) within bf16 rounding of fp32.
4. ``gloo2_vs_ddp``: 2 gloo ranks sharing the GPU with CUDA tensors, ours
   against DDP on the same batches (BatchNorm, 2 buckets), 5 steps.
5. ``ws1_overhead``: an MLP (8 x Linear(4096), batch 256) at world size 1 on
   NCCL: plain, ours with its reducer, DDP; interleaved rounds timed by CUDA
   events; ours/DDP and each against plain.
6. ``memory``: peak CUDA memory of 3 steps, ours against DDP (world size 1).
7. ``pytest_cuda``: the suite's CUDA-marked tests (tests/test_cuda.py).
8. ``compile``: ``torch.compile`` of the replicated model against eager.

Exits 1, saying why, when no CUDA GPU is visible: nothing is skipped.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from torchreplicate import replicate

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from local_ranks import launch  # noqa: E402  (tests/: the tests' launcher, a deadline that kills every rank)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WIDTH, DEPTH, BATCH = 4096, 8, 256
ROUNDS, STEPS = 7, 20


def bn_model(width: int = 512) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(width, width), nn.BatchNorm1d(width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10)).cuda()


def batch(rank: int, step: int, width: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(32, width, generator=g).cuda(), torch.randint(0, 10, (32,), generator=g).cuda()


def with_reducer(model: nn.Module) -> nn.Module:
    """``replicate(model)`` with its reducer installed even at world size 1 (where none is built)."""
    replicated = replicate(model)
    state = replicate.state(replicated)
    if state.reducer is None:
        state.reducer = state.build_reducer()
    return replicated


def step(model: nn.Module, optimizer: torch.optim.Optimizer, data: tuple[torch.Tensor, torch.Tensor]) -> None:
    nn.functional.cross_entropy(model(data[0]), data[1]).backward()
    optimizer.step()
    optimizer.zero_grad()


def nccl_ws1() -> None:
    dist.init_process_group("nccl")
    torch.cuda.set_device(0)


def done() -> None:
    dist.barrier()
    dist.destroy_process_group()


# -- the checks (each runs in launched processes and returns a one-line result) -------------


def check_sync_free_steps() -> str:
    nccl_ws1()
    model = with_reducer(bn_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for i in range(3):
        step(model, optimizer, batch(0, i))
    data = [batch(0, 10 + i) for i in range(3)]  # made before: the batch's own copy to the GPU is not the step's
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for item in data:
            step(model, optimizer, item)
    except RuntimeError as error:
        frames = [f for f in traceback.extract_tb(error.__traceback__) if "torchreplicate" in f.filename]
        where = f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno} {frames[-1].line}" if frames else "?"
        raise AssertionError(f"a host sync in a steady step at {where}: {str(error).splitlines()[0]}") from None
    finally:
        torch.cuda.set_sync_debug_mode("default")
    done()
    return "3 steady steps, no host synchronisation"


def check_ws1_bitwise() -> str:
    nccl_ws1()
    ours, local = with_reducer(bn_model()), bn_model()
    opt_ours = torch.optim.SGD(ours.parameters(), lr=0.01)
    opt_local = torch.optim.SGD(local.parameters(), lr=0.01)
    for i in range(5):
        step(ours, opt_ours, batch(0, i))
        step(local, opt_local, batch(0, i))
    for (name, p), q in zip(ours.named_parameters(), local.parameters(), strict=True):
        assert torch.equal(p, q), f"{name} differs from local training after 5 steps"
    done()
    return "5 steps bitwise equal to local training"


def check_gloo2_vs_ddp() -> str:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.cuda.set_device(0)
    ours = replicate(bn_model(), bucket_cap_mb=1)
    theirs = nn.parallel.DistributedDataParallel(bn_model(), bucket_cap_mb=1)
    opt_ours = torch.optim.SGD(ours.parameters(), lr=0.01)
    opt_theirs = torch.optim.SGD(theirs.parameters(), lr=0.01)
    for i in range(5):
        step(ours, opt_ours, batch(rank, i))
        step(theirs, opt_theirs, batch(rank, i))
    for (name, p), q in zip(ours.named_parameters(), theirs.module.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"rank {rank} {n}: {m}")
    done()
    return f"rank {rank}: 5 steps within 1e-5 of DDP"


def check_bf16() -> str:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    nccl_ws1()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    ours, reference = with_reducer_mp(bn_model(), policy), bn_model()
    data = batch(0, 0)
    nn.functional.cross_entropy(ours(data[0]).float(), data[1]).backward()
    nn.functional.cross_entropy(reference(data[0]), data[1]).backward()
    for (name, p), q in zip(ours.named_parameters(), reference.parameters(), strict=True):
        assert p.grad is not None and p.grad.dtype == torch.float32, f"{name}: {p.grad}"
        torch.testing.assert_close(p.grad, q.grad, rtol=5e-2, atol=5e-3, msg=lambda m, n=name: f"{n}: {m}")
    done()
    return "bf16 compute, fp32 gradients within bf16 rounding of fp32 training"


def with_reducer_mp(model: nn.Module, policy: Any) -> nn.Module:
    replicated = replicate(model, mp_policy=policy)
    state = replicate.state(replicated)
    if state.reducer is None:
        state.reducer = state.build_reducer()
    return replicated


def check_comm_hook() -> str:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

    nccl_ws1()
    ours = replicate(bn_model())
    ours.register_comm_hook(None, fp16_compress_hook)  # builds the reducer at world size 1 too
    theirs = nn.parallel.DistributedDataParallel(bn_model(), device_ids=[0])
    theirs.register_comm_hook(None, fp16_compress_hook)
    for model in (ours, theirs):
        data = batch(0, 0)
        nn.functional.cross_entropy(model(data[0]), data[1]).backward()
    for (name, p), q in zip(ours.named_parameters(), theirs.module.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
    done()
    return "fp16_compress_hook: gradients bitwise DDP's"


def check_compile() -> str:
    nccl_ws1()
    eager, compiled_base = with_reducer(bn_model()), with_reducer(bn_model())
    compiled = torch.compile(compiled_base)
    for model in (eager, compiled):
        data = batch(0, 0)
        nn.functional.cross_entropy(model(data[0]), data[1]).backward()
    for (name, p), q in zip(eager.named_parameters(), compiled_base.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    done()
    return "torch.compile: gradients within 1e-4 of eager"


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(DEPTH) for m in (nn.Linear(WIDTH, WIDTH), nn.ReLU())]).cuda()


def timed_steps(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(STEPS):
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / STEPS


def check_ws1_overhead() -> str:
    nccl_ws1()
    engines = {
        "local": mlp(),
        "ours": with_reducer(mlp()),
        "ddp": nn.parallel.DistributedDataParallel(mlp(), device_ids=[0]),
    }
    optimizers = {name: torch.optim.SGD(m.parameters(), lr=1e-4) for name, m in engines.items()}
    x = torch.randn(BATCH, WIDTH, device="cuda")
    for name in engines:
        timed_steps(engines[name], optimizers[name], x)  # warm-up: allocator, cuBLAS, DDP's buckets
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(ROUNDS):
        for name in engines:
            times[name].append(timed_steps(engines[name], optimizers[name], x))
    done()
    ratio = {n: statistics.median(a / b for a, b in zip(v, times["local"], strict=True)) for n, v in times.items()}
    ms = {n: statistics.median(v) for n, v in times.items()}
    return (
        f"ms/step local {ms['local']:.2f}, ours {ms['ours']:.2f}, DDP {ms['ddp']:.2f}; "
        f"ours/DDP {statistics.median(a / b for a, b in zip(times['ours'], times['ddp'], strict=True)):.3f}, "
        f"ours/local {ratio['ours']:.3f}, DDP/local {ratio['ddp']:.3f}"
    )


def check_memory() -> str:
    nccl_ws1()
    peaks = {}
    for name in ("ours", "ddp"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        model = with_reducer(mlp()) if name == "ours" else nn.parallel.DistributedDataParallel(mlp(), device_ids=[0])
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
        x = torch.randn(BATCH, WIDTH, device="cuda")
        for _ in range(3):
            model(x).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated() / 2**20
        del model, optimizer, x
    done()
    return f"peak MiB ours {peaks['ours']:.0f}, DDP {peaks['ddp']:.0f}, ratio {peaks['ours'] / peaks['ddp']:.3f}"


def run_pytest() -> str:
    done_ = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "tests"],
        cwd=ROOT,
        timeout=CHECKS_BY_NAME["pytest_cuda"].limit_s - 5,
        capture_output=True,
        text=True,
    )
    tail = (done_.stdout.strip().splitlines() or ["(no output)"])[-1]
    if done_.returncode != 0:
        raise AssertionError(f"{done_.stdout[-3000:]}\nexit {done_.returncode}: {tail}")
    return tail


class Check(NamedTuple):
    name: str
    fn: Callable[[], str]
    ranks: int  # launched ranks (0: in the check's own process)
    limit_s: int  # the check's process is killed past it


# In order of risk; the limits add up to BUDGET_S with the preflight (scripts/gpu_check.sh: 300 s in all).
CHECKS = [
    Check("sync_free", check_sync_free_steps, 1, 25),
    Check("ws1_bitwise", check_ws1_bitwise, 1, 20),
    Check("comm_hook", check_comm_hook, 1, 20),
    Check("bf16", check_bf16, 1, 20),
    Check("gloo2_vs_ddp", check_gloo2_vs_ddp, 2, 30),
    Check("ws1_overhead", check_ws1_overhead, 1, 40),
    Check("memory", check_memory, 1, 20),
    Check("pytest_cuda", run_pytest, 0, 40),
    Check("compile", check_compile, 1, 30),
]
CHECKS_BY_NAME = {check.name: check for check in CHECKS}
PREFLIGHT_S = 20
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
            line = check.fn() if check.ranks == 0 else launch(check.fn, check.ranks, timeout_s=check.limit_s - 5)[0]
        result = {"ok": True, "line": line, "traceback": ""}
    except Exception as error:  # the line: the error's last line (for a rank's error, its own last line)
        text = "".join(traceback.format_exception(error))
        result = {"ok": False, "line": last_line(str(error)) or last_line(text), "traceback": text}
    print("RESULT " + json.dumps(result), flush=True)
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["--one"]:
        return run_one(argv[1:])
    dry = "--dry-run" in argv
    only = [name for name in argv if name != "--dry-run"]
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
    elif not torch.cuda.is_available():
        say("gpu_check: FAILED: no CUDA GPU is visible (torch.cuda.is_available() is False); nothing was checked")
        return 1
    ok, line, trace = in_own_process(["--one", f"preflight:{'gloo' if dry else 'nccl'}"], PREFLIGHT_S)
    say(f"{'PASS' if ok else 'FAIL'} preflight ({time.monotonic() - started:.0f} s): {line}")
    results.append({"name": "preflight", "ok": ok, "line": line})
    tracebacks.append(f"== preflight\n{trace}")
    for check in [] if dry or not ok else [c for c in CHECKS if not only or c.name in only]:
        if time.monotonic() - started + check.limit_s > BUDGET_S:
            say(f"NOT RUN {check.name}: its {check.limit_s} s would pass the {BUDGET_S} s budget")
            results.append({"name": check.name, "ok": False, "line": "not run: budget"})
            continue
        at = time.monotonic()
        ok_, line_, trace_ = in_own_process(["--one", check.name], check.limit_s)
        say(f"{'PASS' if ok_ else 'FAIL'} {check.name} ({time.monotonic() - at:.0f} s): {line_}")
        results.append({"name": check.name, "ok": ok_, "line": line_, "seconds": round(time.monotonic() - at, 1)})
        tracebacks.append(f"== {check.name}\n{trace_}")
    failed = [r["name"] for r in results if not r["ok"]]
    say(
        f"\ngpu_check: {len(results) - len(failed)} of {len(results)} passed in {time.monotonic() - started:.0f} s"
        + (f"; failed or not run: {failed}" if failed else "")
    )
    summary = {"torch": torch.__version__, "python": sys.version.split()[0], "dry_run": dry, "results": results}
    with open(os.path.join(out, "summary.json"), "w") as file:
        json.dump(summary, file, indent=1)
    with open(os.path.join(out, "tracebacks.txt"), "w") as file:
        file.write("\n".join(tracebacks))
    with open(os.path.join(out, "log.txt"), "w") as file:
        file.write("\n".join(log) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
