"""The README's and the docs pages' runnable code blocks run as pasted, so they never rot.

A fenced block right after an HTML comment ``<!-- runnable: KIND; file: NAME;
expect: TEXT -->`` is run, in document order, in one temporary folder per
document (docs/contributing.md describes the convention):

- ``torchrun N``: the block saved as a script and run on N local gloo ranks
  (``python -m torch.distributed.run --standalone --nproc-per-node N``; the
  standalone rendezvous picks a free port);
- ``python``: the block run as a script by this interpreter;
- ``shell``: the block run by ``bash -eo pipefail``, with this interpreter's
  ``bin/`` first on ``PATH`` (so ``torchrun`` is this venv's);
- ``save``: the block only saved (``file:`` is then required), for a later
  block to run: the README's first example runs through the shell block that
  shows how to launch it.

``file: NAME`` saves the block under that name, for later blocks of the same
document; ``expect: TEXT`` must appear in the output. Every block must exit 0
within its timeout; a block that runs over is killed with its whole process
group (torchrun's ranks included). The package runs from this checkout's
``src/``. The markers are counted, so they cannot vanish unnoticed.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# At least this many runnable blocks: the README's first example, the
# torchrun line that launches it and launch(); in docs/, two more.
MIN_README_BLOCKS = 3
MIN_DOCS_BLOCKS = 2
BLOCK_TIMEOUT_S = 240  # one torchrun of 2 ranks takes about 10 s on the 2-core machine

# A marker is a line of its own (one quoted inside a sentence is not)
MARKER = re.compile(
    r"^<!--\s*runnable:(?P<spec>[^>]*?)-->\n```(?P<lang>[\w-]*)\n(?P<code>.*?)\n```", re.DOTALL | re.MULTILINE
)
ANY_MARKER = re.compile(r"^<!--\s*runnable:", re.MULTILINE)


@dataclass(frozen=True)
class Block:
    """One runnable block: how to run it, and what it must print."""

    document: str
    line: int
    kind: str  # "torchrun", "python", "shell" or "save"
    nprocs: int  # ranks, for "torchrun"
    file: Optional[str]
    expect: Optional[str]
    code: str

    @property
    def where(self) -> str:
        return f"{self.document}:{self.line}"


def parse_blocks(text: str, document: str) -> list[Block]:
    """Every marked block of ``text``, in order; a marker without its fence, or a bad spec, raises."""
    blocks = []
    for match in MARKER.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        fields = [field.strip() for field in match["spec"].split(";") if field.strip()]
        kind, *options = fields or [""]
        words = kind.split()
        if not words or words[0] not in ("torchrun", "python", "shell", "save"):
            raise ValueError(
                f"{document}:{line}: unknown runnable kind {kind!r}; use torchrun N, python, shell or save"
            )
        nprocs = int(words[1]) if words[0] == "torchrun" and len(words) == 2 else 0
        if words[0] == "torchrun" and nprocs < 1:
            raise ValueError(f"{document}:{line}: 'torchrun N' needs a number of ranks, got {kind!r}")
        values = {}
        for option in options:
            key, _, value = option.partition(":")
            if key.strip() not in ("file", "expect") or not value.strip():
                raise ValueError(
                    f"{document}:{line}: unknown runnable option {option!r}; use file: NAME or expect: TEXT"
                )
            values[key.strip()] = value.strip()
        if words[0] == "save" and "file" not in values:
            raise ValueError(f"{document}:{line}: 'save' needs file: NAME")
        code = match["code"] + "\n"
        blocks.append(Block(document, line, words[0], nprocs, values.get("file"), values.get("expect"), code))
    if len(blocks) != len(ANY_MARKER.findall(text)):
        raise ValueError(f"{document}: a runnable marker is not directly followed by a fenced code block")
    return blocks


def _blocks(document: Path) -> list[Block]:
    return parse_blocks(document.read_text(), str(document.relative_to(ROOT)))


def _run(block: Block, folder: Path, index: int) -> str:
    script = folder / (block.file or f"block{index}.{'sh' if block.kind == 'shell' else 'py'}")
    script.write_text(block.code)
    if block.kind == "save":
        return ""
    if block.kind == "torchrun":
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={block.nprocs}"]
        argv.append(script.name)
    elif block.kind == "python":
        argv = [sys.executable, script.name]
    else:
        argv = ["bash", "-eo", "pipefail", script.name]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    process = subprocess.Popen(
        argv, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = process.communicate(timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the block's whole process group: torchrun and its ranks
        output, _ = process.communicate()
        pytest.fail(f"{block.where}: still running after {BLOCK_TIMEOUT_S} s; killed. Output:\n{output[-4000:]}")
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 0, f"{block.where}: exit {process.returncode}. Output:\n{output[-4000:]}"
    if block.expect is not None:
        assert block.expect in output, f"{block.where}: {block.expect!r} not in the output:\n{output[-4000:]}"
    return output


def test_the_markers_are_there_and_well_formed():
    readme = _blocks(ROOT / "README.md")
    docs = [block for document in DOCUMENTS[1:] for block in _blocks(document)]
    assert len(readme) >= MIN_README_BLOCKS, f"README.md has {len(readme)} runnable blocks, want {MIN_README_BLOCKS}+"
    assert len(docs) >= MIN_DOCS_BLOCKS, f"docs/ has {len(docs)} runnable blocks, want {MIN_DOCS_BLOCKS}+"
    first = readme[0]
    assert "replicate(model)" in first.code, "the README's first runnable block must be its first example"
    if first.kind == "save":
        assert any(first.file in block.code for block in readme[1:]), f"no README block runs {first.file}"


# Any fenced Python block, marked runnable or not
PYTHON_FENCE = re.compile(
    r"^(?P<marker><!--\s*runnable:[^>]*-->\n)?```python\n(?P<code>.*?)\n```", re.DOTALL | re.MULTILINE
)


def unmarked_python_blocks(text: str, document: str) -> list[str]:
    """Where ``text`` has a Python block that is neither runnable nor says, in its first line, that it is a fragment."""
    found = []
    for match in PYTHON_FENCE.finditer(text):
        if not match["marker"] and not match["code"].startswith("# fragment"):
            found.append(f"{document}:{text.count(chr(10), 0, match.start()) + 1}: {match['code'].splitlines()[0]!r}")
    return found


def test_every_python_block_runs_or_says_it_is_a_fragment():
    found = [where for document in DOCUMENTS for where in unmarked_python_blocks(document.read_text(), document.name)]
    assert not found, (
        "Python blocks that no test runs and that do not start with '# fragment': mark them runnable"
        " (docs/contributing.md) or say what the reader supplies:\n" + "\n".join(found)
    )
    assert unmarked_python_blocks("```python\nmodel(x)\n```\n", "x.md") == ["x.md:1: 'model(x)'"]
    assert not unmarked_python_blocks("```python\n# fragment: model is yours\nmodel(x)\n```\n", "x.md")
    assert not unmarked_python_blocks("<!-- runnable: python -->\n```python\nprint(1)\n```\n", "x.md")


def shared_runs(text: str, other: str, length: int = 10) -> list[str]:
    """The runs of ``length`` words that ``text`` copies from ``other`` (HTML comments left out)."""

    def words(t: str) -> list[str]:
        return re.findall(r"[\w'`.()-]+", re.sub(r"<!--.*?-->", "", t, flags=re.DOTALL))

    seen = {tuple(run) for run in zip(*(words(other)[i:] for i in range(length)))}
    return [" ".join(run) for run in zip(*(words(text)[i:] for i in range(length))) if run in seen]


def test_the_docs_home_page_does_not_copy_the_readme():
    copied = shared_runs((ROOT / "docs" / "index.md").read_text(), (ROOT / "README.md").read_text())
    assert not copied, "docs/index.md repeats the README word for word (say it for the site's reader):\n" + "\n".join(
        copied[:10]
    )
    assert shared_runs("a b c d e f g h i j k", "x a b c d e f g h i j y") == ["a b c d e f g h i j"]


def test_a_marker_without_a_fence_is_an_error():
    with pytest.raises(ValueError, match="not directly followed"):
        parse_blocks("<!-- runnable: python -->\ntext\n```python\nprint(1)\n```\n", "x.md")
    with pytest.raises(ValueError, match="unknown runnable kind"):
        parse_blocks("<!-- runnable: ruby -->\n```ruby\nputs 1\n```\n", "x.md")
    with pytest.raises(ValueError, match="needs a number of ranks"):
        parse_blocks("<!-- runnable: torchrun -->\n```python\nprint(1)\n```\n", "x.md")
    with pytest.raises(ValueError, match="'save' needs file"):
        parse_blocks("<!-- runnable: save -->\n```python\nprint(1)\n```\n", "x.md")
    (block,) = parse_blocks("<!-- runnable: torchrun 2; file: a.py; expect: ok -->\n```python\nprint(1)\n```\n", "x.md")
    assert (block.kind, block.nprocs, block.file, block.expect) == ("torchrun", 2, "a.py", "ok")
    assert block.code == "print(1)\n"


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "document", [d for d in DOCUMENTS if _blocks(d)], ids=lambda d: str(d.relative_to(ROOT)).replace("/", "_")
)
def test_runnable_blocks_run(document, tmp_path):
    for index, block in enumerate(_blocks(document)):
        _run(block, tmp_path, index)


def test_the_first_screen_says_what_it_is_against_ddp_and_how_to_start_in_about_30_lines():
    # issue 48: what it is, the status box with the torch range, a table against DDP (the call,
    # state_dict keys, unused parameters, cross-rank mistakes, bits, step time against DDP's two
    # configurations), the two commands and the links onward; set-up detail lives under Install
    readme = (ROOT / "README.md").read_text()
    first = readme[: readme.index("\n## ")]
    assert len(first.splitlines()) <= 35, f"the first screen has {len(first.splitlines())} lines, want about 30"
    for words in (
        "> **Status:",
        "torch 2.9 to 2.14",
        "GPU and NCCL have never",
        "| the call |",
        "| `state_dict` keys |",
        "| unused parameters |",
        "| cross-rank mistakes",
        "bit for bit",
        "| step time / DDP's defaults",
        "| step time / DDP with `gradient_as_bucket_view=True` |",
        "bash scripts/demo.sh",
        "bash scripts/test.sh",
        "(docs/migration.md)",
        "(docs/limits.md)",
        "(docs/performance.md#gpu)",
    ):
        assert words in first, f"the README's first screen lacks {words!r}"
    for detail in ("chromium", "python3-venv", "TORCH_INDEX_URL", "apt-get"):
        assert detail not in first, f"set-up detail {detail!r} belongs under Install, not on the first screen"


def test_the_changelog_opens_the_release_with_what_breaks_then_a_summary():
    # issue 48: release notes, not a diary: the unreleased section says first what code written
    # against the last release must change, then what the release brings, then the entries
    text = (ROOT / "CHANGELOG.md").read_text()
    release = text[text.index("\n## ") : text.index("\n## ", text.index("\n## ") + 1)]
    headings = [line for line in release.splitlines() if line.startswith("### ")]
    assert headings[:3] == ["### Breaking since 0.1.0", "### Summary", "### Changes"], headings
    breaking = release[release.index("### Breaking") : release.index("### Summary")]
    for removed in ("torchreplicate.launch()", '`bucket_layout="tuned"`', 'graph="dynamic"'):
        assert removed in breaking, f"the breaking list lacks {removed}"
