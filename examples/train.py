"""Train a small character-level language model on N CPU ranks with replicate().

Run with our launcher or with torchrun, unchanged:

    python -m torchreplicate.launcher --nproc-per-node 2 examples/train.py
    torchrun --nproc-per-node=2 examples/train.py

Each rank trains on its own slice of every global batch. At the end the ranks
compare their weights bit for bit, and rank 0 replays the same training in one
process on the whole batches to show the replicas match it.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import copy
import hashlib
import importlib
import io

import torch
import torch.distributed as dist
from torch import nn

from torchreplicate import replicate

CONTEXT = 8  # characters the model sees to predict the next one


class CharModel(nn.Module):
    """Embedding -> MLP -> next-character logits."""

    def __init__(self, vocab: int, dim: int = 32, hidden: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mlp = nn.Sequential(
            nn.Linear(CONTEXT * dim, hidden), nn.GELU(), nn.LayerNorm(hidden), nn.Linear(hidden, vocab)
        )

    def forward(self, context: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.embed(context).flatten(1))


def corpus() -> tuple[torch.Tensor, torch.Tensor, int]:
    with contextlib.redirect_stdout(io.StringIO()):  # `this` prints on import
        zen = importlib.import_module("this")  # the Zen of Python ships with Python
    text = codecs.decode(zen.s, "rot13")
    chars = sorted(set(text))
    ids = torch.tensor([chars.index(c) for c in text])
    windows = ids.unfold(0, CONTEXT + 1, 1)
    return windows[:, :CONTEXT], windows[:, CONTEXT], len(chars)


def batches(num_samples: int, steps: int, global_batch: int):
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        yield torch.randint(0, num_samples, (global_batch,), generator=generator)


def weights_digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=64, help="global batch size")
    options = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    inputs, targets, vocab = corpus()
    if options.batch % world_size:
        raise SystemExit(f"--batch {options.batch} must be divisible by the world size {world_size}")
    per_rank = options.batch // world_size

    torch.manual_seed(rank)  # different on each rank: replicate() broadcasts rank 0's
    model = CharModel(vocab)
    replicate(model)
    initial = copy.deepcopy(model.state_dict())
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loss_fn = nn.CrossEntropyLoss()

    for step, index in enumerate(batches(len(inputs), options.steps, options.batch)):
        mine = index[rank * per_rank : (rank + 1) * per_rank]
        loss = loss_fn(model(inputs[mine]), targets[mine])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 50 == 0 or step == options.steps - 1:
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)
            if rank == 0:
                print(f"step {step:4d}  loss {mean_loss.item() / world_size:.3f}", flush=True)

    digests = [None] * world_size
    dist.all_gather_object(digests, weights_digest(model))
    if rank == 0:
        same = len(set(digests)) == 1
        print(f"weights by rank: {digests}  identical: {same}")
        reference = CharModel(vocab)
        reference.load_state_dict(initial)
        ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=3e-3)
        for index in batches(len(inputs), options.steps, options.batch):
            loss_fn(reference(inputs[index]), targets[index]).backward()
            ref_optimizer.step()
            ref_optimizer.zero_grad()
        gap = max((p - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters(), strict=True))
        print(f"single-process run on the whole batches: max |difference| = {gap:.2e}  match: {gap < 1e-4}")
        if not same or gap >= 1e-4:
            raise SystemExit("replicas diverged or do not match the single-process run")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
