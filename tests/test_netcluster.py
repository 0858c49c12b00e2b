"""launch/netcluster.py: namespaces are created, used and always removed; the cluster bench runs on it.

The tests that build namespaces need root and are skipped otherwise.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "launch" / "netcluster.py"
#: these tests compare the machine's namespaces and links before and after: one xdist worker runs them all
pytestmark = pytest.mark.xdist_group("netns")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="builds network namespaces: needs root")


def netcluster(*args: str, timeout: float = 60, **kwargs) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, **kwargs
    )


def namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return {line.split(":")[1].strip() for line in out.splitlines()}


def test_dry_run_prints_the_plan_without_root() -> None:
    proc = netcluster("--nodes", "3", "--rate", "100mbit", "--dry-run", "--", "python", "-c", "print(1)")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert sum("tbf rate 100mbit burst 512kb latency 100ms" in line for line in lines) == 6  # both directions
    assert sum(line.startswith("ip netns add ") for line in lines) == 4  # 3 nodes and the hub
    assert sum(line.startswith("ip netns del ") for line in lines) == 4
    ranks = [line for line in lines if line.startswith("ip netns exec ")]
    assert len(ranks) == 3
    assert "RANK=2 WORLD_SIZE=3" in ranks[2] and "GLOO_SOCKET_IFNAME=veth2" in ranks[2]
    assert "MASTER_ADDR=10.213.0.1" in ranks[2] and ranks[2].endswith("python -c 'print(1)'")
    assert any("link set lo up" in line for line in lines)


def test_bad_arguments_are_one_line() -> None:
    for args in (["--rate", "fast", "--", "true"], ["--nodes", "0", "--", "true"], ["--nodes", "2"]):
        proc = netcluster(*args)
        assert proc.returncode == 2
        assert len(proc.stderr.strip().splitlines()) == 1 and "error" in proc.stderr


def test_not_root_says_so_in_one_line() -> None:
    if os.geteuid() == 0:  # run it as nobody, with the system interpreter (it needs only the standard library)
        python = next((p for p in ("/usr/bin/python3", "/usr/local/bin/python3") if os.access(p, os.X_OK)), None)
        if python is None:
            pytest.skip("no system python3 that user nobody can run")
        # a copy that user nobody can read: the checkout may sit in a directory only root can enter
        with tempfile.TemporaryDirectory() as tmp:
            os.chmod(tmp, 0o755)
            script = Path(tmp) / SCRIPT.name
            shutil.copyfile(SCRIPT, script)
            os.chmod(script, 0o644)
            proc = subprocess.run(
                [python, str(script), "--nodes", "2", "--", "true"],
                capture_output=True, text=True, timeout=60, cwd="/", user=65534, group=65534,
            )  # fmt: skip
    else:
        proc = netcluster("--nodes", "2", "--", "true")
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "root" in lines[0]


@needs_root
def test_runs_one_rank_per_namespace_and_cleans_up(tmp_path: Path) -> None:
    before_ns, before_links = namespaces(), links()
    code = (
        "import os, socket, sys; e = os.environ; "
        "open(os.path.join(sys.argv[1], e['RANK']), 'w').write(' '.join(["
        "e['RANK'], e['WORLD_SIZE'], e['GLOO_SOCKET_IFNAME'], e['MASTER_ADDR'], e['MASTER_PORT'], "
        "','.join(sorted(n for _, n in socket.if_nameindex()))]))"
    )
    proc = netcluster("--nodes", "3", "--", sys.executable, "-c", code, str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    for i in range(3):
        assert (tmp_path / str(i)).read_text() == f"{i} 3 veth{i} 10.213.0.1 29500 lo,veth{i}"
    assert namespaces() == before_ns
    assert links() == before_links


@needs_root
def test_failing_rank_sets_the_exit_status_and_cleans_up() -> None:
    before = namespaces()
    started = time.monotonic()
    script = 'if [ "$RANK" = 1 ]; then exit 3; fi; sleep 60'
    proc = netcluster("--nodes", "3", "--grace", "0.5", "--", "sh", "-c", script)
    assert proc.returncode == 3, proc.stderr
    assert time.monotonic() - started < 30  # the sleeping ranks were stopped
    assert "rank 1 exited with status 3" in proc.stderr
    assert namespaces() == before


@needs_root
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_stops_the_ranks_and_cleans_up(sig: int) -> None:
    before = namespaces()
    marker = f"netcluster-test-{os.getpid()}-{int(sig)}"
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--nodes", "2", "--", "sh", "-c", "sleep 60; true", marker],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    tag = f"dgcn{proc.pid}-"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not _ranks_running(marker, 2):
        time.sleep(0.1)
    assert any(ns.startswith(tag) for ns in namespaces())
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + sig, err
    assert namespaces() == before
    assert not _ranks_running(marker, 1)


def _ranks_running(marker: str, at_least: int) -> bool:
    out = subprocess.run(["ps", "-ww", "-eo", "args"], capture_output=True, text=True).stdout
    return sum(marker in line and "netcluster.py" not in line for line in out.splitlines()) >= at_least


@needs_root
def test_cluster_bench_small_run(tmp_path: Path) -> None:
    before = namespaces()
    out = tmp_path / "cluster.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [
            sys.executable, "-m", "dgc.bench", "cluster", "--nodes", "2", "--model", "tiny", "--steps", "2",
            "--warmup", "1", "--methods", "none,dgc,dgc_compact", "--out", str(out),
        ],
        capture_output=True, text=True, timeout=120, cwd=ROOT, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    assert out.read_text() == proc.stdout
    assert out.with_suffix(".png").stat().st_size > 0
    assert r["bench"] == "cluster" and r["mode"] == "exchange" and r["nodes"] == 2 and r["rate"] == "1gbit"
    assert list(r["methods"]) == ["none", "dgc", "dgc_compact"]
    for name, row in r["methods"].items():
        assert row["exchange_s"] > 0 and len(row["exchange_s_runs"]) == 2, name
        assert row["sent_bytes"] > 0 and row["dense_bytes"] == 4 * r["numel"]
        assert row["agreement"] == "flat", name  # how its step agreed: the cost model fits each run as it ran
    assert r["methods"]["none"]["speedup_vs_none"] == 1.0
    assert r["methods"]["dgc"]["sent_bytes"] < r["methods"]["none"]["sent_bytes"] / 50
    assert r["methods"]["dgc_compact"]["sent_bytes"] < r["methods"]["dgc"]["sent_bytes"]
    assert namespaces() == before


@needs_root
@pytest.mark.skipif(not Path("/usr/share/datasets/fashion-mnist").is_dir(), reason="needs the Fashion-MNIST package")
def test_cluster_bench_against_ddp_as_users_run_it(tmp_path: Path) -> None:
    out = tmp_path / "e2e.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [
            sys.executable, "-m", "dgc.bench", "cluster", "--e2e", "--ddp", "--nodes", "2", "--steps", "1",
            "--warmup", "1", "--batch-size", "4", "--methods", "local,ddp,dgc_overlap", "--out", str(out),
        ],
        capture_output=True, text=True, timeout=180, cwd=ROOT, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    r = json.loads(out.read_text())
    assert r["mode"] == "e2e-ddp" and list(r["methods"]) == ["local", "ddp", "dgc_overlap"]
    rows = r["methods"]
    assert rows["local"]["exposed_s"] == 0.0
    for name in ("ddp", "dgc_overlap"):
        assert rows[name]["exposed_s"] == pytest.approx(rows[name]["step_s"] - rows["local"]["step_s"])
    # what went over a machine's shaped link: DDP's fp32 gradient (and a little more), DGC's hundreds of times less
    assert rows["ddp"]["link_bytes"] > rows["ddp"]["dense_bytes"]
    assert rows["dgc_overlap"]["link_bytes"] < rows["ddp"]["link_bytes"] / 100
    assert 0 < rows["dgc_overlap"]["sent_bytes"] < rows["dgc_overlap"]["link_bytes"]
    assert out.with_suffix(".png").stat().st_size > 0


# each rank runs a child of its own, so a rank killed alone leaves something inside its namespace
STAY = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'import time; time.sleep(60)', sys.argv[1]])"


@contextlib.contextmanager
def staying_cluster(marker: str, log: Path) -> Iterator[tuple[subprocess.Popen, str]]:
    """A 2-node cluster whose ranks each run a child; ``(launcher, tag)``; whatever is left is removed after."""
    with log.open("w") as err:  # not a pipe: the ranks' children keep theirs open after the launcher dies
        proc = subprocess.Popen(
            [sys.executable, str(SCRIPT), "--nodes", "2", "--", sys.executable, "-c", STAY, marker],
            stdout=subprocess.DEVNULL, stderr=err, cwd=ROOT,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not _ranks_running(marker, 4):  # two ranks and their two children
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
            time.sleep(0.1)
        yield proc, f"dgcn{proc.pid}"
    finally:
        proc.kill()
        netcluster("--cleanup-stale")


def reaper_of(tag: str) -> int:
    out = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout
    (pid,) = [int(line.split()[0]) for line in out.splitlines() if f"--reap {tag}" in line]
    return pid


def gone(tag: str, marker: str, within: float) -> bool:
    deadline = time.monotonic() + within
    while any(ns.startswith(tag + "-") for ns in namespaces()) or _ranks_running(marker, 1):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@needs_root
def test_sigkill_of_the_launcher_leaves_no_namespace_and_no_rank(tmp_path: Path) -> None:
    marker = f"netcluster-kill-{os.getpid()}"
    with staying_cluster(marker, tmp_path / "err") as (proc, tag):
        assert any(ns.startswith(tag + "-") for ns in namespaces())
        proc.kill()  # no handler runs: the ranks die with it, the reaper removes the rest at once
        proc.wait(timeout=30)
        assert gone(tag, marker, within=20), (namespaces(), (tmp_path / "err").read_text())
        assert not os.path.exists(f"/run/netcluster/{tag}.lock")


@needs_root
def test_the_next_start_removes_a_cluster_whose_launcher_and_reaper_were_killed(tmp_path: Path) -> None:
    marker = f"netcluster-kill2-{os.getpid()}"
    with staying_cluster(marker, tmp_path / "err") as (proc, tag):
        os.kill(reaper_of(tag), signal.SIGKILL)
        proc.kill()
        proc.wait(timeout=30)
        time.sleep(1)
        left = {ns for ns in namespaces() if ns.startswith(tag + "-")}
        assert len(left) == 3 and _ranks_running(marker, 2)  # the ranks' children still run inside
        out = netcluster("--nodes", "1", "--", "true")
        assert out.returncode == 0, out.stderr
        assert "removed 3 stale namespace(s) of killed launchers" in out.stderr
        assert gone(tag, marker, within=5) and not os.path.exists(f"/run/netcluster/{tag}.lock")
