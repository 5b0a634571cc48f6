"""Merges one torch release's test results into the torch range's record (scripts/torch_range.sh).

    python scripts/range_record.py RECORD.json JUNIT.xml PYTHON

Run by the interpreter that ran the tests (so its torch and Python are the ones recorded). Writes
RECORD.json (one entry per torch release: the commit, whether src/ or tests/ differed from it, the
torch adapter's SHA-256, the outcome of every test) and RECORD.md beside it, a table to read.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import platform
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

ADAPTER = Path("src/torchreplicate/torch_internals.py")


def outcomes(junit: Path) -> dict[str, str]:
    """``{test id: passed | failed | skipped | xfailed | xpassed}`` from pytest's JUnit XML."""
    found = {}
    for case in ET.parse(junit).iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        test_id = f"{module}.py::{case.get('name')}"
        kinds = {child.tag: child for child in case}
        if "failure" in kinds or "error" in kinds:
            found[test_id] = "failed"
        elif "skipped" in kinds:
            expected = kinds["skipped"].get("type") == "pytest.xfail"
            found[test_id] = "xfailed" if expected else "skipped"
        else:
            found[test_id] = "passed"
    return found


def git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout.strip()


def main(record: Path, junit: Path, python: str) -> None:
    tests = outcomes(junit)
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
        "tests": dict(sorted(tests.items())),
    }
    data = json.loads(record.read_text()) if record.exists() else {"runs": {}}
    data["command"] = "bash scripts/torch_range.sh VERSION[:PYTHON] ..."
    data["runs"][torch.__version__.split("+")[0]] = entry
    data["runs"] = dict(sorted(data["runs"].items(), key=lambda kv: [int(p) for p in kv[0].split(".")]))
    record.write_text(json.dumps(data, indent=1) + "\n")
    lines = ["| torch | Python | commit | passed | failed | skipped | xfailed |", "|---|---|---|---|---|---|---|"]
    for release, run in data["runs"].items():
        c = run["counts"]
        commit = run["commit"][:7] + (" (+ changes)" if run["changed_since_commit"] else "")
        row = [release, run["python"], commit, *(str(c.get(k, 0)) for k in ("passed", "failed", "skipped", "xfailed"))]
        lines.append("| " + " | ".join(row) + " |")
    record.with_suffix(".md").write_text(
        "# The torch range: the core and DDP-comparison subsets on each release\n\n"
        "Written by `bash scripts/torch_range.sh`; every test's outcome is in torch_range.json.\n\n"
        + "\n".join(lines)
        + "\n"
    )
    print(f"range_record.py: torch {torch.__version__}: {counts}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])
