"""Our reducer's phases per step, read from the library's ``torch.profiler`` labels.

The library runs each phase inside ``record_function("torchreplicate::<phase>")``,
with `` (bucket k)`` after the phase where it concerns one bucket,
while a profiler is active (src/torchreplicate/reducer/probe.py): ``hook`` (a
parameter's post-accumulate-grad hook), ``launch`` (one bucket's collective
issued, from a hook or from the end of backward), ``wait`` (one bucket
awaited), ``finalize`` (the end-of-backward callback), ``late_round``, and
the forward hooks ``pre_forward`` / ``post_forward``. ``measure_breakdown``
profiles a few steps of an engine (untimed, after the timed rounds) and
``analyse_events`` turns the events into per-step figures; nothing of the
reducer is patched.

[Note: reading phases from profiler events]
An event's total is the wall time between its start and end on the training
thread (the profiler has no thread-CPU clock); its self time is the total
minus its children's totals. Children are nested labels (``launch`` inside
``hook`` or ``finalize``, ``wait`` inside ``finalize``) and the tensor ops
recorded inside (``aten::mul`` moving a gradient into its slot,
``c10d::allreduce_`` enqueuing a collective). A label is not free while the
profiler records: part of ``record_function``'s cost falls inside the event
(its *floor*: the total of an empty labelled function) and part outside it,
in the parent's self time (*nested cost*). Both are calibrated in the same
profiler session, between the steps, with the library's own ``labelled``
decorator, and taken off: the floor from every event, the nested cost from a
parent once per label nested in it. The per-op cost of recording tensor ops
(about a microsecond, mostly inside the op's own event) is not corrected.
Each profiled step runs inside a ``benchlib::step`` label. Hook figures per
call are medians over all calls, and per-step figures medians over the steps
of each step's sum: on a busy machine a call or a step now and then loses
the core, which a mean would spread over every figure.
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections import defaultdict
from typing import Any, Callable, Iterable, Optional, Protocol, Sequence

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile

from benchlib.engines import Engine
from torchreplicate.reducer.probe import labelled

LABEL_PREFIX = "torchreplicate::"
STEP = "benchlib::step"  # one profiled step: the unit of the per-step figures
CALIBRATION = "benchlib::calibrate"  # parent of the calibration's labels, so they are not counted as phases
# What an engine with replicate() and a reducer records in every static synchronised step.
EXPECTED_PHASES = ("pre_forward", "post_forward", "hook", "launch", "wait", "finalize")
# late_round runs only when a gradient arrives after its bucket left: never in these static steps.
ALL_PHASES = EXPECTED_PHASES + ("late_round", "tied_rows")
_COLLECTIVE_OPS = ("c10d::", "gloo:")  # children of a launch that enqueue the collective


class ProfilerEvent(Protocol):
    """What ``analyse_events`` reads of a ``torch.autograd.profiler_util.FunctionEvent``."""

    name: str
    cpu_parent: Optional[ProfilerEvent]
    cpu_children: list[ProfilerEvent]

    @property
    def cpu_time_total(self) -> float: ...


def measure_breakdown(
    engine: Engine, batch: Any, *, steps: int, expected: Sequence[str] = EXPECTED_PHASES, warmup: int = 3
) -> dict:
    """Profiles ``steps`` steps of ``engine`` and breaks its reducer's time down by phase.

    Runs in every rank (the steps are collective); untimed, separate from the
    timed rounds. Warns if a phase of ``expected`` never shows.

    Args:
        engine: a fresh engine holding our reducer.
        batch: this rank's batch.
        steps: profiled steps (also run as many unprofiled, for comparison).
        expected: phases that must show up. Default ``EXPECTED_PHASES``.
        warmup: steps before any measurement (the reducer learns in step 1). Default 3.
    """
    for _ in range(warmup):
        engine.step(batch)
    dist.barrier()
    unprofiled = _StepClock()
    for _ in range(steps):
        with unprofiled:
            engine.step(batch)
    dist.barrier()
    profiled = _StepClock()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            with profiled, record_function(STEP):
                engine.step(batch)
            _calibration_block()  # local: the other rank waits for it at the next step's first collective
    events = list(prof.events())
    calibration = _calibration(events)
    result = analyse_events(
        events, expected=expected, floor_us=calibration["label_floor_us"], nested_us=calibration["nested_label_us"]
    )
    reducer = engine.reducer
    num_tensors = len(reducer.slots) if reducer is not None else 0
    per_call = result["hook_bookkeeping_us_per_call"]
    finalize_other = result["finalize_other_ms"]
    result.update(
        n_tensors=num_tensors,
        num_buckets=len(reducer.buckets) if reducer is not None else 0,
        calibration=calibration,
        step_ms={
            "profiled_wall": profiled.wall_ms,
            "profiled_cpu": profiled.cpu_ms,
            "unprofiled_wall": unprofiled.wall_ms,
            "unprofiled_cpu": unprofiled.cpu_ms,
        },
        copy_microbenchmark_cpu_ms=_copy_microbenchmark_ms(engine),
        one_pass_over_buckets_cpu_ms=_one_pass_ms(engine),
        # Python bookkeeping per tensor: hook logic + end-of-backward work,
        # without copies into buckets, issuing collectives and waiting
        bookkeeping_us_per_tensor=(
            (per_call * result["hook_calls_per_step"] + finalize_other * 1e3) / num_tensors
            if num_tensors and per_call is not None and finalize_other is not None
            else None
        ),
    )
    if result["missing_labels"]:
        warnings.warn(missing_message(result["missing_labels"], result["steps"]), stacklevel=2)
    return result


def analyse_events(
    events: Iterable[ProfilerEvent], *, expected: Sequence[str], floor_us: float, nested_us: float
) -> dict:
    """Per-step figures of each phase from profiler events ([Note: reading phases from profiler events]).

    Pure: reads only the events' names, totals and nesting. Each profiled
    step is a ``STEP`` event; per-step figures are the median over steps of
    each step's sum.

    Args:
        events: the profiler's events.
        expected: phases that must show up; the missing ones are listed in
            ``missing_labels`` and the figures that need them are None.
        floor_us: cost of a label inside its own event, taken off every event.
        nested_us: cost of a nested label in its parent's self time.

    Returns:
        ``phases``: per phase, ``calls_per_step`` and the raw
        ``total_ms_per_step`` / ``self_ms_per_step``; the derived figures
        named in the table; ``missing_labels``; ``nesting_notes`` (labels
        found outside where the library puts them).
    """
    events = list(events)
    step_events = [e for e in events if e.name == STEP]
    if not step_events:
        raise ValueError(f"analyse_events(): no {STEP!r} event; run each profiled step inside record_function(STEP)")
    num_steps = len(step_events)
    step_index = {id(e): i for i, e in enumerate(step_events)}
    by_phase: dict[str, list[ProfilerEvent]] = defaultdict(list)
    step_of: dict[int, int] = {}  # id(event) -> its step
    outside_steps = 0
    for event in events:
        phase = _phase_of(event)
        if phase is None or (event.cpu_parent is not None and event.cpu_parent.name == CALIBRATION):
            continue
        step = _enclosing_step(event, step_index)
        if step is None:
            outside_steps += 1
            continue
        step_of[id(event)] = step
        by_phase[phase].append(event)
    seen = set(by_phase)
    missing = [phase for phase in expected if phase not in seen]

    def per_step_ms(found: Iterable[ProfilerEvent], value: Callable[[ProfilerEvent], float]) -> float:
        sums = [0.0] * num_steps
        for event in found:
            sums[step_of[id(event)]] += value(event)
        return statistics.median(sums) / 1e3

    def when(phase: str, figure: Callable[[], float], *, needs: Sequence[str] = ()) -> Optional[float]:
        # None (the table reads MISSING) when the phase, or a phase the figure
        # subtracts (``needs``), was expected but never showed; 0 when the
        # phase was not expected and did not show
        if any(p in missing for p in (phase, *needs)):
            return None
        return figure() if phase in seen else 0.0

    def net(event: ProfilerEvent) -> float:
        return event.cpu_time_total - floor_us  # without its own label's cost

    def own(event: ProfilerEvent) -> float:
        # without its own label's cost and without the labels nested in it
        inner = [c for c in event.cpu_children if _phase_of(c) is not None]
        return net(event) - sum(c.cpu_time_total for c in inner) - nested_us * len(inner)

    def tensor_ops(event: ProfilerEvent, *, collectives: bool = True) -> float:
        return sum(
            c.cpu_time_total
            for c in event.cpu_children
            if _phase_of(c) is None and (collectives or not c.name.startswith(_COLLECTIVE_OPS))
        )

    result: dict[str, Any] = {
        "steps": num_steps,
        "phases": {
            phase: {
                "calls_per_step": len(by_phase[phase]) / num_steps,
                "total_ms_per_step": per_step_ms(by_phase[phase], lambda e: e.cpu_time_total),
                "self_ms_per_step": per_step_ms(by_phase[phase], _self_time),
            }
            for phase in sorted(set(ALL_PHASES) | seen)
        },
        "missing_labels": [LABEL_PREFIX + p for p in missing],
        "unknown_labels": [LABEL_PREFIX + p for p in sorted(seen - set(ALL_PHASES))],
        "hook_calls_per_step": len(by_phase["hook"]) / num_steps,
    }

    hooks = by_phase["hook"]
    hook_own = [own(e) for e in hooks]
    bookkeeping = [own(e) - tensor_ops(e) for e in hooks]
    result.update(
        hook_us_per_call=when("hook", lambda: statistics.median(hook_own)),
        hook_us_per_call_mean=when("hook", lambda: statistics.mean(hook_own)),
        copy_ms=when("hook", lambda: per_step_ms(hooks, tensor_ops)),
        hook_bookkeeping_us_per_call=when("hook", lambda: statistics.median(bookkeeping)),
    )

    launches: dict[str, list[ProfilerEvent]] = defaultdict(list)
    for event in by_phase["launch"]:
        launches[_enclosing_phase(event) or "no label"].append(event)
    result.update(
        buckets_launched_per_step=len(by_phase["launch"]) / num_steps,
        launches_in_hooks_per_step=len(launches["hook"]) / num_steps,
        launch_in_hooks_ms=when("launch", lambda: per_step_ms(launches["hook"], net)),
        launch_at_end_ms=when("launch", lambda: per_step_ms(launches["finalize"], net)),
        launch_tensor_ops_ms=when(
            "launch", lambda: per_step_ms(by_phase["launch"], lambda e: tensor_ops(e, collectives=False))
        ),
    )

    finalizes = by_phase["finalize"]
    result.update(
        wait_ms=when("wait", lambda: per_step_ms(by_phase["wait"], net)),
        finalize_ms=when("finalize", lambda: per_step_ms(finalizes, net)),
        # end-of-backward work besides launching, waiting and late rounds:
        # filling the slots not launched from hooks, the flags, restoring .grad, learning
        finalize_other_ms=when("finalize", lambda: per_step_ms(finalizes, own), needs=("launch", "wait")),
        finalize_other_tensor_ops_ms=when("finalize", lambda: per_step_ms(finalizes, tensor_ops)),
        late_round_ms=when("late_round", lambda: per_step_ms(by_phase["late_round"], net)),
        late_rounds_per_step=len(by_phase["late_round"]) / num_steps,
        pre_forward_us=when("pre_forward", lambda: per_step_ms(by_phase["pre_forward"], net) * 1e3),
        post_forward_us=when("post_forward", lambda: per_step_ms(by_phase["post_forward"], net) * 1e3),
    )

    notes = [
        f"{len(found)} launch(es) inside {where}, expected inside hook or finalize"
        for where, found in launches.items()
        if where not in ("hook", "finalize")
    ]
    stray_waits = [e for e in by_phase["wait"] if _enclosing_phase(e) != "finalize"]
    if stray_waits:
        notes.append(f"{len(stray_waits)} wait(s) outside finalize")
    if outside_steps:
        notes.append(f"{outside_steps} labelled event(s) outside the profiled steps, not counted")
    result["nesting_notes"] = notes
    return result


def missing_message(missing: Sequence[str], steps: int) -> str:
    """The warning for phases that never showed up in the profile."""
    return (
        f"reducer breakdown: profiler label(s) {', '.join(missing)} never recorded in {steps} profiled steps; "
        "their columns read MISSING. Did the library rename or drop them (src/torchreplicate/reducer/probe.py)?"
    )


# -- calibration ---------------------------------------------------------------

_CALIBRATION_CALLS = 200  # empty labels per calibration block (one block per profiled step)


@labelled("hook")
def _empty_labelled() -> None:
    return None


def _calibration_block() -> None:
    with record_function(CALIBRATION):
        for _ in range(_CALIBRATION_CALLS):
            _empty_labelled()


def _calibration(events: Sequence[ProfilerEvent]) -> dict:
    """Label costs from the calibration blocks: floor (inside) and nested cost (in the parent)."""
    blocks = [e for e in events if e.name == CALIBRATION]
    floors = [c.cpu_time_total for b in blocks for c in b.cpu_children]
    plain = _plain_call_us()
    if not floors:  # labels not recorded at all: nothing to correct (and the breakdown reports them missing)
        return {"label_floor_us": 0.0, "nested_label_us": 0.0, "plain_call_us": plain, "labels": 0}
    nested = statistics.median(_self_time(b) / max(1, len(b.cpu_children)) for b in blocks) - plain
    return {
        "label_floor_us": statistics.median(floors),
        "nested_label_us": max(0.0, nested),
        "plain_call_us": plain,
        "labels": len(floors),
    }


def _plain_call_us() -> float:
    # a loop iteration calling an undecorated function: what the calibration's
    # parent would spend per label without the profiler (best of 5)
    def empty() -> None:
        return None

    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(_CALIBRATION_CALLS):
            empty()
        best = min(best, (time.perf_counter() - t0) / _CALIBRATION_CALLS * 1e6)
    return best


# -- reference figures without the profiler ------------------------------------


class _StepClock:
    """Context manager adding up wall and training-thread CPU time over the steps it wraps."""

    def __init__(self) -> None:
        self.wall_s = 0.0  # summed over the wrapped steps
        self.cpu_s = 0.0
        self.num_steps = 0
        self._started = (0.0, 0.0)

    def __enter__(self) -> None:
        self._started = (time.perf_counter(), time.thread_time())

    def __exit__(self, *exc: object) -> None:
        self.wall_s += time.perf_counter() - self._started[0]
        self.cpu_s += time.thread_time() - self._started[1]
        self.num_steps += 1

    @property
    def wall_ms(self) -> float:
        """Mean wall time per step."""
        return self.wall_s / max(1, self.num_steps) * 1e3

    @property
    def cpu_ms(self) -> float:
        """Mean thread CPU time per step."""
        return self.cpu_s / max(1, self.num_steps) * 1e3


def _copy_microbenchmark_ms(engine: Engine) -> Optional[float]:
    # What the hooks' copies cost without a profiler: the reduction's absorb
    # (fresh gradient -> its slot, scaled) on a random tensor per parameter,
    # hot in cache, thread CPU time, best of 5: a lower bound. Writes into
    # the slots: run after the engine's last step.
    reducer = engine.reducer
    if reducer is None:
        return None
    pairs = [(torch.randn_like(slot.param), slot) for slot in reducer.slots if getattr(slot, "bucket", None)]
    absorb = getattr(reducer.reduction, "absorb", None)  # before issue 37 the reduction absorbed into slots
    if absorb is None:

        def absorb(grad: torch.Tensor, slot: Any) -> None:  # the bucket's multiply on the way in (bucket.py)
            scale = slot.bucket.scale
            torch.mul(grad, scale, out=slot.view) if scale is not None else slot.view.copy_(grad)

    for grad, slot in pairs:
        absorb(grad, slot)
    best = float("inf")
    for _ in range(5):
        c0 = time.thread_time()
        for grad, slot in pairs:
            absorb(grad, slot)
        best = min(best, time.thread_time() - c0)
    return best * 1e3


def _one_pass_ms(engine: Engine) -> Optional[float]:
    # One mul_ over all buckets, for scale: what any extra pass over the gradients costs.
    reducer = engine.reducer
    if reducer is None:
        return None
    scratch = [b.grads.clone() for b in reducer.buckets]  # real values (no denormals)
    for s in scratch:
        s.mul_(0.5)  # touch the pages once
    c0 = time.thread_time()
    for _ in range(5):
        for s in scratch:
            s.mul_(0.5)
    return (time.thread_time() - c0) / 5 * 1e3


# -- event tree ----------------------------------------------------------------------


def _phase_of(event: ProfilerEvent) -> Optional[str]:
    name = event.name  # torchreplicate::<phase>, or torchreplicate::<phase> (bucket k)
    return name[len(LABEL_PREFIX) :].split(" (bucket ")[0] if name.startswith(LABEL_PREFIX) else None


def _enclosing_step(event: ProfilerEvent, step_index: dict[int, int]) -> Optional[int]:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name == STEP:
            return step_index[id(parent)]
        parent = parent.cpu_parent
    return None


def _enclosing_phase(event: ProfilerEvent) -> Optional[str]:
    parent = event.cpu_parent
    while parent is not None:
        phase = _phase_of(parent)
        if phase is not None:
            return phase
        parent = parent.cpu_parent
    return None


def _self_time(event: ProfilerEvent) -> float:
    return event.cpu_time_total - sum(c.cpu_time_total for c in event.cpu_children)
