#!/usr/bin/env python3
"""Run one command per rank on an emulated cluster: network namespaces, a bridge and shaped links.

    sudo python launch/netcluster.py --nodes 4 --rate 1gbit -- python -m dgc.train task=... train.max_steps=20

What it builds (as root; standard library only, it drives ``ip`` and ``tc`` from iproute2):

* one network namespace per node, ``<prefix><pid>-<i>``, holding one end of a veth pair named
  ``veth<i>`` with address ``<subnet>.<i+1>/24`` (default ``10.213.0.0/24``; the addresses exist
  only inside these namespaces) and its own loopback (``lo`` up);
* one more namespace, ``<prefix><pid>-hub``, holding a bridge ``br0`` and the other veth ends
  ``port<i>``: the switch. Nothing is created in the root namespace;
* every link shaped in both directions with a token bucket,
  ``tc qdisc add dev X root tbf rate <rate> burst 512kb latency 100ms``: on ``veth<i>`` (what the
  node sends) and on ``port<i>`` (what the switch sends to the node), like a full-duplex port of a
  switch at ``<rate>``. There is no delay emulation (netem is not available everywhere);

then starts, in namespace i, ``--ranks-per-node R`` copies of ``<command>`` with ``RANK=i*R+l
WORLD_SIZE=N*R LOCAL_RANK=l LOCAL_WORLD_SIZE=R GROUP_RANK=i MASTER_ADDR=<node 0's address>
MASTER_PORT=<port> OMP_NUM_THREADS=<threads> GLOO_SOCKET_IFNAME=veth<i>`` (plus ``NETCLUSTER_NODES``,
``NETCLUSTER_RATE`` and ``NETCLUSTER_NAMESPACE``), the environment ``torchrun`` gives, so ``python -m
dgc.train`` and anything reading those variables runs unchanged. The ranks of a node share its namespace
and its address: between them traffic takes the namespace's loopback, unshaped (a machine's fast bus);
only the links between nodes are shaped.

It waits for every rank. When a rank fails, the others get ``--grace`` seconds to finish, then are
stopped (SIGTERM, then SIGKILL). It always removes what it created (the namespaces, and with them
the veths and the bridge), also on a failure, on Ctrl-C (SIGINT), SIGTERM and SIGHUP. The exit
status is the worst exit status of the ranks that ended on their own (a rank killed by signal S
counts as 128 + S); after a signal to the launcher it is 128 + that signal.

Nothing outlives a launcher killed with SIGKILL (which no handler sees):

* each rank is started with ``PR_SET_PDEATHSIG`` = SIGKILL, so it dies with the launcher;
* a reaper, a second copy of this script in a session of its own (so a process-group kill misses it),
  waits on a pipe from the launcher; when the pipe closes it stops whatever still runs inside the
  launcher's namespaces and deletes them;
* the launcher and its reaper hold ``flock`` on ``/run/netcluster/<prefix><pid>.lock`` while the
  namespaces exist: a cluster whose lock nobody holds is stale whatever its pid now names, and every
  start (the launcher, hence ``python -m dgc.bench cluster`` and the tests) removes stale clusters of
  its prefix before building its own.

``--dry-run`` prints the ``ip``/``tc`` commands and the rank command lines without running anything
(no root needed). ``--cleanup-stale`` only removes stale clusters (see above) and exits.
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

PROG = "netcluster"
RATE_RE = re.compile(r"^\d+(\.\d+)?(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps|tbps)$", re.IGNORECASE)
SUBNET_RE = re.compile(r"^(\d{1,3})\.(\d{1,3})\.(\d{1,3})$")
PREFIX_RE = re.compile(r"^[a-z][a-z0-9]{0,7}$")
HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
LOCK_DIR = "/run/netcluster"
PR_SET_PDEATHSIG = 1


class Interrupted(Exception):
    """A signal asked the launcher to stop."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class SetupError(Exception):
    """An ip/tc command failed; the message is one line."""


def log(message: str) -> None:
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


# -- arguments ------------------------------------------------------------------------------
def rate_arg(text: str) -> str:
    if text.lower() in ("none", "off"):
        return "none"
    if not RATE_RE.match(text):
        raise argparse.ArgumentTypeError(f"must be a tc rate such as 1gbit, 100mbit, 10gbit or 'none', got {text!r}")
    return text


def nodes_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer in [1, 200], got {text!r}") from None
    if not 1 <= value <= 200:
        raise argparse.ArgumentTypeError(f"must be an integer in [1, 200], got {text!r}")
    return value


def subnet_arg(text: str) -> str:
    m = SUBNET_RE.match(text)
    if not m or any(int(x) > 255 for x in m.groups()):
        raise argparse.ArgumentTypeError(f"must be the first three octets of a /24 such as 10.213.0, got {text!r}")
    return text


def prefix_arg(text: str) -> str:
    if not PREFIX_RE.match(text):
        raise argparse.ArgumentTypeError(f"must be 1-8 lowercase letters/digits starting with a letter, got {text!r}")
    return text


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):  # noqa: ANN201 - NoReturn
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="netcluster.py",
        description="Run one rank per network namespace, joined by a bridge with shaped links (see the docstring).",
        usage="%(prog)s [options] -- command [args ...]",
    )
    p.add_argument("--nodes", type=nodes_arg, default=4, help="number of nodes (default: 4)")
    p.add_argument("--ranks-per-node", type=nodes_arg, default=1, help="ranks in each node (default: 1)")
    p.add_argument("--rate", type=rate_arg, default="1gbit", help="link rate per direction, tc syntax (default: 1gbit)")
    p.add_argument("--burst", default="512kb", help="tbf burst (default: 512kb)")
    p.add_argument("--latency", default="100ms", help="tbf latency, i.e. queue limit (default: 100ms)")
    p.add_argument("--port", type=int, default=29500, help="MASTER_PORT (default: 29500)")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per rank (default: 1)")
    p.add_argument("--subnet", type=subnet_arg, default="10.213.0", help="private /24 used inside the namespaces")
    p.add_argument("--prefix", type=prefix_arg, default="dgcn", help="namespace name prefix (default: dgcn)")
    p.add_argument("--grace", type=float, default=10.0, help="seconds the other ranks get after one fails")
    p.add_argument("--dry-run", action="store_true", help="print the ip/tc commands and rank commands; run nothing")
    p.add_argument("--cleanup-stale", action="store_true", help="remove namespaces left by killed launchers, then exit")
    p.add_argument("--reap", metavar="TAG", help=argparse.SUPPRESS)  # the reaper's mode (see the docstring)
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command each rank runs (after --)")
    return p


# -- the topology ---------------------------------------------------------------------------
class Cluster:
    """Names, addresses and the ip/tc commands of one emulated cluster."""

    def __init__(
        self, nodes: int, rate: str, burst: str, latency: str, subnet: str, prefix: str, pid: int, per_node: int = 1
    ):
        self.nodes, self.rate, self.burst, self.latency = nodes, rate, burst, latency
        self.per_node = per_node
        self.subnet, self.prefix, self.pid = subnet, prefix, pid
        self.tag = f"{prefix}{pid}"
        self.hub = f"{self.tag}-hub"
        self.created: list[str] = []  # namespaces created so far, removed in reverse order

    def ns(self, i: int) -> str:
        return f"{self.tag}-{i}"

    def addr(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    @staticmethod
    def ifname(i: int) -> str:
        return f"veth{i}"

    def shape(self, netns: str, dev: str) -> list[str]:
        return [
            "tc", "-n", netns, "qdisc", "add", "dev", dev, "root", "tbf",
            "rate", self.rate, "burst", self.burst, "latency", self.latency,
        ]  # fmt: skip

    def setup_commands(self) -> list[tuple[str | None, list[str]]]:
        """``(namespace created by this command or None, argv)`` in order."""
        hub = self.hub
        cmds: list[tuple[str | None, list[str]]] = [(hub, ["ip", "netns", "add", hub])]
        cmds += [(None, ["ip", "-n", hub, "link", "set", "lo", "up"])]
        cmds += [(None, ["ip", "-n", hub, "link", "add", "br0", "type", "bridge", "stp_state", "0"])]
        cmds += [(None, ["ip", "-n", hub, "link", "set", "br0", "up"])]
        for i in range(self.nodes):
            ns, dev, port = self.ns(i), self.ifname(i), f"port{i}"
            cmds += [
                (ns, ["ip", "netns", "add", ns]),
                (None, ["ip", "-n", ns, "link", "set", "lo", "up"]),
                (None, ["ip", "-n", hub, "link", "add", port, "type", "veth", "peer", "name", dev, "netns", ns]),
                (None, ["ip", "-n", hub, "link", "set", port, "master", "br0"]),
                (None, ["ip", "-n", hub, "link", "set", port, "up"]),
                (None, ["ip", "-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", dev]),
                (None, ["ip", "-n", ns, "link", "set", dev, "up"]),
            ]
            if self.rate != "none":
                cmds += [(None, self.shape(ns, dev)), (None, self.shape(hub, port))]
        return cmds

    def ranks(self) -> list[tuple[int, int]]:
        """``(node, local rank)`` of every rank, in rank order."""
        return [(i, local) for i in range(self.nodes) for local in range(self.per_node)]

    def rank_env(self, i: int, port: int, threads: int, local: int = 0) -> dict[str, str]:
        return {
            "RANK": str(i * self.per_node + local),
            "WORLD_SIZE": str(self.nodes * self.per_node),
            "LOCAL_RANK": str(local),
            "LOCAL_WORLD_SIZE": str(self.per_node),
            "GROUP_RANK": str(i),
            "MASTER_ADDR": self.addr(0),
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": str(threads),
            "GLOO_SOCKET_IFNAME": self.ifname(i),
            "NETCLUSTER_NODES": str(self.nodes),
            "NETCLUSTER_RATE": self.rate,
            "NETCLUSTER_NAMESPACE": self.ns(i),
        }

    def rank_argv(self, i: int, command: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns(i), *command]

    # -- doing it -------------------------------------------------------------------------
    def setup(self) -> None:
        for creates, argv in self.setup_commands():
            if creates is not None:
                self.created.append(creates)  # recorded first: a half-made namespace is removed too
            run_checked(argv)

    def teardown(self) -> list[str]:
        """Stop whatever still runs inside our namespaces and delete them; returns those that remain."""
        for ns in self.created:
            kill_namespace_pids(ns)
        for ns in reversed(self.created):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, text=True)
        left = [ns for ns in list_namespaces() if ns == self.hub or ns.startswith(self.tag + "-")]
        self.created = left
        return left


def run_checked(argv: list[str]) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        reason = " ".join((proc.stderr or proc.stdout).split()) or f"exit status {proc.returncode}"
        raise SetupError(f"`{shlex.join(argv)}` failed: {reason}")


def list_namespaces() -> list[str]:
    proc = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def kill_namespace_pids(ns: str) -> None:
    """SIGKILL the processes still running inside namespace ``ns`` (by pid; they are ours)."""
    proc = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    for token in proc.stdout.split():
        if token.isdigit() and int(token) != os.getpid():
            try:
                os.kill(int(token), signal.SIGKILL)
            except ProcessLookupError:
                pass


def lock_path(tag: str) -> str:
    return os.path.join(LOCK_DIR, f"{tag}.lock")


def hold_lock(tag: str) -> int:
    """Create and lock ``tag``'s lock file; the returned descriptor holds the lock until it is closed."""
    os.makedirs(LOCK_DIR, exist_ok=True)
    fd = os.open(lock_path(tag), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise SetupError(f"{lock_path(tag)} is held by another launcher") from None
    return fd


def owner_alive(tag: str, pid: int) -> bool:
    """Whether the launcher (or its reaper) of cluster ``tag`` still runs: it holds the lock."""
    try:
        fd = os.open(lock_path(tag), os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return pid_alive(pid)  # no lock file: made by a launcher without them
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def remove_cluster(tag: str) -> int:
    """Stop what runs inside cluster ``tag``'s namespaces, delete them and its lock file; how many there were."""
    mine = [ns for ns in list_namespaces() if ns.startswith(tag + "-")]
    for ns in mine:
        kill_namespace_pids(ns)
    for ns in sorted(mine, key=lambda n: n.endswith("-hub")):  # the hub last, as teardown does
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    unlock_file(tag)
    return len(mine)


def unlock_file(tag: str) -> None:
    """Remove ``tag``'s lock file, and the lock folder once it is empty."""
    for remove, path in ((os.unlink, lock_path(tag)), (os.rmdir, LOCK_DIR)):
        try:
            remove(path)
        except OSError:  # already gone, or other launchers' locks are still there
            pass


def cleanup_stale(prefix: str) -> int:
    """Remove the clusters ``<prefix><pid>-*`` whose launcher and reaper are gone; how many namespaces that was."""
    pattern = re.compile(rf"^({re.escape(prefix)}(\d+))(?:-(?:hub|\d+)|\.lock)$")
    names = list_namespaces() + (os.listdir(LOCK_DIR) if os.path.isdir(LOCK_DIR) else [])
    tags = {m.group(1): int(m.group(2)) for m in map(pattern.match, names) if m}
    removed = sum(remove_cluster(tag) for tag, pid in sorted(tags.items()) if not owner_alive(tag, pid))
    if removed:
        log(f"removed {removed} stale namespace(s) of killed launchers")
    return removed


def reap(tag: str) -> int:
    """The reaper: wait until the launcher closes our stdin (it ended, or was killed), then remove what is left."""
    for s in HANDLED_SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    sys.stdin.buffer.read()
    left = remove_cluster(tag)
    if left:
        log(f"the launcher of {tag} died: removed its {left} namespace(s) and the processes inside")
    return 0


def start_reaper(tag: str, lock_fd: int) -> subprocess.Popen:
    """The reaper of cluster ``tag``, sharing the lock on ``lock_fd``, in a session of its own."""
    argv = [sys.executable, os.path.abspath(__file__), "--reap", tag]
    return subprocess.Popen(argv, stdin=subprocess.PIPE, start_new_session=True, pass_fds=(lock_fd,))


def die_with_parent() -> None:
    """preexec_fn of a rank: SIGKILL it when the launcher dies, however it dies (kept across exec)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# -- ranks ----------------------------------------------------------------------------------
def exit_status(code: int) -> int:
    """Popen's return code as a shell would report it (signal S -> 128 + S)."""
    return 128 - code if code < 0 else code


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # each rank leads its own process group (start_new_session)
    except (ProcessLookupError, PermissionError):
        pass


def stop_ranks(procs: list[subprocess.Popen], first: int = signal.SIGTERM, wait_s: float = 5.0) -> None:
    """Signal every running rank's process group, wait, then SIGKILL what is left."""
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        signal_group(p, first)
    deadline = time.monotonic() + wait_s
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [p for p in alive if p.poll() is None]
    for p in alive:
        signal_group(p, signal.SIGKILL)
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def wait_ranks(procs: list[subprocess.Popen], grace: float) -> int:
    """Wait for all ranks; after the first failure give the others ``grace`` seconds, then stop them."""
    codes: dict[int, int] = {}
    failed_at: float | None = None
    while len(codes) < len(procs):
        for i, p in enumerate(procs):
            if i not in codes and p.poll() is not None:
                codes[i] = exit_status(p.returncode)
                if codes[i] != 0:
                    log(f"rank {i} exited with status {codes[i]}")
                    if failed_at is None:
                        failed_at = time.monotonic()
        if failed_at is not None and len(codes) < len(procs) and time.monotonic() - failed_at > grace:
            running = [i for i in range(len(procs)) if i not in codes]
            log(f"stopping rank(s) {', '.join(map(str, running))} after a failure")
            stop_ranks(procs)
            break
        time.sleep(0.05)
    return max(codes.values(), default=1)


# -- main -----------------------------------------------------------------------------------
def _raise_interrupted(signum: int, frame: object) -> None:
    raise Interrupted(signum)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if args.reap:
        return reap(args.reap)
    if args.cleanup_stale:
        if os.geteuid() != 0:
            log("must run as root (it removes network namespaces)")
            return 1
        if not cleanup_stale(args.prefix):
            log("no stale namespaces")
        return 0
    if not command:
        parser.error("no command given: put it after --, e.g. -- python -c 'print(1)'")
    cluster = Cluster(
        args.nodes, args.rate, args.burst, args.latency, args.subnet, args.prefix, os.getpid(), args.ranks_per_node
    )
    if args.dry_run:
        for _, cmd in cluster.setup_commands():
            print(shlex.join(cmd))
        for i, local in cluster.ranks():
            env = [f"{k}={v}" for k, v in cluster.rank_env(i, args.port, args.threads, local).items()]
            print(shlex.join(cluster.rank_argv(i, ["env", *env, *command])))
        for ns in [cluster.ns(i) for i in reversed(range(args.nodes))] + [cluster.hub]:
            print(shlex.join(["ip", "netns", "del", ns]))
        return 0
    if os.geteuid() != 0:
        log("must run as root (it creates network namespaces, veths and a bridge); try sudo, or --dry-run")
        return 1
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        log(f"{' and '.join(missing)} not found: install iproute2")
        return 1

    previous = {s: signal.signal(s, _raise_interrupted) for s in HANDLED_SIGNALS}
    procs: list[subprocess.Popen] = []
    status = 1
    lock_fd: int | None = None
    reaper: subprocess.Popen | None = None
    try:
        cleanup_stale(args.prefix)
        lock_fd = hold_lock(cluster.tag)
        reaper = start_reaper(cluster.tag, lock_fd)
        cluster.setup()
        log(
            f"{args.nodes} node(s) of {args.ranks_per_node} rank(s) {cluster.ns(0)}..{cluster.ns(args.nodes - 1)}, "
            f"{args.rate} per link and direction, master {cluster.addr(0)}:{args.port}"
        )
        for i, local in cluster.ranks():
            env = dict(os.environ, **cluster.rank_env(i, args.port, args.threads, local))
            argv = cluster.rank_argv(i, command)
            procs.append(subprocess.Popen(argv, env=env, start_new_session=True, preexec_fn=die_with_parent))
        status = wait_ranks(procs, args.grace)
    except Interrupted as e:
        log(f"got {e}: stopping the ranks and removing the cluster")
        for s in HANDLED_SIGNALS:
            signal.signal(s, signal.SIG_IGN)
        stop_ranks(procs, first=signal.SIGINT if e.signum == signal.SIGINT else signal.SIGTERM)
        status = 128 + e.signum
    except SetupError as e:
        log(str(e))
        status = 1
    except OSError as e:
        log(f"cannot start the command: {e}")
        status = 1
    finally:
        for s in HANDLED_SIGNALS:  # nothing may interrupt the cleanup
            signal.signal(s, signal.SIG_IGN)
        stop_ranks(procs, wait_s=2.0)
        left = cluster.teardown()
        if left:
            log(f"could not remove namespace(s) {', '.join(left)}")
            status = status or 1
        if lock_fd is not None:
            if not left:
                unlock_file(cluster.tag)
            os.close(lock_fd)
        if reaper is not None:
            reaper.stdin.close()  # the reaper finds nothing left and exits
            reaper.wait(timeout=30)
        for s, handler in previous.items():
            signal.signal(s, handler)
    return status


if __name__ == "__main__":
    sys.exit(main())
