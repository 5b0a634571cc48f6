"""The result files carry their provenance, hold no machine path, and their summaries are their data.

- Every result recorded through ``benchmarks/benchlib/report.py`` from issue 48 on records the
  command line, the UTC time, the CPU model and count, torch and Python, the commit and the whole
  tree's status (``run_env``); paths are kept relative to the checkout (``portable``).
- No committed result file holds an absolute path of the machine that recorded it.
- Every median stored beside its per-round data (``{"median": m, "per_round": [...]}``) is the
  median of that data: a summary edited by hand, or left from another run, fails.
- The headline cells (the README's first screen) come from results recorded at or after the last
  commit that changed the step (``src/torchreplicate/reducer/``): a change to the step makes the
  headline stale until the benchmark is run again, and the failure names the command.
"""

from __future__ import annotations

import importlib.util
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
# The headline result files and how each is refreshed (the README's first screen quotes them).
HEADLINES = {
    "ddp_bits_loopback_2.json": (
        ".venv/bin/python benchmarks/ddp_here/bench_ddp.py --rounds 12 --no-ws1 --no-memory --no-instrument "
        "--name ddp_bits_loopback_2"
    ),
}
MACHINE_PATH = re.compile(r"(?<![\w.)])/(?:work|tmp|root|home|Users|opt|mnt)/")


def _report_module() -> Any:
    spec = importlib.util.spec_from_file_location("benchlib_report", ROOT / "benchmarks" / "benchlib" / "report.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _strings(value: Any, path: str = "") -> Iterator[tuple[str, str]]:
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _strings(item, f"{path}.{index}")
    elif isinstance(value, str):
        yield path, value


def stale_summaries(value: Any, path: str = "") -> list[str]:
    """Where a stored median is not the median of the per-round data beside it."""
    found = []
    if isinstance(value, dict):
        rounds = value.get("per_round")
        if isinstance(rounds, list) and rounds and "median" in value:
            if all(isinstance(x, (int, float)) for x in rounds):
                median = statistics.median(rounds)
                if abs(median - value["median"]) > 1e-9 * max(1.0, abs(median)):
                    found.append(f"{path}: median {value['median']!r}, its per_round data give {median!r}")
        for key, item in value.items():
            found += stale_summaries(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found += stale_summaries(item, f"{path}.{index}")
    return found


def _result_files() -> list[Path]:
    return sorted(RESULTS.rglob("*.json"))


def test_no_committed_result_holds_a_machine_path():
    assert MACHINE_PATH.search('"root": "/work/main"'), "the check must bite"
    found = []
    for path in _result_files():
        for where, text in _strings(json.loads(path.read_text())):
            if text.startswith("/") or MACHINE_PATH.search(text):
                found.append(f"{path.relative_to(RESULTS)}: {where} = {text!r}")
    for path in sorted(RESULTS.rglob("*.md")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if MACHINE_PATH.search(line):
                found.append(f"{path.relative_to(RESULTS)}:{number}: {line.strip()[:100]}")
    assert not found, "result files with this machine's paths (benchlib/report.py's portable() keeps them out):\n" + (
        "\n".join(found)
    )


def test_every_stored_median_is_the_median_of_its_per_round_data():
    planted = {"a": {"median": 1.0, "per_round": [1.0, 2.0, 4.0]}}
    assert stale_summaries(planted) == ["a: median 1.0, its per_round data give 2.0"], "the check must bite"
    checked, stale = 0, []
    for path in _result_files():
        data = json.loads(path.read_text())
        checked += json.dumps(data).count('"per_round"')
        stale += [f"{path.relative_to(RESULTS)}: {where}" for where in stale_summaries(data)]
    assert not stale, "summaries that are not their data:\n" + "\n".join(stale)
    assert checked > 500, f"only {checked} per-round series found: has the format changed?"


def test_a_run_records_its_provenance_and_no_machine_path(monkeypatch):
    report = _report_module()
    monkeypatch.setattr(sys, "argv", [str(ROOT / "benchmarks" / "ddp_here" / "bench_ddp.py"), "--quick"])
    env = report.run_env()
    assert env["argv"] == ["benchmarks/ddp_here/bench_ddp.py", "--quick"], env["argv"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", env["utc"]), env["utc"]
    assert env["cpu_model"] and env["cpu_count"] >= 1
    assert env["torch"] and env["python"] and len(env["git"]["head"]) == 40
    assert "tree_status" in env["git"] and "src_status" in env["git"]
    assert env["torchreplicate_file"] == "src/torchreplicate/__init__.py", env["torchreplicate_file"]
    assert (
        report.portable("/tmp/torchreplicate-snap-abc/src/x.py")
        == "(outside the checkout)/torchreplicate-snap-abc/src/x.py"
    )
    assert not [text for _, text in _strings(env) if text.startswith("/")], env


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.parametrize("name", sorted(HEADLINES))
def test_the_headline_results_were_recorded_after_the_last_change_to_the_step(name):
    data = json.loads((RESULTS / name).read_text())
    env = data["env"]
    for key in ("argv", "utc", "cpu_model", "torch", "python", "cpu_count"):
        assert env.get(key), f"{name}: recorded without its provenance ({key}); refresh: {HEADLINES[name]}"
    recorded = env["git"]["head"]
    # every file one step runs (issue 60: a change to core/state.py, on every forward, once passed unflagged)
    from test_step_shape import LEAVES, READ_IN_ORDER

    step_files = [f"src/torchreplicate/{path}" for path in (*READ_IN_ORDER, *LEAVES)]
    changed = _git("log", "-1", "--format=%H", "--", "src/torchreplicate/reducer", *step_files)
    if not changed:
        pytest.skip("no git history of the step's files here (a shallow or exported tree)")
    at_or_after = subprocess.run(["git", "-C", str(ROOT), "merge-base", "--is-ancestor", changed, recorded]).returncode
    assert at_or_after == 0 or env["git"].get("src_status"), (
        f"{name} was recorded at {recorded[:7]}, before {changed[:7]} changed the step "
        f"(src/torchreplicate/reducer/ or a file one step runs): the README's headline is stale. "
        f"Refresh it on a quiet machine: "
        f"{HEADLINES[name]}, then update the quoted cells (tests/test_doc_numbers.py names them)"
    )


# The script that writes each current result, by name, where the JSON does not record its command line
# (results recorded before issue 48); from then on env.argv names it.
WRITERS = {
    "ddp_bits_network": "bench_net",
    "default_vs_tuned_network": "bench_net",
    "network": "bench_net",
    "ddp_": "bench_ddp",
    "default_vs_tuned_loopback": "bench_ddp",
    "comm_hooks": "bench_hooks",
    "unused_parameters": "bench_dynamic",
    "observer_cost": "bench_observe",
    "first_steps": "bench_first_step",
    "watchdog_scale": "bench_watchdog",
    "torchft_recovery": "bench_torchft",
}
NOT_RENDERED = {"setup_times": "scripts/record_times.sh writes both files in shell; its .md is its own"}
RENDERERS = ("markdown_tables", "markdown", "table_of", "table")  # each script's report -> markdown


def rendered_again(path: Path) -> tuple[str, str]:
    """A current result's .md rendered again from its .json by the script that writes it: (rendered, writer)."""
    data = json.loads(path.read_text())
    name = path.stem
    if name == "torch_range":
        spec = importlib.util.spec_from_file_location("range_record", ROOT / "scripts" / "range_record.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.markdown(data), "scripts/range_record.py"
    argv = data.get("env", {}).get("argv")
    writer = Path(argv[0]).stem if argv else next(s for prefix, s in WRITERS.items() if name.startswith(prefix))
    script = next((ROOT / "benchmarks").glob(f"*/{writer}.py"))  # in the folder of its question
    sys.path[:0] = [str(script.parent), str(ROOT / "benchmarks")]
    try:
        module = importlib.import_module(writer)
        from benchlib.report import run_header
    finally:
        for folder in (script.parent, ROOT / "benchmarks"):
            sys.path.remove(str(folder))
    render = next(getattr(module, fn) for fn in RENDERERS if hasattr(module, fn))
    return run_header(data) + "\n\n" + render(data), str(script.relative_to(ROOT))


def test_every_current_result_md_is_its_json_rendered_again(tmp_path):
    # A .md edited by hand, or left from another run, differs from what its script renders from the
    # .json: the pages quote the .json (cells), readers read the .md; both must say the same.
    current = [p for p in sorted(RESULTS.glob("*.json")) if p.stem not in NOT_RENDERED]
    assert len(current) >= 19, [p.name for p in current]
    for path in current:
        rendered, writer = rendered_again(path)
        stored = path.with_suffix(".md").read_text()
        assert rendered == stored, (
            f"{path.with_suffix('.md').name} is not {path.name} as {writer} renders it: edit the .json "
            "(a note goes in env.note) and render again, or record the run again"
        )
    # the check bites: a median edited in the .json no longer renders as the stored .md
    data = json.loads((RESULTS / "ddp_bits_loopback_2.json").read_text())
    data["world_size_2"]["mlp"]["ratios"]["ours/ddp"]["median"] += 0.01
    planted = tmp_path / "ddp_bits_loopback_2.json"
    planted.write_text(json.dumps(data))
    assert rendered_again(planted)[0] != (RESULTS / "ddp_bits_loopback_2.md").read_text(), "the check must bite"
