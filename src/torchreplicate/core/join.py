"""Uneven inputs: torch's ``Join`` context manager, for ranks with fewer batches.

[Note: join]
Inside ``with model.join():`` (or ``Join([model, zero_optimizer])``), a rank
that runs out of batches leaves its loop and enters Join's exit, where it
shadows the others' collectives until every rank has joined. Every
iteration of a rank still training then runs, in this order:

1. ``Join.notify_join_context`` (torch's: one all-reduce of a 1);
2. one all-reduce of this module's join round: a one-hot of the rank,
   whether this backward will sync and whether this forward broadcasts
   buffers (``JoinRound``); it tells every rank how many ranks still train,
   the highest of them (the buffers' source: rank 0 may have joined with
   stale buffers) and whether to shadow a backward;
3. the buffer broadcast, from that source, if due ([Note: buffer sync]);
4. the backward's buckets (the flags in the last), then the rounds after
   them (reducer/rounds.py: a late round when the flags ask for one, the
   sparse gradients, the tied parameters' rows).

A joined rank's ``main_hook`` runs the same collectives with zeros (its
reduction's shadow of the buckets, then each round's ``shadow``): no
gradients, no flags, no late gradients (the training clock's residues are
zero too, so desync detection ignores it). The divisor is the initial world
size (joined ranks count as zeros) or, with
``divide_by_initial_world_size=False``, the number of ranks still training.
At the end, ``post_hook`` broadcasts parameters and buffers from the last
rank to join, so every replica ends the same, re-bases every rank's training
clock to the highest (a joined rank did not step the steps it shadowed:
[Note: desync detection] in flags.py), and turns the round off.

Limits: gradient sync is read at forward under join (not at backward); a
collective in the user's forward (SyncBatchNorm, tensor parallel) cannot be
shadowed: use ``throw_on_early_termination=True`` there, as with DDP.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, JoinHook

from torchreplicate.core.buffers import broadcast_coalesced
from torchreplicate.faults.wire import all_reduce
from torchreplicate.lifecycle import TrainingState
from torchreplicate.reducer.dtensors import local
from torchreplicate.torch_internals import disable_join

if TYPE_CHECKING:
    from torchreplicate.core.state import ReplicateState


class JoinRound(NamedTuple):
    """What one join round (its all-reduce) says, the same on every rank.

    Attributes:
        num_training: ranks that have not joined.
        source: the highest of them (group rank): where buffers come from.
        sync: whether this iteration's backward averages gradients.
        buffers: whether this iteration's forward broadcasts buffers ([Note: buffer sync]).
    """

    num_training: int
    source: int
    sync: bool
    buffers: bool


def join_round(state: ReplicateState, training: bool) -> JoinRound:
    """Runs one join round: a still-training rank sends its one-hot and sync flag; a joined rank zeros."""
    group = state.group
    world_size = dist.get_world_size(group)
    vector = torch.zeros(world_size + 2, device=state.device)
    if training:
        vector[dist.get_rank(group)] = 1
        vector[world_size] = float(state.sync.on)
        vector[world_size + 1] = float(state.buffer_sync.agreed)
    flags = state.probe.watch.read_on_host(vector, all_reduce(vector, group))
    present = [r for r, v in enumerate(flags[:world_size]) if v > 0]
    return JoinRound(len(present), max(present) if present else 0, flags[world_size] > 0, flags[world_size + 1] > 0)


def start_join(state: ReplicateState, options: dict[str, Any]) -> ReplicateJoinHook:
    """torch's ``join_hook(**options)`` for a replicated module: the hook, and the divisor it asks for."""
    if state.join_refusal is not None:
        raise RuntimeError(state.join_refusal)
    if unknown := set(options) - {"divide_by_initial_world_size"}:
        raise TypeError(f"join_hook(): unexpected option(s) {sorted(unknown)}; it takes divide_by_initial_world_size")
    hook = state.join_hook = ReplicateJoinHook(state, options.get("divide_by_initial_world_size", True))
    return hook


class ReplicateJoinHook(JoinHook):
    """What a joined rank runs for a replicated module; see [Note: join].

    Args:
        state: the module's state.
        divide_by_initial_world_size: divide the sum by the initial world
            size (True, DDP's default) or by the ranks still training.
    """

    def __init__(self, state: ReplicateState, divide_by_initial_world_size: bool) -> None:
        self.state = state
        self.divide_by_initial_world_size = divide_by_initial_world_size

    def training_round(self) -> JoinRound:
        """What a rank still training runs before its forward inside a Join: steps 1 and 2 of [Note: join]."""
        state = self.state
        joinable: Any = state.module
        Join.notify_join_context(joinable)  # torch's own "not joined yet" all-reduce (first joinable)
        verdict = join_round(state, training=True)
        if state.reducer is not None and not self.divide_by_initial_world_size:
            state.reducer.set_divide_factor(float(verdict.num_training))
        return verdict

    def main_hook(self) -> None:
        """Shadows one iteration of the ranks still training."""
        state = self.state
        lifecycle = state.lifecycle
        before, lifecycle.now = lifecycle.now, TrainingState.SHADOWING
        try:
            verdict = join_round(state, training=False)
            if verdict.buffers:
                state.buffer_sync.broadcast(verdict.source)
            if verdict.sync and state.reducer is not None:
                state.reducer.shadow_step()
        finally:
            lifecycle.now = before

    def post_hook(self, is_last_joiner: bool) -> None:
        """Every rank takes the parameters, buffers and training clock of the last rank to join."""
        state = self.state
        group = state.group
        # one MAX all-reduce: the last joiner's rank, and the highest training clock
        mark = torch.tensor(
            [float(dist.get_rank(group) if is_last_joiner else -1), float(state.clock.steps)],
            dtype=torch.float64,  # exact clocks up to 2**53 steps
            device=state.device,
        )
        work = all_reduce(mark, group, op=dist.ReduceOp.MAX)
        source, steps = (int(x) for x in state.probe.watch.read_on_host(mark, work))
        tensors: list[Any] = [local(p).detach() for p in state.plan.candidates]
        if state.buffer_sync.before_forward:  # as DDP's _sync_final_model
            tensors += state.plan.buffer_values()
        if tensors:
            broadcast_coalesced(tensors, group, state.probe.watch, src_rank=source)
        state.clock.catch_up(steps)
        end_join(state)


def end_join(state: ReplicateState) -> None:
    """Every rank joined: back to no join rounds and the usual divisor."""
    state.join_hook = None
    disable_join(state.module)
    if state.reducer is not None:
        state.reducer.set_divide_factor(None)
