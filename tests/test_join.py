"""Uneven inputs with torch's Join: ranks with fewer batches shadow the others; DDP's semantics."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel

from parity import assert_group_usable, assert_replicas_identical, digest, seeded
from torchreplicate import replicate

DIM = 8


def data(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, DIM, generator=torch.Generator().manual_seed(100 * step + rank))


def _net() -> nn.Module:
    net = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, 2))
    net.register_buffer("seen", torch.zeros(1))  # changes in forward: broadcast from a rank still training
    return net


def _forward(run: nn.Module, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    model.seen += 1  # a buffer that changes on every rank that still trains
    return run(x)


def expected(counts: list[int], divide_by_initial: bool) -> list[torch.Tensor]:
    """One process, DDP's semantics: step s averages the ranks that still have a batch s."""
    reference = seeded(_net, 3)
    world_size = len(counts)
    for step in range(max(counts)):
        training = [r for r in range(world_size) if step < counts[r]]
        divisor = world_size if divide_by_initial else len(training)
        reference.zero_grad()
        (sum(reference(data(r, step)).pow(2).mean() for r in training) / divisor).backward()
        with torch.no_grad():
            for p in reference.parameters():
                p -= 0.1 * p.grad
    return [p.detach() for p in reference.parameters()]


class Joined(NamedTuple):
    digest: str  # bitwise fingerprint of the parameters: equal across ranks iff the replicas are identical
    sums: list[float]  # per parameter, for comparing two engines (different arithmetic: a tolerance)


def uneven(rank: int, world_size: int, counts: list[int], divide_by_initial: bool, engine: str) -> Joined:
    model = seeded(_net, 3 + rank)
    if engine == "ddp":
        model = seeded(_net, 3)  # DDP broadcasts too, but its buffer handling differs: start equal
        wrapped = DistributedDataParallel(model)
        context = wrapped.join(divide_by_initial_world_size=divide_by_initial)
        run = wrapped
    else:
        # the flags' route (reducer/flags.py's FlagRoute): after the last bucket (ours), in its room (ours-fixed),
        # after every wait (ours-hook: a comm hook, which divides by the world size)
        run = replicate(model, **({"bucket_layout": "fixed"} if engine == "ours-fixed" else {}))
        if engine == "ours-hook":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            model.register_comm_hook(None, default_hooks.allreduce_hook)
        context = model.join(divide_by_initial_world_size=divide_by_initial)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with context:
        for step in range(counts[rank]):
            _forward(run, model, data(rank, step)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    want = expected(counts, divide_by_initial)
    for (name, p), q in zip(model.named_parameters(), want, strict=True):
        torch.testing.assert_close(
            p.detach(), q, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} {engine} {name}: {m}"
        )
    seen = model.seen.clone()
    gathered = [torch.zeros(1) for _ in range(world_size)]
    dist.all_gather(gathered, seen)
    assert all(torch.equal(g, gathered[0]) for g in gathered), f"buffers differ after the join: {gathered}"
    return Joined(digest(model), [p.sum().item() for p in model.parameters()])


@pytest.mark.parametrize("divide_by_initial", [True, False], ids=["initial-world-size", "ranks-training"])
@pytest.mark.parametrize("counts", [[3, 5], [0, 5]], ids=["3-vs-5", "0-vs-5"])
def test_uneven_inputs_two_ranks(pools, counts, divide_by_initial):
    ours = pools.run(2, uneven, counts, divide_by_initial, "ours", timeout_s=90)
    assert ours[0].digest == ours[1].digest, f"replicas differ bitwise after the join: {ours}"


@pytest.mark.parametrize("engine", ["ours-fixed", "ours-hook"])
def test_uneven_inputs_on_every_flag_route(pools, engine):
    """A joined rank runs the one collective sequence with zeros (reducer.py's ``_collectives``) where the
    flags ride in the last bucket's room and where a comm hook's futures come first."""
    ours = pools.run(2, uneven, [3, 5], True, engine, timeout_s=90)
    assert ours[0].digest == ours[1].digest, f"{engine}: replicas differ bitwise after the join: {ours}"


def test_uneven_inputs_three_ranks(pools):
    ours = pools.run(3, uneven, [0, 3, 5], False, "ours", timeout_s=90)
    assert len({r.digest for r in ours}) == 1, f"replicas differ bitwise after the join: {ours}"


@pytest.mark.parametrize("divide_by_initial", [True, False])
def test_ddp_reaches_the_same_weights(pools, divide_by_initial):
    """The reference above is DDP's semantics: DDP's own run lands on it too."""
    ddp = pools.run(2, uneven, [3, 5], divide_by_initial, "ddp", timeout_s=90)
    ours = pools.run(2, uneven, [3, 5], divide_by_initial, "ours", timeout_s=90)
    assert ours[0].digest == ours[1].digest, f"replicas differ bitwise after the join: {ours}"
    assert ddp[0].digest == ddp[1].digest, f"DDP's replicas differ bitwise after its join: {ddp}"
    for a, b in zip(ddp[0].sums, ours[0].sums, strict=True):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(a)), (ddp[0], ours[0])


def unknown_join_option(rank: int, world_size: int) -> list[str]:
    """join_hook() with an option it does not take, directly and through torch's Join; the state untouched."""
    model = replicate(seeded(_net, 3))
    state = replicate.state(model)
    messages = []
    for call in (
        lambda: model.join_hook(foo=1),
        lambda: model.join_hook(divide_by_initial_world_size=False, foo=1),
        lambda: Join([model], foo=1),
    ):
        try:
            call()
            messages.append("no error")
        except TypeError as error:
            messages.append(str(error))
    assert state.join_hook is None and not state.joining, f"rank {rank}: a refused join_hook changed the state"
    return messages


def test_an_unknown_join_hook_option_is_refused_on_every_rank(pools):
    expected = "join_hook(): unexpected option(s) ['foo']; it takes divide_by_initial_world_size"
    for rank, messages in enumerate(pools.run(2, unknown_join_option)):
        assert messages == [expected] * 3, f"rank {rank}: {messages}"


class Terminated(NamedTuple):
    steps: int  # optimizer steps this rank completed inside the Join
    error: str  # what the Join raised on this rank


def early_termination(rank: int, world_size: int, counts: list[int]) -> Terminated:
    """``throw_on_early_termination=True``: every rank raises when the first runs out, none shadows."""
    model = replicate(seeded(_net, 3 + rank))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = 0
    error = "no error"
    try:
        with model.join(throw_on_early_termination=True):
            for step in range(counts[rank]):
                _forward(model, model, data(rank, step)).pow(2).mean().backward()
                optimizer.step()
                optimizer.zero_grad()
                steps += 1
    except RuntimeError as raised:
        error = str(raised)
    # every rank stopped after the same synchronised steps: the replicas agree, the group still works
    assert_group_usable(f"rank {rank} after the Join raised")
    assert_replicas_identical(model, f"rank {rank} after the Join raised")
    return Terminated(steps, error)


@pytest.mark.parametrize("counts", [[2, 4], [2, 4, 3]], ids=["two-ranks", "three-ranks"])
def test_throw_on_early_termination_raises_on_every_rank(pools, counts):
    results = pools.run(len(counts), early_termination, counts, timeout_s=90)
    first = min(counts)
    for rank, r in enumerate(results):
        assert r.steps == first, f"rank {rank}: {r}"
        if counts[rank] == first:  # the rank that ran out: torch's Join.__exit__
            assert r.error == f"Rank {rank} exhausted all inputs.", f"rank {rank}: {r}"
        else:  # the others, at their next forward: torch's Join.notify_join_context
            assert r.error == "Detected at least one rank that exhausted inputs. Throwing across all ranks.", (
                f"rank {rank}: {r}"
            )


def epochs(rank: int, world_size: int, counts: list[list[int]], engine: str) -> str:
    """Several Join blocks (epochs) with uneven inputs, then a plain step; the parameters' digest."""
    torch.manual_seed(3 + rank if engine == "ours" else 3)  # ours broadcasts rank 0's; DDP starts equal
    model = _net()
    run: nn.Module = replicate(model) if engine == "ours" else DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    joinable: object = model if engine == "ours" else run
    for epoch, epoch_counts in enumerate(counts):
        with joinable.join():  # type: ignore[attr-defined]
            for step in range(epoch_counts[rank]):
                _forward(run, model, data(rank, 10 * epoch + step)).pow(2).mean().backward()
                optimizer.step()
                optimizer.zero_grad()
    _forward(run, model, data(rank, 999)).pow(2).mean().backward()  # a plain step after the last Join
    optimizer.step()
    assert_replicas_identical(model, f"rank {rank} {engine} after {len(counts)} epochs")
    return digest(model)


EPOCHS = [[3, 5], [5, 2], [4, 4], [0, 3]]


def test_epochs_of_uneven_inputs_train_as_ddp_under_join_bitwise(pools):
    """Each Join's end re-bases the training clocks: no false desync, DDP's weights bit for bit."""
    ours = pools.run(2, epochs, EPOCHS, "ours", timeout_s=90)
    ddp = pools.run(2, epochs, EPOCHS, "ddp", timeout_s=90)
    assert ours == ddp, f"after {len(EPOCHS)} uneven epochs: ours {ours}, DDP {ddp}"


def desync_after_join(rank: int, world_size: int) -> str:
    """A Join with uneven inputs, then rank 1 takes an extra optimizer step: a real desync."""
    model = replicate(seeded(_net, 3 + rank))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with model.join():
        for step in range([3, 5][rank]):
            _forward(model, model, data(rank, step)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    if rank == 1:
        optimizer.step()  # no gradients: only the clock moves
    for extra in range(2):  # the flags are read a step late ([Note: flags read a step late] in flags.py)
        try:
            _forward(model, model, data(rank, 99 + extra)).pow(2).mean().backward()
        except RuntimeError as error:
            return f"backward {extra}: {error}"
    return "no error"


def test_a_real_desync_after_a_join_still_raises_on_every_rank(pools):
    messages = pools.run(2, desync_after_join, timeout_s=90)
    for rank, message in enumerate(messages):
        assert message.startswith(  # named at the end of the next backward: the second after the Join
            f"backward 1: replicate(): rank {rank}: synchronised backward 5: the ranks are at different "
            "training steps (rank 1 at step 6, rank 0 at step 5;"
        ), f"rank {rank}: {message}"
