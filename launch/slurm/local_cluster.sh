#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for testing the launch scripts (CPU only, root only).
#
#   launch/slurm/local_cluster.sh start    # install slurm-wlm + munge if missing, write the config, start the daemons
#   launch/slurm/local_cluster.sh status   # daemons, sinfo, squeue
#   launch/slurm/local_cluster.sh stop     # stop slurmd, slurmctld and munged (waits until they are gone)
#
# What `start` sets up:
# * munge: a key in /etc/munge/munge.key (created with mungekey when missing), munged running as the munge
#   user (socket in /run/munge);
# * /etc/slurm/slurm.conf (written only when missing or written by this script before, so a real cluster's
#   configuration is never touched): one node, this machine, with the CPUs and memory `slurmd -C` reports and
#   no GPUs; one partition `local`; cgroup-free (ProctrackType=proctrack/linuxproc, TaskPlugin=task/none), no
#   accounting, SlurmUser=root; state, spool and logs under $STATE (default /var/lib/dgc-slurm);
# * slurmctld and slurmd (their pid files under $STATE/run), then waits until the node is idle.
#
# Daemons run as root and jobs run as the submitting user; the node is named after `hostname -s` so that
# `scontrol show hostnames` gives a name torchrun's c10d rendezvous can resolve. Nothing here is needed on a
# real cluster. Logs: $STATE/log/{slurmctld,slurmd}.log.
set -euo pipefail

STATE=${STATE:-/var/lib/dgc-slurm}
CONF=/etc/slurm/slurm.conf
MARK="# written by dgc launch/slurm/local_cluster.sh"
RUN=$STATE/run
HOST=$(hostname -s)

die() { echo "local_cluster: $*" >&2; exit 1; }
say() { echo "local_cluster: $*"; }

pid_alive() { [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

install_packages() {
    local missing=()
    command -v slurmctld >/dev/null || missing+=(slurm-wlm)
    command -v munged >/dev/null || missing+=(munge)
    if ((${#missing[@]})); then
        command -v apt-get >/dev/null || die "missing ${missing[*]} and no apt-get: install Slurm and munge yourself"
        say "apt-get install ${missing[*]}"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null \
            || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null; }
    fi
}

write_conf() {
    if [[ -f $CONF ]] && ! grep -qF "$MARK" "$CONF"; then
        die "$CONF exists and was not written by this script; refusing to overwrite it"
    fi
    # the node line as slurmd detects it (CPUs, sockets, cores, threads, RealMemory), minus the UpTime line
    local node
    node=$(slurmd -C | head -n1 | sed -E "s/^NodeName=[^ ]+/NodeName=$HOST/")
    mkdir -p /etc/slurm "$STATE"/{ctld,spool,log,run}
    cat >"$CONF" <<EOF
$MARK: a one-node test cluster (remove with: launch/slurm/local_cluster.sh stop; rm $CONF)
ClusterName=dgclocal
SlurmctldHost=$HOST(127.0.0.1)
AuthType=auth/munge
CryptoType=crypto/munge
SlurmUser=root
SlurmdUser=root
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
# no cgroups: plain process tracking, no task binding
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
SlurmdTimeout=300
InactiveLimit=0
KillWait=10
$node NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=local Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
EOF
    say "wrote $CONF ($node)"
}

start_munge() {
    if [[ ! -s /etc/munge/munge.key ]]; then
        mkdir -p /etc/munge
        mungekey --create --keyfile=/etc/munge/munge.key 2>/dev/null \
            || dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
        say "created /etc/munge/munge.key"
    fi
    chown munge:munge /etc/munge /etc/munge/munge.key
    chmod 700 /etc/munge
    chmod 400 /etc/munge/munge.key
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge
    chmod 755 /run/munge
    if pid_alive /run/munge/munged.pid; then
        say "munged already running"
    else
        runuser -u munge -- /usr/sbin/munged
    fi
    munge -n | unmunge >/dev/null || die "munge does not work (see /var/log/munge/munged.log)"
}

wait_idle() {
    for _ in $(seq 60); do
        state=$(sinfo -h -N -o '%T' 2>/dev/null | head -n1 || true)
        case $state in
            idle | mixed | allocated) say "node $HOST is $state"; return 0 ;;
        esac
        sleep 1
    done
    die "the node did not come up (state '${state:-none}'); see $STATE/log/slurmd.log and slurmctld.log"
}

start() {
    [[ $(id -u) == 0 ]] || die "run as root (it installs packages and starts daemons)"
    install_packages
    write_conf
    start_munge
    if pid_alive "$RUN/slurmctld.pid"; then say "slurmctld already running"; else slurmctld; fi
    if pid_alive "$RUN/slurmd.pid"; then say "slurmd already running"; else slurmd; fi
    wait_idle
    # a node left down or drained by an earlier unclean stop comes back
    scontrol update nodename="$HOST" state=resume 2>/dev/null || true
    sinfo
}

stop_pid() {  # stop_pid NAME PIDFILE: SIGTERM, wait up to 30 s, then SIGKILL
    local name=$1 file=$2 pid
    pid_alive "$file" || { say "$name not running"; rm -f "$file"; return 0; }
    pid=$(cat "$file")
    kill "$pid"
    for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    if kill -0 "$pid" 2>/dev/null; then kill -9 "$pid"; say "$name ($pid) killed"; else say "$name ($pid) stopped"; fi
    rm -f "$file"
}

stop() {
    # jobs still running are cancelled first, so no job step outlives the daemons
    if pid_alive "$RUN/slurmctld.pid"; then
        local jobs
        mapfile -t jobs < <(squeue -h -o %i 2>/dev/null || true)
        if ((${#jobs[@]})); then
            say "cancelling jobs ${jobs[*]}"
            scancel "${jobs[@]}" || true
            # wait until slurmd has killed their processes (the jobs leave squeue once they are gone)
            for _ in $(seq 60); do
                [[ -z $(squeue -h -o %i 2>/dev/null) ]] && break
                sleep 1
            done
        fi
    fi
    stop_pid slurmd "$RUN/slurmd.pid"
    stop_pid slurmctld "$RUN/slurmctld.pid"
    stop_pid munged /run/munge/munged.pid
}

status() {
    local up=0
    for d in slurmctld:"$RUN/slurmctld.pid" slurmd:"$RUN/slurmd.pid" munged:/run/munge/munged.pid; do
        if pid_alive "${d#*:}"; then echo "${d%%:*}: running (pid $(cat "${d#*:}"))"; else echo "${d%%:*}: stopped"; up=1; fi
    done
    if ((up == 0)); then sinfo; squeue; fi
    return $up
}

case ${1:-} in
    start) start ;;
    stop) stop ;;
    status) status ;;
    *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
