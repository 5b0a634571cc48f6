"""Graphs that differ by rank or by step, with no flag: parity every step.

Each case is a model and ``loss_of(model, rank, world_size, step)``, what one
rank computes in one step. The reference is one process that computes the
mean over ranks of ``loss_of(reference, r, ...)`` and backwards once: exactly
the gradient replicate() must produce on every rank.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, NamedTuple, Optional

import pytest
import torch
import torch.utils.checkpoint as cp
from torch import nn

from models import DIM, Branches, data
from models import TINY_DIM_BUCKETS as TINY
from parity import assert_grads_match, assert_replicas_identical, seeded
from torchreplicate import replicate


def rank_branch(model, rank, world_size, step):
    return model(data(rank, step), branch="a" if rank == 0 else "b").pow(2).mean()


def alternating_head(model, rank, world_size, step):
    out = model(data(rank, step))
    loss = out.pow(2).mean()
    if step % 2 == 0:
        loss = loss + model.aux_head(out).mean()
    return loss


def moe(model, rank, world_size, step):
    # expert 3 is never chosen; which of 0-2 a rank uses changes every step
    return model(data(rank, step), expert=(rank + step) % 3).pow(2).mean()


def unused_on_one_rank_only(model, rank, world_size, step):
    out = model(data(rank, step))
    if rank != world_size - 1:
        out = model.aux_head(out)
    return out.pow(2).mean()


def two_forwards(model, rank, world_size, step):
    first = model(data(rank, step), branch="a")
    second = model(data(rank, step + 100), branch="b")
    return first.pow(2).mean() + second.abs().mean()


def other_method(model, rank, world_size, step):
    return model.encode(data(rank, step)).pow(2).mean()


class Reused(nn.Module):
    """One layer applied several times, inside and outside checkpoints."""

    def __init__(self, reentrant: Optional[bool]) -> None:
        super().__init__()
        self.reentrant = reentrant  # None: no checkpointing
        self.inp = nn.Linear(DIM, DIM)
        self.shared = nn.Linear(DIM, DIM)
        self.block = nn.Linear(DIM, DIM)
        self.out = nn.Linear(DIM, 2)

    def segment(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.block(torch.tanh(self.shared(h))))

    def forward(self, x: torch.Tensor, uses: int = 2) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for _ in range(uses):
            if self.reentrant is None:
                h = self.segment(h)
            else:
                h = cp.checkpoint(self.segment, h, use_reentrant=self.reentrant)
        return self.out(self.shared(h))


def other_method_checkpointed(model, rank, world_size, step):
    # no forward hook runs, and the first gradient hook fires inside a nested
    # (reentrant) backward: see [Note: end of backward] in core/state.py
    x = data(rank, step).requires_grad_()
    h = torch.tanh(model.inp(x))

    def head(t):
        return model.out(model.shared(model.segment(t)))

    return cp.checkpoint(head, h, use_reentrant=True).pow(2).mean()


def reused_static(model, rank, world_size, step):
    x = data(rank, step).requires_grad_(model.reentrant is True)  # reentrant needs an input that requires grad
    return model(x).pow(2).mean()


def reused_growing(model, rank, world_size, step):
    # 1, 2, 3, 1, 2, 3 uses: the shared layer's gradient arrives more often than learned
    x = data(rank, step).requires_grad_(model.reentrant is True)
    return model(x, uses=1 + step % 3).pow(2).mean()


def reused_rank_dependent(model, rank, world_size, step):
    x = data(rank, step).requires_grad_(model.reentrant is True)
    return model(x, uses=1 + (rank + step) % 2).pow(2).mean()


class GraphCase(NamedTuple):
    build: Callable[[], nn.Module]
    loss_of: Callable[..., torch.Tensor]  # (model, rank, world_size, step) -> this rank's loss
    grows: bool = False  # a gradient arrives more often than in the first step: needs graph="dynamic"


CASES = {
    "rank_branch": GraphCase(Branches, rank_branch),
    "alternating_head": GraphCase(Branches, alternating_head),
    "moe": GraphCase(Branches, moe),
    "unused_on_one_rank": GraphCase(Branches, unused_on_one_rank_only),
    "two_forwards": GraphCase(Branches, two_forwards),
    "other_method": GraphCase(Branches, other_method),
    "called_twice": GraphCase(lambda: Reused(None), reused_static),
    "checkpoint_reentrant": GraphCase(lambda: Reused(True), reused_static),
    "checkpoint_non_reentrant": GraphCase(lambda: Reused(False), reused_static),
    "checkpoint_reentrant_growing": GraphCase(lambda: Reused(True), reused_growing, grows=True),
    "checkpoint_non_reentrant_growing": GraphCase(lambda: Reused(False), reused_growing),
    "checkpoint_reentrant_by_rank": GraphCase(lambda: Reused(True), reused_rank_dependent, grows=True),
    "other_method_checkpointed": GraphCase(lambda: Reused(True), other_method_checkpointed),
}


def train_case(
    rank: int, world_size: int, case: str, *, steps: int = 6, options: Optional[dict[str, Any]] = None
) -> list[list[str]]:
    """Trains ``case`` replicated and as the reference; checks grads every step.

    Returns, by step, the parameters whose ``.grad`` was None after backward.
    """
    build, loss_of, grows = CASES[case]
    model = seeded(build, 7 + rank)
    reference = seeded(build, 7)
    replicate(model, **({"graph": "dynamic"} if grows else {}), **(options or {}))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.5)
    none_grads = []
    for step in range(steps):
        loss_of(model, rank, world_size, step).backward()
        total = sum(loss_of(reference, r, world_size, step) for r in range(world_size)) / world_size
        total.backward()
        assert_grads_match(model, reference, f"{case}: rank {rank} step {step}")
        none_grads.append(sorted(n for n, p in model.named_parameters() if p.grad is None))
        optimizer.step()
        ref_optimizer.step()
        optimizer.zero_grad()
        ref_optimizer.zero_grad()
    assert_replicas_identical(model, f"{case}: after {steps} steps")
    return none_grads


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("world_size", [2, 3])
def test_case_matches_reference(pools, case, world_size):
    pools.run(world_size, train_case, case)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("as_view", [True, False])
def test_case_with_tiny_buckets(pools, case, as_view):
    pools.run(2, train_case, case, options=dict(TINY, gradient_as_bucket_view=as_view))


def grown_after_learning(rank: int, world_size: int) -> list[str]:
    """The reentrant case whose shared layer is used once, then twice, at the default graph="learned"."""
    model = replicate(seeded(lambda: Reused(True), 7 + rank), **TINY)
    reference = seeded(lambda: Reused(True), 7)
    seen = []
    for step in range(3):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                reused_growing(model, rank, world_size, step).backward()
            except RuntimeError as error:
                return [*seen, f"step {step} raised: {error}"]
        seen += [f"step {step} warned: {w.message}" for w in caught if "arrived after its bucket" in str(w.message)]
        total = sum(reused_growing(reference, r, world_size, step) for r in range(world_size)) / world_size
        total.backward()
        if step == 0:  # the learning step: exact
            assert_grads_match(model, reference, f"rank {rank} step 0")
        model.zero_grad()
        reference.zero_grad()
    return seen


def test_a_gradient_beyond_the_learned_count_raises_on_every_rank_a_step_late(pools):
    # graph="learned" reads the flags a step late ([Note: flags read a step late] in
    # flags.py): step 1's late gradient is not reduced; the rank that had it warns at
    # once, and every rank raises at the end of step 2, naming step 1 and the fix.
    for rank, seen in enumerate(pools.run(2, grown_after_learning)):
        assert len(seen) == 2, seen
        assert seen[0].startswith("step 1 warned: replicate(): synchronised backward 1: the gradient of '"), seen
        assert "'shared.weight'" in seen[0], seen[0]
        assert seen[1].startswith(f"step 2 raised: replicate(): rank {rank}: synchronised backward 1: on 2 rank(s)")
        assert "here: '" in seen[1] and "'shared.weight'" in seen[1] and 'graph="dynamic"' in seen[1], seen[1]


def test_never_used_parameter_keeps_none(pools):
    none_grads = pools.run(2, train_case, "moe")[0]
    for per_step in none_grads:
        assert "never.weight" in per_step and "experts.3.weight" in per_step
        assert "trunk.weight" not in per_step


def test_head_used_every_other_step(pools):
    none_grads = pools.run(2, train_case, "alternating_head")[0]
    assert all("aux_head.weight" not in s for s in none_grads[0::2])
    assert all("aux_head.weight" in s for s in none_grads[1::2])


# -- steps that reach no parameter ----------------------------------------------------


def odd_steps(rank, world_size):
    """Forward without backward, outputs not used, backwards that reach no parameter."""
    model = seeded(Branches, 3 + rank)
    reference = seeded(Branches, 3)
    replicate(model)
    # 1. a forward with grad enabled whose result is dropped
    model(data(rank, 0))
    # 2. a backward that reaches no replicated parameter, on every rank
    x = data(rank, 1).requires_grad_()
    (x * 2).sum().backward()
    grads = [name for name, p in model.named_parameters() if p.grad is not None]
    assert not grads, f"rank {rank}: a backward that reached no parameter gave grads to {grads}"
    # 3. a forward whose output needs grad only through its input: every
    #    parameter is unused everywhere, so every .grad stays None
    frozen = {name: p.requires_grad for name, p in model.named_parameters()}
    out = model.trunk(x).detach().requires_grad_() * 3
    out.sum().backward()
    grads = [name for name, p in model.named_parameters() if p.grad is not None]
    assert not grads, f"rank {rank}: grads appeared for {grads}"
    changed = [name for name, p in model.named_parameters() if p.requires_grad != frozen[name]]
    assert not changed, f"rank {rank}: the backward changed requires_grad of {changed}"
    # 4. then a normal step still matches the reference
    model(data(rank, 2)).pow(2).mean().backward()
    (sum(reference(data(r, 2)).pow(2).mean() for r in range(world_size)) / world_size).backward()
    assert_grads_match(model, reference, f"rank {rank} after odd steps")


@pytest.mark.parametrize("world_size", [2, 3])
def test_odd_steps_do_not_break_the_next(pools, world_size):
    pools.run(world_size, odd_steps)
