"""Bad input gets a clear error naming the option, the value and the fix."""

import warnings

import pytest
import torch
from torch import nn

from models import MLP
from torchreplicate import replicate


@pytest.mark.parametrize("device_id", ["cpu", 1.5, [0], object()])
def test_device_id_type(device_id):
    # a TypeError (ours) and a RuntimeError (the seed's), the seed's text first
    with pytest.raises(TypeError) as info:
        replicate(MLP(), device_id=device_id)
    assert isinstance(info.value, RuntimeError)
    message = str(info.value)
    assert message.startswith(
        f"Expected device_id to be int or torch.device, but got {type(device_id)}. "
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
        ({"broadcast_buffers": 1}, TypeError, "broadcast_buffers must be True or False, got 1"),
        (
            {"bucket_layout": "sorted"},
            ValueError,
            "bucket_layout must be one of 'learned', 'fixed', 'tuned', got 'sorted'",
        ),
        ({"tied_split": "yes"}, TypeError, "tied_split must be True, False or None, got 'yes'"),
        ({"gradient_as_bucket_view": 1}, TypeError, "gradient_as_bucket_view must be True or False, got 1"),
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


def test_ddps_layout_flags_are_taken_without_a_warning():
    # find_unused_parameters / static_graph choose DDP's bucket layout for them (tests/test_ddp_bits.py)
    for option in ("find_unused_parameters", "static_graph"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(RuntimeError, match="init_process_group"):
                replicate(MLP(), **{option: True})


def shapes_differ(rank, world_size):
    with pytest.raises(RuntimeError) as info:
        replicate(MLP(width=32 if rank == 0 else 16))
    message = str(info.value)
    expected = (f"rank {rank}:", "'body.0.weight'", "rank 0: shape [32, 32] float32", "rank 1: shape [16, 16] float32")
    for words in expected:
        assert words in message, f"rank {rank}: {words!r} missing from {message!r}"


def test_shape_mismatch_raises_on_every_rank(pools):
    pools.run(2, shapes_differ)


def counts_differ(rank, world_size):
    # depth 2 vs 3: same names up to body.2, then rank 1 has body.4 where others have head
    with pytest.raises(RuntimeError) as info:
        replicate(MLP(depth=3 if rank == 1 else 2))
    assert "rank 1" in str(info.value), f"rank {rank}: 'rank 1' missing from {str(info.value)!r}"


def test_count_mismatch_raises_on_every_rank(pools):
    pools.run(3, counts_differ)


def dtypes_differ(rank, world_size):
    model = MLP()
    if rank == 1:
        model.head.double()
    with pytest.raises(RuntimeError) as info:
        replicate(model)
    for words in ("'head.weight'", "float64"):
        assert words in str(info.value), f"rank {rank}: {words!r} missing from {str(info.value)!r}"


def test_dtype_mismatch_raises_on_every_rank(pools):
    pools.run(2, dtypes_differ)
