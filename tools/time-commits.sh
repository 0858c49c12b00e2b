#!/usr/bin/env bash
# Time a compressor's sync.step() at two commits side by side: alternating, round by round, in one session.
#
#   tools/time-commits.sh OLD NEW [ROUNDS] [-- time_step.py options]     e.g.  tools/time-commits.sh d39e423 HEAD 5
#
# Each commit is checked out into a worktree under runs/time-commits/ (removed at exit) and imported from there
# (PYTHONPATH) by this checkout's .venv and this checkout's tools/time_step.py, so only dgc's code differs. The
# native CPU kernel is built per commit (its cache is keyed by its source). Pause anything else running first
# (tools/background-sweep.sh: kill -STOP). Prints each round's JSON line and the medians per commit.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
old=${1:?usage: $0 OLD NEW [ROUNDS] [-- options]}; new=${2:?usage: $0 OLD NEW [ROUNDS] [-- options]}
rounds=${3:-5}
shift $(( $# < 3 ? $# : 3 )); [[ ${1:-} == -- ]] && shift
WORK=$ROOT/runs/time-commits
trees=()
cleanup() { for t in "${trees[@]}"; do git worktree remove --force "$t" 2>/dev/null || true; done; rm -rf "$WORK"; }
trap cleanup EXIT
mkdir -p "$WORK"
for rev in "$old" "$new"; do
    t=$WORK/$(git rev-parse --short "$rev")
    git worktree add --detach "$t" "$rev" > /dev/null 2>&1
    trees+=("$t")
done
for ((i = 1; i <= rounds; i++)); do
    for t in "${trees[@]}"; do
        PYTHONPATH=$t .venv/bin/python tools/time_step.py "$@" | tee -a "$WORK/$(basename "$t").jsonl"
    done
done
for t in "${trees[@]}"; do
    .venv/bin/python - "$WORK/$(basename "$t").jsonl" "$(basename "$t")" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
med = {k: statistics.median(r[k] for r in rows) for k in ("step_ms", "compress_ms")}
print(f"{sys.argv[2]}: sync.step {med['step_ms']:.1f} ms, compress {med['compress_ms']:.1f} ms "
      f"(medians of {len(rows)} rounds; best step {min(r['step_min_ms'] for r in rows):.1f} ms)")
PY
done
