"""reduce_dtype, sums and divide factors, and the global-token-count recipe."""

import pytest
import torch

from models import MLP
from precision_cases import hook_with_reduce_dtype, reduce_in, summed, token_normalised
from torchreplicate import replicate


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
    results = pools.run(world_size, reduce_in, dtype_name=dtype_name)
    assert len({r[0] for r in results}) == 1, "replicas not bitwise identical"
    for _, worst, wire in results:
        assert worst <= tolerance, f"relative error {worst:.2e} above {tolerance:.2e}"
        assert wire == {f"torch.{dtype_name}"}


def test_bf16_really_rounds(pools):
    # the bf16 wire must show its rounding: an error of exactly zero would mean fp32 travelled
    results = pools.run(2, reduce_in, dtype_name="bfloat16")
    assert results[0][1] > 1e-6


def test_divide_factor_one_is_a_sum(pools):
    assert all(pools.run(2, summed))


@pytest.mark.parametrize("world_size", [2, 3])
def test_global_token_count_recipe(pools, world_size):
    assert all(pools.run(world_size, token_normalised))


def test_comm_hook_and_reduce_dtype_refused(pools):
    for message in pools.run(2, hook_with_reduce_dtype):
        assert message is not None and "reduce_dtype" in message and "drop reduce_dtype" in message


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
