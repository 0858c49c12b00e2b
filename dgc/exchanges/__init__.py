"""How the compressed tensors travel between workers: ``flat`` (the paper's), ``hierarchical``, ``sparse_allreduce``.

One module per exchange; each class registers itself in :data:`EXCHANGES` (every module of this package is
imported here), so a new exchange is one new module. Which compressor each carries: ``flat`` and
``hierarchical`` every one; ``sparse_allreduce`` the sparse ones (it reduces their selections at region owners).
"""

from __future__ import annotations

import importlib
import pkgutil

from dgc.comm import Comm
from dgc.exchanges.base import EXCHANGES, Exchange

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
globals().update({cls.__name__: cls for cls in EXCHANGES.values()})


def build_exchange(name: str, comm: Comm, ranks_per_node: int | None = None, local_bus: str = "auto") -> Exchange:
    """The exchange ``name`` over ``comm``'s workers (the topology's groups are made here: call on every rank);
    ``ranks_per_node`` and ``local_bus`` (:data:`dgc.localbus.LOCAL_BUSES`) are for ``hierarchical``."""
    return EXCHANGES.pick(name).build(comm, ranks_per_node, local_bus)


__all__ = ["EXCHANGES", "Exchange", "build_exchange", *(cls.__name__ for cls in EXCHANGES.values())]
