"""Tasks: models, data and metrics of the paper's experiments (installed as ``dgc.tasks``).

``build_task(cfg, info)`` picks the task family from ``cfg.task.kind``. The tasks sit below the reproduction
framework: they read its run config (:class:`dgc.repro.config.Config`, a type only) and never import
:mod:`dgc.repro` at run time, which imports them (``dgc.repro.trainer``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dgc.tasks.base import Task

from dgc.distributed import DistInfo
from dgc.registry import Registry

if TYPE_CHECKING:
    from dgc.repro.config import Config

#: task families by ``task.kind``, each imported on first use (their modules import data and model code)
TASK_KINDS: Registry[type[Task]] = Registry("task kind")
TASK_KINDS.lazy("image", "dgc.tasks.classification:ImageClassification")
TASK_KINDS.lazy("language", "dgc.tasks.language_modeling:LanguageModeling")
TASK_KINDS.lazy("speech", "dgc.tasks.speech_recognition:SpeechRecognition")
TASK_KINDS.lazy("causal_lm", "dgc.tasks.causal_lm:CausalLM")


def build_task(cfg: Config, info: DistInfo) -> Task:
    return TASK_KINDS.pick(cfg.task.kind)(cfg, info)


__all__ = ["TASK_KINDS", "Task", "build_task"]
