"""Restart and resume with torchrun and torch.distributed.checkpoint (examples/train.py).

A rank killed mid-run, torchrun restarting the group, the script resuming
from its newest checkpoint: the final weights equal an uninterrupted run's,
bitwise. Resuming at another world size continues identically up to fp32
rounding (the global batches are the same; only the reduction order moves).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from harness import run_command

TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
STEPS = "30"


def _run(command: list[str], timeout: float = 180) -> subprocess.CompletedProcess:
    # torch 2.13's torchrun keeps one store across restarts: a restarted group
    # can read the failed group's stale addresses (pytorch/pytorch#135712)
    return run_command(command, env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}, timeout=timeout)


def _train(nprocs: int, *extra: str, max_restarts: int = 0) -> subprocess.CompletedProcess:
    if not os.path.exists(TORCHRUN):
        pytest.skip(f"torchrun is not installed beside {sys.executable}")
    command = [TORCHRUN, "--standalone", f"--nproc-per-node={nprocs}", f"--max-restarts={max_restarts}"]
    done = _run([*command, "examples/train.py", "--steps", STEPS, *extra])
    assert done.returncode == 0, done.stdout + done.stderr
    assert "identical: True" in done.stdout and "match: True" in done.stdout, done.stdout
    return done


def _weights(path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def test_a_killed_rank_restarts_and_resumes_bitwise(tmp_path):
    _train(2, "--save-final", str(tmp_path / "plain.pt"))
    restarted = _train(
        2,
        *("--checkpoint-dir", str(tmp_path / "ckpt"), "--save-every", "10", "--fail-at", "1:17"),
        *("--save-final", str(tmp_path / "restarted.pt")),
        max_restarts=1,
    )
    assert "failed (exitcode: 17)" in restarted.stderr, "the fault was not injected"
    assert "resumed from" in restarted.stdout and "at step 10, world size 2" in restarted.stdout, restarted.stdout
    plain, resumed = _weights(tmp_path / "plain.pt"), _weights(tmp_path / "restarted.pt")
    for name, tensor in plain.items():
        assert torch.equal(tensor, resumed[name]), f"{name} differs after the restart"


@pytest.mark.parametrize("new_world_size", [1, 3])
def test_resume_at_another_world_size(tmp_path, new_world_size):
    batch = ("--batch", "60")  # divisible by 1, 2 and 3
    _train(2, *batch, "--save-final", str(tmp_path / "plain.pt"))
    checkpoints = ("--checkpoint-dir", str(tmp_path / "ckpt"))
    # first half on 2 ranks (saving at step 15), second half on the new world size
    first = _run(
        [TORCHRUN, "--standalone", "--nproc-per-node=2", "examples/train.py", "--steps", "15", *batch, *checkpoints]
        + ["--save-every", "15"]
    )
    assert first.returncode == 0, first.stdout + first.stderr
    resumed = _train(new_world_size, *batch, *checkpoints, "--save-final", str(tmp_path / "resumed.pt"))
    assert f"at step 15, world size {new_world_size}" in resumed.stdout, resumed.stdout
    plain, other = _weights(tmp_path / "plain.pt"), _weights(tmp_path / "resumed.pt")
    for name, tensor in plain.items():
        # AdamW over 15 more steps from a state equal up to fp32 rounding of a
        # differently ordered sum: agreement to about 1e-5 relative
        torch.testing.assert_close(other[name], tensor, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
