"""Wall time per phase of a gradient exchange."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class Phases:
    """Accumulates wall time per phase (compress / communicate / decompress).

    With ``cuda_sync`` the device is synchronized at phase boundaries so that the
    times mean something on CUDA (at the cost of the synchronization).
    """

    def __init__(self, cuda_sync: bool = False):
        self.cuda_sync = cuda_sync and torch.cuda.is_available()
        self.seconds: dict[str, float] = defaultdict(float)
        self.counters: dict[str, int] = defaultdict(int)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if self.cuda_sync:
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.cuda_sync:
                torch.cuda.synchronize()
            self.seconds[name] += time.perf_counter() - start
