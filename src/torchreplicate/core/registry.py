"""The per-module state registry, on torch's own: the only module-level mutable state.

[Note: the registry]
``replicate()`` registers a module through torch's ``@contract``
(``composable_api`` in torch_internals.py), the mechanism torch's own
composable ``replicate`` (the seed) and ``fully_shard`` use: the module's
registry, kept in its ``__dict__``, holds ``"replicate"``, so a
``fully_shard`` applied to an enclosing module afterwards skips it, as it
skips the seed's modules, and its gradients stay ours to reduce (core/nested.py).
Its ``ReplicateState`` lives beside that entry (in the contract's state, a
``_Slot``), so a discarded model frees it. The contract refuses a second
application (api.py refuses first, with the seed's text and ours after it)
and checks that the set-up renamed no parameter, buffer or submodule. A
``.module`` view shares its module's ``__dict__`` ([Note: model.module] in
compat/view.py), so it sees the same registry and state. A ``replicate()``
that fails part-way leaves no entry: a retry, or ``fully_shard``, sees a
plain module.

The registry also keeps the live replicated modules (weakly) and two
process-wide counters fed by torch's global hooks, installed with the first
replicated module and removed with the last: the registration counter of
[Note: re-planning] (plan.py), bumped whenever any module registers a
parameter, buffer or submodule, and each replicated module's optimizer steps,
its training clock ([Note: desync detection] in flags.py).
"""

from __future__ import annotations

import atexit
import weakref
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.nn.modules import module as torch_module

from torchreplicate.reducer.flags import OptimizerSteps, TrainingClock
from torchreplicate.torch_internals import composable_api, composable_state, without_composable_api

# Every module replicate() was applied to and that is alive: which hold another (enclosing_state),
# and whether torch's global hooks are still needed. Weak: a discarded model leaves.
_REPLICATED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


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

    def uninstall(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []  # the count goes on from where it is, if installed again


# read as ``registrations.count``: a plain attribute, read at every forward ([Note: re-planning])
registrations = _RegistrationCounter()


_OPTIMIZER_STEPS = OptimizerSteps()  # the training clocks' hook ([Note: desync detection] in flags.py)
atexit.register(_OPTIMIZER_STEPS.let_go_at_exit)  # one per process, at import (docs/migration.md lists it)


class _Slot:
    """The state torch's contract makes for each module ``replicate()`` is applied to: holds its ``ReplicateState``."""

    def __init__(self) -> None:
        self.state: Optional[Any] = None  # the ReplicateState; set by _apply, before the set-up runs
        # model.module ([Note: model.module] in compat/view.py) while one is alive, held weakly:
        # the view shares the module's __dict__, which holds this slot
        self.view: Optional[weakref.ref[object]] = None


def _apply(module: nn.Module, state: object, clock: TrainingClock, set_up: Callable[[], None]) -> nn.Module:
    # What the contract runs once it has registered `module`: the set-up, with the state findable.
    slot: _Slot = composable_state(module, _apply)
    slot.state = state
    _REPLICATED.add(module)
    _OPTIMIZER_STEPS.clocks.add(clock)
    set_up()
    return module


# The contract's registry key is the function's name: "replicate", the one fully_shard skips.
_apply.__name__ = "replicate"
_registered_apply = composable_api(_Slot, _apply)


def register_state(module: nn.Module, state: object, clock: TrainingClock, set_up: Callable[[], None]) -> None:
    """Registers ``module`` with ``state`` in torch's registry and runs ``set_up``; all undone if it raises.

    Args:
        module: the module ``replicate()`` is applied to.
        state: its state (core/state.py's ``ReplicateState``), found by ``find_state`` while ``set_up`` runs.
        clock: the state's training clock, counted by the optimizer hook ([Note: desync detection] in flags.py).
        set_up: the rest of ``replicate()``; must leave every name in the module tree as it was.

    Raises:
        AssertionError: the contract's: ``replicate()`` was already applied (api.py refuses that first).
        RuntimeError: the contract's: ``set_up`` changed a parameter's, buffer's or submodule's name.
    """
    registrations.install()
    _OPTIMIZER_STEPS.install()
    try:
        _registered_apply(module, state, clock, set_up)
    except BaseException:
        if find_state(module) is state:  # not a refusal of a second replicate(): that one stays
            module.__dict__.update(without_composable_api(module.__dict__, _apply))
            _REPLICATED.discard(module)
            _OPTIMIZER_STEPS.clocks.discard(clock)
        _release_hooks_if_unused()
        raise
    weakref.finalize(module, _release_hooks_if_unused).atexit = False


def _release_hooks_if_unused() -> None:
    # torch's global hooks live as long as a replicated module does: the
    # process is left as it was once the last one is gone (as DDP leaves it)
    if next(iter(_REPLICATED), None) is None:  # live modules only
        registrations.uninstall()
        _OPTIMIZER_STEPS.uninstall()


def without_registry(namespace: dict[str, Any]) -> dict[str, Any]:
    """A copy of a replicated module's ``__dict__`` without its registry entry and state (a plain module's)."""
    return without_composable_api(namespace, _apply)


def get_state(module: object) -> Any:
    """Returns the ``ReplicateState`` of a module that ``replicate()`` was applied to (or of the module it views).

    Raises:
        ValueError: if ``replicate()`` was not applied to ``module``.
    """
    if (state := find_state(module)) is None:
        raise ValueError(
            f"replicate.state(): {type(module).__name__} is not managed by replicate(); call replicate(module) first"
        )
    return state


def find_state(module: object) -> Optional[Any]:
    """The ``ReplicateState`` of ``module``, or None if ``replicate()`` was not applied to it.

    A replicated module's ``.module`` view ([Note: model.module] in
    compat/view.py) shares its ``__dict__``, so its registry and state.
    """
    slot = composable_state(module, _apply)
    return slot.state if isinstance(slot, _Slot) else None


def find_view(module: object) -> Optional[Any]:
    """``module``'s ``.module`` view, if one is alive ([Note: model.module] in compat/view.py)."""
    slot = composable_state(module, _apply)
    return None if not isinstance(slot, _Slot) or slot.view is None else slot.view()


def record_view(module: object, view: object) -> None:
    """Records ``view`` as the replicated ``module``'s ``.module`` view (held weakly)."""
    slot: _Slot = composable_state(module, _apply)
    slot.view = weakref.ref(view)


def enclosing_state(module: object) -> Optional[Any]:
    """The state of a replicated module that contains ``module`` (walks each replicated tree)."""
    for other in list(_REPLICATED):
        if other is not module and any(m is module for m in other.modules()):
            return find_state(other)
    return None
