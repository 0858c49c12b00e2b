"""``python -m dgc.bench ops``: what one gradient exchange costs a GPU in launches and host synchronizations.

On a GPU each ATen operation is (at least) one kernel launch, a few microseconds of host time each, and each
operation whose result the host must read (a Python scalar, or an output whose size depends on the data)
drains the stream. This benchmark counts both for one ``sync.step()`` of a compression preset on a
torchvision model's real parameter shapes, on the CPU, so that the count is known on machines without a
GPU: a :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees every ATen operation dispatched
inside the step.

* ``ops``: every operation dispatched (views included: each is a dispatcher round trip; ``views`` counts
  them apart);
* ``host_syncs``: the operations that wait for the device on CUDA: ``aten._local_scalar_dense`` (``.item()``,
  ``int(t)``, ``bool(t)``), data-dependent output sizes (``nonzero``, ``masked_select``, boolean indexing,
  ``unique``, ``repeat_interleave`` without an output size, ``bincount``), comparisons returning a bool
  (``equal``, ``is_nonzero``), plus calls of ``Tensor.tolist`` / ``Tensor.numpy`` / ``Tensor.cpu`` (which a
  CPU tensor answers without a dispatch);
* ``by_op``: the count of each operation, most frequent first (where to look).

The native CPU kernel (:mod:`dgc.kernels`) is switched off by default (``--kernels off``): its path is the
CPU's, and CUDA tensors take the PyTorch path counted here. Two steps run first (buffers, first-call work);
the third is counted. World size 1: no process group, but the compressors encode and decode their messages
as they would on N ranks.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dgc import kernels
from dgc.bench.common import BenchError, configurations, density_arg, emit, log, run_info
from dgc.bench.wire import build_model, fill_grads, model_arg, single_process_sync

#: ATen operations that make the host wait for the device on CUDA (by overload packet name)
SYNCING = frozenset(
    {
        "_local_scalar_dense", "nonzero", "nonzero_static", "masked_select", "unique", "_unique", "_unique2",
        "unique_consecutive", "unique_dim", "bincount", "equal", "is_nonzero", "allclose", "_assert_async",
        "argwhere", "nonzero_numpy",
    }
)  # fmt: skip
#: Tensor methods that read values on the host and that a CPU tensor answers without a dispatch (``item`` is
#: seen as ``_local_scalar_dense``)
HOST_READS = ("tolist", "numpy", "cpu")
DEFAULT_MODELS = ("resnet50", "resnet101")
DEFAULT_METHODS = ("dgc", "terngrad", "qsgd", "powersgd")


class Counter(TorchDispatchMode):
    """Counts the ATen operations dispatched while active, and those that synchronize the host."""

    def __init__(self) -> None:
        super().__init__()
        self.by_op: collections.Counter[str] = collections.Counter()
        self.syncs: collections.Counter[str] = collections.Counter()
        self.views = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        name = func.overloadpacket.__name__
        self.by_op[name] += 1
        if name in SYNCING or _data_dependent(name, args, kwargs or {}):
            self.syncs[name] += 1
        if func.is_view:
            self.views += 1
        return func(*args, **(kwargs or {}))


def _data_dependent(name: str, args: tuple, kwargs: dict) -> bool:
    """Boolean-mask indexing and ``repeat_interleave`` without ``output_size`` size their output from the data."""
    if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())
    if name == "repeat_interleave":
        return kwargs.get("output_size") is None and not (len(args) > 3 and args[3] is not None)
    return False


@contextlib.contextmanager
def host_reads() -> Iterator[collections.Counter[str]]:
    """Count calls of :data:`HOST_READS` (made from Python) while the block runs."""
    seen: collections.Counter[str] = collections.Counter()
    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def counting(name: str, method: Any) -> Any:
        def wrapper(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            seen[name] += 1
            return method(self, *args, **kwargs)

        return wrapper

    for name, method in saved.items():
        setattr(torch.Tensor, name, counting(name, method))
    try:
        yield seen
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


def buckets(params: list[torch.nn.Parameter], bucket_mb: float,
            first_mb: float = 1.0) -> list[list[torch.nn.Parameter]]:  # fmt: skip
    """``params`` in the parts DDP hands its communication hook once it has rebuilt its buckets after the first
    step: in reverse order (the order backward makes the gradients in), the first part closed once it holds
    ``first_mb`` MiB (DDP's first bucket, 1 MiB), each later one at ``bucket_mb`` (``bucket_cap_mb``, 25 by
    default)."""
    cap, parts, part, size = min(first_mb, bucket_mb) * 2**20, [], [], 0
    for p in reversed(params):
        part.append(p)
        size += p.numel() * p.element_size()
        if size >= cap:
            parts.append(part)
            part, size, cap = [], 0, bucket_mb * 2**20
    return parts + ([part] if part else [])


def count_step(model: torch.nn.Module, name: str, density: float | None, seed: int = 0,
               bucket_mb: float | None = None) -> dict[str, Any]:  # fmt: skip
    """The operations and host synchronizations of the third step of configuration ``name``: one ``sync.step()``,
    or with ``bucket_mb`` the step in parts as the overlapped DDP hook takes it (``sync.begin()``, one
    ``sync.sync_part()`` per bucket of :func:`buckets`, ``sync.end()``)."""
    comp, sync, params = single_process_sync(model, name, density)
    parts = buckets(params, bucket_mb) if bucket_mb else None

    def step() -> None:
        if parts is None:
            sync.step()
            return
        open_step = sync.begin()
        for part in parts:
            sync.sync_part(open_step, [(p, p.grad) for p in part])
        sync.end(open_step)

    gen = torch.Generator().manual_seed(seed)
    for _ in range(2):
        fill_grads(params, gen)
        step()
    fill_grads(params, gen)
    counter = Counter()
    with host_reads() as reads, counter:
        step()
    for p in params:
        p.grad = None
    syncs = sum(counter.syncs.values()) + sum(reads.values())
    return {
        "compressor": comp.name,
        "tensors": len(params),
        **({"bucket_mb": bucket_mb, "parts": len(parts)} if parts is not None else {}),
        "ops": sum(counter.by_op.values()),
        "views": counter.views,
        "host_syncs": syncs,
        "syncs_by_op": dict(counter.syncs.most_common()),
        "host_reads": dict(reads.most_common()),
        "by_op": dict(counter.by_op.most_common()),
    }


def bench_ops(
    models: tuple[str, ...] = DEFAULT_MODELS,
    methods: tuple[str, ...] = DEFAULT_METHODS,
    density: float | None = None,
    use_kernels: bool = False,
    seed: int = 0,
    bucket_mb: float | None = None,
) -> dict[str, Any]:
    unknown = [m for m in methods if m not in configurations()]
    if unknown:
        raise BenchError(f"unknown method {', '.join(unknown)}; valid: {','.join(configurations())}")
    result: dict[str, Any] = {
        **run_info("ops", "cpu"),
        "density": density,
        "kernels": use_kernels and kernels.available(),
        "world_size": 1,
        "bucket_mb": bucket_mb,
        "models": {},
    }
    off = contextlib.nullcontext() if use_kernels else kernels.disabled()
    with off:
        for model_name in models:
            log(f"ops: building {model_name} (weights=None)")
            model = build_model(model_name, seed)
            rows = result["models"][model_name] = {}
            for method in methods:
                rows[method] = row = count_step(model, method, density, seed)
                log(f"  {model_name} {method}: {row['ops']} operations, {row['host_syncs']} host syncs "
                    f"({row['tensors']} tensors)")  # fmt: skip
                if bucket_mb:
                    parts = count_step(model, method, density, seed, bucket_mb)
                    kept = ("bucket_mb", "parts", "ops", "views", "host_syncs", "by_op")
                    row["in_parts"] = {k: parts[k] for k in kept}
                    log(f"  {model_name} {method} in {parts['parts']} parts of {bucket_mb:g} MiB (the overlapped "
                        f"hook): {parts['ops']} operations, {parts['host_syncs']} host syncs")  # fmt: skip
    if len(models) > 1:
        first, last = models[0], models[-1]
        result["growth"] = {
            m: {k: result["models"][last][m][k] / max(1, result["models"][first][m][k]) for k in ("ops", "host_syncs")}
            for m in methods
        }
    return result


def _names(text: str) -> tuple[str, ...]:
    names = tuple(n for n in text.split(",") if n)
    if not names:
        raise argparse.ArgumentTypeError("give at least one name")
    return names


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of MiB, got {text!r}")
    return value


def _models(text: str) -> tuple[str, ...]:
    return tuple(model_arg(n) for n in _names(text))


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "ops",
        help="ATen operations and host synchronizations of one gradient exchange (what a GPU pays per step)",
        description=__doc__.splitlines()[0],
    )
    p.add_argument("--models", type=_models, default=DEFAULT_MODELS,
                   help=f"comma-separated torchvision models (default: {','.join(DEFAULT_MODELS)})")  # fmt: skip
    p.add_argument("--methods", type=_names, default=DEFAULT_METHODS,
                   help=f"comma-separated compression presets (default: {','.join(DEFAULT_METHODS)})")  # fmt: skip
    p.add_argument("--density", type=density_arg, default=None,
                   help="one density for every sparse method (default: each preset's own)")  # fmt: skip
    p.add_argument("--kernels", choices=("off", "on"), default="off",
                   help="the native CPU kernel (default: off, the path CUDA tensors take)")  # fmt: skip
    p.add_argument("--bucket-mb", type=_positive, default=None,
                   help="also count the step in DDP buckets of this many MiB (the first 1 MiB), as the "
                        "overlapped hook takes it (DDP's default: 25); default: not counted")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/bench/ops.json", help="result file (default: %(default)s)")
    return p


def run(args: argparse.Namespace) -> dict[str, Any]:
    result = bench_ops(args.models, args.methods, args.density, args.kernels == "on", args.seed, args.bucket_mb)
    emit(result, args.out)
    return result
