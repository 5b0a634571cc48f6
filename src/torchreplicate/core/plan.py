"""What a replicated module replicates (the plan), and when to plan again.

[Note: re-planning]
What ``replicate()`` replicates can change after it ran: a layer frozen or
unfrozen (staged fine-tuning), a layer added or swapped (model surgery),
parameters replaced by ``load_state_dict(assign=True)``, ``fully_shard``
applied to a child, ``model.double()`` / ``model.to(...)``, torch's
optimizer-in-backward applied to parameters, a lazy module materialised
(lazy.py: its own hook re-plans, the stamp does not see it). Walking the module tree every
forward costs ~0.5 ms for 256 parameters, so each forward compares a stamp
(``ReplicateState.stamp``) instead:

- a process-wide counter that torch's global module registration hooks bump
  whenever any module registers a parameter, buffer or submodule (registry.py);
- a per-module counter that ``ReplicateModule._apply`` bumps (``.to()``,
  ``.double()``, ``.half()``, ``.cuda()`` on the replicated root), and so does
  setting DDP's ``_ddp_params_and_buffers_to_ignore`` on it (compat/ddp_surface.py);
- the number of parameters claimed by optimizer-in-backward, and the number
  of composable-API states (``fully_shard``), process-wide;
- the ``requires_grad`` flags of every candidate parameter (one list
  comparison, ~15 us for 256 parameters).

Only when the stamp moved does the forward walk the tree (``make_plan``), and
only when the walk finds a different plan does the module re-plan. A re-plan
runs collectives (the cross-rank check, a broadcast of the parameters and
buffers new to the plan from rank 0) and rebuilds the reducer, handing over
what it learned, so every rank must re-plan at the same forward: they do
whenever they run the same code. A forward with gradients disabled never
re-plans nor broadcasts buffers, so one rank may evaluate alone.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Collection, NamedTuple, Sequence

import torch
from torch import nn

from torchreplicate.core.buffers import BufferRef, values_of
from torchreplicate.core.registry import find_state
from torchreplicate.errors import some_names
from torchreplicate.reducer.dtensors import local
from torchreplicate.torch_internals import in_backward_optimizers

IGNORE_ATTRIBUTE = "_ddp_params_and_buffers_to_ignore"  # DDP's: names of parameters and buffers left alone


class Plan(NamedTuple):
    """What a module replicates at one moment; see [Note: re-planning].

    Attributes:
        candidate_names: fully qualified names of the candidates.
        candidates: every parameter not skipped, frozen ones too, in
            registration order: all are checked across ranks and broadcast
            at ``replicate()``, as DDP does; those that require grad are
            replicated (``params``).
        trainable: the candidates' ``requires_grad`` when planned (a list, so
            a forward compares it with one C-level list comparison).
        signature: per candidate, what a re-plan must notice besides the
            flags: identity, dtype, device, shape, optimizers in backward.
        buffers: the replicated buffers, as (owner, name): read at each use,
            since a submodule's ``.to()`` swaps the tensors (buffers.py).
        sparse: identities of the parameters that get sparse gradients
            (``nn.Embedding`` / ``nn.EmbeddingBag`` with ``sparse=True``).
        groups: per candidate, 0, or i > 0 when it belongs to the i-th inner
            replicated module (nested ``replicate()``; the innermost wins):
            its buckets hold no other group's parameters.
    """

    candidate_names: tuple[str, ...]
    candidates: tuple[nn.Parameter, ...]
    trainable: list[bool]
    signature: tuple[tuple[object, ...], ...]
    buffers: tuple[BufferRef, ...]
    sparse: frozenset[int]
    groups: tuple[int, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        """Fully qualified names of the replicated parameters (candidates that require grad)."""
        return tuple(n for n, t in zip(self.candidate_names, self.trainable, strict=True) if t)

    @property
    def param_groups(self) -> tuple[int, ...]:
        """The group of each replicated parameter (see ``groups``)."""
        return tuple(g for g, t in zip(self.groups, self.trainable, strict=True) if t)

    @property
    def params(self) -> tuple[nn.Parameter, ...]:
        """The replicated parameters, in registration order."""
        return tuple(p for p, t in zip(self.candidates, self.trainable, strict=True) if t)

    def same_as(self, other: Plan) -> bool:
        """Whether ``other`` replicates exactly the same tensors in the same way."""
        return (
            self.trainable == other.trainable
            and self.signature == other.signature
            and _buffer_keys(self.buffers) == _buffer_keys(other.buffers)
        )

    def buffer_values(self) -> list[torch.Tensor]:
        """The replicated buffers' current tensors."""
        return values_of(self.buffers)


EMPTY_PLAN = Plan((), (), [], (), (), frozenset(), ())


def _buffer_keys(buffers: Sequence[BufferRef]) -> list[tuple[int, str]]:
    return [(id(owner()), name) for owner, name in buffers]


def _signature(param: nn.Parameter) -> tuple[object, ...]:
    return (id(param), param.dtype, param.device, tuple(param.shape), len(in_backward_optimizers(param)))


def make_plan(
    root: nn.Module,
    skipped: Sequence[nn.Module],
    inner: Sequence[nn.Module] = (),
    skipped_names: Collection[str] = (),
) -> Plan:
    """Walks ``root`` and returns what it replicates.

    Args:
        root: the replicated module.
        skipped: modules whose parameters and buffers (and their
            descendants') are left alone (ignored, managed by ``fully_shard``).
        inner: replicated modules inside ``root`` (nested ``replicate()``), outer ones first.
        skipped_names: fully qualified names of parameters and buffers left
            alone, as ``named_parameters()`` / ``named_buffers()`` spell them
            (DDP's ``_ddp_params_and_buffers_to_ignore``, compat/ddp_surface.py).
    """
    skipped_params = {id(p) for m in skipped for p in m.parameters()}
    skipped_buffers = {id(b) for m in skipped for b in m.buffers()}
    named = [(n, p) for n, p in root.named_parameters() if id(p) not in skipped_params and n not in skipped_names]
    names, candidates = [n for n, _ in named], [p for _, p in named]
    buffers: list[BufferRef] = []
    buffer_ids: set[int] = set()
    for prefix, module in root.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is None or id(buffer) in skipped_buffers or id(buffer) in buffer_ids:
                continue
            buffer_ids.add(id(buffer))  # the first name wins, as in named_buffers()
            if (f"{prefix}.{name}" if prefix else name) in skipped_names:
                continue
            buffers.append((weakref.ref(module), name))
    # a deeper module comes later: the innermost wins
    group_of = {id(param): number for number, module in enumerate(inner, start=1) for param in module.parameters()}
    sparse = {id(m.weight) for m in root.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse}
    return Plan(
        candidate_names=tuple(names),
        candidates=tuple(candidates),
        trainable=[p.requires_grad for p in candidates],
        signature=tuple(_signature(p) for p in candidates),
        buffers=tuple(buffers),
        sparse=frozenset(sparse),
        groups=tuple(group_of.get(id(p), 0) for p in candidates),
    )


def ignored_names(module: nn.Module) -> frozenset[str]:
    """The names in ``module._ddp_params_and_buffers_to_ignore`` (DDP's, set by torchrec and others).

    DDP 2.13 neither averages nor broadcasts (at set-up or before a forward)
    the parameters and buffers so named; nor does ``replicate()``. (DDP's
    reducer still averages a listed parameter of the root module itself: it
    spells the name ``.scale`` where the list says ``scale``; here it is left
    alone, as listed.) Names that match no parameter or buffer draw a
    warning: DDP passes over them without a word, averaging the tensor that
    was meant to be left alone.

    Raises:
        TypeError: not a collection of ``str`` (a single ``str``, which DDP
            would silently read as its characters, included).
    """
    if (names := getattr(module, IGNORE_ATTRIBUTE, None)) is None:
        return frozenset()
    checked = check_ignored_names(names)
    known = {name for name, _ in module.named_parameters()} | {name for name, _ in module.named_buffers()}
    if unknown := sorted(checked - known):
        warnings.warn(
            f"replicate(): {IGNORE_ATTRIBUTE} names {unknown[:3]}{' and more' if len(unknown) > 3 else ''}, "
            "which match no parameter or buffer of the replicated module by the name named_parameters() / "
            "named_buffers() give it (a tied tensor goes by its first name); they are not left alone",
            UserWarning,
            stacklevel=2,
        )
    return checked


def check_ignored_names(names: object) -> frozenset[str]:
    """``names`` as DDP's ``_ddp_params_and_buffers_to_ignore`` takes it: a collection of ``str``.

    Raises:
        TypeError: a single ``str`` or anything but a collection of ``str``.
    """
    fix = "e.g. model._ddp_params_and_buffers_to_ignore = ['embedding.weight'] (fully qualified names)"
    if isinstance(names, (str, bytes)):
        raise TypeError(
            f"replicate(): {IGNORE_ATTRIBUTE} must be a collection of names, got the single string {names!r} "
            f"(DDP would read it as its characters and leave nothing alone); write a list, {fix}"
        )
    try:
        items = list(names)  # type: ignore[call-overload]  # checked: anything iterable
    except TypeError:
        raise TypeError(
            f"replicate(): {IGNORE_ATTRIBUTE} must be a collection of names, got {names!r}; {fix}"
        ) from None
    if wrong := [item for item in items if not isinstance(item, str)]:
        raise TypeError(
            f"replicate(): {IGNORE_ATTRIBUTE} must hold fully qualified names (str), got {wrong[0]!r} "
            f"({type(wrong[0]).__name__}); {fix}"
        )
    return frozenset(items)


def describe_change(old: Plan, new: Plan, most: int = 3) -> str:
    """What a re-plan changes, for the watchdog's note and errors: a few names and how each changed."""
    before = dict(zip(old.candidate_names, zip(old.trainable, old.signature, strict=True), strict=True))
    changes = []
    for name, trainable, signature in zip(new.candidate_names, new.trainable, new.signature, strict=True):
        if name not in before:
            changes.append(f"{name!r} added")
        elif before[name][0] != trainable:
            changes.append(f"{name!r} {'unfrozen' if trainable else 'frozen'}")
        elif before[name][1] != signature:
            changes.append(f"{name!r} replaced or converted")
    names = set(new.candidate_names)
    changes += [f"{name!r} removed" for name in old.candidate_names if name not in names]
    return some_names(changes, most, quote=False) if changes else "buffers changed"


def new_tensors(old: Plan, new: Plan, buffers: bool = True) -> list[torch.Tensor]:
    """Candidates (and, with ``buffers``, buffers) in ``new`` that ``old`` did not hold: what a re-plan broadcasts."""
    old_params = {id(p) for p in old.candidates}
    fresh: list[torch.Tensor] = [local(p).detach() for p in new.candidates if id(p) not in old_params]
    if not buffers:
        return fresh
    old_buffers = set(_buffer_keys(old.buffers))
    fresh += [b for k, b in zip(_buffer_keys(new.buffers), new.buffer_values(), strict=True) if k not in old_buffers]
    return fresh


class ReplansOnConversion:
    """Mixed into a replicated module's class and its view's: a conversion re-plans.

    ``nn.Module._apply`` is the one method every conversion (``.to()``,
    ``.double()``, ``.half()``, ``.cuda()``) goes through; after it the
    module's next forward re-plans ([Note: re-planning] in plan.py), on the
    model or through ``model.module`` alike.
    """

    __slots__ = ()

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        result = super()._apply(fn, recurse)  # type: ignore[misc]  # nn.Module's, further along the MRO
        if (state := find_state(self)) is not None:
            state.note_change()
        return result
