"""Time one ``sync.step()`` of a compressor on a torchvision model's shapes, in whichever ``dgc`` is importable.

Only the public API that every commit since November 2026 has (``dgc.build_compressor``, ``dgc.GradientSync``,
``dgc.SGD``, ``StepStats.compress_s``) is used, so the same harness times an older commit: put its tree first on
``PYTHONPATH`` (``tools/time-commits.sh`` does, alternating commits round by round). World size 1 with the
default policy and the non-finite guard on (the library's defaults); fresh normal gradients each step (drawn
untimed). Prints one JSON line: the median and minimum of the whole step and of its compress phase, in ms.

    python tools/time_step.py --model resnet50 --method dgc --density 0.001 --threads 1 --steps 9
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torchvision

import dgc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet50")
    p.add_argument("--method", default="dgc")
    p.add_argument("--density", type=float, default=0.001)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=9, help="timed steps (after 2 untimed ones)")
    p.add_argument("--clip-norm", type=float, default=None, help="local clipping (the paper's DGC clips; default off)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = torchvision.models.get_model(args.model, weights=None)
    options = {"density": args.density} if args.method in ("dgc", "topk") else {}
    sync = dgc.GradientSync(model, dgc.build_compressor(args.method, **options), clip_norm=args.clip_norm)
    dgc.SGD(model.parameters(), sync, lr=0.1, momentum=0.9)
    params = [q for q in model.parameters() if q.requires_grad]
    gen = torch.Generator().manual_seed(1)
    step_ms, compress_ms = [], []
    for i in range(args.steps + 2):
        for q in params:
            q.grad = torch.randn(q.shape, generator=gen)
        sync.set_epoch(10.0)  # after any warm-up
        start = time.perf_counter()
        stats = sync.step()
        elapsed = time.perf_counter() - start
        if i >= 2:
            step_ms.append(1e3 * elapsed)
            compress_ms.append(1e3 * stats.compress_s)
    print(json.dumps({
        "dgc": dgc.__file__, "model": args.model, "method": args.method, "threads": args.threads,
        "clip_norm": args.clip_norm,
        "step_ms": statistics.median(step_ms), "step_min_ms": min(step_ms),
        "compress_ms": statistics.median(compress_ms), "compress_min_ms": min(compress_ms),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
