"""Faults and desync: a clear error on every rank, naming who and where, in bounded time."""

from __future__ import annotations

import datetime
import os
import queue
import re
import time
import warnings
from typing import Any, Callable, NamedTuple, Optional

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from harness import PG_TIMEOUT_S
from local_ranks import start_ranks, stop_ranks
from models import DIM, data
from parity import seeded
from torchreplicate import replicate
from torchreplicate.errors import DesyncReport, format_desync
from torchreplicate.faults.watchdog import StallWarning


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, 2))


# -- desync: a rank that ran an extra backward, or skipped one -------------------------


def desynced(rank: int, world_size: int, fault: str) -> str:
    """Trains with SGD; at step 3 rank 1 runs an extra micro-step, or skips its backward."""
    model = replicate(seeded(_net, 0))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        for step in range(8):
            backwards = 1
            if rank == 1 and step == 3:
                backwards = 2 if fault == "extra" else 0
            for micro in range(backwards):
                model(data(rank, 10 * step + micro)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    except RuntimeError as error:
        return f"step {step}: {error}"
    return "no error"


@pytest.mark.parametrize("fault", ["extra", "skipped"])
def test_desync_raises_on_every_rank_naming_the_ranks(pools, fault):
    messages = pools.run(2, desynced, fault, timeout_s=60)
    for rank, message in enumerate(messages):
        assert f"replicate(): rank {rank}: synchronised backward" in message, message
        assert "the ranks are at different training steps" in message, message
        assert "a rank ran an extra backward or skipped one" in message, message
        # the step after the fault: one rank is one optimizer step ahead
        assert "rank 0 at step 4" in message or "rank 0 at step 3" in message, message
    backward = [m.split("synchronised backward ")[1].split(":")[0] for m in messages]
    assert backward[0] == backward[1], f"the ranks raised at different collectives: {backward}"


def healthy_with_two_optimizers(rank: int, world_size: int) -> int:
    """Gradient accumulation, an optimizer over other parameters, a no-grad evaluation on one rank."""
    model = replicate(seeded(_net, 0))
    other = nn.Linear(DIM, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    other_optimizer = torch.optim.SGD(other.parameters(), lr=0.1)
    for step in range(6):
        with model.no_sync():
            model(data(rank, step)).pow(2).mean().backward()
        model(data(rank, step + 50)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:  # a probe trained on rank 0 alone: not this module's clock
            other(data(0, step)).sum().backward()
            other_optimizer.step()
            with torch.no_grad():
                model(data(0, 99))
    return replicate.state(model).clock.steps


def test_healthy_runs_never_report_a_desync(pools):
    assert pools.run(2, healthy_with_two_optimizers) == [6, 6]


def test_desync_message_names_each_group_of_ranks():
    reports = [DesyncReport(0, 6, 1), DesyncReport(1, 7, 1), DesyncReport(2, 6, 1)]
    message = format_desync(reports, 2, 6, clocks_agree=False)
    assert message.startswith("replicate(): rank 2: synchronised backward 6: the ranks are at different training steps")
    assert "(rank 1 at step 7, ranks 0, 2 at step 6;" in message
    layouts = format_desync([DesyncReport(0, 1, 5), DesyncReport(1, 1, 9)], 0, 3, clocks_agree=True)
    assert "bucket layouts differ (same layout within: rank 0; rank 1)" in layouts


def mismatched_options(rank: int, world_size: int) -> str:
    try:
        replicate(seeded(_net, 0), bucket_cap_mb=25 if rank == 0 else 10)
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_different_options_are_refused_before_any_bucket_travels(pools):
    # gloo aborts the whole process when buckets of different sizes meet
    for rank, message in enumerate(pools.run(2, mismatched_options)):
        assert f"replicate(): rank {rank}: the ranks called replicate() with different bucket_cap_mb" in message
        assert "rank 0: 25, rank 1: 10" in message, message


# -- stalls and dead peers: fresh processes, real exits ---------------------------------

STALL_S = 3.0  # replicate(stall_timeout=...) in these tests


class Outcome(NamedTuple):
    """How one rank of ``run_ranks`` ended."""

    exitcode: Optional[int]  # None: still running at the deadline (then killed)
    result: Any  # what the rank function returned, or None
    error: str  # the error it raised (str), or ""
    waited_s: float  # seconds from its last mark to the error (see mark())
    cause: str = ""  # the error's __cause__ (str): gloo's own text under replicate()'s, or ""


def _rank_main(rank: int, results: Any, fn: Callable[..., Any], args: tuple, pg_timeout_s: float) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=pg_timeout_s))
    world_size = dist.get_world_size()
    marks = [time.monotonic()]
    try:
        value = fn(rank, world_size, marks, *args)
    except RuntimeError as error:
        cause = "" if error.__cause__ is None else str(error.__cause__)
        results.put((rank, None, str(error), time.monotonic() - marks[-1], cause))
        if rank == 0:
            # The group's store lives in rank 0's process here (under torchrun, in the
            # agent): kept up a moment so the other survivors' diagnosis can still read it.
            time.sleep(3)
        raise SystemExit(1) from None
    results.put((rank, value, "", 0.0, ""))
    dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, deadline_s: float = 90, pg_timeout_s: float = PG_TIMEOUT_S
) -> list[Outcome]:
    """Runs ``fn(rank, world_size, marks, *args)`` in fresh processes; never kills a rank early.

    ``marks`` is a list the function appends ``time.monotonic()`` to; an
    error's ``waited_s`` counts from the last mark. Every process is killed at
    the deadline (then its exitcode is None). ``pg_timeout_s``: the process
    group's own timeout (``init_process_group(timeout=)``).
    """
    processes, results = start_ranks(_rank_main, world_size, (fn, args, pg_timeout_s))
    end = time.monotonic() + deadline_s
    for process in processes:
        process.join(max(0.1, end - time.monotonic()))
    exitcodes = [process.exitcode for process in processes]
    stop_ranks(processes)
    reported: dict[int, tuple] = {}
    while len(reported) < world_size:
        try:
            rank, value, error, waited, cause = results.get(timeout=1)
        except queue.Empty:
            break
        reported[rank] = (value, error, waited, cause)
    return [Outcome(exitcodes[r], *reported.get(r, (None, "", 0.0, ""))) for r in range(world_size)]


def train_steps(
    rank: int,
    marks: list[float],
    steps: int,
    stall: Callable[[int, nn.Module], None],
    keep: bool = False,
    engine: str = "replicate",
) -> Any:
    if engine == "ddp":  # the same job under torch DDP, for the comparisons
        model: nn.Module = DistributedDataParallel(seeded(_net, 0))
    else:
        model = replicate(seeded(_net, 0), stall_timeout=STALL_S)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        stall(step, model)
        loss = model(data(rank, step)).pow(2).mean()
        marks.append(time.monotonic())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model if keep else steps


def late_rank(rank: int, world_size: int, marks: list[float], seconds: float, engine: str = "replicate") -> Any:
    """Rank 1 spends ``seconds`` alone before step 2's forward (a checkpoint save, a rank-0-only evaluation).

    Returns the warnings the rank saw and its parameters after 4 steps
    (``engine``: "replicate", or "ddp" for the same job under torch DDP).
    """

    def stall(step: int, model: nn.Module) -> None:
        if rank == 1 and step == 2:
            time.sleep(seconds)

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model = train_steps(rank, marks, 4, stall, keep=True, engine=engine)
    stalls = [str(w.message) for w in seen if issubclass(w.category, StallWarning)]
    return stalls, [p.detach().tolist() for p in model.parameters()]  # no shared memory


def _one_process_reference(world_size: int, steps: int) -> list[torch.Tensor]:
    # the same SGD steps on the global batch: the mean of every rank's loss
    model = seeded(_net, 0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        loss = sum(model(data(r, step)).pow(2).mean() for r in range(world_size)) / world_size
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach() for p in model.parameters()]


def test_a_live_late_rank_draws_warnings_and_the_job_finishes_as_ddp_s_would():
    # rank 1 away 8 s with stall_timeout=3: looks at ~3 s and ~6 s; the group's timeout (60 s) is far
    outcomes = run_ranks(late_rank, 3, 8.0)
    assert [(o.exitcode, o.error) for o in outcomes] == [(0, "")] * 3, outcomes
    for rank in (0, 2):
        seen, _ = outcomes[rank].result
        stalls = [m for m in seen if "rank 1: outside the step for" in m]
        assert stalls, f"rank {rank} saw no warning naming rank 1: {seen}"
        for message in stalls:
            assert message.startswith(f"replicate(): rank {rank} has waited "), message
            assert re.search(r"rank 1: outside the step for \d+ s \(user code after the backward of step 2\)", message)
            assert f"up to the process group's timeout ({PG_TIMEOUT_S:.0f} s)" in message, message
        assert "bucket 0 (" in stalls[0] and "of step 2" in stalls[0], stalls[0]
    assert not outcomes[1].result[0], f"the late rank itself waited for nobody: {outcomes[1].result[0]}"
    reference = _one_process_reference(3, 4)
    for rank in range(3):
        params = outcomes[rank].result[1]
        assert params == outcomes[0].result[1], f"rank {rank} differs from rank 0"  # bitwise, as lists
        for got, ref in zip(params, reference, strict=True):
            torch.testing.assert_close(torch.tensor(got), ref)
    # DDP on the same job: waits too, and ends where ours does (up to its 1/3-before-the-sum rounding)
    under_ddp = run_ranks(late_rank, 3, 8.0, "ddp")
    assert [(o.exitcode, o.error) for o in under_ddp] == [(0, "")] * 3, under_ddp
    for got, ddp in zip(outcomes[0].result[1], under_ddp[0].result[1], strict=True):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(ddp), rtol=1e-5, atol=1e-6)


def test_a_late_rank_past_the_group_s_own_timeout_raises_naming_it():
    # the group's timeout is 8 s: gloo ends the collective, the roll call names the late rank
    outcomes = run_ranks(late_rank, 2, 20.0, pg_timeout_s=8)
    out = outcomes[0]
    assert out.exitcode == 1, out
    assert out.error.startswith("replicate(): rank 0: bucket 0 ("), out.error
    assert "of step 2 waited more than the process group's timeout (8 s)" in out.error, out.error
    assert "rank 1 has been in user code after the backward of step 2 for" in out.error, out.error
    # the late rank meets a closed connection when it comes back: a clean error too
    assert outcomes[1].exitcode == 1 and outcomes[1].error.startswith("replicate(): rank 1: "), outcomes[1]
    # DDP ends the same job the same way: the waiting rank fails at the group's timeout, gloo's words
    under_ddp = run_ranks(late_rank, 2, 20.0, "ddp", pg_timeout_s=8)
    assert under_ddp[0].exitcode == 1 and "Timed out" in under_ddp[0].error, under_ddp[0]
    assert under_ddp[0].waited_s < out.waited_s + 4, (under_ddp[0].waited_s, out.waited_s)


def _bucket_named(message: str) -> str:
    """The bucket a watchdog error names first: "bucket 0 ('2.bias', ...)"."""
    start = message.index("bucket ")
    return message[start : message.index(") of step", start) + 1]


def dead_peer(rank: int, world_size: int, marks: list[float], stall_timeout: float = STALL_S) -> int:
    """Rank 1's process dies inside its backward at step 2."""

    class DieInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            os._exit(3)

    model = replicate(seeded(_net, 0), stall_timeout=stall_timeout)
    for step in range(4):
        out = model(data(rank, step))
        time.sleep(0.6)  # a step longer than a heartbeat period (0.5 s): the last report is this step's
        if rank == 1 and step == 2:
            out = DieInBackward.apply(out)
        marks.append(time.monotonic())
        out.pow(2).mean().backward()
        model.zero_grad()
    return 4


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_dead_peer_is_named_with_the_step_the_bucket_and_gloo_s_text(world_size):
    outcomes = run_ranks(dead_peer, world_size)
    assert outcomes[1].exitcode == 3, outcomes[1]
    survivors = [r for r in range(world_size) if r != 1]
    waiting = "rank 0 waits" if world_size == 2 else "ranks 0, 2 wait"
    for rank in survivors:
        survivor = outcomes[rank]
        assert survivor.exitcode == 1, survivor  # a clean Python exit, no abort, no hang
        message = survivor.error
        assert message.startswith(f"replicate(): rank {rank}: bucket 0 (") and "of step 2 failed" in message, message
        assert "of step 2 failed: a peer's connection broke" in message, message
        # same host: its process has ended, no heartbeat needed to confirm it
        assert "rank 1 is gone (its process, pid" in message and ", has ended; " in message, message
        assert "ward of step 2)" in message, message  # its last report: forward or backward of step 2
        assert f"{waiting} in bucket 0 (" in message, message
        assert "Connection" in message or "connection" in message, "gloo's own text must stay in the message's cause"
        assert "onnection" in survivor.cause, f"rank {rank}: gloo's own text must stay in the cause: {survivor}"
        # named within 3 s (gloo's closed connection, a period for rank 2's counter), with room for a busy machine
        assert survivor.waited_s < 6, f"rank {rank} took {survivor.waited_s:.1f} s"
    buckets = {_bucket_named(outcomes[rank].error) for rank in survivors}
    assert len(buckets) == 1, f"the survivors name different buckets: {buckets}"


def test_a_dead_peer_is_named_in_seconds_under_the_default_stall_timeout():
    # stall_timeout=60: the heartbeat period was 5 s and the diagnosis waited two of them
    outcomes = run_ranks(dead_peer, 2, 60.0)
    assert outcomes[1].exitcode == 3, outcomes[1]
    survivor = outcomes[0]
    assert survivor.exitcode == 1, survivor
    assert "of step 2 failed: a peer's connection broke" in survivor.error, survivor.error
    assert "rank 1 is gone (its process, pid" in survivor.error and ", has ended; " in survivor.error, survivor
    assert survivor.waited_s < 6, f"rank 0 took {survivor.waited_s:.1f} s"


def extra_step_then_exit(rank: int, world_size: int, marks: list[float]) -> int:
    """Rank 0 runs one step more than rank 1, which then exits normally."""
    return train_steps(rank, marks, 4 if rank == 0 else 3, lambda step, model: None)


def test_an_extra_step_on_one_rank_names_the_rank_that_left():
    outcomes = run_ranks(extra_step_then_exit, 2)
    assert outcomes[1].exitcode == 0 and outcomes[1].result == 3, outcomes[1]
    message = outcomes[0].error
    assert outcomes[0].exitcode == 1, outcomes[0]
    assert "replicate(): rank 0:" in message and "of step 3" in message, message
    # its last note (at exit, or when its replica was released) says so, with its count
    assert "rank 1 exited after 3 synchronised backwards" in message or (
        "rank 1 released its replica after 3 synchronised backwards" in message
    ), message
    assert "of step 3, its 4th synchronised backward: the ranks ran different numbers of backward passes" in message
    assert outcomes[0].waited_s < STALL_S + 3, f"rank 0 took {outcomes[0].waited_s:.1f} s"


def slow_but_healthy(rank: int, world_size: int, marks: list[float]) -> int:
    """Steps where one rank is late by less than the stall timeout, and a no-grad evaluation on one rank."""

    def stall(step: int, model: nn.Module) -> None:
        if rank == step % world_size:
            time.sleep(STALL_S * 0.5)
        if rank == 0 and step == 3:  # a slow evaluation on rank 0 alone
            with torch.no_grad():
                model(data(0, 99))
            time.sleep(STALL_S * 0.6)

    return train_steps(rank, marks, 8, stall)


def test_healthy_slow_steps_never_trip_the_watchdog():
    outcomes = run_ranks(slow_but_healthy, 2)
    assert [(o.exitcode, o.result, o.error) for o in outcomes] == [(0, 8, ""), (0, 8, "")]


def test_who_is_where_sentence():
    from torchreplicate.faults.place import Place
    from torchreplicate.faults.watchdog import Note, describe_notes
    from torchreplicate.lifecycle import TrainingState

    def note(rank, state, bucket=None, detail="", seconds=1.0, failed=False, alive=True):
        return Note(rank, Place(state, 12, bucket), detail, seconds, failed, "hostA", 100 + rank, 7, alive)

    notes = [
        note(0, TrainingState.FINALIZING, 0, "'w'"),
        note(1, TrainingState.FORWARD, seconds=63.4),
        note(2, TrainingState.FINALIZING, 0, "'w'", failed=True, alive=False),
        note(3, TrainingState.BACKWARD, alive=False),
    ]
    sentence = describe_notes(notes, 0, silence_s=1.0)
    assert "rank 1 has been in forward of step 12 for 63 s" in sentence, sentence
    assert "rank 3 is gone (its process, pid 103 on hostA, sent no heartbeat in 1.0 s" in sentence, sentence
    assert "was backward of step 12)" in sentence, sentence
    assert sentence.endswith("ranks 0, 2 wait in bucket 0 ('w') of step 12"), sentence


# -- a change of the replicated parameters on one rank only ---------------------------------


def frozen_on_one_rank(rank: int, world_size: int, marks: list[float]) -> int:
    """Rank 1 alone freezes the first layer before step 2: its forward re-plans, the others' do not."""

    def stall(step: int, model: nn.Module) -> None:
        if rank == 1 and step == 2:
            model[0].requires_grad_(False)

    return train_steps(rank, marks, 4, stall)


def test_a_change_on_one_rank_only_is_named_on_every_rank():
    # Each rank waits in a different collective (a mismatch): each raises at its look at the peers
    # (stall_timeout), naming both places; the processes exit when gloo ends the in-flight operation,
    # at the group's own timeout (20 s here).
    outcomes = run_ranks(frozen_on_one_rank, 2, pg_timeout_s=20)
    for rank, out in enumerate(outcomes):
        assert out.exitcode == 1, f"rank {rank}: {out}"
        assert out.error.startswith(f"replicate(): rank {rank}:"), out.error
        assert "'0.weight' frozen" in out.error, f"rank {rank}: {out.error}"
        assert "of step 2" in out.error, f"rank {rank}: {out.error}"
    assert "every rank must make the same change at the same step" in outcomes[0].error, outcomes[0].error
    for rank, out in enumerate(outcomes):
        assert "waits in another collective, so this one can never complete" in out.error, out.error
        assert out.waited_s < STALL_S + 4, f"rank {rank} took {out.waited_s:.1f} s"
    assert outcomes[0].error.startswith("replicate(): rank 0: bucket 0 ("), outcomes[0].error
    # the first to look sees the other waiting there; the second, that it stopped there after its error
    assert re.search(r"rank 1 (has been|stopped after an error) in a re-plan \('0.weight' frozen", outcomes[0].error)
    assert outcomes[1].error.startswith("replicate(): rank 1: a re-plan ('0.weight' frozen"), outcomes[1].error
    assert re.search(r"rank 0 (has been|stopped after an error) in bucket 0 \(", outcomes[1].error), outcomes[1].error


def dies_in_layout_agreement(rank: int, world_size: int, marks: list[float]) -> Any:
    """Rank 1's process dies inside the first step's layout agreement, before its collective (issue 59)."""
    from torchreplicate.reducer import reducer as reducer_module

    if rank == 1:

        def die(*args: Any, **kwargs: Any) -> bool:
            time.sleep(0.6)  # a heartbeat period: its last note is the agreement
            os._exit(3)

        reducer_module.learn_layout = die  # type: ignore[assignment]
    return train_steps(rank, marks, 2, lambda step, model: None)


def test_a_peer_lost_in_the_layout_agreement_is_named_with_the_agreement():
    # the agreement's broadcast was waited and read outside the watchdog: gloo's bare error, no place
    outcomes = run_ranks(dies_in_layout_agreement, 2)
    assert outcomes[1].exitcode == 3, outcomes[1]
    survivor = outcomes[0]
    assert survivor.exitcode == 1, survivor
    message = survivor.error
    assert message.startswith("replicate(): rank 0: the layout's agreement"), message
    assert "of step 0" in message and "rank 1 is gone (its process, pid" in message, message
    assert survivor.waited_s < 6, f"rank 0 took {survivor.waited_s:.1f} s"
