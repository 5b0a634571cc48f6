"""The bodies of scripts/gpu_check.py's checks: each returns its one-line result or raises.

On a CUDA GPU they run on ``cuda:0`` with NCCL (gloo for the 2-rank check).
Where no GPU is visible, or ``GPU_CHECK_CPU=1`` (``gpu_check.sh --cpu``),
the same bodies run on the CPU with gloo and smaller models, so that a
mistake in a check is found here, before the GPU's few minutes (gpu_check.py
names the three with nothing to run on a CPU: peak CUDA memory, the
CUDA-marked tests, a stall on the device). ``hang_dump`` and
``rank_with_hang_dump`` turn faulthandler on in a check's process and in each
rank it launches, so that a check killed at its limit says where it hung.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import faulthandler
import os
import signal
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from typing import IO, Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from host_reads import SHAPES, Shape, by_file, counting_reads, expected_reads
from local_ranks import launch
from torchreplicate import replicate
from torchreplicate.faults.watchdog import StallWatch

CUDA = torch.cuda.is_available() and os.environ.get("GPU_CHECK_CPU") != "1"
DEVICE = "cuda" if CUDA else "cpu"
BACKEND = "nccl" if CUDA else "gloo"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "src", "torchreplicate")
ROUNDS, STEPS = (7, 20) if CUDA else (2, 3)
SLEEP_CYCLES = 40_000_000  # torch.cuda._sleep before each bucket launch: ~20 ms at 2 GHz


# -- where a check hangs: faulthandler in the check's process and in its launched ranks -------


def seconds_left(spare_s: float = 1.0) -> float:
    """Seconds until the check's process is killed (``GPU_CHECK_DEADLINE``, a ``time.time()`` that
    scripts/gpu_check.py sets), less ``spare_s``; 60 s where no deadline is set (a body run by hand)."""
    deadline = os.environ.get("GPU_CHECK_DEADLINE")
    if deadline is None:
        return 60.0
    return max(1.0, float(deadline) - time.time() - spare_s)


@contextlib.contextmanager
def hang_dump(path: Optional[str], dump_at: float) -> Iterator[None]:
    """faulthandler on for the block: every thread's Python stack is written to ``path`` (stderr where
    None) at the wall-clock time ``dump_at`` (``time.time()``) if the block still runs then (its limit
    is near: where it hangs), on SIGUSR1 (the parent, stopped, asks where the check is), and on a fatal
    signal (SIGSEGV, SIGABRT). A file left empty is removed at the end; a killed process leaves it."""
    file: IO[str] = open(path, "w") if path else sys.stderr  # noqa: SIM115 (closed below, after faulthandler lets go)
    faulthandler.enable(file, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file, all_threads=True)
    faulthandler.dump_traceback_later(max(0.1, dump_at - time.time()), exit=False, file=file)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        faulthandler.unregister(signal.SIGUSR1)
        faulthandler.disable()
        if path:
            file.close()
            if os.path.getsize(path) == 0:
                os.remove(path)


def rank_with_hang_dump(fn: Callable[[], str], dump_at: float, hang_file: Optional[str]) -> str:
    """A check's body as a launched rank (``launch(rank_with_hang_dump, ranks, (fn, dump_at, hang_file))``):
    ``fn()`` under ``hang_dump``, its stacks in ``hang_file`` with ``{rank}`` filled in (stderr where None)."""
    path = hang_file.format(rank=os.environ.get("RANK", "0")) if hang_file else None
    with hang_dump(path, dump_at):
        return fn()


def hang_for_test() -> str:
    """The hidden checks ``_hang`` and ``_hang_rank`` (run by name, by tests/test_gpu_check.py only):
    sleeps past any limit, in Python, so that the faulthandler stacks name this function."""
    until = time.monotonic() + 120
    while time.monotonic() < until:
        time.sleep(0.05)
    return "did not hang"


def bn_model(width: int = 512) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(width, width), nn.BatchNorm1d(width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10)).to(DEVICE)


def batch(rank: int, step: int, width: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(32, width, generator=g).to(DEVICE), torch.randint(0, 10, (32,), generator=g).to(DEVICE)


def with_reducer(model: nn.Module, **options: Any) -> nn.Module:
    """``replicate(model)`` with its reducer installed even at world size 1 (where none is built)."""
    replicated = replicate(model, **options)
    state = replicate.state(replicated)
    if state.reducer is None:
        state.make_reducer()
    return replicated


def ddp(model: nn.Module, **options: Any) -> nn.parallel.DistributedDataParallel:
    return nn.parallel.DistributedDataParallel(model, device_ids=[0] if CUDA else None, **options)


def step(model: nn.Module, optimizer: torch.optim.Optimizer, data: tuple[torch.Tensor, torch.Tensor]) -> None:
    nn.functional.cross_entropy(model(data[0]).float(), data[1]).backward()
    optimizer.step()
    optimizer.zero_grad()


def sgd(model: nn.Module, lr: float = 0.01) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=lr)


def ws1() -> None:
    dist.init_process_group(BACKEND)
    if CUDA:
        torch.cuda.set_device(0)


def done() -> None:
    dist.barrier()
    dist.destroy_process_group()


def assert_same(ours: nn.Module, theirs: nn.Module, what: str, grads: bool = False) -> None:
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        a, b = (p.grad, q.grad) if grads else (p, q)
        assert a is not None and b is not None and torch.equal(a, b), f"{name}: {what}: not bitwise equal"


# -- 1. the sync audit over the shapes of issue 47's item 1 ----------------------------------

AUDIT = [(p, {}) for p in (*SHAPES, "unused", "tied_unused")] + [
    ("tied", {"tied_split": True}),
    ("batchnorm", {"graph": "dynamic"}),
]


@contextlib.contextmanager
def syncs_seen() -> Iterator[list[str]]:
    """``torch.cuda.set_sync_debug_mode("warn")``: every host synchronisation, by the innermost library
    frame ("reducer/flags.py:431"), or "outside the library: file:line"."""
    seen: list[str] = []

    def show(message: Any, category: Any, filename: str, lineno: int, *rest: Any, **kw: Any) -> None:
        if "synchroniz" not in str(message):
            return
        stack = traceback.extract_stack()[:-1]
        ours = [f for f in stack if f.filename.startswith(PACKAGE)]
        frame = ours[-1] if ours else stack[-1]
        where = os.path.relpath(frame.filename, PACKAGE) if ours else f"outside the library: {frame.filename}"
        seen.append(f"{where}:{frame.lineno}")

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield seen
        finally:
            torch.cuda.set_sync_debug_mode("default")


def check_sync_audit() -> str:
    """Steady steps of every shape: the CPU counter's reads equal the expected ones (none, or the one
    inherent read), and on CUDA the sync-debug mode sees no synchronisation beyond them."""
    ws1()
    problems, syncs = [], 0
    for pattern, options in AUDIT:
        label = pattern + "".join(f" {k}={v}" for k, v in options.items())
        shape = Shape(pattern, 0, DEVICE, unused_rank=0, force_reducer=True, **options)
        for i in range(3):
            shape.step(i)
        for i in range(3, 6):
            with counting_reads() as counts:
                shape.step(i)
            if (got := by_file(dict(counts))) != (want := expected_reads(pattern, i, True, **options)):
                problems.append(f"{label} step {i}: reads {got}, expected {want}")
        if not CUDA:
            continue
        torch.cuda.synchronize()
        for i in range(6, 9):
            with syncs_seen() as seen:
                shape.step(i)
            allowed = collections.Counter(k.split(" ")[0] for k in expected_reads(pattern, i, True, **options))
            found = collections.Counter(s.rsplit(":", 1)[0] for s in seen)
            syncs += len(seen)
            if any(n > allowed[where] for where, n in found.items()):
                problems.append(f"{label} step {i}: synchronisations at {seen}, allowed {dict(allowed)}")
    done()
    assert not problems, "; ".join(problems)
    tail = f", {syncs} synchronisations, each an expected read" if CUDA else " (CPU: counter only)"
    return f"{len(AUDIT)} shapes, steady steps: host reads as expected{tail}"


# -- 2. bitwise against local training, plain and with the stream stressed -------------------


def check_ws1_bitwise() -> str:
    ws1()
    ours, local = with_reducer(bn_model()), bn_model()
    opt_ours, opt_local = sgd(ours), sgd(local)
    for i in range(5):
        step(ours, opt_ours, batch(0, i))
        step(local, opt_local, batch(0, i))
    assert_same(ours, local, "after 5 steps against local training")
    done()
    return "5 steps bitwise equal to local training"


def check_stressed() -> str:
    """The whole step on a side stream (the rebuild after step 0 too), and the stream kept busy
    (``torch.cuda._sleep``) before every bucket's all-reduce: still bitwise local training."""
    ws1()
    launches = 0
    all_reduce = dist.all_reduce

    def late_all_reduce(*args: Any, **kwargs: Any) -> Any:
        nonlocal launches
        launches += 1
        if CUDA:
            torch.cuda._sleep(SLEEP_CYCLES)
        return all_reduce(*args, **kwargs)

    ours, local = with_reducer(bn_model(), bucket_cap_mb=1), bn_model()
    opt_ours, opt_local = sgd(ours), sgd(local)
    data = [batch(0, i) for i in range(5)]
    side = torch.cuda.Stream() if CUDA else None
    if side is not None:
        side.wait_stream(torch.cuda.current_stream())
    dist.all_reduce = late_all_reduce
    try:
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            for item in data:
                step(ours, opt_ours, item)
                step(local, opt_local, item)
    finally:
        dist.all_reduce = all_reduce
    if CUDA:
        torch.cuda.synchronize()
    assert launches >= 10, f"only {launches} all-reduces were stressed"
    assert_same(ours, local, "after 5 stressed steps on a side stream against local training")
    done()
    return f"5 steps on a side stream, {launches} all-reduces after a busy stream: bitwise local training"


# -- 3. comm hook, bf16, reduce_dtype against DDP -----------------------------------------


def check_precision() -> str:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook, fp16_compress_hook
    from torch.distributed.fsdp import MixedPrecisionPolicy

    ws1()
    data = batch(0, 0)
    # DDP's fp16 hook on both engines: bitwise
    ours, theirs = replicate(bn_model()), ddp(bn_model())
    ours.register_comm_hook(None, fp16_compress_hook)  # builds the reducer at world size 1 too
    theirs.register_comm_hook(None, fp16_compress_hook)
    for model in (ours, theirs):
        nn.functional.cross_entropy(model(data[0]), data[1]).backward()
    assert_same(ours, theirs.module, "fp16_compress_hook against DDP's", grads=True)
    # reduce_dtype=bf16 against DDP's bf16 hook: both round the fp32 gradients to bf16 once (world size 1)
    ours = with_reducer(bn_model(), mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.bfloat16))
    theirs = ddp(bn_model())
    theirs.register_comm_hook(None, bf16_compress_hook if CUDA else bf16_hook_on_cpu)
    for model in (ours, theirs):
        nn.functional.cross_entropy(model(data[0]), data[1]).backward()
    assert_same(ours, theirs.module, "reduce_dtype=bf16 against DDP's bf16_compress_hook", grads=True)
    # bf16 compute, fp32 averaging (no BatchNorm: its fp32 statistics refuse bf16) against fp32 training
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mixed, reference = with_reducer(mlp(512, 4), mp_policy=policy), mlp(512, 4)
    for model in (mixed, reference):
        nn.functional.cross_entropy(model(data[0]).float(), data[1]).backward()
    for (name, p), q in zip(mixed.named_parameters(), reference.parameters(), strict=True):
        assert p.grad is not None and p.grad.dtype == torch.float32, f"{name}: {p.grad}"
        torch.testing.assert_close(p.grad, q.grad, rtol=5e-2, atol=5e-3, msg=lambda m, n=name: f"{n}: {m}")
    done()
    return "fp16 hook and reduce_dtype=bf16 bitwise DDP's; bf16 compute within bf16 rounding of fp32"


def bf16_hook_on_cpu(state, bucket):  # type: ignore[no-untyped-def]  (DDP reads the annotations: none)
    """What DDP's ``bf16_compress_hook`` does (it refuses gloo on the CPU): to bf16, divide, all-reduce, back."""
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(dist.get_world_size())
    work = dist.all_reduce(compressed, async_op=True)
    return work.get_future().then(lambda fut: buffer.copy_(fut.value()[0]))


# -- 4. two gloo ranks sharing the GPU -----------------------------------------------------


def check_gloo2_vs_ddp() -> str:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if CUDA:
        torch.cuda.set_device(0)
    ours = replicate(bn_model(), bucket_cap_mb=1)
    theirs = nn.parallel.DistributedDataParallel(bn_model(), bucket_cap_mb=1)
    opt_ours, opt_theirs = sgd(ours), sgd(theirs)
    for i in range(5):
        step(ours, opt_ours, batch(rank, i))
        step(theirs, opt_theirs, batch(rank, i))
    assert_same(ours, theirs.module, f"rank {rank} after 5 steps against DDP")
    done()
    return f"rank {rank}: 5 steps bitwise DDP's"


# -- 5. overhead against DDP, compute-bound and launch-bound; 6. peak memory ------------------


def mlp(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers = [m for _ in range(depth) for m in (nn.Linear(width, width), nn.ReLU())]
    return nn.Sequential(*layers, nn.Linear(width, 10)).to(DEVICE)


MODELS = {  # name: (width, depth, batch); on the CPU a few small steps (the body, not a timing)
    "compute-bound": (4096, 8, 256) if CUDA else (256, 2, 32),
    "launch-bound": (64, 48, 32) if CUDA else (64, 8, 32),
}


def timed_steps(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> float:
    """ms per step over STEPS steps: CUDA events on the GPU, the host clock on the CPU."""
    if CUDA:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    began = time.perf_counter()
    for _ in range(STEPS):
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    if not CUDA:
        return (time.perf_counter() - began) * 1e3 / STEPS
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / STEPS


def check_overhead() -> str:
    ws1()
    lines = []
    for label, (width, depth, rows) in MODELS.items():
        engines = {"local": mlp(width, depth), "ours": with_reducer(mlp(width, depth)), "ddp": ddp(mlp(width, depth))}
        optimizers = {name: sgd(m, 1e-4) for name, m in engines.items()}
        x = torch.randn(rows, width, device=DEVICE)
        for name in engines:
            timed_steps(engines[name], optimizers[name], x)  # warm-up: allocator, cuBLAS, DDP's buckets
        times: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(ROUNDS):  # interleaved rounds
            for name in engines:
                times[name].append(timed_steps(engines[name], optimizers[name], x))

        def ratio(a: str, b: str, times: dict[str, list[float]] = times) -> float:
            return statistics.median(x / y for x, y in zip(times[a], times[b], strict=True))

        ms = {n: statistics.median(v) for n, v in times.items()}
        lines.append(
            f"{label}: ms/step local {ms['local']:.2f} ours {ms['ours']:.2f} DDP {ms['ddp']:.2f}, "
            f"ours/DDP {ratio('ours', 'ddp'):.3f}, ours/local {ratio('ours', 'local'):.3f}, "
            f"DDP/local {ratio('ddp', 'local'):.3f}"
        )
    done()
    return "; ".join(lines)


def peak_memory(engine: str) -> float:
    """Peak CUDA memory (MiB) of 3 steps of the compute-bound MLP, in a fresh process of its own."""
    ws1()
    width, depth, rows = MODELS["compute-bound"]
    model = mlp(width, depth)
    model = {"local": lambda m: m, "ours": with_reducer, "ddp": ddp}[engine](model)
    optimizer = sgd(model, 1e-4)
    x = torch.randn(rows, width, device=DEVICE)
    for _ in range(3):
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2**20
    done()
    return peak


def check_memory() -> str:
    """Peak CUDA memory of ours and of DDP, each engine in its own process, the two processes at once
    (each its own world of size 1; a process's peak is its own): one process start's time, not two."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        timeout_s = seconds_left(1.0)
        futures = {e: pool.submit(launch, peak_memory, 1, (e,), timeout_s=timeout_s) for e in ("ours", "ddp")}
        peaks = {engine: future.result()[0] for engine, future in futures.items()}
    return (
        "peak MiB, each engine in its own process: "
        + ", ".join(f"{k} {v:.0f}" for k, v in peaks.items())
        + f"; ours/DDP {peaks['ours'] / peaks['ddp']:.3f}"
    )


# -- 7. the suite's CUDA tests; 8. compile; 9. a stall on the device, last ---------------------


PYTEST_PER_TEST_S = 25  # pytest-timeout's limit for each of tests/test_cuda.py's tests (it dumps the stacks)


def run_pytest() -> str:
    """tests/test_cuda.py alone (not the suite: collecting its ~70 modules takes 25 s), without the cache
    and hypothesis's plugin, each test limited to ``PYTEST_PER_TEST_S``, the whole run to the check's
    deadline; fails where a test failed or skipped (on a GPU none may skip)."""
    command = [sys.executable, "-m", "pytest", "-q", "-rs", "-m", "cuda", "-p", "no:cacheprovider"]
    command += ["-p", "no:hypothesispytest", f"--timeout={PYTEST_PER_TEST_S}", "tests/test_cuda.py"]
    done_ = subprocess.run(command, cwd=ROOT, timeout=seconds_left(1.0), capture_output=True, text=True)
    tail = (done_.stdout.strip().splitlines() or ["(no output)"])[-1]
    if done_.returncode != 0 or "skipped" in tail or "passed" not in tail:
        raise AssertionError(f"{done_.stdout[-3000:]}\nexit {done_.returncode}: {tail}")
    return tail


COMPILE_CAP_MB = 1  # bn_model's Linear(512)s hold 1 MiB each: dynamo splits its graph into 4 pieces at this cap
COMPILE_STEPS = 3


class OwnForward(nn.Module):
    """``module`` behind a forward of its own. Dynamo does not compile the frames of torch.nn's own
    modules (nn.Sequential's forward) that DDP's forward calls: ``torch.compile`` of DDP around a bare
    nn.Sequential runs it eagerly, with no graph; around this forward, DDP's job is compiled and split."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


def counting_inductor() -> tuple[Callable[..., Any], list[int]]:
    """Inductor (``torch.compile``'s default backend) as a backend that counts the graphs it is given:
    under a DDP forward, dynamo's ``DDPOptimizer`` hands it each piece of the split graph."""
    from torch._inductor.compile_fx import compile_fx

    graphs = [0]

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs[0] += 1
        return compile_fx(gm, example_inputs)

    return backend, graphs


def compiled_verdict(ours: nn.Module, theirs: nn.Module, graphs: tuple[int, int], what: str) -> str:
    """The compile check's verdict: ours' compiled graph split as DDP's (the same number of pieces, more
    than one) and every gradient bitwise equal to DDP's compiled job's (``theirs``: DDP's module);
    raises otherwise."""
    assert graphs[0] == graphs[1] and graphs[0] > 1, (
        f"{what}: ours compiled {graphs[0]} graphs, DDP {graphs[1]}: not split at the buckets as DDP's"
    )
    assert_same(ours, theirs, f"{what}: gradients against DDP's compiled job", grads=True)
    return f"torch.compile: {graphs[0]} graphs, gradients bitwise equal to DDP's compiled job"


def check_compile() -> str:
    """The same job compiled (inductor) under ours and under DDP, both split at 1 MiB buckets by dynamo's
    ``DDPOptimizer``: the same graphs, so the same kernels, whichever this device's are; the gradients
    bitwise equal at every step, and the parameters after the SGD steps. (Not against eager: inductor's
    kernels and eager's round differently, by how much depends on the device: up to 3e-4 on a CPU.)"""
    import torch._dynamo
    from torch._inductor import config

    ws1()
    torch._dynamo.reset()
    # inductor's deterministic mode (torch 2.13 has it): no benchmarked choice that changes the numerics
    # (on CUDA, a reduction's launch config), so that the two compilations of one graph run the same kernels
    patch = config.patch(deterministic=True) if hasattr(config, "deterministic") else contextlib.nullcontext()
    with patch:
        ours = with_reducer(OwnForward(bn_model()), bucket_cap_mb=COMPILE_CAP_MB)
        theirs = ddp(OwnForward(bn_model()), bucket_cap_mb=COMPILE_CAP_MB)
        engines = []
        for model in (ours, theirs):
            backend, graphs = counting_inductor()
            engines.append((torch.compile(model, backend=backend), sgd(model), graphs))
        for i in range(COMPILE_STEPS):
            x, y = batch(0, i)
            for compiled, _, _ in engines:
                nn.functional.cross_entropy(compiled(x), y).backward()
            line = compiled_verdict(ours, theirs.module, (engines[0][2][0], engines[1][2][0]), f"step {i}")
            for _, optimizer, _ in engines:
                optimizer.step()
                optimizer.zero_grad()
        assert_same(ours, theirs.module, f"after {COMPILE_STEPS} compiled steps against DDP's")
    torch._dynamo.reset()
    done()
    return line


def device_cycles_per_ms() -> float:
    """``torch.cuda._sleep`` cycles per ms of this GPU, timed by CUDA events over about 50 ms after a warm-up
    (the kernel loaded, the clock up)."""
    torch.cuda._sleep(10_000_000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(100_000_000)
    end.record()
    end.synchronize()
    return 100_000_000 / start.elapsed_time(end)


def check_observers() -> str:
    """The step recorder on the module's device clock (observe/timeline.py): on CUDA each record comes
    one step late, and its step time is the device's (a 30 ms device sleep per step shows in it while
    the host runs ahead); on the CPU, the host's clock and no delay. Then the link calibration of the
    tuned opt-in (layout/link.py), timed on the device."""
    from torchreplicate.observe import timeline

    ws1()
    model, records = with_reducer(bn_model()), []
    recorder = timeline.subscribe(model, records.append)
    clock = type(recorder.clock).__name__
    assert clock == ("DeviceClock" if CUDA else "HostClock"), clock
    cycles = int(30 * device_cycles_per_ms()) if CUDA else 0
    data, delay = batch(0, 0), recorder.clock.delay
    for i in range(5):
        out = model(data[0])
        out = Stall.apply(out, cycles) if CUDA else out
        nn.functional.cross_entropy(out, data[1]).backward()
        assert len(records) == i + 1 - delay, f"step {i}: {len(records)} records, delay {delay}"
    recorder.flush()
    timeline.unsubscribe(model, records.append)
    step_ms = [(b.end_ns - a.end_ns) / 1e6 for a, b in zip(records[:-1], records[1:], strict=True)]
    exposed = [r.exposed_ns / 1e6 for r in records]
    assert len(records) == 5 and all(e >= 0 for e in exposed), (len(records), exposed)
    if CUDA:
        assert min(step_ms) >= 21, f"the device clock missed the 30 ms device sleep per step: {step_ms}"
    # the tuned opt-in's link calibration: CUDA-event samples of the device's all-reduce, not the enqueue
    from torchreplicate.faults.wire import Watch
    from torchreplicate.reducer.layout.link import measure_link

    link = measure_link(dist.group.WORLD, torch.float32, torch.device(DEVICE), 64 * 2**20, Watch())
    assert link.latency_s >= 0 and link.bytes_per_s > 0, link
    done()
    return (
        f"{clock}, delay {delay}: step ms {[round(m, 1) for m in step_ms]}, exposed ms "
        f"{[round(e, 2) for e in exposed]}; link: latency {link.latency_s * 1e6:.1f} us, "
        f"{link.bytes_per_s / 1e9:.1f} GB/s"
    )


class Stall(torch.autograd.Function):
    """Identity; its backward keeps the device busy ``cycles`` (the step's last gradient waits on it)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cycles: int) -> torch.Tensor:
        ctx.cycles = cycles
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        torch.cuda._sleep(ctx.cycles)
        return grad, None


def check_stall() -> str:
    """A step whose device work outlasts ``stall_timeout`` (1 s) at world size 1 on NCCL, with
    ``graph="dynamic"`` (the flags are read in the step): the read polls its event through the
    watchdog, which looks at the (absent) peers at 1 s and 2 s and waits on; the host does not spin
    a core; the step ends with the right gradients. Each stage is printed as it ends."""
    ws1()
    model, reference = with_reducer(bn_model(), graph="dynamic"), bn_model()
    state = replicate.state(model)
    state.probe.watch = StallWatch(dist.group.WORLD, 1.0, key="gpu_check_stall", device_type="cuda")
    looks: list[float] = []
    look = state.probe.watch.look_at_peers
    state.probe.watch.look_at_peers = lambda waited: (looks.append(waited), look(waited))[-1]  # type: ignore[method-assign]
    data = batch(0, 0)
    step(model, sgd(model, 0.0), data)  # the first step learns; the stall comes in the second
    cycles_per_ms = device_cycles_per_ms()
    print(f"stall: {cycles_per_ms:.0f} cycles per ms", flush=True)
    wall, cpu = time.perf_counter(), time.process_time()
    out = Stall.apply(model(data[0]), int(3000 * cycles_per_ms))  # its backward: 3 s on the device, first
    nn.functional.cross_entropy(out, data[1]).backward()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    print(f"stall: backward took {wall:.1f} s wall, {cpu:.2f} s CPU; looked at peers at {looks}", flush=True)
    nn.functional.cross_entropy(reference(data[0]), data[1]).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    assert wall >= 2.0 and len(looks) >= 1, f"the step did not stall past stall_timeout: {wall:.1f} s, {looks}"
    assert cpu < 0.5 * wall, f"the host spun while the device worked: {cpu:.2f} s CPU in {wall:.1f} s"
    state.probe.watch.stop()
    done()
    return f"a {wall:.1f} s device stall: polled ({cpu:.2f} s CPU), peers looked at after {looks} s, gradients right"
