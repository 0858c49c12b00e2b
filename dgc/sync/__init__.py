"""The gradient sync: the layer above the exchanges and compressors that every step enters.

* :mod:`dgc.sync.gradient_sync`: :class:`GradientSync`, the step (one shape, given whole or in parts);
* :mod:`dgc.sync.agreement`: the workers' agreement on non-finite gradients and requests, and its strategies;
* :mod:`dgc.sync.step`: the record of an open step, the optimizer's hyperparameters as data, state copies to undo;
* :mod:`dgc.sync.config`: :class:`SyncConfig` (the ``sync`` config) and the checks of the sync's options.
"""

from dgc.sync.agreement import AGREEMENT_BYTES, REQUESTS
from dgc.sync.config import ACCUMULATE, CLIP_SCOPES, PACKS, SyncConfig
from dgc.sync.gradient_sync import GradientSync

__all__ = ["ACCUMULATE", "AGREEMENT_BYTES", "CLIP_SCOPES", "PACKS", "REQUESTS", "GradientSync", "SyncConfig"]
