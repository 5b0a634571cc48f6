"""scripts/setup.sh: where torch comes from, and what the demo's set-up installs.

``torch_index_args`` (scripts/torch_index.sh) is a pure function of the facts
it is given (GPU seen, TORCH_INDEX_URL set, its value), so every case runs
here without a GPU and without a network. setup.sh itself runs against a fake
``.venv/bin/python`` that records the pip commands it is given: the index
options reach the torch install, the demo's set-up installs no development
extra, and a second run installs nothing. A fake interpreter given as
``PYTHON=`` stands for the machine's python3: a ``.venv`` without pip (what a
first run leaves on Debian/Ubuntu without ``python3-venv``) is rebuilt, and a
python without the venv module or older than 3.10 is refused, naming the fix.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def _index_args(gpu: str, override_set: str, override: str) -> subprocess.CompletedProcess:
    script = 'source scripts/torch_index.sh && torch_index_args "$0" "$1" "$2"'
    return subprocess.run(
        ["bash", "-c", script, gpu, override_set, override], cwd=ROOT, capture_output=True, text=True, timeout=30
    )


@pytest.mark.parametrize(
    "gpu, override_set, override, expected",
    [
        ("no", "no", "", ["--extra-index-url", CPU_INDEX]),  # no GPU: the CPU wheels, not PyPI's CUDA build
        ("yes", "no", "", []),  # a GPU: pip's own sources (PyPI's CUDA build)
        (
            "yes",
            "yes",
            "https://download.pytorch.org/whl/cu126",
            ["--extra-index-url", "https://download.pytorch.org/whl/cu126"],
        ),
        ("no", "yes", "file:///opt/wheels-index", ["--extra-index-url", "file:///opt/wheels-index"]),
        ("no", "yes", "default", []),  # the override wins over the missing GPU
        ("yes", "yes", "default", []),
    ],
)
def test_torch_index_follows_the_gpu_and_the_override(gpu, override_set, override, expected):
    done = _index_args(gpu, override_set, override)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == expected


def test_a_torch_index_that_is_no_url_is_refused_naming_the_variable():
    done = _index_args("no", "yes", "cpu")
    assert done.returncode == 2
    assert "TORCH_INDEX_URL=cpu" in done.stderr and CPU_INDEX in done.stderr and "'default'" in done.stderr
    assert done.stdout == ""


def test_an_nvidia_smi_on_the_path_counts_as_a_gpu(tmp_path):
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}")
    done = subprocess.run(
        ["bash", "-c", "source scripts/torch_index.sh && nvidia_gpu_present"], cwd=ROOT, env=env, timeout=30
    )
    assert done.returncode == 0


def _fake_checkout(tmp_path: Path) -> Path:
    """setup.sh, torch_index.sh and pyproject.toml, with a .venv whose python logs its arguments."""
    checkout = tmp_path / "checkout"
    (checkout / "scripts").mkdir(parents=True)
    for name in ("scripts/setup.sh", "scripts/torch_index.sh", "pyproject.toml"):
        shutil.copy(ROOT / name, checkout / name)
    _executable(checkout / ".venv" / "bin" / "python", WORKING_VENV_PYTHON)
    return checkout


# A venv's python that works (Python >= 3.10, with pip) and logs the pip installs it is given.
WORKING_VENV_PYTHON = 'case "$*" in "-m pip install"*) echo "$*" >> "$(dirname "$0")/../pip.log" ;; esac\n'


def _executable(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


def _run_setup(checkout: Path, *args: str, python: str = "python3") -> subprocess.CompletedProcess:
    env = dict(os.environ, TORCH_INDEX_URL="https://example.invalid/whl", PYTHON=python)
    return subprocess.run(
        ["bash", "scripts/setup.sh", *args], cwd=checkout, env=env, capture_output=True, text=True, timeout=60
    )


def _setup(checkout: Path, *args: str, python: str = "python3") -> list[str]:
    done = _run_setup(checkout, *args, python=python)
    assert done.returncode == 0, done.stderr
    log = checkout / ".venv" / "pip.log"
    return log.read_text().splitlines() if log.exists() else []


def test_the_demo_set_up_installs_torch_from_the_index_and_no_development_extra(tmp_path):
    checkout = _fake_checkout(tmp_path)
    torch_install, package_install = _setup(checkout, "--demo")
    expected = "--no-deps --extra-index-url https://example.invalid/whl torch==2.13.0"
    assert torch_install.endswith(expected), torch_install
    assert package_install.endswith("torch==2.13.0 -e .[plot]"), package_install  # no test, bench or docs extra
    assert "index" not in package_install  # torch's dependencies from pip's own sources
    assert _setup(checkout, "--demo") == [torch_install, package_install], "a second run installed again"


def test_the_development_set_up_satisfies_the_demo(tmp_path):
    checkout = _fake_checkout(tmp_path)
    (checkout / ".venv" / ".torchreplicate-dev").write_text("stale\n")
    assert _setup(checkout, "--demo")[-1].endswith("-e .[plot]")  # a stale development stamp counts for nothing
    stamp = (checkout / ".venv" / ".torchreplicate-demo").read_text()
    (checkout / ".venv" / ".torchreplicate-dev").write_text(stamp)
    (checkout / ".venv" / ".torchreplicate-demo").unlink()
    (checkout / ".venv" / "pip.log").unlink()
    assert _setup(checkout, "--demo") == [], "the demo installed again over a current development set-up"


def test_an_unknown_argument_is_refused():
    done = subprocess.run(["bash", "scripts/setup.sh", "--gpu"], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert "unknown argument '--gpu'" in done.stderr and "--demo" in done.stderr


def _base_python(tmp_path: Path, venv_python: str, version_ok: bool = True) -> str:
    """A fake interpreter for PYTHON=: ``-m venv DIR`` makes DIR/bin/python with ``venv_python`` as its body."""
    return str(
        _executable(
            tmp_path / "base" / "python3",
            f"""case "$1" in
  -c) exit {0 if version_ok else 1} ;;
  -m) [ "$2" = venv ] || exit 9
      mkdir -p "$3/bin" && printf '#!/bin/sh\\n%s' '{venv_python}' > "$3/bin/python" && chmod +x "$3/bin/python" ;;
esac
""",
        )
    )


# What Debian's python3 without python3-venv leaves: a python with no pip.
NO_PIP = 'case "$*" in *pip*) echo "No module named pip" >&2; exit 1 ;; esac\n'


def test_a_venv_left_without_pip_is_rebuilt(tmp_path):
    checkout = _fake_checkout(tmp_path)
    _executable(checkout / ".venv" / "bin" / "python", NO_PIP)  # a failed first run's venv
    (checkout / ".venv" / ".torchreplicate-dev").write_text("a stamp from before\n")
    done = _run_setup(checkout, "--demo", python=_base_python(tmp_path, WORKING_VENV_PYTHON))
    assert done.returncode == 0, done.stderr
    assert "no working pip" in done.stderr and "rebuilding it" in done.stderr
    installs = (checkout / ".venv" / "pip.log").read_text().splitlines()
    assert [line.split()[-1] for line in installs] == ["torch==2.13.0", ".[plot]"], installs
    assert _setup(checkout, "--demo") == installs, "the rebuilt venv was not kept"


def test_a_python_without_the_venv_module_is_named_and_leaves_no_venv(tmp_path):
    checkout = _fake_checkout(tmp_path)
    shutil.rmtree(checkout / ".venv")
    done = _run_setup(checkout, "--demo", python=_base_python(tmp_path, NO_PIP))
    assert done.returncode == 1
    assert "apt-get install python3-venv" in done.stderr, done.stderr
    assert not (checkout / ".venv").exists(), "a venv without pip was left for the next run to reuse"


def test_a_python_older_than_3_10_is_refused_naming_python(tmp_path):
    checkout = _fake_checkout(tmp_path)
    shutil.rmtree(checkout / ".venv")
    done = _run_setup(checkout, python=_base_python(tmp_path, WORKING_VENV_PYTHON, version_ok=False))
    assert done.returncode == 1
    assert "older than Python 3.10" in done.stderr and "PYTHON=python3.11 bash scripts/setup.sh" in done.stderr
    assert not (checkout / ".venv").exists()
