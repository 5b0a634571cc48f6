"""MkDocs hook: the benchmark result files, on the site under ``results/``.

The tables in docs/performance.md cite their result files; adding
``benchmarks/results/*.md`` and ``*.png`` here (rather than copying them into
docs/) keeps one copy of each, and lets ``mkdocs build --strict`` check every
link to them. Superseded runs in ``benchmarks/results/archive/`` go on the
site too, under ``results/archive/``, for the pages that cite them as history.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files, InclusionLevel

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def on_files(files: Files, config: Any) -> Files:
    """Adds every result table and picture as ``results/<name>`` (``results/archive/<name>``)."""
    for path in sorted([*RESULTS.iterdir(), *(RESULTS / "archive").iterdir()]):
        if path.suffix in (".md", ".png"):
            files.append(
                File(
                    str(path.relative_to(RESULTS.parent)),
                    src_dir=str(RESULTS.parent),
                    dest_dir=config["site_dir"],
                    use_directory_urls=config["use_directory_urls"],
                    inclusion=InclusionLevel.NOT_IN_NAV,  # reached from the pages that cite it
                )
            )
    return files
