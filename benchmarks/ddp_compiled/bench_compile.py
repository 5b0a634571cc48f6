#!/usr/bin/env python
"""Overlap under ``torch.compile``: how much communication ours exposes against DDP, eager and compiled.

Usage::

    python benchmarks/ddp_compiled/bench_compile.py            # ~4 min on 2 CPU cores (compiling included)
    python benchmarks/ddp_compiled/bench_compile.py --quick    # smoke run, ~2 min
    python benchmarks/ddp_compiled/bench_compile.py --rate 5gbit --name compile_overlap_5gbit   # two hosts (root)

One launch, 2 ranks, gloo, one intra-op thread per rank, the benchmark MLP
(8 x ``Linear(1024, 1024)``, batch 32) with ``bucket_cap_mb=4`` on both
engines (about 8 buckets: room to overlap). On loopback the two ranks'
compute and gloo's threads share 2 cores, so overlap buys little there and
may cost; ``--rate`` puts each rank in a host of its own joined by a link
of that rate (``benchlib.hosts``), where the wire, not the CPU, limits the
collectives and overlap pays as on a cluster. Six engines side by side in
interleaved rounds (``benchlib.rounds.run_rounds``): local training, ours and
DDP, each eager and under ``torch.compile`` (default backend).

- **Exposed communication** of an engine: its step time minus local
  training's in the same mode (eager or compiled), per round, median.
- **Where the buckets leave**: untimed, fresh engines with a comm hook that
  notes the host clock and then all-reduces as DDP's ``allreduce_hook``:
  per step, when the first and the last bucket left, as a fraction of the
  time from ``backward()``'s call to its return (0: at once; 1: at the end).
  Under ``torch.compile`` the backward of a compiled region is one autograd
  node: no gradient exists before it ends, so a bucket can leave earlier
  only where the graph is split (DDP's ``DDPOptimizer`` splits it at its
  bucket boundaries).

Writes ``<out>/compile_overlap.json`` and ``.md``; prints the table. Timings
are reported, never asserted.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: benchlib
from benchlib.engines import Engine
from benchlib.models import MODEL_TITLES, build_model, loss_of, make_batch
from benchlib.ranks import init_rank, launch_phase, rank_record
from benchlib.report import RESULTS_DIR, finish_report, run_env
from benchlib.rounds import ROUNDS_METHOD, run_rounds
from benchlib.stats import aggregate_timing, fmt_ratio, summarize
from torchreplicate import replicate

MODEL, CAP_MB = "mlp", 4
SIDES = ("local", "ours", "ddp")
MODES = ("eager", "compiled")


def make(side: str, mode: str, hook: Optional[Any] = None) -> Engine:
    """One engine: ``side`` wrapped, then compiled or not; ``hook``: a comm hook, registered first."""
    torch.manual_seed(0)
    raw = build_model(MODEL)
    wrapped: nn.Module = raw
    if side == "ours":
        wrapped = replicate(raw, bucket_cap_mb=CAP_MB)
    elif side == "ddp":
        wrapped = DDP(raw, bucket_cap_mb=CAP_MB)
    if hook is not None:
        wrapped.register_comm_hook(None, hook)
    module = torch.compile(wrapped) if mode == "compiled" else wrapped
    engine = Engine(f"{side}.{mode}", MODEL, module, raw)
    engine.opt = torch.optim.SGD(raw.parameters(), lr=1e-4)
    return engine


def launch_fractions(side: str, mode: str, batch: Any, steps: int) -> dict:
    """Per step: the first and last bucket's launch as a fraction of ``backward()``'s wall time."""
    times: list[float] = []
    torch._dynamo.reset()  # a fresh cache: each compiled engine is compiled, never past the recompile limit

    def noting_hook(state, bucket):  # type: ignore[no-untyped-def]  (DDP reads the annotations: none)
        """A comm hook that notes when each bucket left (host clock), then all-reduces and divides."""
        times.append(time.perf_counter())
        tensor = bucket.buffer().div_(dist.get_world_size())
        return dist.all_reduce(tensor, async_op=True).get_future().then(lambda fut: fut.value()[0])

    engine = make(side, mode, noting_hook)
    first, last = [], []
    for i in range(steps + 3):  # 3 warm-up steps: compiling, the buckets' rebuild
        x, y = batch
        loss = loss_of(MODEL, engine.module(x), y)
        times.clear()
        began = time.perf_counter()
        loss.backward()
        ended = time.perf_counter()
        engine.opt.step()
        engine.opt.zero_grad(set_to_none=True)
        if i >= 3 and times:
            first.append((times[0] - began) / (ended - began))
            last.append((times[-1] - began) / (ended - began))
    return {"first": summarize(first), "last": summarize(last), "buckets": len(times)}


def worker(cfg: dict) -> dict:
    rank, _ = init_rank(1)
    out: dict[str, Any] = rank_record()
    batch = make_batch(MODEL, rank)
    engines = {f"{side}.{mode}": make(side, mode) for mode in MODES for side in SIDES}
    timed = run_rounds(engines, batch, cfg)
    fractions = {
        f"{side}.{mode}": launch_fractions(side, mode, batch, cfg["launch_steps"])
        for mode in MODES
        for side in ("ours", "ddp")
    }
    raw = engines["local.eager"].raw
    out["models"] = {
        MODEL: {
            "n_params": sum(p.numel() for p in raw.parameters()),
            "n_tensors": len(list(raw.parameters())),
            **timed,
            "launch_fractions": fractions,
        }
    }
    return out


PAIRS = [
    ("ours.eager", "ddp.eager"),
    ("ours.compiled", "ddp.compiled"),
    ("ours.compiled", "ours.eager"),
    ("ddp.compiled", "ddp.eager"),
]


def exposed(report: dict) -> dict:
    """Exposed communication per engine and mode: per round, engine minus local in that mode; summary."""
    engines = report["results"][MODEL]["engines"]
    return {
        f"{side}.{mode}": summarize(
            [a - b for a, b in zip(engines[f"{side}.{mode}"]["per_round_ms"], engines[f"local.{mode}"]["per_round_ms"])]
        )
        for mode in MODES
        for side in ("ours", "ddp")
    }


def markdown(report: dict) -> str:
    m = report["results"][MODEL]
    e, r, f, x = m["engines"], m["ratios"], m["launch_fractions"], report["exposed_ms"]
    lines = [
        f"**Overlap under torch.compile** ({MODEL_TITLES[MODEL]}, `bucket_cap_mb={CAP_MB}` on both, 2 ranks, gloo, "
        + (f"two hosts joined at {report['config']['rate']}, " if report["config"].get("rate") else "loopback, ")
        + "1 thread/rank; step time = median over rounds of block time / K, slowest rank; exposed = engine minus "
        "local training in the same mode, per round, median; launch = when a bucket left, as a fraction of "
        "`backward()`'s wall time, median over steps (rank 0))",
        "",
        "| engine | step ms | exposed comm ms | first bucket left at | last bucket left at | buckets |",
        "|---|---|---|---|---|---|",
    ]
    for mode in MODES:
        lines.append(f"| local, {mode} | {e[f'local.{mode}']['step_ms']['median']:.2f} | - | - | - | - |")
        for side in ("ours", "ddp"):
            name = f"{side}.{mode}"
            lines.append(
                f"| {'ours' if side == 'ours' else 'DDP'}, {mode} | {e[name]['step_ms']['median']:.2f} "
                f"| {x[name]['median']:.2f} | {f[name]['first']['median']:.2f} | {f[name]['last']['median']:.2f} "
                f"| {f[name]['buckets']} |"
            )
    lines += [
        "",
        f"- ours/DDP eager: {fmt_ratio(r.get('ours.eager/ddp.eager'))}",
        f"- ours/DDP compiled: {fmt_ratio(r.get('ours.compiled/ddp.compiled'))}",
        f"- compiled/eager: ours {fmt_ratio(r.get('ours.compiled/ours.eager'))}, "
        f"DDP {fmt_ratio(r.get('ddp.compiled/ddp.eager'))}",
    ]
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 12; quick 3)")
    parser.add_argument("--quick", action="store_true", help="short smoke run")
    parser.add_argument("--out", default=RESULTS_DIR, help="output folder (default benchmarks/results)")
    parser.add_argument("--name", default="compile_overlap", help="the result files' stem")
    parser.add_argument("--rate", default=None, help="two hosts joined at this rate (tc notation, 5gbit); root")
    parser.add_argument("--timeout", type=float, default=1200, help="launch timeout in seconds")
    args = parser.parse_args(argv)
    cfg = {
        "rounds": args.rounds or (3 if args.quick else 12),
        "steps": None,
        "min_steps": 3,
        "block_s": 0.15 if args.quick else 0.3,
        "warmup": 3,
        "launch_steps": 5 if args.quick else 15,
    }
    started = time.time()
    report: dict[str, Any] = {
        "config": {**cfg, "quick": args.quick, "bucket_cap_mb": CAP_MB, "rate": args.rate},
        "world_size": 2,
        "env": run_env(),
        "method": {**ROUNDS_METHOD, "launch": launch_fractions.__doc__, "exposed": exposed.__doc__},
    }
    if args.rate:
        from benchlib.hosts import launch_on_hosts

        out = launch_on_hosts(
            "compile overlap", worker, cfg, rate=args.rate, timeout_s=args.timeout, tag="bench_compile"
        )
    else:
        out = launch_phase(
            "compile overlap, 2 ranks", worker, cfg, nprocs=2, timeout_s=args.timeout, tag="bench_compile"
        )
    report["env"]["torchreplicate_file_in_ranks"] = out[0]["torchreplicate_file"]
    report["results"] = aggregate_timing(out, PAIRS)
    report["results"][MODEL]["launch_fractions"] = out[0]["models"][MODEL]["launch_fractions"]
    report["exposed_ms"] = exposed(report)
    finish_report(report, started, out[0]["torchreplicate_file"], markdown, args.out, args.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
