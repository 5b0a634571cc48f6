"""The floors' import contracts bite: an import up a floor fails ``lint-imports``, type-checking ones too.

pyproject.toml's import-linter contracts say the architecture (docs/architecture.md,
"Layout"): every arrow points down, compat imports core and never the reverse,
and no modules import each other in a circle. These tests run the contracts on
a copy of the package with one arrow added: the copy as it is passes, each
added arrow fails, naming the importing module.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT = Path(sys.executable).parent / "lint-imports"

pytestmark = pytest.mark.skipif(not LINT.exists(), reason="import-linter is not installed in this environment")


def _append(path: Path, text: str) -> None:
    path.write_text(path.read_text() + text)


def lint(tmp_path: Path, edit: Callable[[Path], None]) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` with the project's contracts on a copy of the package, after ``edit(package)``."""
    package = tmp_path / "torchreplicate"
    shutil.copytree(ROOT / "src" / "torchreplicate", package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    edit(package)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    return subprocess.run(
        [str(LINT), "--no-cache"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False
    )


def test_the_package_as_it_is_keeps_every_contract(tmp_path: Path) -> None:
    result = lint(tmp_path, lambda package: None)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_type_checking_import_up_a_floor_fails(tmp_path: Path) -> None:
    # errors.py (messages) is below the reducer: naming a reducer type there, even for mypy only,
    # is the type-level circle issue 45 removed (errors took a ParamSlot)
    stub = "\nif TYPE_CHECKING:\n    from torchreplicate.reducer.bucket import ParamSlot\n"  # errors.py has the name
    result = lint(tmp_path, lambda package: _append(package / "errors.py", stub))
    assert result.returncode != 0, "a type-checking import from errors.py into reducer/ passed the contracts"
    assert "torchreplicate.errors" in result.stdout, result.stdout


def test_core_importing_compat_fails(tmp_path: Path) -> None:
    result = lint(
        tmp_path, lambda package: _append(package / "core" / "plan.py", "\nimport torchreplicate.compat.view\n")
    )
    assert result.returncode != 0, "core/ importing compat/ passed the contracts"
    assert "torchreplicate.core.plan" in result.stdout, result.stdout


def test_faults_importing_the_reducer_fails(tmp_path: Path) -> None:
    edit = lambda package: _append(package / "faults" / "watchdog.py", "\nimport torchreplicate.reducer.flags\n")  # noqa: E731
    result = lint(tmp_path, edit)
    assert result.returncode != 0, "faults/ importing reducer/ passed the contracts"
    assert "torchreplicate.faults.watchdog" in result.stdout, result.stdout
