"""The docs stay true to their sources: numbers to cells of result files, result files to commits, names to code.

**Cells.** A number quoted from a result file is followed at once by a
marker naming the cell it comes from, a JSON file under benchmarks/results/
and the dotted path of keys to the value (list positions as numbers; a
superseded run is ``archive/NAME.json``)::

    ours/DDP 0.927<!-- cell: ddp_loopback.json world_size_2.mlp.ratios.ours/ddp.median -->

The quoted number must be the cell rounded to the quoted number's decimals
(``0.927`` for 0.92656, ``62`` for 61.75; integers included, ``1,000`` for
1000). ``* N`` or ``/ N`` after the key scales the cell first (``* 100`` for
a percentage, ``/ 1048576`` for MiB from bytes). A wrong number, a key that
names nothing and a file that does not exist all fail, naming the cells of
that file that do hold the number. To find a cell for a number::

    .venv/bin/python tests/test_doc_numbers.py ddp_loopback.json 0.927

**Which numbers must carry one.** A measured number is one with decimals,
or one followed by a unit (``s``, ``ms``, ``MiB``, ``GB``, ``%``, ``x``,
``all-reduces``, ...); numbers in code, link targets and HTML comments, and
versions (2.13.0), are not. Every measured number must carry a marker in

- each paragraph, list item or table (a block between blank lines) that
  names a result file (``results/NAME``) or carries a marker already;
- each headline claim in ``HEADLINES`` below: the README's set-up times and
  speed claim, the site's home page, the performance page's first figures.

Old ``<!-- from: -->`` markers are refused. ``test_the_check_fails_on_a_
changed_number_a_lost_marker_and_a_wrong_cell`` shows on a scratch copy of
the README that each of those mistakes fails.

**Adding a result.** A benchmark run writes ``NAME.json`` and ``NAME.md``
into benchmarks/results/ (one current file per benchmark; move the run it
supersedes to ``archive/``, rewriting the markers that named it). Then add
a row to the index on docs/performance.md (``test_the_performance_page_
indexes_every_current_result_file`` fails until there is one) and a row to
the evidence page, and quote it with cell markers as above.

**Commits.** Every result file names the commit it measured, and that commit
is in the repository's history (CI's clone is a full one); the files
recorded from a tree with uncommitted changes are listed here with what their
pages say about it. The evidence page cites, for each result file, the
commit the file names.

**Names.** Every ``torchreplicate`` name the API page documents (``::: name``)
or the pages write as a dotted path imports, and the API page documents only
what ``torchreplicate`` exports, except under a heading that names its module.

docs/contributing.md describes the markers.
"""

from __future__ import annotations

import importlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterable

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOCUMENTS = [
    ROOT / "README.md",
    ROOT / "benchmarks" / "README.md",
    ROOT / "CHANGELOG.md",  # release notes quote results too (issue 48)
    *sorted((ROOT / "docs").glob("*.md")),
]

# Headline claims: (document, words that find the block). Each must still be
# there, and every measured number in it must carry a cell marker.
HEADLINES = [
    ("README.md", "Measured on the project's 2-core machine"),  # the set-up and run times
    ("README.md", "step time / DDP's defaults"),  # the first screen's table
    ("README.md", "step time / DDP with `gradient_as_bucket_view=True`"),
    ("docs/index.md", "of DDP's step time on three models"),
    ("docs/performance.md", "What this says, against the issue's goals"),  # issue 56's section leads now
    ("docs/performance.md", "world size 1, ours/local step"),
    ("docs/patterns.md", "A parameter unused on one rank costs"),
]

# Result files whose measured commit is not in the history, with why; their pages say so.
COMMIT_NOT_IN_HISTORY: dict[str, str] = {}
# Result files recorded from a tree with uncommitted changes under src/ (env.git.src_status), with what changed.
RECORDED_FROM_UNCOMMITTED = {
    "watchdog_scale": "7d04afb + the roll call, not yet committed (roll_call.py, watchdog.py, state.py)",
    "archive/net_issue24_100mbit": "b033eeb + edits to core/plan.py and core/state.py",
    "archive/net_issue24_1gbit_before": (
        "b033eeb's script, 8ca25a9's library (PYTHONPATH); plan.py, state.py edited, not run"
    ),
}

CELL = re.compile(
    r"(?<![\w.,])(?P<number>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?)"
    r"<!--\s*cell:\s*(?P<file>\S+\.json)\s+(?P<key>\S+)(?:\s*(?P<op>[*/])\s*(?P<factor>\d+(?:\.\d+)?))?\s*-->"
)
OLD_MARKER = re.compile(r"(?<!`)<!--\s*from:")
COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)
CODE_SPAN = re.compile(r"`[^`\n]*`")
FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
LINK_TARGET = re.compile(r"\]\([^)]*\)")
RESULT_LINK = re.compile(r"results/((?:archive/)?\w+)\.(?:md|json|png)")
UNIT = r"(?:ms|µs|us|s|min|minutes|seconds|MiB|MB|GiB|GB|kB|KiB|%|x|×|all-reduces|collectives|requests)"
# A measured number: decimals (not a version such as 2.13.0), or a unit after it.
MEASURED = re.compile(
    r"(?<![\w.,/])(?P<number>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+\.\d+(?![\d.]*\d)|\d+(?=\s?" + UNIT + r"(?![\w(])))"
)
DOTTED_NAME = re.compile(r"(?<![\w/.])torchreplicate(?:\.[A-Za-z_]\w*)+")
HEX = re.compile(r"\b[0-9a-f]{7,40}\b")


def _relative(path: Path) -> str:
    return str(path.relative_to(ROOT))


def cell_value(file: str, key: str, results: Path = RESULTS) -> Any:
    """The value at dotted ``key`` of result file ``file`` (``archive/NAME.json`` for a superseded run).

    A key that holds dots itself (``ours.fp16_hook/ddp.fp16_hook``) is found
    whole: at each level the longest run of parts that names a key wins.
    """
    value: Any = json.loads((results / file).read_text())
    parts, start = key.split("."), 0
    while start < len(parts):
        if isinstance(value, list) and parts[start].lstrip("-").isdigit():
            value, start = value[int(parts[start])], start + 1
            continue
        for end in range(len(parts), start, -1):
            if isinstance(value, dict) and ".".join(parts[start:end]) in value:
                value, start = value[".".join(parts[start:end])], end
                break
        else:
            raise KeyError(f"{file}: no {parts[start]!r} at {key!r}")
    return value


def rounds_to(quoted: str, value: float) -> bool:
    """Whether ``quoted`` (say "0.93", "1,000") is ``value`` rounded to its decimals."""
    text = quoted.replace(",", "")
    places = len(text.split(".")[1]) if "." in text else 0
    return abs(value - float(text)) <= 0.5 * 10**-places + 1e-9


def cells_holding(file: str, quoted: str, results: Path = RESULTS) -> list[str]:
    """The keys of ``file`` whose number rounds to ``quoted``: where a quoted number may come from."""
    found = []

    def walk(value: Any, key: str) -> None:
        if isinstance(value, dict):
            for name, inner in value.items():
                walk(inner, f"{key}.{name}" if key else str(name))
        elif isinstance(value, list):
            for index, inner in enumerate(value):
                walk(inner, f"{key}.{index}" if key else str(index))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and rounds_to(quoted, value):
            found.append(key)

    walk(json.loads((results / file).read_text()), "")
    return found


def _prose(block: str) -> str:
    """A block with what holds no quoted number blanked: comments, code spans, link targets."""
    for pattern in (COMMENT, CODE_SPAN, LINK_TARGET):
        block = pattern.sub(lambda m: " " * len(m.group()), block)
    return block


def _blocks(text: str) -> list[tuple[int, str]]:
    """The blocks of ``text`` between blank lines (fenced code blanked out), with their first line numbers."""
    text = FENCE.sub(lambda m: "\n" * m.group().count("\n"), text)
    blocks, line = [], 1
    for block in re.split(r"(\n\s*\n)", text):
        if block.strip() and not re.fullmatch(r"\n\s*\n", block):
            blocks.append((line, block))
        line += block.count("\n")
    return blocks


def unmarked_numbers(block: str) -> list[str]:
    """The measured numbers of ``block`` that no cell marker follows."""
    marked = {match.start("number") for match in CELL.finditer(block)}
    prose = _prose(block)
    return [m["number"] for m in MEASURED.finditer(prose) if m.start("number") not in marked]


def check_documents(documents: Iterable[Path], root: Path = ROOT, results: Path = RESULTS) -> tuple[list[str], int]:
    """Every problem with the numbers of ``documents``, and how many cells were checked."""
    problems, checked = [], 0
    texts = {str(path.relative_to(root)): path.read_text() for path in documents}
    for name, text in texts.items():
        if OLD_MARKER.search(text):
            problems.append(f"{name}: an old <!-- from: --> marker; name the cell of each number (<!-- cell: -->)")
        for match in CELL.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            where = f"{name}:{line}: {match['number']} from {match['file']} {match['key']}"
            if not (results / match["file"]).is_file():
                problems.append(f"{where}: no result file {match['file']}")
                continue
            try:
                value = cell_value(match["file"], match["key"], results)
            except (KeyError, IndexError) as error:
                problems.append(f"{where}: {error}")
                continue
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                problems.append(f"{where}: the cell holds {value!r}, not a number")
                continue
            if match["op"]:
                factor = float(match["factor"])
                value = value * factor if match["op"] == "*" else value / factor
            checked += 1
            if not rounds_to(match["number"], value):
                holding = cells_holding(match["file"], match["number"], results)[:5]
                problems.append(f"{where}: the cell holds {value!r}; cells holding {match['number']}: {holding}")
        for line, block in _blocks(text):
            cites = RESULT_LINK.search(block) or CELL.search(block)
            unmarked = unmarked_numbers(block) if cites else []
            if unmarked:
                problems.append(f"{name}:{line}: measured numbers with no cell marker: {unmarked}")
    for name, words in HEADLINES:
        if name not in texts:
            continue
        found = [(line, block) for line, block in _blocks(texts[name]) if words in " ".join(block.split())]
        if not found:
            problems.append(f"{name}: the headline claim {words!r} is gone (update HEADLINES if it moved)")
        for line, block in found:
            if not CELL.search(block):
                problems.append(f"{name}:{line}: the headline claim {words!r} names no cell")
            unmarked = unmarked_numbers(block)
            if unmarked:
                problems.append(f"{name}:{line}: the headline claim {words!r} quotes numbers with no cell: {unmarked}")
    return problems, checked


def test_every_quoted_number_is_its_cell_and_every_measured_number_has_one():
    problems, checked = check_documents(DOCUMENTS)
    assert not problems, "numbers the result files do not back (tests/test_doc_numbers.py):\n" + "\n".join(problems)
    assert checked >= 100, f"only {checked} cells are quoted: have markers gone missing?"


MARKER_MID_LINE = re.compile(r"(?<!`)<!--\s*cell:[^>]*-->(?![,.;:)\]]*\s*$)")  # one in a code span is shown


def markers_mid_sentence(text: str) -> list[int]:
    """Lines of ``text`` where a cell marker interrupts a sentence: neither in a table row nor at
    the line's end (closing punctuation may follow it). Code blocks are not looked at."""
    lines, fenced = [], False
    for number, line in enumerate(text.split("\n"), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and not line.lstrip().startswith("|") and MARKER_MID_LINE.search(line):
            lines.append(number)
    return lines


def test_every_page_reads_as_plain_text_a_marker_ends_its_line_or_sits_in_a_table():
    # A page read as plain Markdown (GitHub, a terminal) shows the markers: one inside a sentence
    # breaks it for the reader. At a line's end it does not, and the rendered page is the same.
    assert markers_mid_sentence("ran in 34<!-- cell: a.json b --> s here") == [1], "the check must bite"
    assert markers_mid_sentence("ran in 34<!-- cell: a.json b -->,\ns here\n| 1<!-- cell: a.json b --> | x |") == []
    found = {
        str(path.relative_to(ROOT)): lines for path in DOCUMENTS if (lines := markers_mid_sentence(path.read_text()))
    }
    assert not found, f"cell markers inside a sentence (end the line after the marker): {found}"


def test_the_check_fails_on_a_changed_number_a_lost_marker_and_a_wrong_cell(tmp_path):
    scratch = tmp_path / "README.md"
    readme = (ROOT / "README.md").read_text()
    line = next(line for line in readme.splitlines() if "step time / DDP's defaults" in line)
    first = CELL.search(line)
    assert first, "the README's speed headline carries no cell marker"

    def problems_with(text: str) -> list[str]:
        scratch.write_text(text)
        return check_documents([scratch], root=tmp_path)[0]

    assert problems_with(readme) == []
    # a quoted number changed by one in its last digit
    number = first["number"]
    changed = number[:-1] + str((int(number[-1]) + 1) % 10)
    wrong = problems_with(readme.replace(first.group(), first.group().replace(number, changed, 1), 1))
    assert any(f"{changed} from {first['file']}" in p and "the cell holds" in p for p in wrong), wrong
    # the marker deleted: the headline's number is unmarked
    bare = problems_with(readme.replace(first.group(), number, 1))
    assert any("no cell" in p and number in p for p in bare), bare
    # the marker pointing at another cell, one that holds another number (two models can round alike)
    other = next(
        key
        for key in (first["key"].replace("mlp", name) for name in ("gpt", "small"))
        if not rounds_to(number, cell_value(first["file"], key))
    )
    moved = problems_with(readme.replace(first["key"], other, 1))
    assert any("the cell holds" in p for p in moved), moved
    # a key that names nothing, and a file that does not exist
    assert any("no 'nothing'" in p for p in problems_with(readme.replace(first["key"], "nothing", 1)))
    assert any("no result file" in p for p in problems_with(readme.replace(first["file"], "gone.json", 1)))
    # integers are checked too: the set-up time
    times = CELL.search(next(b for _, b in _blocks(readme) if "setup_times.json" in b))
    assert times and "." not in times["number"]
    later = str(int(times["number"].replace(",", "")) + 7)
    slower = readme.replace(times.group(), times.group().replace(times["number"], later, 1), 1)
    assert any(later in p for p in problems_with(slower))


def test_the_parts_of_the_check():
    assert rounds_to("0.93", 0.929) and rounds_to("121.0", 121.02) and rounds_to("62", 61.75)
    assert rounds_to("1,000", 1000)
    assert not rounds_to("0.93", 0.936) and not rounds_to("1.05", 1.0) and not rounds_to("61", 61.75)
    block = "ours 0.93<!-- cell: a.json x.y --> and 1.5 ms, 4 MiB, 70 s, 2.13.0, `x=0.5`, 8×Linear, 2 ranks, 1,000"
    assert unmarked_numbers(block) == ["1.5", "4", "70", "1,000"]
    assert [m["number"] for m in CELL.finditer(block)] == ["0.93"]
    assert unmarked_numbers("0.98-1.02x [0.909-0.978], 2 all-reduces in 2fc8115, v1.2") == [
        "0.98",
        "1.02",
        "0.909",
        "0.978",
        "2",
    ]
    assert _blocks("a\n\n```\n1.5 s\n```\n\nb 2 s\nc\n") == [(1, "a"), (7, "b 2 s\nc\n")]  # code left out


def test_the_performance_page_indexes_every_current_result_file():
    text = (ROOT / "docs" / "performance.md").read_text()
    index = text[text.index("## The result files") :]
    index = index[: index.index("\n## ", 4)]
    current = sorted(path.stem for path in RESULTS.glob("*.md"))
    missing = [name for name in current if f"(results/{name}.md)" not in index]
    assert not missing, f"current result files the index on docs/performance.md lacks: {missing}"
    archived = [name for name in RESULT_LINK.findall(index) if name.startswith("archive/")]
    assert not archived, f"the index lists superseded runs as current: {archived}"
    assert not [p.name for p in RESULTS.iterdir() if p.is_file() and p.suffix not in (".md", ".json", ".png")]


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


def _result_names(suffix: str) -> list[str]:
    """Every result file with ``suffix``, current and archived, by name (``archive/NAME`` for the archived)."""
    paths = [*RESULTS.glob(f"*{suffix}"), *(RESULTS / "archive").glob(f"*{suffix}")]
    return sorted(str(path.relative_to(RESULTS).with_suffix("")) for path in paths)


def _json_results() -> list[str]:
    return _result_names(".json")


def test_every_result_file_names_a_commit_in_the_history(history):
    not_found = {name for name in _json_results() if not history(measured_commit(name))}
    assert not_found == set(COMMIT_NOT_IN_HISTORY), (
        f"result files whose commit is not in the history: {sorted(not_found)};"
        f" listed as such: {sorted(COMMIT_NOT_IN_HISTORY)}"
    )
    for name in _result_names(".md"):
        if (RESULTS / f"{name}.json").exists():
            continue  # its JSON is checked above
        named = [c for c in HEX.findall((RESULTS / f"{name}.md").read_text()) if not c.isdigit()]
        assert named, f"{name}.md names no commit"
        assert all(history(c) for c in named), f"{name}.md names commits not in the history: {named}"


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
    scripts = sorted(path.name for path in (ROOT / "benchmarks").glob("*/bench_*.py"))  # one folder per question
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
    """Every dotted ``torchreplicate...`` name the pages write, with where (not the CHANGELOG, which names
    what was removed or moved too)."""
    names: dict[str, str] = {}
    for document in (d for d in DOCUMENTS if d.name != "CHANGELOG.md"):
        for match in DOTTED_NAME.finditer(document.read_text()):
            names.setdefault(match.group().rstrip("."), _relative(document))
    return names


def test_every_documented_name_imports():
    pytest.importorskip("torchft", reason="the torchft extra: the pages document torchreplicate.integrations.torchft")
    pytest.importorskip("lightning", reason="the lightning extra: the pages document its strategies")
    pytest.importorskip("ray.train.torch", reason="the ray extra: the pages document torchreplicate.integrations.ray")
    failed = []
    for name, where in sorted(documented_names().items()):
        try:
            resolve(name)
        except (ImportError, AttributeError) as error:
            failed.append(f"{where}: {name}: {type(error).__name__}: {error}")
    assert not failed, "documented names that do not import:\n" + "\n".join(failed)
    assert "torchreplicate.load_ddp_state_dict" in documented_names()


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


if __name__ == "__main__":  # python tests/test_doc_numbers.py FILE NUMBER: the cells of FILE holding NUMBER
    if len(sys.argv) != 3:
        sys.exit("usage: python tests/test_doc_numbers.py ddp_loopback.json 0.927")
    print("\n".join(cells_holding(sys.argv[1], sys.argv[2])) or f"no cell of {sys.argv[1]} rounds to {sys.argv[2]}")


def test_the_options_table_is_the_signature_of_replicate():
    # docs/migration.md's options table names every keyword option of replicate() and its default
    # as the signature has it (issue 48): an option added, dropped or given another default fails here
    import inspect

    from torchreplicate import replicate

    text = (ROOT / "docs" / "migration.md").read_text()
    table = text[text.index("## Options") : text.index("## What the module gains")]
    rows: dict[str, str] = {}
    for line in table.splitlines():
        if line.startswith("| `"):
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            for name in re.findall(r"`(\w+)`", cells[0]):
                rows[name] = cells[1]
    options = {p.name: p.default for p in inspect.signature(replicate).parameters.values() if p.kind is p.KEYWORD_ONLY}
    assert set(options) == set(rows), (
        f"only in the signature: {set(options) - set(rows)}; only in the table: {set(rows) - set(options)}"
    )
    said = {"process_group": "world", "broadcast_buffers": "`True`"}  # what their None means, as the table says
    for name, default in options.items():
        shown = (
            '"' + default + '"'
            if isinstance(default, str)
            else f"{default:g}"
            if isinstance(default, float)
            else default
        )
        assert rows[name] == said.get(name, f"`{shown}`"), (
            f"{name}: the table says {rows[name]}, the signature {default!r}"
        )


RESULT_MD_LINK = re.compile(r"\]\((?:\.\./)?(?:benchmarks/)?results/(\w+)\.md\)")  # a current result, not archive/
COMMIT_NAMED = re.compile(r"\b[0-9a-f]{7,40}\b")
# Result pages whose own rows name each run's commit, so a citing block need not.
AGED_IN_THEIR_ROWS = {
    "torch_range": "one row per torch release, each with the commit it tested",
    "network_floor": "a summary of archived runs, each named with its commit inside",
}


def test_every_cited_result_shows_its_age():
    # a result cited on a page says which commit it measured, in the same block, so a reader can
    # tell a current figure from an old one (the evidence page and the index say it too)
    missing = []
    for path in DOCUMENTS:
        if path.name == "CHANGELOG.md":  # each entry is its own age
            continue
        for line, block in _blocks(path.read_text()):
            names = set(RESULT_MD_LINK.findall(block)) - set(AGED_IN_THEIR_ROWS)
            if names and not COMMIT_NAMED.search(COMMENT.sub("", block)):
                missing.append(f"{_relative(path)}:{line}: {sorted(names)}")
    assert not missing, "results cited without the commit they measured (add 'at abc1234'):\n" + "\n".join(missing)
