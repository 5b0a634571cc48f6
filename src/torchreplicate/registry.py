"""The per-module state registry: the only module-level mutable state.

``replicate()`` records one state object per module it is applied to; the
registry refuses a second application and answers ``replicate.state(module)``.
Entries are held weakly, so a discarded model frees its state.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torchreplicate.state import ReplicateState

_STATES: "weakref.WeakKeyDictionary[object, ReplicateState]" = weakref.WeakKeyDictionary()


def register_state(module: object, state: "ReplicateState") -> None:
    """Records ``state`` for ``module``; refuses a module that already has one."""
    if module in _STATES:
        raise RuntimeError(
            f"replicate() was already applied to this {type(module).__name__}: "
            "applying it twice is not supported; call it once on the root module"
        )
    _STATES[module] = state


def get_state(module: object) -> "ReplicateState":
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


def is_registered(module: object) -> bool:
    """Whether ``replicate()`` was applied to ``module``."""
    return module in _STATES


def unregister_state(module: object) -> None:
    """Forgets ``module``'s state (a ``replicate()`` call that failed part-way)."""
    _STATES.pop(module, None)
