"""Rank-side code of test_comm_hooks.py: hooks, models and per-rank training runs.

Everything here is module level so the spawned gloo ranks can import it, and
every run returns plain picklable values. Exceptions raised by training (a
hook refused, a stock hook failing on gloo) are caught on the rank and
returned as text, so an error that every rank raised at the same point does
not cost a pool restart; the test asserts on the text.
"""

from __future__ import annotations

import time
import traceback
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import (
    debugging_hooks,
    default_hooks,
    powerSGD_hook,
    quantization_hooks,
)

from models import MODELS
from parity import PER_RANK, digest, seeded
from torchreplicate import replicate

TINY = {"bucket_cap_mb": 0.001, "first_bucket_cap_mb": 0.0005}  # several buckets for the MLP

# Unit roundoff (half an ulp at 1.0) of the compressed formats: fp16 keeps 11
# significant bits, bf16 keeps 8.
UNIT_ROUNDOFF = {"fp16": 2.0**-11, "bf16": 2.0**-8}


# -- stock hooks ----------------------------------------------------------------


def powersgd_state(process_group=None) -> powerSGD_hook.PowerSGDState:
    return powerSGD_hook.PowerSGDState(
        process_group=process_group,
        matrix_approximation_rank=1,
        start_powerSGD_iter=2,
        use_error_feedback=True,
        warm_start=True,
    )


def make_hook(name: str) -> tuple[Any, Callable]:
    """(state, hook) of a stock hook, built on the rank (groups do not pickle)."""
    if name == "allreduce_none":
        return None, default_hooks.allreduce_hook
    if name == "allreduce_group":
        return dist.group.WORLD, default_hooks.allreduce_hook
    if name == "fp16":
        return None, default_hooks.fp16_compress_hook
    if name == "bf16":
        return None, default_hooks.bf16_compress_hook
    if name == "fp16_wrapper":
        return None, default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook)
    if name == "bf16_wrapper":
        return None, default_hooks.bf16_compress_wrapper(default_hooks.allreduce_hook)
    if name == "powerSGD":
        return powersgd_state(), powerSGD_hook.powerSGD_hook
    if name == "batched_powerSGD":
        return powersgd_state(), powerSGD_hook.batched_powerSGD_hook
    if name == "quant_pertensor":
        return None, quantization_hooks.quantization_pertensor_hook
    if name == "quant_perchannel":
        return None, quantization_hooks.quantization_perchannel_hook
    if name == "noop":
        return None, debugging_hooks.noop_hook
    raise KeyError(name)


def completed(value: Any):
    """A ``torch.futures.Future`` already holding ``value``."""
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(value)
    return future


def _error_text() -> str:
    return traceback.format_exc()


# -- gradients against a single-process reference ---------------------------------


def _grads(module: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in module.parameters()]


def _reference_grads(reference: nn.Module, loss_of, batch: torch.Tensor, world_size: int):
    """The global-batch gradient, and each rank's local gradient, at the current point."""
    reference.zero_grad(set_to_none=True)
    loss_of(reference(batch), batch).backward()
    global_grads = _grads(reference)
    shard_grads = []
    for r in range(world_size):
        reference.zero_grad(set_to_none=True)
        shard = batch[r * PER_RANK : (r + 1) * PER_RANK]
        loss_of(reference(shard), shard).backward()
        shard_grads.append(_grads(reference))
    return global_grads, shard_grads


def _check_grads(model, global_grads, shard_grads, compare: str, where: str) -> dict[str, float]:
    """Asserts the replica's grads are what ``compare`` promises; returns error statistics.

    ``exact``: the all-reduce mean, as the default path gives: within
    parity.py's rtol 1e-5 / atol 1e-6 of the global-batch reference, and
    bitwise the mean of the ranks' local gradients.

    ``fp16`` / ``bf16``: the hook rounds each rank's gradient (divided by the
    world size, exact for 2) to the compressed format and the sum back to it:
    two roundings of relative size at most u (u = 2^-11 for fp16, 2^-8 for
    bf16), so |g - ref| <= 2u * mean_r |g_r| up to u^2 terms. Measured
    against the rank gradients, not the mean, since the mean may cancel. We
    allow 3u * mean_r |g_r| + 1e-6; the absolute term covers fp16 subnormals
    (spacing 2^-24) and the fp32 reference's own rounding.

    ``local``: no reduction at all (noop hook): exactly this rank's gradient.
    """
    ratio = 0.0
    differs = False
    rank = dist.get_rank()
    for (name, p), ref, *shards in zip(model.named_parameters(), global_grads, *shard_grads):
        assert p.grad is not None, f"{where}: {name}.grad is None"
        if compare == "exact":
            torch.testing.assert_close(p.grad, ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{where}: {name}: {m}")
            # bitwise what the default path gives: the sum of the ranks' local
            # gradients over the world size (each halved first, as the hook
            # does: exact for a power-of-2 world size)
            mean = sum(shard / len(shards) for shard in shards)
            assert torch.equal(p.grad, mean), f"{where}: {name}: not bitwise the mean of the local gradients"
        elif compare == "local":
            torch.testing.assert_close(p.grad, shards[rank], rtol=0, atol=0, msg=lambda m: f"{where}: {name}: {m}")
        else:
            u = UNIT_ROUNDOFF[compare]
            scale = torch.stack([s.abs() for s in shards]).mean(0)
            bound = 3 * u * scale + 1e-6
            error = (p.grad - ref).abs()
            worst = float((error / bound).max())
            assert worst <= 1.0, (
                f"{where}: {name}: {compare} gradient off by {float(error.max()):.3g}, "
                f"more than 3u * mean|g_r| + 1e-6 allows (worst ratio {worst:.3f})"
            )
            ratio = max(ratio, worst)
            differs = differs or not torch.equal(p.grad, ref)
    return {"worst_ratio": ratio, "differs": differs}


def _replica_backward(model, reference, make_batch, loss_of, rank, world_size, step):
    """Points the reference at the replica's parameters, runs the replica's
    backward on this rank's shard; returns (global batch, error text or None)."""
    with torch.no_grad():
        for p, q in zip(model.parameters(), reference.parameters()):
            q.copy_(p)
    batch = make_batch(torch.Generator().manual_seed(step), PER_RANK * world_size)
    local = batch[rank * PER_RANK : (rank + 1) * PER_RANK]
    try:
        loss_of(model(local), local).backward()
    except Exception:
        return batch, _error_text()
    return batch, None


def train_with_hook(
    rank: int,
    world_size: int,
    hook_name: str,
    *,
    compare: str = "exact",
    model_name: str = "mlp",
    steps: int = 4,
    replicate_kwargs: Optional[dict] = None,
) -> dict[str, Any]:
    """Trains the replica with a stock hook; checks its grads every step.

    The reference takes the replica's parameters before each step, so every
    step compares gradients at the same point even when the hook is lossy.
    Returns the per-step parameter digests (equal across ranks iff the
    replicas stayed bitwise identical), or the error a step raised.
    """
    build, make_batch, loss_of = MODELS[model_name]
    model = seeded(build, 100 + rank)
    reference = seeded(build, 100)
    replicate(model, **(replicate_kwargs or {}))
    model.register_comm_hook(*make_hook(hook_name))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    digests, worst, differs = [], 0.0, False
    for step in range(steps):
        batch, error = _replica_backward(model, reference, make_batch, loss_of, rank, world_size, step)
        if error is not None:
            return {"error": error, "step": step}
        global_grads, shard_grads = _reference_grads(reference, loss_of, batch, world_size)
        stats = _check_grads(model, global_grads, shard_grads, compare, f"rank {rank} step {step}")
        worst, differs = max(worst, stats["worst_ratio"]), differs or stats["differs"]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        digests.append(digest(model))
    reducer = replicate.state(model).reducer
    return {"digests": digests, "worst_ratio": worst, "differs": differs, "num_buckets": len(reducer.buckets)}


# -- PowerSGD on a regression task ------------------------------------------------


class DeepLinear(nn.Module):
    """Two matrices (compressed by PowerSGD) and two biases (sent uncompressed)."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(32, 32)
        self.out = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.hidden(x))


def regression_data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank's fixed 64 samples of y = x A^T for one teacher A shared by all ranks."""
    teacher = torch.randn(8, 32, generator=torch.Generator().manual_seed(7)) / 32**0.5
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1000 + rank))
    return x, x @ teacher.T


def powersgd_regression(rank: int, world_size: int, hook_name: str, *, steps: int = 100) -> dict[str, Any]:
    """Full-batch SGD on the regression with a PowerSGD hook.

    Returns the local losses (first, last) and per-step digests, or the error
    and the step it happened at.
    """
    model = seeded(DeepLinear, 100 + rank)
    replicate(model)
    state, hook = make_hook(hook_name)
    model.register_comm_hook(state, hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
    x, y = regression_data(rank)
    losses, digests = [], []
    for step in range(steps):
        loss = (model(x) - y).pow(2).mean()
        try:
            loss.backward()
        except Exception:
            return {"error": _error_text(), "step": step, "losses": losses, "digests": digests}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        digests.append(digest(model))
    return {
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "digests": digests,
        "state_iter": state.iter,
        "compressed_buckets": sorted(state.p_memory_dict),
    }


# -- hooks that fail on gloo: the same model under DDP, for comparison ---------------


def first_backward_error(rank: int, world_size: int, hook_name: str, *, ddp: bool) -> dict[str, Any]:
    """Registers a stock hook on the MLP (replicate or DDP) and runs three steps.

    Returns the first error (text and step) or None, and whether the process
    group still works afterwards (an all-reduce gives the right sum).
    """
    from torch.nn.parallel import DistributedDataParallel

    build, make_batch, loss_of = MODELS["mlp"]
    model = seeded(build, 100)
    if ddp:
        model = DistributedDataParallel(model)
    else:
        replicate(model)
    model.register_comm_hook(*make_hook(hook_name))
    error, step = None, None
    for step in range(3):
        batch = make_batch(torch.Generator().manual_seed(step), PER_RANK)
        try:
            loss_of(model(batch), batch).backward()
        except Exception:
            error = _error_text()
            break
        model.zero_grad(set_to_none=True)
    return {"error": error, "step": step, "group_ok": _group_ok(rank, world_size)}


def _group_ok(rank: int, world_size: int) -> bool:
    probe = torch.full((3,), float(rank + 1))
    dist.all_reduce(probe)
    return bool(torch.equal(probe, torch.full((3,), world_size * (world_size + 1) / 2)))


# -- what a hook is handed: bucket order, is_last, parameters and gradient views --------


class Recorder:
    """Hook state: what every call saw, and the local gradients to expect."""

    def __init__(self, names: dict[int, str]) -> None:
        self.names = names  # id(param) -> name
        self.expected: dict[str, torch.Tensor] = {}  # name -> this rank's local gradient
        self.calls: list[dict[str, Any]] = []


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
    state.calls.append({"index": bucket.index(), "is_last": bucket.is_last(), "names": names, "problems": problems})
    dist.all_reduce(buffer)
    return completed(buffer.div_(dist.get_world_size()))


def trace_buckets(
    rank: int, world_size: int, *, steps: int = 3, gradient_as_bucket_view: bool = True
) -> dict[str, Any]:
    """Trains the MLP with tiny buckets under the recording hook; returns the trace."""
    build, make_batch, loss_of = MODELS["mlp"]
    model = seeded(build, 100 + rank)
    shadow = seeded(build, 0)  # a plain copy: this rank's local gradients
    replicate(model, gradient_as_bucket_view=gradient_as_bucket_view, **TINY)
    names = {id(p): name for name, p in model.named_parameters()}
    recorder = Recorder(names)
    model.register_comm_hook(recorder, recording_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    per_step = []
    for step in range(steps):
        batch = make_batch(torch.Generator().manual_seed(step), PER_RANK * world_size)
        local = batch[rank * PER_RANK : (rank + 1) * PER_RANK]
        with torch.no_grad():
            for p, q in zip(model.parameters(), shadow.parameters()):
                q.copy_(p)
        shadow.zero_grad(set_to_none=True)
        loss_of(shadow(local), local).backward()
        recorder.expected = {
            name: q.grad.clone() for (name, _), q in zip(model.named_parameters(), shadow.parameters())
        }
        recorder.calls = []
        loss_of(model(local), local).backward()
        per_step.append(recorder.calls)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {
        "steps": per_step,
        "param_names": [name for name, _ in model.named_parameters()],
        "num_buckets": len(replicate.state(model).reducer.buckets),
        "digest": digest(model),
    }


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


def counting_hook_run(
    rank: int, world_size: int, *, hook_kind: str = "counting", steps: int = 3, scale: float = 3.0, tiny: bool = True
) -> dict[str, Any]:
    """Trains the MLP with a custom (or stock) hook; checks grads against the reference.

    ``counting``: grads must be ``scale`` times the mean; ``allreduce``: the
    stock allreduce_hook, grads the mean.
    """
    build, make_batch, loss_of = MODELS["mlp"]
    model = seeded(build, 100 + rank)
    reference = seeded(build, 100)
    replicate(model, **(TINY if tiny else {}))
    if hook_kind == "counting":
        state = CountingState(scale)
        model.register_comm_hook(state, counting_hook)
        factor = scale
    else:
        state = None
        model.register_comm_hook(None, default_hooks.allreduce_hook)
        factor = 1.0
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        batch, error = _replica_backward(model, reference, make_batch, loss_of, rank, world_size, step)
        if error is not None:
            return {"error": error, "step": step}
        reference.zero_grad(set_to_none=True)
        loss_of(reference(batch), batch).backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(
                p.grad, q.grad * factor, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} step {step} {name}: {m}"
            )
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    reducer = replicate.state(model).reducer
    out = {"num_buckets": len(reducer.buckets), "digest": digest(model)}
    if state is not None:
        out.update(calls=state.calls, per_bucket=state.per_bucket)
    return out


# -- errors ------------------------------------------------------------------------


def _one_arg_hook(bucket):  # wrong signature: no state
    raise AssertionError("never called")


def _three_arg_hook(state, bucket, extra):  # wrong signature: a required third argument
    raise AssertionError("never called")


def _returns_tensor_hook(state, bucket):
    return bucket.buffer()


def _resolves_to_str_hook(state, bucket):
    return completed("averaged")


def _resolves_to_pair_hook(state, bucket):
    return completed([bucket.buffer(), bucket.buffer()])


def _resolves_short_hook(state, bucket):
    return completed(bucket.buffer()[:-1].clone())


BAD_RESULT_HOOKS = {
    "returns_tensor": _returns_tensor_hook,
    "resolves_to_str": _resolves_to_str_hook,
    "resolves_to_pair": _resolves_to_pair_hook,
    "resolves_short": _resolves_short_hook,
}


def registration_errors(rank: int, world_size: int) -> dict[str, str]:
    """Bad registrations, each on a fresh replica; returns 'Type: message' per case."""
    build, make_batch, loss_of = MODELS["mlp"]
    seen: dict[str, str] = {}

    def attempt(key: str, model, state, hook) -> None:
        try:
            model.register_comm_hook(state, hook)
        except Exception as error:  # the test checks type and text
            seen[key] = f"{type(error).__name__}: {error}"
        else:
            seen[key] = "no error"

    attempt("not_callable", replicate(seeded(build, 0)), None, 42)
    attempt("one_arg", replicate(seeded(build, 0)), None, _one_arg_hook)
    attempt("three_args", replicate(seeded(build, 0)), None, _three_arg_hook)

    # a refused hook leaves nothing registered: a good one is accepted next
    model = replicate(seeded(build, 0))
    attempt("refused_then_good_first", model, None, 42)
    attempt("refused_then_good", model, None, default_hooks.allreduce_hook)

    model = replicate(seeded(build, 0))
    model.register_comm_hook(None, default_hooks.allreduce_hook)
    attempt("twice", model, None, default_hooks.allreduce_hook)

    model = replicate(seeded(build, 0))
    batch = make_batch(torch.Generator().manual_seed(0), PER_RANK)
    loss_of(model(batch), batch).backward()
    attempt("after_step", model, None, default_hooks.allreduce_hook)

    # replicate()'s own reduction options and a hook both decide the reduction
    attempt(
        "reduce_dtype", replicate(seeded(build, 0), reduce_dtype=torch.bfloat16), None, default_hooks.allreduce_hook
    )
    attempt(
        "divide_factor", replicate(seeded(build, 0), gradient_divide_factor=8.0), None, default_hooks.allreduce_hook
    )
    return seen


def bad_result_errors(rank: int, world_size: int, hook_key: str, *, tiny: bool = False) -> dict[str, Any]:
    """Two backwards with a hook that breaks the protocol; the errors, then a group check."""
    build, make_batch, loss_of = MODELS["mlp"]
    model = replicate(seeded(build, 0), **(TINY if tiny else {}))
    model.register_comm_hook(None, BAD_RESULT_HOOKS[hook_key])
    numel = sum(p.numel() for p in model.parameters())
    errors = []
    for step in range(2):
        batch = make_batch(torch.Generator().manual_seed(step), PER_RANK)
        try:
            loss_of(model(batch), batch).backward()
        except Exception as error:  # the test checks type and text
            errors.append(f"{type(error).__name__}: {error}")
        else:
            errors.append("no error")
        model.zero_grad(set_to_none=True)
    return {
        "errors": errors,
        "group_ok": _group_ok(rank, world_size),
        "numel": numel,
        "num_buckets": len(replicate.state(model).reducer.buckets),
    }


def register_after_step_single_rank(rank: int, world_size: int) -> str:
    """World size 1: the no-reducer fast path trains a step, then a hook is registered."""
    build, make_batch, loss_of = MODELS["mlp"]
    model = replicate(seeded(build, 0))
    batch = make_batch(torch.Generator().manual_seed(0), PER_RANK)
    loss_of(model(batch), batch).backward()
    try:
        model.register_comm_hook(CountingState(1.0), counting_hook)
    except Exception as error:  # the test checks type and text
        return f"{type(error).__name__}: {error}"
    return "no error"


# -- hooks whose behaviour collides with the reducer's own bookkeeping ---------------------


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


def chained_collective_run(rank: int, world_size: int, *, ddp: bool = False) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    build, make_batch, loss_of = MODELS["mlp"]
    model = seeded(build, 100 + rank)
    reference = seeded(build, 100)
    if ddp:
        model = DistributedDataParallel(model)
    else:
        replicate(model)
    num_params = len(list(model.parameters()))
    state = ChainState(num_params + 1)
    model.register_comm_hook(state, chained_collective_hook)
    batch = make_batch(torch.Generator().manual_seed(0), PER_RANK * world_size)
    local = batch[rank * PER_RANK : (rank + 1) * PER_RANK]
    try:
        loss_of(model(local), local).backward()
    except Exception:
        return {"error": _error_text()}
    loss_of(reference(batch), batch).backward()
    grads_ok = all(
        torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6) for p, q in zip(model.parameters(), reference.parameters())
    )
    return {"markers": state.markers, "grads_ok": grads_ok}


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


def padding_hook_run(rank: int, world_size: int, *, hook: bool = True) -> dict[str, Any]:
    """One step where ``extra`` is used on rank 1 only; returns its grad on each rank."""
    model = seeded(SometimesUsed, 100 + rank)
    replicate(model)
    if hook:
        model.register_comm_hook(None, padding_hook)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    model(x, use_extra=rank == 1).pow(2).mean().backward()
    grad = model.extra.weight.grad
    # what the mean must be: rank 1's gradient of extra / world_size (rank 0 contributes 0)
    return {"extra_grad": None if grad is None else grad.tolist(), "body_grad": model.body.weight.grad.tolist()}
