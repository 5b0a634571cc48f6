"""Reduction precision and divide factor: functions run on every rank."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from models import MODELS
from parity import PER_RANK, digest, seeded
from torchreplicate import replicate


def reduce_in(rank, world_size, *, dtype_name, model_name="mlp"):
    build, make_batch, loss_of = MODELS[model_name]
    model = seeded(build, 100)
    reference = seeded(build, 100)
    replicate(model, reduce_dtype=getattr(torch, dtype_name), bucket_cap_mb=0.01, first_bucket_cap_mb=0.005)
    worst = 0.0
    for step in range(3):
        batch = make_batch(torch.Generator().manual_seed(step), PER_RANK * world_size)
        local = batch[rank * PER_RANK : (rank + 1) * PER_RANK]
        loss_of(model(local), local).backward()
        loss_of(reference(batch), batch).backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            assert p.grad.dtype == p.dtype
            scale = q.grad.abs().max().item() + 1e-12
            worst = max(worst, (p.grad - q.grad).abs().max().item() / scale)
            with torch.no_grad():
                q.grad.copy_(p.grad)  # continue from the same point: errors do not compound
        for module in (model, reference):
            with torch.no_grad():
                for p in module.parameters():
                    p -= 0.1 * p.grad
            module.zero_grad()
    wire = {str(w.dtype) for w in replicate.state(model).reducer.reduction.wires}
    return digest(model), worst, wire


def summed(rank, world_size):
    build, make_batch, loss_of = MODELS["mlp"]
    model = seeded(build, 100)
    reference = seeded(build, 100)
    replicate(model, gradient_divide_factor=1)
    batch = make_batch(torch.Generator().manual_seed(0), PER_RANK * world_size)
    local = batch[rank * PER_RANK : (rank + 1) * PER_RANK]
    loss_of(model(local), local).backward()
    loss_of(reference(batch), batch).backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad * world_size, rtol=1e-5, atol=1e-6)
    return True


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
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    return True


def hook_with_reduce_dtype(rank, world_size):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    model = seeded(MODELS["mlp"][0], 0)
    replicate(model, reduce_dtype=torch.bfloat16)
    try:
        model.register_comm_hook(None, allreduce_hook)
    except ValueError as error:
        return str(error)
    return None
