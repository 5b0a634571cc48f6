"""Packaging: the wheel, installed into a clean venv, imports and runs a 2-rank step.

What a ``pip install torchreplicate`` user gets: the wheel is built from this
checkout, installed with torch 2.13.0 (CPU) into a new venv without the
system's packages, and a script run from outside the checkout imports the
installed files (not the source tree) and trains one step on 2 gloo ranks
against a one-process reference. Not run here: trace(), which needs numpy
(torch 2.13's all_gather_object calls tensor.numpy()) that a plain install
lacks (an open bug: numpy belongs in the dependencies or the [plot] extra).
The metadata must name the extras the README's install line names. Slow (a
venv with torch: minutes on a loaded machine); bounded by the timeout.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TORCH = "torch==2.13.0"

STEP = r"""
import sys
import torch, torch.distributed as dist
from torch import nn
import torchreplicate
from torchreplicate import replicate

venv = sys.argv[1]
assert torchreplicate.__file__.startswith(venv), f"imported {torchreplicate.__file__}, not the installed wheel"
assert not {"matplotlib", "lightning", "torchft"} & set(sys.modules)
dist.init_process_group("gloo")
rank, world_size = dist.get_rank(), dist.get_world_size()
torch.manual_seed(rank)  # different starts: replicate() gives every rank rank 0's
model = replicate(nn.Linear(4, 2))
torch.manual_seed(0)
reference = nn.Linear(4, 2)
batches = [torch.randn(3, 4, generator=torch.Generator().manual_seed(r)) for r in range(world_size)]
model(batches[rank]).sum().backward()
torch.stack([reference(b).sum() for b in batches]).mean().backward()
for p, q in zip(model.parameters(), reference.parameters()):
    torch.testing.assert_close(p.grad, q.grad)
dist.destroy_process_group()
print(f"rank {rank}: ok {torchreplicate.__version__} from {torchreplicate.__file__}")
"""


def run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(command, capture_output=True, text=True, **kwargs)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.mark.timeout(900)
def test_wheel_installs_into_a_clean_venv_and_runs_a_two_rank_step(tmp_path):
    dist_dir = tmp_path / "dist"
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(dist_dir), str(ROOT)])
    (wheel,) = dist_dir.glob("torchreplicate-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "torchreplicate/py.typed" in names
    assert "torchreplicate/integrations/lightning/trainer.py" in names
    assert "torchreplicate/integrations/torchft.py" in names
    assert "torchreplicate/integrations/accelerate/prepare.py" in names
    assert "torchreplicate/integrations/ray.py" in names
    assert "torchreplicate/integrations/options.py" in names  # what the Lightning and accelerate entry points share
    assert not any(n.startswith(("tests/", "tools/", "benchmarks/")) for n in names), names
    for extra in ("plot", "lightning", "torchft", "accelerate", "ray", "test"):
        assert f"Provides-Extra: {extra}" in metadata, f"no [{extra}] extra in the wheel's metadata"
    assert 'matplotlib>=3.5; extra == "plot"' in metadata
    assert 'lightning>=2.6; extra == "lightning"' in metadata
    assert 'torchft>=0.2; extra == "torchft"' in metadata
    assert 'accelerate>=1.16; extra == "accelerate"' in metadata
    assert 'ray[train]>=2.60; extra == "ray"' in metadata

    # nothing from the checkout: with PYTHONPATH=src, pip would take the build's
    # src/torchreplicate.egg-info for an installed torchreplicate and skip the wheel
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(venv)], env=env)  # no --system-site-packages: only what the wheel pulls in
    python = venv / "bin" / "python"
    run([str(python), "-m", "pip", "install", "--quiet", str(wheel), TORCH], env=env, cwd=tmp_path, timeout=720)

    script = tmp_path / "step.py"
    script.write_text(STEP)
    launch = [str(python), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    done = run([*launch, str(script), str(venv)], cwd=tmp_path, env=env, timeout=180)
    for rank in (0, 1):
        assert f"rank {rank}: ok" in done.stdout, done.stdout
