"""The per-module state registry: the only module-level mutable state.

``replicate()`` records one state object per module it is applied to; the
registry refuses a second application and answers ``replicate.state(module)``.
Entries are held weakly, so a discarded model frees its state.

It also keeps two process-wide counters fed by torch's global hooks, installed
with the first replicated module and removed with the last: the
registration counter of [Note: re-planning] (plan.py), bumped whenever any
module registers a parameter, buffer or submodule, and each replicated
module's optimizer steps, its training clock ([Note: desync detection] in
flags.py).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch.nn.modules import module as torch_module

from torchreplicate.reducer.flags import OptimizerSteps

if TYPE_CHECKING:
    from torchreplicate.core.state import ReplicateState

_STATES: weakref.WeakKeyDictionary[object, ReplicateState] = weakref.WeakKeyDictionary()
# model.module ([Note: model.module] in core/unwrapped.py): a replicated module's view while one
# is alive, and a view's module. Weak both ways: the view shares the module's __dict__, which may
# hold the module (a bound method), so a strong reference here would keep a discarded model alive.
_VIEWS: weakref.WeakKeyDictionary[object, weakref.ref[object]] = weakref.WeakKeyDictionary()
_VIEWED: weakref.WeakKeyDictionary[object, weakref.ref[object]] = weakref.WeakKeyDictionary()


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


def register_state(module: object, state: ReplicateState) -> None:
    """Records ``state`` for ``module``; refuses a module that already has one."""
    if module in _STATES:
        raise RuntimeError(
            f"replicate() was already applied to this {type(module).__name__}: "
            "applying it twice is not supported; call it once on the root module"
        )
    registrations.install()
    _OPTIMIZER_STEPS.install()
    _OPTIMIZER_STEPS.clocks.add(state.clock)
    _STATES[module] = state
    weakref.finalize(module, _release_hooks_if_unused).atexit = False


def _release_hooks_if_unused() -> None:
    # torch's global hooks live as long as a replicated module does: the
    # process is left as it was once the last one is gone (as DDP leaves it)
    if next(iter(_STATES.keys()), None) is None:  # live modules only
        registrations.uninstall()
        _OPTIMIZER_STEPS.uninstall()


def get_state(module: object) -> ReplicateState:
    """Returns the state of a module that ``replicate()`` was applied to (or of the module ``module`` views).

    Raises:
        ValueError: if ``replicate()`` was not applied to ``module``.
    """
    state = find_state(module)
    if state is None:
        raise ValueError(
            f"replicate.state(): {type(module).__name__} is not managed by replicate(); call replicate(module) first"
        )
    return state


def find_state(module: object) -> Optional[ReplicateState]:
    """The state of ``module``, or None if ``replicate()`` was not applied to it.

    A replicated module's ``.module`` view ([Note: model.module] in
    core/unwrapped.py) has its module's state.
    """
    try:
        state = _STATES.get(module)
        if state is None and module in _VIEWED:
            return _STATES.get(_VIEWED[module]())
        return state
    except TypeError:
        return None


def find_view(module: object) -> Optional[Any]:
    """``module``'s ``.module`` view, if one is alive ([Note: model.module] in core/unwrapped.py)."""
    ref = _VIEWS.get(module)
    return None if ref is None else ref()


def record_view(module: object, view: object) -> None:
    """Records ``view`` as ``module``'s ``.module`` view (both held weakly)."""
    _VIEWS[module] = weakref.ref(view)
    _VIEWED[view] = weakref.ref(module)


def enclosing_state(module: object) -> Optional[ReplicateState]:
    """The state of a replicated module that contains ``module`` (walks each replicated tree)."""
    for other, state in list(_STATES.items()):
        if other is not module and any(m is module for m in state.module.modules()):
            return state
    return None


def unregister_state(module: object) -> None:
    """Forgets ``module``'s state (a ``replicate()`` call that failed part-way)."""
    _STATES.pop(module, None)
    _release_hooks_if_unused()
