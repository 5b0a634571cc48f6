"""What a report records about its run, and writing it: ``<name>.json`` and ``<name>.md``."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from typing import Any, Callable, Optional, Sequence

import torch

import torchreplicate

BENCHMARKS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(BENCHMARKS)
RESULTS_DIR = os.path.join(BENCHMARKS, "results")  # the scripts' default --out
MiB = 1024 * 1024


def run_env(**extra: Any) -> dict:
    """What a report records at the start of a run, its provenance: the command line, the UTC time,
    the CPU model and count, torch, Python, the commit and the whole tree's status, the load; plus
    ``extra``. No absolute path of this machine is kept (``portable``)."""
    return {
        "argv": [portable(sys.argv[0]), *sys.argv[1:]],
        "utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu_model": cpu_model(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torchreplicate_file": portable(torchreplicate.__file__),
        "git": git_info(),
        "loadavg_start": os.getloadavg(),
        "threads_per_rank": 1,
        **extra,
    }


def portable(path: Optional[str]) -> Optional[str]:
    """``path`` without this machine's layout: relative to the checkout where it lies inside it, else
    ``(outside the checkout)/`` and the path below its top two folders (a snapshot's own name kept)."""
    if not path:
        return path
    real = os.path.realpath(path)
    if real == REPO or real.startswith(REPO + os.sep):
        return os.path.relpath(real, REPO)
    return "/".join(["(outside the checkout)", *real.split(os.sep)[2:]])


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux), else what ``platform`` says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_info() -> dict:
    """This checkout's HEAD, the ``git status`` of its ``src/`` and of the whole tree (empty strings without git)."""

    def run(*args: str) -> str:
        try:
            return subprocess.run(["git", "-C", REPO, *args], capture_output=True, text=True, timeout=10).stdout.strip()
        except Exception:
            return ""

    return {
        "head": run("rev-parse", "HEAD"),
        "src_status": run("status", "--porcelain", "--", "src"),
        "tree_status": run("status", "--porcelain"),
    }


def source_info(module_file: Optional[str]) -> dict:
    """Which torchreplicate a process imported: this checkout's, or a snapshot.

    A snapshot is a ``git archive`` copy with the commit in ``SNAPSHOT_COMMIT``
    (see ``benchmarks/snapshot.sh``), so that edits to ``src/`` during a run
    do not reach the benchmark.
    """
    if not module_file:
        return {}
    if not os.path.isabs(module_file):  # run_env's, made portable: inside the checkout, or no longer readable
        if module_file.startswith("(outside"):
            return {"root": module_file.rsplit("/", 3)[0], "is_this_checkout": False}
        module_file = os.path.join(REPO, module_file)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(module_file))))
    info: dict[str, Any] = {
        "root": portable(root),
        "is_this_checkout": os.path.realpath(root) == os.path.realpath(REPO),
    }
    marker = os.path.join(root, "SNAPSHOT_COMMIT")
    if os.path.exists(marker):
        with open(marker) as f:
            info["snapshot_commit"] = f.read().strip()
    return info


def run_header(report: dict) -> str:
    """One line for the markdown: what was measured, where, under what load (after ``env["note"]``, if any)."""
    env = report.get("env", {})
    src = env.get("source", {})
    git = env.get("git", {})
    commit = src.get("snapshot_commit") or (
        git.get("head", "?") + (" + uncommitted src/" if git.get("src_status") else "")
    )
    where = "git-archive snapshot" if src.get("snapshot_commit") else "working tree"

    def load(v: Optional[list]) -> str:
        return "/".join(f"{x:.2f}" for x in v) if v else "?"

    note = f"_{env['note']}_\n\n" if env.get("note") else ""  # what the run's env cannot say (set by hand)
    return note + (
        f"_torchreplicate {commit[:12]} ({where}), torch {env.get('torch', '?')}, {env.get('cpu_count', '?')} CPUs, "
        f"load average (1/5/15 min) {load(env.get('loadavg_start'))} at start, {load(env.get('loadavg_end'))} at end_"
    )


def finish_report(
    report: dict, started: float, rank_file: Optional[str], table_of: Callable[[dict], str], out_dir: str, name: str
) -> str:
    """Stamps the end load, the measured source and the run time; writes and prints the report.

    Args:
        report: the JSON-able report, with ``env`` from ``run_env``.
        started: ``time.time()`` at the start of the run.
        rank_file: ``torchreplicate.__file__`` as the ranks imported it.
        table_of: report -> markdown (without the header line, which is added here).
        out_dir: where ``<name>.json`` and ``<name>.md`` go.
        name: the files' stem.

    Returns:
        The markdown, header line included.
    """
    report["env"]["loadavg_end"] = os.getloadavg()
    report["env"]["source"] = source_info(rank_file)
    for key in ("torchreplicate_file_in_ranks", "before_package"):  # set by some benchmarks: no machine paths
        if report["env"].get(key):
            report["env"][key] = portable(report["env"][key])
    report["elapsed_s"] = time.time() - started
    table = run_header(report) + "\n\n" + table_of(report)
    path = write_report(report, table, out_dir, name)
    print()
    print(table)
    print(f"[bench] wrote {path} and {name}.md in {report['elapsed_s']:.0f} s")
    return table


def write_report(report: dict, table: str, out_dir: str, name: str) -> str:
    """Writes ``<name>.json`` (atomically) and ``<name>.md`` in ``out_dir``; returns the JSON path."""
    os.makedirs(out_dir, exist_ok=True)
    json_path = os.path.join(out_dir, f"{name}.json")
    with open(json_path + ".tmp", "w") as f:
        json.dump(report, f, indent=1)
    os.replace(json_path + ".tmp", json_path)
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(table)
    return json_path


def comma_choices(parser: argparse.ArgumentParser, text: str, allowed: Sequence[str], what: str = "model") -> list[str]:
    """A command line's comma list (``--models mlp,gpt``), each name checked against ``allowed``.

    Exits through ``parser.error`` on an unknown name, naming the ones allowed.
    """
    names = [name for name in text.split(",") if name]
    for name in names:
        if name not in allowed:
            parser.error(f"unknown {what} {name!r}; expected some of {', '.join(allowed)}")
    return names
