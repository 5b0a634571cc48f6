"""Peak RSS of each engine over the RSS of the bare model (a phase of its own).

Runs in a separate launch with ``MEMORY_ENV``: a fixed glibc mmap threshold
(no dynamic raise) makes glibc return every freed tensor over 64 KiB to the
OS, so RSS tracks live tensors and one engine cannot reuse pages another
freed. Linux only (``/proc/self/status``, ``/proc/self/clear_refs``).
"""

from __future__ import annotations

import gc
import os
from typing import Any

import torch
import torch.distributed as dist

from benchlib.engines import build_engine
from benchlib.models import build_model, make_batch
from benchlib.ranks import init_rank

MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}
MEMORY_METHOD = (
    "separate launch; glibc MALLOC_MMAP_THRESHOLD_=65536; engines one after another in one process; "
    "per engine: RSS baseline with the bare model built (parameters not counted), then wrap + optimizer + 3 "
    "first steps, VmHWM reset via /proc/self/clear_refs, then more steps; peak increase = VmHWM - baseline "
    "over the steady steps (first_steps_peak includes wrapping and the first 3 steps); held = RSS between steps - baseline; "
    "largest rank"
)


def memory_worker(cfg: dict) -> dict:
    """Rank entry point: for each model and engine kind, RSS increases in KiB.

    Args:
        cfg: ``models``, ``engines`` (kinds of ``build_engine``),
            ``first_steps`` (before the peak is reset) and ``mem_steps``
            (steady steps measured).
    """
    rank, _ = init_rank(1)
    out: dict[str, Any] = {"rank": rank, "models": {}, "malloc_env": os.environ.get("MALLOC_MMAP_THRESHOLD_")}
    for model_name in cfg["models"]:
        batch = make_batch(model_name, rank)
        res: dict[str, Any] = {}
        # a throw-away local engine first: one-time costs (kernel and
        # allocator caches, autograd thread state) are not charged to the
        # first measured engine
        warm = build_engine("local", model_name)
        for _ in range(2):
            warm.step(batch)
        del warm
        for kind in cfg["engines"]:
            gc.collect()
            # the bare model (parameters) exists before the baseline: only what
            # the engine adds is counted (grads, buckets, activations, hooks)
            torch.manual_seed(0)
            model = build_model(model_name)
            dist.barrier()
            gc.collect()
            base = _status_kib()["VmRSS"]
            reset_ok = _reset_hwm()
            engine = build_engine(kind, model_name, model=model)
            del model
            built = _status_kib()
            for _ in range(cfg["first_steps"]):  # DDP rebuilds buckets, ours learns
                engine.step(batch)
            first = _status_kib()
            _reset_hwm()  # steady state from here
            for _ in range(cfg["mem_steps"]):
                engine.step(batch)
            status = _status_kib()
            res[kind] = {
                "baseline_rss_kib": base,
                "build_peak_increase_kib": built["VmHWM"] - base,
                "after_build_increase_kib": built["VmRSS"] - base,
                "first_steps_peak_increase_kib": max(first["VmHWM"], built["VmHWM"]) - base,
                "peak_increase_kib": status["VmHWM"] - base,  # steady state
                "steady_increase_kib": status["VmRSS"] - base,  # held between steps
                "hwm_reset": reset_ok,
            }
            del engine
            gc.collect()
        # the model itself (not counted above): parameters only
        res["_model_param_kib"] = sum(p.numel() * p.element_size() for p in build_model(model_name).parameters()) / 1024
        out["models"][model_name] = res
    return out


def aggregate_memory(rank_outputs: list[dict]) -> dict:
    """Per model and engine: the increases in MiB, largest rank."""
    models = {}
    for model_name, m0 in rank_outputs[0]["models"].items():
        res: dict[str, Any] = {"model_param_mib": m0["_model_param_kib"] / 1024}
        for kind in m0:
            if kind.startswith("_"):
                continue
            per_rank = [r["models"][model_name][kind] for r in rank_outputs]

            def largest(key: str, per_rank: list = per_rank) -> float:
                return max(p[key] for p in per_rank) / 1024

            res[kind] = {
                "peak_increase_mib": largest("peak_increase_kib"),
                "first_steps_peak_increase_mib": largest("first_steps_peak_increase_kib"),
                "build_peak_increase_mib": largest("build_peak_increase_kib"),
                "steady_increase_mib": largest("steady_increase_kib"),
                "after_build_increase_mib": largest("after_build_increase_kib"),
                "hwm_reset": all(p["hwm_reset"] for p in per_rank),
            }
        models[model_name] = res
    return models


def _status_kib() -> dict[str, int]:
    values = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM")):
                key, rest = line.split(":")
                values[key] = int(rest.split()[0])
    return values


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False
