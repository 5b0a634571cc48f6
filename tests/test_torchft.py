"""torchreplicate on torchft: a replica lost mid-step and a fresh one healed in, without a restart.

The scenario (torchft_runs.py): a lighthouse started here, three replica
groups of one process each, one SIGKILLed in the middle of step ``DIE_AT``,
a fresh one started once the survivors went on, healing from a live peer.
Checked: step 0 starts from one replica's parameters on all (each built
its own; the Manager synced them), the survivors never restarted (one pid
each, every step), the
killed step is committed nowhere, the newcomer healed (it starts at a later
step with its peers' parameters and momentum) and trained on, every replica
ends bitwise equal, and equal to a single-process replay of exactly the
committed steps with the data each participant used in them.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from torch import nn

pytest.importorskip("torchft")

import torchft_runs  # noqa: E402  (after the skip: it imports nothing of torchft at import time, its workers do)
from torchreplicate import replicate  # noqa: E402
from torchreplicate.integrations.torchft import ManagerFuture, replicate_ft  # noqa: E402

DIE_AT = 4
NUM_STEPS = 12
HIDDEN = 16


def test_replica_lost_and_replaced_without_restart(tmp_path):
    run = torchft_runs.run_scenario(
        "ours", tmp_path, num_steps=NUM_STEPS, die_at=DIE_AT, hidden=HIDDEN, reduce_dtype="float64"
    )
    records, states = run["records"], run["states"]
    assert run["returncodes"] == {"r0": 0, "r1": 0, "r2": -9, "r3": 0}, run["returncodes"]
    # The victim died in step DIE_AT, after its forward.
    assert records["r2"][-1]["step"] == DIE_AT and "killed" in records["r2"][-1]
    for survivor in ("r0", "r1"):
        rows = records[survivor]
        assert len({row["pid"] for row in rows}) == 1, f"{survivor} restarted"
        killed_step = [row for row in rows if row["step"] == DIE_AT]
        assert [row["committed"] for row in killed_step] == [False, True], killed_step  # dropped, then redone
        assert killed_step[0]["participants"] == 3 and killed_step[1]["participants"] == 2
        assert [row["step"] for row in rows if row["committed"]] == list(range(NUM_STEPS))
    # The newcomer started at a later step (healed from a peer, not from step 0) and trained on.
    newcomer = records["r3"]
    assert newcomer[0]["step"] > DIE_AT and newcomer[0]["participants"] == 3
    assert all(row["committed"] for row in newcomer) and newcomer[-1]["step"] == NUM_STEPS - 1
    # Every committed step: the same participants on every replica that committed it.
    steps = torchft_runs.committed_steps(records)
    assert list(steps) == list(range(NUM_STEPS))
    for step, rows in steps.items():
        assert all(row["participants"] == len(rows) for row in rows), (step, rows)
    victim_seed = records["r2"][-1]["seed"]
    assert all(row["seed"] != victim_seed for rows in steps.values() for row in rows)
    # Step 0: each replica built its model from its own seed; the Manager
    # synced them (init_sync), our set-up broadcast nothing. The replay
    # starts from the replica the others were synced to.
    starts = {records[name][0]["start_digest"] for name in ("r0", "r1", "r2")}
    assert len(starts) == 1, "the replicas did not start step 0 from the same parameters"
    init_seeds = [s for s in range(3) if torchft_runs.digest(torchft_runs.make_model(HIDDEN, s)) in starts]
    assert len(init_seeds) == 1, init_seeds
    # Bitwise: the replicas among themselves, and against the replay.
    reference = torchft_runs.replay(steps, HIDDEN, init_seeds[0])
    for name in ("r0", "r1", "r3"):
        _assert_same_state(states[name], reference, name)


def _assert_same_state(state, reference, name):
    for key, value in reference["model"].items():
        assert torch.equal(state["model"][key], value), f"{name}: parameter {key} differs from the replay"
    for index, entry in reference["optim"]["state"].items():
        ours = state["optim"]["state"][index]["momentum_buffer"]
        assert torch.equal(ours, entry["momentum_buffer"]), f"{name}: momentum {index} differs from the replay"


def test_replay_sums_are_exact_in_every_order():
    # The premise of the bitwise replay: three float32 gradients add up
    # exactly in float64, whichever way the all-reduce associates them.
    generator = torch.Generator().manual_seed(0)
    scales = (1e-3, 1.0, 1e2)  # float32 values of different magnitudes, as gradients of different batches
    parts = [(torch.randn(1000, generator=generator) * scale).double() for scale in scales]
    sums = {tuple(order): (order[0] + order[1]) + order[2] for order in itertools.permutations(parts)}
    first = next(iter(sums.values()))
    assert all(torch.equal(first, total) for total in sums.values())


# -- options ---------------------------------------------------------------------


@pytest.fixture
def one_process_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_refuses_what_is_not_a_manager():
    with pytest.raises(TypeError, match=r"replicate_ft\(\): manager must be a torchft.manager.Manager, got object"):
        replicate_ft(nn.Linear(2, 2), object())


class _OutOfOrder(nn.Module):
    # Registered a, b, c; used c, then b, then a: readiness order in backward
    # is a, b, c, the reverse of what the reducer starts with.
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 4)

    def forward(self, x):
        return self.a(self.b(self.c(x)))


def _noop_hook(state, bucket):
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


@pytest.mark.parametrize("layout, reordered", [("learned", True), ("fixed", False)])
def test_fixed_layout_is_never_relearned(one_process_group, layout, reordered):
    # The first step learns the readiness order ("learned"); "fixed" keeps the
    # layout a replica joining later builds at its first step.
    model = replicate(_OutOfOrder(), bucket_cap_mb=0.0001, first_bucket_cap_mb=0.0001, bucket_layout=layout)
    model.register_comm_hook(None, _noop_hook)
    reducer = replicate.state(model).reducer

    def layout_now():
        return [[slot.name for slot in bucket.slots] for bucket in reducer.buckets]

    before = layout_now()
    for _ in range(2):
        model(torch.randn(2, 4)).sum().backward()
    assert (layout_now() != before) is reordered, (before, layout_now())


def test_refuses_no_process_group_and_a_bad_reduce_dtype():
    from torchft.manager import Manager

    manager = Manager.__new__(Manager)  # only its type is looked at before the group
    with pytest.raises(RuntimeError, match=r"replicate_ft\(\): torch.distributed is not initialized"):
        replicate_ft(nn.Linear(2, 2), manager)
    with pytest.raises(TypeError, match=r"reduce_dtype must be a floating torch.dtype .* got torch.int32"):
        replicate_ft(nn.Linear(2, 2), manager, reduce_dtype=torch.int32)


class _StubManager:
    # What ManagerFuture reads of a torchft Manager: errored().
    def __init__(self) -> None:
        self.error = None

    def errored(self):
        return self.error


class _FailingWork:
    # torchft's _ManagedWork.wait on a broken connection: reports, returns False, never raises.
    def __init__(self, manager: _StubManager) -> None:
        self.manager = manager

    def wait(self):
        self.manager.error = RuntimeError("Connection reset by peer")
        return False


class _Work:
    def wait(self):
        return True


def test_a_failed_allreduce_gives_zeros_not_an_exception():
    manager = _StubManager()
    wire = torch.full((3,), 2.0, dtype=torch.float64)
    result = ManagerFuture(manager, _FailingWork(manager), wire, torch.float32).wait()
    assert result.dtype == torch.float32 and torch.equal(result, torch.zeros(3))


def test_the_average_comes_back_in_the_bucket_dtype():
    wire = torch.full((3,), 0.5, dtype=torch.float64)
    result = ManagerFuture(_StubManager(), _Work(), wire, torch.float32).wait()
    assert result.dtype == torch.float32 and torch.equal(result, torch.full((3,), 0.5))


def test_join_is_refused_naming_torchft(one_process_group):
    # Join would only shadow collectives inside this one-process group: refused, not ignored.
    from torch.distributed.algorithms.join import Join
    from torchft.manager import Manager

    model = replicate_ft(nn.Linear(2, 2), Manager.__new__(Manager))  # the Manager is not called before a step
    with pytest.raises(RuntimeError, match=r"replicate_ft\(\): torch's Join does not apply across torchft"):
        Join([model])
    with pytest.raises(RuntimeError, match=r"drop the Join context"):
        model.join()
