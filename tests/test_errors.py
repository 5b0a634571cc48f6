"""Bad input gets a clear error naming the option, the value and the fix."""

import pytest
import torch
from torch import nn

from models import MLP
from torchreplicate import replicate


@pytest.mark.parametrize("device_id", ["cpu", 1.5, [0], object()])
def test_device_id_type(device_id):
    with pytest.raises(TypeError) as info:
        replicate(MLP(), device_id=device_id)
    message = str(info.value)
    assert message.startswith(
        "replicate(): device_id must be an int (accelerator index, e.g. LOCAL_RANK) or a torch.device"
    )
    assert f"got {device_id!r} ({type(device_id).__name__})" in message
    assert "pass e.g. torch.device('cpu') or 0" in message


def test_not_a_module():
    with pytest.raises(TypeError, match="expected an nn.Module, got Tensor"):
        replicate(torch.zeros(3))


@pytest.mark.parametrize(
    "options, error, message",
    [
        ({"bucket_cap_mb": 0}, ValueError, "bucket_cap_mb must be a positive number of MiB, got 0"),
        ({"bucket_cap_mb": "25"}, ValueError, "bucket_cap_mb must be a positive number of MiB, got '25'"),
        ({"first_bucket_cap_mb": -1}, ValueError, "first_bucket_cap_mb must be a positive"),
        ({"gradient_as_bucket_view": 1}, TypeError, "gradient_as_bucket_view must be True or False, got 1"),
        ({"broadcast_buffers": None}, TypeError, "broadcast_buffers must be True or False, got None"),
        (
            {"ignored_modules": [nn.Linear(2, 2), "head"]},
            TypeError,
            "ignored_modules must hold nn.Module objects, got str",
        ),
        ({"process_group": "world"}, TypeError, "process_group must be a torch.distributed.ProcessGroup"),
    ],
)
def test_bad_option_values(options, error, message):
    with pytest.raises(error, match=message.replace("(", "\\(").replace(")", "\\)")):
        replicate(MLP(), **options)


def test_needs_an_initialized_process_group():
    model = MLP()
    with pytest.raises(RuntimeError, match="init_process_group"):
        replicate(model)
    # the failed call left nothing behind: no state, no class change, no hooks
    with pytest.raises(ValueError, match="not managed"):
        replicate.state(model)
    assert type(model) is MLP
    assert not model._forward_pre_hooks and not model._forward_hooks


def test_ddp_only_flags_warn():
    with pytest.warns(UserWarning, match="find_unused_parameters=True has no effect"):
        with pytest.raises(RuntimeError, match="init_process_group"):
            replicate(MLP(), find_unused_parameters=True)
    with pytest.warns(UserWarning, match="static_graph=True has no effect"):
        with pytest.raises(RuntimeError, match="init_process_group"):
            replicate(MLP(), static_graph=True)


def _rank_model(rank, variant):
    # each variant builds a model that differs on one rank
    if variant == "shapes":
        return MLP(width=32 if rank == 0 else 16)
    if variant == "count":
        return MLP(depth=3 if rank == 1 else 2)
    model = MLP()
    if variant == "dtype" and rank == 1:
        model.head.double()
    return model


def mismatch_error(rank, world_size, variant):
    """The message replicate() raises on this rank (None if it did not raise)."""
    try:
        replicate(_rank_model(rank, variant))
    except RuntimeError as error:
        return str(error)
    return None


def test_shape_mismatch_raises_on_every_rank(pools):
    messages = pools.run(2, mismatch_error, "shapes")
    for rank, message in enumerate(messages):
        assert message is not None, f"rank {rank} did not raise"
        assert f"rank {rank}:" in message
        assert "'body.0.weight'" in message
        assert "rank 0: shape [32, 32] float32" in message and "rank 1: shape [16, 16] float32" in message


def test_count_mismatch_raises_on_every_rank(pools):
    messages = pools.run(3, mismatch_error, "count")
    assert all(m is not None for m in messages)
    # depth 2 vs 3: same names up to body.2, then rank 1 has body.4 where others have head
    assert all("rank 1" in m for m in messages)


def test_dtype_mismatch_raises_on_every_rank(pools):
    messages = pools.run(2, mismatch_error, "dtype")
    assert all(m is not None and "'head.weight'" in m and "float64" in m for m in messages)
