"""Gradient and parameter parity against one process that sees the whole batch."""

import pytest

from parity import run_parity

MODEL_NAMES = ["mlp", "conv", "tied", "encoder", "wide"]


@pytest.mark.parametrize("model_name", MODEL_NAMES)
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_parity_default_options(pools, model_name, world_size):
    results = pools.run(world_size, run_parity, model_name)
    assert len({r["digest"] for r in results}) == 1, "replicas diverged"
    if world_size > 1:
        assert results[0]["grads_are_views"] is True


@pytest.mark.parametrize("model_name", MODEL_NAMES)
@pytest.mark.parametrize("as_view", [True, False])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_parity_tiny_buckets(pools, model_name, as_view, set_to_none):
    options = {"bucket_cap_mb": 0.001, "first_bucket_cap_mb": 0.0005, "gradient_as_bucket_view": as_view}
    results = pools.run(2, run_parity, model_name, replicate_kwargs=options, set_to_none=set_to_none)
    assert len({r["digest"] for r in results}) == 1, "replicas diverged"
    assert results[0]["num_buckets"] >= 2, "tiny caps should give several buckets"
    assert results[0]["grads_are_views"] is as_view


def test_wide_model_has_several_default_buckets(pools):
    results = pools.run(2, run_parity, "wide", steps=2)
    # 16 x 256 KiB weights: a 1 MiB first bucket, then 25 MiB caps -> more than one bucket
    assert results[0]["num_buckets"] >= 2


def test_parity_three_ranks_tiny_buckets(pools):
    options = {"bucket_cap_mb": 0.001, "first_bucket_cap_mb": 0.0005}
    results = pools.run(3, run_parity, "tied", replicate_kwargs=options)
    assert len({r["digest"] for r in results}) == 1
