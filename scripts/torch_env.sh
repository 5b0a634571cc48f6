#!/usr/bin/env bash
# Makes (or reuses) a venv with torch VERSION and the package, for the tests on a torch of the range
# that is not the development one; prints its path. Sourced by scripts/test.sh (TORCH_VERSION=...).
#   bash scripts/torch_env.sh VERSION [PYTHON]     e.g. 2.11.0 python3.12 (default python3)
# The venv lives outside the checkout, cached between runs and checkouts:
# ${TORCHREPLICATE_ENVS:-~/.cache/torchreplicate/envs}/torch-VERSION-pyX.Y. A new one gets torch
# first, alone, then the package with its dependencies, as a user with a pinned torch installs it:
# that must leave torch as it was (checked). Every run reinstalls the package from this checkout
# (no dependencies, a second or two). torch is pip's (a CUDA build from PyPI, several GB, where the
# CPU index of scripts/torch_index.sh does not answer); the test tools are pinned as in pyproject.
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:?"torch_env.sh: give a torch version, e.g. 2.11.0"}
python=${2:-python3}
if ! "$python" -c 'import sys' 2>/dev/null; then  # pyenv keeps python3.X out of PATH unless selected
  found=$(ls -d "$(pyenv root 2>/dev/null || echo /nonexistent)/versions/${python#python}".*/bin/"$python" 2>/dev/null | tail -1)
  [ -n "$found" ] || { echo "torch_env.sh: no interpreter '$python' (give a path, or install it)" >&2; exit 1; }
  python=$found
fi
pyver=$("$python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
env="${TORCHREPLICATE_ENVS:-$HOME/.cache/torchreplicate/envs}/torch-$version-py$pyver"
tools=(pytest==9.2.0 pytest-timeout==2.4.0 hypothesis==6.170.27 numpy "setuptools>=77")
pip=(-m pip install --quiet --disable-pip-version-check)
stamp="torch==$version ${tools[*]}"
if [ "$(cat "$env/.torchreplicate-range" 2>/dev/null || true)" != "$stamp" ]; then
  echo "torch_env.sh: setting up $env (torch $version; a CUDA build is several GB)" >&2
  [ -x "$env/bin/python" ] || "$python" -m venv "$env"
  source scripts/torch_index.sh
  gpu=no
  if nvidia_gpu_present; then gpu=yes; fi
  index_args=()
  while IFS= read -r arg; do index_args+=("$arg"); done \
    < <(torch_index_args "$gpu" "${TORCH_INDEX_URL+yes}" "${TORCH_INDEX_URL-}")
  "$env/bin/python" "${pip[@]}" "${index_args[@]}" "torch==$version" >&2
  "$env/bin/python" "${pip[@]}" "${tools[@]}" >&2  # setuptools first: the package's build needs >= 77
  "$env/bin/python" "${pip[@]}" . >&2  # the package with its dependencies: torch stays as it is
  have=$("$env/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])')
  [ "$have" = "$version" ] || { echo "torch_env.sh: installing the package moved torch to $have" >&2; exit 1; }
  echo "$stamp" > "$env/.torchreplicate-range"
fi
"$env/bin/python" "${pip[@]}" --no-deps --no-build-isolation --force-reinstall . >&2
echo "$env"
