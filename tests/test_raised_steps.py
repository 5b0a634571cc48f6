"""A step that raised on some ranks leaves every rank's collective sequence paired ([Note: a backward that raised]).

A forward that raises on one rank only (a bad sample, out of memory on the longest sequence), caught by
the rank's loop, which skips the batch or retries it while the others go on to backward; an error
inside the end of backward on one rank (here the first step's rebuild of the buckets): the raising rank
runs the rest of the step's collectives with zeros and says so in the flags, so every rank raises at
the same step, naming the rank and what it raised, and no collective is left unpaired. Each job then
takes every rank back to a checkpoint and trains on: its final weights equal, bit for bit, those of
the same job in which nothing raised. Raised on every rank and skipped on every rank: the weights of
a job that skipped that batch. 3 ranks, BatchNorm (a buffer broadcast is due at every forward).
"""

from __future__ import annotations

import copy
import hashlib
import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from local_ranks import launch


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh())
        self.head = nn.Linear(32, 4)
        self.fail = False  # the next forward raises

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        if self.fail:
            self.fail = False
            raise ValueError("a bad sample in this batch")
        return self.head(h)


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(6, 8, generator=torch.Generator().manual_seed(100 * step + rank)) + rank


def digest(tensors: Any) -> str:
    h = hashlib.sha256()
    for tensor in tensors:
        h.update(tensor.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


ROUTES = {  # where the flags travel (reducer/flags.py's FlagRoute), and the options that choose it
    "after_last": {},  # DDP's layout: their own collective after the last bucket
    "carried": {"bucket_layout": "fixed"},  # in the last bucket's room
    "after_waits": {},  # a comm hook: their own collective after every wait (the hook registered below)
}


def job(scenario: str, route: str = "after_last") -> dict[str, Any]:
    """Trains (the scenario's failure included), goes back to the checkpoint, trains 2 steps; what it saw."""
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    from torchreplicate import replicate
    from torchreplicate.reducer.reducer import Reducer

    rank = dist.get_rank()
    torch.manual_seed(0)
    raw = Net()
    model = replicate(raw, stall_timeout=5, **ROUTES[route])
    if route == "after_waits":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        model.register_comm_hook(None, default_hooks.allreduce_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if scenario == "rebuild" and rank == 1:  # the first step's rebuild raises once, on rank 1
        rebuild = Reducer._rebuild_buckets

        def failing(self: Reducer) -> None:
            Reducer._rebuild_buckets = rebuild  # type: ignore[method-assign]
            raise RuntimeError("injected: the new buckets could not be allocated")

        Reducer._rebuild_buckets = failing  # type: ignore[method-assign]
    raised: list[tuple[int, str, str]] = []  # (loop step, where, message)
    checkpoint: Any = None

    def train(step: int, data_step: int) -> None:
        loss = model(batch(rank, data_step)).pow(2).mean()
        try:
            loss.backward()
        except RuntimeError as error:
            raised.append((step, "backward", str(error)))
            if str(error).startswith("replicate()"):
                return  # every rank raised alike: the step's average is incomplete, go back to the checkpoint
        optimizer.step()
        optimizer.zero_grad()

    step = data_step = 0
    while step < 6 and not any(where == "backward" and text.startswith("replicate()") for _, where, text in raised):
        if step == 1:
            checkpoint = copy.deepcopy((raw.state_dict(), optimizer.state_dict()))
        failing_here = step == 2 and (scenario in ("forward", "retry") and rank == 1 or scenario == "everywhere")
        if failing_here:
            raw.fail = True
            try:
                model(batch(rank, data_step))
            except ValueError as error:
                raised.append((step, "forward", str(error)))
            if scenario == "retry":
                train(step, data_step)  # the same batch again
            data_step += 1
            step += 1
            continue
        if scenario == "skipped" and step == 2:
            data_step += 1
            step += 1
            continue
        train(step, data_step)
        data_step += 1
        step += 1
    if scenario in ("forward", "retry", "rebuild", "clean"):  # back to the checkpoint, then 2 more steps
        raw.load_state_dict(checkpoint[0])
        optimizer.load_state_dict(checkpoint[1])
        optimizer.zero_grad()
        for k in range(2):
            train(10 + k, 50 + k)
    dist.barrier()
    dist.destroy_process_group()
    weights = digest(raw.parameters())
    return {
        "raised": [(s, w, t) for s, w, t in raised],
        "digest": digest([*raw.parameters(), *raw.buffers()]),
        "weights": weights,
    }


def run(scenario: str, route: str = "after_last") -> list[dict[str, Any]]:
    return launch(job, nprocs=3, args=(scenario, route), timeout_s=90, threads_per_rank=1)


@pytest.mark.parametrize("scenario", ["forward", "retry", "rebuild"])
def test_a_step_raised_on_one_rank_raises_on_every_rank_and_leaves_the_group_usable(scenario):
    check_raised_on_one_rank(scenario, run(scenario), run("clean"))


@pytest.mark.parametrize("route", ["carried", "after_waits"])
def test_the_raising_rank_pairs_the_sequence_on_every_flag_route(route):
    """The one collective sequence with zeros (reducer.py's ``_collectives``) where the flags ride in the last
    bucket's room (the fixed layout) and where a comm hook's futures come first (the flags after every wait)."""
    check_raised_on_one_rank("forward", run("forward", route), run("clean", route))


def check_raised_on_one_rank(scenario: str, done: list[dict[str, Any]], clean: list[dict[str, Any]]) -> None:
    agreed = [[(s, t) for s, w, t in r["raised"] if w == "backward" and t.startswith("replicate()")] for r in done]
    for rank, errors in enumerate(agreed):
        assert len(errors) == 1, f"{scenario}: rank {rank} raised {errors} at the flags' read (one expected)"
        text = errors[0][1]
        assert "raised on rank 1" in text, f"{scenario}: rank {rank}: {text}"
        expected = "injected: the new buckets" if scenario == "rebuild" else "ValueError: a bad sample"
        assert expected in text, f"{scenario}: rank {rank}: the message does not say what rank 1 raised: {text}"
    steps = {re.search(r"synchronised step (\d+)", errors[0][1]).group(1) for errors in agreed}  # type: ignore[union-attr]
    assert len(steps) == 1, f"{scenario}: the ranks name different steps: {agreed}"
    for rank in range(3):
        assert done[rank]["digest"] == clean[rank]["digest"], (
            f"{scenario}: rank {rank}: after the checkpoint, not the weights of the job in which nothing raised"
        )


def test_raised_on_every_rank_and_skipped_is_the_job_that_skipped_the_batch():
    done, skipped = run("everywhere"), run("skipped")
    for rank in range(3):
        assert [w for _, w, _ in done[rank]["raised"]] == ["forward"], done[rank]["raised"]
        # the weights (the raised forward updated BatchNorm's statistics before it raised: not the buffers)
        assert done[rank]["weights"] == skipped[rank]["weights"], f"rank {rank}: not the weights of the skipped job"
    assert len({r["weights"] for r in done}) == 1, "the replicas differ"
