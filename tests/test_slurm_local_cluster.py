"""launch/slurm/local_cluster.sh: its plan mode (no root, no Slurm needed) and a real start / stop --purge cycle.

The cycle installs slurm-wlm and munge with apt-get when they are missing, so it runs only when asked:
``DGC_TEST_LOCAL_CLUSTER=1 pytest -m slurm tests/test_slurm_local_cluster.py`` as root, on a machine where no
Slurm or munged runs and ``/etc/slurm/slurm.conf`` does not exist.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "launch" / "slurm" / "local_cluster.sh"
CONF = Path("/etc/slurm/slurm.conf")
MARK = "# written by dgc launch/slurm/local_cluster.sh"
DAEMONS = ("munged", "slurmctld", "slurmd", "slurmstepd", "slurmscriptd")
# what start touches outside its state folder
SYSTEM_PATHS = ["/etc/slurm", str(CONF), "/etc/munge", "/etc/munge/munge.key", "/run/munge", "/var/lib/munge",
                "/var/log/munge", "/var/lib/slurm", "/var/log/slurm", "/var/spool/slurmd", "/run/slurm"]  # fmt: skip

needs_bash = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _script(*args: str, state: Path | str, prefix: tuple[str, ...] = (), timeout: float = 120, **env_vars: str):
    env = dict(os.environ, STATE=str(state), **env_vars)
    return subprocess.run(
        [*prefix, "bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=timeout, cwd="/"
    )


def _running(names=DAEMONS) -> dict[int, str]:
    """pid -> name of the running (not zombie) processes with one of these names."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            name = (proc / "comm").read_text().strip()
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if name in names and state != "Z":
            found[int(proc.name)] = name
    return found


def _snapshot(paths) -> dict[str, object]:
    """Each path's type, mode, size and mtime (None when absent), the installed packages, the daemons running."""
    snap: dict[str, object] = {}
    for path in paths:
        try:
            st = os.lstat(path)
            snap[str(path)] = (stat.S_IFMT(st.st_mode), st.st_mode, st.st_size, st.st_mtime_ns)
        except FileNotFoundError:
            snap[str(path)] = None
        except OSError as exc:  # e.g. /etc/munge/munge.key as a user
            snap[str(path)] = type(exc).__name__
    if shutil.which("dpkg-query"):
        snap["packages"] = subprocess.run(["dpkg-query", "-W"], capture_output=True, text=True).stdout
    snap["daemons"] = _running()
    return snap


@pytest.fixture
def open_tmp(tmp_path):
    """A temporary folder; as root one others can enter (under /tmp), so that the plan can run as nobody."""
    if os.geteuid() != 0 or not os.path.isdir("/tmp"):
        yield tmp_path
        return
    path = Path(tempfile.mkdtemp(prefix="dgc-local-cluster-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _unprivileged(*paths: Path) -> tuple[str, ...]:
    """A command prefix that runs as nobody when we are root and nobody can read the script and these paths'
    folders, else ()."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        return ()
    folders = [*SCRIPT.parents, *(q for p in paths for q in Path(p).parents)]
    if not all(q.stat().st_mode & stat.S_IXOTH for q in folders) or not SCRIPT.stat().st_mode & stat.S_IROTH:
        return ()
    return ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")


@needs_bash
@pytest.mark.parametrize(
    "args",
    [
        (),
        ("bogus",),
        ("plan",),
        ("plan", "status"),
        ("stop", "--force"),
        ("start", "now"),
        ("plan", "stop", "--purge", "x"),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(args, tmp_path):
    done = _script(*args, state=tmp_path / "state")
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("usage: ")
    for command in ("start", "stop [--purge]", "status", "plan start", "plan stop [--purge]"):
        assert command in lines[0]


@needs_bash
def test_plan_start_prints_what_it_would_do_and_changes_nothing(open_tmp):
    if set(_running(("slurmctld", "slurmd")).values()):
        pytest.skip("a slurmctld or slurmd runs here: the plan would differ")
    if CONF.exists() and MARK not in CONF.read_text(errors="replace"):
        pytest.skip(f"{CONF} belongs to another Slurm: start refuses to run here")
    state = open_tmp / "state"
    paths = [state, f"{state}.manifest", *SYSTEM_PATHS]
    before = _snapshot(paths)
    done = _script("plan", "start", state=state, prefix=_unprivileged(state), timeout=300)
    assert done.returncode == 0, done.stderr
    out = done.stdout.splitlines()
    assert f"local_cluster: would record what it creates in {state}.manifest, each thing before creating it" in out
    for sub in ("", "/ctld", "/spool", "/log", "/run"):
        assert f"local_cluster: would create {state}{sub}/" in out
    assert f"local_cluster: would write {CONF} (this node as slurmd -C reports it)" in out
    assert out[-2:] == ["local_cluster: would start slurmctld", "local_cluster: would start slurmd"]
    sbin = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    if shutil.which("slurmctld", path=sbin) is None and shutil.which("apt-get"):
        assert any(line.startswith("local_cluster: would apt-get ") for line in out), done.stdout
    assert all(line.startswith("local_cluster: ") for line in out)
    assert _snapshot(paths) == before


@needs_bash
def test_plan_stop_purge_lists_only_what_the_manifest_records(open_tmp):
    state = open_tmp / "state"
    (state / "log").mkdir(parents=True)
    (state / "log" / "slurmd.log").write_text("log\n")
    made, kept = open_tmp / "made.conf", open_tmp / "was-here.conf"
    made.write_text("made by start\n")
    kept.write_text("there before start\n")
    manifest = Path(f"{state}.manifest")
    manifest.write_text(
        "# what start created\n"
        f"pkg dgc-no-such-package-{uuid.uuid4().hex[:8]}\n"
        f"dir {state}\n"
        f"file {made}\n"
        f"dir {open_tmp}/never-created\n"
        "user dgc-no-such-user\n"
        "group dgc-no-such-group\n"
    )
    manifest.chmod(0o644)
    paths = [state, state / "log", state / "log" / "slurmd.log", made, kept, manifest, *SYSTEM_PATHS]
    before = _snapshot(paths)
    text = manifest.read_text()
    done = _script("plan", "stop", "--purge", state=state, prefix=_unprivileged(manifest))
    assert done.returncode == 0, done.stderr
    out = done.stdout.splitlines()
    # newest first, then the manifest; nothing that is absent, and nothing the manifest does not list
    assert out[-3:] == [
        f"local_cluster: would remove {made}",
        f"local_cluster: would remove {state}",
        f"local_cluster: would remove {manifest}",
    ]
    assert not any(w in line for line in out for w in ("apt-get", "remove user", "remove group")), done.stdout
    assert str(kept) not in done.stdout and "never-created" not in done.stdout
    assert _snapshot(paths) == before and manifest.read_text() == text


@needs_bash
@pytest.mark.skipif(
    shutil.which("pgrep") is None or not Path("/proc/self/environ").exists(), reason="needs pgrep, /proc"
)
def test_plan_stop_finds_its_daemons_by_tag_or_manifest_and_leaves_others_alone(open_tmp):
    """Fake daemons (copies of sleep named slurmd, slurmctld): the one with the script's tag in its environment and
    the one whose pid and start time the manifest records are the script's; the others are left alone."""
    state = open_tmp / "state"
    bin_dir = open_tmp / "bin"
    bin_dir.mkdir()
    for name in ("slurmd", "slurmctld"):
        shutil.copy(shutil.which("sleep"), bin_dir / name)
    env = {k: v for k, v in os.environ.items() if k != "DGC_LOCAL_SLURM"}
    tagged = subprocess.Popen([bin_dir / "slurmd", "300"], env=dict(env, DGC_LOCAL_SLURM=str(state)))
    untagged = subprocess.Popen([bin_dir / "slurmd", "300"], env=env)
    recorded = subprocess.Popen([bin_dir / "slurmctld", "300"], env=env)
    stale = subprocess.Popen([bin_dir / "slurmctld", "300"], env=env)
    procs = (tagged, untagged, recorded, stale)
    try:
        start = Path(f"/proc/{recorded.pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
        Path(f"{state}.manifest").write_text(
            f"# what start created\npid slurmctld {recorded.pid} {start}\npid slurmctld {stale.pid} 1\n"
        )
        Path(f"{state}.manifest").chmod(0o644)
        before = _snapshot([state, f"{state}.manifest"])
        # as the user that started the fakes, so that their environment is readable; the fake slurmctld counts as
        # the script's, so the plan asks squeue for jobs to cancel: point it at no configuration, so it fails at once
        done = _script("plan", "stop", state=state, SLURM_CONF=str(open_tmp / "no-such.conf"))
        assert done.returncode == 0, done.stderr
        out = done.stdout.splitlines()
        assert f"local_cluster: would stop slurmd (pid {tagged.pid})" in out
        assert f"local_cluster: would stop slurmctld (pid {recorded.pid})" in out
        left = [line for line in out if "left alone: not started by this script" in line]
        assert any(str(untagged.pid) in line.split() for line in left if "slurmd pid" in line), out
        assert any(str(stale.pid) in line.split() for line in left if "slurmctld pid" in line), out
        assert all(p.poll() is None for p in procs)
        assert _snapshot([state, f"{state}.manifest"]) == before
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _installed(packages) -> set[str]:
    if not packages:
        return set()
    out = subprocess.run(
        ["dpkg-query", "-W", "-f=${Package} ${db:Status-Status}\\n", *packages], capture_output=True, text=True
    ).stdout
    return {line.split()[0] for line in out.splitlines() if line.split()[1:] not in ([], ["not-installed"])}


def _job_processes(sleep: str) -> list[int]:
    """The running processes whose command line is `sleep <sleep>`."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if (proc / "cmdline").read_bytes().split(b"\0")[:2] == [b"sleep", sleep.encode()]:
                if (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    found.append(int(proc.name))
        except OSError:
            continue
    return found


def _user_exists(name: str) -> bool:
    return subprocess.run(["id", "-u", name], capture_output=True).returncode == 0


def _why_no_cycle() -> str | None:
    if os.environ.get("DGC_TEST_LOCAL_CLUSTER") != "1":
        return "installs packages: set DGC_TEST_LOCAL_CLUSTER=1 to run it"
    if os.geteuid() != 0:
        return "needs root"
    if not all(shutil.which(c) for c in ("bash", "apt-get", "dpkg-query", "pgrep")):
        return "needs bash, apt-get, dpkg-query, pgrep"
    if _running():
        return f"Slurm or munge runs here already ({sorted(set(_running().values()))}); not disturbing it"
    if CONF.exists() or Path("/var/lib/dgc-slurm.manifest").exists():
        return f"{CONF} or a local cluster's manifest exists; not disturbing it"
    return None


@pytest.mark.slurm
def test_start_then_stop_purge_leaves_the_machine_as_it_was():
    reason = _why_no_cycle()
    if reason:
        pytest.skip(reason)
    state = Path(f"/var/lib/dgc-slurm-test-{uuid.uuid4().hex[:8]}")
    manifest = Path(f"{state}.manifest")
    base = ["slurm-wlm", "munge", "slurmctld", "slurmd", "slurm-client", "libmunge2"]
    installed_before = _installed(base)
    users_before = {u: _user_exists(u) for u in ("munge", "slurm")}
    existed_before = {p: Path(p).exists() for p in SYSTEM_PATHS}
    sleep = f"300.{uuid.uuid4().int % 10**6}"  # the job's sleep, told apart from any other by its argument
    try:
        done = _script("start", state=state, timeout=1200)
        assert done.returncode == 0, done.stdout + done.stderr
        assert " is idle" in done.stdout
        entries = [line.split(" ", 1) for line in manifest.read_text().splitlines() if not line.startswith("#")]
        pkgs = [v for k, v in entries if k == "pkg"]
        created = [Path(v) for k, v in entries if k in ("dir", "file")]
        assert state in created and CONF in created
        assert not set(pkgs) & installed_before, "recorded a package that was installed before start"
        assert _installed(pkgs) == set(pkgs)
        # every system path that appeared is recorded, itself or a folder above it
        appeared = [Path(p) for p, there in existed_before.items() if not there and Path(p).exists()]
        assert all(any(c == p or c in p.parents for c in created) for p in appeared), (appeared, created)
        assert not [p for p, there in existed_before.items() if there and Path(p) in created]
        assert {"munged", "slurmctld", "slurmd"} <= set(_running().values())
        # a job left running, and stale pid files (as after a killed shell): stop must still find everything
        job = subprocess.run(["sbatch", "--parsable", "-o", "/dev/null", "--wrap", f"sleep {sleep}"],
                             capture_output=True, text=True, cwd="/")  # fmt: skip
        assert job.returncode == 0, job.stderr
        for _ in range(60):
            if _job_processes(sleep):
                break
            time.sleep(0.5)
        assert _job_processes(sleep), "the job did not start"
        for pid_file in (state / "run").glob("*.pid"):
            pid_file.unlink()
    finally:
        done = _script("stop", "--purge", state=state, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert _running() == {}, "daemons left running"
    assert _job_processes(sleep) == [], "the job's processes are left running"
    assert not manifest.exists() and not state.exists()
    assert [p for p in created if p.exists()] == []
    assert {p: Path(p).exists() for p in SYSTEM_PATHS} == existed_before
    assert _installed(pkgs) == set(), "packages start installed are still there"
    assert _installed(base) == installed_before
    assert {u: _user_exists(u) for u in ("munge", "slurm")} == users_before
