"""One replica group of a job that survives losing a replica, without a restart: replicate_ft on torchft.

Each replica group is one process (this script); torchft's lighthouse forms
a quorum of the live ones before every step. Start a lighthouse, then the
replica groups, each with its own id (here on one machine, CPU, gloo):

    torchft_lighthouse --min_replicas 2 --join_timeout_ms 2000 --heartbeat_timeout_ms 2000 &
    for id in 0 1 2; do
        python examples/torchft_train.py --replica-id $id --lighthouse http://localhost:29510 &
    done

Kill one (``kill -9 <pid>``): the others drop the step it was in (not
committed anywhere) and go on with two, in about the heartbeat timeout.
Start it again with the same command: it heals from a live peer
(parameters, optimizer state, step) and trains on with them. Each step
prints the step, whether it was committed and how many replica groups took
part; at the end each replica prints a checksum of its parameters (the
same on every replica that finished together).

Needs ``pip install ".[torchft]" in a clone``. See docs/torchft.md.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchft.manager import Manager
from torchft.optim import OptimizerWrapper
from torchft.process_group import ProcessGroupGloo

from torchreplicate.integrations.torchft import replicate_ft


def main() -> None:
    """Trains one replica group until the job's committed step count reaches ``--steps``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replica-id", type=int, required=True, help="this replica group's id (0, 1, ...)")
    parser.add_argument("--lighthouse", default=os.environ.get("TORCHFT_LIGHTHOUSE", "http://localhost:29510"))
    parser.add_argument("--steps", type=int, default=300, help="committed steps to train (default 300)")
    parser.add_argument("--step-delay", type=float, default=0.05, help="seconds of pretend work per step")
    parser.add_argument("--min-replicas", type=int, default=2, help="fewer live replica groups: no commit")
    args = parser.parse_args()
    torch.set_num_threads(1)

    # This process is its replica group: our reducer runs on a group of one;
    # everything across replica groups goes through torchft's Manager.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)  # the Manager's own store

    torch.manual_seed(0)  # every replica starts alike (the Manager also syncs step 0 from a peer)
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 1))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def state_dict() -> dict[str, Any]:  # what a healing peer receives
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(state: dict[str, Any]) -> None:  # what a healing replica loads
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=10)),
        min_replica_size=args.min_replicas,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"replica_{args.replica_id}",
        store_addr="localhost",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=args.lighthouse,
        timeout=timedelta(seconds=10),
    )
    model = replicate_ft(model, manager)
    optimizer = OptimizerWrapper(manager, inner)  # zero_grad: the quorum; step: only if committed

    generator = torch.Generator().manual_seed(args.replica_id)  # each replica group reads its own data
    true_weights = torch.linspace(-1, 1, 32)
    while manager.current_step() < args.steps:
        optimizer.zero_grad()
        inputs = torch.randn(64, 32, generator=generator)
        targets = (inputs @ true_weights).tanh().unsqueeze(1)
        loss = nn.functional.mse_loss(model(inputs), targets)
        loss.backward()  # every bucket: manager.allreduce; a lost peer makes the step uncommitted
        step = manager.current_step()
        participants = manager.num_participants()
        optimizer.step()
        committed = manager.current_step() > step
        print(f"replica {args.replica_id} pid {os.getpid()} step {step} committed {committed} "
              f"participants {participants} loss {loss.item():.4f}", flush=True)  # fmt: skip
        time.sleep(args.step_delay)
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    print(f"replica {args.replica_id} done at step {manager.current_step()}: parameters {digest[:16]}", flush=True)
    manager.shutdown(wait=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
