"""What a run writes, and where: one directory for all ranks, written by rank 0 only.

::

    <run_dir>/config.yaml     resolved configuration
    <run_dir>/env.json        versions, git revision, world size, command line
    <run_dir>/metrics.jsonl   one line per logged step ("kind": "train") and per evaluation ("eval")
    <run_dir>/checkpoint.pt   latest checkpoint (model, optimizer, counters, config, every rank's
                              compression state keyed by parameter name, RNG states)
    <run_dir>/summary.json    written last: task, compression, world_size, steps, metrics,
                              wire_ratio, bytes_per_step, wall_s, ...

Every file is written atomically (:mod:`dgc.atomic`). The directory is chosen once, by rank 0
(:func:`dgc.repro.locate.choose_run_dir`), and broadcast to all ranks.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import platform
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import yaml

import dgc
from dgc import atomic
from dgc.distributed import DistInfo, broadcast_object
from dgc.repro import checkpoint
from dgc.repro.config import Config, ConfigError, method_name
from dgc.repro.locate import RUN_DIR_CHOSEN, choose_run_dir, continue_with, job_id, restart_count
from dgc.repro.runlock import RunLock


def read_records(path: str | os.PathLike) -> list[dict]:
    """The records of a ``metrics.jsonl``, in order; a line that is not JSON (cut by a crash) is skipped. Raises
    OSError when the file cannot be read."""
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


class MetricsLog:
    """Append-only ``metrics.jsonl``: one JSON object per line (rank 0 only)."""

    def __init__(self, path: str | os.PathLike, enabled: bool = True):
        self.path = Path(path)
        self.enabled = enabled

    def truncate_after(self, step: int) -> list[str]:
        """Drop records past ``step`` (written after the checkpoint a resumed run starts from), and a torn last
        line (a write cut short); returns the warnings."""
        if not self.enabled:
            return []
        if step > 0 and (not self.path.exists() or not self.path.stat().st_size):
            return [f"{self.path} is missing or empty: the log of steps 1-{step} is lost (the checkpoint is "
                    f"intact); logging goes on after step {step}"]  # fmt: skip
        if not self.path.exists():
            return []
        keep, warnings = [], []
        lines = self.lines()
        for i, line in enumerate(lines):
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                if i == len(lines) - 1:
                    warnings.append(f"dropped a torn last line of {self.path}: {line[:60]!r}")
                    continue
                raise ConfigError(f"{self.path} line {i + 1} is not JSON; repair or remove it, then resume") from None
            if record.get("step", 0) <= step:
                keep.append(line)
        atomic.write_text(self.path, "\n".join(keep) + "\n" if keep else "")
        return warnings

    def lines(self) -> list[str]:
        """The log's lines; a ConfigError naming the file when it is not UTF-8 text (checked before a resume
        changes anything)."""
        try:
            return self.path.read_text().splitlines()
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{self.path} is not UTF-8 text (a bad byte at offset {exc.start}); repair or remove "
                              "it, then resume") from None  # fmt: skip

    def write(self, record: dict[str, Any]) -> None:
        """Append one record; a full disk is a ConfigError naming the log (a resume drops a line cut short)."""
        if not self.enabled:
            return
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise OSError(exc.errno, exc.strerror, str(self.path)) from None
            raise ConfigError(f"no space left on the device of {self.path} while logging step {record.get('step')}: "
                              "free space there, then run the same command with resume=auto (it continues from "
                              "the last checkpoint)") from None  # fmt: skip


def _git_revision() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, cwd=Path(__file__).parent
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _num(value: float | None, fmt: str) -> str:
    return "nan" if value is None else format(value, fmt)


def _human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.1f}{unit}" if unit != "B" else f"{n:.0f}B"
        n /= 1024
    return f"{n:.1f}GB"


class RunFiles:
    """The run directory of one run. ``open()`` takes it (the lock), decides whether to start or resume and
    checks a resumption before anything in the directory changes; every rank learns rank 0's decision."""

    def __init__(self, cfg: Config, info: DistInfo):
        self.cfg, self.info = cfg, info
        self.main = info.is_main
        self.run_dir = Path(str(broadcast_object(choose_run_dir(cfg))))
        self.metrics = MetricsLog(self.run_dir / "metrics.jsonl", enabled=self.main)
        self.lock = RunLock(self.run_dir)
        self.progress = None
        self.wandb = None

    # -- opening -------------------------------------------------------------------------
    def open(self) -> dict[str, Any] | None:
        """Take the directory and return the checkpoint to resume from (None: a fresh start).

        Everything that can refuse the run (the lock, the resume mode, the checkpoint, the settings it was
        written with) is decided on rank 0 and broadcast before anything is written; a refusal raises the
        same :class:`ConfigError` on every rank and leaves the directory as it was.
        """
        decision: dict[str, Any] = {}
        if self.main:
            try:
                decision = self._decide()
            except ConfigError as exc:
                decision = {"error": str(exc)}
            except OSError as exc:  # a full or read-only disk: said once, on every rank, nothing left half-done
                decision = {"error": self._write_error(exc)}
        decision = broadcast_object(decision)  # type: ignore[assignment]
        if "error" in decision:
            self.lock.release()
            raise ConfigError(decision["error"])
        for warning in decision.get("warnings", []):
            self.console(f"warning: {warning}")
        state = None
        if decision.get("checkpoint"):
            path = Path(decision["checkpoint"])
            try:
                state = checkpoint.load(path)
            except ValueError as exc:  # it was readable on rank 0
                raise ConfigError(f"{path} {exc}") from None
        if self.main:
            if state is not None or decision.get("restart"):
                for warning in self.metrics.truncate_after(state["counters"]["step"] if state else 0):
                    self.console(f"warning: {warning}")
        if state is not None:
            self.console(f"resuming {self.run_dir} at step {state['counters']['step']} (from {path.name})")
        else:
            self.console(f"run dir {self.run_dir}")
        return state

    def _decide(self) -> dict[str, Any]:
        """Rank 0: the lock, then start or resume (``{"checkpoint": path | None, "warnings": [...]}``)."""
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise ConfigError(f"run_dir {self.run_dir} exists and is not a directory; pass a directory")
        created = [p for p in (self.run_dir, *self.run_dir.parents) if not p.exists()]
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot create run_dir {self.run_dir}: {exc.strerror}") from None
        try:
            warnings = [w for w in [self.lock.acquire()] if w]
            warnings += checkpoint.recover(self.run_dir)
            path, state, skipped = checkpoint.choose(self.run_dir)
            files = checkpoint.paths(self.run_dir)
            mode = self.cfg.resume
            leftover = (self.run_dir / "metrics.jsonl").exists()
            if leftover:
                self.metrics.lines()  # a log that cannot be read is said before anything changes
            if mode is False and (files or leftover) and self._restarted_here():
                mode = "auto"  # a restart of the job that started this run: it continues, as resume=auto would
            if mode is False and files:
                raise ConfigError(
                    f"{self.run_dir} already holds a run: pass resume=true (or resume=auto) to continue it, "
                    "or another run_dir"
                )
            if state is None and files:  # there are checkpoints, none usable
                raise ConfigError(f"cannot resume: {'; '.join(skipped)}")
            if state is None and mode is True:
                raise ConfigError(f"resume=true but {self.run_dir} holds no checkpoint (resume=auto starts then)")
            if state is None:
                if leftover and mode is False:
                    raise ConfigError(
                        f"{self.run_dir} holds the metrics.jsonl of a run that left no checkpoint to resume from: "
                        "remove it, pass another run_dir, or resume=auto to start it over"
                    )
                if leftover:
                    warnings.append(f"{self.run_dir} holds the log of a run that left no checkpoint: starting it over")
                self._write_header()
                return {"checkpoint": None, "restart": leftover, "warnings": warnings}
            bad = checkpoint.nonfinite(state)
            if bad:
                raise ConfigError(self._nonfinite_refusal(path, bad))
            self._check_resumable(state)
            warnings += [f"{w}; resuming from {path.name}" for w in skipped]
            self._write_header()
            return {"checkpoint": str(path), "warnings": warnings}
        except BaseException:
            self.lock.release()
            if created:  # a refused run leaves no directory it made (nor the header it wrote into it)
                for name in ("config.yaml", "env.json"):
                    with contextlib.suppress(OSError):
                        (self.run_dir / name).unlink()
            for folder in created:
                with contextlib.suppress(OSError):
                    folder.rmdir()
            raise

    def _write_error(self, exc: OSError) -> str:
        """The one line for a start that could not write in the run directory."""
        where = f" ({exc.filename})" if exc.filename else ""
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return (f"no space left on the device of {self.run_dir} at the start{where}: free space there (or pass "
                    "another run_dir), then run the same command; nothing was changed")  # fmt: skip
        return f"cannot write in {self.run_dir}{where}: {exc.strerror or exc}; nothing was changed"

    def continue_with(self) -> str:
        """How to continue this run after a stop (:func:`continue_with`)."""
        given = self.cfg.run_dir is not None and not os.environ.get(RUN_DIR_CHOSEN)
        return continue_with(None if given else self.run_dir)

    def _restarted_here(self) -> bool:
        """This start is a restart (torchrun's agent, a Slurm requeue) of the job that wrote the run's env.json."""
        if not restart_count() or job_id() is None:
            return False
        try:
            return json.loads((self.run_dir / "env.json").read_text()).get("job") == job_id()
        except (OSError, ValueError, AttributeError):
            return False

    def _nonfinite_refusal(self, path: Path, bad: list[str]) -> str:
        """The line refusing to resume from ``path``, whose state holds NaN/Inf (``bad``): which, and the newest
        checkpoint that is finite, if any."""
        good = None
        for other in checkpoint.paths(self.run_dir):
            if other == path:
                continue
            with contextlib.suppress(ValueError):
                state = checkpoint.load(other)
                if not checkpoint.nonfinite(state):
                    good = (other, state["counters"]["step"])
                    break
        where = (
            f"the last finite one is {good[0]} (step {good[1]}): remove {path.name} to resume from it"
            if good
            else "no checkpoint of this run is finite: start it over in another run_dir"
        )
        return f"cannot resume from {path}: it holds non-finite values ({', '.join(bad)}); {where}"

    def _check_resumable(self, state: dict[str, Any]) -> None:
        if state["world_size"] != self.info.world_size and "world_size" not in self.cfg.resume_allow:
            raise ConfigError(
                f"cannot resume {self.run_dir}: it was written by {state['world_size']} workers and this run has "
                f"{self.info.world_size} (compression state is per worker); resume with the same number of workers, "
                "or remap every worker's state onto these with resume_allow=[world_size]"
            )
        changed = checkpoint.changed_settings(
            state["config"], asdict(self.cfg), list(self.cfg.resume_allow), cfg=self.cfg
        )
        if changed:
            keys = ",".join(c.split(":")[0] for c in changed)
            raise ConfigError(
                f"cannot resume {self.run_dir} with other settings: {'; '.join(changed)}; run with the "
                f"checkpoint's settings, or accept the change with resume_allow=[{keys}]"
            )

    def _write_header(self) -> None:
        """config.yaml and env.json (rank 0), after the run is known to go ahead."""
        plain = asdict(self.cfg)
        atomic.write_text(self.run_dir / "config.yaml", yaml.safe_dump(plain, sort_keys=False))
        atomic.write_json(
            self.run_dir / "env.json",
            {
                "argv": sys.argv,
                "python": platform.python_version(),
                "torch": torch.__version__,
                "platform": platform.platform(),
                "dgc_version": dgc.__version__,
                "git_revision": _git_revision(),  # null outside a git checkout (an installed package)
                "world_size": self.info.world_size,
                "backend": self.info.backend,
                "device": str(self.info.device),
                "job": job_id(),  # a restart of this job continues the run (resume=false notwithstanding)
                "restarts": restart_count(),
            },
        )
        if self.cfg.logger.wandb:
            self._start_wandb(plain)

    def close(self) -> None:
        """Give the directory up (the lock); the run's files stay."""
        if self.progress is not None:
            self.progress.close()
            self.progress = None
        self.lock.release()

    def _start_wandb(self, plain: dict[str, Any]) -> None:
        try:
            import wandb
        except ImportError:
            self.console("logger.wandb=true but wandb is not installed (pip install wandb); continuing without it")
            return
        self.wandb = wandb.init(
            project=self.cfg.logger.project,
            mode=self.cfg.logger.mode,
            dir=str(self.run_dir),
            config=plain,
            name=f"{self.cfg.task.name}-{method_name(self.cfg)}",
            resume="allow" if self.cfg.resume else None,
        )

    # -- console and progress ------------------------------------------------------------
    def console(self, line: str) -> None:
        if not self.main:
            return
        if self.progress is not None:
            self.progress.write(line)
        else:
            print(line, flush=True)

    def start_progress(self, total: int, done: int) -> None:
        """A per-step progress bar on a terminal; in a pipe or a log file (Slurm) the log lines are the progress."""
        if self.main and self.cfg.train.progress and sys.stderr.isatty():
            from tqdm import tqdm

            self.progress = tqdm(
                total=total, initial=done, unit="step", dynamic_ncols=True, leave=False, file=sys.stderr
            )

    def tick(self, step: int) -> None:
        if self.progress is not None:
            self.progress.update(step - self.progress.n)

    def log_step(self, record: dict[str, Any]) -> None:
        self.metrics.write(record)
        if self.progress is not None:
            self.progress.n = record["step"]
            ratio = f"{record['wire_ratio']:.0f}x"
            self.progress.set_postfix(loss=_num(record["train_loss"], ".3f"), ratio=ratio, refresh=True)
        skipped = f" skipped {record['skipped']} (non-finite)" if record.get("skipped") else ""
        # the ratio is this step's; the run's (summary.json, the eval lines) is over the steps after the
        # compression warm-up, which the line says it is still in
        warmup = float(getattr(self.cfg.compression, "warmup_epochs", 0.0) or 0.0)
        # local steps: the bytes and the ratio are over the line's steps (an exchange every local_steps.every)
        n = record.get("ratio_steps")
        over = "this step" if n is None else f"over {n} step{'s' if n > 1 else ''}, local steps"
        phase = f", in the compression warm-up to epoch {warmup:g}" if record["epoch"] < warmup else ""
        # a step that sent nothing (skipped: a non-finite gradient somewhere) has no ratio
        ratio = f"ratio {record['wire_ratio']:.0f}x {over}" if record["sent_bytes"] else f"nothing sent {over}"
        self.console(
            f"step {record['step']} epoch {record['epoch']:.2f} loss {_num(record['train_loss'], '.4f')} "
            f"lr {record['lr']:.4g} "
            f"density {record['density']:.4g} sent {_human_bytes(record['sent_bytes'])} "
            f"({ratio}{phase}) compute {record['compute_s'] * 1e3:.0f}ms "
            f"compress {record['compress_s'] * 1e3:.1f}ms comm {record['communicate_s'] * 1e3:.1f}ms{skipped}"
        )
        if self.wandb is not None:
            self.wandb.log({f"train/{k}": v for k, v in record.items() if k != "kind"}, step=record["step"])

    def log_eval(self, record: dict[str, Any]) -> None:
        self.metrics.write(record)
        shown = " ".join(f"{k} {v:.4g}" for k, v in record.items() if isinstance(v, float) and k != "epoch")
        self.console(f"eval step {record['step']} epoch {record['epoch']:g}: {shown}")
        if self.wandb is not None:
            self.wandb.log({f"eval/{k}": v for k, v in record.items() if k != "kind"}, step=record["step"])

    # -- checkpoints and the summary -----------------------------------------------------
    def save_checkpoint(self, state: dict[str, Any]) -> None:
        checkpoint.save(self.run_dir, state)

    def complete(self, step: int) -> bool:
        """Rank 0, resuming a run that had trained and evaluated its last step: when its summary is written, say
        that it is complete (not the summary again) and return True; other ranks return False."""
        if not self.main or not (self.run_dir / "summary.json").exists():
            return False
        self.console(f"{self.run_dir} is complete (step {step}, evaluated): nothing to do; its summary is "
                     f"{self.run_dir / 'summary.json'}")  # fmt: skip
        return True

    def finish(self, summary: dict[str, Any]) -> None:
        if self.progress is not None:
            self.progress.close()
            self.progress = None
        if not self.main:
            return
        atomic.write_json(self.run_dir / "summary.json", summary)
        self.console(json.dumps(summary))
        if self.wandb is not None:
            self.wandb.summary.update({k: v for k, v in summary.items() if not isinstance(v, dict)})
            self.wandb.finish()
