#!/usr/bin/env python
"""Comm hooks and wire precision: step time and bytes, ``replicate()`` vs torch DDP.

Usage::

    python benchmarks/option_cost/bench_hooks.py              # full run, ~3 min on 2 CPU cores
    python benchmarks/option_cost/bench_hooks.py --quick      # smoke run, ~40 s
    python benchmarks/option_cost/bench_hooks.py --variants fp32,psgd_r1 --rounds 10

One launch, 2 ranks, gloo, one intra-op thread per rank, the benchmark MLP
(8 x ``Linear(1024, 1024)``, 8.4 M parameters, batch 32). Every engine, ours
and DDP's for each variant, lives side by side in one process group on its
own model copy (same init) with its own SGD, timed in interleaved rounds as
in ``bench_ddp.py`` (``benchlib.rounds.run_rounds``: a block of K steps per engine per
round, engine order rotated each round, a barrier before each block).

Variants (``ours`` = ``replicate()``; ``DDP`` = torch DDP with the same stock
hook from ``torch.distributed.algorithms.ddp_comm_hooks``, defaults otherwise):

- ``fp32``: no hook (both reduce float32 gradients in their own reducer);
- ``bf16_wire``: ours with ``replicate(reduce_dtype=torch.bfloat16)``; DDP
  has no such option (its counterpart is ``bf16_compress_hook``);
- ``bf16_hook`` / ``fp16_hook``: ``bf16_compress_hook`` / ``fp16_compress_hook``
  (DDP refuses ``bf16_compress_hook`` without CUDA + NCCL: reported as refused);
- ``psgd_r1`` / ``psgd_r2`` / ``psgd_r4``: ``powerSGD_hook`` with
  ``PowerSGDState(process_group=None, matrix_approximation_rank=r,
  start_powerSGD_iter=2, use_error_feedback=True, warm_start=True)``, with
  ONE bucket for both (``bucket_cap_mb=64``, and for ours also
  ``first_bucket_cap_mb=64``): DDP + PowerSGD with several buckets can hang
  or abort on gloo, because PowerSGD launches collectives from future
  callbacks whose order differs by rank;
- ``psgd_r2_buckets``: ours only, PowerSGD r=2 with the default buckets
  (1 MiB first, then 25 MiB: 2 buckets here), which our reducer supports.

Bytes on the wire: after timing, untimed, ``benchlib.collectives.count_wire`` counts each
engine's collectives over 2 steps: ``torch.distributed.all_reduce``,
``all_gather``, ``all_gather_into_tensor``, ``broadcast`` and
``reduce_scatter_tensor`` wrapped in the rank process (every Python-level
call, from any thread: our reducer, the hooks and their callbacks), merged
with the ``gloo:*`` events of torch.profiler that no wrapped call accounts
for (DDP's C++ reducer). Payload = bytes of the tensors handed in, per step
and rank. Also reported: the largest parameter difference between ours and
DDP's engine of a variant after the same steps (same math: rounding only).

Writes ``<out>/comm_hooks.json`` and ``<out>/comm_hooks.md`` and prints the table.
Timings are reported, never asserted.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: benchlib
from benchlib.collectives import count_wire
from benchlib.engines import Engine
from benchlib.models import MODEL_TITLES, build_model, make_batch
from benchlib.ranks import init_rank, launch_phase, rank_record
from benchlib.report import RESULTS_DIR, MiB, finish_report, run_env
from benchlib.rounds import ROUNDS_METHOD, run_rounds
from benchlib.stats import aggregate_timing, fmt_ratio
from torchreplicate import replicate

MODEL = "mlp"
ONE_BUCKET_MB = 64  # > the MLP's 32 MiB of gradients: one bucket
VARIANTS = ("fp32", "bf16_wire", "bf16_hook", "fp16_hook", "psgd_r1", "psgd_r2", "psgd_r4", "psgd_r2_buckets")
OURS_ONLY = {
    "bf16_wire": "no DDP option (its counterpart is bf16_compress_hook)",
    "psgd_r2_buckets": "not run: DDP + PowerSGD with several buckets can hang on gloo",
}
TITLES = {
    "fp32": "fp32, no hook",
    "bf16_wire": "bf16 on the wire: `reduce_dtype=torch.bfloat16`",
    "bf16_hook": "`bf16_compress_hook`",
    "fp16_hook": "`fp16_compress_hook`",
    "psgd_r1": "`powerSGD_hook` r=1, one bucket",
    "psgd_r2": "`powerSGD_hook` r=2, one bucket",
    "psgd_r4": "`powerSGD_hook` r=4, one bucket",
    "psgd_r2_buckets": "`powerSGD_hook` r=2, default buckets (2)",
}


def _psgd_rank(variant: str) -> Optional[int]:
    return int(variant.split("_")[1][1:]) if variant.startswith("psgd_") else None


def make_engine(side: str, variant: str, ddp_gbv: bool) -> tuple[Engine, Optional[powerSGD_hook.PowerSGDState]]:
    """The engine of one side (``ours`` or ``ddp``) of a variant, and its PowerSGD state if any.

    Raises what DDP or replicate() raise (a refusal).
    """
    torch.manual_seed(0)
    raw = build_model(MODEL)
    rank = _psgd_rank(variant)
    one_bucket = rank is not None and variant != "psgd_r2_buckets"
    if side == "ours":
        kwargs: dict[str, Any] = {}
        if one_bucket:
            kwargs.update(bucket_cap_mb=ONE_BUCKET_MB, first_bucket_cap_mb=ONE_BUCKET_MB)
        if variant == "bf16_wire":
            kwargs["reduce_dtype"] = torch.bfloat16
        module = replicate(raw, **kwargs)
    else:
        kwargs = {"gradient_as_bucket_view": ddp_gbv}
        if one_bucket:
            # an explicit bucket_cap_mb also sets DDP's first-bucket cap
            kwargs["bucket_cap_mb"] = ONE_BUCKET_MB
        module = DDP(raw, **kwargs)
    state: Optional[powerSGD_hook.PowerSGDState] = None
    if variant == "bf16_hook":
        module.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif variant == "fp16_hook":
        module.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif rank is not None:
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=rank,
            start_powerSGD_iter=2,
            use_error_feedback=True,
            warm_start=True,
        )
        module.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    return Engine(f"{side}.{variant}", MODEL, module, raw, keep=(state,)), state


def _buckets(engine: Engine) -> Any:
    """Gradient elements per bucket, in launch order (for the record)."""
    if engine.kind.startswith("ours"):
        reducer = engine.reducer
        return [b.numel for b in reducer.buckets] if reducer is not None else None
    try:  # private API; DDP logs bytes, the model is float32
        sizes = engine.module._get_ddp_logging_data().get("rebuilt_bucket_sizes")
        return [int(x) // 4 for x in str(sizes).split(",")] if sizes else sizes
    except Exception as error:
        return f"unavailable: {error!r}"


def timing_worker(cfg: dict) -> dict:
    rank, _ = init_rank(1)
    out: dict[str, Any] = rank_record()
    batch = make_batch(MODEL, rank)
    engines: dict[str, Engine] = {}
    psgd_states: dict[str, powerSGD_hook.PowerSGDState] = {}
    refused: dict[str, str] = {}
    for variant in cfg["variants"]:
        for side in ("ours", "ddp"):
            name = f"{side}.{variant}"
            if side == "ddp" and variant in OURS_ONLY:
                refused[name] = OURS_ONLY[variant]
                continue
            try:
                engines[name], state = make_engine(side, variant, cfg["ddp_gbv"])
                if state is not None:
                    psgd_states[name] = state
            except Exception as error:  # a refusal is a result
                refused[name] = f"refused: {type(error).__name__}: {error}"
            dist.barrier()  # a refusal is the same on every rank
    timed = run_rounds(engines, batch, cfg)
    wire = {name: count_wire(lambda e=e: e.step(batch)) for name, e in engines.items()}
    diffs = {}
    with torch.no_grad():
        for variant in cfg["variants"]:
            a, b = engines.get(f"ours.{variant}"), engines.get(f"ddp.{variant}")
            if a is not None and b is not None:
                diffs[variant] = max(float((p - q).abs().max()) for p, q in zip(a.raw.parameters(), b.raw.parameters()))
    stats = {}
    for name, state in psgd_states.items():
        rate, before, after = state.compression_stats()
        stats[name] = {"compress_rate": rate, "numel_before": before, "numel_after": after}
    out["models"] = {
        MODEL: {
            "n_params": next(iter(engines.values())).num_params,
            "n_tensors": next(iter(engines.values())).num_tensors,
            **timed,
            "collectives": wire,
            "buckets": {name: _buckets(e) for name, e in engines.items()},
            "max_param_diff": diffs,
            "powersgd_stats": stats,
        }
    }
    out["refused"] = refused
    del engines
    gc.collect()
    return out


# --------------------------------------------------------------------------
# report


def pairs_for(variants: list[str]) -> list[tuple[str, str]]:
    pairs = []
    for v in variants:
        pairs.append((f"ours.{v}", f"ddp.{v}"))
        pairs.append((f"ours.{v}", "ours.fp32"))
        pairs.append((f"ddp.{v}", "ddp.fp32"))
    pairs.append(("ours.psgd_r2_buckets", "ours.psgd_r2"))
    pairs.append(("ours.bf16_wire", "ours.bf16_hook"))
    return [p for p in pairs if p[0] != p[1]]


def markdown(report: dict) -> str:
    m = report["results"][MODEL]
    e, r, c = m["engines"], m["ratios"], m["collectives"]
    refused = report["refused"]
    lines = [
        f"**Comm hooks and wire precision** ({MODEL_TITLES[MODEL]}, 2 ranks, gloo, 1 thread/rank; step time = median over rounds of "
        "block time / K, slowest rank; ratio = median of per-round ratios [IQR] (min-max); "
        f"DDP = torch DDP{' (gradient_as_bucket_view=True)' if report['config']['ddp_gbv'] else ' (defaults)'} with the same stock hook; "
        f"PowerSGD: start_powerSGD_iter=2, error feedback, warm start, one bucket (bucket_cap_mb={ONE_BUCKET_MB}) unless noted; "
        "collectives and payload per step and rank from wrapped torch.distributed collectives + torch.profiler gloo events; "
        "max |Δparam| = largest parameter difference ours vs DDP after the same steps)",
        "",
        "| variant | ours ms | DDP ms | **ours/DDP** | ours / ours fp32 | DDP / DDP fp32 | collectives/step ours / DDP "
        "| payload MiB/step/rank ours / DDP | max abs Δparam |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for v in report["config"]["variants"]:
        o, d = f"ours.{v}", f"ddp.{v}"

        def ms(name: str) -> str:
            if name in e:
                return f"{e[name]['step_ms']['median']:.2f}"
            return refused.get(name, "n/a")

        def cnt(name: str) -> str:
            return f"{c[name]['per_step']:.0f}" if name in c else "-"

        def pay(name: str) -> str:
            return f"{c[name]['payload_bytes_per_step'] / MiB:.3f}" if name in c else "-"

        diff = m["max_param_diff"].get(v)
        lines.append(
            f"| {TITLES[v]} | {ms(o)} | {ms(d)} | {fmt_ratio(r.get(f'{o}/{d}'))} "
            f"| {fmt_ratio(r.get(f'{o}/ours.fp32')) if v != 'fp32' else '1'} "
            f"| {fmt_ratio(r.get(f'{d}/ddp.fp32')) if v != 'fp32' else '1'} "
            f"| {cnt(o)} / {cnt(d)} | {pay(o)} / {pay(d)} | {'-' if diff is None else f'{diff:.2g}'} |"
        )
    extra = [
        (k, lbl)
        for k, lbl in (
            ("ours.psgd_r2_buckets/ours.psgd_r2", "ours PowerSGD r=2, default buckets / one bucket"),
            ("ours.bf16_wire/ours.bf16_hook", "ours reduce_dtype=bf16 / ours bf16_compress_hook"),
        )
        if k in r
    ]
    if extra:
        lines.append("")
        for k, lbl in extra:
            lines.append(f"- {lbl}: {fmt_ratio(r[k])}")
    lines.append("")
    lines.append(
        "Gradient elements per bucket: "
        + "; ".join(f"{name} {b}" for name, b in m["buckets"].items() if "psgd" in name or name.endswith("fp32"))
        + ". With a comm hook our reducer sends its per-step flags (`num_params + 1` floats) as an all-reduce of their own, "
        "after the hooks' futures complete; without one they ride in the last bucket."
    )
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 40; quick 4)")
    parser.add_argument(
        "--steps", type=int, default=None, help="steps per timed block (default: about --block-s worth, >= 3)"
    )
    parser.add_argument(
        "--block-s", type=float, default=None, help="target seconds per timed block (default 0.25; quick 0.15)"
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="warm-up steps per engine (default 5; quick 3; PowerSGD compresses from step 3)",
    )
    parser.add_argument("--quick", action="store_true", help="short smoke run (~1 min)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list from {VARIANTS}")
    parser.add_argument(
        "--ddp-gbv", action="store_true", help="DDP engines with gradient_as_bucket_view=True (default: DDP defaults)"
    )
    parser.add_argument("--out", default=RESULTS_DIR, help="output folder (default benchmarks/results)")
    parser.add_argument("--timeout", type=float, default=900, help="launch timeout in seconds")
    args = parser.parse_args(argv)

    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        if v not in VARIANTS:
            parser.error(f"unknown variant {v!r}")
    if "fp32" not in variants:
        variants.insert(0, "fp32")  # the reference of the "vs fp32" columns
    quick = args.quick
    cfg = {
        "variants": variants,
        "ddp_gbv": args.ddp_gbv,
        "rounds": args.rounds or (4 if quick else 40),
        "steps": args.steps,
        "min_steps": 2 if quick else 3,
        "block_s": args.block_s or (0.15 if quick else 0.25),
        "warmup": max(3, args.warmup or (3 if quick else 5)),
    }
    started = time.time()
    report: dict[str, Any] = {
        "config": {**cfg, "quick": quick, "one_bucket_mb": ONE_BUCKET_MB},
        "world_size": 2,
        "env": run_env(),
        "method": {
            **ROUNDS_METHOD,
            "collectives": count_wire.__doc__,
        },
    }
    out = launch_phase("timing, 2 ranks", timing_worker, cfg, nprocs=2, timeout_s=args.timeout, tag="bench_hooks")
    report["env"]["torchreplicate_file_in_ranks"] = out[0]["torchreplicate_file"]
    results = aggregate_timing(out, pairs_for(variants))
    m0 = out[0]["models"][MODEL]
    results[MODEL].update(
        collectives=m0["collectives"],
        collectives_rank1=out[1]["models"][MODEL]["collectives"],
        buckets=m0["buckets"],
        max_param_diff={k: max(r["models"][MODEL]["max_param_diff"][k] for r in out) for k in m0["max_param_diff"]},
        powersgd_stats=m0["powersgd_stats"],
    )
    report["results"] = results
    report["refused"] = out[0]["refused"]
    finish_report(report, started, out[0]["torchreplicate_file"], markdown, args.out, "comm_hooks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
