"""The reducer breakdown's table and warnings, for the report (parent process).

The figures come from ``benchlib.breakdown``; the caption says how.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from benchlib.breakdown import missing_message

TABLE_CAPTION = (
    "**Our reducer, from torch.profiler labels** (world size 2, rank 0; a separate untimed pass under "
    "`torch.profiler.profile(activities=[CPU])`, reading the library's `torchreplicate::<phase>` events; nothing is patched. "
    "Wall time on the training thread, ms per step (the median over the profiled steps) unless noted. Each event's own label cost (label µs: the median "
    "total of an empty labelled function, calibrated in the same session) is taken off, and a parent's self time "
    "loses the cost of each label nested in it (nested µs). "
    "hook = `hook` per call, median, without the launches nested in it; copy = tensor ops recorded inside hooks "
    "(moving fresh grads into their slots) [the multiply into the slot (`Bucket.take`'s) on every slot without the profiler, hot in cache, "
    "thread CPU: a lower bound]; bookkeeping = hook - copy, per call, median; launch = `launch` nested in a hook / "
    "in `finalize`; scale = tensor ops inside launches (`Bucket.launch`'s scaling, a wire-dtype copy); "
    "wait = `wait` (inside `finalize`); finalize other = `finalize` minus the launches, waits and late rounds nested "
    "in it (filling slots at the end, the flags, restoring .grad, learning); late = `late_round` ms (calls per step); "
    "fwd hooks = `pre_forward` / `post_forward` µs per step; 1 pass = one mul_ over all buckets, thread CPU, for scale; "
    "bookkeeping µs/tensor = (bookkeeping per call x hook calls + finalize other) / tensors. "
    "MISSING = the label never appeared)"
)


def breakdown_table(rows: Sequence[tuple[str, dict]]) -> list[str]:
    """Markdown lines of the breakdown table: a caption, then one row per (title, breakdown)."""
    lines = [TABLE_CAPTION, ""]
    lines.append(
        "| model | buckets (from hooks) | hook µs/call | copy ms [µbench] | bookkeeping µs/call | launch ms hooks / end "
        "| scale ms | wait ms | finalize other ms | late ms (calls) | fwd hooks µs pre / post | 1 pass ms "
        "| bookkeeping µs/tensor | label µs / nested µs |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    warnings_below = []
    for title, b in rows:
        missing = b["missing_labels"]

        def f(key: str, digits: int = 2, b: dict = b) -> str:
            value = b.get(key)
            return "MISSING" if value is None else f"{value:.{digits}f}"

        micro = b.get("copy_microbenchmark_cpu_ms")
        cal = b["calibration"]
        lines.append(
            f"| {title} | {b['num_buckets']} ({b['launches_in_hooks_per_step']:.0f}) | {f('hook_us_per_call')} "
            f"| {f('copy_ms')} [{'n/a' if micro is None else f'{micro:.2f}'}] | {f('hook_bookkeeping_us_per_call')} "
            f"| {f('launch_in_hooks_ms')} / {f('launch_at_end_ms')} | {f('launch_tensor_ops_ms')} | {f('wait_ms')} "
            f"| {f('finalize_other_ms', 3)} | {f('late_round_ms')} ({b['late_rounds_per_step']:.0f}) "
            f"| {f('pre_forward_us', 0)} / {f('post_forward_us', 0)} | {f('one_pass_over_buckets_cpu_ms')} "
            f"| {f('bookkeeping_us_per_tensor')} | {cal['label_floor_us']:.1f} / {cal['nested_label_us']:.1f} |"
        )
        if missing:
            lines.append(f"| **{title}** | **MISSING profiler labels: {', '.join(missing)}** |")
            warnings_below.append(f"{title}: {missing_message(missing, b['steps'])}")
        for note in b["nesting_notes"] + [f"unknown label {u}" for u in b["unknown_labels"]]:
            warnings_below.append(f"{title}: {note}")
    if warnings_below:
        lines.append("")
        lines.extend(f"> **WARNING** {w}" for w in warnings_below)
    return lines


def breakdown_warnings(breakdowns: Iterable[tuple[str, dict]]) -> list[str]:
    """One line per (place, breakdown) whose expected labels did not all appear."""
    return [
        f"{place}: {missing_message(b['missing_labels'], b['steps'])}"
        for place, b in breakdowns
        if b.get("missing_labels")
    ]
