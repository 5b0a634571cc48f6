"""The per-module state registry: the only module-level mutable state.

``replicate()`` records one state object per module it is applied to; the
registry refuses a second application and answers ``replicate.state(module)``.
Entries are held weakly, so a discarded model frees its state.

It also keeps the process-wide registration counter of [Note: re-planning]
(plan.py): torch's global module registration hooks bump it whenever any
module registers a parameter, buffer or submodule.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch.nn.modules import module as torch_module

if TYPE_CHECKING:
    from torchreplicate.state import ReplicateState

_STATES: weakref.WeakKeyDictionary[object, ReplicateState] = weakref.WeakKeyDictionary()


class _RegistrationCounter:
    """Counts parameter, buffer and submodule registrations on any module."""

    def __init__(self) -> None:
        self.count = 0  # registrations seen since installed
        self.handles: list[Any] = []  # torch's global hook handles; empty until installed

    @torch.compiler.disable
    def __call__(self, module: Any, name: str, value: Any) -> None:
        # Never traced: torch.compile itself registers modules (OptimizedModule._orig_mod),
        # and tracing this hook there fails inside Dynamo.
        self.count += 1  # returning None leaves the registration unchanged

    def install(self) -> None:
        if not self.handles:
            self.handles = [
                torch_module.register_module_parameter_registration_hook(self),
                torch_module.register_module_buffer_registration_hook(self),
                torch_module.register_module_module_registration_hook(self),
            ]


_REGISTRATIONS = _RegistrationCounter()


def registration_count() -> int:
    """Parameter, buffer and submodule registrations on any module since the first ``replicate()``."""
    return _REGISTRATIONS.count


def register_state(module: object, state: ReplicateState) -> None:
    """Records ``state`` for ``module``; refuses a module that already has one."""
    if module in _STATES:
        raise RuntimeError(
            f"replicate() was already applied to this {type(module).__name__}: "
            "applying it twice is not supported; call it once on the root module"
        )
    _REGISTRATIONS.install()
    _STATES[module] = state


def get_state(module: object) -> ReplicateState:
    """Returns the state of a module that ``replicate()`` was applied to.

    Raises:
        ValueError: if ``replicate()`` was not applied to ``module``.
    """
    try:
        return _STATES[module]
    except (KeyError, TypeError):
        raise ValueError(
            f"replicate.state(): {type(module).__name__} is not managed by replicate(); call replicate(module) first"
        ) from None


def find_state(module: object) -> Optional[ReplicateState]:
    """The state of ``module``, or None if ``replicate()`` was not applied to it."""
    try:
        return _STATES.get(module)
    except TypeError:
        return None


def unregister_state(module: object) -> None:
    """Forgets ``module``'s state (a ``replicate()`` call that failed part-way)."""
    _STATES.pop(module, None)
