#!/usr/bin/env python
"""What seeing inside a step costs: step events off, a do-nothing observer, trace(), log_summary(), verify_replicas().

Usage::

    python benchmarks/option_cost/bench_observe.py            # full run, ~2 min on 2 CPU cores
    python benchmarks/option_cost/bench_observe.py --quick    # smoke run, ~40 s

One launch, 2 ranks, gloo, one intra-op thread per rank. Per model, three
engines live side by side in one process group, each a ``replicate()`` of
its own model copy (same init, default options) with its own SGD, timed in
interleaved rounds as in ``bench_ddp.py`` (``benchlib.rounds.run_rounds``):

- ``off``: nothing attached (the default): one attribute check per event point;
- ``null``: ``replicate.state(m).set_events(null_events)``, an observer whose
  methods do nothing: the cost of the calls alone;
- ``summary``: ``torchreplicate.log_summary(m, every=100)`` (the recorder,
  plus one small all-reduce every 100th step).

``trace()`` runs ``torch.profiler``, which records every op of the process,
so it cannot share the process with engines timed untraced: after the
rounds, the ``off`` engine runs as many rounds again, each one block of K
steps inside ``trace()`` (``trace``; entry and exit, with the export and the
gather, untimed) and one without (``untraced``), in alternating order.

Then, untimed by the rounds: the time of one ``verify_replicas(model)`` call
(median of repeated calls, slowest rank), and in the parent process the
recorder alone, fed one synthetic step of each model's event pattern
(nanoseconds per step, no process group: the floor of ``summary``'s cost).

Writes ``<out>/observer_cost.json`` and ``<out>/observer_cost.md`` and prints the table.
Timings are reported, never asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: benchlib
from benchlib.engines import Engine
from benchlib.models import MODEL_TITLES, build_model, make_batch
from benchlib.ranks import init_rank, launch_phase, rank_record
from benchlib.report import RESULTS_DIR, comma_choices, finish_report, run_env
from benchlib.rounds import ROUNDS_METHOD, run_rounds
from benchlib.stats import aggregate_timing, fmt_ratio, per_round_ratios
from torchreplicate import log_summary, replicate, trace, verify_replicas
from torchreplicate.observe.timeline import StepRecorder
from torchreplicate.reducer.probe import StepEvent as E

MODELS = ("mlp", "small")
ENGINES = ("off", "null", "summary")  # interleaved in one round
KINDS = (*ENGINES, "untraced", "trace")  # and the trace rounds' two
PAIRS = (("null", "off"), ("summary", "off"), ("trace", "untraced"))


def null_events(event: E, a: int, b: int) -> None:
    """A step observer that does nothing (reducer/probe.py's StepObserver): the cost of the calls alone."""


def timing_worker(cfg: dict) -> dict:
    rank, _ = init_rank(1)
    out: dict[str, Any] = {**rank_record(), "models": {}}
    folder = tempfile.mkdtemp(prefix="bench_observe_") if rank == 0 else ""
    for model_name in cfg["models"]:
        batch = make_batch(model_name, rank)
        engines = {}
        for kind in cfg["engines"]:
            torch.manual_seed(0)
            raw = build_model(model_name)
            engines[kind] = Engine(kind, model_name, replicate(raw), raw)
        if "null" in engines:
            replicate.state(engines["null"].module).set_events(null_events)
        summary = log_summary(engines["summary"].module, every=100) if "summary" in engines else None
        timed = run_rounds(engines, batch, cfg)
        if summary is not None:
            summary.stop()
        path = os.path.join(folder, f"{model_name}-trace.json")
        traced = trace_rounds(engines["off"], batch, timed["steps_per_block"], cfg["rounds"], path)
        for key, blocks in traced.items():
            timed[key].update(blocks)
        model = engines["off"].module
        verify_replicas(model)  # warm
        checks = []
        for _ in range(cfg["verify_repeats"]):
            dist.barrier()
            t0 = time.perf_counter()
            verify_replicas(model)
            checks.append(time.perf_counter() - t0)
        reducer = replicate.state(model).reducer
        out["models"][model_name] = {
            "n_params": engines["off"].num_params,
            "n_tensors": engines["off"].num_tensors,
            "num_buckets": len(reducer.buckets),
            "bucket_sizes": [len(b.slots) for b in reducer.buckets],
            "verify_ms": statistics.median(checks) * 1e3,
            **timed,
        }
        del engines
    return out


def trace_rounds(engine: Engine, batch: Any, k: int, rounds: int, path: str) -> dict[str, dict[str, list[Any]]]:
    """Blocks of ``k`` steps of ``engine``, each round one inside ``trace()`` and one not, in alternating order.

    Entry and exit of ``trace()`` (barrier, export, gather, rank 0's file)
    are outside the timed block. Returns ``per_step_s``, ``block_s`` and
    ``cpu_block_s`` for the kinds ``trace`` and ``untraced``, shaped as
    ``run_rounds``' own.
    """
    out: dict[str, dict[str, list[Any]]] = {
        key: {"untraced": [], "trace": []} for key in ("per_step_s", "block_s", "cpu_block_s")
    }
    for r in range(rounds):
        for kind in ("untraced", "trace") if r % 2 == 0 else ("trace", "untraced"):
            traced = kind == "trace"
            with trace(path, model=engine.module, plot=False) if traced else contextlib.nullcontext():
                dist.barrier()
                steps = []
                c_block, t_block = time.thread_time(), time.perf_counter()
                for _ in range(k):
                    t0 = time.perf_counter()
                    engine.step(batch)
                    steps.append(time.perf_counter() - t0)
                out["block_s"][kind].append(time.perf_counter() - t_block)
                out["cpu_block_s"][kind].append(time.thread_time() - c_block)
                out["per_step_s"][kind].append(steps)
    return out


def recorder_ns_per_step(bucket_sizes: list[int], repeats: int = 2000) -> float:
    """The recorder alone, fed one step of this event pattern (with one subscriber that keeps the record)."""
    recorder = StepRecorder()
    kept: list[Any] = []
    recorder.subscribers.append(kept.append)
    best = float("inf")
    for _ in range(5):
        kept.clear()
        t0 = time.perf_counter_ns()
        for step in range(repeats):
            recorder(E.BACKWARD, step, 0)
            for index, size in enumerate(bucket_sizes):
                for _ in range(size):
                    recorder(E.GRAD, index, 0)
                if index < len(bucket_sizes) - 1:
                    recorder(E.LAUNCH, index, 1)
            recorder(E.FINALIZE, step, 0)
            recorder(E.LAUNCH, len(bucket_sizes) - 1, 0)
            for index in range(len(bucket_sizes)):
                recorder(E.WAITING, index, 0)
                recorder(E.DONE, index, 0)
            recorder(E.STEP_END, step, 0)
        best = min(best, (time.perf_counter_ns() - t0) / repeats)
    return best


def markdown(report: dict) -> str:
    lines = [
        "**Cost of seeing inside a step** (2 ranks, gloo, 1 thread/rank, `replicate()` defaults; step time = "
        "median over rounds of block time / K, slowest rank; ratio = median of per-round ratios [IQR] (min-max); "
        "`off`: no observer; `null`: an observer whose methods do nothing; `summary`: `log_summary(every=100)`; "
        "then, in rounds of their own, the `off` model inside `trace()` (torch.profiler on) and not (`untraced`))",
        "",
        "| model | buckets | off ms | null ms | summary ms | untraced ms | trace ms | **null / off** "
        "| summary / off | **trace / untraced** | recorder alone, µs/step | `verify_replicas()` ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    cpu_lines = [
        "",
        "**Training-thread CPU time per step** (`time.thread_time()`, mean over ranks: the observer's work, without "
        "waiting and without the time other processes took the core; gloo's own threads not included)",
        "",
        "| model | off ms | null ms | summary ms | untraced ms | trace ms | **null / off** | summary / off "
        "| **trace / untraced** |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, m in report["results"].items():
        e, r = m["engines"], m["ratios"]

        def ms(kind: str) -> str:
            return f"{e[kind]['step_ms']['median']:.2f}" if kind in e else "n/a"

        lines.append(
            f"| {MODEL_TITLES.get(name, name)}, {m['n_tensors']} tensors | {m['num_buckets']} "
            f"| {' | '.join(ms(k) for k in KINDS)} "
            f"| {' | '.join(fmt_ratio(r.get(f'{a}/{b}')) for a, b in PAIRS)} "
            f"| {m['recorder_ns_per_step'] / 1e3:.1f} | {m['verify_ms']:.2f} |"
        )

        def cpu(kind: str) -> str:
            return f"{e[kind]['cpu_step_ms']['median']:.2f}" if kind in e else "n/a"

        cpu_lines.append(
            f"| {MODEL_TITLES.get(name, name)} | {' | '.join(cpu(k) for k in KINDS)} "
            f"| {' | '.join(fmt_ratio(m['cpu_ratios'].get(f'{a}/{b}')) for a, b in PAIRS)} |"
        )
    return "\n".join(lines + cpu_lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 30; quick 5)")
    parser.add_argument("--steps", type=int, default=None, help="steps per timed block (default: about --block-s)")
    parser.add_argument("--block-s", type=float, default=None, help="target seconds per block (default 0.25)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps per engine (default 5; quick 3)")
    parser.add_argument("--quick", action="store_true", help="short smoke run")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma list from {MODELS}")
    parser.add_argument("--out", default=RESULTS_DIR, help="output folder (default benchmarks/results)")
    parser.add_argument("--timeout", type=float, default=900, help="launch timeout in seconds")
    args = parser.parse_args(argv)
    models = comma_choices(parser, args.models, MODELS)
    quick = args.quick
    cfg = {
        "models": models,
        "engines": list(ENGINES),
        "rounds": args.rounds or (5 if quick else 30),
        "steps": args.steps,
        "min_steps": 2 if quick else 3,
        "block_s": args.block_s or (0.15 if quick else 0.25),
        "warmup": args.warmup or (3 if quick else 5),
        "verify_repeats": 5 if quick else 20,
    }
    started = time.time()
    report: dict[str, Any] = {
        "config": {**cfg, "quick": quick},
        "world_size": 2,
        "env": run_env(),
        "method": {**ROUNDS_METHOD, "recorder": (recorder_ns_per_step.__doc__ or "").strip()},
    }
    out = launch_phase("timing, 2 ranks", timing_worker, cfg, nprocs=2, timeout_s=args.timeout, tag="bench_observe")
    results = aggregate_timing(out, PAIRS)
    for name, m in results.items():
        m0 = out[0]["models"][name]
        m["num_buckets"] = m0["num_buckets"]
        m["verify_ms"] = max(r["models"][name]["verify_ms"] for r in out)
        m["recorder_ns_per_step"] = recorder_ns_per_step(m0["bucket_sizes"])
        # the training thread's CPU time: what an observer adds, without the waiting and
        # the time other processes took the core (this machine's cores are shared)
        m["cpu_ratios"] = per_round_ratios({k: e["per_round_cpu_ms"] for k, e in m["engines"].items()}, PAIRS)
    report["results"] = results
    finish_report(report, started, out[0]["torchreplicate_file"], markdown, args.out, "observer_cost")
    return 0


if __name__ == "__main__":
    sys.exit(main())
