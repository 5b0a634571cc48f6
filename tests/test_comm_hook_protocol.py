"""The comm-hook protocol: what a hook is handed, errors, custom hooks, the reducer's bookkeeping.

Two ranks unless noted. DDP's stock hooks are in test_comm_hooks.py.

Regression tests for bugs these tests found (fixed in c05c5ad):
* a hook's Work.get_future() / Future.then() result (torch._C.Future, the base
  of torch.futures.Future) was refused: every stock hook but noop_hook failed;
* the reducer's flags all-reduce (the "tail") went out while hook futures were
  still launching collectives from their callbacks: PowerSGD mismatched
  collectives across ranks (test_hook_collectives_from_callbacks_...);
* the flags followed the hook's buffer in memory, so a hook padding buffer()
  in place (batched_powerSGD_hook) overwrote them (test_hook_padding_...);
* at world size 1 a hook registered after training was accepted.
"""

from __future__ import annotations

import time
from typing import Any, Callable, NamedTuple

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from models import MODELS, TINY_BUCKETS
from parity import (
    PER_RANK,
    assert_group_usable,
    assert_replicas_identical,
    assert_same_on_every_rank,
    local_shard,
    seeded,
)
from torchreplicate import replicate


def completed(value: Any) -> torch.futures.Future:
    """A ``torch.futures.Future`` already holding ``value``."""
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(value)
    return future


def error_text(action: Callable[[], Any], error_type: type, *words: str, where: str) -> str:
    """Runs ``action``, which must raise exactly ``error_type`` with every one of ``words``; returns the message."""
    with pytest.raises(error_type) as info:
        action()
    text = str(info.value)
    assert type(info.value) is error_type, f"{where}: {type(info.value).__name__}, not {error_type.__name__}: {text}"
    missing = [w for w in words if w not in text]
    assert not missing, f"{where}: {missing} not in {error_type.__name__}: {text}"
    return text


def mlp_backward(model: nn.Module, step: int = 0) -> None:
    """One backward of the MLP on the same batch on every rank."""
    build, make_batch, loss_of = MODELS["mlp"]
    batch = make_batch(torch.Generator().manual_seed(step), PER_RANK)
    loss_of(model(batch), batch).backward()


# -- what the hook is handed: bucket order, is_last, parameters and gradient views --------


class Recorder:
    """Hook state: what every call saw, and the local gradients to expect."""

    def __init__(self, names: dict[int, str]) -> None:
        self.names = names  # id(param) -> name
        self.expected: dict[str, torch.Tensor] = {}  # name -> this rank's local gradient
        self.calls: list[BucketCall] = []


class BucketCall(NamedTuple):
    index: int
    is_last: bool
    names: list[str]  # of bucket.parameters(), in order
    problems: list[str]  # what did not line up


def recording_hook(state: Recorder, bucket):
    """Records the bucket, checks its views, then averages it synchronously."""
    buffer = bucket.buffer()
    params, grads = bucket.parameters(), bucket.gradients()
    problems = []
    if buffer.dim() != 1:
        problems.append(f"buffer() is {buffer.dim()}-D")
    if len(params) != len(grads):
        problems.append(f"{len(params)} parameters but {len(grads)} gradients")
    offset = 0
    names = []
    for p, g in zip(params, grads):
        name = state.names.get(id(p))
        names.append(name)
        if name is None:
            problems.append(f"parameters() holds a tensor of shape {tuple(p.shape)} that is not a model parameter")
            continue
        if g.shape != p.shape:
            problems.append(f"{name}: gradient shape {tuple(g.shape)} != parameter shape {tuple(p.shape)}")
        if g.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr():
            problems.append(f"{name}: gradient is not in buffer()'s storage")
        elif g.storage_offset() != buffer.storage_offset() + offset:
            problems.append(
                f"{name}: gradient at offset {g.storage_offset() - buffer.storage_offset()}, expected {offset}"
            )
        elif not torch.equal(buffer[offset : offset + p.numel()].view_as(p), g):
            problems.append(f"{name}: buffer() and gradients() disagree")
        if name in state.expected and not torch.equal(g, state.expected[name]):
            off = float((g - state.expected[name]).abs().max())
            problems.append(f"{name}: the hook sees {off:.3g} off this rank's local gradient")
        offset += p.numel()
    if offset != buffer.numel():
        problems.append(f"buffer() has {buffer.numel()} elements, its gradients {offset}")
    state.calls.append(BucketCall(bucket.index(), bucket.is_last(), names, problems))
    dist.all_reduce(buffer)
    return completed(buffer.div_(dist.get_world_size()))


def trace_buckets(rank: int, world_size: int, *, gradient_as_bucket_view: bool, steps: int = 3) -> None:
    """Trains the MLP with tiny buckets under the recording hook; checks every call."""
    build, make_batch, loss_of = MODELS["mlp"]
    model = seeded(build, 100 + rank)
    shadow = seeded(build, 0)  # a plain copy: this rank's local gradients
    replicate(model, gradient_as_bucket_view=gradient_as_bucket_view, **TINY_BUCKETS)
    reducer = replicate.state(model).reducer
    param_names = [name for name, _ in model.named_parameters()]
    recorder = Recorder({id(p): name for name, p in model.named_parameters()})
    model.register_comm_hook(recorder, recording_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    layouts = []
    for step in range(steps):
        batch = make_batch(torch.Generator().manual_seed(step), PER_RANK * world_size)
        local = local_shard(batch, rank)
        with torch.no_grad():
            for p, q in zip(model.parameters(), shadow.parameters()):
                q.copy_(p)
        shadow.zero_grad(set_to_none=True)
        loss_of(shadow(local), local).backward()
        recorder.expected = {name: q.grad.clone() for name, q in zip(param_names, shadow.parameters())}
        recorder.calls = []
        count = len(reducer.buckets)  # the step's layout (DDP's: rebuilt after the first step)
        loss_of(model(local), local).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        calls = recorder.calls
        where = f"rank {rank} step {step}"
        if step == 0:  # DDP's first iteration: one bucket per dtype and device
            assert count == 1, f"{where}: the first step should reduce one bucket, got {count}"
            continue
        assert count >= 3, f"{where}: tiny caps should give several buckets, got {count}"
        assert [c.index for c in calls] == list(range(count)), f"{where}: bucket indices {[c.index for c in calls]}"
        is_last = [c.is_last for c in calls]
        assert is_last == [i == count - 1 for i in range(count)], f"{where}: is_last {is_last}"
        problems = [p for c in calls for p in c.problems]
        assert not problems, f"{where}: {problems}"
        names = [n for c in calls for n in c.names]
        assert sorted(names) == sorted(param_names), f"{where}: each parameter once: {names}"
        layouts.append([c.names for c in calls])
    assert all(layout == layouts[0] for layout in layouts), f"rank {rank}: buckets changed between steps: {layouts}"
    every_layout: list[Any] = [None] * world_size
    dist.all_gather_object(every_layout, layouts[0])
    assert all(layout == layouts[0] for layout in every_layout), f"ranks disagree on the bucket layout: {every_layout}"
    assert_replicas_identical(model, f"after {steps} steps")


@pytest.mark.parametrize("as_view", [True, False], ids=["grad-as-view", "grad-copied"])
def test_bucket_order_is_last_and_views(pools, as_view):
    """Tiny buckets: indices 0..B-1 in order every step, is_last only for B-1, views line up.

    Step 0 reduces everything at the end of backward, later steps launch
    from the gradient hooks; both must look the same to the hook. Each
    bucket's gradients() are views into buffer() at consecutive offsets,
    shaped like parameters(), and hold this rank's local gradients.
    """
    pools.run(2, trace_buckets, gradient_as_bucket_view=as_view)


# -- registration errors ------------------------------------------------------------------


def _one_arg_hook(bucket):  # wrong signature: no state
    raise AssertionError("never called")


def _three_arg_hook(state, bucket, extra):  # wrong signature: a required third argument
    raise AssertionError("never called")


def register_badly(rank: int, world_size: int) -> list[str]:
    """Bad registrations, each on a fresh replica; returns the messages (the test compares ranks)."""
    allreduce = default_hooks.allreduce_hook

    def fresh(**options: Any) -> nn.Module:
        return replicate(seeded(MODELS["mlp"].build, 0), **options)

    def register(model: nn.Module, hook: Any) -> Callable[[], None]:
        return lambda: model.register_comm_hook(None, hook)

    texts = [
        error_text(register(fresh(), 42), TypeError, "callable", "int", where="not callable"),
        error_text(
            register(fresh(), _one_arg_hook),
            TypeError,
            "two positional arguments (state, bucket)",
            "_one_arg_hook",
            where="one argument",
        ),
        error_text(
            register(fresh(), _three_arg_hook),
            TypeError,
            "two positional arguments (state, bucket)",
            "_three_arg_hook",
            where="three arguments",
        ),
    ]

    # a refused hook leaves nothing registered: a good one is accepted next
    model = fresh()
    texts.append(error_text(register(model, 42), TypeError, where="refused first"))
    model.register_comm_hook(None, allreduce)  # raises if the refused hook was left registered

    model = fresh()
    model.register_comm_hook(None, allreduce)
    texts.append(error_text(register(model, allreduce), RuntimeError, "already registered", where="twice"))

    model = fresh()
    mlp_backward(model)
    texts.append(
        error_text(
            register(model, allreduce),
            RuntimeError,
            "already ran 1 synchronised step",
            "before the first backward",
            where="after a step",
        )
    )

    # replicate()'s own reduction options and a hook both decide the reduction
    for option, value in (("reduce_dtype", torch.bfloat16), ("gradient_divide_factor", 8.0)):
        texts.append(
            error_text(register(fresh(**{option: value}), allreduce), ValueError, f"replicate({option}=", where=option)
        )
    return texts


def test_registration_errors(pools):
    texts = pools.run(2, register_badly)
    assert texts[0] == texts[1], "the ranks raised different messages"


def register_after_step_single_rank(rank: int, world_size: int) -> None:
    """World size 1: the no-reducer fast path trains a step, then a hook is registered."""
    model = replicate(seeded(MODELS["mlp"].build, 0))
    mlp_backward(model)
    error_text(
        lambda: model.register_comm_hook(CountingState(1.0), counting_hook),
        RuntimeError,
        "before the first backward",
        where="after a step",
    )


def test_register_after_step_refused_at_world_size_1(pools):
    pools.run(1, register_after_step_single_rank)


# -- hook results that break the protocol, and hooks that raise -----------------------------


def _returns_tensor_hook(state, bucket):
    return bucket.buffer()


def _resolves_to_str_hook(state, bucket):
    return completed("averaged")


def _resolves_to_pair_hook(state, bucket):
    return completed([bucket.buffer(), bucket.buffer()])


def _resolves_short_hook(state, bucket):
    return completed(bucket.buffer()[:-1].clone())


class BadHook(NamedTuple):
    fn: Callable
    error: type
    words: tuple[str, ...]  # the message must hold each; {numel} and {short} are filled in


BAD_HOOKS = {
    "returns_tensor": BadHook(
        _returns_tensor_hook, TypeError, ("must return a torch.futures.Future", "bucket 0", "returned Tensor")
    ),
    "resolves_to_str": BadHook(_resolves_to_str_hook, TypeError, ("must resolve to a torch.Tensor", "got str")),
    "resolves_to_pair": BadHook(_resolves_to_pair_hook, TypeError, ("must resolve to a torch.Tensor", "got list")),
    "resolves_short": BadHook(
        _resolves_short_hook, ValueError, ("resolved to a tensor of {short} elements", "bucket holds {numel}")
    ),
}


def backward_with_bad_hook(rank: int, world_size: int, hook_key: str, *, tiny: bool = False) -> None:
    """Two backwards with a hook that breaks the protocol: each raises, then the group still works."""
    bad = BAD_HOOKS[hook_key]
    # tiny buckets from the first step on: the fixed layout (DDP's first step reduces one bucket)
    model = replicate(seeded(MODELS["mlp"].build, 0), **({**TINY_BUCKETS, "bucket_layout": "fixed"} if tiny else {}))
    model.register_comm_hook(None, bad.fn)
    num_buckets = len(replicate.state(model).reducer.buckets)
    if tiny:
        assert num_buckets >= 3, f"rank {rank}: tiny caps gave {num_buckets} buckets"
    else:
        assert num_buckets == 1, f"rank {rank}: {num_buckets} buckets"
    numel = sum(p.numel() for p in model.parameters())
    words = [w.format(short=numel - 1, numel=numel) for w in bad.words]
    # names the rank, the step (none completed yet) and the bucket's parameters
    first = "head.bias" if tiny else "body.0.weight"  # reverse registration order (fixed), or DDP's first bucket
    words.append(f"replicate(): rank {rank}, step 0, bucket 0 ('{first}'")
    for step in range(2):
        error_text(lambda: mlp_backward(model, step), bad.error, *words, where=f"rank {rank} backward {step}")
        model.zero_grad(set_to_none=True)
    assert_group_usable(f"rank {rank}")


@pytest.mark.parametrize("hook_key", sorted(BAD_HOOKS))
def test_bad_hook_result_raises_at_backward_on_every_rank(pools, hook_key):
    """Raised at each of two backwards on both ranks; the group stays usable."""
    pools.run(2, backward_with_bad_hook, hook_key, timeout_s=60)


def test_bad_hook_result_with_several_buckets(pools):
    """The same with tiny buckets: the error names the first bucket, on every rank."""
    pools.run(2, backward_with_bad_hook, "resolves_to_str", tiny=True, timeout_s=60)


def _raises_in_body_hook(state, bucket):
    raise IndexError("the hook gives up")


def _raises_in_callback_hook(state, bucket):
    def give_up(future):
        raise IndexError("the hook gives up")

    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(give_up)


def backward_with_raising_hook(rank: int, world_size: int, hook: Callable, error: type, message: str) -> None:
    """Two backwards with a hook that raises: each raises ``error`` with ``message``, then the group still works."""
    model = replicate(seeded(MODELS["mlp"].build, 0))
    model.register_comm_hook(None, hook)
    for step in range(2):
        error_text(lambda: mlp_backward(model, step), error, message, where=f"rank {rank} backward {step}")
        model.zero_grad(set_to_none=True)
    assert_group_usable(f"rank {rank}")


@pytest.mark.parametrize(
    "hook, error, message",
    [
        # raised by the hook itself, as batched_powerSGD_hook does in torch 2.13
        pytest.param(_raises_in_body_hook, IndexError, "the hook gives up", id="in-the-hook"),
        # raised by its future's callback, as the quantization hooks do on gloo: the future wraps it
        pytest.param(_raises_in_callback_hook, RuntimeError, "IndexError: the hook gives up", id="in-a-callback"),
    ],
)
def test_hook_exception_reaches_backward_on_every_rank(pools, hook, error, message):
    """A hook's own exception is raised by each of two backwards, on every rank; the group stays usable.

    What the quantization and batched PowerSGD tests in test_comm_hooks.py
    checked while they asserted torch's failures; they are xfails now.
    """
    pools.run(2, backward_with_raising_hook, hook, error, message, timeout_s=60)


# -- custom hooks: state, world size 1 ------------------------------------------------


class CountingState:
    """A stateful hook's state: counts calls, and scales the mean (so its effect shows)."""

    def __init__(self, scale: float) -> None:
        self.scale = scale
        self.calls = 0
        self.per_bucket: dict[int, int] = {}


def counting_hook(state: CountingState, bucket):
    if not isinstance(state, CountingState):
        raise AssertionError(f"hook got state {state!r}")
    state.calls += 1
    state.per_bucket[bucket.index()] = state.per_bucket.get(bucket.index(), 0) + 1
    buffer = bucket.buffer()
    dist.all_reduce(buffer)
    return completed(buffer.mul_(state.scale / dist.get_world_size()))


def train_with_custom_hook(
    rank: int, world_size: int, *, hook_kind: str = "counting", steps: int = 3, scale: float = 3.0, tiny: bool = True
) -> None:
    """Trains the MLP with a custom (or stock) hook; checks grads against the reference.

    ``counting``: grads must be ``scale`` times the mean, and the hook called
    once per bucket per step; ``allreduce``: the stock allreduce_hook, grads
    the mean.
    """
    build, make_batch, loss_of = MODELS["mlp"]
    model = seeded(build, 100 + rank)
    reference = seeded(build, 100)
    replicate(model, **(TINY_BUCKETS if tiny else {}))
    if hook_kind == "counting":
        state = CountingState(scale)
        model.register_comm_hook(state, counting_hook)
        factor = scale
    else:
        model.register_comm_hook(None, default_hooks.allreduce_hook)
        factor = 1.0
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        with torch.no_grad():
            for p, q in zip(model.parameters(), reference.parameters()):
                q.copy_(p)
        batch = make_batch(torch.Generator().manual_seed(step), PER_RANK * world_size)
        local = local_shard(batch, rank)
        loss_of(model(local), local).backward()
        reference.zero_grad(set_to_none=True)
        loss_of(reference(batch), batch).backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(
                p.grad, q.grad * factor, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} step {step} {name}: {m}"
            )
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert_replicas_identical(model, f"after {steps} steps")
    num_buckets = len(replicate.state(model).reducer.buckets)
    assert (num_buckets >= 3) is tiny, f"rank {rank}: {num_buckets} buckets with tiny={tiny}"
    if hook_kind == "counting":  # the first step reduced one bucket (DDP's first iteration), the later ones all
        first = 1
        calls = first + (steps - 1) * num_buckets
        assert state.calls == calls, f"rank {rank}: {state.calls} calls, {num_buckets} buckets"
        per_bucket = {i: steps - 1 + (i < first) for i in range(num_buckets)}
        assert state.per_bucket == per_bucket, f"rank {rank}: calls {state.per_bucket}"


def test_stateful_hook_gets_its_state(pools):
    """A hook counting calls in its state, scaling the mean by state.scale = 3."""
    pools.run(2, train_with_custom_hook, steps=3, scale=3.0)


@pytest.mark.parametrize(
    "hook_kind, tiny",
    [
        pytest.param("counting", True, id="custom-hook-tiny-buckets"),
        pytest.param("counting", False, id="custom-hook"),
        pytest.param("allreduce", False, id="allreduce_hook"),
    ],
)
def test_world_size_1_hook_runs(pools, hook_kind, tiny):
    """One rank, no reduction needed, but a registered hook still sees every bucket."""
    pools.run(1, train_with_custom_hook, hook_kind=hook_kind, steps=3, scale=3.0, tiny=tiny, timeout_s=60)


# -- hooks meeting the reducer's own bookkeeping --------------------------------------------


class ChainState:
    """State of ``chained_collective_hook``: the size of its second collective, what it got."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.markers: list[list[float]] = []


def chained_collective_hook(state: ChainState, bucket):
    """All-reduces the bucket, then, from the future's callback, a second tensor.

    PowerSGD and the quantization hooks have this shape: their later
    collectives are launched from ``then`` callbacks, whenever the earlier
    ones complete. Here rank 0 plays a rank whose first collective has
    already completed when the hook returns (the chained collective goes out
    before the hook returns) and rank 1 a rank where it completes later
    (from gloo's thread, 0.3 s on). Both timings are legal; each rank still
    launches the same collectives in the same order *within the hook*.
    The second tensor (all 1000.0) has the size of the reducer's tail
    all-reduce, so a collision swaps data instead of crashing gloo.
    """
    world_size = dist.get_world_size()
    rank = dist.get_rank()
    buffer = bucket.buffer()
    first = dist.all_reduce(buffer, async_op=True).get_future()

    def second(fut):
        if rank != 0:
            time.sleep(0.3)
        marker = torch.full((state.size,), 1000.0)
        dist.all_reduce(marker)
        state.markers.append(marker.tolist())
        return fut.value()[0].div_(world_size)

    if rank == 0:
        first.wait()
    return first.then(second)


def chained_collective_run(rank: int, world_size: int) -> None:
    build, make_batch, loss_of = MODELS["mlp"]
    model = seeded(build, 100 + rank)
    reference = seeded(build, 100)
    replicate(model)
    state = ChainState(len(list(model.parameters())) + 1)
    model.register_comm_hook(state, chained_collective_hook)
    batch = make_batch(torch.Generator().manual_seed(0), PER_RANK * world_size)
    local = local_shard(batch, rank)
    loss_of(model(local), local).backward()
    loss_of(reference(batch), batch).backward()
    assert state.markers and all(v == 1000.0 * world_size for v in state.markers[0]), (
        f"rank {rank}: the hook's all-reduce got {state.markers}"
    )
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(
            p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank}: wrong gradient {name}: {m}"
        )


def test_hook_collectives_from_callbacks_do_not_meet_the_tail(pools):
    """A hook launching a second collective from its future's callback (as PowerSGD does).

    Rank 0's chain launches it before the hook returns, rank 1's 0.3 s
    later; the hook's second all-reduce must pair with the other rank's
    second all-reduce (every element 2000), never with the reducer's tail.
    """
    pools.run(2, chained_collective_run, timeout_s=60)


class SometimesUsed(nn.Module):
    """``extra`` takes part in the loss on rank 1 only: unused on rank 0."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.extra = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        h = self.body(x)
        return self.extra(h) if use_extra else h


PAD = 16  # more than the reducer's tail (num_params + 1 = 5 here)


def padding_hook(state, bucket):
    """All-reduce, after padding the buffer in place as ``batched_powerSGD_hook`` does.

    batched_powerSGD_hook pads ``bucket.buffer()`` to a square with
    ``resize_`` and zero-fills the padding (and later writes the low-rank
    product over it), then resizes it back. The padding is the hook's own
    scratch space; the bucket's gradients are untouched.
    """
    buffer = bucket.buffer()
    numel = buffer.numel()
    buffer.resize_(numel + PAD)
    buffer[numel:].fill_(0)
    buffer.resize_(numel)
    dist.all_reduce(buffer)
    return completed(buffer.div_(dist.get_world_size()))


def sometimes_used_step(rank: int, world_size: int, *, hook: bool) -> None:
    """One step where ``extra`` is used on rank 1 only: its mean reaches every rank."""
    model = seeded(SometimesUsed, 100 + rank)
    replicate(model)
    if hook:
        model.register_comm_hook(None, padding_hook)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    model(x, use_extra=rank == 1).pow(2).mean().backward()
    assert model.extra.weight.grad is not None, f"rank {rank}: lost the gradient of extra.weight, which rank 1 used"
    assert_same_on_every_rank(model.extra.weight.grad, "extra.weight.grad")
    assert_same_on_every_rank(model.body.weight.grad, "body.weight.grad")


def test_padding_hook_reference_without_hook(pools):
    """Baseline for the next test: without a hook, the sometimes-used parameter is averaged."""
    pools.run(2, sometimes_used_step, hook=False)


def test_hook_padding_its_buffer_keeps_unused_parameter_flags(pools):
    """A hook that pads buffer() in place (batched_powerSGD_hook's way) changes no decision."""
    pools.run(2, sometimes_used_step, hook=True)
