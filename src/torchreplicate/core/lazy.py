"""Lazy modules (``nn.LazyLinear`` and the like): replicated from the first forward that materialises them.

[Note: lazy modules]
A lazy module's parameters have no shape until its first forward, where
torch's own forward pre-hook (``LazyModuleMixin``) materialises them in
place (the same ``Parameter`` object, now with data drawn from this rank's
random generator) and resets them. DDP refuses such a module; here the plan
leaves each lazy module out (``LazyModules``, as if ignored) until a forward
pre-hook of ours on it, registered after torch's and so run right after it,
releases it in its first forward with gradients and re-plans: the re-plan
checks them across ranks and broadcasts them from rank 0 ([Note:
re-planning] in plan.py) before the lazy module's forward reads them, and
builds the reducer that averages their first gradients. So every rank
computes with rank 0's values from the very first forward, whatever each
rank seeded: exact against one process that materialised them as rank 0
did.

Like every re-plan, it runs collectives: every rank must run the lazy
module's first forward with gradients enabled at the same point (a forward
without gradients materialises locally and leaves the broadcast to the
next forward with gradients, as [Note: re-planning] leaves evaluation
alone). Refused, naming the fix (run one forward first): a lazy root (torch
swaps its class as it materialises) and an ``mp_policy`` (its casts wrap
the root's forward, which would already be under way).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.nn.modules.lazy import LazyModuleMixin
from torch.utils.hooks import RemovableHandle


def _unmaterialised(module: nn.Module) -> bool:
    return isinstance(module, LazyModuleMixin) and module.has_uninitialized_params()


class LazyModules:
    """The lazy modules of one replicated tree not yet seen in a forward with gradients.

    The plan leaves them out, materialised or not: a rank that evaluated
    first (materialised without gradients) plans them at the same forward
    as a rank that did not ([Note: lazy modules]).
    """

    def __init__(self) -> None:
        self._pending: list[weakref.ref[nn.Module]] = []  # held weakly: a swapped-out layer is freed

    def modules(self) -> list[nn.Module]:
        """The lazy modules still pending (what the plan skips)."""
        return [m for m in (ref() for ref in self._pending) if m is not None]

    def watch(self, root: nn.Module, mixed: bool, materialised: Callable[[nn.Module], None]) -> list[RemovableHandle]:
        """Installs a hook on every lazy module of ``root``'s tree that is not materialised yet.

        Args:
            root: the replicated module.
            mixed: whether an ``mp_policy`` casts around its forward.
            materialised: a bound method (held weakly), called with a lazy
                module once it materialised in a forward with gradients.

        Raises:
            ValueError: a lazy root, or a lazy module under an ``mp_policy``, naming it and the fix.
        """
        handles = []
        for name, module in root.named_modules():
            if not _unmaterialised(module):
                continue
            _refuse_unsafe(module is root, mixed, name, module)
            watch = _LazyWatch(materialised, module)
            watch.handle = module.register_forward_pre_hook(watch)  # after torch's: runs once it materialised
            handles.append(watch.handle)
            self._pending.append(weakref.ref(module))
        return handles

    def release(self, module: nn.Module) -> None:
        """``module`` materialised in a forward with gradients: the plan takes it from now on."""
        self._pending = [ref for ref in self._pending if ref() is not module and ref() is not None]


def _refuse_unsafe(is_root: bool, mixed: bool, name: str, module: nn.Module) -> None:
    if is_root and getattr(module, "cls_to_become", None) is not None:
        raise ValueError(
            f"replicate(): the root {type(module).__name__} is a lazy module that is not materialised yet, "
            "and torch replaces its class when it materialises (dropping replicate()'s methods); run one "
            "forward first (a dry run with an input of the right shape), or replicate a module that holds it"
        )
    if mixed:
        raise ValueError(
            f"replicate(): {name} ({type(module).__name__}) is a lazy module that is not materialised yet, "
            "and mp_policy casts around the forward that would materialise it; run one forward first "
            "(a dry run with an input of the right shape), then call replicate()"
        )


class _Copied:
    """What a deep copy or a pickle of a replicated model keeps of a lazy module's hook: a hook that does
    nothing (the copy is a plain module, replicated by no one)."""

    def __call__(self, module: nn.Module, args: Any) -> None:
        return None


class _LazyWatch:
    """Re-plans once its lazy module materialised, in a forward with gradients ([Note: lazy modules]).

    A deep copy or a pickle of the model (``torch.save``) copies the lazy module's
    hooks: each copies as a ``_Copied`` (a weak reference does not pickle).
    """

    __slots__ = ("owner_ref", "method", "module_ref", "handle")

    def __init__(self, materialised: Callable[[nn.Module], None], module: nn.Module) -> None:
        # the state's bound method, its owner held weakly (the state holds the handle: no cycle)
        self.owner_ref = weakref.ref(materialised.__self__)  # type: ignore[attr-defined]
        self.method = materialised.__func__  # type: ignore[attr-defined]
        self.module_ref = weakref.ref(module)  # the watched module (a deep copy carries this hook too)
        self.handle: Optional[RemovableHandle] = None  # set right after registering

    def __reduce__(self) -> tuple[type[_Copied], tuple[()]]:
        return _Copied, ()

    @torch.compiler.disable  # eager: a re-plan runs collectives
    def __call__(self, module: nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled() or _unmaterialised(module) or module is not self.module_ref():
            return  # no collective without gradients; still lazy: torch raised its own error; a deep copy
        assert self.handle is not None, "set at registration"
        self.handle.remove()
        if (owner := self.owner_ref()) is not None:  # else replicate() failed part-way
            self.method(owner, module)
