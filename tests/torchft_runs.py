"""A replica lost and replaced under torchft, one process per replica group; and its single-process replay.

tests/test_torchft.py and benchmarks/failure_cost/bench_torchft.py call ``run_scenario``:
a torchft lighthouse in the calling process, three replica groups (this file
run as ``worker``), one of which SIGKILLs itself in the middle of step
``die_at`` (after its forward, before its backward), and a fresh replica
group started once the survivors have committed two more steps; it heals
from a live peer and trains on to ``num_steps``. Each worker appends one
JSON line per attempted step to ``<out>/<name>.jsonl`` (its pid, the
Manager's step, the data seed it used, whether the step was committed, the
number of participants, times) and saves its final model and optimizer
state to ``<out>/<name>.pt``. ``replay`` trains a plain model in this
process on exactly the committed steps, with each participant's data.

Engines: ``ours`` (``replicate_ft``) and ``torchft_ddp``
(``torchft.ddp.DistributedDataParallel``); ``plain_ours`` / ``plain_ddp``
time the same model without torchft (``replicate`` and torch's DDP on a gloo
group of the same processes).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

HERE = Path(__file__).resolve().parent
IN_FEATURES, OUT_FEATURES, BATCH = 8, 4, 4
LR, MOMENTUM = 0.05, 0.9


def make_model(hidden: int, seed: int = 0) -> nn.Module:
    """A model to start from, initialised from ``seed``.

    Each replica starts from its own seed: the Manager's step-0 sync
    (``init_sync=True``) must make them equal, with no broadcast of ours.
    """
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(IN_FEATURES, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, OUT_FEATURES)
    )


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """SGD with momentum: optimizer state a healed replica must receive."""
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data of one attempted step, from its seed."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, IN_FEATURES, generator=generator), torch.randn(BATCH, OUT_FEATURES, generator=generator)


def digest(model: nn.Module) -> str:
    """A hash of the model's parameters, bit for bit."""
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()


def seed_of(name: str, attempt: int) -> int:
    """A replica's data seed for its ``attempt``-th step: every attempt (also a failed one) draws new data."""
    return 1000 * (int(name[1:]) + 1) + attempt


# -- a worker: one replica group ---------------------------------------------


def worker(args: argparse.Namespace) -> None:
    """One replica group's training loop (``python torchft_runs.py worker ...``)."""
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    torch.set_num_threads(1)
    out = Path(args.out)
    log = open(out / f"{args.name}.jsonl", "a", buffering=1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # this process: the replica group
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)  # the Manager's store
    model = make_model(args.hidden, seed=int(args.name[1:]))
    optimizer = make_optimizer(model)

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=10)),
        min_replica_size=2,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=args.name,
        store_addr="localhost",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=args.lighthouse,
        use_async_quorum=False,  # heal before the forward: the step's participants are known at once
        timeout=timedelta(seconds=10),
        quorum_timeout=timedelta(seconds=30),
        connect_timeout=timedelta(seconds=10),
    )
    trained: nn.Module
    if args.engine == "ours":
        from torchreplicate.integrations.torchft import replicate_ft

        dtype = None if args.reduce_dtype is None else getattr(torch, args.reduce_dtype)
        trained = replicate_ft(model, manager, reduce_dtype=dtype)
    else:
        from torchft.ddp import DistributedDataParallel

        trained = DistributedDataParallel(manager, model)
    _barrier(out, args.barrier, args.name)
    if args.barrier <= 1:
        (out / "newcomer.ready").touch()  # a late replica: heartbeating; the others may go on
    loss_fn = nn.MSELoss()
    attempt = 0
    while manager.current_step() < args.steps:
        if manager.current_step() == args.hold_at:
            _wait_for(out / "newcomer.ready")
        if manager.current_step() == args.die_at and args.die_in == "between":  # no all-reduce in flight
            log.write(json.dumps({"pid": os.getpid(), "step": args.die_at, "seed": -1, "killed": time.time()}) + "\n")
            os.kill(os.getpid(), signal.SIGKILL)
        started = time.time()
        manager.start_quorum()  # the quorum; a new replica heals here (use_async_quorum=False)
        optimizer.zero_grad()
        quorum_s = time.time() - started
        step = manager.current_step()
        seed = seed_of(args.name, attempt)
        inputs, targets = batch(seed)
        loss = loss_fn(trained(inputs), targets)
        record = {"pid": os.getpid(), "attempt": attempt, "step": step, "seed": seed, "start": started}
        if attempt == 0:
            record["start_digest"] = digest(model)  # after the first quorum: synced or healed
        if step == args.die_at and args.die_in == "backward":
            log.write(json.dumps({**record, "killed": time.time()}) + "\n")
            os.kill(os.getpid(), signal.SIGKILL)
        loss.backward()
        participants = manager.num_participants()
        committed = manager.should_commit()
        if committed:
            optimizer.step()
        record.update(committed=committed, participants=participants, quorum_s=quorum_s, end=time.time())
        log.write(json.dumps(record) + "\n")
        attempt += 1
    torch.save(state_dict(), out / f"{args.name}.pt")
    manager.shutdown(wait=False)


def _barrier(out: Path, count: int, name: str) -> None:
    # The first replica groups start training together (a quorum of all of
    # them), each after creating its Manager (heartbeating the lighthouse).
    if count <= 1:
        return
    (out / f"{name}.ready").touch()
    deadline = time.time() + 60
    while len(list(out.glob("r*.ready"))) < count:
        if time.time() > deadline:
            raise TimeoutError("torchft_runs: the other replica groups never started")
        time.sleep(0.02)


def _wait_for(path: Path) -> None:
    # The survivors wait at one step for the newcomer, so that it joins a
    # running job (steps of a few ms would otherwise end before it starts).
    deadline = time.time() + 60
    while not path.exists():
        if time.time() > deadline:
            raise TimeoutError(f"torchft_runs: {path.name} never appeared")
        time.sleep(0.02)


def plain_worker(args: argparse.Namespace) -> None:
    """The same steps without torchft, for the step time: ``replicate`` or torch DDP on a gloo group."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=args.init, rank=args.rank, world_size=args.world)
    model = make_model(args.hidden)
    optimizer = make_optimizer(model)
    if args.engine == "plain_ours":
        from torchreplicate import replicate

        trained: nn.Module = replicate(model, bucket_cap_mb=25, stall_timeout=None)
    else:
        trained = nn.parallel.DistributedDataParallel(model)
    loss_fn = nn.MSELoss()
    times = []
    for attempt in range(args.steps):
        started = time.time()
        optimizer.zero_grad()
        inputs, targets = batch(seed_of(f"r{args.rank}", attempt))
        loss_fn(trained(inputs), targets).backward()
        optimizer.step()
        times.append(time.time() - started)
    if args.rank == 0:
        (Path(args.out) / f"{args.engine}.json").write_text(json.dumps(times))
    dist.destroy_process_group()


# -- the scenario, from the calling process ------------------------------------


def _launch(script_args: list[str], out: Path, name: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent / "src"), os.environ.get("PYTHONPATH", "")])}
    env.setdefault("TORCHFT_LOG_LEVEL", "WARNING")
    stderr = open(out / f"{name}.stderr", "w")
    return subprocess.Popen(
        [sys.executable, str(Path(__file__)), *script_args], env=env, stdout=stderr, stderr=subprocess.STDOUT
    )


def read_records(out: Path, name: str) -> list[dict[str, Any]]:
    """A worker's records, one per attempted step (the victim's last one says when it died)."""
    path = out / f"{name}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_scenario(
    engine: str,
    out: Path,
    *,
    num_steps: int = 12,
    die_at: int = 4,
    hidden: int = 16,
    reduce_dtype: Optional[str] = None,
    die_in: str = "backward",
    timeout_s: float = 150.0,
) -> dict[str, Any]:
    """Three replica groups, one killed at ``die_at``, a fresh one healed in; returns what each recorded.

    ``die_in="backward"``: the victim dies after its forward, before its
    backward, so its peers are in (or about to start) an all-reduce with it;
    ``"between"``: before step ``die_at``'s quorum, no collective in flight
    (where torchft's own tests inject failures).

    Every child is killed in a ``finally``; the lighthouse is shut down.

    Returns:
        ``{"records": {name: [...]}, "states": {name: state_dict}, "returncodes": {...}, "newcomer_started": t}``.

    Raises:
        TimeoutError: the run did not end within ``timeout_s`` (the children's output is in ``out``).
    """
    from torchft._torchft import LighthouseServer

    out.mkdir(parents=True, exist_ok=True)
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=1000, heartbeat_timeout_ms=2000)
    common = ["--engine", engine, "--lighthouse", lighthouse.address(), "--out", str(out)]
    common += ["--steps", str(num_steps), "--hidden", str(hidden), "--die-in", die_in]
    if reduce_dtype is not None:
        common += ["--reduce-dtype", reduce_dtype]
    processes: dict[str, subprocess.Popen] = {}
    deadline = time.time() + timeout_s
    newcomer_started = None
    try:
        for name in ("r0", "r1", "r2"):
            die = ["--die-at", str(die_at)] if name == "r2" else ["--hold-at", str(die_at + 3)]
            processes[name] = _launch(["worker", "--name", name, "--barrier", "3", *common, *die], out, name)
        while newcomer_started is None:
            _check(processes, deadline, out)
            committed = [r["step"] for r in read_records(out, "r0") if r.get("committed")]
            if processes["r2"].poll() is not None and committed and max(committed) >= die_at + 1:
                newcomer_started = time.time()
                processes["r3"] = _launch(["worker", "--name", "r3", *common], out, "r3")
            time.sleep(0.05)
        while any(p.poll() is None for p in processes.values()):
            _check(processes, deadline, out)
            time.sleep(0.05)
        _check(processes, deadline, out)
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()
        lighthouse.shutdown()
    names = list(processes)
    return {
        "records": {name: read_records(out, name) for name in names},
        "states": {name: torch.load(out / f"{name}.pt") for name in names if (out / f"{name}.pt").exists()},
        "returncodes": {name: processes[name].returncode for name in names},
        "newcomer_started": newcomer_started,
    }


def _check(processes: dict[str, subprocess.Popen], deadline: float, out: Path) -> None:
    for name, process in processes.items():
        code = process.poll()
        if code not in (None, 0) and not (name == "r2" and code == -signal.SIGKILL):
            tail = (out / f"{name}.stderr").read_text()[-3000:]
            raise RuntimeError(f"torchft_runs: replica {name} exited with {code}:\n{tail}")
    if time.time() > deadline:
        raise TimeoutError(f"torchft_runs: the scenario did not finish in time; see {out}/*.stderr")


def committed_steps(records: dict[str, list[dict[str, Any]]]) -> dict[int, list[dict[str, Any]]]:
    """Per committed Manager step, the records of the replicas that committed it."""
    steps: dict[int, list[dict[str, Any]]] = {}
    for name, rows in records.items():
        for row in rows:
            if row.get("committed"):
                steps.setdefault(row["step"], []).append({**row, "name": name})
    return dict(sorted(steps.items()))


def replay(steps: dict[int, list[dict[str, Any]]], hidden: int, init_seed: int = 0) -> dict[str, Any]:
    """One process trains on exactly the committed steps: each participant's gradient, averaged.

    The sum of a step's gradients is taken in float64 (as the replicas send
    them, ``reduce_dtype="float64"``), where three float32 values add up
    exactly, so the order of the all-reduce does not matter; the average is
    then rounded to float32 once, as on the replicas. Checked here: if any
    sum were not exact, the orders would disagree and this raises.
    ``init_seed``: the seed of the replica whose start the Manager synced to all.
    """
    torch.set_num_threads(1)
    model = make_model(hidden, init_seed)
    optimizer = make_optimizer(model)
    loss_fn = nn.MSELoss()
    for step, rows in steps.items():
        grads = []
        for row in rows:
            model.zero_grad()
            inputs, targets = batch(row["seed"])
            loss_fn(model(inputs), targets).backward()
            grads.append([p.grad.detach().clone().double() for p in model.parameters()])
        for position, param in enumerate(model.parameters()):
            parts = [g[position] for g in grads]
            total = sum(parts, torch.zeros_like(parts[0]))
            backwards = sum(reversed(parts), torch.zeros_like(parts[0]))
            if not torch.equal(total, backwards):
                raise AssertionError(f"replay: step {step}'s float64 sum is not exact; the replay cannot be bitwise")
            param.grad = (total / len(rows)).to(param.dtype)
        optimizer.step()
    return {"model": model.state_dict(), "optim": optimizer.state_dict()}


def main() -> None:
    """``worker`` / ``plain`` from the command line."""
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["worker", "plain"])
    parser.add_argument("--engine", required=True)
    parser.add_argument("--name", default="r0")
    parser.add_argument("--lighthouse", default="")
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=16)
    parser.add_argument("--die-at", type=int, default=-1)
    parser.add_argument("--barrier", type=int, default=1)
    parser.add_argument("--hold-at", type=int, default=-1)
    parser.add_argument("--die-in", choices=["backward", "between"], default="backward")
    parser.add_argument("--reduce-dtype", default=None)
    parser.add_argument("--init", default="")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world", type=int, default=1)
    args = parser.parse_args()
    (worker if args.role == "worker" else plain_worker)(args)


if __name__ == "__main__":
    main()
