"""docs/architecture.md names every module of the package and every design note, where it is written.

The page is a reader's map: a module missing from its layout, or a
``[Note: ...]`` block missing from its table (or listed under the wrong
file), is a map that lies. Both lists are read from the source here.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "torchreplicate"
PAGE = ROOT / "docs" / "architecture.md"
# A note is defined where a line (of a docstring or a comment) is its name alone: "[Note: name]".
NOTE = re.compile(r"^\s*(?:#\s*)?\[Note: ([^\]]+)\]\s*$")


def modules() -> list[str]:
    """Every module of the package, as a path under src/torchreplicate; a subpackage by its folder."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        found.append(
            relative.removesuffix("__init__.py") if path.name == "__init__.py" and path.parent != PACKAGE else relative
        )
    return found


def notes() -> dict[str, set[str]]:
    """Each note's name -> the files that define it."""
    found: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for line in path.read_text().splitlines():
            match = NOTE.match(line)
            if match:
                found.setdefault(match.group(1), set()).add(path.relative_to(PACKAGE).as_posix())
    return found


def layout_block() -> str:
    page = PAGE.read_text()
    start = page.index("## Layout")
    return page[start : page.index("## ", start + 3)]


def test_the_layout_names_every_module():
    block = layout_block()
    missing = []
    for module in modules():
        folder, _, name = module.rstrip("/").rpartition("/")
        # the layout lists a file by its name under its folder (or by its path), a subpackage as "name/"
        named = f"{name}/" if module.endswith("/") else name
        if not re.search(rf"(?<![\w/]){re.escape(named)}", block) and module not in block:
            missing.append(module)
        elif folder and f"{folder.split('/')[-1]}/" not in block:
            missing.append(f"{module} (its folder)")
    assert not missing, f"docs/architecture.md's layout does not name {missing}"


def test_the_notes_table_lists_every_note_at_its_file():
    page = PAGE.read_text()
    table = page[page.index("## The notes") :]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| note")]
    problems = []
    for name, files in sorted(notes().items()):
        row = next((r for r in rows if re.search(rf"(?:\| |; ){re.escape(name)}(?:;| \|)", r)), None)
        if row is None:
            problems.append(f"[Note: {name}] is not in the table")
            continue
        for file in files:
            if f"`{file}`" not in row:
                problems.append(f"[Note: {name}] is defined in {file}, which its row does not name")
    assert notes(), "no note found: the pattern no longer matches the source"
    assert not problems, "\n".join(problems)
