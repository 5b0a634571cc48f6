"""Counting the collectives an engine issues per step, and their payload (runs in every rank).

Two counters: ``count_all_reduces`` (``bench_ddp.py``: ``gloo:all_reduce``
profiler events, float32 payload) and ``count_wire`` (``bench_dynamic.py``,
``bench_hooks.py``: every kind of collective, any dtype, also those launched
from comm-hook callbacks). Both run untimed, after the timed rounds.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from benchlib.engines import Engine


def count_all_reduces(engine: Engine, batch: Any, steps: int = 2) -> dict:
    """All-reduces per step and their float32 payload, from torch.profiler (gloo records them).

    For our engines, cross-checked by wrapping ``torch.distributed.all_reduce``
    in this process; for DDP, against its private ``_get_ddp_logging_data()``.
    """
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(steps):
            engine.step(batch)
    sizes = []
    for event in prof.events():
        if event.name == "gloo:all_reduce":
            sizes.append(_numel((event.input_shapes or [[]])[0] or []))
    result: dict[str, Any] = {
        "method": "torch.profiler 'gloo:all_reduce' events",
        "per_step": len(sizes) / steps,
        # every reduced tensor in these models is float32
        "payload_bytes_per_step": 4 * sum(sizes) / steps,
        "sizes_numel_one_step": sizes[: len(sizes) // steps],
    }
    reducer = engine.reducer
    if reducer is not None:
        # cross-check: wrap torch.distributed.all_reduce (this process only)
        calls: list[int] = []
        original = dist.all_reduce

        def counting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
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


# torch.distributed functions wrapped by count_wire: name -> (op, position,
# keyword) of the tensor this rank contributes; all_gather_into_tensor shows
# as gloo:all_gather
_WIRE_FUNCTIONS = {
    "all_reduce": ("all_reduce", 0, "tensor"),
    "all_gather": ("all_gather", 1, "tensor"),
    "all_gather_into_tensor": ("all_gather", 1, "input_tensor"),
    "broadcast": ("broadcast", 0, "tensor"),
    "reduce_scatter_tensor": ("reduce_scatter", 1, "input"),
}
# the profiler's C++ dtype names
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
# ring estimate of bytes sent per byte of payload, at world size w
_RING_FACTORS: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda w: 2 * (w - 1) / w,
    "all_gather": lambda w: w - 1,
    "reduce_scatter": lambda w: (w - 1) / w,
    "broadcast": lambda w: 1.0,
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
    world = dist.get_world_size()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(steps):
            step()
    profiled = []
    for event in prof.events():
        if not event.name.startswith("gloo:") or event.name == "gloo:barrier":
            continue
        numel = _numel((event.input_shapes or [[]])[0] or [])
        dtypes = getattr(event, "input_dtypes", None) or ["?"]
        profiled.append((event.name[len("gloo:") :], numel, _PROFILER_DTYPES.get(dtypes[0], dtypes[0])))

    calls: list[tuple[str, int, str]] = []
    originals = {name: getattr(dist, name) for name in _WIRE_FUNCTIONS if hasattr(dist, name)}

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        op, position, keyword = _WIRE_FUNCTIONS[name]

        def counting(*args: Any, **kwargs: Any) -> Any:
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

    remaining: dict[tuple[str, int, str], int] = defaultdict(int)
    for call in calls:
        remaining[call] += 1
    profiler_only = []
    for event in profiled:
        if remaining[event] > 0:
            remaining[event] -= 1
        else:
            profiler_only.append(event)
    merged = calls + profiler_only
    item = {
        name: torch.empty((), dtype=getattr(torch, name)).element_size()
        for name in set(c[2] for c in merged)
        if hasattr(torch, name)
    }
    payload = sum(n * item.get(dt, 4) for _, n, dt in merged) / steps
    sent = sum(n * item.get(dt, 4) * _RING_FACTORS.get(op, lambda w: 1.0)(world) for op, n, dt in merged) / steps
    by_op: dict[str, int] = defaultdict(int)
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


def _numel(shape: list[int]) -> int:
    numel = 1
    for dim in shape:
        numel *= dim
    return numel
