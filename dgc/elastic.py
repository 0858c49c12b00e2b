"""Resuming on another number of workers: N workers' compression states mapped onto N'.

What a worker's residual (or error-feedback buffer, or DGC's momentum ``u`` and accumulator ``v``) holds is its
share of gradient not yet sent: the average the workers owe the model is the *mean over workers* of those
buffers (every exchange divides the sum of the sent values by the number of workers). A remapping that keeps that
mean per parameter loses nothing unsent and counts nothing twice:

* **fewer workers** (N -> N' < N): old rank i goes to new rank ``i mod N'``; a new rank's buffer is the sum of
  its old ranks' times N'/N (4 -> 2: the mean of the two it takes);
* **more workers** (N -> N' > N): new rank j takes old rank ``j mod N``'s buffer, divided among the c new ranks
  that share it and times N'/N (2 -> 4: a copy);

in both cases ``(1/N') sum_j new_j = (1/N) sum_i old_i``. A buffer equal on every old worker (PowerSGD's warm-start
Q, a momentum of dense SGD) is state the workers share, not a debt: it is copied unchanged, which keeps the mean
too. What depends on the rank is made again: the random streams of the stochastic compressors start from
``(seed, new rank)`` and DGC's reused thresholds are estimated afresh; the exchanges derive their shard owners and
regions from the new topology when they are built.

:func:`remap` works on :meth:`dgc.GradientSync.state_dict` outputs (one per old rank, in rank order) and returns the
N' states to load, one per new rank. ``python -m dgc.train ... resume=true resume_allow=[world_size]`` does this
for a checkpoint (:mod:`dgc.repro.trainer`).
"""

from __future__ import annotations

import copy
from typing import Any

import torch


def weights(old: int, new: int) -> list[list[tuple[int, float]]]:
    """For each new rank, the old ranks it takes and the factor of each (see the module docstring)."""
    if old < 1 or new < 1:
        raise ValueError(f"world sizes must be >= 1, got {old} -> {new}")
    scale = new / old
    if new <= old:
        return [[(i, scale) for i in range(old) if i % new == j] for j in range(new)]
    shares = [sum(1 for j in range(new) if j % old == i) for i in range(old)]
    return [[(j % old, scale / shares[j % old])] for j in range(new)]


def remap_tensors(buffers: list[torch.Tensor], new: int) -> list[torch.Tensor]:
    """One buffer per old rank -> one per new rank, the mean over ranks kept (a buffer equal everywhere: copied)."""
    first = buffers[0]
    if all(torch.equal(first, b) for b in buffers[1:]):
        return [first.clone() for _ in range(new)]
    out = []
    for takes in weights(len(buffers), new):
        acc = torch.zeros_like(first, dtype=torch.float64)
        for i, factor in takes:
            acc.add_(buffers[i].to(torch.float64), alpha=factor)
        out.append(acc.to(first.dtype))
    return out


def remap(states: list[dict[str, Any]], new: int) -> list[dict[str, Any]]:
    """Every old rank's :meth:`dgc.GradientSync.state_dict` (in rank order) -> the state of each of ``new`` ranks."""
    old = len(states)
    if old < 1:
        raise ValueError("remap needs the state of every old rank, got none")
    ranks = [s.get("rank") for s in states]
    if ranks != list(range(old)) or any(s.get("world_size") != old for s in states):
        raise ValueError(f"remap needs one state per rank of one run, in rank order; got ranks {ranks}")
    out = [copy.deepcopy({k: v for k, v in states[0].items() if k not in ("compressor", "dense_compressor")})
           for _ in range(new)]  # fmt: skip
    for j, state in enumerate(out):
        state["rank"], state["world_size"] = j, new
    for part in ("compressor", "dense_compressor"):
        if part not in states[0]:
            continue
        olds = [s[part] for s in states]
        tensors = olds[0]["tensors"]
        mapped: list[dict[str, dict[str, torch.Tensor]]] = [{} for _ in range(new)]
        for name, keys in tensors.items():
            for key in keys:
                for j, t in enumerate(remap_tensors([o["tensors"][name][key] for o in olds], new)):
                    mapped[j].setdefault(name, {})[key] = t
        extra = {k: v for k, v in olds[0].get("extra", {}).items() if k not in RANK_EXTRAS}
        for j in range(new):
            out[j][part] = {**olds[0], "tensors": mapped[j], "extra": copy.deepcopy(extra)}
    return out


#: compressor extras that belong to one rank and are made again after a remap (the random stream of a stochastic
#: compressor, DGC's thresholds reused from its own last selections)
RANK_EXTRAS = ("generator", "thresholds")


def mean_over_ranks(states: list[dict[str, Any]], part: str = "compressor") -> dict[str, dict[str, torch.Tensor]]:
    """Per tensor and buffer, the mean over ranks (float64): what :func:`remap` keeps."""
    n = len(states)
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, keys in states[0][part]["tensors"].items():
        for key in keys:
            total = sum(s[part]["tensors"][name][key].to(torch.float64) for s in states)
            out.setdefault(name, {})[key] = total / n
    return out


__all__ = ["RANK_EXTRAS", "mean_over_ranks", "remap", "remap_tensors", "weights"]
