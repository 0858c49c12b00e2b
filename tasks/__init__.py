"""Tasks: models, data and metrics of the paper's experiments (installed as ``dgc.tasks``).

``build_task(cfg, info)`` picks the task family from ``cfg.task.kind``.
"""

from __future__ import annotations

import importlib

from dgc.tasks.base import Task

from dgc.distributed import DistInfo
from dgc.repro.config import Config

#: task family -> "module:class", imported on use
TASK_KINDS = {
    "image": "dgc.tasks.classification:ImageClassification",
    "language": "dgc.tasks.language_modeling:LanguageModeling",
    "speech": "dgc.tasks.speech_recognition:SpeechRecognition",
}


def build_task(cfg: Config, info: DistInfo) -> Task:
    kind = cfg.task.kind
    if kind not in TASK_KINDS:
        raise ValueError(f"unknown task kind {kind!r}; valid: {', '.join(TASK_KINDS)}")
    module, cls = TASK_KINDS[kind].split(":")
    return getattr(importlib.import_module(module), cls)(cfg, info)


__all__ = ["TASK_KINDS", "Task", "build_task"]
