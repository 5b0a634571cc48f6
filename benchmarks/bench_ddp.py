#!/usr/bin/env python
"""Step-time, memory and communication benchmark: ``replicate()`` vs torch DDP.

Usage::

    python benchmarks/bench_ddp.py                 # full run, ~5 min on 2 CPU cores
    python benchmarks/bench_ddp.py --quick         # smoke run, ~1.5 min
    python benchmarks/bench_ddp.py --rounds 30 --models mlp,small --out /tmp/res

Phases (each a separate ``torchreplicate.launch`` of fresh processes, gloo,
one intra-op thread per rank):

1. timing, 2 ranks: engines ``local`` (no communication), ``ddp`` (torch
   DistributedDataParallel defaults), ``ddp_gbv`` (DDP with
   ``gradient_as_bucket_view=True``) and ``ours`` (``replicate()`` defaults)
   live side by side in one process group, each on its own model copy (same
   init) with its own SGD. After a warm-up, every round times a block of K
   steps of each engine, interleaved (the engine order rotates by one each
   round), with a ``dist.barrier()`` before each block. Afterwards, untimed:
   a torch.profiler pass counts collectives and their sizes for every engine,
   and an instrumented pass times the pieces of our reducer.
2. timing, 1 rank: ``local`` vs ``ours`` (plus ``ddp`` and two diagnostic
   engines, see benchmarks/README.md).
3. memory, 2 ranks: each engine in turn, peak RSS increase over the RSS
   of the bare model (method in benchmarks/README.md and in the JSON).

Writes ``<out>/latest.json``, ``<out>/ratios.png`` and ``<out>/latest.md``,
and prints the markdown tables. Timings are reported, never asserted.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from typing import Any, Callable, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MiB = 1024 * 1024

MODEL_NAMES = ("mlp", "gpt", "small")
MODEL_TITLES = {
    "mlp": "MLP 8x Linear(1024,1024)",
    "gpt": "GPT 6L d256 V8192 (tied)",
    "small": "64x (Linear(128)+LayerNorm)",
}
ENGINES_WS2 = ("local", "ddp", "ddp_gbv", "ours")
# world size 1: ``reducer`` is our Reducer forced onto the 1-rank group (what
# replicate() skips at world size 1), ``noop_hooks`` is one empty Python
# post-accumulate-grad hook per parameter (the floor of any Python-hook reducer).
ENGINES_WS1 = ("local", "ours", "ddp", "reducer", "noop_hooks")

GPT_SEQ = 64
GPT_BATCH = 4
GPT_VOCAB = 8192


# --------------------------------------------------------------------------
# models and batches: built identically on every rank from a seed


def build_model(name: str):
    import torch
    import torch.nn.functional as F
    from torch import nn

    if name == "mlp":
        layers: list = []
        for i in range(8):
            layers.append(nn.Linear(1024, 1024))
            if i < 7:
                layers.append(nn.ReLU())
        return nn.Sequential(*layers)
    if name == "small":
        layers = []
        for _ in range(64):
            layers += [nn.Linear(128, 128), nn.LayerNorm(128)]
        return nn.Sequential(*layers)
    if name == "gpt":

        class Block(nn.Module):
            def __init__(self, d: int, heads: int) -> None:
                super().__init__()
                self.heads = heads
                self.ln1 = nn.LayerNorm(d)
                self.qkv = nn.Linear(d, 3 * d)
                self.proj = nn.Linear(d, d)
                self.ln2 = nn.LayerNorm(d)
                self.fc = nn.Linear(d, 4 * d)
                self.out = nn.Linear(4 * d, d)

            def forward(self, x):
                b, t, d = x.shape
                q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
                q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
                return x + self.out(F.gelu(self.fc(self.ln2(x))))

        class GPT(nn.Module):
            def __init__(self, vocab: int = GPT_VOCAB, d: int = 256, layers: int = 6, heads: int = 4) -> None:
                super().__init__()
                self.wte = nn.Embedding(vocab, d)
                self.wpe = nn.Embedding(GPT_SEQ, d)
                self.blocks = nn.ModuleList([Block(d, heads) for _ in range(layers)])
                self.ln_f = nn.LayerNorm(d)
                self.head = nn.Linear(d, vocab, bias=False)
                self.head.weight = self.wte.weight  # tied, as in GPT-2

            def forward(self, idx):
                pos = torch.arange(idx.shape[1], device=idx.device)
                x = self.wte(idx) + self.wpe(pos)
                for block in self.blocks:
                    x = block(x)
                return self.head(self.ln_f(x))

        return GPT()
    raise ValueError(f"unknown model {name!r}")


def make_batch(name: str, rank: int):
    import torch

    g = torch.Generator().manual_seed(1000 + rank)
    if name == "mlp":
        return torch.randn(32, 1024, generator=g), torch.randn(32, 1024, generator=g)
    if name == "small":
        return torch.randn(16, 128, generator=g), torch.randn(16, 128, generator=g)
    if name == "gpt":
        tokens = torch.randint(0, GPT_VOCAB, (GPT_BATCH, GPT_SEQ + 1), generator=g)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].reshape(-1).contiguous()
    raise ValueError(name)


def loss_of(name: str, out, target):
    import torch.nn.functional as F

    if name == "gpt":
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), target)
    return F.mse_loss(out, target)


# --------------------------------------------------------------------------
# engines


class Engine:
    """One model copy, wrapped one way, with its own optimizer."""

    def __init__(self, kind: str, model_name: str, seed: int = 0, model=None) -> None:
        import torch
        import torch.distributed as dist

        self.kind = kind
        self.model_name = model_name
        if model is None:
            torch.manual_seed(seed)
            model = build_model(model_name)
        self.raw = model
        self.keep: list = []  # objects that must stay alive (hooks, reducer)
        if kind == "local":
            self.module = model
        elif kind in ("ddp", "ddp_gbv"):
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.module = DDP(model) if kind == "ddp" else DDP(model, gradient_as_bucket_view=True)
        elif kind == "ours":
            from torchreplicate import replicate

            self.module = replicate(model)
        elif kind == "reducer":
            # Our reducer on the 1-rank group: what its bookkeeping costs when
            # the collectives are (nearly) free. Uses an internal class; see README.
            from torchreplicate.reducer import Reducer

            names, params = zip(*[(n, p) for n, p in model.named_parameters() if p.requires_grad])
            self.keep.append(
                Reducer(
                    list(params),
                    list(names),
                    dist.group.WORLD,
                    bucket_cap_bytes=25 * MiB,
                    first_bucket_cap_bytes=1 * MiB,
                    gradient_as_bucket_view=True,
                )
            )
            self.module = model
        elif kind == "noop_hooks":

            def noop(param):
                return None

            for p in model.parameters():
                self.keep.append(p.register_post_accumulate_grad_hook(noop))
            self.module = model
        else:
            raise ValueError(kind)
        self.opt = torch.optim.SGD(self.module.parameters(), lr=1e-4)

    @classmethod
    def around(cls, kind: str, model_name: str, module, raw, keep: tuple = ()) -> "Engine":
        """An engine around a module wrapped by the caller (the other benchmarks' engines)."""
        import torch

        self = cls.__new__(cls)
        self.kind, self.model_name, self.raw, self.module = kind, model_name, raw, module
        self.keep = list(keep)
        self.opt = torch.optim.SGD(module.parameters(), lr=1e-4)
        return self

    def step(self, batch) -> None:
        x, y = batch
        loss = loss_of(self.model_name, self.module(x), y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def reducer(self):
        if self.kind == "ours":
            from torchreplicate import replicate

            return replicate.state(self.module).reducer
        if self.kind == "reducer":
            return self.keep[0]
        return None


# --------------------------------------------------------------------------
# helpers run inside the ranks


def init_rank(threads: int = 1):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def _broadcast_int(value: int) -> int:
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64)
    dist.broadcast(t, src=0)
    return int(t.item())


def _count_collectives(engine: Engine, batch, steps: int = 2) -> dict:
    """Counts all-reduces per step with torch.profiler (gloo records them)."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(steps):
            engine.step(batch)
    sizes = []
    for event in prof.events():
        if event.name == "gloo:all_reduce":
            shapes = event.input_shapes or [[]]
            numel = 1
            for dim in shapes[0] if shapes and shapes[0] else []:
                numel *= dim
            sizes.append(numel)
    result = {
        "method": "torch.profiler 'gloo:all_reduce' events",
        "per_step": len(sizes) / steps,
        # every reduced tensor in these models is float32
        "payload_bytes_per_step": 4 * sum(sizes) / steps,
        "sizes_numel_one_step": sizes[: len(sizes) // steps] if steps else sizes,
    }
    if engine.kind == "ours":
        # cross-check: wrap torch.distributed.all_reduce (this process only)
        calls = []
        original = dist.all_reduce

        def counting(tensor, *args, **kwargs):
            calls.append(tensor.numel() * tensor.element_size())
            return original(tensor, *args, **kwargs)

        dist.all_reduce = counting
        try:
            dist.barrier()
            for _ in range(steps):
                engine.step(batch)
        finally:
            dist.all_reduce = original
        result["patched_all_reduce_per_step"] = len(calls) / steps
        result["patched_all_reduce_bytes_per_step"] = sum(calls) / steps
        reducer = engine.reducer()
        if reducer is not None:
            result["num_buckets"] = len(reducer.buckets)
            result["bucket_numel"] = [int(b.buffer.numel()) for b in reducer.buckets]
    if engine.kind in ("ddp", "ddp_gbv"):
        try:  # private API, cross-check only
            data = engine.module._get_ddp_logging_data()
            result["ddp_logging"] = {
                k: data.get(k) for k in ("rebuilt_bucket_sizes", "num_buckets_reduced", "bucket_cap_bytes")
            }
        except Exception as error:
            result["ddp_logging"] = f"unavailable: {error!r}"
    return result


# torch.distributed functions wrapped by count_wire: name -> (position, keyword) of
# the tensor this rank contributes; all_gather_into_tensor shows as gloo:all_gather
_WIRE_FUNCTIONS = {
    "all_reduce": ("all_reduce", 0, "tensor"),
    "all_gather": ("all_gather", 1, "tensor"),
    "all_gather_into_tensor": ("all_gather", 1, "input_tensor"),
    "broadcast": ("broadcast", 0, "tensor"),
    "reduce_scatter_tensor": ("reduce_scatter", 1, "input"),
}
_PROFILER_DTYPES = {
    "float": "float32",
    "double": "float64",
    "c10::BFloat16": "bfloat16",
    "c10::Half": "float16",
    "long int": "int64",
    "int": "int32",
    "short int": "int16",
    "signed char": "int8",
    "unsigned char": "uint8",
    "bool": "bool",
}


def count_wire(step: Callable[[], None], steps: int = 2) -> dict:
    """Collectives one rank issues per step, and their payload, counted two ways.

    ``step()`` runs ``steps`` times under each method; run no other
    collective meanwhile.

    (1) ``torch.profiler`` ``gloo:*`` events with input shapes and dtypes:
        every collective enqueued from the training thread, torch DDP's C++
        reducer included, but not those a comm hook launches from a future's
        callback on gloo's thread (PowerSGD's P and Q all-reduces).
    (2) the ``torch.distributed`` functions in ``_WIRE_FUNCTIONS`` wrapped in
        this process: every Python-level call, from any thread (our reducer,
        comm hooks, their callbacks), but not DDP's C++ reducer.

    The merged list is (2) plus the events of (1) no call of (2) accounts
    for, matched by (op, numel, dtype). The payload is the bytes this rank
    hands in (the tensor reduced, or its own piece of a gather);
    ``est_sent_bytes_per_step`` is a ring estimate: all-reduce
    2(W-1)/W x payload, all-gather (W-1) x payload, reduce-scatter
    (W-1)/W x payload, broadcast 1 x payload (gloo's algorithms may differ).
    """
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    dist.barrier()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(steps):
            step()
    profiled = []
    for event in prof.events():
        if not event.name.startswith("gloo:") or event.name == "gloo:barrier":
            continue
        shape = (event.input_shapes or [[]])[0] or []
        numel = 1
        for dim in shape:
            numel *= dim
        dtypes = getattr(event, "input_dtypes", None) or ["?"]
        profiled.append((event.name[len("gloo:") :], numel, _PROFILER_DTYPES.get(dtypes[0], dtypes[0])))

    calls: list = []
    originals = {name: getattr(dist, name) for name in _WIRE_FUNCTIONS if hasattr(dist, name)}

    def wrap(name, fn):
        op, position, keyword = _WIRE_FUNCTIONS[name]

        def counting(*args, **kwargs):
            tensor = args[position] if len(args) > position else kwargs.get(keyword)
            if isinstance(tensor, torch.Tensor):
                calls.append((op, tensor.numel(), str(tensor.dtype).replace("torch.", "")))
            return fn(*args, **kwargs)

        return counting

    dist.barrier()
    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    try:
        for _ in range(steps):
            step()
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)

    remaining: dict = defaultdict(int)
    for call in calls:
        remaining[call] += 1
    profiler_only = []
    for event in profiled:
        if remaining[event] > 0:
            remaining[event] -= 1
        else:
            profiler_only.append(event)
    merged = calls + profiler_only
    factor = {
        "all_reduce": 2 * (world - 1) / world,
        "all_gather": world - 1,
        "reduce_scatter": (world - 1) / world,
        "broadcast": 1.0,
    }
    item = {
        name: torch.empty((), dtype=getattr(torch, name)).element_size()
        for name in set(c[2] for c in merged)
        if hasattr(torch, name)
    }
    payload = sum(n * item.get(dt, 4) for _, n, dt in merged) / steps
    sent = sum(n * item.get(dt, 4) * factor.get(op, 1.0) for op, n, dt in merged) / steps
    by_op: dict = defaultdict(int)
    for op, _, _ in merged:
        by_op[op] += 1
    return {
        "method": "python-wrapped torch.distributed collectives + torch.profiler gloo events not matched by them",
        "per_step": len(merged) / steps,
        "per_step_by_op": {op: n / steps for op, n in by_op.items()},
        "payload_bytes_per_step": payload,
        "est_sent_bytes_per_step": sent,
        "one_step": [list(c) for c in merged[: len(merged) // steps]],
        "profiler_per_step": len(profiled) / steps,
        "python_per_step": len(calls) / steps,
        "profiler_only_per_step": len(profiler_only) / steps,
    }


class _MethodTimers:
    """Wraps methods of a class with inclusive/exclusive timers on two clocks.

    ``wall`` is time.perf_counter (includes blocking and being descheduled);
    ``cpu`` is time.thread_time, CPU time of the calling thread only, which
    the other processes of a busy machine do not inflate.
    """

    def __init__(self, cls: type, names: list[str]) -> None:
        self.cls = cls
        self.names = names
        self.originals: dict[str, Callable] = {}
        self.stack: list[list[float]] = []
        self.hook_depth = [0]  # >0 while inside a gradient hook
        self.reset()

    def reset(self) -> None:
        self.incl = {"wall": defaultdict(float), "cpu": defaultdict(float)}
        self.excl = {"wall": defaultdict(float), "cpu": defaultdict(float)}
        self.calls: dict[str, int] = defaultdict(int)

    def _wrap(self, name: str, fn: Callable) -> Callable:
        perf, cpu = time.perf_counter, time.thread_time
        timers = self
        stack, hook_depth = self.stack, self.hook_depth
        is_hook = name == "_on_grad_accumulated"
        in_hook_name = name + "_in_hook"

        def wrapper(*args, **kwargs):
            frame = [0.0, 0.0]
            stack.append(frame)
            if is_hook:
                hook_depth[0] += 1
            t0, c0 = perf(), cpu()
            try:
                return fn(*args, **kwargs)
            finally:
                dt, dc = perf() - t0, cpu() - c0
                if is_hook:
                    hook_depth[0] -= 1
                stack.pop()
                incl, excl = timers.incl, timers.excl
                incl["wall"][name] += dt
                incl["cpu"][name] += dc
                excl["wall"][name] += dt - frame[0]
                excl["cpu"][name] += dc - frame[1]
                timers.calls[name] += 1
                if hook_depth[0] and not is_hook:
                    excl["wall"][in_hook_name] += dt - frame[0]
                    excl["cpu"][in_hook_name] += dc - frame[1]
                    timers.calls[in_hook_name] += 1
                if stack:
                    stack[-1][0] += dt
                    stack[-1][1] += dc

        return wrapper

    def install(self) -> None:
        for name in self.names:
            fn = getattr(self.cls, name, None)
            if fn is None:
                continue
            self.originals[name] = fn
            setattr(self.cls, name, self._wrap(name, fn))

    def uninstall(self) -> None:
        for name, fn in self.originals.items():
            setattr(self.cls, name, fn)


def _wrapper_overhead_s() -> dict:
    """Exclusive time a wrapped child call adds to its wrapped parent, per clock.

    The timing wrappers' own work around a nested call lands in the caller's
    exclusive time; calibrated on a parent calling a no-op child (best of 5).
    """

    class Dummy:
        def parent(self, n):
            for _ in range(n):
                self.child(1)

        def child(self, a):
            return None

    d = Dummy()
    n = 2000
    best = {"wall": float("inf"), "cpu": float("inf")}
    for _ in range(5):
        results = []
        for names in (["parent"], ["parent", "child"]):
            timers = _MethodTimers(Dummy, names)
            timers.install()
            try:
                d.parent(n)
            finally:
                timers.uninstall()
            results.append({c: timers.excl[c]["parent"] + timers.excl[c].get("child", 0.0) for c in best})
        for c in best:
            best[c] = min(best[c], max(0.0, (results[1][c] - results[0][c]) / n))
    return best


REDUCER_METHODS = [
    "_on_grad_accumulated",
    "_adopt_grad",
    "_launch",
    "_finalize",
    "_fill_at_end",
    "_write_tail",
    "_wait",
    "_read_tail",
    "_restore_grads",
    "_learn_expected",
    "_reset_step",
    "_scale_in_place",
    "_copy_in",
]


def _instrument_ours(model_name: str, batch, steps: int, kind: str = "ours") -> dict:
    """Times the pieces of our reducer on a fresh engine (untimed phase)."""
    import torch
    import torch.distributed as dist

    try:
        from torchreplicate.reducer import Reducer
    except ImportError as error:
        return {"error": repr(error)}
    timers = _MethodTimers(Reducer, REDUCER_METHODS)
    timers.install()  # before the engine exists: its hooks bind the wrappers
    try:
        engine = Engine(kind, model_name)
        for _ in range(3):
            engine.step(batch)
        dist.barrier()
        timers.reset()
        t0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(steps):
            engine.step(batch)
        wall = (time.perf_counter() - t0) / steps
        cpu_step = (time.thread_time() - c0) / steps
    finally:
        timers.uninstall()
    reducer = engine.reducer()
    n_tensors = len(reducer.params) if reducer is not None else 0
    overhead = _wrapper_overhead_s()
    excl = {c: {k: v / steps for k, v in timers.excl[c].items()} for c in ("wall", "cpu")}
    incl = {c: {k: v / steps for k, v in timers.incl[c].items()} for c in ("wall", "cpu")}
    calls = {name: n / steps for name, n in timers.calls.items()}
    hook_calls = calls.get("_on_grad_accumulated", 0.0)
    launches_in_hooks = calls.get("_launch_in_hook", 0.0)
    # calls nested in the hook: their wrappers' cost is in the hook's exclusive time
    nested_in_hook = sum(v for k, v in calls.items() if k.endswith("_in_hook"))
    nested_in_finalize = (
        sum(calls.get(k, 0.0) for k in REDUCER_METHODS if k not in ("_on_grad_accumulated", "_finalize"))
        - nested_in_hook
    )

    # The copy of a fresh .grad into its slot may be inlined in the hook
    # (not a wrapped method): estimate it from a micro-benchmark of the same
    # op on tensors of each parameter's size, hot in cache (a lower bound).
    copy_est_s = 0.0
    if reducer is not None:
        scale = getattr(reducer, "scale", None)
        pairs = [(torch.randn_like(p), v) for p, v in zip(reducer.params, reducer.param_view)]
        if scale is None:
            op = lambda src, dst: dst.copy_(src)  # noqa: E731
        else:
            op = lambda src, dst: torch.mul(src, scale, out=dst)  # noqa: E731
        for src, dst in pairs:
            op(src, dst)
        reps = 5
        c0 = time.thread_time()
        for _ in range(reps):
            for src, dst in pairs:
                op(src, dst)
        copy_est_s = (time.thread_time() - c0) / reps

    def derived(c: str) -> dict:
        e, i, o = excl[c], incl[c], overhead[c]
        hook_excl = max(0.0, e.get("_on_grad_accumulated", 0.0) - o * nested_in_hook)
        adopt = e.get("_adopt_grad", 0.0)
        # the copy is inlined in the hook when _adopt_grad is never called
        copy_in_hook = copy_est_s if not calls.get("_adopt_grad") and c == "cpu" else 0.0
        bookkeeping = max(0.0, hook_excl - copy_in_hook)
        launch_hooks = e.get("_launch_in_hook", 0.0)
        launch_end = e.get("_launch", 0.0) - launch_hooks
        scale_in_place = e.get("_scale_in_place", 0.0)
        finalize = max(0.0, i.get("_finalize", 0.0) - o * nested_in_finalize)
        wait = e.get("_wait", 0.0)
        scale_at_end = scale_in_place - e.get("_scale_in_place_in_hook", 0.0)
        finalize_other = max(0.0, finalize - wait - launch_end - scale_at_end)
        return {
            "hook_exclusive_us_per_call": hook_excl / hook_calls * 1e6 if hook_calls else None,
            "hook_bookkeeping_us_per_call": bookkeeping / hook_calls * 1e6 if hook_calls else None,
            "hook_exclusive_raw_us_per_call": e.get("_on_grad_accumulated", 0.0) / hook_calls * 1e6
            if hook_calls
            else None,
            "copy_ms": (adopt + copy_in_hook) * 1e3,
            "copy_is_estimate": bool(copy_in_hook),
            "launch_in_hooks_ms": launch_hooks * 1e3,
            "launch_at_end_ms": launch_end * 1e3,
            "scale_in_place_ms": scale_in_place * 1e3,
            "finalize_ms": finalize * 1e3,
            "wait_ms": wait * 1e3,
            "finalize_other_ms": finalize_other * 1e3,
            "restore_grads_ms": e.get("_restore_grads", 0.0) * 1e3,
            "fill_at_end_ms": e.get("_fill_at_end", 0.0) * 1e3,
            # Python bookkeeping per tensor: hook logic + end-of-backward work,
            # without copies into buckets, scaling, issuing all-reduces and waiting
            "bookkeeping_us_per_tensor": (bookkeeping + finalize_other) / n_tensors * 1e6 if n_tensors else None,
        }

    # one full pass over the buckets (what a division after the collective costs)
    div_s = 0.0
    if reducer is not None:
        scratch = [b.grads.clone() for b in reducer.buckets]  # real values (no denormals)
        for s in scratch:
            s.mul_(0.5)  # touch the pages once
        c0 = time.thread_time()
        for _ in range(5):
            for s in scratch:
                s.mul_(0.5)
        div_s = (time.thread_time() - c0) / 5
    return {
        "steps": steps,
        "n_tensors": n_tensors,
        "num_buckets": len(reducer.buckets) if reducer is not None else 0,
        "buckets_launched_per_step": calls.get("_launch", 0.0),
        "launches_in_hooks_per_step": launches_in_hooks,
        "hook_calls_per_step": hook_calls,
        "wrapper_overhead_us": {c: v * 1e6 for c, v in overhead.items()},
        "step_ms_instrumented": {"wall": wall * 1e3, "cpu": cpu_step * 1e3},
        "exclusive_ms_per_step": {c: {k: v * 1e3 for k, v in d.items()} for c, d in excl.items()},
        "calls_per_step": calls,
        "wall": derived("wall"),
        "cpu": derived("cpu"),
        "one_pass_over_buckets_cpu_ms": div_s * 1e3,
        "copy_estimate_cpu_ms_per_step": copy_est_s * 1e3,
    }


# --------------------------------------------------------------------------
# rank entry points (module level: spawn imports them)


def run_rounds(engines: dict, batch, cfg: dict) -> dict:
    """Warms up, then times interleaved blocks of K steps of every engine.

    ``engines`` maps a name to anything with ``step(batch)``. Per round, every
    engine runs a block of K steps after a ``dist.barrier()``; the engine
    order rotates by one each round. K comes from rank 0's slowest warm step
    (about ``cfg["block_s"]`` per block, at least ``cfg["min_steps"]``, or
    ``cfg["steps"]`` if set) and is broadcast, so every rank runs the same
    steps. Returns what ``aggregate_timing`` reads.
    """
    import torch.distributed as dist

    # warm-up, interleaved; DDP rebuilds buckets after step 1, ours
    # learns its schedule in step 1
    for _ in range(cfg["warmup"]):
        for engine in engines.values():
            engine.step(batch)
    # block size K: from rank 0's slowest engine, the same on every rank
    dist.barrier()
    slowest = 0.0
    for engine in engines.values():
        t0 = time.perf_counter()
        engine.step(batch)
        slowest = max(slowest, time.perf_counter() - t0)
    k = cfg["steps"] or max(cfg["min_steps"], min(200, int(round(cfg["block_s"] / max(slowest, 1e-4)))))
    k = _broadcast_int(k)
    kinds = list(engines)
    per_step: dict[str, list[list[float]]] = {kind: [] for kind in kinds}  # [round][step]
    blocks: dict[str, list[float]] = {kind: [] for kind in kinds}
    cpu_blocks: dict[str, list[float]] = {kind: [] for kind in kinds}  # thread CPU time
    orders = []
    for r in range(cfg["rounds"]):
        order = kinds[r % len(kinds) :] + kinds[: r % len(kinds)]
        orders.append(order)
        for kind in order:
            engine = engines[kind]
            dist.barrier()
            steps = []
            c_block = time.thread_time()
            t_block = time.perf_counter()
            for _ in range(k):
                t0 = time.perf_counter()
                engine.step(batch)
                steps.append(time.perf_counter() - t0)
            blocks[kind].append(time.perf_counter() - t_block)
            cpu_blocks[kind].append(time.thread_time() - c_block)
            per_step[kind].append(steps)
    return {
        "steps_per_block": k,
        "rounds": cfg["rounds"],
        "orders": orders,
        "per_step_s": per_step,
        "block_s": blocks,
        "cpu_block_s": cpu_blocks,
    }


def timing_worker(cfg: dict) -> dict:
    rank, world = init_rank(1)
    out: dict[str, Any] = {"rank": rank, "world_size": world, "models": {}}
    import torchreplicate

    out["torchreplicate_file"] = torchreplicate.__file__
    for model_name in cfg["models"]:
        batch = make_batch(model_name, rank)
        engines = {kind: Engine(kind, model_name) for kind in cfg["engines"]}
        first = next(iter(engines.values()))
        n_params = sum(p.numel() for p in first.raw.parameters())
        n_tensors = len(list(first.raw.parameters()))
        timed = run_rounds(engines, batch, cfg)
        model_out: dict[str, Any] = {"n_params": n_params, "n_tensors": n_tensors, **timed}
        if cfg.get("count", True):
            model_out["collectives"] = {
                kind: _count_collectives(engine, batch) for kind, engine in engines.items() if kind != "noop_hooks"
            }
        del engines, first
        gc.collect()
        if cfg.get("instrument"):
            model_out["reducer_breakdown"] = _instrument_ours(
                model_name, batch, cfg["instrument_steps"], kind="ours" if world > 1 else "reducer"
            )
        out["models"][model_name] = model_out
        gc.collect()
    return out


def _status_kib() -> dict:
    values = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM")):
                key, rest = line.split(":")
                values[key] = int(rest.split()[0])
    return values


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def memory_worker(cfg: dict) -> dict:
    import torch.distributed as dist

    rank, world = init_rank(1)
    out: dict[str, Any] = {"rank": rank, "models": {}, "malloc_env": os.environ.get("MALLOC_MMAP_THRESHOLD_")}
    import torch

    for model_name in cfg["models"]:
        batch = make_batch(model_name, rank)
        res = {}
        # a throw-away local engine first: one-time costs (kernel and
        # allocator caches, autograd thread state) are not charged to the
        # first measured engine
        warm = Engine("local", model_name)
        for _ in range(2):
            warm.step(batch)
        del warm
        for kind in cfg["engines"]:
            gc.collect()
            # the bare model (parameters) exists before the baseline: only what
            # the engine adds is counted (grads, buckets, activations, hooks)
            torch.manual_seed(0)
            model = build_model(model_name)
            dist.barrier()
            gc.collect()
            base = _status_kib()["VmRSS"]
            reset_ok = _reset_hwm()
            engine = Engine(kind, model_name, model=model)
            del model
            built = _status_kib()
            for _ in range(cfg["first_steps"]):  # DDP rebuilds buckets, ours learns
                engine.step(batch)
            first = _status_kib()
            _reset_hwm()  # steady state from here
            for _ in range(cfg["mem_steps"]):
                engine.step(batch)
            status = _status_kib()
            res[kind] = {
                "baseline_rss_kib": base,
                "build_peak_increase_kib": built["VmHWM"] - base,
                "after_build_increase_kib": built["VmRSS"] - base,
                "first_steps_peak_increase_kib": max(first["VmHWM"], built["VmHWM"]) - base,
                "peak_increase_kib": status["VmHWM"] - base,  # steady state
                "steady_increase_kib": status["VmRSS"] - base,  # held between steps
                "hwm_reset": reset_ok,
            }
            del engine
            gc.collect()
        # the model itself (not counted above): parameters only
        res["_model_param_kib"] = sum(p.numel() * p.element_size() for p in build_model(model_name).parameters()) / 1024
        out["models"][model_name] = res
    return out


# --------------------------------------------------------------------------
# statistics and reporting (parent process)


def _quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    if not values:
        return float("nan")
    pos = (len(values) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def _summary(values: list[float]) -> dict:
    return {
        "median": statistics.median(values),
        "q1": _quantile(values, 0.25),
        "q3": _quantile(values, 0.75),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


RATIO_PAIRS = (
    ("ours", "ddp"),
    ("ours", "ddp_gbv"),
    ("ours", "local"),
    ("ddp", "local"),
    ("ddp_gbv", "ddp"),
    ("reducer", "local"),
    ("noop_hooks", "local"),
)


def per_round_ratios(round_step: dict[str, list[float]], pairs) -> dict:
    """``"a/b"``: summary of a's block over b's block in the same round, for each pair present."""
    ratios = {}
    for num, den in pairs:
        if num in round_step and den in round_step:
            per = [a / b for a, b in zip(round_step[num], round_step[den])]
            ratios[f"{num}/{den}"] = {**_summary(per), "per_round": per}
    return ratios


def aggregate_timing(rank_outputs: list[dict], pairs=RATIO_PAIRS) -> dict:
    """Per model: per-engine step time (slowest rank), per-round ratios of ``pairs``.

    ``engines[kind]["per_round_ms"]`` keeps the per-round step times, from
    which callers may form further paired ratios (``per_round_ratios``).
    """
    models = {}
    for model_name, m0 in rank_outputs[0]["models"].items():
        ranks = [r["models"][model_name] for r in rank_outputs]
        kinds = list(m0["block_s"])
        engines = {}
        round_step: dict[str, list[float]] = {}
        for kind in kinds:
            # block time per step, slowest rank: the step a data-parallel job sees
            per_round = [
                max(rk["block_s"][kind][i] for rk in ranks) / m0["steps_per_block"] for i in range(m0["rounds"])
            ]
            round_step[kind] = per_round
            steps = [
                max(rk["per_step_s"][kind][i][j] for rk in ranks)
                for i in range(m0["rounds"])
                for j in range(m0["steps_per_block"])
            ]
            engines[kind] = {
                "step_ms": _summary([v * 1e3 for v in per_round]),
                "single_step_ms": _summary([v * 1e3 for v in steps]),
                "per_round_ms": [v * 1e3 for v in per_round],
            }
        round_cpu: dict[str, list[float]] = {}
        for kind in kinds:
            # training-thread CPU time per step (mean over ranks): excludes
            # waiting and time other processes took the core
            round_cpu[kind] = [
                statistics.mean(rk["cpu_block_s"][kind][i] for rk in ranks) / m0["steps_per_block"]
                for i in range(m0["rounds"])
            ]
            engines[kind]["cpu_step_ms"] = _summary([v * 1e3 for v in round_cpu[kind]])
        ratios = per_round_ratios(round_step, pairs)
        exposed = {}
        if "local" in engines:
            base_local = engines["local"]["step_ms"]["median"]
            exposed = {kind: engines[kind]["step_ms"]["median"] - base_local for kind in kinds if kind != "local"}
        result = {
            "n_params": m0["n_params"],
            "n_tensors": m0["n_tensors"],
            "steps_per_block": m0["steps_per_block"],
            "rounds": m0["rounds"],
            "engines": engines,
            "ratios": ratios,
            "exposed_comm_ms": exposed,
        }
        # extra cost per tensor at world size 1 (differences of medians of per-round differences)
        for kind in ("reducer", "noop_hooks", "ours", "ddp"):
            if kind in round_step and "reducer" in round_step:
                diffs = [a - b for a, b in zip(round_step[kind], round_step["local"])]
                result[f"{kind}_minus_local_us_per_tensor"] = {
                    k: (v * 1e6 / m0["n_tensors"] if isinstance(v, float) else v) for k, v in _summary(diffs).items()
                }
                diffs = [a - b for a, b in zip(round_cpu[kind], round_cpu["local"])]
                result[f"{kind}_minus_local_cpu_us_per_tensor"] = {
                    k: (v * 1e6 / m0["n_tensors"] if isinstance(v, float) else v) for k, v in _summary(diffs).items()
                }
        if "collectives" in m0:
            result["collectives"] = m0["collectives"]
        if "reducer_breakdown" in m0:
            result["reducer_breakdown"] = {
                f"rank{r['rank']}": r["models"][model_name]["reducer_breakdown"] for r in rank_outputs
            }
        models[model_name] = result
    return models


def aggregate_memory(rank_outputs: list[dict]) -> dict:
    models = {}
    for model_name, m0 in rank_outputs[0]["models"].items():
        res = {"model_param_mib": m0["_model_param_kib"] / 1024}
        for kind in m0:
            if kind.startswith("_"):
                continue
            per_rank = [r["models"][model_name][kind] for r in rank_outputs]
            res[kind] = {
                "peak_increase_mib": max(p["peak_increase_kib"] for p in per_rank) / 1024,
                "first_steps_peak_increase_mib": max(p["first_steps_peak_increase_kib"] for p in per_rank) / 1024,
                "build_peak_increase_mib": max(p["build_peak_increase_kib"] for p in per_rank) / 1024,
                "steady_increase_mib": max(p["steady_increase_kib"] for p in per_rank) / 1024,
                "after_build_increase_mib": max(p["after_build_increase_kib"] for p in per_rank) / 1024,
                "hwm_reset": all(p["hwm_reset"] for p in per_rank),
            }
        models[model_name] = res
    return models


def fmt_ratio(r: Optional[dict]) -> str:
    if not r:
        return "n/a"
    return f"{r['median']:.3f} [{r['q1']:.3f}-{r['q3']:.3f}] ({r['min']:.2f}-{r['max']:.2f})"


def markdown_tables(report: dict) -> str:
    lines = []
    ws2 = report.get("world_size_2", {})
    ws1 = report.get("world_size_1", {})
    mem = report.get("memory", {})
    if not ws2:
        lines.append("(world-size-2 phase skipped)")
    lines.append(
        "**World size 2** (gloo, 1 thread/rank; step time = median over rounds of block time / K, slowest rank; ratio = median of per-round ratios [IQR] (min-max))"
    )
    lines.append("")
    lines.append(
        "| model | params (tensors) | local ms | DDP ms | DDP-gbv ms | ours ms | ours/DDP | ours/DDP-gbv | exposed comm ms DDP / gbv / ours |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|")
    for name, m in ws2.items():
        e = m["engines"]
        x = m["exposed_comm_ms"]
        lines.append(
            f"| {MODEL_TITLES.get(name, name)} | {m['n_params'] / 1e6:.2f}M ({m['n_tensors']}) "
            f"| {e['local']['step_ms']['median']:.2f} | {e['ddp']['step_ms']['median']:.2f} "
            f"| {e['ddp_gbv']['step_ms']['median']:.2f} | {e['ours']['step_ms']['median']:.2f} "
            f"| {fmt_ratio(m['ratios'].get('ours/ddp'))} | {fmt_ratio(m['ratios'].get('ours/ddp_gbv'))} "
            f"| {x['ddp']:.2f} / {x['ddp_gbv']:.2f} / {x['ours']:.2f} |"
        )
    lines.append("")
    lines.append(
        "**Communication and memory** (world size 2; all-reduces and payload per step per rank from torch.profiler 'gloo:all_reduce' events; "
        "sent = ring estimate 2(W-1)/W x payload; memory in MiB over the RSS of the bare model, largest rank: steady peak (after 3 steps) "
        "[peak incl. wrapping and first 3 steps] {held between steps})"
    )
    lines.append("")
    lines.append(
        "| model | all-reduces/step DDP / gbv / ours | payload MiB/step DDP / ours | est. sent MiB/rank/step | peak RSS +MiB local / DDP / gbv / ours | params MiB |"
    )
    lines.append("|---|---|---|---|---|---|")
    for name, m in ws2.items():
        c = m.get("collectives", {})
        mm = mem.get(name, {})

        def cnt(kind):
            return f"{c[kind]['per_step']:.0f}" if kind in c else "n/a"

        def pay(kind):
            return f"{c[kind]['payload_bytes_per_step'] / MiB:.2f}" if kind in c else "n/a"

        def pk(kind):
            if kind not in mm:
                return "n/a"
            v = mm[kind]
            return f"{v['peak_increase_mib']:.1f} [{v['first_steps_peak_increase_mib']:.0f}] {{{v['steady_increase_mib']:.0f}}}"

        ws = report["world_size"]
        sent = (2 * (ws - 1) / ws) * c["ours"]["payload_bytes_per_step"] / MiB if "ours" in c else float("nan")
        lines.append(
            f"| {MODEL_TITLES.get(name, name)} | {cnt('ddp')} / {cnt('ddp_gbv')} / {cnt('ours')} | {pay('ddp')} / {pay('ours')} "
            f"| {sent:.2f} | {pk('local')} / {pk('ddp')} / {pk('ddp_gbv')} / {pk('ours')} | {mm.get('model_param_mib', float('nan')):.1f} |"
        )
    if ws1:
        lines.append("")
        lines.append(
            "**World size 1** (ours = replicate() defaults; reducer = our Reducer forced on the 1-rank group; noop = one empty Python hook per parameter; "
            "+µs/tensor = median over rounds of (engine - local) per step / tensors, on training-thread CPU time [wall time])"
        )
        lines.append("")
        lines.append(
            "| model | local ms | ours ms | ours/local | DDP ms | reducer ms | +µs/tensor CPU [wall]: DDP / reducer / noop hooks |"
        )
        lines.append("|---|---|---|---|---|---|---|")
        for name, m in ws1.items():
            e = m["engines"]

            def ms(kind):
                return f"{e[kind]['step_ms']['median']:.2f}" if kind in e else "n/a"

            def per_t(kind):
                v = m.get(f"{kind}_minus_local_cpu_us_per_tensor")
                w = m.get(f"{kind}_minus_local_us_per_tensor")
                return f"{v['median']:.1f} [{w['median']:.1f}]" if v and w else "n/a"

            lines.append(
                f"| {MODEL_TITLES.get(name, name)} | {ms('local')} | {ms('ours')} | {fmt_ratio(m['ratios'].get('ours/local'))} "
                f"| {ms('ddp')} | {ms('reducer')} | {per_t('ddp')} / {per_t('reducer')} / {per_t('noop_hooks')} |"
            )
    rows = [(name, m["reducer_breakdown"]) for name, m in ws2.items() if "reducer_breakdown" in m]
    if rows:
        lines.append("")
        lines.append(
            "**Our reducer, instrumented** (world size 2, rank 0, separate untimed pass with timing wrappers, wrapper cost subtracted; "
            "thread CPU time unless noted; ms per step unless noted. hook = `_on_grad_accumulated` per call, without nested wrapped calls (launch); "
            "copy = moving fresh grads into their slots (`_adopt_grad` if called, else a micro-benchmark estimate, marked ~); bookkeeping = hook - copy; "
            "launch = issuing all_reduce (from hooks / at the end); scale = `_scale_in_place`; wait = wall time in `_wait`; "
            "finalize other = end-of-backward work besides launch, scale and wait; 1 pass = one mul_ over all buckets, for scale)"
        )
        lines.append("")
        lines.append(
            "| model | buckets (from hooks) | hook µs/call | copy ms | bookkeeping µs/call | launch ms hooks / end | scale ms | finalize other ms | _restore_grads ms | wait ms (wall) | 1 pass ms | bookkeeping µs/tensor |"
        )
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for name, b in rows:
            b = b.get("rank0", next(iter(b.values())))
            if "error" in b:
                lines.append(f"| {MODEL_TITLES.get(name, name)} | {b['error']} |")
                continue
            c, w = b["cpu"], b["wall"]
            approx = "~" if c["copy_is_estimate"] else ""
            lines.append(
                f"| {MODEL_TITLES.get(name, name)} | {b['num_buckets']} ({b['launches_in_hooks_per_step']:.0f}) "
                f"| {c['hook_exclusive_us_per_call']:.2f} | {approx}{c['copy_ms']:.2f} | {c['hook_bookkeeping_us_per_call']:.2f} "
                f"| {c['launch_in_hooks_ms']:.2f} / {c['launch_at_end_ms']:.2f} | {c['scale_in_place_ms']:.2f} "
                f"| {c['finalize_other_ms']:.3f} | {c['restore_grads_ms']:.3f} "
                f"| {w['wait_ms']:.2f} | {b['one_pass_over_buckets_cpu_ms']:.2f} | {c['bookkeeping_us_per_tensor']:.2f} |"
            )
    return "\n".join(lines) + "\n"


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = []
    for name, m in report.get("world_size_2", {}).items():
        for key, label in (("ours/ddp", "ours/DDP"), ("ours/ddp_gbv", "ours/DDP-gbv")):
            if key in m["ratios"]:
                series.append(
                    (
                        f"{name}\n{label}",
                        m["ratios"][key]["per_round"],
                        "tab:blue" if key == "ours/ddp" else "tab:orange",
                    )
                )
    for name, m in report.get("world_size_1", {}).items():
        if "ours/local" in m["ratios"]:
            series.append((f"{name}\nws1 ours/local", m["ratios"]["ours/local"]["per_round"], "tab:green"))
    if not series:
        return
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(series)), 4.5))
    box = ax.boxplot([s[1] for s in series], patch_artist=True, whis=(0, 100))
    ax.set_xticks(range(1, len(series) + 1), [s[0] for s in series], fontsize=8)
    for patch, s in zip(box["boxes"], series):
        patch.set_facecolor(s[2])
        patch.set_alpha(0.5)
    ax.axhline(1.0, color="gray", lw=1)
    ax.axhline(0.95, color="red", lw=1, ls="--", label="target 0.95 (vs DDP)")
    ax.axhline(1.03, color="green", lw=1, ls=":", label="target 1.03 (ws1 vs local)")
    ax.set_ylabel("step time ratio (per round)")
    ax.set_title(
        f"replicate() vs DDP, gloo CPU, {report['world_size']} ranks x 1 thread (box IQR, whiskers min-max)", fontsize=9
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def finish_report(report: dict, started: float, rank_file: str, table_of, out_dir: str, name: str) -> str:
    """Stamps the end load, the measured source and the run time; writes and prints the report.

    Returns the markdown table.
    """
    report["env"]["loadavg_end"] = os.getloadavg()
    report["env"]["source"] = source_info(rank_file)
    report["elapsed_s"] = time.time() - started
    table = table_of(report)
    path = write_report(report, table, out_dir, name)
    print()
    print(table)
    print(f"[bench_{name}] wrote {path} and {name}.md in {report['elapsed_s']:.0f} s")
    return table


def write_report(report: dict, table: str, out_dir: str, name: str) -> str:
    """Writes ``<name>.json`` (atomically) and ``<name>.md`` in ``out_dir``; returns the JSON path."""
    json_path = os.path.join(out_dir, f"{name}.json")
    with open(json_path + ".tmp", "w") as f:
        json.dump(report, f, indent=1)
    os.replace(json_path + ".tmp", json_path)
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(table)
    return json_path


def source_info(module_file: Optional[str]) -> dict:
    """Which torchreplicate a process imported: this checkout's, or a snapshot.

    A snapshot is a ``git archive`` copy with the commit in ``SNAPSHOT_COMMIT``
    (see ``benchmarks/snapshot.sh``), so that edits to ``src/`` during a run
    do not reach the benchmark.
    """
    if not module_file:
        return {}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(module_file))))
    info: dict[str, Any] = {"root": root, "is_this_checkout": os.path.realpath(root) == os.path.realpath(REPO)}
    marker = os.path.join(root, "SNAPSHOT_COMMIT")
    if os.path.exists(marker):
        with open(marker) as f:
            info["snapshot_commit"] = f.read().strip()
    return info


def run_header(report: dict) -> str:
    """One line for the markdown: what was measured, where, under what load."""
    env = report.get("env", {})
    src = env.get("source", {})
    commit = src.get("snapshot_commit") or (
        env.get("git", {}).get("head", "?")
        + ("" if not env.get("git", {}).get("src_status") else " + uncommitted src/")
    )
    where = "git-archive snapshot" if src.get("snapshot_commit") else "working tree"
    load = lambda v: "/".join(f"{x:.2f}" for x in v) if v else "?"  # noqa: E731
    return (
        f"_torchreplicate {commit[:12]} ({where}), torch {env.get('torch', '?')}, {env.get('cpu_count', '?')} CPUs, "
        f"load average (1/5/15 min) {load(env.get('loadavg_start'))} at start, {load(env.get('loadavg_end'))} at end_"
    )


# How bench_dynamic and bench_hooks time their engines (run_rounds), for their reports.
ROUNDS_METHOD = {
    "step_time": "bench_ddp.run_rounds: median over rounds of block wall time / K, slowest rank; engines interleaved, order rotated each round",
    "ratio": "per round: engine block / reference block in the same round; median, quartiles, min, max",
}


def run_env(**extra: Any) -> dict:
    """What a report records at the start of a run: torch, Python, CPUs, git, load; plus ``extra``."""
    import torch

    import torchreplicate

    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torchreplicate_file": torchreplicate.__file__,
        "git": git_info(),
        "loadavg_start": os.getloadavg(),
        "threads_per_rank": 1,
        **extra,
    }


def git_info() -> dict:
    def run(*args):
        try:
            return subprocess.run(["git", "-C", REPO, *args], capture_output=True, text=True, timeout=10).stdout.strip()
        except Exception:
            return ""

    return {"head": run("rev-parse", "HEAD"), "src_status": run("status", "--porcelain", "--", "src")}


# --------------------------------------------------------------------------
# main


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds per model (default 40; quick 4)")
    parser.add_argument(
        "--steps", type=int, default=None, help="steps per timed block (default: about --block-s worth, >= 3)"
    )
    parser.add_argument(
        "--block-s", type=float, default=None, help="target seconds per timed block (default 0.25; quick 0.15)"
    )
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps per engine (default 5; quick 3)")
    parser.add_argument("--quick", action="store_true", help="short smoke run (~1-2 min)")
    parser.add_argument("--models", default=",".join(MODEL_NAMES), help=f"comma list from {MODEL_NAMES}")
    parser.add_argument("--nprocs", type=int, default=2, help="ranks of the main phase (default 2)")
    parser.add_argument("--no-ws2", action="store_true", help="skip the main (--nprocs ranks) timing phase")
    parser.add_argument("--no-ws1", action="store_true", help="skip the world-size-1 phase")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory phase")
    parser.add_argument("--no-instrument", action="store_true", help="skip the instrumented reducer pass")
    parser.add_argument(
        "--out", default=os.path.join(HERE, "results"), help="output folder (default benchmarks/results)"
    )
    parser.add_argument("--timeout", type=float, default=1500, help="per-launch timeout in seconds")
    args = parser.parse_args(argv)

    try:
        import torchreplicate  # noqa: F401
    except ImportError:  # run from a checkout without installing
        sys.path.insert(0, os.path.join(REPO, "src"))
    import torchreplicate
    from torchreplicate.launcher import launch

    models = [m for m in args.models.split(",") if m]
    for m in models:
        if m not in MODEL_NAMES:
            parser.error(f"unknown model {m!r}")
    quick = args.quick
    rounds = args.rounds or (4 if quick else 40)
    cfg = {
        "models": models,
        "rounds": rounds,
        "steps": args.steps,
        "min_steps": 2 if quick else 3,
        "block_s": args.block_s or (0.15 if quick else 0.25),
        "warmup": args.warmup or (3 if quick else 5),
        "instrument": not args.no_instrument,
        "instrument_steps": 3 if quick else 10,
        "count": True,
    }
    os.makedirs(args.out, exist_ok=True)
    started = time.time()
    report: dict[str, Any] = {
        "config": {**cfg, "quick": quick},
        "world_size": args.nprocs,
        "env": run_env(
            machine=platform.machine(),
            gpt={"tied_embedding": True, "seq": GPT_SEQ, "batch": GPT_BATCH, "vocab": GPT_VOCAB},
        ),
    }

    def phase(label: str, fn, nprocs: int, phase_cfg: dict, env: Optional[dict] = None):
        print(f"[bench] {label} ...", flush=True)
        t0 = time.time()
        saved = {k: os.environ.get(k) for k in (env or {})}
        os.environ.update(env or {})
        try:
            result = launch(fn, nprocs=nprocs, args=(phase_cfg,), timeout_s=args.timeout, threads_per_rank=1)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        print(f"[bench] {label} done in {time.time() - t0:.0f} s", flush=True)
        return result

    if not args.no_ws2:
        out = phase(f"timing, {args.nprocs} ranks", timing_worker, args.nprocs, {**cfg, "engines": list(ENGINES_WS2)})
        report["env"]["torchreplicate_file_in_ranks"] = out[0].get("torchreplicate_file")
        report["world_size_2"] = aggregate_timing(out)
    if not args.no_ws1:
        ws1_cfg = {
            **cfg,
            "engines": list(ENGINES_WS1),
            "rounds": max(3, rounds // 2) if not quick else 3,
            "count": False,
            "instrument": cfg["instrument"],
        }
        out1 = phase("timing, 1 rank", timing_worker, 1, ws1_cfg)
        report["env"]["torchreplicate_file_in_ranks"] = out1[0].get("torchreplicate_file")
        report["world_size_1"] = aggregate_timing(out1)
    if not args.no_memory:
        mem_cfg = {"models": models, "engines": list(ENGINES_WS2), "first_steps": 3, "mem_steps": 3 if quick else 5}
        # A fixed mmap threshold (no dynamic raise) makes glibc return every
        # freed tensor over 64 KiB to the OS, so RSS tracks live tensors and
        # one engine cannot reuse pages another freed.
        env = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}
        outm = phase(f"memory, {args.nprocs} ranks", memory_worker, args.nprocs, mem_cfg, env)
        report["memory"] = aggregate_memory(outm)
        report["memory_method"] = (
            "separate launch; glibc MALLOC_MMAP_THRESHOLD_=65536; engines one after another in one process; "
            "per engine: RSS baseline with the bare model built (parameters not counted), then wrap + optimizer + 3 "
            "first steps, VmHWM reset via /proc/self/clear_refs, then more steps; peak increase = VmHWM - baseline "
            "over the steady steps (first_steps_peak includes wrapping and the first 3 steps); held = RSS between steps - baseline; "
            "largest rank"
        )
    report["method"] = {
        "step_time": "median over rounds of block wall time / K, slowest rank per block; engines interleaved, order rotated each round, dist.barrier() before each block",
        "ratio": "per round: engine block / reference block in the same round; median, quartiles, min, max over rounds",
        "exposed_comm_ms": "engine median step time - local median step time",
        "cpu_step_ms": "training-thread CPU time (time.thread_time) per step, mean over ranks",
        "collectives": "torch.profiler 'gloo:all_reduce' events over 2 steps (float32 payload); ours cross-checked by wrapping torch.distributed.all_reduce",
        "instrumented": "reducer methods wrapped at class level in the ranks (separate, untimed pass); calibrated wrapper cost subtracted",
    }
    report["env"]["loadavg_end"] = os.getloadavg()
    report["env"]["source"] = source_info(report["env"].get("torchreplicate_file_in_ranks") or torchreplicate.__file__)
    report["elapsed_s"] = time.time() - started

    table = run_header(report) + "\n\n" + markdown_tables(report)
    json_path = write_report(report, table, args.out, "latest")
    try:
        plot(report, os.path.join(args.out, "ratios.png"))
    except Exception as error:  # the plot is optional
        print(f"[bench] plot skipped: {error!r}")
    print()
    print(table)
    print(f"[bench] wrote {json_path}, latest.md, ratios.png in {report['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
