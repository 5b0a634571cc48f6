"""Statistics of the timed rounds (in the parent process): summaries and paired per-round ratios."""

from __future__ import annotations

import statistics
from typing import Optional, Sequence


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile with linear interpolation; NaN for no values."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    pos = (len(ordered) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(values: Sequence[float]) -> dict:
    """Median, quartiles, min, max and count."""
    return {
        "median": statistics.median(values),
        "q1": quantile(values, 0.25),
        "q3": quantile(values, 0.75),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def per_round_ratios(round_step: dict[str, list[float]], pairs: Sequence[tuple[str, str]]) -> dict:
    """``"a/b"``: summary of a's block over b's block in the same round, for each pair present."""
    ratios = {}
    for num, den in pairs:
        if num in round_step and den in round_step:
            per = [a / b for a, b in zip(round_step[num], round_step[den], strict=True)]
            ratios[f"{num}/{den}"] = {**summarize(per), "per_round": per}
    return ratios


def per_tensor_difference_us(engine_ms: Sequence[float], reference_ms: Sequence[float], num_tensors: int) -> dict:
    """Summary over rounds of (engine - reference) per step, in µs per parameter tensor."""
    diffs = [(a - b) * 1e3 / num_tensors for a, b in zip(engine_ms, reference_ms, strict=True)]
    return summarize(diffs)


def aggregate_timing(rank_outputs: list[dict], pairs: Sequence[tuple[str, str]]) -> dict:
    """Per model: per-engine step time (slowest rank), and per-round ratios of ``pairs``.

    Args:
        rank_outputs: what the ranks returned, each with ``models[name]``
            holding ``run_rounds``' result plus ``n_params`` and ``n_tensors``.
        pairs: (numerator, denominator) engine names; pairs not present are skipped.

    Returns:
        Per model: ``engines[kind]`` with ``step_ms`` (summary over rounds of
        block time / K, slowest rank), ``single_step_ms``, ``cpu_step_ms``
        (training-thread CPU time, mean over ranks), and the per-round
        ``per_round_ms`` / ``per_round_cpu_ms`` from which callers may form
        further paired figures; ``ratios``; ``exposed_comm_ms`` (engine
        median minus the ``local`` median, if a ``local`` engine ran).
    """
    models = {}
    for model_name, m0 in rank_outputs[0]["models"].items():
        ranks = [r["models"][model_name] for r in rank_outputs]
        kinds = list(m0["block_s"])
        k, rounds = m0["steps_per_block"], m0["rounds"]
        engines = {}
        round_step: dict[str, list[float]] = {}
        for kind in kinds:
            # block time per step, slowest rank: the step a data-parallel job sees
            per_round = [max(rk["block_s"][kind][i] for rk in ranks) / k for i in range(rounds)]
            round_step[kind] = per_round
            steps = [max(rk["per_step_s"][kind][i][j] for rk in ranks) for i in range(rounds) for j in range(k)]
            # training-thread CPU time (mean over ranks): excludes waiting and
            # time other processes took the core
            per_round_cpu = [statistics.mean(rk["cpu_block_s"][kind][i] for rk in ranks) / k for i in range(rounds)]
            engines[kind] = {
                "step_ms": summarize([v * 1e3 for v in per_round]),
                "single_step_ms": summarize([v * 1e3 for v in steps]),
                "per_round_ms": [v * 1e3 for v in per_round],
                "cpu_step_ms": summarize([v * 1e3 for v in per_round_cpu]),
                "per_round_cpu_ms": [v * 1e3 for v in per_round_cpu],
            }
        exposed = {}
        if "local" in engines:
            base_local = engines["local"]["step_ms"]["median"]
            exposed = {kind: engines[kind]["step_ms"]["median"] - base_local for kind in kinds if kind != "local"}
        models[model_name] = {
            "n_params": m0["n_params"],
            "n_tensors": m0["n_tensors"],
            "steps_per_block": k,
            "rounds": rounds,
            "engines": engines,
            "ratios": per_round_ratios(round_step, pairs),
            "exposed_comm_ms": exposed,
        }
    return models


def fmt_ratio(r: Optional[dict]) -> str:
    """``median [q1-q3] (min-max)`` of a ratio summary; ``n/a`` if absent."""
    if not r:
        return "n/a"
    return f"{r['median']:.3f} [{r['q1']:.3f}-{r['q3']:.3f}] ({r['min']:.2f}-{r['max']:.2f})"
