"""Inert and reproducible: the library draws from no generator the user can see, leaves the process as
DDP leaves it, gives the same bits on every rerun of a seeded job, and refuses DDP on top of it.

A user who swaps DDP for ``replicate()`` compares the two runs, reruns to
debug, reproduces a paper: one random draw of ours (even at set-up) moves
every later dropout mask and sampled batch of theirs; a bucket layout taken
from timings changes the order in which the all-reduce sums, and so the
last bits, from one run to the next.
"""

from __future__ import annotations

import atexit
import gc
import hashlib
import logging
import os
import pickle
import random
import signal
import threading
import time
import warnings
from typing import Any, Callable

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import torchreplicate
from local_ranks import launch
from parity import seeded
from torchreplicate import replicate
from torchreplicate.config import ReplicateConfig
from torchreplicate.faults.watchdog import StallWarning

WIDTH = 256  # 8 blocks: 2 MiB of gradients, so a tuned cap changes the layout (and the link is measured)


class Stack(nn.Module):
    """Linear + LayerNorm blocks: several buckets at small caps, a layer to freeze for a re-plan."""

    def __init__(self, depth: int = 8, width: int = WIDTH) -> None:
        super().__init__()
        self.blocks = nn.Sequential(
            *(nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width)) for _ in range(depth))
        )
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.blocks(x)))


# -- the generators ---------------------------------------------------------------------------------


def generator_states() -> dict[str, Any]:
    """Every generator a user's program draws from: torch's CPU and CUDA defaults, numpy's, Python's."""
    states = {
        "torch": torch.get_rng_state(),
        "numpy": pickle.dumps(np.random.get_state()),
        "random": random.getstate(),
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def assert_draws_nothing(rank: int, what: str, action: Callable[[], Any]) -> Any:
    """Runs ``action``; fails naming the generator it moved."""
    before = generator_states()
    result = action()
    after = generator_states()
    for name, state in before.items():
        same = torch.equal(state, after[name]) if isinstance(state, torch.Tensor) else state == after[name]
        if name == "cuda":
            same = all(torch.equal(a, b) for a, b in zip(state, after[name], strict=True))
        assert same, f"rank {rank}: {what} drew from the {name} generator the user's program draws from"
    return result


def batch(rank: int, step: int, width: int = WIDTH) -> torch.Tensor:
    """Rank-different data from a private generator (the user's are watched)."""
    return torch.randn(8, width, generator=torch.Generator().manual_seed(100 * step + rank))


def step_of(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    return run


def every_mode_draws_nothing(rank: int, world_size: int, tmp: str) -> None:
    """Set-up, steps (tuned: the link measured), a re-plan, the watchdog's stall, observers, torchft."""
    torch.manual_seed(1234)
    np.random.seed(1234)
    random.seed(1234)
    model = seeded(Stack, 1 + rank)
    assert_draws_nothing(
        rank,
        "replicate()",
        lambda: replicate(model, bucket_layout="tuned", first_bucket_cap_mb=0.01, stall_timeout=0.5),
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    assert_draws_nothing(rank, "log_summary()", lambda: torchreplicate.log_summary(model, every=1))
    for step in range(3):  # the first measures the link and re-lays the buckets
        assert_draws_nothing(rank, f"step {step}", step_of(model, optimizer, batch(rank, step)))
    assert replicate.state(model).reducer.layout_policy.link is not None, "the tuned layout measured nothing"
    model.blocks[0].requires_grad_(False)  # on every rank: the next forward re-plans
    assert_draws_nothing(rank, "the step after a re-plan", step_of(model, optimizer, batch(rank, 3)))

    def stalled_step() -> None:  # rank 1 late past stall_timeout: rank 0's watchdog looks at the notes
        x = batch(rank, 4)
        loss = model(x).pow(2).mean()
        if rank == 1:
            time.sleep(1.5)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss.backward()
        if rank == 0:
            assert any(issubclass(w.category, StallWarning) for w in caught), [str(w.message) for w in caught]
        optimizer.zero_grad()

    assert_draws_nothing(rank, "a stalled step (the watchdog's roll call)", stalled_step)

    def traced() -> None:
        with torchreplicate.trace(os.path.join(tmp, "trace.json"), model=model, plot=False):
            step_of(model, optimizer, batch(rank, 5))()

    assert_draws_nothing(rank, "trace()", traced)
    assert_draws_nothing(rank, "verify_replicas()", lambda: torchreplicate.verify_replicas(model))


class _Done:
    def wait(self) -> bool:
        return True


def torchft_draws_nothing(rank: int, world_size: int) -> None:
    """``replicate_ft`` on a one-process group with a Manager whose all-reduce is this replica's own."""
    from torchft.manager import Manager

    from torchreplicate.integrations.torchft import replicate_ft

    groups = [dist.new_group([r]) for r in range(world_size)]  # every rank creates every group
    manager = Manager.__new__(Manager)  # no lighthouse: the hook's two calls answered here
    manager.allreduce = lambda tensor: _Done()  # type: ignore[method-assign]
    manager.errored = lambda: None  # type: ignore[method-assign]
    model = seeded(Stack, 1)
    assert_draws_nothing(rank, "replicate_ft()", lambda: replicate_ft(model, manager, process_group=groups[rank]))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(2):
        assert_draws_nothing(rank, f"a torchft step {step}", step_of(model, optimizer, batch(rank, step)))


def test_every_mode_draws_nothing_from_the_users_generators(pools, tmp_path):
    pools.run(2, every_mode_draws_nothing, str(tmp_path), timeout_s=180)


def test_replicate_ft_draws_nothing_from_the_users_generators(pools):
    pytest.importorskip(
        "torchft", reason="the torchft extra is not installed here (pip install torchreplicate[torchft])"
    )
    pools.run(2, torchft_draws_nothing)


# -- the process left as DDP leaves it ---------------------------------------------------------------

HEARTBEAT = "torchreplicate-heartbeat"  # the watchdog's thread, while a replicated module lives


def torch_functions() -> dict[str, int]:
    """The identity of every function of torch's main namespaces: one patched moves."""
    owners = (torch, torch.distributed, torch.distributed.distributed_c10d, torch.autograd, nn.Module, torch.Tensor)
    return {
        f"{getattr(owner, '__name__', owner)}.{name}": id(value)
        for owner in owners
        for name, value in list(vars(owner).items())
        if callable(value)
    }


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def process_state(functions_before: dict[str, int], environ_before: dict[str, str]) -> dict[str, Any]:
    """What a library could change in the process: generators, torch's switches, warnings, logging,
    the environment (the variables changed since ``environ_before``), signal handlers, live threads,
    exit handlers, and torch's own functions (those replaced since ``functions_before``)."""
    loggers = {"": logging.getLogger()} | {
        name: logger for name, logger in logging.root.manager.loggerDict.items() if isinstance(logger, logging.Logger)
    }
    configured = {
        name: (logger.level, [type(h).__name__ for h in logger.handlers], logger.propagate, logger.disabled)
        for name, logger in loggers.items()
        if logger.level or logger.handlers or not logger.propagate or logger.disabled or name == ""
    }
    functions = torch_functions()
    from torch.nn.modules import module as module_globals
    from torch.optim import optimizer as optimizer_globals

    return {
        "generators": {
            "torch": digest(torch.get_rng_state().numpy().tobytes()),
            "numpy": digest(pickle.dumps(np.random.get_state())),
            "random": digest(pickle.dumps(random.getstate())),
        },
        "switches": {
            "grad": torch.is_grad_enabled(),
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
            "threads": torch.get_num_threads(),
            "default_dtype": str(torch.get_default_dtype()),
            "anomaly": torch.is_anomaly_enabled(),
            "matmul_precision": torch.get_float32_matmul_precision(),
        },
        "warnings_filters": [repr(f) for f in warnings.filters],
        "logging": configured,
        "environ": {k: v for k, v in os.environ.items() if environ_before.get(k) != v}
        | {k: None for k in environ_before if k not in os.environ},
        "signals": {int(s): repr(signal.getsignal(s)) for s in signal.valid_signals() if signal.getsignal(s)},
        "threads": sorted(HEARTBEAT if t.name.startswith(HEARTBEAT) else t.name for t in threading.enumerate()),
        "atexit": atexit._ncallbacks(),
        "torch_functions_replaced": sorted(
            name for name in set(functions) | set(functions_before) if functions.get(name) != functions_before.get(name)
        ),
        "global_hooks": {
            f"{owner.__name__}.{name}": len(getattr(owner, name))
            for owner in (module_globals, optimizer_globals)
            for name in dir(owner)
            if name.startswith("_global_") and isinstance(getattr(owner, name), dict)
        },
    }


def states_through_a_job(engine: str) -> list[dict[str, Any]]:
    """Snapshots before wrapping, after steps, after a re-plan (ours; DDP: one more step), after destroy."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    model = Stack()
    functions, environ = torch_functions(), dict(os.environ)
    snapshots = [process_state(functions, environ)]
    wrapped = replicate(model) if engine == "ours" else DDP(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(3):
        step_of(wrapped, optimizer, batch(rank, step))()
    snapshots.append(process_state(functions, environ))
    if engine == "ours":
        model.blocks[0].requires_grad_(False)  # a re-plan; DDP has none
    step_of(wrapped, optimizer, batch(rank, 3))()
    snapshots.append(process_state(functions, environ))
    dist.barrier()  # both ranks past their last collective: gloo's teardown can hang a rank left behind
    dist.destroy_process_group()
    del wrapped, model, optimizer
    gc.collect()  # what the interpreter's collector does in time: hooks hold the model in cycles
    snapshots.append(process_state(functions, environ))
    return snapshots


def differences(ours: dict[str, Any], ddp: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    found = {}
    for key in ddp:
        if key in ("environ", "logging", "global_hooks"):  # dicts: name the entries that differ
            names = set(ours[key]) | set(ddp[key])
            keys = sorted(n for n in names if ours[key].get(n) != ddp[key].get(n))
            if keys:
                found[key] = ({k: ours[key].get(k) for k in keys}, {k: ddp[key].get(k) for k in keys})
        elif ours[key] != ddp[key]:
            found[key] = (ours[key], ddp[key])
    return found


@pytest.mark.timeout(240)
def test_the_process_is_left_as_ddp_leaves_it():
    ddp = launch(states_through_a_job, nprocs=2, args=("ddp",), timeout_s=120)
    ours = launch(states_through_a_job, nprocs=2, args=("ours",), timeout_s=120)
    points = ["before wrapping", "after 3 steps", "after a re-plan", "after destroy_process_group()"]
    for rank in range(2):
        for point, mine, theirs in zip(points, ours[rank], ddp[rank], strict=True):
            found = differences(mine, theirs)
            # the documented differences (docs/migration.md), while a replicated module lives: the
            # watchdog's heartbeat thread, torch's global hooks that count module registrations
            # and optimizer steps; and the watchdog's exit handler (one per replicate())
            living = point != "after destroy_process_group()"
            hooks = found.pop("global_hooks", None)
            if hooks is not None:
                assert living and all(hooks[0][k] == hooks[1][k] + 1 for k in hooks[0]), (rank, point, hooks)
            threads = found.pop("threads", None)
            if threads is not None:
                extra = list(threads[0])
                for name in threads[1]:
                    extra.remove(name)
                assert extra == [HEARTBEAT] and living, (rank, point, threads)
            exits = found.pop("atexit", None)
            assert exits is None or exits[0] == exits[1] + 1, (rank, point, exits)
            assert not found, f"rank {rank}, {point}: ours left the process otherwise than DDP: {found}"


# -- reproducible by default ------------------------------------------------------------------------


def seeded_job(options: dict[str, Any]) -> bytes:
    """The issue's job: 3 ranks, 64 x (Linear(128) + LayerNorm), SGD, 30 steps; the weights' bytes."""
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = replicate(Stack(depth=64, width=128), **options)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(30):
        step_of(model, optimizer, batch(rank, step, width=128))()
    num_buckets = len(replicate.state(model).reducer.buckets)
    weights = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
    torchreplicate.verify_replicas(model)
    dist.barrier()
    dist.destroy_process_group()
    return num_buckets.to_bytes(2, "little") + weights


@pytest.mark.timeout(300)
@pytest.mark.parametrize("nprocs, num_runs", [(3, 3), (2, 2), (4, 2)])
def test_the_same_seed_gives_the_same_bits_on_every_run(nprocs, num_runs):
    runs = [launch(seeded_job, nprocs=nprocs, args=({},), timeout_s=150)[0] for _ in range(num_runs)]
    assert int.from_bytes(runs[0][:2], "little") >= 2, "one bucket: the layout would not matter"
    assert all(run == runs[0] for run in runs[1:]), f"a rerun on {nprocs} ranks gave other weights"


def test_tuning_is_refused_under_deterministic_algorithms():
    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        with pytest.raises(RuntimeError, match=r'bucket_layout="tuned" lets measured timings choose the buckets'):
            ReplicateConfig(bucket_layout="tuned")
        ReplicateConfig()  # the default is reproducible: accepted
        torch.use_deterministic_algorithms(True, warn_only=True)
        with pytest.warns(UserWarning, match=r"warn_only=True: tuning stays on"):
            ReplicateConfig(bucket_layout="tuned")
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)


def test_tuning_chooses_the_cap_itself():
    with pytest.raises(ValueError, match=r'bucket_layout="tuned" chooses the bucket cap itself, got bucket_cap_mb=25'):
        ReplicateConfig(bucket_layout="tuned", bucket_cap_mb=25)
    assert ReplicateConfig().cap_bytes == 25 * 2**20 and ReplicateConfig(bucket_layout="tuned").cap_bytes is None


# -- DDP on top of a replicated model ---------------------------------------------------------------


def ddp_on_top(rank: int, world_size: int) -> dict[str, str]:
    messages = {}
    model = replicate(seeded(Stack, 1))
    wrapped = DDP(model)  # as accelerate's prepare() or Trainer would
    try:
        wrapped(batch(rank, 0)).sum().backward()
        messages["on top"] = "no error"
    except RuntimeError as error:
        messages["on top"] = str(error)
    try:
        replicate(DDP(seeded(Stack, 2)))
        messages["under"] = "no error"
    except TypeError as error:
        messages["under"] = str(error)
    outer = nn.Sequential(DDP(seeded(Stack, 3)), nn.Linear(1, 1))
    try:
        replicate(outer)
        messages["inside"] = "no error"
    except RuntimeError as error:
        messages["inside"] = str(error)
    return messages


def test_ddp_on_top_of_a_replicated_model_raises_on_every_rank(pools):
    for rank, messages in enumerate(pools.run(2, ddp_on_top)):
        on_top = messages["on top"]
        assert on_top.startswith(f"replicate(): rank {rank}: this Stack was replicated and is now run by "), on_top
        assert "DistributedDataParallel" in on_top and "prepare_model(model, evaluation_mode=True)" in on_top, on_top
        assert "replicate(model), not replicate(DDP(model))" in messages["under"], messages
        assert "the submodule '0' is a torch.nn.parallel.DistributedDataParallel" in messages["inside"], messages
