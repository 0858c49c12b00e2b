"""What the benches on the emulated cluster (``launch/netcluster.py``) share: the link counter of a machine, the
record of how a bench ran, the per-method medians over steps of the slowest rank, and the trainer config of an
end-to-end run (:mod:`dgc.bench.cluster`, :mod:`dgc.bench.ddp_e2e`)."""

from __future__ import annotations

import argparse
import os
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

from dgc.bench.common import configuration
from dgc.topology import ranks_per_node_from_env


def _median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


def summarize(per_rank: list[dict[str, list[dict[str, float]]]], methods: list[str], keys: list[str]) -> dict:
    """Per method: medians over steps of the slowest rank's value of every key."""
    out: dict[str, Any] = {}
    steps = len(per_rank[0][methods[0]])
    for m in methods:
        row: dict[str, Any] = {}
        for key in keys:
            worst = [max(rank[m][s][key] for rank in per_rank) for s in range(steps)]
            row[key] = _median(worst)
            row[f"{key}_runs"] = worst
        out[m] = row
    return out


class NodeLink:
    """Bytes this machine sent over its shaped link (the namespace's veth, from /sys), read by local rank 0."""

    def __init__(self) -> None:
        iface = os.environ.get("GLOO_SOCKET_IFNAME", "")
        path = Path(f"/sys/class/net/{iface}/statistics/tx_bytes")
        self.path = path if iface and os.environ.get("LOCAL_RANK", "0") == "0" and path.exists() else None

    @property
    def measures(self) -> bool:
        return self.path is not None

    def sent(self) -> int:
        return int(self.path.read_text()) if self.path is not None else 0


def setup_record(args: argparse.Namespace, info) -> dict[str, Any]:  # noqa: ANN001
    """The fields both modes record about how they ran."""
    return {
        "machines": info.world_size // ranks_per_node_from_env(),
        "ranks_per_node": ranks_per_node_from_env(),
        "nodes": info.world_size,
        "rate": args.rate,
        "threads_per_rank": args.threads,
        "cores": os.cpu_count(),
        "steps": args.steps,
        "warmup": args.warmup,
        "seed": args.seed,
    }


def e2e_config(method: str, batch_size: int, seed: int, run_dir: str):  # noqa: ANN201
    from dgc.repro.config import Config, DataConfig, ModelConfig, OptimConfig, TaskConfig, TrainConfig

    spec = configuration("none" if method == "local" else method)
    return Config(
        task=TaskConfig(name="fmnist_wide", kind="image"),
        model=ModelConfig(name="fmnist_wide", args={}),
        data=DataConfig(name="fmnist", root="/usr/share/datasets/fashion-mnist", augment=False),
        optim=OptimConfig(lr=0.01, momentum=0.9, weight_decay=1e-4, schedule="constant"),
        compression=spec.compression,
        sync=replace(spec.sync),
        train=TrainConfig(epochs=1.0, batch_size=batch_size, log_every=1, progress=False),
        run_dir=run_dir,
        seed=seed,
        device="cpu",
    )


__all__ = ["NodeLink", "e2e_config", "setup_record", "summarize"]
