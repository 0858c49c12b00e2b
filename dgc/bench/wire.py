"""``python -m dgc.bench wire``: bytes on the wire per step, every compressor, one real model.

The model (any torchvision classification model, built with ``weights=None``, so
nothing is downloaded) gives the real parameter shapes. For every compression preset of
``conf/compression/`` (:mod:`dgc.repro.presets`: what ``python -m dgc.train compression=<name>`` uses),
plus the variants ``dgc_int32`` (int32 indices), ``dgc_fp16`` (fp16 values) and ``dgc_rice``
(Rice-coded index gaps), each at its preset's own density (0.001 for DGC and top-k, 0.02 for SparseLoCo)
unless ``--density`` sets one for every sparse method, the preset's
:class:`dgc.GradientSync` and a :class:`dgc.SGD` (lr 0.1, momentum 0.9) run ``--steps`` steps in
this single process: no process group, world size 1, but the compressors still encode and decode
their messages and the communicator counts the bytes each would put into the collectives. The
gradients are seeded normal values, drawn afresh every step (the same sequence
for every compressor). ``opt.step()`` is never called: the weights do not matter.

Reported per compressor, from the last step's :class:`dgc.StepStats`:
``dense_bytes`` (fp32 size of the whole gradient), ``sent_bytes``, ``wire_ratio``
(their quotient, the paper's compression ratio), ``values_sent`` and
``compressed_numel`` (values handled by the compressor; the rest go dense).
"""

from __future__ import annotations

import argparse
import functools
import time
from typing import Any

import torch

import dgc
from dgc.bench.common import (
    BenchError,
    configuration,
    configurations,
    density_arg,
    emit,
    finite,
    int_arg,
    log,
    non_default,
    positive_int_arg,
    run_info,
)


@functools.cache
def classification_models() -> tuple[str, ...]:
    import torchvision

    return tuple(torchvision.models.list_models(module=torchvision.models))


def model_arg(text: str) -> str:
    names = classification_models()
    if text not in names:
        raise argparse.ArgumentTypeError(
            f"unknown torchvision classification model {text!r}; valid: {', '.join(names)}"
        )
    return text


def compressors_arg(text: str) -> list[str]:
    valid = list(configurations())
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in valid]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown compressor {', '.join(unknown) or text!r}; valid: {','.join(valid)}")
    return list(dict.fromkeys(names))


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "wire",
        help="bytes sent per step by every compressor on a torchvision model's gradient",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model", type=model_arg, default="resnet50", help="torchvision classification model (default: resnet50)"
    )
    p.add_argument(
        "--density",
        type=density_arg,
        default=None,
        help="one density, in (0, 1], for every sparse compressor (default: each preset's own: 0.001 for DGC and "
        "top-k, 0.02 for SparseLoCo)",
    )
    p.add_argument("--seed", type=int_arg, default=0, help="seed of the model and the gradients (default: 0)")
    p.add_argument("--steps", type=positive_int_arg, default=3, help="steps per compressor; the last is reported")
    p.add_argument(
        "--compressors",
        type=compressors_arg,
        default=None,
        help=f"comma-separated subset of: {','.join(configurations())} (default: all)",
    )
    p.add_argument("--out", default="runs/bench/wire.json", help="JSON output (default: %(default)s)")
    return p


def build_model(name: str, seed: int = 0) -> torch.nn.Module:
    import torchvision

    if name not in classification_models():
        raise BenchError(
            f"unknown torchvision classification model {name!r}; valid: {', '.join(classification_models())}"
        )
    torch.manual_seed(seed)
    return torchvision.models.get_model(name, weights=None)


def model_numel(model: torch.nn.Module) -> dict[str, int]:
    params = [p for p in model.parameters() if p.requires_grad]
    matrix = sum(p.numel() for p in params if p.dim() > 1)
    total = sum(p.numel() for p in params)
    return {
        "numel": total,
        "numel_dim_gt1": matrix,
        "numel_rest": total - matrix,
        "tensors": len(params),
        "tensors_dim_gt1": sum(1 for p in params if p.dim() > 1),
    }


def fill_grads(params: list[torch.nn.Parameter], gen: torch.Generator) -> None:
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)


def single_process_sync(model: torch.nn.Module, name: str, density: float | None):  # noqa: ANN201
    """Configuration ``name``'s compressor, its :class:`dgc.GradientSync` on ``model`` (world size 1, a
    :class:`dgc.SGD` bound to it for DGC's momentum) and the parameters it exchanges."""
    spec = configuration(name, density)
    comp = dgc.build_compressor(spec.compression)
    sync = dgc.GradientSync.from_config(spec.sync, model, comp)
    dgc.SGD(model.parameters(), sync, lr=0.1, momentum=0.9)  # gives dgc its momentum
    return comp, sync, [p for _, p in sync.params]


def measure(model: torch.nn.Module, name: str, density: float | None, seed: int = 0, steps: int = 3) -> dict[str, Any]:
    """Run ``steps`` exchanges of configuration ``name``; the last step's numbers."""
    spec = configuration(name, density)
    comp, sync, params = single_process_sync(model, name, density)
    gen = torch.Generator().manual_seed(seed)
    started = time.perf_counter()
    for _ in range(steps):
        fill_grads(params, gen)
        stats = sync.step()
    seconds = time.perf_counter() - started
    for p in params:
        p.grad = None
    return {
        "compressor": comp.name,
        "options": non_default(spec.compression),
        "policy": non_default(spec.sync.policy),
        "dense_bytes": stats.dense_bytes,
        "sent_bytes": stats.sent_bytes,
        "recv_bytes": stats.recv_bytes,
        "wire_ratio": finite(stats.wire_ratio),
        "bytes_per_value": stats.sent_bytes / (stats.dense_bytes / 4),
        "values_sent": stats.values_sent,
        "compressed_numel": stats.compressed_numel,
        "collectives": stats.collectives,
        "density": stats.density,
        "counters": stats.counters,
        "seconds_per_step": seconds / steps,
    }


def bench_wire(
    model: str = "resnet50",
    density: float | None = None,
    seed: int = 0,
    steps: int = 3,
    compressors: list[str] | None = None,
) -> dict[str, Any]:
    """Run the benchmark and return its result (see the module docstring)."""
    names = compressors or list(configurations())
    unknown = [n for n in names if n not in configurations()]
    if unknown:
        raise BenchError(f"unknown compressor {', '.join(unknown)}; valid: {','.join(configurations())}")
    log(f"wire: building {model} (weights=None)")
    net = build_model(model, seed)
    result: dict[str, Any] = {
        **run_info("wire", "cpu"),
        "model": model,
        "density": density,
        "seed": seed,
        "steps": steps,
        "world_size": 1,
        **model_numel(net),
        "compressors": {},
    }
    for name in names:
        row = measure(net, name, density, seed, steps)
        result["compressors"][name] = row
        log(
            f"  {name}: sent {row['sent_bytes']} of {row['dense_bytes']} bytes, "
            f"ratio {row['wire_ratio']:.1f}, {row['seconds_per_step']:.2f} s/step"
        )
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    result = bench_wire(args.model, args.density, args.seed, args.steps, args.compressors)
    emit(result, args.out)
    return result
