"""Every tensor the library builds on its way to a collective is built on the gradients' device: proven on
the CPU with :class:`tests.devices.HostTensorGuard` over whole steps of 2 real gloo ranks (every compressor,
every exchange, the DDP hook, a non-finite step, a stop request, a state_dict round trip; and the trainer with a
stop, a checkpoint and a resume), and a static check
of the library's source (``tools/check_devices.py``, also run by ``make lint``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from dgc.tasks.tiny_data import write_fmnist
from torch.nn.parallel import DistributedDataParallel

import dgc
from dgc.comm import Comm
from dgc.repro.config import EXIT_INTERRUPTED
from tests.devices import DGC, SITECUSTOMIZE, HostTensorGuard
from tests.multiproc import run
from tests.runs import TINY, cli
from tests.test_sync_dist import batch, make_model

ROOT = Path(__file__).resolve().parents[1]
SMALL = {"topk": {"density": 0.05}, "dgc": {"density": 0.05}, "powersgd": {"rank": 2}}


def train(model, sync, rank: int, steps: int, net=None, poison_at: int = -1) -> None:  # noqa: ANN001
    opt = dgc.SGD(model.parameters(), sync, lr=0.05, momentum=0.9, weight_decay=1e-4)
    for step in range(steps):
        sync.set_epoch(step / 4)
        x, y = batch(rank, step)
        model.zero_grad(set_to_none=True)
        F.cross_entropy((net or model)(x), y).backward()
        if step == poison_at and rank == 1:
            next(model.parameters()).grad.view(-1)[0] = float("nan")
        if step == poison_at + 1 and rank == 0:
            sync.request("stop")
        if net is None:
            sync.step()
        opt.step()


def plant_host_tensor() -> None:
    """A ``torch.tensor([1])`` in the path of every allgather, written as if in dgc/comm.py."""
    source = "import torch\ndef planted(self, buf, _orig=None):\n    torch.tensor([1])\n    return _orig(self, buf)\n"
    ns: dict = {}
    exec(compile(source, f"{DGC}/comm.py", "exec"), ns)
    original = Comm.allgather
    Comm.allgather = lambda self, buf: ns["planted"](self, buf, _orig=original)


def _every_path(rank: int, world: int, plant: bool) -> list[str]:
    if plant:
        plant_host_tensor()
    with HostTensorGuard() as guard:
        for name in dgc.COMPRESSORS:
            model = make_model()
            train(model, dgc.GradientSync(model, dgc.build_compressor(name, **SMALL.get(name, {})), clip_norm=5.0),
                  rank, 3)  # fmt: skip
        for exchange, extra in [("hierarchical", {"local_bus": "group"}), ("hierarchical", {"local_bus": "shm"}),
                                ("sparse_allreduce", {})]:  # fmt: skip
            model = make_model()
            compressor = dgc.build_compressor("dgc", density=0.05)
            sync = dgc.GradientSync(model, compressor, exchange=exchange, ranks_per_node=2, **extra)
            train(model, sync, rank, 3)
        for name, options in [
            ("dgc", {"density": 0.05}),
            ("dgc", {"density": 0.05, "selection": "chunk"}),
            ("powersgd", {"rank": 2}),
        ]:  # the dense values and the agreement in the compressor's message
            model = make_model()
            train(model, dgc.GradientSync(model, dgc.build_compressor(name, **options), pack="all"), rank, 3)
        model = make_model()  # a non-finite gradient, then a stop request; a state_dict round trip
        sync = dgc.GradientSync(model, dgc.build_compressor("dgc", density=0.05), clip_norm=1.0)
        train(model, sync, rank, 4, poison_at=1)
        sync.load_state_dict(sync.state_dict())
        train(model, sync, rank, 2)
        model = make_model()  # the DDP hook
        sync = dgc.GradientSync(model, dgc.build_compressor("dgc", density=0.05))
        ddp = DistributedDataParallel(model)
        ddp.register_comm_hook(sync, dgc.ddp_comm_hook)
        train(model, sync, rank, 3, net=ddp)
    return guard.found


def test_every_path_builds_its_tensors_on_the_gradients_device() -> None:
    found = run(_every_path, 2, False)
    assert found == [[], []], (
        "tensors built without a device (the CPU, under NCCL a failing collective):\n" + "\n".join(found[0])
    )


def test_a_planted_host_tensor_in_a_collective_path_is_caught() -> None:
    found = run(_every_path, 2, True)
    assert all("dgc/comm.py:3 torch.tensor" in f for f in found), found


def test_the_guard_sees_only_calls_without_a_device() -> None:
    with HostTensorGuard() as guard:
        torch.zeros(3, device="cpu"), torch.tensor([1.0]).new_zeros(2), torch.empty_like(torch.ones(2, device="cpu"))
    assert guard.found == []  # made here, not in dgc/, and with devices


def test_the_trainer_builds_its_tensors_on_the_gradients_device(tmp_path) -> None:
    """2 workers of ``python -m dgc.train`` with the guard in every process: a non-finite step, a stop
    (SIGTERM) with its checkpoint, a resume, evaluations, the checkpoint's gather of every rank's state and
    the run directory's agreement; then the DDP hook."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE.format(root=str(ROOT)))
    report = tmp_path / "report.txt"
    fmnist = write_fmnist(tmp_path / "fmnist", n_train=48, n_test=16)
    env = {"PYTHONPATH": str(site), "DGC_TEST_GUARD_REPORT": str(report)}
    common = [*TINY, f"data.root={fmnist}", "data.limit=48", "data.eval_limit=16", "compression=dgc",
              "compression.density=0.05", "train.checkpoint_every=2"]  # fmt: skip
    run_dir = f"run_dir={tmp_path / 'run'}"
    first = cli([*common, run_dir, "train.max_steps=6"], tmp_path, nproc=2, env={**env, "DGC_FAULTS": "nan@2:1,term@3"})
    assert first.returncode == EXIT_INTERRUPTED, first.stderr[-2000:]
    second = cli([*common, run_dir, "train.max_steps=6", "resume=auto"], tmp_path, nproc=2, env=env)
    assert second.returncode == 0 and "at step 4" in second.stdout, second.stderr[-2000:]  # stopped a step later
    hook = [*common, f"run_dir={tmp_path / 'hook'}", "train.max_steps=3", "sync.ddp_hook=true"]
    assert cli(hook, tmp_path, nproc=2, env=env).returncode == 0
    assert len(Path(f"{report}.pids").read_text().split()) >= 9  # 3 launchers and their 6 workers
    found = sorted(set(report.read_text().split("\n")) - {""}) if report.exists() else []
    assert found == [], "tensors built without a device:\n" + "\n".join(found)


def test_the_static_check_is_clean_and_catches_a_plant(tmp_path) -> None:
    check = [sys.executable, str(ROOT / "tools" / "check_devices.py")]
    out = subprocess.run(check, capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and out.stdout == "", out.stdout + out.stderr
    planted = tmp_path / "planted.py"
    planted.write_text("import torch\n\ndef f(n):\n    return torch.tensor([n], dtype=torch.int64)\n")
    out = subprocess.run([*check, str(planted)], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 1
    assert (
        out.stdout.strip()
        == f"{planted}:4: torch.tensor without device= (use the gradients' device; device='cpu' for a host value)"
    )
