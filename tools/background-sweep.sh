#!/usr/bin/env bash
# Long reproductions in the background, resumable across working sessions.
#
#   tools/background-sweep.sh start [TABLE[:ROW,ROW...] ...]   # default queue: $QUEUE below
#   tools/background-sweep.sh status                           # what runs, the log's tail
#   tools/background-sweep.sh stop                             # checkpoint, stop, remove the worktree
#   tools/background-sweep.sh keep                             # commit what a later session needs to resume
#                                                              # (while it runs too: a snapshot, as after a kill)
#   tools/background-sweep.sh pin                              # the commit a start runs (an unfinished run's own)
#
# The sweep runs from a git worktree pinned to one commit (runs/bg/commit, kept until the queue is done), so
# editing this checkout does not change the code of a run half done, and a run resumed in a later session runs the
# commit it started with. It runs `python -m dgc.repro.sweep --skip-done` table after table, `nice -n 19` (it takes
# only idle CPU: a test suite beside it runs at almost full speed; pause it for timing with `kill -STOP`), writing
# into this checkout's results/runs/; the tables are then made here with `make report TABLE=<table>` (the sweep's
# own report would name the worktree's absolute paths). `stop` sends SIGTERM: each rank stops at a step boundary after a
# checkpoint (the trainer's own preemption path), and the next `start` continues from it (the checkpoints are
# ignored by git and stay in results/runs/<table>/<row>/). Nothing is left running or mounted after `stop`; the
# worktree (its .venv of hard links into uv's cache) is removed and made again, in ~20 s, by the next `start`.
# A session's machine may not be the next session's: `keep` (after `stop`, or while running: a snapshot) commits
# each unfinished run's checkpoint.pt with its config, env and metrics (git add -f: checkpoints are otherwise
# ignored; ~12 MB for a speech run, ~30 MB for a kjv_gpt one), and for each finished run its files without the
# checkpoint (a checkpoint committed earlier is removed from git), so that the next session's `start` resumes from
# what landed. A session's submission may hold at most 256 MiB of diffs, a binary file counting whole each time it is
# added, changed or removed: keep commits checkpoints only while those committed in the last 3 hours (a session)
# stay within KEEP_BUDGET_BYTES (96 MiB), and otherwise keeps the finished runs alone and says so. Keep once, at the
# end of a session (a snapshot in the middle costs as much again).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
BG=$ROOT/runs/bg
TREE=$BG/tree
QUEUE=${QUEUE:-"cpu-fmnist:topk-s1 cpu-speech cpu-frontier-grid cpu-speech-long"}
cd "$ROOT"

# whether a process of group $1 is alive (a zombie, exited but not yet reaped, is not)
group_alive() { pgrep -g "$1" -r R,S,D,T,t,I > /dev/null; }

running() { [[ -f $BG/pid ]] && kill -0 "$(cat "$BG/pid")" 2>/dev/null; }

# The commit a new start runs: runs/bg/commit while a queue is under way here; on a machine without it (a fresh
# one), the commit an unfinished kept run started with (its env.json's git_revision), so that it resumes with the
# code it began with; otherwise HEAD.
pin() {
    if [[ -s $BG/commit ]]; then cat "$BG/commit"; return; fi
    local dir rev
    for dir in results/runs/*/*/; do
        [[ -f $dir/checkpoint.pt && ! -f $dir/summary.json && -f $dir/env.json ]] || continue
        rev=$(grep -o '"git_revision": *"[0-9a-f]*"' "$dir/env.json" | grep -o '[0-9a-f]\{40\}' || true)
        if [[ -n $rev ]] && git cat-file -e "$rev^{commit}" 2> /dev/null; then echo "$rev"; return; fi
    done
    git rev-parse HEAD
}

start() {
    if running; then echo "background sweep already running (pid $(cat "$BG/pid")); see: $0 status"; exit 1; fi
    mkdir -p "$BG"
    # (pin reads runs/bg/commit first: the file must not exist, empty, while it runs)
    if [[ ! -s $BG/commit ]]; then local chosen; rm -f "$BG/commit"; chosen=$(pin); echo "$chosen" > "$BG/commit"; fi
    local commit; commit=$(cat "$BG/commit")
    if [[ ! -d $TREE ]]; then
        git worktree prune
        git worktree add --detach "$TREE" "$commit" > /dev/null
    fi
    echo "background sweep at ${commit:0:12}: installing its .venv (uv cache)"
    make -C "$TREE" install > "$BG/install.log" 2>&1 || { echo "install failed: $BG/install.log"; exit 1; }
    # the corpora the tables need (kjv_lstm, synth_deepspeech), built once where the runs read them
    echo "background sweep: data sets under ${DGC_DATA:-$ROOT/data} (make data: skipped when present, ~2 min otherwise)"
    make -C "$TREE" data DATA="${DGC_DATA:-$ROOT/data}" >> "$BG/install.log" 2>&1 || { echo "make data failed: $BG/install.log"; exit 1; }
    local queue=("$@"); [[ ${#queue[@]} -gt 0 ]] || read -ra queue <<< "$QUEUE"
    printf '%s\n' "${queue[@]}" > "$BG/queue"
    # one session of its own (setsid): `stop` signals the whole group, torchrun and its ranks included
    # torchrun leaves /tmp/torchelastic_* behind: its temporary files go under runs/bg/tmp, removed by `stop`
    mkdir -p "$BG/tmp"
    TMPDIR=$BG/tmp DGC_DATA=${DGC_DATA:-$ROOT/data} setsid nice -n 19 bash -c '
        cd "$1"; shift; bg=$1; root=$2; shift 2
        for item in "$@"; do
            table=${item%%:*}; only=(); [[ $item == *:* ]] && only=(--only "${item#*:}")
            echo "[bg] $(date -Is) $table ${only[*]}"
            rc=0
            .venv/bin/python -m dgc.repro.sweep "$table" --launcher local --skip-done --no-report "${only[@]}" \
                --runs-root "$root/results/runs" || rc=$?
            if [[ $rc != 0 ]]; then echo "[bg] $(date -Is) stopped: rc $rc"; exit 1; fi
        done
        echo "[bg] $(date -Is) queue done"; rm -f "$bg/commit"' _ "$TREE" "$BG" "$ROOT" "${queue[@]}" \
        >> "$BG/log" 2>&1 < /dev/null &
    echo $! > "$BG/pid"
    echo "started (pid $!), queue: ${queue[*]}; log: $BG/log"
}

stop() {
    if running; then
        local pid; pid=$(cat "$BG/pid")
        kill -TERM -- "-$pid" 2>/dev/null || true
        kill -CONT -- "-$pid" 2>/dev/null || true  # a sweep paused for timing (kill -STOP) takes the signal now
        # every live process of the group, not only its leader: the ranks write their last checkpoint after the
        # leader's bash is gone, and a keep right after must find it in place
        for _ in $(seq 600); do group_alive "$pid" || break; sleep 1; done
        if group_alive "$pid"; then echo "still running after 10 min: killing"; kill -KILL -- "-$pid" || true; fi
        echo "stopped; a run in progress continues from its checkpoint at the next start"
    fi
    rm -f "$BG/pid"
    rm -rf "$BG/tmp"
    if [[ -d $TREE ]]; then git worktree remove --force "$TREE"; fi
    git worktree prune
}

# The bytes of the blobs named in `git diff --raw` lines on stdin (the old and the new side: a changed or removed
# binary counts whole in a submission's diffs).
blob_bytes() {
    awk '{print $3; print $4}' | { grep -v '^0*$' || true; } | sort -u | while read -r blob; do git cat-file -s "$blob"; done |
        awk '{s += $1} END {print s + 0}'
}

keep() {
    # While the sweep runs, keep commits a snapshot: the state a kill at this moment would leave, which resumes
    # exactly (git reads a checkpoint whole, as the trainer renames a finished one into place; a resumed run drops
    # the log records written after its checkpoint). Keep once, late in a session but before it may be cut off: a
    # session cut off before it keeps loses what its runs did since the last keep.
    if running; then echo "the sweep is running: keeping a snapshot of its runs (it goes on; a resume starts there)"; fi
    local dir kept=() done=()
    for dir in results/runs/*/*/; do
        dir=${dir%/}
        if [[ -f $dir/summary.json ]]; then
            git ls-files --error-unmatch "$dir/checkpoint.pt" > /dev/null 2>&1 && git rm -q --cached "$dir/checkpoint.pt"
            if [[ -n $(git status --porcelain -- "$dir") ]]; then
                git add -- "$dir/config.yaml" "$dir/env.json" "$dir/metrics.jsonl" "$dir/summary.json"; done+=("$dir")
            fi
        elif [[ -f $dir/checkpoint.pt ]]; then
            git add -f -- "$dir/checkpoint.pt" "$dir/config.yaml" "$dir/env.json" "$dir/metrics.jsonl"; kept+=("$dir")
        fi
    done
    if [[ ${#kept[@]} -gt 0 ]]; then
        local budget=${KEEP_BUDGET_BYTES:-100663296} used pending
        used=$(git log --since="${KEEP_WINDOW:-3 hours ago}" --format= --raw --no-abbrev -- 'results/runs/*/*/checkpoint.pt' | blob_bytes)
        pending=$(git diff --cached --raw --no-abbrev -- 'results/runs/*/*/checkpoint.pt' | blob_bytes)
        if (( used + pending > budget )); then
            git reset -q -- "${kept[@]}"
            echo "not keeping the unfinished runs (${kept[*]}): their checkpoints ($((pending >> 20)) MiB) and those committed in the last 3 hours ($((used >> 20)) MiB) exceed KEEP_BUDGET_BYTES ($((budget >> 20)) MiB; a submission's diffs may hold 256 MiB); they resume from their last kept checkpoint"
            kept=()
        fi
    fi
    if [[ ${#kept[@]} -eq 0 && ${#done[@]} -eq 0 ]] || git diff --cached --quiet; then echo "nothing to keep"; return 0; fi
    git commit -q -m "background sweep: finished ${done[*]:-(none)}; unfinished, kept with its checkpoint for the next session: ${kept[*]:-(none)}"
    echo "committed: finished ${done[*]:-(none)}; unfinished ${kept[*]:-(none)}"
}

status() {
    if running; then echo "running (pid $(cat "$BG/pid")) at $(cut -c1-12 "$BG/commit" 2>/dev/null)"; else echo "not running"; fi
    [[ -f $BG/log ]] && tail -n 5 "$BG/log"
    return 0
}

case ${1:-} in
    start) shift; start "$@" ;;
    stop) stop ;;
    keep) keep ;;
    status) status ;;
    pin) pin ;;
    *) echo "usage: $0 start [TABLE[:ROWS] ...] | status | stop | keep | pin" >&2; exit 2 ;;
esac
