#!/usr/bin/env python
"""Dynamic-graph cost: a parameter unused on one rank, ``replicate()`` vs torch DDP.

Usage::

    python benchmarks/option_cost/bench_dynamic.py              # full run, ~3 min on 2 CPU cores
    python benchmarks/option_cost/bench_dynamic.py --quick      # smoke run, ~40 s
    python benchmarks/option_cost/bench_dynamic.py --models mlp --unused bias --rounds 20

One launch, 2 ranks, gloo, one intra-op thread per rank. Per model and per
kind of unused parameter (``--unused``), five engines live side by side in
one process group, each on its own model copy (same init) with its own SGD,
timed in interleaved rounds exactly as in ``bench_ddp.py``
(``benchlib.rounds.run_rounds``):

- ``ours_static``: ``replicate()`` defaults, every parameter used on every rank;
- ``ddp_static``: torch DDP defaults, same static model;
- ``ours_dyn``: ``replicate()`` defaults (no flag), the parameter unused on rank 1;
- ``ddp_fu_dyn``: DDP with ``find_unused_parameters=True`` (required there), same;
- ``ddp_fu_static``: DDP with ``find_unused_parameters=True`` on the static
  model, to separate the flag's own cost from the unused parameter's.

Kinds of unused parameter: ``bias`` — the model gets one extra parameter, an
output bias (1024 or 128 elements) added to its output, which rank 1 skips:
the compute is the same on both ranks, only the reducer's handling differs;
``layer`` — rank 1 skips the model's last ``Linear`` (a weight and a bias),
so rank 1 also computes less. Either way the unused tensors are the first
gradients of backward, in the first bucket (ours and DDP).

Afterwards (untimed): collectives per step and their payload
(``benchlib.collectives.count_wire``), and the largest parameter difference between our
engine and DDP's after the same steps (both average the same gradients, so
it is rounding). Writes ``<out>/unused_parameters.json`` and ``<out>/unused_parameters.md`` and
prints the tables. Timings are reported, never asserted.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: benchlib
from benchlib.collectives import count_wire
from benchlib.engines import Engine
from benchlib.models import MODEL_TITLES, build_model, make_batch
from benchlib.ranks import init_rank, launch_phase, rank_record
from benchlib.report import RESULTS_DIR, MiB, comma_choices, finish_report, run_env
from benchlib.rounds import ROUNDS_METHOD, run_rounds
from benchlib.stats import aggregate_timing, fmt_ratio
from torchreplicate import replicate

MODELS = ("mlp", "small")
UNUSED = ("bias", "layer")
ENGINES = ("ours_static", "ddp_static", "ours_dyn", "ddp_fu_dyn", "ddp_fu_static")
PAIRS = (
    ("ours_dyn", "ours_static"),  # what an unused parameter costs us
    ("ours_dyn", "ddp_fu_dyn"),  # us vs DDP on the dynamic graph
    ("ours_static", "ddp_static"),  # the static path, for comparison with bench_ddp
    ("ddp_fu_dyn", "ddp_static"),  # what the dynamic graph costs DDP
    ("ddp_fu_static", "ddp_static"),  # what the flag alone costs DDP
    ("ours_dyn", "ddp_static"),
)
UNUSED_TITLES = {
    "bias": "extra output bias unused on rank 1",
    "layer": "last Linear unused on rank 1",
}


def build_dynamic(model_name: str, unused: str, skip: bool) -> nn.Module:
    """The benchmark model, with one parameter (or layer) that ``skip`` leaves out."""
    base = build_model(model_name)
    width = {"mlp": 1024, "small": 128}[model_name]
    last_linear = max(i for i, m in enumerate(base) if isinstance(m, nn.Linear))

    class Bias(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bias = nn.Parameter(torch.zeros(width))

    class Dynamic(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.base = base
            if unused == "bias":
                # a child registered after ``base``, so the extra parameter is
                # the last in registration order (a module's own parameters
                # would come first): its gradient comes first in backward and
                # it lands in the first bucket, with the last Linear
                self.extra = Bias()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if unused == "bias":
                y = self.base(x)
                return y if skip else y + self.extra.bias
            for i, layer in enumerate(self.base):
                if not (skip and i == last_linear):
                    x = layer(x)
            return x

    return Dynamic()


def make_engine(kind: str, model_name: str, unused: str, rank: int) -> Engine:
    """An engine of ``ENGINES`` on the model of ``build_dynamic``, same init on every rank."""
    torch.manual_seed(0)
    dynamic = kind.endswith("_dyn")
    raw = build_dynamic(model_name, unused, skip=dynamic and rank == 1)
    if kind.startswith("ours"):
        module = replicate(raw)
    elif kind == "ddp_static":
        module = DDP(raw)
    else:
        module = DDP(raw, find_unused_parameters=True)
    return Engine(kind, model_name, module, raw)


def _max_param_diff(a: Engine, b: Engine) -> float:
    with torch.no_grad():
        return max(float((p - q).abs().max()) for p, q in zip(a.raw.parameters(), b.raw.parameters()))


def timing_worker(cfg: dict) -> dict:
    # DDP warns once that the static model has no unused parameter: that is
    # the point of ddp_fu_static
    warnings.filterwarnings("ignore", message=".*find_unused_parameters=True.*")
    rank, _ = init_rank(1)
    out: dict[str, Any] = {**rank_record(), "models": {}}
    for model_name in cfg["models"]:
        batch = make_batch(model_name, rank)
        for unused in cfg["unused"]:
            engines = {kind: make_engine(kind, model_name, unused, rank) for kind in cfg["engines"]}
            first = engines[cfg["engines"][0]]
            timed = run_rounds(engines, batch, cfg)
            wire = {kind: count_wire(lambda e=e: e.step(batch)) for kind, e in engines.items()}
            # every engine ran the same steps from the same init
            diffs = {}
            for a, b in (("ours_dyn", "ddp_fu_dyn"), ("ours_static", "ddp_static")):
                if a in engines and b in engines:
                    diffs[f"{a}-{b}"] = _max_param_diff(engines[a], engines[b])
            dist.barrier()
            out["models"][f"{model_name}:{unused}"] = {
                "n_params": first.num_params,
                "n_tensors": first.num_tensors,
                **timed,
                "collectives": wire,
                "max_param_diff": diffs,
            }
            del engines, first
            gc.collect()
    return out


# --------------------------------------------------------------------------
# report


def markdown(report: dict) -> str:
    lines = [
        "**Dynamic graph** (2 ranks, gloo, 1 thread/rank; step time = median over rounds of block time / K, slowest rank; "
        "ratio = median of per-round ratios [IQR] (min-max); `dyn` = one parameter unused on rank 1 every step; "
        "ours = `replicate()` defaults, no flag; DDP-fu = DDP with `find_unused_parameters=True`)",
        "",
        "| model | unused on rank 1 | ours static ms | DDP static ms | ours dyn ms | DDP-fu dyn ms | DDP-fu static ms "
        "| **ours dyn / ours static** | **ours dyn / DDP-fu dyn** | ours static / DDP static | DDP-fu dyn / DDP static |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, m in report["results"].items():
        model_name, unused = key.split(":")
        e, r = m["engines"], m["ratios"]

        def ms(kind: str) -> str:
            return f"{e[kind]['step_ms']['median']:.2f}" if kind in e else "n/a"

        lines.append(
            f"| {MODEL_TITLES.get(model_name, model_name)} | {UNUSED_TITLES[unused]} | {ms('ours_static')} | {ms('ddp_static')} "
            f"| {ms('ours_dyn')} | {ms('ddp_fu_dyn')} | {ms('ddp_fu_static')} "
            f"| {fmt_ratio(r.get('ours_dyn/ours_static'))} | {fmt_ratio(r.get('ours_dyn/ddp_fu_dyn'))} "
            f"| {fmt_ratio(r.get('ours_static/ddp_static'))} | {fmt_ratio(r.get('ddp_fu_dyn/ddp_static'))} |"
        )
    lines.append("")
    lines.append(
        "**Collectives** (per step and rank: count, and payload MiB handed to them, counted by `benchlib.collectives.count_wire`: "
        "wrapped `torch.distributed` calls + torch.profiler gloo events; DDP's C++ reducer shows in the profiler only). "
        "max |Δparam| = largest parameter difference between ours and DDP after the same steps from the same init."
    )
    lines.append("")
    lines.append(
        "| model | unused on rank 1 | collectives/step ours static / DDP static / ours dyn / DDP-fu dyn / DDP-fu static "
        "| payload MiB/step ours dyn / DDP-fu dyn | max abs param diff dyn / static |"
    )
    lines.append("|---|---|---|---|---|")
    for key, m in report["results"].items():
        model_name, unused = key.split(":")
        c = m["collectives"]

        def cnt(kind: str) -> str:
            return f"{c[kind]['per_step']:.0f}" if kind in c else "n/a"

        def pay(kind: str) -> str:
            return f"{c[kind]['payload_bytes_per_step'] / MiB:.3f}" if kind in c else "n/a"

        d = m["max_param_diff"]
        lines.append(
            f"| {MODEL_TITLES.get(model_name, model_name)} | {UNUSED_TITLES[unused]} "
            f"| {' / '.join(cnt(k) for k in ENGINES)} | {pay('ours_dyn')} / {pay('ddp_fu_dyn')} "
            f"| {d.get('ours_dyn-ddp_fu_dyn', float('nan')):.2g} / {d.get('ours_static-ddp_static', float('nan')):.2g} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds per case (default 40; quick 5)")
    parser.add_argument(
        "--steps", type=int, default=None, help="steps per timed block (default: about --block-s worth, >= 3)"
    )
    parser.add_argument(
        "--block-s", type=float, default=None, help="target seconds per timed block (default 0.25; quick 0.15)"
    )
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps per engine (default 5; quick 3)")
    parser.add_argument("--quick", action="store_true", help="short smoke run (~1 min)")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma list from {MODELS}")
    parser.add_argument("--unused", default=",".join(UNUSED), help=f"comma list from {UNUSED}")
    parser.add_argument("--out", default=RESULTS_DIR, help="output folder (default benchmarks/results)")
    parser.add_argument("--timeout", type=float, default=900, help="launch timeout in seconds")
    args = parser.parse_args(argv)

    models = comma_choices(parser, args.models, MODELS)
    unused = comma_choices(parser, args.unused, UNUSED, what="--unused")
    quick = args.quick
    cfg = {
        "models": models,
        "unused": unused,
        "engines": list(ENGINES),
        "rounds": args.rounds or (5 if quick else 40),
        "steps": args.steps,
        "min_steps": 2 if quick else 3,
        "block_s": args.block_s or (0.15 if quick else 0.25),
        "warmup": args.warmup or (3 if quick else 5),
    }
    started = time.time()
    report: dict[str, Any] = {
        "config": {**cfg, "quick": quick},
        "world_size": 2,
        "env": run_env(),
        "method": {
            **ROUNDS_METHOD,
            "collectives": (count_wire.__doc__ or "").strip().splitlines()[0],
            "models": {u: UNUSED_TITLES[u] for u in UNUSED},
        },
    }
    out = launch_phase("timing, 2 ranks", timing_worker, cfg, nprocs=2, timeout_s=args.timeout, tag="bench_dynamic")
    report["env"]["torchreplicate_file_in_ranks"] = out[0]["torchreplicate_file"]
    results = aggregate_timing(out, PAIRS)
    for key, m in results.items():
        m0 = out[0]["models"][key]
        m["collectives"] = m0["collectives"]
        m["collectives_rank1"] = out[1]["models"][key]["collectives"]
        m["max_param_diff"] = {k: max(r["models"][key]["max_param_diff"][k] for r in out) for k in m0["max_param_diff"]}
    report["results"] = results
    finish_report(report, started, out[0]["torchreplicate_file"], markdown, args.out, "unused_parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
