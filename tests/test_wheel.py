"""The package as a user gets it: a wheel built from the checkout's tracked files, installed into a fresh
environment that already holds torch, used from another directory.

* the core needs torch alone: installing the wheel into an environment with torch adds dgc and changes nothing
  else, and the README's library script trains there (torchrun, 2 ranks);
* ``dgc[repro]`` adds the reproduction framework: ``python -m dgc.train`` composes a task from the installed
  ``dgc.conf`` and trains one step.

uv's cache (what ``make install`` filled) makes each install hard links: seconds, not a download.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from dgc.tasks.tiny_data import write_fmnist

from tests.runs import TINY
from tests.test_readme import README, blocks, section

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import lock_constraints  # noqa: E402


def uv() -> str:
    out = subprocess.run(["bash", str(ROOT / "tools" / "install.sh"), "--print-uv"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


def run(cmd: list[str], cwd: Path, env: dict | None = None, timeout: float = 300) -> str:
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{' '.join(map(str, cmd))} exited {out.returncode}:\n{out.stdout}\n{out.stderr}"
    return out.stdout


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without what would let the checkout or its venv leak into the installed one."""
    drop = ("PYTHONPATH", "VIRTUAL_ENV", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    return env | {"OMP_NUM_THREADS": "1", **extra}


def freeze(uv_bin: str, python: Path, cwd: Path) -> set[str]:
    """The environment's distributions, one line each (``name==version``, or ``name @ url`` for a wheel file)."""
    return set(run([uv_bin, "pip", "freeze", "--python", str(python)], cwd).splitlines())


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    """A wheel of the tracked files, and a fresh venv holding the lock's torch (and its dependencies) only."""
    tmp = tmp_path_factory.mktemp("wheel")
    uv_bin = uv()
    src, dist, venv, elsewhere = tmp / "src", tmp / "dist", tmp / "venv", tmp / "elsewhere"
    # the files git would commit (tracked, and new ones not ignored), as they are in the work tree
    for name in run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], ROOT).split("\0"):
        if name and (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    run([uv_bin, "build", "--wheel", "--out-dir", str(dist), str(src)], tmp)
    (wheel,) = dist.glob("dgc-*.whl")
    with zipfile.ZipFile(wheel) as z:
        assert {"dgc/__init__.py", "dgc/exchanges/__init__.py", "dgc/conf/config.yaml"} <= set(z.namelist())
    run([uv_bin, "venv", "--python", sys.executable, str(venv)], tmp)
    python = venv / "bin" / "python"
    constraints = tmp / "constraints.txt"
    locked = lock_constraints.constraints(tomllib.loads((ROOT / "uv.lock").read_text()))
    constraints.write_text("\n".join(locked) + "\n")
    run([uv_bin, "pip", "install", "--python", str(python), "-c", str(constraints), "torch"], tmp)
    elsewhere.mkdir()
    return {"uv": uv_bin, "wheel": wheel, "python": python, "constraints": constraints, "cwd": elsewhere}


def test_the_wheel_adds_dgc_to_an_environment_with_torch_and_changes_nothing_else(installed):
    uv_bin, python, cwd = installed["uv"], installed["python"], installed["cwd"]
    before = freeze(uv_bin, python, cwd)
    assert any(line.startswith("torch==") for line in before)
    run([uv_bin, "pip", "install", "--python", str(python), str(installed["wheel"])], cwd)
    after = freeze(uv_bin, python, cwd)
    assert after - before == {f"dgc @ {installed['wheel'].as_uri()}"}
    assert before <= after  # nothing upgraded, replaced or removed

    # imported from the venv, not the checkout; every subpackage of the library is there
    probe = (
        "import dgc, dgc.compressors, dgc.exchanges, dgc.costmodel, dgc.integrations, sys; print(dgc.__file__); "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'hydra', 'omegaconf', 'numpy', 'scipy', 'tqdm'}))"
    )
    where, extras = run([str(python), "-c", probe], cwd, clean_env()).splitlines()
    assert Path(where).is_relative_to(python.parents[1]) and not Path(where).is_relative_to(ROOT)
    assert "hydra" not in extras and "omegaconf" not in extras

    # the README's library script trains with the core alone (2 ranks under torch's own torchrun)
    (script,) = blocks(section("Use it in your training script"), "python")[:1]
    (cwd / "train_dgc.py").write_text(script)
    torchrun = [str(python), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    out = run([*torchrun, "train_dgc.py"], cwd, clean_env())
    assert out.count("epoch ") == 3 and "bytes sent" in out

    # the reproduction framework is not there: its commands say which extra in one line
    for command in (["-m", "dgc.train", "task=fmnist_resnet20"], ["-m", "dgc.bench", "select"]):
        fail = subprocess.run([str(python), *command], cwd=cwd, env=clean_env(), capture_output=True, text=True)
        assert fail.returncode == 2 and fail.stdout == "", fail.stderr
        # (torch itself warns on import that it found no NumPy: the core does not need it)
        (line,) = [
            line for line in fail.stderr.splitlines() if "NumPy" not in line and "_conversion_method" not in line
        ]
        assert line.startswith(f"error: python {' '.join(command[:2])} needs dgc's `repro` extra (hydra, ")
        assert line.endswith("pip install 'dgc[repro]' (in a checkout of dgc: make install)")
    fail = subprocess.run([str(python), "-c", "import dgc.repro"], cwd=cwd, env=clean_env(), capture_output=True,
                          text=True)  # fmt: skip
    assert (
        fail.returncode == 1
        and "ImportError: dgc.repro (the reproduction framework) needs dgc's `repro`" in fail.stderr
    )


def test_the_repro_extra_runs_the_trainer_from_the_installed_configs(installed, tmp_path):
    uv_bin, python, cwd = installed["uv"], installed["python"], installed["cwd"]
    wheel = installed["wheel"]
    pinned = ["-c", str(installed["constraints"])]
    run([uv_bin, "pip", "install", "--python", str(python), *pinned, f"dgc[repro] @ {wheel.as_uri()}"], cwd)
    fmnist = write_fmnist(tmp_path / "fmnist", n_train=16, n_test=8)
    run_dir = tmp_path / "run"
    args = [*TINY, "compression=dgc", f"data.root={fmnist}", "train.max_steps=1", f"run_dir={run_dir}"]
    run([str(python), "-m", "dgc.train", *args], cwd, clean_env())
    assert (run_dir / "summary.json").is_file() and (run_dir / "config.yaml").is_file()
    # the configs came from the installed package
    probe = "import dgc.conf; print(dgc.conf.__file__); print(len(dgc.conf.options('task')))"
    where, tasks = run([str(python), "-c", probe], cwd, clean_env()).splitlines()
    assert Path(where).is_relative_to(python.parents[1]) and int(tasks) >= 5
    assert "Use it in your training script" in README
