"""The torch range: declared in one floor, probed by feature, and recorded as run on each end.

The floor and the features live in torch_internals.py ([Note: the torch range]).
scripts/torch_range.sh runs the core and DDP-comparison subsets on other torch
releases and records every outcome in benchmarks/results/torch_range.json; the
record must have tested the torch adapter as it is now.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from torchreplicate import torch_internals
from torchreplicate.torch_internals import FEATURES, FLOOR

ROOT = Path(__file__).resolve().parent.parent
RECORD = ROOT / "benchmarks" / "results" / "torch_range.json"
ADAPTER = ROOT / "src" / "torchreplicate" / "torch_internals.py"
FLOOR_TEXT = f"{FLOOR[0]}.{FLOOR[1]}"
# The releases scripts/torch_range.sh must have run, each with its interpreter: the floor's release, the GPU
# machine's (2.11 on Python 3.12), the development one and the newest this machine's pip installs.
ENDS = {"2.9.1": "3.11", "2.11.0": "3.12", "2.13.0": "3.11", "2.14.1": "3.11"}
REFRESH = "bash scripts/torch_range.sh 2.9.1 2.11.0:python3.12 2.13.0 2.14.1"


def record() -> dict:
    return json.loads(RECORD.read_text())


def test_the_range_is_declared_alike_everywhere():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'"torch>={FLOOR_TEXT}"' in pyproject, "pyproject.toml's dependency: the floor of torch_internals.py"
    for page in ("README.md", "docs/getting-started.md", "CHANGELOG.md"):
        text = (ROOT / page).read_text()
        assert re.search(rf"torch {FLOOR_TEXT}(\.\d+)? to 2\.14", text), f"{page} does not state the range"
    assert sorted(ENDS, key=lambda v: [int(p) for p in v.split(".")])[0].startswith(FLOOR_TEXT + ".")


def test_the_record_tested_this_adapter_on_every_end():
    runs = record()["runs"]
    adapter = hashlib.sha256(ADAPTER.read_bytes()).hexdigest()
    for release, python in ENDS.items():
        assert release in runs, f"no recorded run on torch {release}: run {REFRESH}"
        run = runs[release]
        assert run["adapter_sha256"] == adapter, (
            f"src/torchreplicate/torch_internals.py changed since scripts/torch_range.sh ran on torch {release} "
            f"(at {run['commit'][:7]}): run {REFRESH}, and commit benchmarks/results/torch_range.json"
        )
        assert run["python"].startswith(python + "."), f"torch {release} ran on Python {run['python']}, not {python}"


def test_every_recorded_end_passed_both_subsets():
    runs = record()["runs"]
    for release in ENDS:
        tests = runs[release]["tests"]
        failed = sorted(name for name, outcome in tests.items() if outcome not in ("passed", "skipped", "xfailed"))
        assert not failed, f"torch {release}: {failed}"
        modules = {name.split("::")[0].rsplit("/", 1)[-1] for name in tests}
        assert {"test_api.py", "test_parity.py", "test_ddp_bits.py", "test_buffers.py"} <= modules, release
        passed = sum(outcome == "passed" for outcome in tests.values())
        assert passed >= 250, f"torch {release}: only {passed} tests passed"


def test_the_same_seed_gives_the_same_bits_where_torchs_kernels_agree():
    bits = {release: run["seeded_bits"] for release, run in record()["runs"].items()}
    assert set(ENDS) <= set(bits)
    for a in bits:
        for b in bits:
            if bits[a]["one_process"] == bits[b]["one_process"]:  # torch's own kernels give the same bits
                assert bits[a]["replicated_3_ranks"] == bits[b]["replicated_3_ranks"], f"torch {a} and {b}"


def test_the_floor_refuses_an_older_torch_by_name():
    code = "import torch; torch.__version__ = '2.8.0+cu128'; import torchreplicate"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert f"ImportError: torchreplicate needs torch >= {FLOOR_TEXT} (this is torch 2.8.0+cu128)" in done.stderr
    assert f"pip install 'torch>={FLOOR_TEXT}'" in done.stderr


@pytest.mark.parametrize("name", sorted(FEATURES))
def test_each_feature_is_present_on_this_torch(name):
    feature = FEATURES[name]
    assert feature.present, f"{name} is missing on torch {torch.__version__}, inside the declared range"
    assert re.fullmatch(r"\d+\.\d+", feature.since) and len(feature.without) > 40


def test_without_the_group_store_the_watchdog_finds_the_same_store(monkeypatch, tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        for group in (dist.group.WORLD, dist.new_group([0])):
            group_store = torch_internals.group_store(group)
            monkeypatch.setitem(FEATURES, "group_store", FEATURES["group_store"]._replace(present=False))
            fallback = torch_internals.group_store(group)
            monkeypatch.undo()
            fallback.set("written-by-the-fallback", "yes")
            assert group_store.get("written-by-the-fallback") == b"yes", "the fallback found another store"
    finally:
        dist.destroy_process_group()


def test_without_the_profiler_flag_labels_stop_and_trace_refuses(tmp_path):
    code = (
        "import torch.autograd.profiler as p; del p._is_profiler_enabled\n"
        "import torchreplicate\n"
        "from torchreplicate import torch_internals as t\n"
        "assert not t.FEATURES['profiler_flag'].present and not t.profiler_active()\n"
        "with torch.profiler.profile(): assert not t.profiler_active()\n"
        "torchreplicate.trace('unused.json', model=torch.nn.Linear(1, 1))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-c", "import torch\n" + code],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=tmp_path,
    )
    assert "RuntimeError: trace(): this torch has no torch.autograd.profiler._is_profiler_enabled: " in done.stderr
    assert "the reducer records no torchreplicate:: labels" in done.stderr
