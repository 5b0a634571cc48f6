"""scripts/gpu_check.sh refuses, loudly, where no GPU is visible (it never skips its checks)."""

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: gpu_check.sh would run the whole check")
def test_gpu_check_fails_without_a_gpu():
    done = subprocess.run(
        ["bash", os.path.join(ROOT, "scripts", "gpu_check.sh")],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, (done.returncode, done.stdout, done.stderr)
    assert "gpu_check: FAILED: no CUDA GPU is visible" in done.stdout, done.stdout
