#!/usr/bin/env python
"""Step-time, memory and communication benchmark: ``replicate()`` vs torch DDP.

Usage::

    python benchmarks/ddp_here/bench_ddp.py                 # full run, ~5 min on 2 CPU cores
    python benchmarks/ddp_here/bench_ddp.py --quick         # smoke run, ~1.5 min
    python benchmarks/ddp_here/bench_ddp.py --rounds 30 --models mlp,small --out /tmp/res

Phases (each a separate ``launch`` of fresh processes (tests/local_ranks.py), gloo,
one intra-op thread per rank):

1. timing, 2 ranks: engines ``local`` (no communication), ``ddp`` (torch
   DistributedDataParallel defaults), ``ddp_gbv`` (DDP with
   ``gradient_as_bucket_view=True``), ``ours`` (``replicate()`` defaults) and
   ``ours_tuned`` (``replicate(bucket_layout="tuned")``, the opt-in) live side by side in one process group, each on its own model copy (same
   init) with its own SGD, timed in interleaved rounds
   (``benchlib.rounds.run_rounds``). Afterwards, untimed: a torch.profiler
   pass counts collectives and their sizes for every engine, and a fresh
   ``ours`` engine is profiled to break our reducer's time down by phase
   (``benchlib.breakdown``).
2. timing, 1 rank: ``local`` vs ``ours`` (plus ``ddp`` and two diagnostic
   engines, see benchmarks/README.md).
3. memory, 2 ranks: each engine in turn, peak RSS increase over the RSS
   of the bare model (``benchlib.memory``).

Writes ``<out>/ddp_loopback.json``, ``<out>/ddp_loopback_ratios.png`` and ``<out>/ddp_loopback.md``
(with ``--name NAME``: ``NAME.json``, ``NAME_ratios.png``, ``NAME.md``),
and prints the markdown tables. Timings are reported, never asserted.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import sys
import time
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: benchlib
from benchlib.breakdown import measure_breakdown
from benchlib.breakdown_table import breakdown_table, breakdown_warnings
from benchlib.collectives import count_all_reduces
from benchlib.engines import build_engine
from benchlib.memory import MEMORY_ENV, MEMORY_METHOD, aggregate_memory, memory_worker
from benchlib.models import EXTRA_MODEL_NAMES, GPT_SETTINGS, MODEL_NAMES, MODEL_TITLES, make_batch
from benchlib.ranks import init_rank, launch_phase, rank_record
from benchlib.report import RESULTS_DIR, MiB, comma_choices, finish_report, run_env
from benchlib.rounds import run_rounds
from benchlib.stats import aggregate_timing, fmt_ratio, per_tensor_difference_us

ENGINES_WS2 = ("local", "ddp", "ddp_gbv", "ours", "ours_tuned", "torch_replicate")
ENGINES_MEMORY = ("local", "ddp", "ddp_gbv", "ours")
# world size 1: ``reducer`` is replicate() plus the reducer it builds at world
# size 2 (at world size 1 it builds none), ``noop_hooks`` is one empty Python
# post-accumulate-grad hook per parameter (the floor of any Python-hook reducer).
ENGINES_WS1 = ("local", "ours", "ddp", "reducer", "noop_hooks")
RATIO_PAIRS = (
    ("ours", "ddp"),
    ("ours", "ddp_gbv"),
    ("ours_tuned", "ddp"),
    ("ours_tuned", "ddp_gbv"),
    ("ours", "ours_tuned"),
    ("ours", "torch_replicate"),
    ("torch_replicate", "ddp"),
    ("torch_replicate", "ddp_gbv"),
    ("ours", "local"),
    ("ddp", "local"),
    ("ddp_gbv", "ddp"),
    ("reducer", "local"),
    ("noop_hooks", "local"),
)
METHOD = {
    "step_time": "median over rounds of block wall time / K, slowest rank per block; engines interleaved, order rotated each round, dist.barrier() before each block",
    "ratio": "per round: engine block / reference block in the same round; median, quartiles, min, max over rounds",
    "exposed_comm_ms": "engine median step time - local median step time",
    "cpu_step_ms": "training-thread CPU time (time.thread_time) per step, mean over ranks",
    "collectives": "torch.profiler 'gloo:all_reduce' events over 2 steps (float32 payload); ours cross-checked by wrapping torch.distributed.all_reduce",
    "instrumented": "separate untimed pass of a fresh engine under torch.profiler; per-phase time from the library's torchreplicate::<phase> record_function events, label cost calibrated in the same session and taken off (benchlib/breakdown.py)",
}


# --------------------------------------------------------------------------
# rank entry point (module level: spawn imports it)


def timing_worker(cfg: dict) -> dict:
    rank, world = init_rank(1)
    out: dict[str, Any] = {**rank_record(), "models": {}}
    for model_name in cfg["models"]:
        batch = make_batch(model_name, rank)
        engines = {kind: build_engine(kind, model_name) for kind in cfg["engines"]}
        first = next(iter(engines.values()))
        model_out: dict[str, Any] = {"n_params": first.num_params, "n_tensors": first.num_tensors}
        model_out.update(run_rounds(engines, batch, cfg))
        if cfg["count"]:
            model_out["collectives"] = {
                kind: count_all_reduces(engine, batch) for kind, engine in engines.items() if kind != "noop_hooks"
            }
        del engines, first
        gc.collect()
        if cfg["instrument"]:
            # a fresh engine: at world size 1 replicate() builds no reducer, so the reducer engine
            kind = "ours" if world > 1 else "reducer"
            model_out["reducer_breakdown"] = measure_breakdown(
                build_engine(kind, model_name), batch, steps=cfg["instrument_steps"]
            )
        out["models"][model_name] = model_out
        gc.collect()
    return out


def aggregate(rank_outputs: list[dict]) -> dict:
    """``aggregate_timing`` plus what this benchmark adds per model: collectives,
    the breakdown of every rank, and at world size 1 the cost per tensor."""
    models = aggregate_timing(rank_outputs, RATIO_PAIRS)
    for model_name, result in models.items():
        m0 = rank_outputs[0]["models"][model_name]
        engines = result["engines"]
        if "local" in engines:  # extra host time per tensor over the bare model (every world size)
            for kind in ("reducer", "noop_hooks", "ours", "ddp", "ddp_gbv"):
                if kind in engines:
                    result[f"{kind}_minus_local_us_per_tensor"] = per_tensor_difference_us(
                        engines[kind]["per_round_ms"], engines["local"]["per_round_ms"], result["n_tensors"]
                    )
                    result[f"{kind}_minus_local_cpu_us_per_tensor"] = per_tensor_difference_us(
                        engines[kind]["per_round_cpu_ms"], engines["local"]["per_round_cpu_ms"], result["n_tensors"]
                    )
        if "collectives" in m0:
            result["collectives"] = m0["collectives"]
        if "reducer_breakdown" in m0:
            result["reducer_breakdown"] = {
                f"rank{r['rank']}": r["models"][model_name]["reducer_breakdown"] for r in rank_outputs
            }
    return models


# --------------------------------------------------------------------------
# report


def markdown_tables(report: dict) -> str:
    lines = []
    ws2 = report.get("world_size_2", {})
    ws1 = report.get("world_size_1", {})
    mem = report.get("memory", {})
    if ws2:
        lines += _ws2_table(ws2, report["world_size"])
        lines += [""] + _comm_memory_table(ws2, mem, report["world_size"])
    else:
        lines.append("(the main, --nprocs ranks, phase skipped)")
    if ws1:
        lines += [""] + _ws1_table(ws1)
    rows = [
        (MODEL_TITLES.get(name, name), m["reducer_breakdown"].get("rank0", next(iter(m["reducer_breakdown"].values()))))
        for name, m in ws2.items()
        if "reducer_breakdown" in m
    ]
    if rows:
        lines += [""] + breakdown_table(rows)
    return "\n".join(lines) + "\n"


def _ws2_table(ws2: dict, world_size: int) -> list[str]:
    lines = [
        f"**World size {world_size}** (gloo, 1 thread/rank; step time = median over rounds of block time / K, slowest rank; ratio = median of per-round ratios [IQR] (min-max))",
        "",
        "| model | params (tensors) | local ms | DDP ms | DDP-gbv ms | ours ms | ours/DDP | ours/DDP-gbv "
        "| tuned ms | tuned/DDP | tuned/DDP-gbv | ours/tuned | exposed comm ms DDP / gbv / ours |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, m in ws2.items():
        e, x = m["engines"], m["exposed_comm_ms"]
        tuned = f"{e['ours_tuned']['step_ms']['median']:.2f}" if "ours_tuned" in e else "n/a"
        lines.append(
            f"| {MODEL_TITLES.get(name, name)} | {m['n_params'] / 1e6:.2f}M ({m['n_tensors']}) "
            f"| {e['local']['step_ms']['median']:.2f} | {e['ddp']['step_ms']['median']:.2f} "
            f"| {e['ddp_gbv']['step_ms']['median']:.2f} | {e['ours']['step_ms']['median']:.2f} "
            f"| {fmt_ratio(m['ratios'].get('ours/ddp'))} | {fmt_ratio(m['ratios'].get('ours/ddp_gbv'))} "
            f"| {tuned} | {fmt_ratio(m['ratios'].get('ours_tuned/ddp'))} "
            f"| {fmt_ratio(m['ratios'].get('ours_tuned/ddp_gbv'))} | {fmt_ratio(m['ratios'].get('ours/ours_tuned'))} "
            f"| {x['ddp']:.2f} / {x['ddp_gbv']:.2f} / {x['ours']:.2f} |"
        )
    return lines


def _comm_memory_table(ws2: dict, mem: dict, world_size: int) -> list[str]:
    lines = [
        f"**Communication and memory** (world size {world_size}; all-reduces and payload per step per rank from torch.profiler 'gloo:all_reduce' events; "
        "sent = ring estimate 2(W-1)/W x payload; memory in MiB over the RSS of the bare model, largest rank: steady peak (after 3 steps) "
        "[peak incl. wrapping and first 3 steps] {held between steps})",
        "",
        "| model | all-reduces/step DDP / gbv / ours | payload MiB/step DDP / ours | est. sent MiB/rank/step | peak RSS +MiB local / DDP / gbv / ours | params MiB |",
        "|---|---|---|---|---|---|",
    ]
    for name, m in ws2.items():
        c = m.get("collectives", {})
        mm = mem.get(name, {})

        def cnt(kind: str) -> str:
            return f"{c[kind]['per_step']:.0f}" if kind in c else "n/a"

        def pay(kind: str) -> str:
            return f"{c[kind]['payload_bytes_per_step'] / MiB:.2f}" if kind in c else "n/a"

        def peak(kind: str) -> str:
            if kind not in mm:
                return "n/a"
            v = mm[kind]
            return f"{v['peak_increase_mib']:.1f} [{v['first_steps_peak_increase_mib']:.0f}] {{{v['steady_increase_mib']:.0f}}}"

        factor = 2 * (world_size - 1) / world_size
        sent = f"{factor * c['ours']['payload_bytes_per_step'] / MiB:.2f}" if "ours" in c else "n/a"
        lines.append(
            f"| {MODEL_TITLES.get(name, name)} | {cnt('ddp')} / {cnt('ddp_gbv')} / {cnt('ours')} | {pay('ddp')} / {pay('ours')} "
            f"| {sent} | {peak('local')} / {peak('ddp')} / {peak('ddp_gbv')} / {peak('ours')} "
            f"| {mm.get('model_param_mib', float('nan')):.1f} |"
        )
    return lines


def _ws1_table(ws1: dict) -> list[str]:
    lines = [
        "**World size 1** (ours = replicate() defaults; reducer = replicate() plus the reducer it would build at world size 2; noop = one empty Python hook per parameter; "
        "+µs/tensor = median over rounds of (engine - local) per step / tensors, on training-thread CPU time [wall time])",
        "",
        "| model | local ms | ours ms | ours/local | DDP ms | reducer ms | +µs/tensor CPU [wall]: DDP / reducer / noop hooks |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, m in ws1.items():
        e = m["engines"]

        def ms(kind: str) -> str:
            return f"{e[kind]['step_ms']['median']:.2f}" if kind in e else "n/a"

        def per_tensor(kind: str) -> str:
            cpu, wall = m.get(f"{kind}_minus_local_cpu_us_per_tensor"), m.get(f"{kind}_minus_local_us_per_tensor")
            return f"{cpu['median']:.1f} [{wall['median']:.1f}]" if cpu and wall else "n/a"

        lines.append(
            f"| {MODEL_TITLES.get(name, name)} | {ms('local')} | {ms('ours')} | {fmt_ratio(m['ratios'].get('ours/local'))} "
            f"| {ms('ddp')} | {ms('reducer')} | {per_tensor('ddp')} / {per_tensor('reducer')} / {per_tensor('noop_hooks')} |"
        )
    return lines


def plot(report: dict, path: str) -> None:
    """Box plot of the per-round ratios: ours/DDP, ours/DDP-gbv, tuned/DDP-gbv, torch's replicate/DDP-gbv,
    and ours/local at world size 1 (the pairs the run measured)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = []
    for name, m in report.get("world_size_2", {}).items():
        for key, label, color in (
            ("ours/ddp", "ours/DDP", "tab:blue"),
            ("ours/ddp_gbv", "ours/DDP-gbv", "tab:orange"),
            ("ours_tuned/ddp_gbv", "tuned/DDP-gbv", "tab:purple"),
            ("torch_replicate/ddp_gbv", "torch rep./DDP-gbv", "tab:gray"),
        ):
            if key in m["ratios"]:
                series.append((f"{name}\n{label}", m["ratios"][key]["per_round"], color))
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
    ax.axhline(0.95, color="red", lw=1, ls="--", label="0.95")
    if report.get("world_size_1"):
        ax.axhline(1.03, color="green", lw=1, ls=":", label="target 1.03 (ws1 vs local)")
    ax.set_ylabel("step time ratio (per round)")
    ax.set_title(
        f"replicate() vs DDP, gloo CPU, {report['world_size']} ranks x 1 thread (box IQR, whiskers min-max)", fontsize=9
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
    parser.add_argument(
        "--models", default=",".join(MODEL_NAMES), help=f"comma list from {MODEL_NAMES + EXTRA_MODEL_NAMES}"
    )
    parser.add_argument("--nprocs", type=int, default=2, help="ranks of the main phase (default 2)")
    parser.add_argument("--no-ws2", action="store_true", help="skip the main (--nprocs ranks) timing phase")
    parser.add_argument("--no-ws1", action="store_true", help="skip the world-size-1 phase")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory phase")
    parser.add_argument("--no-instrument", action="store_true", help="skip the profiled reducer pass")
    parser.add_argument("--out", default=RESULTS_DIR, help="output folder (default benchmarks/results)")
    parser.add_argument(
        "--name", default="ddp_loopback", help="the result files' stem: NAME.json, NAME.md (default ddp_loopback)"
    )
    parser.add_argument("--timeout", type=float, default=1500, help="per-launch timeout in seconds")
    args = parser.parse_args(argv)

    models = comma_choices(parser, args.models, MODEL_NAMES + EXTRA_MODEL_NAMES)
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
    started = time.time()
    report: dict[str, Any] = {
        "config": {**cfg, "quick": quick},
        "world_size": args.nprocs,
        "env": run_env(machine=platform.machine(), gpt=GPT_SETTINGS),
    }

    def phase(label: str, worker: Any, nprocs: int, phase_cfg: dict, env: Optional[dict] = None) -> list:
        return launch_phase(label, worker, phase_cfg, nprocs=nprocs, timeout_s=args.timeout, env=env)

    if not args.no_ws2:
        out = phase(f"timing, {args.nprocs} ranks", timing_worker, args.nprocs, {**cfg, "engines": list(ENGINES_WS2)})
        report["env"]["torchreplicate_file_in_ranks"] = out[0].get("torchreplicate_file")
        report["world_size_2"] = aggregate(out)
    if not args.no_ws1:
        ws1_cfg = {**cfg, "engines": list(ENGINES_WS1), "rounds": 3 if quick else max(3, rounds // 2), "count": False}
        out1 = phase("timing, 1 rank", timing_worker, 1, ws1_cfg)
        report["env"]["torchreplicate_file_in_ranks"] = out1[0].get("torchreplicate_file")
        report["world_size_1"] = aggregate(out1)
    if not args.no_memory:
        mem_cfg = {"models": models, "engines": list(ENGINES_MEMORY), "first_steps": 3, "mem_steps": 3 if quick else 5}
        outm = phase(f"memory, {args.nprocs} ranks", memory_worker, args.nprocs, mem_cfg, MEMORY_ENV)
        report["memory"] = aggregate_memory(outm)
        report["memory_method"] = MEMORY_METHOD
    report["method"] = METHOD

    rank_file = report["env"].get("torchreplicate_file_in_ranks") or report["env"]["torchreplicate_file"]
    finish_report(report, started, rank_file, markdown_tables, args.out, args.name)
    try:
        plot(report, os.path.join(args.out, f"{args.name}_ratios.png"))
    except Exception as error:  # the plot is optional
        print(f"[bench] plot skipped: {error!r}")
    for line in breakdown_warnings(
        (f"{phase_name}, {name}, {rank}", b)
        for phase_name in ("world_size_2", "world_size_1")
        for name, m in report.get(phase_name, {}).items()
        for rank, b in m.get("reducer_breakdown", {}).items()
    ):
        print(f"[bench] WARNING {line}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
