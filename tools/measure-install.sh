#!/usr/bin/env bash
# What `make install` costs in a fresh clone of this checkout's HEAD on this machine: wall time and the disk
# it adds (df of the clone's file system before and after, so files hard-linked from uv's cache count
# once). Prints one JSON line; the clone is removed afterwards, whatever happens.
#   usage: tools/measure-install.sh [--cold | --fallback]
#     (default: with this machine's uv cache; --cold: an empty uv cache and no uv yet, as on a fresh machine;
#      --fallback: plain pip, as when uv is unavailable)
set -euo pipefail
top=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
mode=${1:-warm}
[[ $# -le 1 && $mode =~ ^(warm|--cold|--fallback)$ ]] || { echo "usage: $0 [--cold | --fallback]" >&2; exit 2; }
clone=$(mktemp -d "${TMPDIR:-/tmp}/dgc-measure-install.XXXXXX")
trap 'rm -rf "$clone"' EXIT
git clone -q "$top" "$clone/repo"
used() { df -B1M --output=used "$clone" | tail -n 1 | tr -d ' '; }
before=$(used)
start=$(date +%s%N)
case $mode in
    --fallback) env UV=no-uv make -C "$clone/repo" install ;;
    --cold) env UV_CACHE_DIR="$clone/uv-cache" DGC_TOOLS="$clone/tools" make -C "$clone/repo" install ;;
    *) make -C "$clone/repo" install ;;
esac >"$clone/log" 2>&1 || { cat "$clone/log" >&2; exit 1; }
wall=$(awk -v a="$start" -v b="$(date +%s%N)" 'BEGIN { printf "%.1f", (b - a) / 1e9 }')
printf '{"commit": "%s", "mode": "%s", "wall_s": %s, "disk_added_mb": %d, "last_line": "%s"}\n' \
    "$(git -C "$top" rev-parse --short HEAD)" "${mode#--}" "$wall" $(( $(used) - before )) \
    "$(grep "^install: dgc" "$clone/log" | tail -n 1 | sed 's/"/\\"/g')"
