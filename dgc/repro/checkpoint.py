"""Checkpoint files: the last two kept, written atomically, read safely, checked before use.

``checkpoint.pt`` is the latest, ``checkpoint.prev.pt`` the one before: a save writes the new one to a
temporary file, links the latest as ``.prev`` and renames the new one to the latest, so a crash or a full disk
at any moment leaves the complete checkpoints there were (:func:`save`; :func:`recover` cleans up after one).
Reading uses ``torch.load(weights_only=True)``:
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
    """Write ``state`` as the latest checkpoint, keeping the previous one.

    The new file is written and flushed to disk under a temporary name; then the latest is hard-linked as the
    previous (the latest stays in place), and the new file renamed over the latest. At every moment
    ``checkpoint.pt`` is a complete checkpoint; a stop between the two renames leaves the new one complete
    under its temporary name, which :func:`recover` finishes at the next start."""
    latest = run_dir / LATEST

    def keep_previous() -> None:  # once the new checkpoint is complete, the latest becomes the previous too
        if latest.exists():
            link = run_dir / f".{PREVIOUS}.{os.getpid()}.link"
            link.unlink(missing_ok=True)
            os.link(latest, link)
            os.replace(link, run_dir / PREVIOUS)

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            try:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            except (OSError, RuntimeError) as exc:  # torch's zip writer reports a full disk as a RuntimeError
                if getattr(exc, "errno", None) == errno.ENOSPC or _full(run_dir):  # (before the partial file goes)
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), tmp) from None
                raise

    try:
        return atomic.write_with(latest, write, before_replace=keep_previous)
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


def nonfinite(state: Mapping[str, Any], limit: int = 3) -> list[str]:
    """Where a checkpoint's state is not finite: the names (at most ``limit``) of the floating-point tensors of
    its weights, optimizer state and every rank's state (compression, local weights, BatchNorm statistics) that
    hold a NaN or an infinity. A checkpoint with any is never written, and refused on resume."""
    found: list[str] = []

    def visit(obj: Any, name: str) -> None:
        if len(found) >= limit:
            return
        if isinstance(obj, torch.Tensor):
            if obj.is_floating_point() and not bool(torch.isfinite(obj).all()):
                found.append(name)
        elif isinstance(obj, Mapping):
            for key, value in obj.items():
                visit(value, f"{name}.{key}" if name else str(key))
        elif isinstance(obj, (list, tuple)):
            for i, value in enumerate(obj):
                visit(value, f"{name}[{i}]")

    for key in ("model", "optimizer", "ranks"):
        visit(state.get(key), key)
    return found


def leftovers(run_dir: Path) -> list[Path]:
    """Temporary files of writes a stop cut short (:mod:`dgc.atomic`'s ``.<name>.*.tmp``, the previous
    checkpoint's link, the lock files of older versions)."""
    return sorted(
        p for p in run_dir.glob(".*")
        if p.is_file() and (p.name.endswith(".tmp") or p.name.startswith(f".{PREVIOUS}.") and p.name.endswith(".link"))
    )  # fmt: skip


def recover(run_dir: Path) -> list[str]:
    """At a start, under the run's lock: finish a checkpoint a stop left complete under its temporary name (newer
    than the latest: the stop came between its two renames), remove every other leftover; one warning each."""
    warnings = []
    found = leftovers(run_dir)
    pending = [p for p in found if p.name.startswith(f".{LATEST}.") and p.name.endswith(".tmp")]
    complete = None
    if pending:  # (loading checkpoints only after a stop that left one)
        steps = {p: _step_of(p) for p in pending}
        best = max((p for p in pending if steps[p] is not None), key=lambda p: steps[p], default=None)
        latest = run_dir / LATEST
        latest_step = _step_of(latest) if latest.exists() else None
        if best is not None and (latest_step is None or steps[best] > latest_step):
            if latest_step is not None:  # a readable latest becomes the previous, as the save would have made it
                os.replace(latest, run_dir / PREVIOUS)
            os.replace(best, latest)
            complete = best
            warnings.append(f"finished the checkpoint of step {steps[best]} that a stop left under {best.name}")
    removed = [p for p in found if p != complete and p.exists()]
    if removed:
        size = sum(p.stat().st_size for p in removed)
        for p in removed:
            p.unlink(missing_ok=True)
        names = ", ".join(p.name for p in removed[:3]) + (", ..." if len(removed) > 3 else "")
        warnings.append(f"removed {len(removed)} unfinished temporary file(s) of an earlier stop ({names}; "
                        f"{size / 2**20:.1f} MB) from {run_dir}")  # fmt: skip
    return warnings


def _step_of(path: Path) -> int | None:
    """The step a checkpoint file was written at; None when it is not a complete checkpoint."""
    try:
        return int(load(path)["counters"]["step"])
    except (ValueError, KeyError, TypeError):
        return None


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
