"""Works kept past a step are released whatever updates the weights ([Note: works kept past a step] in
faults/wire.py): a loop without a torch optimizer holds no more after 2,000 steps than after 100.

Issue 63 measured rank 0's memory growing by 32 MiB over 3,000 steps of a BatchNorm model updated by hand
(``p -= lr * p.grad``, as torch's own test_replicate.py writes it): every forward's buffers sent ahead,
with rank 0's packed copy, stayed in a list that only a torch optimizer's step hook emptied. What the
library holds is counted here, not RSS: every object and every tensor byte reachable from the module's
``ReplicateState`` (modules, classes and functions are not followed).
"""

from __future__ import annotations

import gc
import types
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torchreplicate import replicate

_LEAVES = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.CodeType, nn.Module)
_VALUES = (int, float, str, bytes)  # counters and names: an int past 256 is a new object, not a growth


def held_by_library(state: Any) -> tuple[int, int]:
    """(objects, tensor bytes) reachable from ``state``: what the library holds for one module (plain values
    such as step counters are not counted as objects)."""
    seen: set[int] = set()
    storages: set[int] = set()
    num_bytes = num_values = 0
    todo = [state]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, _LEAVES) or isinstance(obj, types.FrameType):
            continue
        seen.add(id(obj))
        if isinstance(obj, _VALUES):
            num_values += 1
            continue
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            if storage.data_ptr() not in storages:
                storages.add(storage.data_ptr())
                num_bytes += storage.nbytes()
            continue
        todo.extend(gc.get_referents(obj))
    return len(seen) - num_values, num_bytes


def train_without_an_optimizer(rank: int, world_size: int, steps: int, graph: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 1))
    replicate(model, graph=graph)
    state = replicate.state(model)
    data = torch.Generator().manual_seed(rank)
    held: dict[int, tuple[int, int]] = {}
    for step in range(1, steps + 1):
        x = torch.randn(16, 32, generator=data)
        model(x).square().mean().backward()
        with torch.no_grad():  # a manual update, no torch.optim.Optimizer: no optimizer step hook runs
            for p in model.parameters():
                p -= 0.01 * p.grad
                p.grad = None
        if step in (100, steps):
            gc.collect()
            held[step] = held_by_library(state)
    with torch.no_grad():
        model.eval()
        model(torch.randn(4, 32, generator=data))  # an evaluation forward takes the buffers sent ahead
    weights = torch.cat([p.detach().flatten() for p in model.parameters()] + [b.flatten() for b in model.buffers()])
    gathered = [torch.empty_like(weights) for _ in range(world_size)]
    dist.all_gather(gathered, weights)
    same = all(torch.equal(g, gathered[0]) for g in gathered)
    return {"held": held, "same": same, "works": len(state.clock.held.works)}


def test_a_loop_without_an_optimizer_holds_no_more_after_2000_steps_than_after_100(pools):
    for graph in ("learned", "dynamic"):
        for rank, result in enumerate(pools.run(2, train_without_an_optimizer, 2000, graph, timeout_s=240)):
            (objects_100, bytes_100), (objects_end, bytes_end) = result["held"][100], result["held"][2000]
            assert objects_end <= objects_100 and bytes_end <= bytes_100, (
                f"rank {rank}, graph={graph}: the library held {objects_100} objects and {bytes_100} tensor "
                f"bytes after step 100, {objects_end} and {bytes_end} after step 2000"
            )
            assert result["works"] == 0, f"rank {rank}: the evaluation forward released every work kept"
            assert result["same"], f"rank {rank}: the replicas differ after a manual update on every rank"
