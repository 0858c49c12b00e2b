"""What a run writes, and where: one directory for all ranks, written by rank 0 only.

::

    <run_dir>/config.yaml     resolved configuration
    <run_dir>/env.json        versions, git revision, world size, command line
    <run_dir>/metrics.jsonl   one line per logged step ("kind": "train") and per evaluation ("eval")
    <run_dir>/checkpoint.pt   latest checkpoint (model, optimizer, counters, config, every rank's
                              compression state keyed by parameter name, RNG states)
    <run_dir>/summary.json    written last: task, compression, world_size, steps, metrics,
                              wire_ratio, bytes_per_step, wall_s, ...

Every file is written atomically (:mod:`dgc.atomic`). The directory is chosen once (``run_dir=`` or a
fresh ``runs/<task>/<compression>/<time>-<pid>`` picked by rank 0) and broadcast to all ranks.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import yaml

from dgc import atomic
from dgc.distributed import DistInfo, broadcast_object
from dgc.repro.config import Config, ConfigError


def default_run_dir(task: str, compression: str) -> str:
    """A fresh ``runs/<task>/<compression>/<time>-<pid>[-N]`` (the jobs of a sweep share time and pid)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = Path("runs") / task / compression / f"{stamp}-{os.getpid()}"
    path, n = base, 1
    while path.exists():
        path, n = base.with_name(f"{base.name}-{n}"), n + 1
    return str(path)


class MetricsLog:
    """Append-only ``metrics.jsonl``: one JSON object per line (rank 0 only)."""

    def __init__(self, path: str | os.PathLike, enabled: bool = True):
        self.path = Path(path)
        self.enabled = enabled

    def truncate_after(self, step: int) -> None:
        """Drop records past ``step`` (written after the checkpoint a resumed run starts from)."""
        if not self.enabled or not self.path.exists():
            return
        keep = [line for line in self.path.read_text().splitlines() if line and json.loads(line).get("step", 0) <= step]
        atomic.write_text(self.path, "\n".join(keep) + "\n" if keep else "")

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def _git_revision() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, cwd=Path(__file__).parent
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.1f}{unit}" if unit != "B" else f"{n:.0f}B"
        n /= 1024
    return f"{n:.1f}GB"


class RunFiles:
    def __init__(self, cfg: Config, info: DistInfo):
        self.cfg, self.info = cfg, info
        self.main = info.is_main
        run_dir = cfg.run_dir or default_run_dir(cfg.task.name, cfg.compression.name)
        self.run_dir = Path(str(broadcast_object(run_dir)))
        self.checkpoint_path = self.run_dir / "checkpoint.pt"
        if cfg.resume and not self.checkpoint_path.is_file():
            raise ConfigError(f"resume=true but {self.checkpoint_path} does not exist")
        if not cfg.resume and self.checkpoint_path.exists():
            raise ConfigError(
                f"{self.run_dir} already holds a run: pass resume=true to continue it, or another run_dir"
            )
        if not cfg.resume and (self.run_dir / "metrics.jsonl").exists():
            # a run that stopped before its first checkpoint: starting over would append to its log
            raise ConfigError(
                f"{self.run_dir} holds the metrics.jsonl of a run that left no checkpoint to resume from: "
                "remove it or pass another run_dir"
            )
        self.metrics = MetricsLog(self.run_dir / "metrics.jsonl", enabled=self.main)
        self.progress = None
        self.wandb = None

    def open(self) -> dict[str, Any] | None:
        """Create the directory (rank 0) and return the checkpoint to resume from, if any."""
        state = None
        if self.main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            plain = asdict(self.cfg)
            atomic.write_text(self.run_dir / "config.yaml", yaml.safe_dump(plain, sort_keys=False))
            atomic.write_json(
                self.run_dir / "env.json",
                {
                    "argv": sys.argv,
                    "python": platform.python_version(),
                    "torch": torch.__version__,
                    "platform": platform.platform(),
                    "git_revision": _git_revision(),
                    "world_size": self.info.world_size,
                    "backend": self.info.backend,
                    "device": str(self.info.device),
                },
            )
            if self.cfg.logger.wandb:
                self._start_wandb(plain)
        if self.cfg.resume:
            state = torch.load(self.checkpoint_path, map_location="cpu", weights_only=False)
            self.metrics.truncate_after(state["counters"]["step"])
            self.console(f"resuming {self.run_dir} at step {state['counters']['step']}")
        else:
            self.console(f"run dir {self.run_dir}")
        return state

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
            name=f"{self.cfg.task.name}-{self.cfg.compression.name}",
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
        if self.main and self.cfg.train.progress:
            from tqdm import tqdm

            self.progress = tqdm(
                total=total, initial=done, unit="step", dynamic_ncols=True, leave=False, file=sys.stderr
            )

    def log_step(self, record: dict[str, Any]) -> None:
        self.metrics.write(record)
        if self.progress is not None:
            self.progress.n = record["step"]
            self.progress.set_postfix(loss=f"{record['loss']:.3f}", ratio=f"{record['wire_ratio']:.0f}x", refresh=True)
        self.console(
            f"step {record['step']} epoch {record['epoch']:.2f} loss {record['loss']:.4f} lr {record['lr']:.4g} "
            f"density {record['density']:.4g} sent {_human_bytes(record['sent_bytes'])}/step "
            f"({record['wire_ratio']:.0f}x) compute {record['compute_s'] * 1e3:.0f}ms "
            f"compress {record['compress_s'] * 1e3:.1f}ms comm {record['communicate_s'] * 1e3:.1f}ms"
        )
        if self.wandb is not None:
            self.wandb.log({f"train/{k}": v for k, v in record.items() if k != "kind"}, step=record["step"])

    def log_eval(self, record: dict[str, Any]) -> None:
        self.metrics.write(record)
        shown = " ".join(f"{k} {v:.4g}" for k, v in record.items() if isinstance(v, float) and k != "epoch")
        self.console(f"eval step {record['step']} epoch {record['epoch']}: {shown}")
        if self.wandb is not None:
            self.wandb.log({f"eval/{k}": v for k, v in record.items() if k != "kind"}, step=record["step"])

    # -- checkpoints and the summary -----------------------------------------------------
    def save_checkpoint(self, state: dict[str, Any], step: int) -> None:
        atomic.write_with(self.checkpoint_path, lambda tmp: torch.save(state, tmp))

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
