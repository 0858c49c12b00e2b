"""Catch, on the CPU, the tensors that would fail under NCCL (tests only).

Under ``init_process_group("nccl")`` a collective given a CPU tensor raises "No backend type associated
with device type cpu". On a CPU-only machine the gradients are CPU tensors too, so that failure cannot
happen here; its cause can be seen: a tensor that the library builds from Python values without saying
on which device, i.e. on the CPU whatever device the gradients are on. :class:`HostTensorGuard` records
every such factory call (``torch.tensor``, ``zeros``, ``empty``, ``full``, ``arange``, ...) made from a
file of the ``dgc`` package while it is active; a host value built on purpose says ``device="cpu"``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

import dgc

DGC = str(Path(dgc.__file__).resolve().parent)
FACTORIES = {
    torch.tensor, torch.as_tensor, torch.empty, torch.zeros, torch.ones, torch.full, torch.arange, torch.eye,
    torch.linspace, torch.rand, torch.randn, torch.randint, torch.randperm, torch.empty_strided,
}  # fmt: skip


class HostTensorGuard(TorchFunctionMode):
    """``with HostTensorGuard() as guard:`` ... ``guard.found``: ``file:line torch.f`` of each factory call
    without ``device=`` made from the ``dgc`` package."""

    def __init__(self, report: str | None = None) -> None:
        super().__init__()
        self.found: list[str] = []
        self.report = report  # a file each finding is appended to at once (workers leave with os._exit)

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None:
            frame = sys._getframe(1)  # the caller: factories are C functions, with no frame of their own
            path = frame.f_code.co_filename
            if path.startswith(DGC):
                where = f"dgc{path[len(DGC) :]}:{frame.f_lineno} torch.{func.__name__}"
                if where not in self.found:
                    self.found.append(where)
                    if self.report:
                        with open(self.report, "a") as f:
                            f.write(where + "\n")
        return func(*args, **kwargs)


#: a ``sitecustomize`` that puts every Python process started with it on ``PYTHONPATH`` under the guard,
#: reporting to ``$DGC_TEST_GUARD_REPORT`` (the trainer's workers, under its launcher or torchrun)
SITECUSTOMIZE = """
import os, sys
sys.path.insert(0, {root!r})
from tests.devices import HostTensorGuard
HostTensorGuard(report=os.environ["DGC_TEST_GUARD_REPORT"]).__enter__()
with open(os.environ["DGC_TEST_GUARD_REPORT"] + ".pids", "a") as f:  # who ran under it
    f.write(f"{{os.getpid()}}\\n")
"""
