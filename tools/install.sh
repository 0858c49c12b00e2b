#!/usr/bin/env bash
# `make install`: the pinned stack of uv.lock in $VENV (default .venv), idempotently.
#
# Fast path: uv (pinned below; from $UV, else a one-time tool venv under ~/.cache/dgc-tools). uv keeps
# every wheel once in its cache (`uv cache dir`) and hard-links it into each environment, so a second
# clone on this machine installs in seconds and adds little disk. Fallback, said so when taken: plain
# pip, constrained to the same versions read from uv.lock (a full download of the stack, no sharing).
#
# Either way it then compiles the bytecode of what the project imports (only that, not all of
# site-packages): where PYTHONDONTWRITEBYTECODE is set, no process would ever write it, and every
# process would import torch from source (about 3x slower).
#   usage: tools/install.sh              (VENV, PYTHON, UV, EXTRAS from the environment)
#          tools/install.sh --print-uv   (print the uv it would use, getting it first if need be)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
EXTRAS=${EXTRAS:-repro,speech,dev,wandb,slurm,lightning,accelerate}
UV_VERSION=0.13.9
TOOLS=${DGC_TOOLS:-${XDG_CACHE_HOME:-$HOME/.cache}/dgc-tools}
say() { echo "install: $*"; }
die() { echo "install: $*" >&2; exit 1; }
log=$(mktemp "${TMPDIR:-/tmp}/dgc-install.XXXXXX")
trap 'rm -f "$log"' EXIT

# uv, if it can be had: $UV as given, else the pinned one in $TOOLS (made once per machine)
find_uv() {
    if [[ -n ${UV:-} ]]; then command -v "$UV" && return 0; say "UV=$UV is not a command" >&2; return 1; fi
    if [[ $("$TOOLS/bin/uv" --version 2>/dev/null) == "uv $UV_VERSION"* ]]; then echo "$TOOLS/bin/uv"; return 0; fi
    say "getting uv $UV_VERSION into $TOOLS (once per machine)" >&2
    if "$PYTHON" -m venv --clear "$TOOLS" >"$log" 2>&1 && "$TOOLS/bin/pip" install -q "uv==$UV_VERSION" >>"$log" 2>&1; then
        echo "$TOOLS/bin/uv"
        return 0
    fi
    say "could not install uv: $(tail -n 1 "$log")" >&2
    return 1
}

with_uv() {  # with_uv UV: sync $VENV to uv.lock; 1 when uv could not (the caller falls back to pip)
    local uv=$1
    cache=$("$uv" cache dir 2>/dev/null) || cache=""  # global: the report below sizes it
    say "uv $("$uv" --version | cut -d' ' -f2): uv.lock into $VENV (extras $EXTRAS), wheels shared through ${cache:-the uv cache}"
    local extras=()
    IFS=, read -ra names <<<"$EXTRAS"
    for e in "${names[@]}"; do extras+=(--extra "$e"); done
    mkdir -p "$TOOLS/tmp"  # uv's build locks, kept out of /tmp
    local before
    before=$(ls /tmp/uv-*.lock 2>/dev/null || true)
    if TMPDIR=$TOOLS/tmp UV_PROJECT_ENVIRONMENT=$VENV "$uv" sync --locked --python "$PYTHON" "${extras[@]}" >"$log" 2>&1; then
        grep -E '^(Installed|Uninstalled|Checked)' "$log" | sed 's/^/install: /' || true
        # uv locks the environment with /tmp/uv-<hash>.lock and never removes it (astral-sh/uv#10773):
        # remove the one this sync made, unless another uv holds it now
        for f in /tmp/uv-*.lock; do
            [[ -e $f ]] && ! grep -qxF "$f" <<<"$before" && flock -n "$f" rm -f "$f"
        done
        return 0
    fi
    if grep -q "needs to be updated" "$log"; then
        die "uv.lock does not match pyproject.toml: run \`make lock\` and commit uv.lock"
    fi
    say "uv sync failed: $(grep -v '^ *$' "$log" | tail -n 1)"
    return 1
}

with_pip() {
    say "plain pip (no shared cache: the whole stack is downloaded into $VENV), versions from uv.lock"
    [[ -x $VENV/bin/pip ]] || "$PYTHON" -m venv "$VENV"
    # every registry package at its version in uv.lock (the project itself is installed editable)
    "$VENV/bin/python" tools/lock_constraints.py uv.lock >"$VENV/constraints.txt"
    "$VENV/bin/pip" install -q -c "$VENV/constraints.txt" -e ".[$EXTRAS]" >"$log" 2>&1 || { cat "$log"; die "pip install failed"; }
}

if [[ ${1:-} == --print-uv ]]; then find_uv || die "no uv: install it (pip install uv==$UV_VERSION) or set UV"; exit 0; fi
[[ $# == 0 ]] || die "unknown argument $1 (valid: --print-uv, or none)"
start=$(date +%s)
if uv=$(find_uv) && with_uv "$uv"; then :; else with_pip; fi

# bytecode of what the project imports, written once here and read by every later process; and what was installed
scratch=$(mktemp -d "${TMPDIR:-/tmp}/dgc-install.XXXXXX")  # what importing torch makes (torchinductor_$USER)
trap 'rm -f "$log"; rm -rf "$scratch"' EXIT
torch_line=$(env -u PYTHONDONTWRITEBYTECODE TMPDIR="$scratch" "$VENV/bin/python" -c 'import torchvision, torchaudio, hydra, scipy, pytest
import matplotlib.pyplot, dgc.train, dgc.bench, dgc.repro.sweep, dgc, torch; c = torch.version.cuda
print(f"dgc {dgc.__version__}, torch {torch.__version__} (" + (f"CUDA {c} build" if c else "CPU build") + ")")')
# how large, where (du counts a file hard-linked from uv's cache once, under the cache)
if [[ -n ${cache:-} && -d ${cache:-} ]]; then sizes=$(du -sh "$cache" "$VENV" | awk '{print $1}' | paste -sd' ')
    set -- $sizes; where="$VENV adds $2 beside uv's cache of $1 ($cache)"
else where="$VENV is $(du -sh "$VENV" | cut -f1)"; fi
say "$torch_line; $where; $(( $(date +%s) - start )) s"
if [[ $torch_line == *"CUDA "* ]]; then  # the lock's torch: PyPI's build, for one CUDA version
    say "another torch build (CPU-only, or CUDA 12.x for an older driver): see README.md, \"Which torch build\""
fi
