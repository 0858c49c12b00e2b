"""DGC where users already train: PyTorch Lightning (:mod:`dgc.integrations.lightning`) and Hugging Face
Accelerate (:mod:`dgc.integrations.accelerate`), each an optional extra (``pip install 'dgc[lightning]'``,
``'dgc[accelerate]'``). Both keep every rank's compression state in the framework's own checkpoints through
:class:`~dgc.integrations.state.EveryRank`."""

from dgc.integrations.state import EveryRank

__all__ = ["EveryRank"]
