"""Checkpoint files: the last two kept, written atomically, read safely, checked before use.

``checkpoint.pt`` is the latest, ``checkpoint.prev.pt`` the one before: a save writes the new one to a
temporary file, renames the latest to ``.prev`` and the new one to the latest, so a crash or a full disk
at any moment leaves the complete checkpoints there were. Reading uses ``torch.load(weights_only=True)``:
a checkpoint holds tensors and plain containers only, and one that needs anything else (a pickled
callable, say) is refused without running it. :func:`choose` returns the newest readable checkpoint and
says why it skipped the latest.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from dgc import atomic
from dgc.repro.config import ConfigError

LATEST, PREVIOUS = "checkpoint.pt", "checkpoint.prev.pt"
#: what every checkpoint holds (see :meth:`dgc.repro.trainer.Trainer.checkpoint`)
KEYS = ("model", "optimizer", "counters", "last_eval", "world_size", "ranks", "config")


def paths(run_dir: Path) -> list[Path]:
    """The checkpoint files, newest first (those that exist)."""
    return [p for p in (run_dir / LATEST, run_dir / PREVIOUS) if p.exists()]


def save(run_dir: Path, state: dict[str, Any]) -> Path:
    """Write ``state`` as the latest checkpoint, keeping the previous one."""
    latest = run_dir / LATEST

    def keep_previous() -> None:  # once the new checkpoint is complete, the latest becomes the previous
        if latest.exists():
            os.replace(latest, run_dir / PREVIOUS)

    try:
        return atomic.write_with(latest, lambda tmp: torch.save(state, tmp), before_replace=keep_previous)
    except (OSError, RuntimeError) as exc:  # torch.save's zip writer reports a full disk as a RuntimeError
        if getattr(exc, "errno", None) == errno.ENOSPC or _full(run_dir):
            kept = ", ".join(p.name for p in paths(run_dir)) or "none"
            raise ConfigError(
                f"no space left on the device of {run_dir} while writing {LATEST} (checkpoints kept: {kept}); "
                "free space there, then run the same command with resume=auto"
            ) from None
        raise


def _full(folder: Path, margin: int = 1 << 20) -> bool:
    """Less than ``margin`` bytes free where ``folder`` lives."""
    try:
        st = os.statvfs(folder)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < margin


def load(path: Path) -> dict[str, Any]:
    """A checkpoint's contents; a ValueError (one line) when it cannot be used."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        refused = next((line for line in lines if "GLOBAL" in line), None)
        if refused:
            raise ValueError(f"holds objects other than tensors and plain containers ({refused}); refused") from None
        boilerplate = ("Weights only load failed", "Please file an issue", "Check the documentation")
        detail = next((line for line in lines if not line.startswith(boilerplate)), "not a checkpoint file")
        raise ValueError(f"is unreadable ({detail})") from None
    except (RuntimeError, EOFError, OSError, ValueError, AttributeError, IndexError) as exc:
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else "the file ends early"
        raise ValueError(f"is unreadable ({type(exc).__name__}: {detail})") from None
    missing = [k for k in KEYS if not isinstance(state, Mapping) or k not in state]
    if missing:
        raise ValueError(f"is not a dgc checkpoint (no {', '.join(missing)})")
    return dict(state)


def choose(run_dir: Path) -> tuple[Path | None, dict[str, Any] | None, list[str]]:
    """The newest usable checkpoint, its contents, and one warning per newer file that was not usable."""
    warnings = []
    for path in paths(run_dir):
        try:
            return path, load(path), warnings
        except ValueError as exc:
            warnings.append(f"{path} {exc}")
    return None, None, warnings


#: settings that may change between a run and its resumption without changing the trajectory
FREE_TO_CHANGE = ("resume", "resume_allow", "run_dir", "timeout_s", "train.progress", "train.log_every",
                  "train.checkpoint_every", "train.checkpoint_minutes", "train.max_steps", "train.test_eval",
                  "logger.")  # fmt: skip


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def default_of(cfg: Any, key: str) -> Any:
    """The schema default of the dotted setting ``key`` of the dataclass config ``cfg`` (MISSING: none)."""
    *path, name = key.split(".")
    obj = cfg
    for part in path:
        obj = getattr(obj, part, None)
    if not dataclasses.is_dataclass(obj):
        return dataclasses.MISSING
    for f in dataclasses.fields(obj):
        if f.name == name:
            return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    return dataclasses.MISSING


def changed_settings(saved: Mapping[str, Any], now: Mapping[str, Any], allow: list[str], cfg: Any = None) -> list[str]:
    """``key: old -> new`` for every setting that differs and is neither free to change nor in ``allow``. With the
    run's dataclass config ``cfg``, a setting the checkpoint does not have (an option added since it was written)
    is no change while it keeps its default: new options default to what the code did before them."""
    old, new = flatten(saved), flatten(now)
    free = (*FREE_TO_CHANGE, *allow)
    out = []
    for key in sorted(set(old) | set(new)):
        if old.get(key) == new.get(key) or any(key == f or (f.endswith(".") and key.startswith(f)) or
                                               key.startswith(f + ".") for f in free):  # fmt: skip
            continue
        if key not in old and cfg is not None and new[key] == default_of(cfg, key):
            continue
        out.append(f"{key}: {old.get(key, '(absent)')!r} -> {new.get(key, '(absent)')!r}")
    return out
