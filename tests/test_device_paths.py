"""The accelerator paths that can be checked without one (issue 39): devices, inputs, sparse on NCCL.

What needs a GPU is scripts/gpu_check.sh's; these pin the decisions the
code makes before any kernel runs: where the module's own collectives go on
NCCL, that inputs follow ``device_id`` as DDP's ``device_ids`` moves them,
and that NCCL's missing sparse all-reduce is refused at ``replicate()``.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch import nn

from torchreplicate.core import setup
from torchreplicate.torch_internals import moved_to


def plan_of(module: nn.Module) -> setup.Plan:
    return setup.plan_tree(module, (), (), ())


def test_sparse_gradients_are_refused_on_nccl_only():
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
    plan = plan_of(model)
    with pytest.raises(ValueError, match=r"'0.weight' get sparse gradients .* NCCL cannot all-reduce.*sparse=False"):
        setup.refuse_sparse_on("nccl", plan)
    setup.refuse_sparse_on("gloo", plan)  # gloo reduces them (tests/test_patterns.py trains one)
    setup.refuse_sparse_on("nccl", plan_of(nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 2))))


def test_nccl_collectives_run_on_the_modules_gpu_not_the_current_device(monkeypatch):
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cuda:nccl")
    plan = plan_of(nn.Linear(4, 2))
    # device_id names the GPU: never torch.cuda.current_device() (cuda:0 on every rank without set_device)
    assert setup.collective_device(object(), plan, torch.device("cuda", 3)) == torch.device("cuda", 3)


@pytest.mark.parametrize("config", ["cpu:gloo,cuda:gloo", "cpu:gloo", "cpu:gloo,cuda:nccl"])
def test_a_group_that_runs_cpu_tensors_uses_the_modules_device(monkeypatch, config):
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: config)
    assert setup.collective_device(object(), plan_of(nn.Linear(4, 2)), None) == torch.device("cpu")
    meta = nn.Linear(4, 2, device="meta")
    assert setup.collective_device(object(), plan_of(meta), None) == torch.device("meta")


def test_the_backend_is_read_per_device_type_from_the_group():
    # dist.get_backend() is the whole spec for a group made with one ("cpu:gloo"): compared with "gloo",
    # the watchdog took such a group for NCCL; the config names one backend per device type
    from torchreplicate.config import backend_of

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert backend_of(None, "cpu") == "gloo"
        group = dist.new_group([0], backend="cpu:gloo")
        assert dist.get_backend(group) == "cpu:gloo" and backend_of(group, "cpu") == "gloo"
        assert backend_of(group, "cuda") == ""
    finally:
        dist.destroy_process_group()


def test_sparse_gradients_are_refused_where_their_device_runs_nccl(monkeypatch):
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cpu:gloo,cuda:nccl")
    sparse = plan_of(nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2)))
    assert setup.sparse_backend(object(), sparse) == "gloo"  # on the CPU: gloo reduces them
    assert setup.sparse_backend(object(), plan_of(nn.Linear(4, 2))) == ""


def test_inputs_follow_device_id_through_nested_containers():
    x, y = torch.randn(2, 3), torch.randn(3)
    args, kwargs = moved_to(torch.device("meta"), ((x, [y], "text", 3), {"mask": y, "flag": True}))
    assert args[0].device.type == "meta" and args[1][0].device.type == "meta" and kwargs["mask"].device.type == "meta"
    assert args[2:] == ("text", 3) and kwargs["flag"] is True
    assert x.device.type == "cpu", "the caller's tensors are left where they were"


def forward_sees_moved_inputs(rank: int, world_size: int) -> str:
    class Spy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.seen: list[str] = []

        def forward(self, x: torch.Tensor, *, mask: torch.Tensor) -> torch.Tensor:
            self.seen += [x.device.type, mask.device.type]
            return self.lin(torch.ones(1, 2))

    from torchreplicate import replicate

    model = replicate(Spy())
    state = replicate.state(model)
    assert state.input_device is None, "device_id unset (or the CPU): inputs stay where they are"
    model(torch.zeros(1), mask=torch.zeros(1))
    state.input_device = torch.device("meta")  # what replicate(device_id=<accelerator>) sets
    model(torch.zeros(1), mask=torch.zeros(1))
    return " ".join(model.seen)


def test_the_forward_hook_moves_inputs_to_the_input_device(pools):
    assert pools.run(1, forward_sees_moved_inputs) == ["cpu cpu meta meta"]


def test_object_gathers_run_with_the_modules_gpu_current(monkeypatch):
    # dist.all_gather_object serializes onto torch.cuda.current_device() on NCCL: every object gather of
    # ours (errors, set-up check, verify_replicas, trace) makes the module's device current while it runs
    from torchreplicate.faults import wire as errors

    seen = []
    monkeypatch.setattr(torch.cuda, "device", lambda device: seen.append(device) or contextlib.nullcontext())
    monkeypatch.setattr(dist, "get_world_size", lambda group: 2)
    monkeypatch.setattr(dist, "all_gather_object", lambda out, obj, group: out.__setitem__(slice(None), [obj, obj]))
    assert errors.gather_objects("mine", None, torch.device("cuda", 3)) == ["mine", "mine"]
    assert seen == [torch.device("cuda", 3)]
    assert errors.gather_objects("mine", None, torch.device("cpu")) == ["mine", "mine"]
    assert seen == [torch.device("cuda", 3)], "no device made current for a CPU module"


def test_the_staged_flags_go_to_the_host_on_a_stream_of_their_own(monkeypatch):
    """On an accelerator the flags' sums are copied to the host on a side stream of the flags' device, which
    waits for the step's stream (the last bucket carried them) or for their own all-reduce: the step's
    stream never waits for the flags ([Note: the flags' own all-reduce] in reducer/flags.py)."""
    from torchreplicate.reducer import flags

    streams = []
    monkeypatch.setattr(torch.accelerator, "current_stream", lambda device: streams.append(device) or "step")

    class FakeEvent:
        def __init__(self, device):
            self.device = device

        def record(self, stream):
            self.stream = stream

    class FakeStream:
        def __init__(self):
            self.waited, self.entered = [], 0

        def __enter__(self):
            self.entered += 1

        def __exit__(self, *exc):
            return False

        def wait_stream(self, other):
            self.waited.append(other)

    class FakeWork:
        waited_on = None

        def wait(self):
            FakeWork.waited_on = side.entered  # inside the side stream's context: that stream waits

    staged = flags.StagedSums(torch.device("cpu"))
    device = torch.device("meta")  # as on an accelerator (pinned host memory needs one): the event path
    side = FakeStream()
    staged.device, staged.event, staged.host = device, FakeEvent(device), torch.zeros(flags._STAGED_WIDTH)
    staged.side = side  # type: ignore[assignment]
    from torchreplicate.faults.wire import Watch

    staged.stage(torch.ones(flags._STAGED_WIDTH), None, None, Watch(), step=1, clock=0, late_params=())  # carried
    assert streams == [torch.device("meta")] and side.waited == ["step"] and staged.event.stream is side
    staged.stage(torch.ones(flags._STAGED_WIDTH), None, FakeWork(), Watch(), step=2, clock=0, late_params=())
    assert FakeWork.waited_on == 2 and side.waited == ["step"], "the side stream waits for the flags' work"


def watch_on_a_cpu_gloo_group(rank, world_size):
    from torchreplicate import replicate

    group = dist.new_group(backend="cpu:gloo")
    model = replicate(nn.Linear(4, 2), process_group=group)
    return replicate.state(model).probe.watch.sliced


def test_the_watchdog_slices_its_waits_on_a_group_made_with_cpu_gloo(pools):
    assert pools.run(2, watch_on_a_cpu_gloo_group) == [True, True]


def test_cuda_graph_capture_is_refused_before_any_collective(monkeypatch):
    from torchreplicate import replicate

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = replicate(nn.Linear(4, 2))
        model(torch.randn(3, 4)).sum().backward()  # uncaptured: trains
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        model(torch.randn(3, 4))  # a CPU module: nothing to capture, nothing refused
        replicate.state(model).device = torch.device("cuda", 0)  # as on a GPU, under torch.cuda.graph
        with pytest.raises(RuntimeError, match=r"^replicate\(\): a forward of the replicated Linear ran under CUDA"):
            model(torch.randn(3, 4))
        with torch.no_grad():
            model(torch.randn(3, 4))  # an evaluation runs no collective: not refused
    finally:
        dist.destroy_process_group()


def backward_under_capture(rank, world_size):
    """A backward-only CUDA-graph capture (stood in for on the CPU): refused at its first gradient, on every rank,
    before any collective of the step; the next, uncaptured step trains as if nothing happened."""
    from torchreplicate import replicate

    model = replicate(nn.Linear(4, 2))
    model(torch.randn(3, 4)).sum().backward()  # uncaptured: a step with its collectives
    replicate.state(model).reducer.on_cuda = True  # as on a GPU, under torch.cuda.graph around the backward only
    real = torch.cuda.is_current_stream_capturing
    loss = model(torch.randn(3, 4)).sum()  # forward uncaptured
    torch.cuda.is_current_stream_capturing = lambda: True
    try:
        with pytest.raises(RuntimeError, match=r"^replicate\(\): a backward of the replicated module \(parameter"):
            loss.backward()
    finally:
        torch.cuda.is_current_stream_capturing = real
        replicate.state(model).reducer.on_cuda = False
    model.zero_grad()
    model(torch.full((3, 4), float(rank))).sum().backward()  # the collectives still pair
    return model.weight.grad.tolist()


def test_a_backward_under_cuda_graph_capture_is_refused_before_any_collective(pools):
    grads = pools.run(2, backward_under_capture)
    assert grads[0] == grads[1] == [[1.5] * 4] * 2, grads  # the mean of rank 0's zeros and rank 1's ones, x3 rows / 2


def test_an_accelerator_wait_is_polled_and_looks_at_the_peers_on_the_stall_schedule(monkeypatch):
    # On NCCL a host wait is an event's; polled (no spinning core), it looks at the peers at stall_timeout,
    # then at x2, as a gloo wait does, so a hung peer is named before NCCL's own abort
    import time

    from torchreplicate.faults.watchdog import StallWatch

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        watch = StallWatch(dist.group.WORLD, 0.05, key="polled")
        looks = []
        monkeypatch.setattr(watch, "look_at_peers", lambda waited: looks.append(waited))
        ready_at = time.monotonic() + 0.35
        queries = []
        watch.wait_until(lambda: queries.append(1) or time.monotonic() >= ready_at)
        assert len(looks) == 3, looks  # at 0.05 s, 0.1 s and 0.2 s; done at 0.35 s
        assert 0.05 <= looks[0] < 0.1 and 0.1 <= looks[1] < 0.2 and 0.2 <= looks[2] < 0.35, looks
        assert len(queries) < 200, "polled with naps, not spun"
        looks.clear()
        watch.wait_until(lambda: True)  # done at once: no look, no nap
        assert looks == []
        watch.stop()
    finally:
        dist.destroy_process_group()


def test_the_staged_flags_wait_through_the_watchdog_not_a_plain_synchronize():
    from torchreplicate.reducer import flags

    class Event:
        def query(self):
            return True

        def synchronize(self):
            raise AssertionError("a plain wait: a hung peer would hold this rank until NCCL's abort")

    from torchreplicate.faults.watchdog import StallWatch
    from torchreplicate.faults.wire import Watch

    class Waiter(Watch):  # the stall watchdog's way with an event: polled, never a plain synchronize
        wait_event = StallWatch.wait_event

        def wait_until(self, done):
            self.polled = done()

    staged, waiter = flags.StagedSums(torch.device("cpu")), Waiter()
    staged.event, staged.values, staged.step = Event(), _agreeing_sums(flags), 3
    staged.check(lambda: None, 0, waiter)
    assert waiter.polled is True


def _agreeing_sums(flags):
    # what a step late reads when the ranks agree: no late gradient, no rank raised, both residue blocks one-hot
    import numpy as np

    clock = flags.one_hot_residues(0)
    return np.array([0.0] * flags._HEAD + [*clock, *clock], dtype=np.float32)


def test_a_read_of_the_flags_in_the_step_polls_on_an_accelerator(monkeypatch):
    # The unused parameters' counts and graph="dynamic"'s flags are read in the step: on an accelerator
    # the host polls an event recorded after the all-reduce, through the watchdog, not a plain blocking read
    from torchreplicate.reducer import flags

    seen = []
    monkeypatch.setattr(torch.accelerator, "current_stream", lambda device: seen.append(("stream", device)) or "s")

    class Event:
        def record(self, stream):
            seen.append(("record", stream))

        def query(self):
            return True

    from torchreplicate.faults.watchdog import StallWatch
    from torchreplicate.faults.wire import Watch

    class Waiter(Watch):  # the stall watchdog's way with an event: polled
        wait_event = StallWatch.wait_event

        def wait(self, work):
            seen.append(("wait", work))

        def wait_until(self, done):
            seen.append(("polled", done()))

    step_flags = flags.StepFlags(torch.device("cpu"), 3, 0, flags.TrainingClock())
    step_flags.wait("work", Waiter())
    assert seen == [("wait", "work")], "on the host the work's wait is the read's"
    seen.clear()
    step_flags.ready = Event()  # as on an accelerator
    step_flags.wait("work", Waiter())
    assert seen == [("wait", "work"), ("stream", torch.device("cpu")), ("record", "s"), ("polled", True)], seen


def test_the_plain_watch_blocks_in_an_event_the_stall_watchdog_polls_it():
    """Without a stall watchdog (world size 1, stall_timeout=None) a wait on an accelerator's event blocks in
    it, with no naps in between; the stall watchdog polls it, looking at the peers meanwhile."""
    from torchreplicate.faults.watchdog import StallWatch
    from torchreplicate.faults.wire import Watch

    class Event:
        def __init__(self):
            self.calls = []

        def synchronize(self):
            self.calls.append("synchronize")

        def query(self):
            self.calls.append("query")
            return True

    plain, event = Watch(), Event()
    plain.wait_event(event)
    assert event.calls == ["synchronize"]

    class Polling(Watch):
        wait_event = StallWatch.wait_event

    polled = Event()
    Polling().wait_event(polled)
    assert polled.calls == ["query"], "the stall watchdog's wait polls the event"
