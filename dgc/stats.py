"""What one gradient exchange did, as one worker saw it: :class:`StepStats`."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class StepStats:
    """What one exchange did, from this worker's point of view."""

    step: int
    epoch: float
    density: float
    dense_bytes: int  # fp32 size of the whole gradient
    sent_bytes: int  # bytes this worker put into collectives
    recv_bytes: int
    collectives: int
    #: of ``sent_bytes``, what the tensors the policy leaves dense took (allreduce, or the 1-bit allgather)
    dense_sent_bytes: int = 0
    values_sent: int = 0
    compressed_numel: int = 0
    compress_s: float = 0.0
    communicate_s: float = 0.0
    decompress_s: float = 0.0
    counters: dict[str, int] = field(default_factory=dict)
    #: some worker's gradient was not finite: nothing was exchanged or accumulated, the gradients are zero
    skipped: bool = False
    #: what any worker requested before this step (:meth:`GradientSync.request`), agreed by all
    requests: tuple[str, ...] = ()
    #: the agreement on non-finite gradients and requests (one byte per flag; not part of ``sent_bytes``)
    control_bytes: int = 0
    #: bytes this worker put on its machine's local bus (exchange=hierarchical; not part of ``sent_bytes``)
    local_bytes: int = 0

    @property
    def wire_ratio(self) -> float:
        return self.dense_bytes / self.sent_bytes if self.sent_bytes else math.inf

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["wire_ratio"] = self.wire_ratio
        return out
