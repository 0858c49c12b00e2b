"""Where a run lives: the run directory a start chooses, the same one for every rank and every restart of its job
(``run_dir=``; a job's own directory; the run that ``resume=auto`` continues; else a new one), and the record a Hydra
sweep keeps of the directories it made. What the directory holds is :mod:`dgc.repro.rundir`'s."""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import yaml

from dgc.repro import checkpoint
from dgc.repro.config import Config, method_name

#: the file in a Hydra multirun's sweep folder (``runs/multirun/<time>/``) listing the run directories it made
MULTIRUN_RECORD = "run_dirs.txt"
_recorded: set[Path] = set()  # the records this process added to (said at exit)


#: set by ``python -m dgc.train --nproc`` for its workers when it chose the run directory (no ``run_dir=`` given)
RUN_DIR_CHOSEN = "DGC_RUN_DIR_CHOSEN"


def continue_with(run_dir: str | Path | None) -> str:
    """How to continue a stopped run: the same command with ``resume=auto``, and with ``run_dir=`` when a new
    start of that command would choose another directory (``run_dir``: the directory then; None when the command
    gave it)."""
    if run_dir is None:
        return "run the same command with resume=auto"
    return f"run the same command with run_dir={run_dir} resume=auto"


def job_id() -> str | None:
    """The job this process is a worker of, the same in every restart of it: torchrun's run id (one per launch,
    kept by its restarts: ``torchrun-<8 hex>``), else Slurm's job and step (kept by a requeue:
    ``slurm-<job>.<step>``); None outside both."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":  # ("none": a rendezvous without an id, the same for every job)
        return f"torchrun-{run_id.replace('-', '')[:8]}"
    job = os.environ.get("SLURM_JOB_ID", "")
    if job:
        return f"slurm-{job}.{os.environ.get('SLURM_STEP_ID', 'batch')}"
    return None


def restart_count() -> int:
    """How many times the job was restarted before this attempt: by torchrun's agent (``--max-restarts``) or by
    Slurm (a requeue); 0 for a first start."""
    for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"):
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 0


def default_run_dir(task: str, compression: str) -> str:
    """Where a run without ``run_dir=`` goes: ``runs/<task>/<compression>/<job>`` in a job that may be restarted
    (:func:`job_id`: a restart or requeue finds the run it continues), else a fresh
    ``runs/<task>/<compression>/<time>-<pid>[-N]`` (the jobs of a sweep share time and pid).

    In a job of a Hydra multirun (``python -m dgc.train -m ...``) rank 0 also adds it to the sweep's
    :data:`MULTIRUN_RECORD`, and the process says at exit where that list is."""
    job = _job_dir(task, compression)
    if job is not None:
        return str(job)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = Path("runs") / task / compression / f"{stamp}-{os.getpid()}"
    path, n = base, 1
    while path.exists():
        path, n = base.with_name(f"{base.name}-{n}"), n + 1
    _record_multirun(path)
    return str(path)


def find_run(cfg: Config) -> Path | None:
    """The newest run directory under ``runs/<task>/<method>/`` whose ``config.yaml`` holds this run's settings
    (those free to change on a resume aside, ``train.max_steps`` not): the run that the same command with
    ``resume=auto`` continues, a finished one included (it then says that it is complete)."""
    folder = Path("runs") / cfg.task.name / method_name(cfg)
    try:
        found = [d / "config.yaml" for d in folder.iterdir() if (d / "config.yaml").is_file()]
    except OSError:
        return None
    mine = yaml.safe_load(yaml.safe_dump(asdict(cfg), sort_keys=False))
    for path in sorted(found, key=lambda p: p.stat().st_mtime, reverse=True):
        try:
            saved = yaml.safe_load(path.read_text())
        except (OSError, ValueError, yaml.YAMLError):
            continue
        if not isinstance(saved, dict) or checkpoint.changed_settings(saved, mine, [], cfg=cfg):
            continue
        # (train.max_steps may change on a resume, but a sweep over it makes other runs, not one continued)
        if (saved.get("train") or {}).get("max_steps") == cfg.train.max_steps:
            return path.parent
    return None


def choose_run_dir(cfg: Config) -> str:
    """Where this run lives: ``run_dir=``; else, in a job that may restart, the job's own directory once it
    exists; else, with ``resume=auto`` or ``true``, the run of the same settings it continues (:func:`find_run`);
    else a new :func:`default_run_dir`."""
    if cfg.run_dir:
        return cfg.run_dir
    job = _job_dir(cfg.task.name, method_name(cfg))
    if job is not None and job.is_dir():
        return str(job)
    found = find_run(cfg) if cfg.resume in (True, "auto") else None
    if found is not None:
        _record_multirun(found)
        return str(found)
    return default_run_dir(cfg.task.name, method_name(cfg))


def _job_dir(task: str, compression: str) -> Path | None:
    """``runs/<task>/<compression>/<job>`` in a job that may restart (not a sweep's job), else None."""
    job = job_id() if _multirun_folder() is None else None
    return None if job is None else Path("runs") / task / compression / job


def _multirun_folder() -> Path | None:
    """The sweep folder (``hydra.sweep.dir``) of the Hydra multirun this process runs a job of, else None."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode
    except ImportError:
        return None
    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    return Path(str(HydraConfig.get().sweep.dir))


def _record_multirun(run_dir: Path) -> None:
    """Rank 0 of a multirun's job: one line, the run directory's absolute path, appended to the record."""
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
    folder = _multirun_folder()
    if folder is None or rank != "0":
        return
    record = folder / MULTIRUN_RECORD
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(record, "a") as f:  # one short write: the lines of jobs running at once stay whole
            f.write(f"{run_dir.absolute()}\n")
    except OSError as exc:
        print(f"warning: cannot record the run directory in {record}: {exc.strerror}", file=sys.stderr)
        return
    if not _recorded:
        atexit.register(_say_recorded)
    _recorded.add(record)


def _say_recorded() -> None:
    for record in sorted(_recorded):
        with contextlib.suppress(OSError):
            n = sum(1 for line in record.read_text().splitlines() if line.strip())
            print(f"[multirun] {record} lists the {n} run director{'y' if n == 1 else 'ies'} of this sweep; "
                  f"their table: python -m dgc.repro.report {record.parent}", flush=True)  # fmt: skip
