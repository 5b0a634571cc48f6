"""Gradient accumulation, the sync toggle, odd steps, and buffers."""

import pytest
import torch

from accumulation_cases import (
    accumulate,
    buffers_broadcast,
    odd_steps,
    sync_batchnorm_trains,
    sync_setting_read_at_backward,
)


@pytest.mark.parametrize("use_context", [True, False])
@pytest.mark.parametrize("vary_used_set", [False, True])
@pytest.mark.parametrize("micro_batches", [0, 3])
@pytest.mark.parametrize("world_size", [2, 3])
def test_accumulation_matches_reference(pools, world_size, micro_batches, use_context, vary_used_set):
    digests = pools.run(
        world_size, accumulate, micro_batches=micro_batches, use_context=use_context, vary_used_set=vary_used_set
    )
    assert len(set(digests)) == 1


def test_sync_setting_takes_effect_at_backward(pools):
    for local_only, averaged in pools.run(2, sync_setting_read_at_backward):
        assert local_only, "sync switched off before backward still averaged"
        assert averaged, "sync back on before backward did not average"


@pytest.mark.parametrize("world_size", [2, 3])
def test_odd_steps_do_not_break_the_next(pools, world_size):
    assert all(pools.run(world_size, odd_steps))


def test_buffers_broadcast_before_every_forward(pools):
    results = pools.run(2, buffers_broadcast, broadcast_buffers=True)
    for before, after, counters, _count in results:
        assert not before, "ranks saw different data, so their statistics should differ before the broadcast"
        assert after and counters
    assert results[0][3] == 6  # 6 training forwards; the eval forward does not count


def test_buffers_left_alone_when_asked(pools):
    for _before, after, _counters, _count in pools.run(2, buffers_broadcast, broadcast_buffers=False):
        assert not after


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="torch.nn.SyncBatchNorm raises 'SyncBatchNorm expected input tensor to be on GPU' in training "
    "on CPU tensors (torch 2.13 batchnorm.py); this machine has no GPU",
)
def test_sync_batchnorm_model_trains_identically(pools):
    assert len(set(pools.run(2, sync_batchnorm_trains))) == 1
