"""A change against the code before it: step time and the reducer's own cost, side by side with DDP, in one run.

Materialises an earlier revision's package as ``torchreplicate_before``
(benchlib/before.py) and times, on 2 gloo ranks in one process group, each
model under ``ddp``, ``ours_before`` (that revision's ``replicate()``
defaults) and ``ours`` (this checkout's), interleaved round by round as
``bench_ddp.py`` times its engines (benchlib/rounds.py). Then, untimed, the
profiler breakdown of both reducers (benchlib/breakdown.py: per-phase time
from the ``torchreplicate::<phase>`` labels, which both revisions share).
Models: ``bench_ddp.py``'s, plus ``bn`` (8 x Linear(1024) + BatchNorm1d, as
the realistic step of tests/test_step_shape.py: buffers, 3 buckets).

    .venv/bin/python benchmarks/bench_before_after.py --base 2bf6001 --name issue37_before_after

Writes ``NAME.json`` and ``NAME.md`` under ``benchmarks/results``.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchlib.before import materialise  # noqa: E402
from benchlib.breakdown import measure_breakdown  # noqa: E402
from benchlib.breakdown_table import breakdown_table  # noqa: E402
from benchlib.engines import build_engine  # noqa: E402
from benchlib.models import EXTRA_MODEL_NAMES, MODEL_NAMES, make_batch  # noqa: E402
from benchlib.ranks import init_rank, launch_phase, rank_record  # noqa: E402
from benchlib.report import RESULTS_DIR, finish_report, run_env  # noqa: E402
from benchlib.rounds import run_rounds  # noqa: E402
from benchlib.stats import aggregate_timing, fmt_ratio  # noqa: E402

ENGINES = ("ddp", "ours_before", "ours")
RATIO_PAIRS = (("ours", "ours_before"), ("ours", "ddp"), ("ours_before", "ddp"))


def worker(cfg: dict) -> dict:
    rank, _ = init_rank(1)
    out: dict[str, Any] = {**rank_record(), "models": {}}
    for model_name in cfg["models"]:
        batch = make_batch(model_name, rank)
        engines = {kind: build_engine(kind, model_name) for kind in ENGINES}
        first = engines["ours"]
        model_out: dict[str, Any] = {"n_params": first.num_params, "n_tensors": first.num_tensors}
        model_out.update(run_rounds(engines, batch, cfg))
        del engines, first
        gc.collect()
        model_out["breakdown"] = {
            kind: measure_breakdown(build_engine(kind, model_name), batch, steps=cfg["instrument_steps"])
            for kind in ("ours_before", "ours")
        }
        out["models"][model_name] = model_out
        gc.collect()
    return out


def table(report: dict) -> str:
    lines = [
        f"**Before ({report['base']}) and after ({report['env'].get('git', {}).get('commit', 'this checkout')}),"
        " 2 ranks, gloo, 1 thread/rank; ratio = median of per-round ratios [IQR] (min-max)**",
        "",
        "| model | DDP ms | before ms | after ms | after/before | after/DDP | before/DDP |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, m in report["timing"].items():
        e, r = m["engines"], m["ratios"]
        lines.append(
            f"| {name} | {e['ddp']['step_ms']['median']:.2f} | {e['ours_before']['step_ms']['median']:.2f} "
            f"| {e['ours']['step_ms']['median']:.2f} | {fmt_ratio(r.get('ours/ours_before'))} "
            f"| {fmt_ratio(r.get('ours/ddp'))} | {fmt_ratio(r.get('ours_before/ddp'))} |"
        )
    rows = [(f"{name} ({kind})", b) for name, m in report["breakdown"].items() for kind, b in m.items()]
    return "\n".join(lines + ["", "**The reducer's own cost, rank 0 (profiler labels)**", ""] + breakdown_table(rows))


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the revision before the change (a commit)")
    parser.add_argument(
        "--models", default="mlp,gpt,small,bn", help=f"comma list from {MODEL_NAMES + EXTRA_MODEL_NAMES}"
    )
    parser.add_argument("--rounds", type=int, default=20, help="interleaved rounds per model (default 20)")
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--name", default="before_after", help="the result files' stem")
    parser.add_argument("--out", default=RESULTS_DIR, help="output folder (default benchmarks/results)")
    parser.add_argument("--timeout", type=float, default=1800, help="per-launch timeout in seconds")
    args = parser.parse_args(argv)
    models = args.models.split(",")
    cfg = {
        "models": models,
        "rounds": 3 if args.quick else args.rounds,
        "steps": None,
        "min_steps": 2 if args.quick else 3,
        "block_s": 0.15 if args.quick else 0.25,
        "warmup": 3 if args.quick else 5,
        "instrument_steps": 3 if args.quick else 10,
    }
    started = time.time()
    before = materialise(args.base)
    sys.path.insert(0, before)  # the ranks start with this process's sys.path (spawn)
    report: dict[str, Any] = {"config": cfg, "base": args.base, "env": run_env(before_package=before)}
    outs = launch_phase("before/after, 2 ranks", worker, cfg, nprocs=2, timeout_s=args.timeout)
    report["timing"] = aggregate_timing(outs, RATIO_PAIRS)
    report["breakdown"] = {name: outs[0]["models"][name]["breakdown"] for name in models}
    finish_report(report, started, outs[0].get("torchreplicate_file"), table, args.out, args.name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
