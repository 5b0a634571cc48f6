"""The training function the Ray Train tests run on each worker (tests/test_ray.py), shipped by value.

One seeded loop (dropout, AdamW) under Ray's own DDP path (``ray.train.torch.prepare_model``) or ours
(``torchreplicate.integrations.ray.prepare_model``). Everything random comes from the step and the rank
(the batch's generator, torch's seed for dropout), so a run resumed from a checkpoint at step s sees
the same data and the same dropout masks as an uninterrupted run from s on: the checkpoint holds the
model, the optimizer and the step. Each worker writes its final weights' digest to ``out``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn


def network() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))


def digest(model: nn.Module) -> str:
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()[:16]


def train(config: dict[str, Any]) -> None:
    """``config``: engine ("ddp" or "ours"), steps, save_every, out (a folder), and optionally resume
    (a checkpoint folder) and kill_at (rank 1 SIGKILLs itself at that step, in the first attempt only)."""
    import ray.train
    import ray.train.torch

    rank = ray.train.get_context().get_world_rank()
    torch.manual_seed(0)
    model = network()
    if config["engine"] == "ours":
        from torchreplicate.integrations.ray import prepare_model

        model = prepare_model(model)
        plain = model
    else:
        model = ray.train.torch.prepare_model(model)
        plain = model.module
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    start = 0
    checkpoint = ray.train.get_checkpoint()  # after a restart: the last one reported
    folder = config.get("resume") if checkpoint is None else None
    with checkpoint.as_directory() if checkpoint is not None else contextlib.nullcontext(folder) as found:
        if found is not None:
            state = torch.load(Path(found) / "state.pt")
            plain.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            start = state["step"] + 1
    for step in range(start, config["steps"]):
        marker = Path(config["out"]) / f"killed-{config['engine']}"
        if step == config.get("kill_at") and rank == 1 and not marker.exists():
            marker.write_text(str(step))
            os.kill(os.getpid(), signal.SIGKILL)
        torch.manual_seed(1000 * step + rank)  # dropout's masks: from the step, so a resumed run draws the same
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(100 * step + rank))
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if (step + 1) % config["save_every"] == 0 or step + 1 == config["steps"]:
            with tempfile.TemporaryDirectory() as saved:
                if rank == 0:
                    state = {"model": plain.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
                    torch.save(state, Path(saved) / "state.pt")
                kept = ray.train.Checkpoint.from_directory(saved) if rank == 0 else None
                ray.train.report({"step": step}, checkpoint=kept)
    (Path(config["out"]) / f"{config['engine']}-{rank}").write_text(digest(plain))
