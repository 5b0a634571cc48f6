"""Train a small character-level language model on N CPU ranks with replicate().

Run it with torchrun (``python -m torch.distributed.run`` is torchrun), which
sets each rank's environment for ``init_process_group()``:

    .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 2 examples/train.py

Each rank trains on its own slice of every global batch. At the end the ranks
compare their weights bit for bit, and rank 0 replays the same training in one
process on the whole batches to show the replicas match it.

Restart and resume: with ``--checkpoint-dir DIR --save-every K`` the script
saves model, optimizer and data position with torch.distributed.checkpoint
every K steps and, on start, resumes from the newest complete checkpoint in
DIR, also at another world size. Under ``torchrun --max-restarts N`` a
failed worker group is restarted and carries on from there:

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node 2 \
        --max-restarts 3 examples/train.py --checkpoint-dir /tmp/ckpt --save-every 50

(``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: torch 2.13's torchrun keeps one
store across restarts, and a restarted group can read the failed group's
stale addresses; pytorch/pytorch#135712.)

Seeing inside the steps: ``--trace PATH`` records every rank's per-bucket
timeline into one Chrome trace file (open it in https://ui.perfetto.dev) and
a plot next to it; ``--summary-every N`` logs step time, exposed
communication and the slowest rank every N steps; ``--verify-every K``
checks every K steps that the replicas are bitwise identical (and the run
ends with that check).
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import copy
import hashlib
import importlib
import io
import logging
import os
import re
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import torchreplicate
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


def batches(num_samples: int, steps: int, global_batch: int, start: int = 0):
    """The global batches of steps ``start`` to ``steps - 1``: the same at any world size."""
    generator = torch.Generator().manual_seed(0)
    for step in range(steps):
        index = torch.randint(0, num_samples, (global_batch,), generator=generator)
        if step >= start:
            yield index


# -- checkpoints: torch.distributed.checkpoint, one fresh directory per save ------------------


def latest_checkpoint(root: str) -> Optional[str]:
    """The newest complete checkpoint under ``root`` (DCP writes ``.metadata`` last)."""
    if not os.path.isdir(root):
        return None
    done = [d for d in os.listdir(root) if re.fullmatch(r"step_\d{8}", d)]
    done = [d for d in sorted(done) if os.path.exists(os.path.join(root, d, ".metadata"))]
    return os.path.join(root, done[-1]) if done else None


def save_checkpoint(root: str, step: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Saves after ``step`` steps into a fresh directory, renamed into place once complete."""
    model_state, optim_state = get_state_dict(model, optimizer)
    final = os.path.join(root, f"step_{step:08d}")
    partial = final + ".tmp"  # never written over: a crash mid-save leaves no half checkpoint named step_*
    dcp.save({"model": model_state, "optim": optim_state, "progress": {"step": step}}, checkpoint_id=partial)
    dist.barrier()
    if dist.get_rank() == 0:
        os.replace(partial, final)
    dist.barrier()


def load_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Loads model and optimizer in place; returns the step to resume from."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_state, "optim": optim_state, "progress": {"step": 0}}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return int(state["progress"]["step"])


def fail_here(fail_at: Optional[str], rank: int, step: int) -> None:
    """Fault injection for the tests: ``--fail-at RANK:STEP`` kills that rank's process at that
    step, in the first attempt only (torchrun's restart count is 0)."""
    if fail_at and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        fail_rank, fail_step = (int(v) for v in fail_at.split(":"))
        if (rank, step) == (fail_rank, fail_step):
            os._exit(17)


def weights_digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=64, help="global batch size")
    parser.add_argument("--checkpoint-dir", help="save here, and resume from the newest checkpoint here")
    parser.add_argument("--save-every", type=int, default=0, help="save every K steps (0: never)")
    parser.add_argument("--fail-at", help="RANK:STEP: that rank's process dies at that step (tests)")
    parser.add_argument("--save-final", help="rank 0 writes the final state_dict here (torch.save)")
    parser.add_argument("--trace", help="write every rank's per-bucket timeline here (Chrome trace JSON) and a plot")
    parser.add_argument("--summary-every", type=int, default=0, help="log a summary across ranks every N steps")
    parser.add_argument("--verify-every", type=int, default=0, help="check the replicas bitwise every K steps")
    parser.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=None,
        help="gradient bucket size in MiB (default: replicate()'s, DDP's 25 MiB; the demo pins small ones)",
    )
    options = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if rank == 0:  # the summary's lines (logger "torchreplicate")
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    inputs, targets, vocab = corpus()
    if options.batch % world_size:
        raise SystemExit(f"--batch {options.batch} must be divisible by the world size {world_size}")
    per_rank = options.batch // world_size

    torch.manual_seed(rank)  # different on each rank: replicate() broadcasts rank 0's
    model = CharModel(vocab)
    cap = options.bucket_cap_mb
    replicate(model, bucket_cap_mb=cap, first_bucket_cap_mb=1 if cap is None else min(1, cap))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loss_fn = nn.CrossEntropyLoss()
    start = 0
    resume_from = latest_checkpoint(options.checkpoint_dir) if options.checkpoint_dir else None
    if resume_from is not None:
        start = load_checkpoint(resume_from, model, optimizer)
        if rank == 0:
            print(f"resumed from {resume_from} at step {start}, world size {world_size}", flush=True)
    initial = copy.deepcopy(model.state_dict())  # where this run starts: the reference replays from here
    initial_optim = copy.deepcopy(optimizer.state_dict())

    with contextlib.ExitStack() as observers:
        if options.trace:
            # rank 0 logs where it wrote the files when the block ends
            observers.enter_context(torchreplicate.trace(options.trace, model=model))
        if options.summary_every:
            observers.enter_context(torchreplicate.log_summary(model, every=options.summary_every))
        for step, index in enumerate(batches(len(inputs), options.steps, options.batch, start), start):
            fail_here(options.fail_at, rank, step)
            mine = index[rank * per_rank : (rank + 1) * per_rank]
            loss = loss_fn(model(inputs[mine]), targets[mine])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if options.checkpoint_dir and options.save_every and (step + 1) % options.save_every == 0:
                save_checkpoint(options.checkpoint_dir, step + 1, model, optimizer)
            if options.verify_every and (step + 1) % options.verify_every == 0:
                torchreplicate.verify_replicas(model)  # raises on every rank, naming what differs
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
        if options.save_final:
            torch.save(model.state_dict(), options.save_final)
        reference = CharModel(vocab)
        reference.load_state_dict(initial)
        ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=3e-3)
        ref_optimizer.load_state_dict(initial_optim)
        for index in batches(len(inputs), options.steps, options.batch, start):
            loss_fn(reference(inputs[index]), targets[index]).backward()
            ref_optimizer.step()
            ref_optimizer.zero_grad()
        gap = max((p - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters(), strict=True))
        print(f"single-process run on the whole batches: max |difference| = {gap:.2e}  match: {gap < 1e-4}")
        if not same or gap >= 1e-4:
            raise SystemExit("replicas diverged or do not match the single-process run")
    if options.verify_every:  # the end of the demo: one collective of digests, every tensor bitwise
        report = torchreplicate.verify_replicas(model)
        if rank == 0:
            print(f"replica check: {report.num_tensors} tensors bitwise identical on {report.world_size} ranks")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
