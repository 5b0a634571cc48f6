"""Saving and restoring a stateful comm hook (PowerSGD) with the training checkpoint."""

from __future__ import annotations

import io

import torch
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

from models import MLP
from parity import digest, seeded
from torchreplicate import replicate


def _train(model, optimizer, rank, steps, first_step):
    for step in range(first_step, first_step + steps):
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(100 * step + rank))
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _fresh(seed):
    model = seeded(MLP, seed)
    replicate(model, bucket_cap_mb=0.01, first_bucket_cap_mb=0.005)
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def powersgd_resume(rank, world_size):
    state = powersgd.PowerSGDState(
        process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2, use_error_feedback=True, warm_start=True
    )
    model, optimizer = _fresh(0)
    model.register_comm_hook(state, powersgd.powerSGD_hook)
    _train(model, optimizer, rank, steps=4, first_step=0)
    saved = io.BytesIO()
    # What to save: the model, the optimizer and the hook state. PowerSGDState
    # pickles without its process group (torch drops it in __getstate__).
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "powersgd": state}, saved)
    _train(model, optimizer, rank, steps=4, first_step=4)
    uninterrupted = digest(model)

    saved.seek(0)
    checkpoint = torch.load(saved, weights_only=False)
    restored_state = checkpoint["powersgd"]
    restored_state.process_group = None  # re-attach: None means the world group
    resumed, resumed_optimizer = _fresh(1)
    resumed.load_state_dict(checkpoint["model"])
    resumed_optimizer.load_state_dict(checkpoint["optimizer"])
    resumed.register_comm_hook(restored_state, powersgd.powerSGD_hook)
    _train(resumed, resumed_optimizer, rank, steps=4, first_step=4)
    return uninterrupted, digest(resumed), restored_state.iter
