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

from torch.autograd.profiler import record_function

from torchreplicate.torch_internals import profiler_active

F = TypeVar("F", bound=Callable[..., Any])

PREFIX = "torchreplicate::"
PHASES = ("pre_forward", "post_forward", "hook", "launch", "wait", "finalize", "late_round")


def labelled(phase: str) -> Callable[[F], F]:
    """Decorator: runs the function under ``record_function("torchreplicate::<phase>")`` while profiling."""
    assert phase in PHASES, phase
    name = PREFIX + phase

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not profiler_active():
                return fn(*args, **kwargs)
            with record_function(name):
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate
