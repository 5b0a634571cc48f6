#!/usr/bin/env python
"""Communication-bound benchmark: ``replicate()`` vs torch DDP across two hosts joined by a 1 or 10 Gbit link.

Usage (as root: the hosts are network namespaces)::

    python benchmarks/ddp_on_a_link/bench_net.py                       # full run, both rates, ~6 min on 2 CPU cores
    python benchmarks/ddp_on_a_link/bench_net.py --quick               # smoke run, 1gbit only, ~2-3 min, to /tmp/bench_net_quick
    python benchmarks/ddp_on_a_link/bench_net.py --rates 10gbit --models mlp --rounds 6 --out /tmp/net

For each link rate, ``benchlib.hosts.launch_on_hosts`` makes two hosts
(``hostnet``, in tools/: network namespaces joined by a veth pair whose
ends are limited to the rate by tc's ``tbf``) and starts one gloo rank in
each, with one intra-op thread. In one process group, on their own model
copies (same init) with their own ``SGD(lr=1e-4)``, these engines are timed
side by side in interleaved rounds (``benchlib.rounds.run_rounds``):

- ``local``: the bare model, no communication (the compute floor);
- ``fwd``: forward and loss of the ``local`` model, no backward (the part of
  a step no gradient communication can overlap);
- ``ddp`` / ``ddp_gbv``: torch DDP defaults / with ``gradient_as_bucket_view=True``;
- ``ours``: ``replicate()`` defaults (DDP's 25 MiB cap, the launch order
  from the first backward's readiness; reproducible);
- ``ours_tuned``: ``replicate(bucket_layout="tuned")``, the opt-in (the cap,
  the bucket ends and the tied split chosen from the first step's timings);
- ``ours_bf16``: ``replicate(reduce_dtype=torch.bfloat16)``;
- ``ddp_bf16``: DDP defaults with torch's stock ``bf16_compress_hook``;
- ``allreduce``: one gloo all-reduce of ``ours``' wire bytes per step and
  nothing else: what the link and gloo deliver, measured;
- ``fwd_ar_opt``: a forward, ONE all-reduce of all the gradient bytes and
  the optimizer step, on its own model copy (the transfer with nothing
  hidden under it);

Floors (per model and rate): ``S`` = ``replicate.state(m).reducer.wire_bytes()``,
the bytes per rank one step hands to all-reduce. A ring all-reduce on 2
ranks sends S bytes per rank each way (S/2 reduce-scatter + S/2 all-gather),
so the link needs at least ``comm = 8 S / rate``. The gradient of the first
bucket exists only after the forward, so ``floor = fwd + comm``; ``local``
is the other lower bound (compute alone). The **measured floor**, per round,
is the longer of ``local`` and ``fwd_ar_opt``, both timed in the same round
on the same link: backward can hide entirely under the transfer, or the
transfer under backward, but not both. After the rounds, untimed, a few
steps of every communicating engine are traced (``benchlib.timeline``): when
the forward ends, when ``backward()`` returns, and for ours when each bucket
launches and is waited for (the library's step timeline), which splits
``ours - floor`` into launch delay, transfer below line rate and the tail
after the last wait.

Writes ``<out>/network.json``, ``<out>/network.md`` and ``<out>/network.png`` and prints
the tables. Timings are reported, never asserted. Skips, saying why, where
hosts cannot be made (not root, no ``ip``/``tc``, no namespaces).
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import tempfile
import time
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: benchlib
from benchlib.engines import Engine, build_engine
from benchlib.hosts import hosts_available, launch_on_hosts
from benchlib.models import GPT_SETTINGS, MODEL_NAMES, MODEL_TITLES, build_model, loss_of, make_batch
from benchlib.ranks import init_rank, rank_record
from benchlib.report import RESULTS_DIR, MiB, comma_choices, finish_report, run_env
from benchlib.rounds import ROUNDS_METHOD, run_rounds
from benchlib.stats import aggregate_timing, fmt_ratio, summarize
from benchlib.timeline import bucket_wire_bytes, summarize_trace, trace_steps
from hostnet import parse_rate
from torchreplicate import replicate

ENGINES = (
    *("local", "fwd", "ddp", "ddp_gbv", "ours", "ours_tuned", "torch_replicate"),
    *("ddp_bf16", "ours_bf16", "allreduce", "fwd_ar_opt"),
)
TRACED = ("ddp", "ddp_gbv", "ours", "ddp_bf16", "ours_bf16")  # the engines that communicate through a model
RATIO_PAIRS = (
    ("ours", "ddp"),
    ("ours", "ddp_gbv"),
    ("ours_tuned", "ddp"),
    ("ours_tuned", "ddp_gbv"),
    ("torch_replicate", "ddp"),
    ("torch_replicate", "ddp_gbv"),
    ("ours", "torch_replicate"),
    ("ours", "local"),
    ("ddp_gbv", "ddp"),
    ("ours_bf16", "ddp"),
    ("ddp_bf16", "ddp"),
    ("ours_bf16", "ddp_bf16"),
    ("ours_bf16", "ours"),
)
BF16_GOAL = 0.55  # ours_bf16 / DDP fp32 at 1gbit: half the bytes, so a little over half the step
NUM_FIRST_ROUNDS_SHOWN = 1  # progress: first round, then every few
METHOD = {
    **ROUNDS_METHOD,
    "hosts": "benchlib.hosts: 2 hostnet hosts (network namespaces, one veth pair, tbf at the rate on each end), one gloo rank per host, GLOO_SOCKET_IFNAME=veth0",
    "wire_bytes": "S = replicate.state(m).reducer.wire_bytes() of the ours / ours_bf16 engine: bytes per rank one step hands to all-reduce (gradients plus num_params + 1 flags)",
    "comm_ms": "8 S / link rate: a ring all-reduce on 2 ranks sends S bytes per rank (S/2 reduce-scatter + S/2 all-gather); payload bytes against the nominal rate, so a strict lower bound (TCP/IP headers take ~4% of a 1500-byte MTU)",
    "floor_ms": "fwd + comm: the forward (and loss) of the local model, which no gradient communication can overlap, plus comm; per round: that round's fwd block + comm",
    "ratio_to_floor": "per round: engine block / (fwd block of the same round + comm); median, quartiles, min, max",
    "timeline": "untimed traced steps after the rounds (benchlib.timeline): ms from the step's start, median over steps, per rank; ours' marks from torchreplicate.timeline.subscribe (one StepRecord per step)",
    "measured_floor_ms": "per round: max(local block, fwd_ar_opt block), both timed in that round: the longer of the local step and a forward + ONE all-reduce of all gradient bytes + the optimizer step; ratio = median of per-round engine / measured floor",
    "line_rate_done_ms": "when the last bucket would be through the link at the nominal rate had each bucket started at its launch (one link, buckets in order)",
}


# --------------------------------------------------------------------------
# engines


class ForwardOnly:
    """Forward and loss of a model, no backward: the part of a step no gradient communication overlaps."""

    def __init__(self, model_name: str, module: torch.nn.Module) -> None:
        self.model_name = model_name
        self.module = module

    def step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        x, y = batch
        loss_of(self.model_name, self.module(x), y)  # the graph is built, as in training, then dropped


class ForwardAllReduceStep:
    """A forward, one all-reduce of every gradient byte, and the optimizer step: the measured floor's comm side."""

    def __init__(self, model_name: str) -> None:
        torch.manual_seed(0)
        self.model_name = model_name
        self.module = build_model(model_name)
        params = list(self.module.parameters())
        self.flat = torch.ones(sum(p.numel() for p in params))
        for p in params:
            p.grad = torch.zeros_like(p)
        self.optimizer = torch.optim.SGD(params, lr=1e-4)

    def step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        x, y = batch
        loss_of(self.model_name, self.module(x), y)
        dist.all_reduce(self.flat)
        self.optimizer.step()


class AllReduceOnly:
    """One gloo all-reduce of ``num_bytes`` (float32) per step, no compute: the link and gloo, measured."""

    def __init__(self, num_bytes: int) -> None:
        self.buffer = torch.ones(max(1, num_bytes // 4))

    def step(self, batch: Any) -> None:
        dist.all_reduce(self.buffer)


def ddp_bf16_compress_hook(process_group, bucket):
    """torch's stock ``bf16_compress_hook``, called under another name.

    DDP refuses the stock function by its ``__name__`` unless CUDA and NCCL
    2.10+ are present, a check meant for NCCL that also refuses gloo, which
    reduces bfloat16 on CPU (our reducer runs the same hook on gloo). No
    annotations: DDP compares the ``bucket`` annotation with the class, and
    this file's annotations are strings.
    """
    return default_hooks.bf16_compress_hook(process_group, bucket)


def build_engines(model_name: str) -> dict[str, Any]:
    """Every engine of ``ENGINES`` on its own model copy (same init).

    ``fwd`` shares ``local``'s model.
    """
    engines: dict[str, Any] = {}
    for kind in ("local", "ddp", "ddp_gbv", "ours", "ours_tuned", "torch_replicate"):
        engines[kind] = build_engine(kind, model_name)
    engines["fwd"] = ForwardOnly(model_name, engines["local"].module)
    torch.manual_seed(0)
    raw = build_model(model_name)
    ddp_bf16 = DDP(raw)
    ddp_bf16.register_comm_hook(None, ddp_bf16_compress_hook)
    engines["ddp_bf16"] = Engine("ddp_bf16", model_name, ddp_bf16, raw)
    torch.manual_seed(0)
    raw = build_model(model_name)
    engines["ours_bf16"] = Engine("ours_bf16", model_name, replicate(raw, reduce_dtype=torch.bfloat16), raw)
    engines["allreduce"] = AllReduceOnly(engines["ours"].reducer.wire_bytes())
    engines["fwd_ar_opt"] = ForwardAllReduceStep(model_name)
    return {kind: engines[kind] for kind in ENGINES}


# --------------------------------------------------------------------------
# rank entry point (module level: benchlib.hosts imports this file in every rank)


def timing_worker(cfg: dict) -> dict:
    rank, _ = init_rank(1)
    rate_bps = parse_rate(cfg["rate"])
    out: dict[str, Any] = {**rank_record(), "models": {}}
    for model_name in cfg["models"]:
        started = time.time()
        batch = make_batch(model_name, rank)
        engines = build_engines(model_name)
        ours = engines["ours"]
        every = max(1, cfg["rounds"] // 4)

        def progress(done: int, k: int) -> None:
            if rank == 0 and (done <= NUM_FIRST_ROUNDS_SHOWN or done % every == 0 or done == cfg["rounds"]):
                print(
                    f"[net] {cfg['rate']} {model_name}: round {done}/{cfg['rounds']} "
                    f"({k} steps per block, {time.time() - started:.0f} s)",
                    flush=True,
                )

        model_out: dict[str, Any] = {"n_params": ours.num_params, "n_tensors": ours.num_tensors}
        model_out.update(run_rounds(engines, batch, cfg, progress))
        model_out["wire_bytes"] = {
            "ours": ours.reducer.wire_bytes(),
            "ours_bf16": engines["ours_bf16"].reducer.wire_bytes(),
            "ddp_payload": sum(p.numel() * p.element_size() for p in ours.raw.parameters()),
            "ddp_bf16_payload": sum(p.numel() * 2 for p in ours.raw.parameters()),
        }
        model_out["timeline"] = {}
        for kind in TRACED:
            records = trace_steps(engines[kind], batch, cfg["trace_steps"])
            model_out["timeline"][kind] = summarize_trace(records, bucket_wire_bytes(engines[kind]), rate_bps)
        del engines, ours
        gc.collect()
        out["models"][model_name] = model_out
        if rank == 0:
            print(f"[net] {cfg['rate']} {model_name}: done in {time.time() - started:.0f} s", flush=True)
    return out


# --------------------------------------------------------------------------
# aggregation (parent)


def aggregate(rank_outputs: list[dict], rate: str) -> dict:
    """``aggregate_timing`` plus, per model, the floors, the ratios to them and every rank's timeline."""
    rate_bps = parse_rate(rate)
    models = aggregate_timing(rank_outputs, list(RATIO_PAIRS))
    for model_name, result in models.items():
        m0 = rank_outputs[0]["models"][model_name]
        engines = result["engines"]
        wire = m0["wire_bytes"]
        fwd_rounds = engines["fwd"]["per_round_ms"]
        floors: dict[str, Any] = {"rate": rate, "rate_bps": rate_bps, "forward_ms": engines["fwd"]["step_ms"]}
        for precision, key in (("fp32", "ours"), ("bf16", "ours_bf16")):
            comm_ms = wire[key] * 8 / rate_bps * 1e3
            floors[precision] = {
                "wire_bytes": wire[key],
                "comm_ms": comm_ms,
                "floor_ms": statistics.median(fwd_rounds) + comm_ms,
            }
            fp32_kinds = ("ours", "ours_tuned", "ddp", "ddp_gbv", "torch_replicate")
            for kind in fp32_kinds if precision == "fp32" else ("ours_bf16", "ddp_bf16"):
                per = [e / (f + comm_ms) for e, f in zip(engines[kind]["per_round_ms"], fwd_rounds)]
                result["ratios"][f"{kind}/floor"] = {**summarize(per), "per_round": per}
        # the measured floor: per round, the longer of the local step and fwd + one all-reduce + optimizer
        measured = [max(a, b) for a, b in zip(engines["local"]["per_round_ms"], engines["fwd_ar_opt"]["per_round_ms"])]
        floors["measured_ms"] = statistics.median(measured)
        for kind in ("ours", "ours_tuned", "ddp", "ddp_gbv", "torch_replicate"):
            per = [e / f for e, f in zip(engines[kind]["per_round_ms"], measured)]
            result["ratios"][f"{kind}/measured_floor"] = {**summarize(per), "per_round": per}
        result["floors"] = floors
        result["wire_bytes"] = wire
        result["timeline"] = {f"rank{r['rank']}": r["models"][model_name]["timeline"] for r in rank_outputs}
    return models


# --------------------------------------------------------------------------
# report


def markdown_tables(report: dict) -> str:
    rows = [(rate, name, m) for rate, models in report["rates"].items() for name, m in models.items()]
    lines = [
        "**Two hosts, one gloo rank each, 1 thread** (step time = median over rounds of block time / K, slowest rank; "
        "ratio = median of per-round ratios [IQR] (min-max); S = `reducer.wire_bytes()` per rank and step; "
        "comm = 8 S / rate (a 2-rank ring all-reduce sends S per rank); floor = fwd + comm; "
        "all-reduce = one gloo all-reduce of S bytes alone, measured; measured floor = per round max(local, "
        "fwd + ONE all-reduce of all gradient bytes + optimizer step), both timed in the round)",
        "",
        "| model | rate | S MiB | local ms | fwd ms | comm ms | floor ms | all-reduce ms | DDP ms | DDP-gbv ms | ours ms "
        "| ours/DDP | ours/DDP-gbv | ours/floor | DDP-gbv/floor | ours/local "
        "| fwd+AR+opt ms | measured floor ms | **ours/measured floor** | DDP/measured floor "
        "| tuned ms | tuned/DDP | tuned/DDP-gbv |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for rate, name, m in rows:
        e, f, r = m["engines"], m["floors"], m["ratios"]
        lines.append(
            f"| {MODEL_TITLES.get(name, name)} | {rate} | {f['fp32']['wire_bytes'] / MiB:.2f} "
            f"| {_ms(e, 'local')} | {_ms(e, 'fwd')} | {f['fp32']['comm_ms']:.1f} | {f['fp32']['floor_ms']:.1f} "
            f"| {_ms(e, 'allreduce')} | {_ms(e, 'ddp')} | {_ms(e, 'ddp_gbv')} | {_ms(e, 'ours')} "
            f"| **{fmt_ratio(r.get('ours/ddp'))}** | {fmt_ratio(r.get('ours/ddp_gbv'))} "
            f"| {fmt_ratio(r.get('ours/floor'))} | {_med(r.get('ddp_gbv/floor'))} | {_med(r.get('ours/local'))} "
            f"| {_ms(e, 'fwd_ar_opt')} | {f.get('measured_ms', float('nan')):.1f} "
            f"| **{fmt_ratio(r.get('ours/measured_floor'))}** | {fmt_ratio(r.get('ddp/measured_floor'))} "
            f"| {_ms(e, 'ours_tuned')} | {fmt_ratio(r.get('ours_tuned/ddp'))} | {fmt_ratio(r.get('ours_tuned/ddp_gbv'))} |"
        )
    lines += [
        "",
        f"**bf16 on the wire** (ours: `reduce_dtype=torch.bfloat16`; DDP: stock `bf16_compress_hook`; "
        f"floor = fwd + 8 S_bf16 / rate; goal: ours bf16 / DDP fp32 <= {BF16_GOAL} at 1gbit)",
        "",
        "| model | rate | S bf16 MiB | comm ms | floor ms | DDP bf16 ms | ours bf16 ms | **ours bf16 / DDP fp32** "
        "| DDP bf16 / DDP fp32 | ours bf16 / DDP bf16 | ours bf16 / floor |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for rate, name, m in rows:
        e, f, r = m["engines"], m["floors"], m["ratios"]
        goal = r.get("ours_bf16/ddp")
        mark = ""
        if goal and parse_rate(rate) == parse_rate("1gbit"):
            mark = " (goal met)" if goal["median"] <= BF16_GOAL else " (goal missed)"
        lines.append(
            f"| {MODEL_TITLES.get(name, name)} | {rate} | {f['bf16']['wire_bytes'] / MiB:.2f} "
            f"| {f['bf16']['comm_ms']:.1f} | {f['bf16']['floor_ms']:.1f} | {_ms(e, 'ddp_bf16')} | {_ms(e, 'ours_bf16')} "
            f"| {fmt_ratio(goal)}{mark} | {_med(r.get('ddp_bf16/ddp'))} | {fmt_ratio(r.get('ours_bf16/ddp_bf16'))} "
            f"| {fmt_ratio(r.get('ours_bf16/floor'))} |"
        )
    lines += [
        "",
        "**Where ours' step goes** (untimed traced steps, rank 0, median over steps, ms from the step's start: "
        "forward end; first gradient hook; each bucket's launch, `h` from a gradient hook, `e` from the end of backward; "
        "end of backward compute (end-of-backward callback); last bucket's wait done; step end incl. optimizer. "
        "ours - floor = launch delay (line-rate end of the buckets from their launches - (fwd + comm)) "
        "+ below line rate (last wait done - line-rate end) + tail (step end - last wait done))",
        "",
        "| model | rate | engine | fwd | 1st hook | launches (MiB) | bwd end | last wait done | step | floor | launch delay | below line rate | tail | DDP-gbv backward() returns / step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for rate, name, m in rows:
        rate_bps = m["floors"]["rate_bps"]
        timeline = m["timeline"].get("rank0", {})
        gbv = timeline.get("ddp_gbv", {})
        for kind in ("ours", "ours_bf16"):
            t = timeline.get(kind, {})
            if "launch_ms" not in t:
                continue
            comm_ms = sum(t["bucket_wire_bytes"]) * 8 / rate_bps * 1e3
            floor = t["forward_ms"] + comm_ms
            launches = ", ".join(
                f"{at:.0f}{'h' if hook else 'e'} ({size / MiB:.1f})"
                for at, hook, size in zip(t["launch_ms"], t["from_hook"], t["bucket_wire_bytes"])
            )
            last_done = t["done_ms"][-1]
            lines.append(
                f"| {MODEL_TITLES.get(name, name)} | {rate} | {kind} | {t['forward_ms']:.1f} | {t['backward_ms']:.1f} "
                f"| {launches} | {t['finalize_ms']:.1f} | {last_done:.1f} | {t['step_ms']:.1f} | {floor:.1f} "
                f"| {t['line_rate_done_ms'] - floor:.1f} | {last_done - t['line_rate_done_ms']:.1f} "
                f"| {t['step_ms'] - last_done:.1f} "
                f"| {gbv.get('backward_return_ms', float('nan')):.1f} / {gbv.get('step_ms', float('nan')):.1f} |"
            )
    return "\n".join(lines) + "\n"


def _ms(engines: dict, kind: str) -> str:
    return f"{engines[kind]['step_ms']['median']:.1f}" if kind in engines else "n/a"


def _med(ratio: Optional[dict]) -> str:
    return f"{ratio['median']:.3f}" if ratio else "n/a"


# --------------------------------------------------------------------------
# main


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rates", default=None, help="comma list of link rates in tc's notation (default 1gbit,10gbit; quick 1gbit)"
    )
    parser.add_argument("--models", default=",".join(MODEL_NAMES), help=f"comma list from {MODEL_NAMES}")
    parser.add_argument(
        "--rounds", type=int, default=None, help="interleaved rounds per model and rate (default 12; quick 3)"
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="steps per timed block (default: about --block-s worth, >= 2)"
    )
    parser.add_argument(
        "--block-s", type=float, default=None, help="target seconds per timed block (default 0.25; quick 0.1)"
    )
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps per engine (default 4; quick 2)")
    parser.add_argument("--trace-steps", type=int, default=None, help="traced steps per engine (default 5; quick 3)")
    parser.add_argument("--quick", action="store_true", help="short smoke run (1gbit, 3 rounds; ~2-3 min)")
    parser.add_argument(
        "--out", default=None, help="output folder (default benchmarks/results; quick: /tmp/bench_net_quick)"
    )
    parser.add_argument("--timeout", type=float, default=900, help="per-rate launch timeout in seconds")
    parser.add_argument("--name", default="network", help="the result files' stem: NAME.json, NAME.md, NAME.png")
    args = parser.parse_args(argv)

    quick = args.quick
    models = comma_choices(parser, args.models, MODEL_NAMES)
    rates = [r for r in (args.rates or ("1gbit" if quick else "1gbit,10gbit")).split(",") if r]
    for rate in rates:
        try:
            parse_rate(rate)
        except ValueError as error:
            parser.error(str(error))
    out_dir = args.out or (os.path.join(tempfile.gettempdir(), "bench_net_quick") if quick else RESULTS_DIR)
    ok, why = hosts_available()
    if not ok:
        print(f"[net] skipped: cannot make hosts here: {why}")
        return 0
    cfg = {
        "models": models,
        "rounds": args.rounds or (3 if quick else 12),
        "steps": args.steps,
        "min_steps": 2,
        "block_s": args.block_s or (0.1 if quick else 0.25),
        "warmup": args.warmup or (2 if quick else 4),
        "trace_steps": args.trace_steps or (3 if quick else 5),
    }
    load = os.getloadavg()
    print(f"[net] load average at start {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} (1/5/15 min)", flush=True)
    if load[0] > 1.5:
        print("[net] WARNING: the machine is busy (load > 1.5): timings will be noisy", flush=True)
    started = time.time()
    report: dict[str, Any] = {
        "config": {**cfg, "quick": quick, "rates": rates},
        "world_size": 2,
        "env": run_env(machine=platform.machine(), gpt=GPT_SETTINGS, hosts=2, ranks_per_host=1),
        "rates": {},
    }
    rank_file = None
    for rate in rates:
        outs = launch_on_hosts(
            f"timing at {rate}", timing_worker, {**cfg, "rate": rate}, rate=rate, timeout_s=args.timeout, tag="net"
        )
        rank_file = outs[0].get("torchreplicate_file")
        report["rates"][rate] = aggregate(outs, rate)
    report["method"] = METHOD
    finish_report(
        report, started, rank_file or report["env"]["torchreplicate_file"], markdown_tables, out_dir, args.name
    )
    try:
        from net_plot import plot  # beside this script (the ranks, started from benchmarks/, never plot)

        plot(report, os.path.join(out_dir, f"{args.name}.png"))
        print(f"[net] wrote {os.path.join(out_dir, f'{args.name}.png')}")
    except Exception as error:  # the plot is optional
        print(f"[net] plot skipped: {error!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
