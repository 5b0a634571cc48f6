"""The library as it was at an earlier revision, importable beside today's as ``torchreplicate_before``.

``bench_before_after.py`` times both in one process group, side by side with
DDP: ``materialise(rev)`` writes that revision's ``src/torchreplicate`` (from
git) into a fresh folder as the package ``torchreplicate_before``, its own
imports renamed, and returns the folder to put on ``PYTHONPATH``. Strings
(the profiler labels ``torchreplicate::<phase>``) are left as they were, so
the breakdown reads both.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import tarfile
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NAME = "torchreplicate_before"
_IMPORT = re.compile(r"^(\s*)(from|import) torchreplicate(?=[.\s])", re.MULTILINE)


def materialise(rev: str) -> str:
    """Writes ``rev``'s package as ``torchreplicate_before`` under a new temporary folder; returns the folder."""
    archive = subprocess.run(
        ["git", "archive", "--format=tar", rev, "src/torchreplicate"], cwd=REPO, check=True, capture_output=True
    ).stdout
    root = tempfile.mkdtemp(prefix="torchreplicate_before_")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        for member in tar.getmembers():
            if not member.isfile() or not member.name.endswith(".py"):
                continue
            relative = os.path.relpath(member.name, "src/torchreplicate")
            target = os.path.join(root, NAME, relative)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            extracted = tar.extractfile(member)
            assert extracted is not None
            text = extracted.read().decode()
            with open(target, "w", encoding="utf-8") as out:
                out.write(_IMPORT.sub(rf"\1\2 {NAME}", text))
    return root
