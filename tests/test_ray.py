"""Ray Train: ``torchreplicate.integrations.ray.prepare_model`` against Ray's own DDP path, bit for bit.

A local Ray cluster (2 CPUs, no dashboard, no usage reporting; Train's current API, V2), 3 workers
of half a CPU each (at 2 workers any summation order gives the same bits, so 2 would prove nothing),
gloo. The same seeded loop (tests/ray_runs.py: dropout, AdamW) runs under
``ray.train.torch.prepare_model(model)`` (DDP) and under ours; each worker writes its final weights'
digest. Three runs, each compared across the engines per rank:

- uninterrupted, with a checkpoint reported at its end;
- resumed from that checkpoint (model, optimizer, step; the data and dropout streams follow the step);
- a worker SIGKILLed mid-training with ``FailureConfig(max_failures=1)``: Ray restarts the group
  from the last reported checkpoint, and the run ends with the weights Ray's DDP ends with.

And the refusals: Ray's FSDP strategy, a model already replicated, and ``replicate()`` followed
by Ray's default ``prepare_model`` (DDP on top), whose error names this path.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")  # Train's current API (before ray is imported)
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
ray = pytest.importorskip("ray", reason="the ray extra: pip install 'torchreplicate[ray]'")
pytest.importorskip("ray.train.torch", reason="the ray extra: pip install 'torchreplicate[ray]'")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from ray.train import FailureConfig, RunConfig, ScalingConfig  # noqa: E402
from ray.train.torch import TorchTrainer  # noqa: E402
from torch import nn  # noqa: E402

import ray_runs  # noqa: E402
from torchreplicate import replicate  # noqa: E402
from torchreplicate.integrations.ray import prepare_model  # noqa: E402

WORKERS = 3
ENGINES = ("ddp", "ours")


@pytest.fixture(scope="module")
def cluster():
    ray.cloudpickle.register_pickle_by_value(ray_runs)  # the workers do not have tests/ on their path
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def fit(config: dict[str, Any], storage: Path, failures: int = 0) -> Any:
    trainer = TorchTrainer(
        ray_runs.train,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=WORKERS, resources_per_worker={"CPU": 0.5}),
        run_config=RunConfig(
            name=f"{config['engine']}-{len(list(storage.iterdir()))}",
            storage_path=str(storage),
            failure_config=FailureConfig(max_failures=failures),
        ),
    )
    return trainer.fit()


def digests(out: Path, engine: str) -> list[str]:
    return [(out / f"{engine}-{rank}").read_text() for rank in range(WORKERS)]


def assert_same_bits(out: Path, what: str) -> None:
    ours, theirs = digests(out, "ours"), digests(out, "ddp")
    assert ours == theirs, f"{what}: weights by rank, ours {ours}, Ray's DDP {theirs}"
    assert len(set(ours)) == 1, f"{what}: the replicas differ: {ours}"
    assert ours[0] != ray_runs.digest(_initial()), f"{what}: the weights did not move"


def _initial() -> nn.Module:
    torch.manual_seed(0)
    return ray_runs.network()


@pytest.fixture(scope="module")
def first_runs(cluster, tmp_path_factory):
    # the uninterrupted run of each engine: 4 steps, a checkpoint at the end
    out, storage = tmp_path_factory.mktemp("first"), tmp_path_factory.mktemp("storage")
    results = {e: fit({"engine": e, "steps": 4, "save_every": 4, "out": str(out)}, storage) for e in ENGINES}
    return out, results


@pytest.mark.timeout(240)
def test_ours_trains_as_rays_ddp_bit_for_bit(first_runs):
    out, results = first_runs
    for engine, result in results.items():
        assert result.error is None and result.checkpoint is not None, (engine, result.error)
    assert_same_bits(out, "3 workers, 4 steps")


@pytest.mark.timeout(240)
def test_a_run_resumed_from_its_checkpoint_ends_as_rays_ddp_resumed(first_runs, tmp_path):
    _, results = first_runs
    storage = tmp_path / "storage"
    storage.mkdir()
    for engine in ENGINES:
        resume = results[engine].checkpoint.path
        result = fit({"engine": engine, "steps": 7, "save_every": 7, "out": str(tmp_path), "resume": resume}, storage)
        assert result.error is None, (engine, result.error)
    assert_same_bits(tmp_path, "resumed at step 4, to step 7")


@pytest.mark.timeout(240)
def test_a_killed_worker_restarts_from_the_last_checkpoint_and_ends_as_rays_ddp(cluster, tmp_path):
    storage = tmp_path / "storage"
    storage.mkdir()
    for engine in ENGINES:
        config = {"engine": engine, "steps": 6, "save_every": 2, "out": str(tmp_path), "kill_at": 3}
        result = fit(config, storage, failures=1)
        assert result.error is None, (engine, result.error)
        assert (tmp_path / f"killed-{engine}").read_text() == "3", f"{engine}: no worker was killed"
    assert_same_bits(tmp_path, "rank 1 SIGKILLed at step 3, restarted from step 2's checkpoint")


def test_rays_fsdp_strategy_is_refused_naming_what_to_do():
    with pytest.raises(ValueError, match=r"parallel_strategy='fsdp' is not taken: ours replaces Ray's 'ddp'"):
        prepare_model(nn.Linear(2, 2), parallel_strategy="fsdp")


def test_options_that_would_be_ignored_or_given_twice_are_refused():
    # before Ray's preparation, on every worker alike: nothing is silently dropped or overridden
    with pytest.raises(
        TypeError, match=r"parallel_strategy=None replicates nothing, so bucket_cap_mb would be ignored"
    ):
        prepare_model(nn.Linear(2, 2), parallel_strategy=None, bucket_cap_mb=10)
    with pytest.raises(TypeError, match=r"bucket_cap_mb given both in parallel_strategy_kwargs and as options"):
        prepare_model(nn.Linear(2, 2), parallel_strategy_kwargs={"bucket_cap_mb": 10}, bucket_cap_mb=25)


def test_a_replicated_model_is_refused_and_ddp_on_top_names_this_path():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = replicate(nn.Linear(2, 2))
        with pytest.raises(RuntimeError, match="already replicated"):
            prepare_model(model)
        # what Ray's default prepare_model does at more than one worker: DDP around the model
        wrapped = torch.nn.parallel.DistributedDataParallel(replicate(nn.Linear(2, 2)))
        with pytest.raises(RuntimeError, match=r"torchreplicate\.integrations\.ray\.prepare_model"):
            wrapped(torch.randn(3, 2))
    finally:
        dist.destroy_process_group()
