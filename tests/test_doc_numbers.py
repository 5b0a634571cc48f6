"""The docs stay true to their sources: numbers to the result files, result files to commits, names to the code.

- A number quoted from a result file stands after a marker
  ``<!-- from: results/NAME.md -->`` (several files: comma-separated) and
  must be a rounding of a number in that file (its markdown or its JSON):
  ``0.93`` matches ``0.929``. The marker covers the rest of its paragraph
  (to the next blank line; a whole table when it stands on the line before
  it). A paragraph that links a result file and quotes decimal numbers with
  no marker fails, so a quoted number cannot be left unchecked by leaving
  the marker out.
- Every result file names the commit it measured, and that commit is in the
  repository's history (CI's clone is a full one); the files recorded from a
  tree with uncommitted changes, or from a commit that is no longer in the
  history, are listed here with what their pages say about it.
- The evidence page cites, for each result file, the commit the file names.
- Every ``torchreplicate`` name the API page documents (``::: name``) or the
  pages write as a dotted path imports, and the API page documents only what
  ``torchreplicate`` exports, except under a heading that names its module.

docs/contributing.md describes the markers.
"""

from __future__ import annotations

import importlib
import json
import math
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOCUMENTS = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Result files whose measured commit is not in the history, with why; their pages say so.
COMMIT_NOT_IN_HISTORY: dict[str, str] = {}
# Result files recorded from a tree with uncommitted changes under src/ (env.git.src_status), with what changed.
RECORDED_FROM_UNCOMMITTED = {
    "watchdog": "7d04afb + the roll call, not yet committed (roll_call.py, watchdog.py, state.py)",
    "net_issue24_100mbit": "b033eeb + edits to core/plan.py and core/state.py",
    "net_issue24_1gbit_before": "b033eeb's script, 8ca25a9's library (PYTHONPATH); plan.py, state.py edited, not run",
}

MARKER = re.compile(r"(?<!`)<!--\s*from:\s*(?P<files>[^>]*?)\s*-->")
DECIMAL = re.compile(r"(?<![\w.])(\d+\.\d+)(?![\w.]*\d)")  # 0.93, 121.0; not 2.13.0, not v1.2
ANY_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
LINK_TARGET = re.compile(r"\]\([^)]*\)")
RESULT_LINK = re.compile(r"results/(\w+)\.(?:md|json)")
DOTTED_NAME = re.compile(r"(?<![\w/.])torchreplicate(?:\.[A-Za-z_]\w*)+")
HEX = re.compile(r"\b[0-9a-f]{7,40}\b")


def _paragraph_after(text: str, start: int) -> str:
    """From ``start`` to the next blank line."""
    end = text.find("\n\n", start)
    return text[start : end if end >= 0 else len(text)]


def _decimals(text: str) -> list[str]:
    """The decimal numbers ``text`` quotes, link targets and result-file names left out."""
    return DECIMAL.findall(RESULT_LINK.sub("", LINK_TARGET.sub("](...)", text)))


def _file_numbers(name: str) -> list[float]:
    """Every number in result file ``name`` (its markdown and, where there is one, its JSON)."""
    texts = [(RESULTS / f"{name}{suffix}") for suffix in (".md", ".json")]
    return [float(n) for path in texts if path.exists() for n in ANY_NUMBER.findall(path.read_text())]


def is_rounding_of(quoted: str, numbers: list[float]) -> bool:
    """Whether ``quoted`` (say "0.93") is one of ``numbers`` rounded to its decimals (0.929, 0.9301, ...)."""
    places = len(quoted.split(".")[1])
    value = float(quoted)
    half = 0.5 * 10**-places + 1e-12
    return any(math.isfinite(n) and abs(n - value) <= half for n in numbers)


def quoted_from_files(text: str) -> list[tuple[list[str], str, str]]:
    """Each marker's files, the text it covers and the decimals in that text."""
    found = []
    for match in MARKER.finditer(text):
        files = [Path(f.strip()).stem for f in match["files"].split(",") if f.strip()]
        covered = _paragraph_after(text, match.end() + (1 if text[match.end() : match.end() + 1] == "\n" else 0))
        for number in _decimals(covered):
            found.append((files, number, covered.splitlines()[0][:80] if covered else ""))
    return found


def _relative(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_each_quoted_number_is_a_rounding_of_a_number_in_its_result_file():
    wrong, checked = [], 0
    for document in DOCUMENTS:
        for files, number, where in quoted_from_files(document.read_text()):
            missing = [f for f in files if not (RESULTS / f"{f}.md").exists()]
            assert not missing, f"{_relative(document)}: a marker names result files that do not exist: {missing}"
            numbers = [n for f in files for n in _file_numbers(f)]
            checked += 1
            if not is_rounding_of(number, numbers):
                wrong.append(f"{_relative(document)}: {number} is in none of {files} (near {where!r})")
    assert not wrong, "numbers that their result files do not hold:\n" + "\n".join(wrong)
    assert checked >= 20, f"only {checked} numbers are quoted under markers: have markers gone missing?"


def test_a_paragraph_that_cites_a_result_file_with_numbers_has_a_marker():
    unmarked = []
    for document in DOCUMENTS:
        for paragraph in re.split(r"\n\s*\n", document.read_text()):
            if RESULT_LINK.search(paragraph) and _decimals(paragraph) and not MARKER.search(paragraph):
                unmarked.append(f"{_relative(document)}: {paragraph.strip().splitlines()[0][:100]!r}")
    assert not unmarked, (
        "paragraphs that cite a result file and quote numbers with no <!-- from: results/NAME.md --> marker"
        " (docs/contributing.md):\n" + "\n".join(unmarked)
    )


def test_the_number_check_itself():
    assert is_rounding_of("0.93", [0.929]) and is_rounding_of("121.0", [121.02]) and is_rounding_of("1.5", [1.46])
    assert not is_rounding_of("0.93", [0.936]) and not is_rounding_of("1.05", [1.0])
    text = "a\n\n<!-- from: results/latest.md -->\nours 0.93 of DDP, torch 2.13.0, [x](results/latest.md)\n1.5\n\nz 9.9"
    assert [(files, number) for files, number, _ in quoted_from_files(text)] == [
        (["latest"], "0.93"),
        (["latest"], "1.5"),
    ]


# -- result files and commits --------------------------------------------------


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def history():
    if shutil.which("git") is None or _git("rev-parse", "--git-dir").returncode != 0:
        pytest.skip("not a git checkout (an sdist or a copy): the commits cannot be looked up")
    if _git("rev-parse", "--is-shallow-repository").stdout.strip() == "true":
        pytest.skip("a shallow clone: older commits are not there to look up (CI's clone is a full one)")
    return lambda commit: _git("cat-file", "-e", f"{commit}^{{commit}}").returncode == 0


def measured_commit(name: str) -> str:
    """The commit result file ``name`` says it measured: its JSON's snapshot, or the checkout's head."""
    env = json.loads((RESULTS / f"{name}.json").read_text())["env"]
    return env.get("source", {}).get("snapshot_commit") or env["git"]["head"]


def _json_results() -> list[str]:
    return sorted(path.stem for path in RESULTS.glob("*.json"))


def test_every_result_file_names_a_commit_in_the_history(history):
    not_found = {name for name in _json_results() if not history(measured_commit(name))}
    assert not_found == set(COMMIT_NOT_IN_HISTORY), (
        f"result files whose commit is not in the history: {sorted(not_found)};"
        f" listed as such: {sorted(COMMIT_NOT_IN_HISTORY)}"
    )
    for path in RESULTS.glob("*.md"):
        if (RESULTS / f"{path.stem}.json").exists():
            continue  # its JSON is checked above
        named = [c for c in HEX.findall(path.read_text()) if not c.isdigit()]
        assert named, f"{path.name} names no commit"
        assert all(history(c) for c in named), f"{path.name} names commits not in the history: {named}"


def test_a_result_file_from_uncommitted_changes_is_listed_and_says_so():
    dirty = set()
    for name in _json_results():
        env = json.loads((RESULTS / f"{name}.json").read_text())["env"]
        if env["git"].get("src_status", "").strip() and not env.get("source", {}).get("snapshot_commit"):
            dirty.add(name)
    assert dirty == set(RECORDED_FROM_UNCOMMITTED), (
        f"recorded from uncommitted trees: {sorted(dirty)}; listed: {sorted(RECORDED_FROM_UNCOMMITTED)}"
    )
    for name in dirty:
        assert "uncommitted" in (RESULTS / f"{name}.md").read_text(), f"{name}.md does not say it is uncommitted"


def test_the_evidence_page_cites_the_commits_the_result_files_name():
    rows = [line for line in (ROOT / "docs" / "evidence.md").read_text().splitlines() if "(results/" in line]
    assert len(rows) >= 8, "the evidence page's table of result files is gone"
    for row in rows:
        cited = HEX.findall(row.split("|")[-2])
        files = RESULT_LINK.findall(row)
        named = " ".join(path.read_text() for f in files for path in RESULTS.glob(f"{f}.*") if path.suffix != ".png")
        assert cited, f"evidence.md cites no commit for {files}"
        for commit in cited:
            assert commit in named, f"evidence.md cites {commit} for {files}, which do not name it"


def test_the_benchmarks_readme_counts_and_names_every_script():
    scripts = sorted(path.name for path in (ROOT / "benchmarks").glob("bench_*.py"))
    text = (ROOT / "benchmarks" / "README.md").read_text()
    words = ["One", "Two", "Three", "Four", "Five", "Six", "Seven", "Eight", "Nine", "Ten", "Eleven", "Twelve"]
    assert text.split("\n", 3)[2].startswith(f"{words[len(scripts) - 1]} scripts"), (
        f"benchmarks/README.md does not open with '{words[len(scripts) - 1]} scripts' ({len(scripts)}: {scripts})"
    )
    assert not [s for s in scripts if f"`{s}`" not in text], "scripts benchmarks/README.md does not name"


# -- names ----------------------------------------------------------------------


def resolve(dotted: str) -> object:
    """The object ``dotted`` names: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as error:
            if error.name is not None and not ".".join(parts[:cut]).startswith(error.name):
                raise  # a dependency of the module is missing, not the module
            continue
        for attribute in parts[cut:]:
            target = getattr(target, attribute)
        return target
    raise ModuleNotFoundError(dotted)


def documented_names() -> dict[str, str]:
    """Every dotted ``torchreplicate...`` name the pages write, with where."""
    names: dict[str, str] = {}
    for document in DOCUMENTS:
        for match in DOTTED_NAME.finditer(document.read_text()):
            names.setdefault(match.group().rstrip("."), _relative(document))
    return names


def test_every_documented_name_imports():
    pytest.importorskip("torchft", reason="the torchft extra: the pages document torchreplicate.integrations.torchft")
    pytest.importorskip("lightning", reason="the lightning extra: the pages document its strategies")
    failed = []
    for name, where in sorted(documented_names().items()):
        try:
            resolve(name)
        except (ImportError, AttributeError) as error:
            failed.append(f"{where}: {name}: {type(error).__name__}: {error}")
    assert not failed, "documented names that do not import:\n" + "\n".join(failed)
    assert "torchreplicate.WorkerError" in documented_names()


def test_the_api_page_documents_what_torchreplicate_exports():
    import torchreplicate

    text = (ROOT / "docs" / "api.md").read_text()
    assert "Everything here is importable from\n`torchreplicate` unless its heading says otherwise" in text
    section, outside = "", []
    for line in text.splitlines():
        if line.startswith("## "):
            section = ""
        elif line.startswith("`torchreplicate."):
            section = line.split("`")[1]  # the module a section names under its heading
        elif line.startswith("::: "):
            name = line[4:].strip()
            module, _, short = name.rpartition(".")
            if module == "torchreplicate":
                assert short in torchreplicate.__all__, f"api.md documents {name}, which torchreplicate does not export"
            elif module != section:
                outside.append(name)
    assert not outside, f"api.md documents names outside torchreplicate with no heading naming their module: {outside}"
    documented = {line[4:].strip().rpartition(".")[2] for line in text.splitlines() if line.startswith("::: ")}
    lacking = set(torchreplicate.__all__) - documented
    assert not lacking, f"exports the API page lacks: {sorted(lacking)}"
