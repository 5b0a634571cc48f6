"""Random graphs for the property-based test: a plan of which layers each rank uses."""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.utils.checkpoint as cp
from torch import nn

from models import data
from parity import assert_grads_match, digest, seeded
from torchreplicate import replicate

NUM_LAYERS = 6

# A plan: plan[step][rank] = list of (layer index, how) with how in
# {"plain", "reentrant", "non_reentrant"}; an empty list uses only the stem.


class Layers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(NUM_LAYERS))

    def forward(self, x: torch.Tensor, route: Sequence[tuple[int, str]] = ()) -> torch.Tensor:
        h = torch.tanh(self.stem(x))
        for index, how in route:
            layer = self.layers[index]
            if how == "plain":
                h = torch.tanh(layer(h))
            else:
                h = cp.checkpoint(lambda t, f=layer: torch.tanh(f(t)), h, use_reentrant=how == "reentrant")
        return h


def _loss(model: nn.Module, route, rank: int, step: int) -> torch.Tensor:
    x = data(rank, step)
    if any(how == "reentrant" for _, how in route):
        x.requires_grad_()  # reentrant checkpointing needs an input that requires grad
    return model(x, route).pow(2).mean()


def run_plan(rank: int, world_size: int, plan: list[list[Any]], options: dict[str, Any]) -> str:
    model = seeded(Layers, 11 + rank)
    reference = seeded(Layers, 11)
    replicate(model, **options)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step, routes in enumerate(plan):
        _loss(model, routes[rank], rank, step).backward()
        (sum(_loss(reference, routes[r], r, step) for r in range(world_size)) / world_size).backward()
        assert_grads_match(model, reference, f"rank {rank} step {step} routes {routes}")
        optimizer.step()
        ref_optimizer.step()
        optimizer.zero_grad()
        ref_optimizer.zero_grad()
    return digest(model)
