"""What DGC's compressor holds at a run's last checkpoint: per compressed tensor, the norms of the weights, of
the momentum-corrected velocity ``u`` and of the residual ``v`` that waits to be sent (the paper's notation),
averaged over the ranks.

    python -m dgc.repro.residual results/runs/cpu-speech/dgc-w1-c400-s0

``|v| / |u|`` says how many steps' worth of velocity the residual holds (the longer values wait, the larger);
``max / median`` of ``|v|`` says how far the largest residual values stand above the rest (near 1: the
selection is close to picking at random); ``lr |v| / |w|`` is how far the waiting residual would move the
weights at the current learning rate, relative to their size.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dgc.repro import checkpoint


def _tensors(rank_state: dict) -> dict[str, dict]:
    return rank_state.get("compression", {}).get("compressor", {}).get("tensors", {})


def summarize(state: dict) -> tuple[list[dict], dict]:
    """One row per compressed tensor (norms averaged over the ranks) and the totals over all of them."""
    ranks = state["ranks"]
    names = [n for n, t in _tensors(ranks[0]).items() if "u" in t and "v" in t]
    if not names:
        raise ValueError("the checkpoint holds no DGC velocity and residual (compression=dgc runs only)")
    lr = float(state["optimizer"]["param_groups"][0]["lr"])
    rows, sq = [], {"w": 0.0, "u": 0.0, "v": 0.0}
    for name in names:
        w = state["model"][name].float()
        wn = w.norm().item()
        us = [_tensors(r)[name]["u"].float() for r in ranks]
        vs = [_tensors(r)[name]["v"].float() for r in ranks]
        u = sum(x.norm().item() for x in us) / len(us)
        v = sum(x.norm().item() for x in vs) / len(vs)
        spread = sum((x.abs().max() / x.abs().median().clamp_min(1e-30)).item() for x in vs) / len(vs)
        rows.append({"tensor": name, "numel": w.numel(), "w": wn, "u": u, "v": v,
                     "v_over_u": v / u if u else float("inf"), "max_over_median": spread})  # fmt: skip
        for key, value in (("w", wn), ("u", u), ("v", v)):
            sq[key] += value**2
    total = {k: x**0.5 for k, x in sq.items()}
    total.update(lr=lr, ranks=len(ranks), step=state["counters"]["step"],
                 v_over_u=total["v"] / total["u"] if total["u"] else float("inf"),
                 lr_v_over_w=lr * total["v"] / total["w"] if total["w"] else float("inf"))  # fmt: skip
    return rows, total


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dgc.repro.residual", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="a DGC run's directory (with checkpoint.pt)")
    args = parser.parse_args(argv)
    try:
        path, state, warnings = checkpoint.choose(args.run_dir)
        if state is None:
            why = f": {warnings[-1]}" if warnings else ""
            raise ValueError(f"no usable checkpoint.pt or checkpoint.prev.pt in {args.run_dir}{why}")
        rows, total = summarize(state)
    except (OSError, ValueError, KeyError) as exc:
        sys.exit(f"error: {exc}")
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)
    print(f"{path}: step {total['step']}, {total['ranks']} ranks, lr {total['lr']:.4g}")
    print(f"{'tensor':32s} {'values':>8s} {'|w|':>8s} {'|u|':>9s} {'|v|':>9s} {'|v|/|u|':>8s} {'max/median':>10s}")
    for r in rows:
        print(f"{r['tensor']:32s} {r['numel']:8d} {r['w']:8.3g} {r['u']:9.4g} {r['v']:9.4g} {r['v_over_u']:8.1f} "
              f"{r['max_over_median']:10.1f}")  # fmt: skip
    print(f"all {len(rows)} tensors: |w| {total['w']:.4g}, |u| {total['u']:.4g}, |v| {total['v']:.4g}, "
          f"|v|/|u| {total['v_over_u']:.1f}, lr |v| / |w| {total['lr_v_over_w']:.3g}")  # fmt: skip


if __name__ == "__main__":
    main()
