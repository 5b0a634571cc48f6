"""The forward hooks ``replicate()`` installs on the replicated root.

Before each forward with gradients enabled: the join round (inside a Join),
the watchdog's mark, the re-plan check ([Note: re-planning] in plan.py) and
the buffer broadcast ([Note: buffer sync] in buffers.py); inputs cast
(mp_policy). After it: whether the next forward broadcasts buffers, outputs
cast, and a hook on each output that queues the reducer's end-of-backward work. They
move the module's ``TrainingState`` from ``IDLE`` to ``FORWARD`` and back (a
forward recomputed inside a backward stays ``BACKWARD``; the first forward
outside one after a backward that raised ends that step, ``abandon_step``). Both hooks run at
every forward, so they stay flat: bound methods registered directly, calling
plain functions, with no wrapper layers between.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator, Optional

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from torchreplicate.core.buffers import broadcast_buffers
from torchreplicate.core.join import training_join_round
from torchreplicate.reducer.probe import labelled
from torchreplicate.reducer.reduction import HookReduction, compiled_hook_error
from torchreplicate.reducer.switches import TrainingState
from torchreplicate.torch_internals import compiled_autograd_enabled, in_backward

if TYPE_CHECKING:
    from torchreplicate.core.state import ReplicateState
    from torchreplicate.reducer.reducer import Reducer


class ForwardHooks:
    """The forward pre-hook and post-hook of one replicated module.

    The module's hook dicts hold this object, and through it the state; the
    state holds only the handles, so no reference cycle keeps a discarded
    model's state (and its watchdog) alive.

    Args:
        state: the module's state.
    """

    __slots__ = ("state",)

    def __init__(self, state: ReplicateState) -> None:
        self.state = state

    def install(self, module: nn.Module) -> list[RemovableHandle]:
        """Registers both hooks on ``module`` (the pre-hook first of all); returns their handles."""
        return [
            module.register_forward_pre_hook(self.pre_forward, prepend=True, with_kwargs=True),
            module.register_forward_hook(self.post_forward),
        ]

    @torch.compiler.disable  # eager under torch.compile, as FSDP2's hooks: collectives, Python state
    @labelled("pre_forward")
    def pre_forward(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> Optional[tuple[Any, Any]]:
        """Runs before every forward of the root; returns cast inputs, or None to keep them."""
        state = self.state
        sync_before_forward(state)
        if state.mixed is None or state.nested:
            return None
        cast = state.mixed.cast_inputs_of((args, kwargs))
        return None if cast is None else (cast[0], cast[1])

    @torch.compiler.disable  # the outputs get real (eager) hooks
    @labelled("post_forward")
    def post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        """Runs after every forward of the root; returns the (cast) output."""
        state = self.state
        lifecycle = state.lifecycle
        if lifecycle.now is TrainingState.FORWARD:
            lifecycle.now = TrainingState.IDLE
        elif lifecycle.now is TrainingState.NESTED:
            return output  # nested replicate: the enclosing module does this work
        if torch.is_grad_enabled():
            state.buffer_sync.note_forward(state.sync.on)
        if state.mixed is not None:
            output = state.mixed.cast_output(output)
        reducer = state.reducer
        if reducer is None or not torch.is_grad_enabled():
            return output
        for tensor in _tensors_in(output):
            if tensor.requires_grad:
                tensor.register_hook(_OutputGradHook(reducer))
        return output


def sync_before_forward(state: ReplicateState) -> None:
    """What every rank does together before a forward with gradients enabled.

    The join round, the watchdog's mark, the re-plan check and the buffer
    broadcast; nothing at all without gradients (or in a nested module).
    """
    if not torch.is_grad_enabled() or state.nested:
        return  # no collective: one rank may evaluate alone ([Note: re-planning])
    if isinstance(state.reduction, HookReduction) and compiled_autograd_enabled():
        raise compiled_hook_error()  # every rank, before any collective ([Note: compiled autograd])
    buffers = state.buffer_sync.wanted  # [Note: buffer sync] in buffers.py
    buffer_source = 0
    if state.joining:  # inside a Join context ([Note: join] in join.py)
        buffer_source = training_join_round(state).source
    if state.lifecycle.now is TrainingState.BACKWARD and not in_backward() and state.reducer is not None:
        state.reducer.abandon_step()  # the last backward raised before its end ran: on every rank
    state.num_forwards += 1
    state.probe.at("forward", 0 if state.reducer is None else state.reducer.num_steps)
    plan = state.plan
    if state.stamp() != state.planned_stamp or [p.requires_grad for p in plan.candidates] != plan.trainable:
        state.replan_if_changed()
    if buffers:
        broadcast_buffers(state, buffer_source)
    now = state.lifecycle.now
    if now is TrainingState.IDLE or now is TrainingState.FORWARD:  # not a forward recomputed in a backward
        state.lifecycle.now = TrainingState.FORWARD
        state.tied.begin(state.reducer, state.sync.on)


def without_hooks(attributes: dict[str, Any], handles: list[RemovableHandle]) -> dict[str, Any]:
    """A shallow copy of a module's ``__dict__`` whose hook dicts lack the hooks of ``handles``."""
    drop: dict[int, set[Any]] = {}  # id(hook dict) -> our keys in it
    for handle in handles:
        for ref in (handle.hooks_dict_ref, *handle.extra_dict_ref):
            hooks = ref()
            if hooks is not None:
                drop.setdefault(id(hooks), set()).add(handle.id)
    copied = dict(attributes)
    for name, value in attributes.items():
        if isinstance(value, dict) and id(value) in drop:
            kept = type(value)()
            kept.update((k, v) for k, v in value.items() if k not in drop[id(value)])
            copied[name] = kept
    return copied


class _OutputGradHook:
    # Queues the reducer's end-of-backward work from the outermost backward
    # pass ([Note: end of backward] in reducer/step.py).
    __slots__ = ("reducer",)

    def __init__(self, reducer: Reducer) -> None:
        self.reducer = reducer

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():  # traced by compiled autograd: no callback ([Note: compiled autograd])
            self.reducer.queue_finalize()
        return grad  # not None: traced under compiled autograd, the return value is the gradient


def _tensors_in(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors_in(item)
