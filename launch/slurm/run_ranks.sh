#!/bin/bash
# The body of both sbatch scripts: start one Slurm task per rank with srun (no torchrun), resume what the
# run directory holds, and requeue the job when the run stopped on Slurm's warning signal.
#
# * Ranks: NPROC per node (default: the GPUs Slurm allocated, 4 in CPU mode), on every node of the job; each
#   task is one rank (dgc.distributed reads SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID; MASTER_ADDR is the
#   first host of the job, MASTER_PORT 20000 + job id mod 10000). CPU mode (no GPUs): gloo and device=cpu.
# * Run directory: run_dir=... when given, else runs/slurm/<job id>; resume=auto unless given, so a
#   requeued job (the same job id, the same directory) continues from its last checkpoint.
# * Stopping: the scripts ask Slurm for SIGUSR1 two minutes before the time limit (--signal=USR1@120) and
#   for requeueing (--requeue); a preemption sends SIGTERM. Either way every rank stops at the same step
#   after a checkpoint and exits 75, and this script then requeues the job (scontrol requeue).
# * The job log: runs/slurm/<job name>-<job id>.out. Slurm opens the log before the job's script runs and
#   never creates a folder for it (a job whose log folder is missing fails at once), so the scripts' default
#   (#SBATCH --output=slurm-%x-%j.out) is in the submit directory, and move_log moves it from there
#   (the file Slurm holds open goes with it) into runs/slurm/, made if missing. A requeued job appends to it
#   (--open-mode=append). A log placed with sbatch -o/--output stays where it was put.
set -uo pipefail

move_log() {
    local log dest flags
    [[ -n ${SLURM_JOB_ID:-} ]] || return 0
    log=$(readlink "/proc/$$/fd/1" 2>/dev/null) || return 0
    [[ $log == "$(pwd -P)/slurm-${SLURM_JOB_NAME:-}-$SLURM_JOB_ID.out" ]] || return 0
    dest=runs/slurm/${SLURM_JOB_NAME:-}-$SLURM_JOB_ID.out
    mkdir -p runs/slurm || return 0
    flags=$(awk '/^flags:/ {print $2}' "/proc/$$/fdinfo/1" 2>/dev/null)
    if [[ -e $dest && -n $flags ]] && (((8#$flags & 8#2000) != 0)); then
        # requeued, appending: the earlier starts' lines, then this one's, in the file Slurm writes to
        cat "$dest" "$log" >"$dest.tmp" && cat "$dest.tmp" >"$log" && rm -f "$dest.tmp" || return 0
    fi
    mv -f "$log" "$dest" && LOG=$dest
}

cd "${SLURM_SUBMIT_DIR:-.}"
LOG=$(readlink "/proc/$$/fd/1" 2>/dev/null || echo "?")
move_log
PYTHON=${PYTHON:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}
GPUS=${SLURM_GPUS_ON_NODE:-0}
NODES=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}
ARGS=("$@")
if ((GPUS > 0)); then
    NPROC=${NPROC:-$GPUS}
else
    NPROC=${NPROC:-4}
    [[ " ${ARGS[*]} " == *" device="* ]] || ARGS+=(device=cpu)
fi
CPUS=${SLURM_CPUS_ON_NODE:-${SLURM_CPUS_PER_TASK:-$NPROC}}
PER_TASK=$((CPUS / NPROC > 0 ? CPUS / NPROC : 1))
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$PER_TASK}

RUN_DIR=runs/slurm/${SLURM_JOB_ID:-local}
for a in "${ARGS[@]}"; do [[ $a == run_dir=* ]] && RUN_DIR=${a#run_dir=}; done
[[ " ${ARGS[*]} " == *" run_dir="* ]] || ARGS+=("run_dir=$RUN_DIR")
[[ " ${ARGS[*]} " == *" resume="* ]] || ARGS+=(resume=auto)

echo "[dgc] job ${SLURM_JOB_ID:-?} (restart ${SLURM_RESTART_COUNT:-0}): $NODES node(s) x $NPROC ranks" \
    "($( ((GPUS > 0)) && echo "$GPUS GPUs per node, nccl" || echo "CPU, gloo")), OMP_NUM_THREADS=$OMP_NUM_THREADS," \
    "run_dir=$RUN_DIR, log $LOG"
set -x
# since Slurm 22.05 srun does not inherit --cpus-per-task from sbatch: pass it
srun --nodes="$NODES" --ntasks-per-node="$NPROC" --ntasks=$((NODES * NPROC)) --cpus-per-task="$PER_TASK" \
    --kill-on-bad-exit=1 "$PYTHON" -m dgc.train "${ARGS[@]}"
status=$?
set +x
# 75: every rank stopped after a checkpoint; 138 (128 + SIGUSR1): the warning came before the ranks were
# listening, nothing was lost since the last checkpoint. Either way the job continues after a requeue.
if ((status == 75 || status == 138)) && [[ -n ${SLURM_JOB_ID:-} ]]; then
    echo "[dgc] the run stopped (exit $status): requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID" && exit 0
fi
exit "$status"
