#!/usr/bin/env bash
# `make test-torch-floor`: the library's lower bound on torch (pyproject.toml: torch>=...), tested. A venv of its
# own holding torch $TORCH_FLOOR (and pytest, numpy for the tests) runs every test module that needs no extra
# (none of hydra, omegaconf, torchvision, torchaudio, scipy, matplotlib, the trainer, the benches or the tasks):
# the compressors, selection, wire formats, exchanges, the sync, the optimizer, the DDP hook and its overlap.
# The venv is removed afterwards, whatever happens.
#   usage: tools/test-torch-floor.sh [pytest arguments]      (TORCH_FLOOR, default the bound in pyproject.toml)
set -euo pipefail
cd "$(dirname "$0")/.."
bound=$(sed -nE 's/^dependencies = \["torch>=([0-9.]+)"\]$/\1/p' pyproject.toml)
[[ -n $bound ]] || { echo "test-torch-floor: no torch>= bound found in pyproject.toml's dependencies" >&2; exit 1; }
TORCH_FLOOR=${TORCH_FLOOR:-$bound.1}
uv=$(tools/install.sh --print-uv)
work=$(mktemp -d "${TMPDIR:-/tmp}/dgc-torch-floor.XXXXXX")
trap 'rm -rf "$work"' EXIT
venv=$work/venv
export TMPDIR=$work/tmp  # what uv and the tests leave in the temporary folder goes with the venv
mkdir "$TMPDIR"
"$uv" venv -q --python "${PYTHON:-python3}" "$venv"
# numpy < 2: the NumPy ABI the oldest torch builds were made for
"$uv" pip install -q --no-config --python "$venv/bin/python" "torch==$TORCH_FLOOR" "numpy<2" pytest packaging
# dgc itself (its core: no extra), for the tests' worker scripts (the test process imports this checkout's),
# built from a copy of the files git would commit: a build in place would leave build/ and dgc.egg-info here
mkdir "$work/src"
git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t "$work/src" 2>/dev/null || true
"$uv" pip install -q --no-config --no-deps --python "$venv/bin/python" "$work/src"
# test modules that import no extra and nothing of the reproduction framework
extras='hydra|omegaconf|torchvision|torchaudio|scipy|matplotlib|lightning|accelerate|soundfile'
above='dgc\.(repro|bench|train|tasks|costmodel)|tests\.(runs|datafiles)'
app='test_(install|background_sweep|slurm_[a-z_]+)\.py$'  # the application's environment, scripts and Slurm
mapfile -t modules < <(grep -LE "^\s*(import|from) ($extras|$above)|$above" tests/test_*.py | grep -vE "$app")
echo "test-torch-floor: torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)'), ${#modules[@]} test modules"
OMP_NUM_THREADS=1 "$venv/bin/python" -m pytest -q -p no:cacheprovider -m "not slow and not gpu and not slurm" "$@" "${modules[@]}"
