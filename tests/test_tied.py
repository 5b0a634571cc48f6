"""Tied parameters: the detached first use is reduced by rows, the rest in its bucket, early.

[Note: tied parameters] in reducer/tied_rows.py: an opt-in (``tied_split=True``, or a tuned layout
that finds it pays); at default options a tied parameter is reduced whole, in its bucket, as DDP's
(tests/test_ddp_bits.py). Every check is against a
single process on the global batch (or DDP), never against the replica itself.
"""

from __future__ import annotations

import contextlib
import copy
import pickle
from typing import Callable, Optional

import pytest
import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import nn

from parity import assert_grads_match, assert_replicas_identical, same_on_every_rank, seeded, sgd_step
from torchreplicate import replicate
from torchreplicate.observe import timeline

VOCAB, DIM, TOKENS = 64, 8, 6


class TinyGPT(nn.Module):
    """Token embedding tied to the output projection, as GPT-2; optional paths to leave a use out."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, DIM)
        self.mix = nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, tokens: torch.Tensor, use: str = "both") -> torch.Tensor:
        if use == "head":  # no lookup: a fixed input straight to the head
            return self.head(self.norm(self.mix(torch.ones(tokens.shape[0], tokens.shape[1], DIM))))
        h = self.norm(torch.tanh(self.mix(self.wte(tokens))))
        if use == "lookup":  # no head: a loss on the hidden states only
            return h.sum(-1, keepdim=True).expand(*h.shape[:2], VOCAB)
        return self.head(h)


def tokens_of(rank: int, step: int, rows: int = 2, low: int = 0, high: int = VOCAB) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(low, high, (rows, TOKENS), generator=g)


def loss_of(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())


def rows_range(rank: int) -> tuple[int, int]:
    # disjoint token ranges per rank: the union of touched rows differs from each rank's own
    return (16 * rank, 16 * rank + 16)


def own_rows_tokens(rank: int, step: int) -> torch.Tensor:
    """Rank ``rank``'s tokens at ``step``, from its own range of rows (``rows_range``)."""
    low, high = rows_range(rank)
    return tokens_of(rank, step, low=low, high=high)


def global_loss(step: int, world_size: int, call: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """One process's loss on the global batch: the mean over ranks of ``loss_of(call(rank, tokens), tokens)``."""
    total = sum(loss_of(call(r, t), t) for r in range(world_size) for t in [own_rows_tokens(r, step)])
    return total / world_size


def train_tied(rank: int, world_size: int, uses: Optional[list[list[str]]] = None, hook_late: bool = False) -> None:
    """Every step's gradients equal one process on the global batch; the tied bucket leaves early."""
    model = seeded(TinyGPT, 7 + rank)
    reference = seeded(TinyGPT, 7)
    # the table (2 KiB) in a bucket of its own; the split is an opt-in (DDP reduces the table whole)
    replicate(model, bucket_cap_mb=0.001, first_bucket_cap_mb=0.001, tied_split=True)
    state = replicate.state(model)
    assert state.reducer is not None
    assert [slot.name for slot in state.reducer.tied_rows.slots] == ["wte.weight"], "the tied table is split"
    records: list = []
    timeline.subscribe(model, records.append)
    for step in range(4):
        use = "both" if uses is None else uses[step][rank]
        tokens = own_rows_tokens(rank, step)
        loss_of(model(tokens, use), tokens).backward()
        step_uses = ["both"] * world_size if uses is None else uses[step]
        global_loss(step, world_size, lambda r, t: reference(t, step_uses[r])).backward()
        assert_grads_match(model, reference, f"rank {rank} step {step}")
        sgd_step(model, reference, lr=0.1, skip_none=True)
    assert_replicas_identical(model, "after 4 steps")
    if uses is None:
        # from the second step on, the table's bucket is launched from a hook, during backward
        slot = state.reducer.tied_rows.slots[0]
        index = slot.bucket.index
        assert len(state.reducer.buckets) > 1
        assert all(record.buckets[index].from_hook for record in records[1:]), (
            f"rank {rank}: the tied table's bucket {index} left only at the end of backward: "
            f"{[[b.from_hook for b in r.buckets] for r in records]}"
        )


@pytest.mark.parametrize("world_size", [2, 3])
def test_tied_matches_reference_and_leaves_early(pools, world_size):
    pools.run(world_size, train_tied)


def test_tied_one_use_left_out(pools):
    # step 0: both uses; 1: rank 0 without the head, rank 1 without the lookup;
    # 2: no rank looks up (the rows round sends nothing); 3: no rank uses the head
    uses = [["both", "both"], ["lookup", "head"], ["head", "head"], ["lookup", "lookup"]]
    pools.run(2, train_tied, uses=uses)


class ScaledGPT(TinyGPT):
    """TinyGPT times a scalar input: reentrant checkpointing needs an input that requires grad."""

    def forward(self, tokens: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(tokens) * scale


def checkpointed_root(rank: int, world_size: int, reentrant: bool) -> None:
    """The whole root under activation checkpointing: its forward runs again inside the backward,
    where the tied uses must not be detached a second time; every step equals the reference."""
    model = seeded(ScaledGPT, 7 + rank)
    reference = seeded(ScaledGPT, 7)
    replicate(model, bucket_cap_mb=0.001, first_bucket_cap_mb=0.001, tied_split=True)
    reducer = replicate.state(model).reducer
    assert reducer is not None and [slot.name for slot in reducer.tied_rows.slots] == ["wte.weight"]
    scale = torch.ones((), requires_grad=True)
    for step in range(3):
        tokens = own_rows_tokens(rank, step)
        logits = torch.utils.checkpoint.checkpoint(model, tokens, scale, use_reentrant=reentrant)
        loss_of(logits, tokens).backward()
        global_loss(step, world_size, lambda r, t: reference(t, scale)).backward()
        assert_grads_match(model, reference, f"rank {rank} step {step}")
        sgd_step(model, reference, lr=0.1, skip_none=True)
    assert_replicas_identical(model, "after 3 checkpointed steps")


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_tied_whole_root_checkpointed(pools, reentrant):
    pools.run(2, checkpointed_root, reentrant)


def accumulate_tied(rank: int, world_size: int) -> None:
    """no_sync micro-batches, and a forward with sync on whose backward runs with it off."""
    model = seeded(TinyGPT, 3 + rank)
    reference = seeded(TinyGPT, 3)
    replicate(model, tied_split=True)
    for step in range(3):
        for k in range(2):
            with model.no_sync():
                t = tokens_of(rank, 10 * step + k)
                loss_of(model(t), t).backward()
        t = tokens_of(rank, 10 * step + 2)
        loss_of(model(t), t).backward()
        total = sum(
            loss_of(reference(t), t) for r in range(world_size) for k in range(3) for t in [tokens_of(r, 10 * step + k)]
        )
        (total / world_size).backward()
        assert_grads_match(model, reference, f"rank {rank} step {step}")
        sgd_step(model, reference, lr=0.1)
    # sync read at backward: the forward ran with it on (the lookup detached), the backward with it off
    local_ref = copy.deepcopy(reference)
    t = tokens_of(rank, 99)
    loss = loss_of(model(t), t)
    model.set_requires_gradient_sync(False)
    loss.backward()
    loss_of(local_ref(t), t).backward()
    torch.testing.assert_close(model.wte.weight.grad, local_ref.wte.weight.grad, rtol=1e-5, atol=1e-6)
    assert not same_on_every_rank(model.wte.weight.grad), "a backward with sync off averaged the tied table"
    model.set_requires_gradient_sync(True)
    model.zero_grad()
    local_ref.zero_grad()
    t = tokens_of(rank, 100)
    loss_of(model(t), t).backward()  # nothing of the unsynchronised backward may be added here
    reference.zero_grad()
    (sum(loss_of(reference(t), t) for r in range(world_size) for t in [tokens_of(r, 100)]) / world_size).backward()
    assert_grads_match(model, reference, f"rank {rank} after a backward with sync off")


def test_tied_accumulation_and_sync_off(pools):
    pools.run(2, accumulate_tied)


def against_ddp(rank: int, world_size: int, comm_hook: bool, uneven: bool) -> None:
    """Equal to DDP (to rounding) with a comm hook (not split) and under Join with uneven inputs."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = seeded(TinyGPT, 5)
    ddp = DDP(seeded(TinyGPT, 5))
    replicate(model, tied_split=True)
    if comm_hook:
        model.register_comm_hook(dist.group.WORLD, default_hooks.allreduce_hook)
        ddp.register_comm_hook(dist.group.WORLD, default_hooks.allreduce_hook)
        assert not replicate.state(model).reducer.tied_rows.slots, "a comm hook sees the whole gradient"
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    steps = 3 + (2 * rank if uneven else 0)
    with Join([model, ddp]) if uneven else contextlib.nullcontext():
        for step in range(steps):
            t = tokens_of(rank, step)
            loss_of(model(t), t).backward()
            loss_of(ddp(t), t).backward()
            opt.step()
            ddp_opt.step()
            opt.zero_grad()
            ddp_opt.zero_grad()
    for (name, p), q in zip(model.named_parameters(), ddp.module.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} {name}: {m}")
    assert_replicas_identical(model, "against DDP")


@pytest.mark.parametrize("comm_hook,uneven", [(True, False), (False, True)])
def test_tied_against_ddp(pools, comm_hook, uneven):
    pools.run(2, against_ddp, comm_hook=comm_hook, uneven=uneven)


def copies(rank: int, world_size: int) -> None:
    model = seeded(TinyGPT, 1)
    replicate(model, tied_split=True)
    clone = copy.deepcopy(model)
    pickle.loads(pickle.dumps(model))
    t = tokens_of(rank, 0)
    loss_of(clone(t), t).backward()  # the copy's hooks are inert: a plain local backward
    assert clone.wte.weight.grad is not None and not same_on_every_rank(clone.wte.weight.grad)


def test_tied_model_copies(pools):
    pools.run(2, copies)


def profiled(rank: int, world_size: int) -> None:
    model = seeded(TinyGPT, 2)
    replicate(model, tied_split=True)
    t = tokens_of(rank, 0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        loss_of(model(t), t).backward()
    names = {event.name for event in prof.events()}
    assert "torchreplicate::tied_rows" in names, sorted(n for n in names if n.startswith("torchreplicate"))


def test_tied_rows_round_under_the_profiler(pools):
    pools.run(2, profiled)


class WideTiedLM(nn.Module):
    """A 1 MiB tied table and four 256 KiB layers: a layout the cap changes, so the link is measured."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(4096, 64)
        self.up = nn.Linear(64, 256)
        self.layers = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
        self.down = nn.Linear(256, 64)
        self.head = nn.Linear(64, 4096, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.down(torch.tanh(self.layers(self.up(self.wte(tokens))))))


def scheduled_tied(rank: int, world_size: int, split_kept: bool) -> tuple[Optional[list[int]], int]:
    """A slow link measured: the schedule's buckets, the split dropped (or kept), every step exact."""
    from torchreplicate.reducer.layout import policy
    from torchreplicate.reducer.layout.link import LinkModel

    saved = (policy.measure_link, policy.split_pays)
    policy.measure_link = lambda *args: LinkModel(
        latency_s=0.0005, bytes_per_s=12.5e6
    )  # 100 Mbit: the link is the step
    if split_kept:
        policy.split_pays = lambda *args: True
    try:
        model = replicate(seeded(WideTiedLM, 11 + rank), bucket_layout="tuned")
        reference = seeded(WideTiedLM, 11)
        reducer = replicate.state(model).reducer
        for step in range(4):
            tokens = [
                torch.randint(0, 4096, (2, TOKENS), generator=torch.Generator().manual_seed(50 * step + r))
                for r in range(world_size)
            ]
            loss_of(model(tokens[rank]), tokens[rank]).backward()
            (sum(loss_of(reference(t), t) for t in tokens) / world_size).backward()
            assert_grads_match(model, reference, f"rank {rank} step {step}")
            sgd_step(model, reference, lr=0.1)
            assert_replicas_identical(model, f"after step {step}")
        assert reducer is replicate.state(model).reducer
        assert bool(reducer.tied_rows.slots) is split_kept, (
            "the split dropped where it does not pay, kept where it does"
        )
        return reducer.layout_policy.lengths, len(reducer.buckets)
    finally:
        policy.measure_link, policy.split_pays = saved


@pytest.mark.parametrize("split_kept", [False, True])
def test_tied_under_the_schedule_matches_reference(pools, split_kept):
    results = pools.run(2, scheduled_tied, split_kept=split_kept)
    assert results[0] == results[1], f"ranks chose different layouts: {results}"
    lengths, num_buckets = results[0]
    assert lengths is not None and len(lengths) == num_buckets, "the schedule chose the buckets"
