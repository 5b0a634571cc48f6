"""Merges one torch release's test results into the torch range's record (scripts/torch_range.sh).

    python scripts/range_record.py RECORD.json JUNIT.xml PYTHON

Run by the interpreter that ran the tests (so its torch and Python are the ones recorded). Writes
RECORD.json (one entry per torch release: the commit, whether src/ or tests/ differed from it, the
torch adapter's SHA-256, the outcome of every test, and the bits of one seeded job) and RECORD.md
beside it, a table to read. The seeded job: 3 gloo ranks train a replicated MLP (dropout, AdamW) for
5 steps, and one process trains the same MLP on the global batch; the SHA-256 of each one's final
weights. Where two releases' one-process bits agree (torch's own kernels), their replicated bits
must agree too (tests/test_torch_range.py).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import platform
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

ADAPTER = Path("src/torchreplicate/torch_internals.py")


def outcomes(junit: Path) -> tuple[dict[str, str], dict[str, str]]:
    """``{test id: passed | failed | skipped | xfailed}`` from pytest's JUnit XML, and why each not passed."""
    found, why = {}, {}
    for case in ET.parse(junit).iter("testcase"):
        module = case.get("classname", "").replace(".", "/")  # empty where a whole module skipped at collection
        test_id = f"{module}.py::{case.get('name')}" if module else f"{case.get('name')} (the module)"
        kinds = {child.tag: child for child in case}
        for tag in ("failure", "error", "skipped"):
            if tag in kinds:
                why[test_id] = (kinds[tag].get("message") or "")[:300]
        if "failure" in kinds or "error" in kinds:
            found[test_id] = "failed"
        elif "skipped" in kinds:
            expected = kinds["skipped"].get("type") == "pytest.xfail"
            found[test_id] = "xfailed" if expected else "skipped"
        else:
            found[test_id] = "passed"
    return found, why


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 4))


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * step + rank))


def digest(model: nn.Module) -> str:
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()


def seeded_rank(rank: int, world_size: int, store_path: str, out: str) -> None:
    from torchreplicate import replicate

    dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size)
    model = replicate(mlp())
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    torch.manual_seed(1 + rank)  # dropout's stream, rank-different
    for step in range(5):
        model(batch(rank, step)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    if rank == 0:
        Path(out).write_text(digest(model))
    dist.destroy_process_group()


def seeded_bits(folder: Path, world_size: int = 3) -> dict[str, str]:
    """The SHA-256 of the seeded job's final weights: replicated on 3 ranks, and in one process."""
    mp.spawn(seeded_rank, (world_size, str(folder / "store"), str(folder / "bits")), nprocs=world_size)
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    torch.manual_seed(1)  # the same kernels, dropout's included, on one stream
    for step in range(5):
        (sum(model(batch(rank, step)).square().mean() for rank in range(world_size)) / world_size).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {"replicated_3_ranks": (folder / "bits").read_text(), "one_process": digest(model)}


def git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout.strip()


def main(record: Path, junit: Path, python: str) -> None:
    tests, reasons = outcomes(junit)
    counts = {kind: sum(1 for o in tests.values() if o == kind) for kind in sorted(set(tests.values()))}
    entry = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "python_asked": python,
        "commit": git("rev-parse", "HEAD"),
        "changed_since_commit": bool(git("status", "--porcelain", "--", "src", "tests")),
        "adapter_sha256": hashlib.sha256(ADAPTER.read_bytes()).hexdigest(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "subset": "core or ddp",
        "counts": counts,
        "seeded_bits": seeded_bits(Path(tempfile.mkdtemp())),
        "tests": dict(sorted(tests.items())),
        "reasons": dict(sorted(reasons.items())),
    }
    data = json.loads(record.read_text()) if record.exists() else {"runs": {}}
    data["command"] = "bash scripts/torch_range.sh VERSION[:PYTHON] ..."
    data["env"] = {"git": {"head": entry["commit"], "src_status": git("status", "--porcelain", "--", "src")}}
    data["runs"][torch.__version__.split("+")[0]] = entry
    data["runs"] = dict(sorted(data["runs"].items(), key=lambda kv: [int(p) for p in kv[0].split(".")]))
    record.write_text(json.dumps(data, indent=1) + "\n")
    record.with_suffix(".md").write_text(markdown(data))
    print(f"range_record.py: torch {torch.__version__}: {counts}")


def markdown(data: dict) -> str:
    """The record's .md, from its .json alone (tests/test_results.py renders it again)."""
    lines = ["| torch | Python | commit | passed | failed | skipped | xfailed |", "|---|---|---|---|---|---|---|"]
    for release, run in data["runs"].items():
        c = run["counts"]
        commit = run["commit"][:7] + (" (+ changes)" if run["changed_since_commit"] else "")
        row = [release, run["python"], commit, *(str(c.get(k, 0)) for k in ("passed", "failed", "skipped", "xfailed"))]
        lines.append("| " + " | ".join(row) + " |")
    return (
        "# The torch range: the core and DDP-comparison subsets on each release\n\n"
        "Written by `bash scripts/torch_range.sh`; every test's outcome is in torch_range.json.\n\n"
        + "\n".join(lines)
        + "\n"
    )


if __name__ == "__main__":  # the spawned ranks import this file again: main() only here
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])
