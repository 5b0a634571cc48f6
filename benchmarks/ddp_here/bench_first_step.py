#!/usr/bin/env python
"""What the start of a job costs: wrapping plus the first steps, ours against DDP, and the link calibration's bytes.

Usage::

    python benchmarks/ddp_here/bench_first_step.py            # ~2 min on 2 idle CPU cores
    python benchmarks/ddp_here/bench_first_step.py --quick    # smoke run, ~1 min

One launch, 2 ranks on loopback, gloo, one intra-op thread per rank. Per
model (``small``: about 5k parameters; ``large``: 8 x Linear(1024, 1024),
32 MiB of gradients) and per trial, each engine starts from a fresh copy of
the model (same init): ``replicate(model)`` or ``DistributedDataParallel(model)``,
then ``--steps`` steps of forward, backward and SGD. The wall time of that
(wrapping included, each rank from a barrier; the slowest rank counts) is
the job's start-up cost; the engines alternate within a trial, the order
rotated each trial.

Then, untimed, one more start of each engine counts what went on the wire:
the bytes of every all-reduce and broadcast (torch.profiler's gloo events,
DDP's included) and, for ours, the bytes the link calibration sent
(``reducer/layout/policy.py``'s ``measure_link``, [Note: tuning]) and the cap it chose. Last,
``--cap-rounds`` times, the calibration runs alternately within each
model's budget and within none (the sizes every model timed before the
budget): the caps the two choose on the same link.

Writes ``<out>/first_steps.json`` and ``<out>/first_steps.md`` and prints the
table. Timings are reported, never asserted; on a shared machine they are
noisy: read the medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: benchlib
from benchlib.ranks import init_rank, launch_phase, rank_record
from benchlib.report import RESULTS_DIR, comma_choices, finish_report, run_env
from benchlib.stats import summarize
from torchreplicate import replicate
from torchreplicate.faults.wire import Watch
from torchreplicate.reducer.layout import policy as tuning  # where the reducer looks measure_link up

MODELS = ("small", "large")
ENGINES = ("ours", "ddp")
BATCH = 32


def build_model(name: str) -> nn.Module:
    """``small``: 5,200 parameters; ``large``: 8 x Linear(1024, 1024), 8.4M parameters."""
    torch.manual_seed(0)
    if name == "small":
        return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 16))
    return nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)])


def make_batch(name: str, rank: int) -> torch.Tensor:
    """This rank's inputs (its own slice of the data)."""
    width = 64 if name == "small" else 1024
    return torch.randn(BATCH, width, generator=torch.Generator().manual_seed(rank))


def start_job(engine: str, name: str, steps: int) -> nn.Module:
    """Wraps a fresh model one way and runs ``steps`` SGD steps; returns the wrapped model."""
    model = build_model(name)
    wrapped = replicate(model) if engine == "ours" else DDP(model)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=1e-4)
    x = make_batch(name, dist.get_rank())
    for _ in range(steps):
        wrapped(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return wrapped


def timed_start(engine: str, name: str, steps: int) -> float:
    """Seconds from a barrier to the end of ``start_job`` on this rank."""
    dist.barrier()
    started = time.perf_counter()
    start_job(engine, name, steps)
    return time.perf_counter() - started


# the C++ names torch.profiler gives the dtypes of the tensors handed to gloo
_ELEMENT_BYTES = {
    "unsigned char": 1,
    "c10::Half": 2,
    "c10::BFloat16": 2,
    "float": 4,
    "int": 4,
    "double": 8,
    "long int": 8,
}


def wire_bytes(prof: Any) -> int:
    """Bytes handed to gloo's all-reduces and broadcasts, from the profiler's shapes and dtypes."""
    total = 0
    for event in prof.events():
        if event.name in ("gloo:all_reduce", "gloo:broadcast"):
            shape = (event.input_shapes or [[]])[0] or []
            dtype = (event.input_dtypes or ["float"])[0]
            total += _ELEMENT_BYTES.get(dtype, 4) * int(torch.Size(shape).numel())
    return total


def counted_start(engine: str, name: str, steps: int) -> dict:
    """One untimed start: the bytes on the wire, and for ours what the calibration sent and chose."""
    calibration: list[int] = []
    measure, all_reduce = tuning.measure_link, dist.all_reduce
    inside = [False]

    def counting_measure(*args: Any, **kwargs: Any) -> Any:
        inside[0] = True
        try:
            return measure(*args, **kwargs)
        finally:
            inside[0] = False

    def counting_all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if inside[0]:
            calibration.append(tensor.numel() * tensor.element_size())
        return all_reduce(tensor, *args, **kwargs)

    tuning.measure_link, dist.all_reduce = counting_measure, counting_all_reduce  # type: ignore[assignment]
    try:
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            wrapped = start_job(engine, name, steps)
    finally:
        tuning.measure_link, dist.all_reduce = measure, all_reduce  # type: ignore[assignment]
    grad_bytes = sum(p.numel() * p.element_size() for p in wrapped.parameters())
    record: dict[str, Any] = {"wire_bytes": wire_bytes(prof), "grad_bytes": grad_bytes}
    if engine == "ours":
        reducer = replicate.state(wrapped).reducer
        policy = reducer.layout_policy
        record.update(
            calibration_bytes=sum(calibration),
            calibration_all_reduces=len(calibration),
            cap_bytes=policy.cap_bytes,
            link=None if policy.link is None else list(policy.link),
            num_buckets=len(reducer.buckets),
        )
    return record


def compare_caps(budgets: dict[str, int], rounds: int) -> dict[str, list[int]]:
    """The cap each calibration budget chooses on this link, budgets alternated ``rounds`` times.

    Only the models whose link was measured have a budget here (a model no
    cap changes is never measured).

    ``today`` (an unbounded budget) times the sizes every model sent before
    the budget existed, so the caps of the two are compared on the same link
    in the same minutes.
    """
    caps: dict[str, list[int]] = {name: [] for name in budgets}
    for _ in range(rounds):
        for name, budget in budgets.items():
            link = tuning.measure_link(dist.group.WORLD, torch.float32, torch.device("cpu"), budget, Watch())
            caps[name].append(tuning.choose_cap(link))
    return caps


def worker(cfg: dict) -> dict:
    """One rank: timed trials of every engine per model, then one counted start each."""
    init_rank()
    out: dict[str, Any] = {**rank_record(), "models": {}}
    for name in cfg["models"]:
        times: dict[str, list[float]] = {e: [] for e in ENGINES}
        caps: list[int] = []
        for trial in range(cfg["trials"]):
            order = ENGINES[trial % len(ENGINES) :] + ENGINES[: trial % len(ENGINES)]
            for engine in order:
                times[engine].append(timed_start(engine, name, cfg["steps"]))
            caps.append(counted_start("ours", name, cfg["steps"])["cap_bytes"] if cfg["caps"] else 0)
        counted = {engine: counted_start(engine, name, cfg["steps"]) for engine in ENGINES}
        out["models"][name] = {"times_s": times, "caps": caps, "counted": counted}
        dist.barrier()
    if cfg["cap_rounds"]:
        measured = {n: m["counted"]["ours"] for n, m in out["models"].items() if m["counted"]["ours"]["link"]}
        budgets = {"today": 2**62, **{n: counted["grad_bytes"] for n, counted in measured.items()}}
        out["cap_comparison"] = compare_caps(budgets, cfg["cap_rounds"])
    dist.destroy_process_group()
    return out


def aggregate(out: list[dict], models: list[str]) -> dict:
    """Per model: the slowest rank's time per trial, summarised; the ratio ours / DDP per trial."""
    results = {}
    for name in models:
        per_rank = [r["models"][name] for r in out]
        slowest = {e: [max(ts) for ts in zip(*(m["times_s"][e] for m in per_rank))] for e in ENGINES}
        ratios = [o / d for o, d in zip(slowest["ours"], slowest["ddp"])]
        results[name] = {
            "start_s": {e: summarize(v) for e, v in slowest.items()},
            "ratio_ours_ddp": summarize(ratios),
            "overhead_s": summarize([o - d for o, d in zip(slowest["ours"], slowest["ddp"])]),
            "caps": per_rank[0]["caps"],
            "counted": per_rank[0]["counted"],
        }
    return results


def markdown(report: dict) -> str:
    """The report's table."""
    steps = report["config"]["steps"]
    lines = [
        f"Wrapping plus the first {steps} steps, 2 ranks on loopback (gloo, 1 thread each); "
        f"slowest rank per trial, median over {report['config']['trials']} trials [q1, q3].",
        "",
        "| model | grad bytes | ours s | DDP s | ours - DDP s | ours / DDP | calibration bytes (all-reduces) "
        "| wire bytes ours / DDP | caps chosen (MiB) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, r in report["results"].items():
        ours, ddp, counted = r["start_s"]["ours"], r["start_s"]["ddp"], r["counted"]
        caps = sorted({round(c / 2**20, 2) for c in r["caps"] + [counted["ours"]["cap_bytes"]]})
        lines.append(
            f"| {name} | {counted['ours']['grad_bytes']:,} | {ours['median']:.3f} [{ours['q1']:.3f}, {ours['q3']:.3f}] "
            f"| {ddp['median']:.3f} [{ddp['q1']:.3f}, {ddp['q3']:.3f}] | {r['overhead_s']['median']:+.3f} "
            f"| {r['ratio_ours_ddp']['median']:.2f} | {counted['ours']['calibration_bytes']:,} "
            f"({counted['ours']['calibration_all_reduces']}) "
            f"| {counted['ours']['wire_bytes']:,} / {counted['ddp']['wire_bytes']:,} | {caps} |"
        )
    caps = report.get("cap_comparison") or {}
    if caps:
        lines += [
            "",
            f"Caps chosen on this link by a calibration within each budget, alternated {len(caps['today'])} times "
            "(today: the sizes every model timed before the budget, 4 KiB + 2 MiB + 8 MiB):",
            "",
            "| budget | median cap MiB | caps MiB |",
            "|---|---:|---|",
        ]
        for name, values in caps.items():
            mib = sorted(round(c / 2**20, 2) for c in values)
            lines.append(f"| {name} | {statistics.median(mib):.2f} | {mib} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--trials", type=int, default=None, help="timed starts per engine and model (default 5; quick 2)"
    )
    parser.add_argument("--steps", type=int, default=4, help="steps after wrapping (default 4)")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma list from {MODELS}")
    parser.add_argument("--no-caps", action="store_true", help="skip the counted start of ours after each trial")
    parser.add_argument(
        "--cap-rounds", type=int, default=None, help="rounds of the cap comparison (default 8; quick 2)"
    )
    parser.add_argument("--quick", action="store_true", help="short smoke run")
    parser.add_argument("--out", default=RESULTS_DIR, help="output folder (default benchmarks/results)")
    parser.add_argument("--timeout", type=float, default=900, help="launch timeout in seconds")
    args = parser.parse_args(argv)
    models = comma_choices(parser, args.models, MODELS)
    cfg = {"models": models, "trials": args.trials or (2 if args.quick else 5), "steps": args.steps}
    cfg["caps"] = not args.no_caps
    cfg["cap_rounds"] = args.cap_rounds if args.cap_rounds is not None else (2 if args.quick else 8)
    started = time.time()
    report: dict[str, Any] = {"config": {**cfg, "quick": args.quick}, "world_size": 2, "env": run_env()}
    out = launch_phase("first steps, 2 ranks", worker, cfg, nprocs=2, timeout_s=args.timeout, tag="bench_first_step")
    report["results"] = aggregate(out, models)
    report["cap_comparison"] = out[0].get("cap_comparison", {})
    finish_report(report, started, out[0]["torchreplicate_file"], markdown, args.out, "first_steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
