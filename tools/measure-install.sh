#!/usr/bin/env bash
# What `make install` costs in a fresh clone of this checkout's HEAD on this machine: wall time and the disk
# it adds (df of the clone's file system before and after, so files hard-linked from uv's cache count
# once). Prints one JSON line; the clone is removed afterwards, whatever happens.
#   usage: tools/measure-install.sh [--fallback]     (--fallback: plain pip, as when uv is unavailable)
set -euo pipefail
top=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
[[ ${1:-} == "" || ${1:-} == --fallback ]] || { echo "usage: $0 [--fallback]" >&2; exit 2; }
clone=$(mktemp -d "${TMPDIR:-/tmp}/dgc-measure-install.XXXXXX")
trap 'rm -rf "$clone"' EXIT
git clone -q "$top" "$clone/repo"
used() { df -B1M --output=used "$clone" | tail -n 1 | tr -d ' '; }
before=$(used)
start=$(date +%s%N)
if [[ ${1:-} == --fallback ]]; then UV=no-uv make -C "$clone/repo" install >"$clone/log" 2>&1
else make -C "$clone/repo" install >"$clone/log" 2>&1; fi || { cat "$clone/log" >&2; exit 1; }
wall=$(awk -v a="$start" -v b="$(date +%s%N)" 'BEGIN { printf "%.1f", (b - a) / 1e9 }')
printf '{"commit": "%s", "mode": "%s", "wall_s": %s, "disk_added_mb": %d, "last_line": "%s"}\n' \
    "$(git -C "$top" rev-parse --short HEAD)" "${1:-uv}" "$wall" $(( $(used) - before )) \
    "$(tail -n 1 "$clone/log" | sed 's/"/\\"/g')"
