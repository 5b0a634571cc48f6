#!/usr/bin/env python
"""The stall watchdog at scale: its steady store load and one failure's diagnosis, simulated and modelled.

Usage::

    python benchmarks/failure_cost/bench_watchdog.py            # ~2-4 min on 2 CPU cores
    python benchmarks/failure_cost/bench_watchdog.py --quick    # smoke run, under a minute

One TCPStore on loopback (this process serves it), hundreds of simulated
ranks as threads with a connection each (benchlib/store_sim.py), the
protocol before issue 22 and the library's side by side in one run:

1. what the store serves: every client in a tight loop of ``set`` (one-way)
   and of ``add`` (a round trip);
2. the steady load: the heartbeats of N simulated ranks, requests per
   second, against what the store serves;
3. a failure: the last simulated rank dies (its note names another host,
   so no process check helps: the cross-host worst case) and every other
   rank diagnoses at once; the seconds to the last survivor's error and the
   store requests, with a short heartbeat period (0.2 s) to keep it brief.

Then a model fitted to (3), the diagnosis past its two heartbeat periods as
seconds of store work (before: a * N^2, every survivor reads every counter;
after: b * N + c * N^2, the published roll call's bytes), extrapolated to
1,000 and 10,000 ranks with each protocol's real heartbeat period at the
default ``stall_timeout`` of 60 s. Writes ``<out>/watchdog_scale.json`` and
``<out>/watchdog_scale.md``; timings are reported, never asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta

import numpy as np
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: benchlib
from benchlib import store_sim
from benchlib.report import RESULTS_DIR, finish_report, run_env
from local_ranks import free_port
from torchreplicate.faults.watchdog import heartbeat_period

DEFAULT_TIMEOUT_S = 60.0  # replicate()'s stall_timeout
SIM_PERIOD_S = 0.2  # the simulated heartbeat period (the shortest the library uses)
STEADY_S = 3.0  # seconds of heartbeats per steady-load point


def period_before(world_size: int) -> float:
    """The heartbeat period before issue 22 (independent of the world size)."""
    return min(5.0, max(0.2, DEFAULT_TIMEOUT_S / 6))


def measure(quick: bool) -> dict:
    """Runs the three measurements; returns their numbers."""
    sizes = [32, 64, 128] if quick else [32, 64, 128, 256]
    after_sizes = sizes + ([] if quick else [512])
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    clients = store_sim.connect(port, max(after_sizes) + 4)
    served = {op: store_sim.served_per_s(clients[:16], op, 1.0 if quick else 2.0) for op in ("set", "add")}
    print(f"[bench] the store served {served['set']:.0f} set/s, {served['add']:.0f} add/s", flush=True)
    steady = {protocol: steady_load(clients, max(sizes), protocol) for protocol in ("before", "after")}
    failures: dict[str, list[dict]] = {"before": [], "after": []}
    for protocol, world_sizes in (("before", sizes), ("after", after_sizes)):
        for world_size in world_sizes:
            result = store_sim.failure(clients, world_size, protocol, SIM_PERIOD_S)
            seconds = result["seconds"]
            point = {"world_size": world_size, "requests": result["requests"], "last_s": seconds[-1]}
            point.update(median_s=statistics.median(seconds), store_s=max(0.0, seconds[-1] - 2 * SIM_PERIOD_S))
            failures[protocol].append(point)
            print(f"[bench] {protocol:6} N={world_size:4}: last survivor {seconds[-1]:.2f} s, "
                  f"{result['requests']} requests", flush=True)  # fmt: skip
    del server
    return {"served_per_s": served, "steady": steady, "failures": failures}


def steady_load(clients: list, world_size: int, protocol: str) -> dict:
    """Heartbeats of ``world_size`` ranks at the simulated period for STEADY_S; requests per second."""
    prefix = f"steady/{protocol}/"
    beaters = store_sim.Beaters(clients[:8], prefix, list(range(world_size)), SIM_PERIOD_S, protocol)
    time.sleep(STEADY_S)
    beaters.stop()
    rate = beaters.requests / STEADY_S
    print(f"[bench] steady {protocol}: {world_size} ranks every {SIM_PERIOD_S} s: {rate:.0f} requests/s", flush=True)
    return {"world_size": world_size, "period_s": SIM_PERIOD_S, "requests_per_s": rate}


def fit(points: list[dict], terms: str) -> list[float]:
    """Least-squares coefficients of the store seconds over N ("N2": a*N^2; "N,N2": b*N + c*N^2)."""
    n = np.array([p["world_size"] for p in points], dtype=float)
    y = np.array([p["store_s"] for p in points])
    columns = [n * n] if terms == "N2" else [n, n * n]
    coefficients, *_ = np.linalg.lstsq(np.stack(columns, axis=1), y, rcond=None)
    return [max(0.0, float(c)) for c in coefficients]


def requests_before(n: int) -> int:
    """Store requests of one failure's diagnosis before: every survivor reads 2N counters and N notes."""
    return (n - 1) * (2 * n + 1)


def requests_after(n: int) -> int:
    """After: claim, wait, get per survivor; the claimer's multi_gets (10 polls at most) and publication."""
    return 3 * (n - 2) + 1 + 11 + 2


def model(measured: dict) -> dict:
    """The model and its extrapolation to 1,000 and 10,000 ranks at the default stall_timeout.

    Diagnosis = 2 heartbeat periods + its store requests / the round trips the
    store served (checked against the simulation below); the curves fitted to
    the simulation are kept too, as an upper bound: there every survivor's
    client work shares this machine's 2 cores, where real ranks have their own.
    """
    (a,) = fit(measured["failures"]["before"], "N2")
    b, c = fit(measured["failures"]["after"], "N,N2")
    served = measured["served_per_s"]
    rows = []
    for n in (256, 1000, 10_000):
        p_before, p_after = period_before(n), heartbeat_period(DEFAULT_TIMEOUT_S, n)
        before = {"period_s": p_before, "requests": requests_before(n), "steady_per_s": 2 * n / p_before}
        before.update(
            fitted_s=2 * p_before + a * n * n,
            share=(n / p_before) / served["set"] + before["steady_per_s"] / 2 / served["add"],
        )
        after = {"period_s": p_after, "requests": requests_after(n), "steady_per_s": n / p_after}
        after.update(fitted_s=2 * p_after + b * n + c * n * n, share=after["steady_per_s"] / served["set"])
        for side in (before, after):
            side["diagnosis_s"] = 2 * side["period_s"] + side["requests"] / served["add"]
        rows.append({"world_size": n, "before": before, "after": after})
    return {"before_a": a, "after_b": b, "after_c": c, "extrapolation": rows}


def table_of(report: dict) -> str:
    """The report's markdown (without the header line)."""
    served = report["measured"]["served_per_s"]
    lines = [
        f"The store served **{served['set']:.0f} set/s** (one-way) and **{served['add']:.0f} add/s** (round trips), "
        "16 clients in tight loops.",
        "",
        "### Steady heartbeat load (simulated)",
        "",
        "| protocol | ranks | period | requests/s |",
        "|---|---:|---:|---:|",
    ]
    for protocol, s in report["measured"]["steady"].items():
        lines.append(f"| {protocol} | {s['world_size']} | {s['period_s']} s | {s['requests_per_s']:.0f} |")
    lines += ["", f"### One failure, every survivor diagnosing at once (period {SIM_PERIOD_S} s)", ""]
    lines += ["| protocol | ranks | last survivor | median survivor | past two periods | store requests | model |"]
    lines += ["|---|---:|---:|---:|---:|---:|---:|"]
    for protocol, points in report["measured"]["failures"].items():
        for p in points:
            lines.append(
                f"| {protocol} | {p['world_size']} | {p['last_s']:.2f} s | {p['median_s']:.2f} s | "
                f"{p['store_s']:.2f} s | {p['requests']} | {p['requests'] / served['add']:.2f} s |"
            )
    m = report["model"]
    lines += [
        "",
        "### Model and extrapolation (stall_timeout 60 s)",
        "",
        "Diagnosis = 2 heartbeat periods + its store requests / the round trips the store served (the "
        "model column above: the simulation's time past two periods). Fitted to the simulation, an upper "
        f"bound (every survivor's client work on this machine's 2 cores): before {m['before_a']:.3g} s * N^2; "
        f"after {m['after_b']:.3g} s * N + {m['after_c']:.3g} s * N^2. Steady share: heartbeat requests per "
        "second over what the store served (before: a set and an add per beat; after: a set).",
        "",
        "| ranks | protocol | period | diagnosis (model) | (fitted) | diagnosis requests | steady requests/s | "
        "share of the store |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in m["extrapolation"]:
        for protocol in ("before", "after"):
            r = row[protocol]
            lines.append(
                f"| {row['world_size']} | {protocol} | {r['period_s']:.2f} s | {r['diagnosis_s']:.1f} s | "
                f"{r['fitted_s']:.1f} s | {r['requests']:,} | {r['steady_per_s']:.0f} | {100 * r['share']:.2f}% |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer, smaller simulated worlds")
    parser.add_argument("--out", default=RESULTS_DIR, help="where watchdog.json and watchdog.md go")
    args = parser.parse_args()
    started = time.time()
    report: dict = {"env": run_env(sim_period_s=SIM_PERIOD_S, quick=args.quick)}
    report["measured"] = measure(args.quick)
    report["model"] = model(report["measured"])
    import torchreplicate

    finish_report(report, started, torchreplicate.__file__, table_of, args.out, "watchdog_scale")


if __name__ == "__main__":
    main()
