"""The tests' launch() (local_ranks.py) from Python; scripts under torchrun; the removed public launch()."""

import multiprocessing
import os
import re
import threading
import time
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist

from harness import TORCHRUN, run_command
from local_ranks import WorkerError, launch

# -- launch() from Python: the targets run on the launched ranks, which import
# them from this module by name (tests/ is on sys.path)


class RankReport(NamedTuple):
    rank: int
    world_size: int  # from the WORLD_SIZE environment variable the launcher sets
    total: float  # all-reduced sum of rank + 1


def rank_and_sum() -> RankReport:
    dist.init_process_group("gloo")
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    return RankReport(dist.get_rank(), int(os.environ["WORLD_SIZE"]), value.item())


def rank_one_fails() -> None:
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        raise ValueError("boom on rank one")
    dist.barrier()  # rank 0 would wait here forever: the launcher must kill it


def sleeps_forever() -> None:
    time.sleep(600)


def returns_a_lock() -> object:
    return threading.Lock()


def test_launch_returns_results_by_rank():
    results = launch(rank_and_sum, 3, timeout_s=120)
    assert results == [RankReport(0, 3, 6.0), RankReport(1, 3, 6.0), RankReport(2, 3, 6.0)]


def _children() -> set:
    return {p.pid for p in multiprocessing.active_children()}


def test_worker_error_names_rank_and_kills_the_rest():
    before = _children()  # the session's test pools live on
    started = time.monotonic()
    with pytest.raises(WorkerError) as info:
        launch(rank_one_fails, 2, timeout_s=120)
    assert info.value.rank == 1
    assert "ValueError: boom on rank one" in str(info.value)
    assert time.monotonic() - started < 60, "the waiting rank was not killed promptly"
    assert _children() - before == set(), "a launched rank outlived launch()"


def test_timeout_kills_every_rank():
    before = _children()
    with pytest.raises(TimeoutError, match="after 3 s"):
        launch(sleeps_forever, 2, timeout_s=3)
    assert _children() - before == set(), "a launched rank outlived launch()"


def test_a_value_that_cannot_be_pickled_is_reported_not_waited_for():
    with pytest.raises(WorkerError, match="returns_a_lock returned a value that cannot be pickled"):
        launch(returns_a_lock, 2, timeout_s=120)


def test_bad_nprocs():
    with pytest.raises(ValueError, match="nprocs must be a positive int, got 0"):
        launch(rank_and_sum, 0)


def test_the_removed_public_launch_names_its_replacement():
    # torchreplicate.launch until 0.2.0: a user's import says what replaces it
    with pytest.raises(ImportError, match=r"torchreplicate.launch was removed in 0.2\.0.*torchrun.*elastic_launch"):
        from torchreplicate import launch as _  # noqa: F401
    with pytest.raises(ImportError, match="ChildFailedError"):
        from torchreplicate import WorkerError as _  # noqa: F401,F811
    import torchreplicate

    assert not hasattr(torchreplicate, "no_such_name"), "an unknown name must stay an AttributeError"


# -- scripts: torchrun, not this package, launches them

TWO_RANKS = [*TORCHRUN, "--standalone", "--nproc-per-node", "2"]


def _run(command, timeout=180):
    return run_command(command, timeout=timeout)  # from the repository root (harness.ROOT)


def test_torchrun_runs_the_example():
    done = _run([*TWO_RANKS, "examples/train.py", "--steps", "30"])
    assert done.returncode == 0, done.stderr
    assert "identical: True" in done.stdout and "match: True" in done.stdout
    assert "RuntimeWarning" not in done.stderr


def test_torchrun_reports_a_failing_rank(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("import os\nif os.environ['RANK'] == '1':\n    raise SystemExit('rank one gives up')\n")
    done = _run([*TWO_RANKS, str(script)])
    assert done.returncode == 1
    assert "rank one gives up" in done.stderr, done.stderr
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)", done.stderr), done.stderr  # torchrun's root cause
