"""Profiler labels for each phase of a step, free when no profiler runs.

Every reducer and forward phase runs inside ``record_function("torchreplicate::<phase>")``
while a ``torch.profiler`` session is active, so a trace shows them by name
(and the benchmark reads its breakdown from them). Outside a session the label
costs one flag check: the gradient hook runs once per parameter per step, and
``record_function`` itself costs microseconds even with no profiler.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

from torch.autograd import profiler as _autograd_profiler

F = TypeVar("F", bound=Callable[..., Any])

PREFIX = "torchreplicate::"
PHASES = ("pre_forward", "post_forward", "hook", "launch", "wait", "finalize", "late_round")


def profiler_enabled() -> bool:
    """Whether a torch profiler session is recording.

    Reads ``torch.autograd.profiler._is_profiler_enabled``, the flag torch
    keeps for exactly this kind of fast Python check (set on profiler start
    and stop by both ``torch.profiler.profile`` and the legacy profiler).
    Private: checked on torch 2.13.0 (present since 1.13); if a later torch
    drops it, labels are simply never recorded.
    """
    return getattr(_autograd_profiler, "_is_profiler_enabled", False)


def labelled(phase: str) -> Callable[[F], F]:
    """Decorator: runs the function under ``record_function`` while profiling."""
    assert phase in PHASES, phase
    name = PREFIX + phase

    def decorate(fn: F) -> F:
        if not hasattr(_autograd_profiler, "_is_profiler_enabled"):
            return fn  # see profiler_enabled()

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not _autograd_profiler._is_profiler_enabled:
                return fn(*args, **kwargs)
            with _autograd_profiler.record_function(name):
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate
