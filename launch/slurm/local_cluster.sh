#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for testing the launch scripts (CPU only, root only).
#
#   launch/slurm/local_cluster.sh start          # install slurm-wlm + munge if missing, write the config, start the daemons
#   launch/slurm/local_cluster.sh status         # daemons, sinfo, squeue
#   launch/slurm/local_cluster.sh stop           # cancel jobs left, stop slurmd, slurmctld, munged (waits until gone)
#   launch/slurm/local_cluster.sh stop --purge   # stop, then remove everything start created or installed
#   launch/slurm/local_cluster.sh plan start     # (or: plan stop [--purge]) print what it would do; changes nothing
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
# The manifest $STATE.manifest lists what start created: each package it installed, folder, file and user,
# written before the thing is created (so a start killed midway can still be purged), and the pid and start
# time of each daemon it started. The daemons also carry DGC_LOCAL_SLURM=$STATE in their environment: stop
# finds them by that even when pid files are stale or missing, and never stops a Slurm or munged this
# script did not start. Anything that existed before start is not in the manifest and is never removed.
#
# Daemons run as root and jobs run as the submitting user; the node is named after `hostname -s` so that
# `scontrol show hostnames` gives a name torchrun's c10d rendezvous can resolve. Nothing here is needed on a
# real cluster. Logs: $STATE/log/{slurmctld,slurmd}.log.
set -euo pipefail
export PATH=$PATH:/usr/sbin:/sbin  # slurmctld, slurmd, munged live there; a user's PATH may lack it (plan)

STATE=${STATE:-/var/lib/dgc-slurm}
STATE=${STATE%/}
MANIFEST=$STATE.manifest  # beside the state folder, so that it can record the folder before creating it
CONF=/etc/slurm/slurm.conf
MARK="# written by dgc launch/slurm/local_cluster.sh"
RUN=$STATE/run
TAG=DGC_LOCAL_SLURM=$STATE
HOST=$(hostname -s)
# folders the packages (or munged) create when start installs them, recorded so that purge removes what
# dpkg leaves behind (logs, the key, our slurm.conf); users the packages create
PKG_DIRS=(/etc/slurm /etc/munge /var/lib/munge /var/log/munge /run/munge /var/lib/slurm /var/log/slurm
    /var/spool/slurmd /run/slurm)
PKG_USERS=(munge slurm)
DRY=0
PURGE=0
declare -A PLANNED=() COVERED=()  # plan mode: the folders it would have created, the processes stopped

die() { echo "local_cluster: $*" >&2; exit 1; }
say() { echo "local_cluster: $*"; }
act() { if ((DRY)); then say "would $*"; else say "$*"; fi; }  # an action; plan only prints it
usage() { echo "usage: local_cluster.sh start | stop [--purge] | status | plan start | plan stop [--purge]" >&2; exit 2; }
need_root() { [[ $(id -u) == 0 ]] || die "$1 needs root (plan $1 does not)"; }

# ---- processes
starttime() { sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | awk '{print $20}'; }
alive() {  # alive PID...: whether any of them still runs (a zombie has ended)
    local p
    for p; do [[ -e /proc/$p ]] && [[ $(sed 's/.*) //' "/proc/$p/stat" 2>/dev/null | cut -c1) != Z ]] && return 0; done
    return 1
}
ours() {  # ours NAME PID: whether this script started that process: the tag in its environment, a file
    # open under $STATE (slurmstepd and slurmscriptd write their title over their environment, but log there),
    # or its pid and start time in the manifest (plan mode without root can read only that)
    grep -qzxF -- "$TAG" "/proc/$2/environ" 2>/dev/null \
        || [[ -n $(find "/proc/$2/fd" -lname "$STATE/*" -print -quit 2>/dev/null) ]] \
        || { [[ -f $MANIFEST ]] && grep -qxF "pid $1 $2 $(starttime "$2")" "$MANIFEST"; }
}
pids_named() {  # pids_named NAME: the running NAME processes
    local p
    for p in $(pgrep -x "$1" || true); do alive "$p" && echo "$p"; done
    return 0
}
our_pids() {  # our_pids NAME: the NAME processes this script started
    local p
    for p in $(pids_named "$1"); do ours "$1" "$p" && echo "$p"; done
    return 0
}
other_pids() {  # other_pids NAME: NAME processes this script did not start (or, in plan mode, cannot tell)
    local p
    for p in $(pids_named "$1"); do ours "$1" "$p" || echo "$p"; done
    return 0
}

# ---- what start creates goes through these: recorded in the manifest first; in plan mode only printed
record() {  # record KIND VALUE: a line of the manifest (once)
    ((DRY)) && return 0
    [[ -f $MANIFEST ]] || echo "# what $0 start created here; removed by stop --purge (newest first)" >"$MANIFEST"
    grep -qxF "$1 $2" "$MANIFEST" || echo "$1 $2" >>"$MANIFEST"
}
make_dir() {  # make_dir MODE OWNER DIR...: create those missing (their parent must exist)
    local mode=$1 owner=$2 d
    shift 2
    for d; do
        [[ -e $d ]] && continue
        [[ -d $(dirname "$d") || -n ${PLANNED[$(dirname "$d")]:-} ]] || die "$(dirname "$d") does not exist"
        if ((DRY)); then act "create $d/"; PLANNED[$d]=1; continue; fi
        record dir "$d"
        mkdir "$d" && chmod "$mode" "$d" && chown "$owner" "$d"
    done
}
start_daemon() {  # start_daemon NAME CMD...: run CMD (it daemonizes; it must pass $TAG on), record the pid
    local name=$1 pids=()
    shift
    if ((DRY)); then act "start $name"; return 0; fi
    "$@"
    for _ in $(seq 20); do
        mapfile -t pids < <(our_pids "$name")
        ((${#pids[@]})) && break
        sleep 0.5
    done
    ((${#pids[@]})) || die "$name did not start; see its log under $STATE/log or /var/log/munge"
    for p in "${pids[@]}"; do record pid "$name $p $(starttime "$p")"; done
    say "started $name (pid ${pids[*]})"
}

install_packages() {
    local missing=() sim pkgs upgrades removes
    command -v slurmctld >/dev/null || missing+=(slurm-wlm)
    command -v munged >/dev/null || missing+=(munge)
    ((${#missing[@]})) || return 0
    command -v apt-get >/dev/null || die "missing ${missing[*]} and no apt-get: install Slurm and munge yourself"
    export DEBIAN_FRONTEND=noninteractive
    # what apt would do, to record the packages it newly installs before it does
    if ! sim=$(apt-get install -s "${missing[@]}" 2>/dev/null); then
        if ((DRY)); then act "apt-get update, then apt-get install ${missing[*]} and what they depend on"; return 0; fi
        say "apt-get update"
        apt-get update -qq
        sim=$(apt-get install -s "${missing[@]}") || die "apt-get cannot install ${missing[*]}"
    fi
    pkgs=$(awk '$1 == "Inst" && $3 !~ /^\[/ {print $2}' <<<"$sim" | xargs)
    upgrades=$(awk '$1 == "Inst" && $3 ~ /^\[/ {print $2}' <<<"$sim" | xargs)
    removes=$(awk '$1 == "Remv" {print $2}' <<<"$sim" | xargs)
    [[ -z $removes ]] || die "installing ${missing[*]} would remove $removes; install Slurm yourself"
    [[ -z $upgrades ]] || say "note: apt-get would also upgrade $upgrades (stop --purge does not downgrade them)"
    if ((DRY)); then act "apt-get install ${missing[*]}: $(wc -w <<<"$pkgs") new packages: $pkgs"; return 0; fi
    for p in $pkgs; do record pkg "$p"; done
    for d in "${PKG_DIRS[@]}"; do [[ -e $d ]] || record dir "$d"; done
    for u in "${PKG_USERS[@]}"; do
        id -u "$u" &>/dev/null || record user "$u"
        getent group "$u" >/dev/null || record group "$u"
    done
    # the .deb files it downloads stay in apt's cache
    for f in $(apt-get install --print-uris -qq "${missing[@]}" | awk '{print $2}'); do
        record file "/var/cache/apt/archives/$f"
    done
    say "apt-get install ${missing[*]} ($(wc -w <<<"$pkgs") new packages)"
    apt-get install -y -qq "${missing[@]}" >/dev/null
}

write_conf() {
    if [[ -f $CONF ]] && ! grep -qF "$MARK" "$CONF"; then
        die "$CONF exists and was not written by this script; refusing to overwrite it"
    fi
    make_dir 755 root:root /etc/slurm "$STATE" "$STATE"/{ctld,spool,log,run}
    if ((DRY)); then act "write $CONF (this node as slurmd -C reports it)"; return 0; fi
    # the node line as slurmd detects it (CPUs, sockets, cores, threads, RealMemory), minus the UpTime line
    local node
    node=$(slurmd -C | head -n1 | sed -E "s/^NodeName=[^ ]+/NodeName=$HOST/")
    record file "$CONF"
    cat >"$CONF" <<EOF
$MARK: a one-node test cluster (remove with: launch/slurm/local_cluster.sh stop --purge)
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
    local key=/etc/munge/munge.key
    make_dir 700 munge:munge /etc/munge /var/lib/munge /var/log/munge
    make_dir 755 munge:munge /run/munge
    if [[ ! -e $key ]]; then
        if ((DRY)); then
            act "create $key"
        else
            record file "$key"
            mungekey --create --keyfile="$key" 2>/dev/null || dd if=/dev/urandom of="$key" bs=1 count=1024 status=none
            chown munge:munge "$key" && chmod 400 "$key"
            say "created $key"
        fi
    fi
    if [[ -n $(pids_named munged) ]]; then  # ours from before, or the machine's own: either serves
        say "munged already running (pid $(pids_named munged | xargs))"
    else
        start_daemon munged runuser -u munge -- env "$TAG" /usr/sbin/munged
    fi
    ((DRY)) || munge -n | unmunge >/dev/null || die "munge does not work (see /var/log/munge/munged.log)"
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
    ((DRY)) || need_root start
    if [[ -n $(our_pids slurmctld) && -n $(our_pids slurmd) ]]; then
        say "slurmctld and slurmd already running"
        ((DRY)) || { wait_idle; sinfo; }
        return 0
    fi
    if ((DRY)); then act "record what it creates in $MANIFEST, each thing before creating it"; fi
    # one daemon without the other: left by a start that was killed midway, or one died; start afresh
    stop_daemon slurmd quiet
    stop_daemon slurmctld quiet
    for d in slurmctld slurmd; do
        [[ -z $(other_pids $d) ]] || die "a $d this script did not start is running (pid $(other_pids $d | xargs)); stop it first"
    done
    install_packages
    write_conf
    start_munge
    start_daemon slurmctld env "$TAG" slurmctld
    start_daemon slurmd env "$TAG" slurmd
    ((DRY)) && return 0
    wait_idle
    # a node left down or drained by an earlier unclean stop comes back
    scontrol update nodename="$HOST" state=resume 2>/dev/null || true
    sinfo
}

stop_daemon() {  # stop_daemon NAME [quiet]: SIGTERM ours and the processes under them, SIGKILL those left
    # after 30 s, wait until all are gone (quiet: say nothing when none runs)
    local name=$1 how=${2:-} pids=() all=() others under p
    for p in $(our_pids "$name"); do [[ -n ${COVERED[$p]:-} ]] || pids+=("$p"); done
    others=$(other_pids "$name" | xargs)
    [[ -z $others || -n $how ]] || say "$name pid $others left alone: not started by this script$(
        [[ $(id -u) == 0 ]] || echo " (as far as $(id -un) can tell)")"
    [[ -f $MANIFEST ]] && ((DRY == 0)) && sed -i "/^pid $name /d" "$MANIFEST"  # it is stopped below
    if ((${#pids[@]} == 0)); then
        [[ -n $how || -n $others ]] || say "$name not running"
        return 0
    fi
    # the processes under it: a job step's job (it outlives a slurmstepd that is killed), slurmctld's helper
    mapfile -t all < <(ps -eo pid=,ppid= | awk -v roots="${pids[*]}" '
        BEGIN { n = split(roots, r, " "); for (i = 1; i <= n; i++) tree[r[i]] = 1 }
        { parent[$1] = $2 }
        END { do { more = 0; for (p in parent) if (!(p in tree) && (parent[p] in tree)) { tree[p] = 1; more = 1 } }
              while (more); for (p in tree) print p }')
    under=$((${#all[@]} - ${#pids[@]}))
    if ((under)); then under=" and $under processes under it"; else under=; fi
    if ((DRY)); then
        act "stop $name (pid ${pids[*]}$under)"
        for p in "${all[@]}"; do COVERED[$p]=1; done
        return 0
    fi
    kill "${all[@]}" 2>/dev/null || true
    for _ in $(seq 30); do alive "${all[@]}" || break; sleep 1; done
    if alive "${all[@]}"; then
        kill -9 "${all[@]}" 2>/dev/null || true
        for _ in $(seq 10); do alive "${all[@]}" || break; sleep 1; done
        alive "${all[@]}" && die "$name (pid ${pids[*]}$under) still running after SIGKILL"
        say "$name (pid ${pids[*]}$under) killed"
    else
        say "$name (pid ${pids[*]}$under) stopped"
    fi
}

stop() {
    ((DRY)) || need_root stop
    # jobs still running are cancelled first, so no job step outlives the daemons
    if [[ -n $(our_pids slurmctld) ]]; then
        local jobs
        mapfile -t jobs < <(squeue -h -o %i 2>/dev/null || true)
        if ((${#jobs[@]})) && ((DRY)); then
            act "cancel jobs ${jobs[*]}"
        elif ((${#jobs[@]})); then
            say "cancelling jobs ${jobs[*]}"
            scancel "${jobs[@]}" || true
            # wait until slurmd has killed their processes (the jobs leave squeue once they are gone); without
            # slurmd they cannot end that way, and the job steps are stopped below
            for _ in $(seq 60); do
                [[ -z $(our_pids slurmd) || -z $(squeue -h -o %i 2>/dev/null) ]] && break
                sleep 1
            done
        fi
    fi
    stop_daemon slurmstepd quiet  # a job step whose job did not end
    stop_daemon slurmd
    stop_daemon slurmctld
    stop_daemon slurmscriptd quiet  # slurmctld's helper, in case slurmctld was killed without it
    stop_daemon munged
    ((DRY)) || rm -f "$RUN/slurmd.pid" "$RUN/slurmctld.pid"
    ((PURGE == 0)) || purge
}

purge() {  # remove what the manifest lists: packages, then folders and files (newest first), users, groups
    [[ -f $MANIFEST ]] || { say "no $MANIFEST: start created nothing here to remove"; return 0; }
    local kind value status debs=0 pkgs=() paths=() users=() groups=()
    while read -r kind value; do
        case $kind in
            pkg)
                status=$(dpkg-query -W -f='${db:Status-Status}' "$value" 2>/dev/null || true)
                [[ -z $status || $status == not-installed ]] || pkgs+=("$value")
                ;;
            dir | file) paths=("$value" "${paths[@]}") ;;
            user) users+=("$value") ;;
            group) groups+=("$value") ;;
        esac
    done <"$MANIFEST"
    if ((${#pkgs[@]})); then
        act "apt-get purge ${pkgs[*]}"
        ((DRY)) || DEBIAN_FRONTEND=noninteractive apt-get purge -y -qq "${pkgs[@]}" >/dev/null
    fi
    for p in "${paths[@]}"; do
        [[ $p == /?* && $p != */../* && $p != */.. ]] || die "refusing to remove '$p' (listed in $MANIFEST)"
        [[ -e $p || -L $p ]] || continue
        if [[ $p == /var/cache/apt/archives/*.deb ]]; then debs=$((debs + 1)); else act "remove $p"; fi
        ((DRY)) || rm -rf -- "$p"
    done
    ((debs == 0)) || act "remove the $debs .deb files apt-get downloaded into /var/cache/apt/archives"
    for u in "${users[@]}"; do
        id -u "$u" &>/dev/null || continue
        act "remove user $u"
        ((DRY)) || userdel "$u"
    done
    for g in "${groups[@]}"; do
        getent group "$g" >/dev/null || continue
        act "remove group $g"
        ((DRY)) || groupdel "$g"
    done
    act "remove $MANIFEST"
    ((DRY)) || rm -f "$MANIFEST"
}

status() {
    local up=0 pids
    for d in slurmctld slurmd munged; do
        pids=$(our_pids $d | xargs)
        if [[ -n $pids ]]; then
            echo "$d: running (pid $pids)"
        elif [[ -n $(other_pids $d) ]]; then
            echo "$d: running, not started by this script (pid $(other_pids $d | xargs))"
            [[ $d == munged ]] || up=1
        else
            echo "$d: stopped"
            up=1
        fi
    done
    if ((up == 0)); then sinfo; squeue; fi
    return $up
}

cmd=${1:-}
(($#)) && shift
if [[ $cmd == plan ]]; then
    DRY=1
    cmd=${1:-}
    (($#)) && shift
    [[ $cmd == start || $cmd == stop ]] || usage
fi
if [[ $cmd == stop && ${1:-} == --purge ]]; then PURGE=1; shift; fi
(($# == 0)) || usage
case $cmd in
    start) start ;;
    stop) stop ;;
    status) status ;;
    *) usage ;;
esac
