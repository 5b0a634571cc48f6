"""The forward side of tied parameters: the first module to use one gets a detached copy.

[Note: tied parameters] in reducer/tied_rows.py says why. Here: every module
that holds a tied parameter (two or more modules hold it, in their
``_parameters``) gets a forward pre-hook and an always-run forward hook. In a
forward of the root with gradients enabled, before a synchronised backward,
the first such module called gets, for the length of its forward, a detached
copy in ``_parameters`` (set directly, as mixed_precision.py does, so no
registration hook runs); the gradient of the copy goes to the reducer's
``TiedRows``. The modules called after it use the parameter itself, so its
``.grad`` is complete once their backward is done, early in backward.

Not detached (the parameter is then reduced whole, in its bucket, as any
other): under compiled autograd or while Dynamo traces the module, outside a
forward of the root (a method other than ``forward``, a checkpointed block
recomputed in backward), with gradient sync off (``no_sync``), or when the
module's parameter was replaced since the plan.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from torchreplicate.lifecycle import Lifecycle, TrainingState
from torchreplicate.reducer.reducer import Reducer
from torchreplicate.torch_internals import compiled_autograd_enabled, parameters_of


def tied_params(root: nn.Module, params: tuple[nn.Parameter, ...]) -> dict[int, list[tuple[nn.Module, str]]]:
    """The parameters of ``params`` that two or more modules of ``root`` hold, by identity, with their holders."""
    wanted = {id(p) for p in params}
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in root.modules():
        for name, param in parameters_of(module).items():
            if param is not None and id(param) in wanted:
                holders.setdefault(id(param), []).append((module, name))
    return {key: found for key, found in holders.items() if len(found) > 1}


class TiedUses:
    """The hooks of one replicated module's tied parameters, for one plan whose reducer splits some.

    A plan without a tied split has none (``ReplicateState.tied`` is None,
    setup.py decides): its forwards run nothing of this file.

    Args:
        lifecycle: the module's; holders detach only while it is ``FORWARD``.
    """

    def __init__(self, lifecycle: Lifecycle) -> None:
        self._handles: list[RemovableHandle] = []
        self.lifecycle = lifecycle
        # the reducer the detached uses of the root's current (or last) forward
        # go to; None: that forward does not detach (decided once, at its start)
        self.reducer: Optional[Reducer] = None
        # per tied parameter (by identity) in this forward: the module given the
        # detached copy, and the copy
        self.detached: dict[int, tuple[nn.Module, torch.Tensor]] = {}

    def install(self, root: nn.Module, reducer: Reducer) -> None:
        """Hooks every module holding one of ``reducer``'s tied parameters (it has some: setup.py)."""
        index_of = {id(slot.param): slot.index for slot in reducer.tied_rows.slots}
        holders = tied_params(root, tuple(slot.param for slot in reducer.tied_rows.slots))
        by_module: dict[int, tuple[nn.Module, list[tuple[str, nn.Parameter, int]]]] = {}
        for key, found in holders.items():
            for module, name in found:
                param = parameters_of(module)[name]
                assert param is not None
                by_module.setdefault(id(module), (module, []))[1].append((name, param, index_of[key]))
        for module, uses in by_module.values():
            hook = _HolderHook(self, uses)
            self._handles.append(module.register_forward_pre_hook(hook.before))
            self._handles.append(module.register_forward_hook(hook.after, always_call=True))

    def remove(self) -> None:
        """Removes every hook it installed."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.reducer = None
        self.detached.clear()

    def begin(self, reducer: Optional[Reducer], syncs: bool) -> None:
        """The root's forward starts (``FORWARD``); ``syncs``: its backward will be synchronised."""
        self.detached.clear()
        # the reducer's first step may drop the split where it does not pay (layout/policy.py): no tied slots left
        detaches = self._handles and syncs and reducer is not None and reducer.tied_rows.slots
        self.reducer = reducer if detaches and not compiled_autograd_enabled() else None


class _HolderHook:
    # One holder module's tied parameters: (name, parameter, slot index).
    __slots__ = ("uses", "owner", "restore")

    def __init__(self, owner: Optional[TiedUses], uses: list[tuple[str, nn.Parameter, int]]) -> None:
        self.owner = owner
        self.uses = uses
        self.restore: list[list[tuple[str, nn.Parameter]]] = []  # a stack: a module may call itself

    def __reduce__(self) -> Any:
        # A copy or pickle of the module (without replicate(): api.py) keeps an inert hook.
        return (_HolderHook, (None, []))

    def before(self, module: nn.Module, args: Any) -> None:
        owner = self.owner
        swapped: list[tuple[str, nn.Parameter]] = []
        self.restore.append(swapped)
        if owner is None or owner.lifecycle.now is not TrainingState.FORWARD or owner.reducer is None:
            return
        if not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return
        reducer = owner.reducer
        params = parameters_of(module)
        for name, param, index in self.uses:
            if params.get(name) is not param:
                continue  # replaced since the plan: the next forward re-plans
            holder, copy = owner.detached.get(id(param), (None, None))
            if holder is None:
                copy = param.detach().requires_grad_()
                copy.register_post_accumulate_grad_hook(functools.partial(_arrived, reducer, index))
                owner.detached[id(param)] = (module, copy)
            elif holder is not module:
                continue  # a later holder: uses the parameter itself
            assert copy is not None
            params[name] = copy  # a plain tensor for the forward only
            swapped.append((name, param))

    def after(self, module: nn.Module, args: Any, output: Any) -> None:
        params = parameters_of(module)
        for name, param in self.restore.pop():
            params[name] = param


def _arrived(reducer: Reducer, index: int, copy: torch.Tensor) -> None:
    if (grad := copy.grad) is not None:
        copy.grad = None
        reducer.tied_rows.arrive(index, grad)
