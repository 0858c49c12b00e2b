"""The one place that initializes torch.distributed (torchrun, Slurm's srun, or one process).

* torchrun sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``;
* ``srun`` without torchrun (e.g. Hydra's submitit launcher) sets ``SLURM_PROCID``, ``SLURM_NTASKS``,
  ``SLURM_LOCALID``; unless exported, ``MASTER_ADDR`` is then the first host of the step's node list
  (where task 0 runs) and ``MASTER_PORT`` is derived from the job id (:func:`slurm_master_env`);
* otherwise the run is a single process and no process group is created, unless
  ``DGC_COLLECTIVES_AT_WORLD_1=1``: then a process group of one is made (an in-memory store) and every
  collective runs at world size 1 too, where the library would otherwise skip it. Only the GPU check
  (``python -m dgc.bench gpu``: NCCL's collective paths on one GPU) and the tests use it.

The backend is NCCL when the run uses CUDA and gloo otherwise; with CUDA each rank
takes the GPU of its local rank.
"""

from __future__ import annotations

import datetime
import gc
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

#: the switch that keeps every collective at world size 1 (see the module docstring)
COLLECTIVES_AT_WORLD_1 = "DGC_COLLECTIVES_AT_WORLD_1"


def collectives_at_world_1() -> bool:
    return os.environ.get(COLLECTIVES_AT_WORLD_1) == "1"


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def collectives(self) -> bool:
        """Whether the run's collectives run: several workers, or a group of one under the switch."""
        return self.world_size > 1 or self.backend is not None


def _env_int(*names: str) -> int | None:
    for name in names:
        if os.environ.get(name, "") != "":
            return int(os.environ[name])
    return None


def resolve_device(device: str) -> torch.device:
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be one of auto, cpu, cuda; got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device=cuda but CUDA is not available; use device=cpu or device=auto")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device)


def first_slurm_host(nodelist: str) -> str:
    """The first host of a Slurm node list, without ``scontrol``: ``gpu[07-09,12],cpu1`` -> ``gpu07``,
    ``rack[1-2]-n[3-4]`` -> ``rack1-n3`` (Slurm sorts the list, so this is where task 0 runs)."""
    first, depth = "", 0
    for ch in nodelist.strip():
        if ch == "," and depth == 0:
            break
        depth += (ch == "[") - (ch == "]")
        first += ch
    # each bracket group contributes its first element, zero padding kept
    host = re.sub(r"\[([^\]]*)\]", lambda m: m.group(1).split(",")[0].split("-")[0], first)
    if not host or "[" in host or "]" in host:
        raise ValueError(f"cannot parse the Slurm node list {nodelist!r}")
    return host


#: the rendezvous port of a job started by srun alone: 20000 + job id mod 10000 (below Linux's ephemeral ports)
SLURM_PORT_BASE, SLURM_PORT_SPAN = 20000, 10000


def slurm_master_env(env: Mapping[str, str]) -> dict[str, str]:
    """``MASTER_ADDR``/``MASTER_PORT`` for processes started by ``srun`` without torchrun, for the
    ones ``env`` lacks; empty when the ranks do not come from Slurm (torchrun sets ``RANK``)."""
    if env.get("RANK", "") != "" or env.get("SLURM_PROCID", "") == "":
        return {}
    out = {}
    if env.get("MASTER_ADDR", "") == "":
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_NODELIST") or env.get("SLURM_JOB_NODELIST")
        out["MASTER_ADDR"] = first_slurm_host(nodelist) if nodelist else "127.0.0.1"
    job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if env.get("MASTER_PORT", "") == "" and job:
        out["MASTER_PORT"] = str(SLURM_PORT_BASE + int(job) % SLURM_PORT_SPAN)
    return out


def init_distributed(device: str = "auto", timeout_s: float = 600) -> DistInfo:
    """Initialize the default process group from the launcher's environment (idempotent)."""
    rank = _env_int("RANK", "SLURM_PROCID") or 0
    world_size = _env_int("WORLD_SIZE", "SLURM_NTASKS") or 1
    local_rank = _env_int("LOCAL_RANK", "SLURM_LOCALID") or 0
    dev = resolve_device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if world_size == 1:
        if not collectives_at_world_1():
            return DistInfo(0, 1, 0, dev, None)
        if not dist.is_initialized():
            dist.init_process_group(
                backend, store=dist.HashStore(), rank=0, world_size=1, device_id=dev if dev.type == "cuda" else None
            )
        return DistInfo(0, 1, local_rank, dev, backend)
    if not dist.is_initialized():
        os.environ.update(slurm_master_env(os.environ))
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            raise RuntimeError("MASTER_PORT is not set: launch with torchrun, or export MASTER_ADDR/MASTER_PORT")
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            device_id=dev if dev.type == "cuda" else None,
            store=_attempt_store(timeout),
        )
    return DistInfo(rank, world_size, local_rank, dev, backend)


def _attempt_store(timeout: datetime.timedelta) -> dist.Store | None:
    """Under torchrun, the agent's store with keys of this attempt only (None otherwise: ``env://``).

    torchrun's workers share the agent's TCPStore across restarts: after ``--max-restarts`` brings the
    workers back, a rank can read the gloo address the previous attempt's rank 0 left there, and fail
    to connect (or wait) before the new rank 0 overwrites it. Keys prefixed by the attempt
    (``TORCHELASTIC_RESTART_COUNT``) never mix."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"/dgc/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def shutdown(clean: bool = True) -> None:
    """Leave the process group; ``clean``: first free unreachable objects and wait until every rank is done.
    After a failure, leave at once.

    Call it at the end of a training script: a gloo worker that exits with the process group alive, or
    with garbage (reference cycles holding tensors) left for the interpreter's teardown, aborts now and then
    ("terminate called without an active exception", exit -6) after its work is done. Measured on the
    README's script under torchrun with 2 workers on 2 busy cores: 4 aborts in 46 runs without the
    ``gc.collect()`` (barrier and destroy alone included), none in 64 with it."""
    if dist.is_initialized():
        if clean:
            gc.collect()
            dist.barrier()
        dist.destroy_process_group()


def broadcast_object(obj: object, src: int = 0) -> object:
    """Rank ``src``'s object on every rank (the object itself in a single process)."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Sum a few numbers over all ranks."""
    if not dist.is_initialized():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()
