"""The hardware model's form checked on this machine: its step times against the measured e2e runs.

``python -m dgc.bench cluster --e2e --ddp`` measures whole training steps of DDP fp32 and bf16 and of DGC's serial
and overlapped hooks on emulated machines (one rank each, shaped links; ``results/bench/cluster_e2e_ddp.json``).
This module predicts those steps with :func:`dgc.costmodel.hardware.step_s`, the same timeline and collectives as
the GPU projection, on a profile of this machine:

* the link: the run's tc rate times the bandwidth efficiency, and a per-message latency alpha, both from the
  calibrated exchange model (``results/bench/costmodel.json``: fitted on exchange-only runs of other models and
  node counts, not on these runs);
* the compressor: the calibrated CPU seconds per value and per decoded byte, times the contention of N ranks on
  this machine's cores; with the overlapped hook that work shares the cores with the backward pass;
* the compute: the run's own compute-only step (``local``), measured under the same contention;
* the workload: the run's model size; DGC's dense rest (biases) from its measured bytes per step.

The check is of the model's form: how the compute, the buckets, the link and the compressor add up into a step.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dgc.costmodel import rate_bytes
from dgc.costmodel.hardware import Link, Profile, Workload, step_s

#: the e2e bench's method names -> the model's
CHECKED = {"ddp": "ddp_fp32", "ddp_bf16": "ddp_bf16", "dgc": "dgc", "dgc_overlap": "dgc_overlap"}


def machine_profile(params: dict[str, float], run: dict[str, Any]) -> Profile:
    """This machine as a profile: one rank per emulated machine on the run's shaped link."""
    contention = max(1.0, run["nodes"] * run.get("threads_per_rank", 1) / run["cores"])
    link = Link(rate_bytes(run["rate"]) * 8 / 1e9 * params["efficiency"], params["alpha"] * 1e6, "calibrated")
    return Profile(f"this machine at {run['rate']}", "emulated machines, one CPU rank each", 1, link, link,
                   base_latency_us=0.0, cpu_s_per_value={"dgc": params["cpu_dgc"] * contention},
                   cpu_s_per_decoded_byte=params.get("cpu_msg_dgc", 0.0) * contention,
                   latency_on_device=True)  # fmt: skip


def workload(run: dict[str, Any], density: float = 0.001, bytes_per_kept: float = 6.0) -> Workload:
    numel, local = run["numel"], run["methods"]["local"]["step_s"]
    sent = run["methods"].get("dgc", {}).get("sent_bytes")
    # sent = 8 (size) + bytes_per_kept * density * (numel - rest) + 4 * rest
    rest = 0 if sent is None else max(0, round((sent - 8 - bytes_per_kept * density * numel) /
                                               (4 - bytes_per_kept * density)))  # fmt: skip
    return Workload(run["task"], numel, rest, local, "measured: the run's compute-only step", density=density,
                    bytes_per_kept=bytes_per_kept)  # fmt: skip


def check(e2e: dict[str, Any], params: dict[str, float]) -> list[dict[str, Any]]:
    """Predicted against measured step per run and method of an e2e bench JSON."""
    out = []
    for run in e2e["runs"]:
        p, w = machine_profile(params, run), workload(run)
        for name, method in CHECKED.items():
            if name not in run["methods"]:
                continue
            measured = run["methods"][name]["step_s"]
            predicted = step_s(p, w, method, run["machines"])["step_s"]
            out.append({"rate": run["rate"], "method": name, "measured_s": measured, "predicted_s": predicted,
                        "error": predicted / measured - 1,
                        "comm_ratio_target": run.get("comm_ratio_target")})  # fmt: skip
    return out


def check_files(e2e_path: str, costmodel_path: str) -> list[dict[str, Any]]:
    """:func:`check` on files; ValueError naming the file that cannot be read."""
    loaded = []
    for path, key in ((e2e_path, "runs"), (costmodel_path, "params")):
        try:
            data = json.loads(Path(path).read_text())
            data[key]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            what = "an e2e bench JSON (python -m dgc.bench cluster --e2e --ddp)" if key == "runs" else (
                "a calibrated model (python -m dgc.bench costmodel)")  # fmt: skip
            raise ValueError(f"cannot read {path} as {what}: {type(e).__name__}: {e}") from None
        loaded.append(data)
    return check(loaded[0], loaded[1]["params"])


__all__ = ["CHECKED", "check", "check_files", "machine_profile", "workload"]
