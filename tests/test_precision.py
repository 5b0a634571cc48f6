"""reduce_dtype, sums and divide factors, and the global-token-count recipe."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from models import MLP, MODELS
from parity import PER_RANK, assert_replicas_identical, local_shard, seeded, sgd_step
from torchreplicate import replicate


def reduce_in(rank, world_size, *, dtype_name, tolerance, model_name="mlp") -> float:
    """Three steps with gradients sent in ``dtype_name``; returns the worst relative error.

    The error of every gradient against the fp32 single-process reference,
    relative to the reference's largest entry, must stay within ``tolerance``.
    """
    build, make_batch, loss_of = MODELS[model_name]
    model = seeded(build, 100)
    reference = seeded(build, 100)
    replicate(model, reduce_dtype=getattr(torch, dtype_name), bucket_cap_mb=0.01, first_bucket_cap_mb=0.005)
    worst = 0.0
    for step in range(3):
        batch = make_batch(torch.Generator().manual_seed(step), PER_RANK * world_size)
        local = local_shard(batch, rank)
        loss_of(model(local), local).backward()
        loss_of(reference(batch), batch).backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            where = f"rank {rank} step {step} {name}"
            assert p.grad.dtype == p.dtype, f"{where}: .grad is {p.grad.dtype}, the parameter {p.dtype}"
            scale = q.grad.abs().max().item() + 1e-12
            error = (p.grad - q.grad).abs().max().item() / scale
            assert error <= tolerance, f"{where}: relative error {error:.2e} above {tolerance:.2e}"
            worst = max(worst, error)
            with torch.no_grad():
                q.grad.copy_(p.grad)  # continue from the same point: errors do not compound
        sgd_step(model, reference)
    assert_replicas_identical(model, f"reduce_dtype={dtype_name}, after 3 steps")
    wires = {str(w.dtype) for w in replicate.state(model).reducer.reduction.wires}
    assert wires == {f"torch.{dtype_name}"}, f"rank {rank}: gradients travelled in {wires}"
    return worst


@pytest.mark.parametrize(
    "dtype_name, tolerance",
    [
        ("float32", 1e-5),  # same dtype: only summation order differs
        ("bfloat16", 2**-7),  # 8 mantissa bits: one rounding on the way, one on the sum
        ("float16", 2**-9),  # 11 mantissa bits
    ],
)
@pytest.mark.parametrize("world_size", [2, 3])
def test_reduce_dtype_close_to_fp32_reference(pools, world_size, dtype_name, tolerance):
    pools.run(world_size, reduce_in, dtype_name=dtype_name, tolerance=tolerance)


def test_bf16_really_rounds(pools):
    # the bf16 wire must show its rounding: an error of exactly zero would mean fp32 travelled
    worst = pools.run(2, reduce_in, dtype_name="bfloat16", tolerance=2**-7)[0]
    assert worst > 1e-6


def summed(rank, world_size):
    build, make_batch, loss_of = MODELS["mlp"]
    model = seeded(build, 100)
    reference = seeded(build, 100)
    replicate(model, gradient_divide_factor=1)
    batch = make_batch(torch.Generator().manual_seed(0), PER_RANK * world_size)
    local = local_shard(batch, rank)
    loss_of(model(local), local).backward()
    loss_of(reference(batch), batch).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(
            p.grad, q.grad * world_size, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank}: {name} is not the sum: {m}"
        )


def test_divide_factor_one_is_a_sum(pools):
    pools.run(2, summed)


def token_normalised(rank, world_size):
    """Ranks hold different token counts; the loss is the mean over all tokens."""
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    reference = nn.Linear(6, 3)
    reference.load_state_dict(model.state_dict())
    replicate(model, gradient_divide_factor=1)
    counts = [3 + 4 * r for r in range(world_size)]  # uneven on purpose
    generator = torch.Generator().manual_seed(1)
    shards = [(torch.randn(n, 6, generator=generator), torch.randint(0, 3, (n,), generator=generator)) for n in counts]
    x, y = shards[rank]
    num_tokens = torch.tensor([float(len(y))])
    dist.all_reduce(num_tokens)  # the recipe: global token count first ...
    loss = nn.functional.cross_entropy(model(x), y, reduction="sum") / num_tokens  # ... then scale
    loss.backward()
    all_x = torch.cat([s[0] for s in shards])
    all_y = torch.cat([s[1] for s in shards])
    nn.functional.cross_entropy(reference(all_x), all_y).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank}: {name}: {m}")


@pytest.mark.parametrize("world_size", [2, 3])
def test_global_token_count_recipe(pools, world_size):
    pools.run(world_size, token_normalised)


def hook_with_reduce_dtype(rank, world_size):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    model = seeded(MLP, 0)
    replicate(model, reduce_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="reduce_dtype") as info:
        model.register_comm_hook(None, allreduce_hook)
    assert "drop reduce_dtype" in str(info.value), f"rank {rank}: {info.value}"


def test_comm_hook_and_reduce_dtype_refused(pools):
    pools.run(2, hook_with_reduce_dtype)


@pytest.mark.parametrize(
    "options, error, message",
    [
        ({"reduce_dtype": torch.int32}, TypeError, "reduce_dtype must be a floating torch.dtype"),
        ({"reduce_dtype": "bf16"}, TypeError, "reduce_dtype must be a floating torch.dtype"),
        ({"gradient_divide_factor": 0}, ValueError, "gradient_divide_factor must be a positive number"),
        ({"gradient_divide_factor": True}, ValueError, "gradient_divide_factor must be a positive number"),
    ],
)
def test_bad_precision_options(options, error, message):
    with pytest.raises(error, match=message):
        replicate(MLP(), **options)
