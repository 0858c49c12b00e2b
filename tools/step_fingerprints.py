"""Bit-identity harness: proof that a refactor of the library changes no number.

For each named set-up (a compressor, an exchange, a policy, a path: library ``dgc.EveryStep``, the DDP hook serial
or overlapped, local steps ``LocalSteps.step``; with clipping, Nesterov and weight decay, a learning-rate schedule,
a NaN on one rank, a request) two real processes joined by a gloo process group on 127.0.0.1 train a tiny
deterministic model for :data:`STEPS` steps through the public API only (``dgc.build_compressor``,
``dgc.GradientSync``, ``dgc.SGD``, ``dgc.Policy``, ``dgc.ddp_comm_hook``, ``dgc.EveryStep``,
``dgc.LocalStepsConfig``/``dgc.LocalSteps``, ``set_epoch``, ``request``, ``state_dict``, ``StepStats``). Each rank
records sha256 fingerprints of

* ``grads``: every step's averaged gradients, the bytes of every parameter's ``.grad`` in parameter order (local
  steps: this rank's gradient the inner step stepped on and its weights after ``LocalSteps.step()``, every step);
* ``stats``: every step's :class:`dgc.StepStats` (``dataclasses.asdict``, the fields holding seconds dropped);
* ``state``: the final compression state, ``sync.state_dict()`` (and ``LocalSteps.state_dict()``): every tensor's
  key path, dtype, shape and bytes in sorted key order, every other value by its ``repr``;
* ``weights``: the final ``model.state_dict()`` (parameters and BatchNorm buffers).

The per-step ones also keep one short hash per step, so a comparison names the first step that differs. A set-up
the library refuses with a ValueError is recorded as refused, with the message. Both processes run every set-up,
one after the other, in one process group (a fresh model, sync and optimizer per set-up).

Record a baseline, and compare the code of the working tree against it::

    .venv/bin/python tools/step_fingerprints.py --record results/identity/before-rebuild.json
    .venv/bin/python tools/step_fingerprints.py --compare results/identity/before-rebuild.json
    .venv/bin/python tools/step_fingerprints.py --compare results/identity/before-rebuild.json --only hierarchical
    .venv/bin/python tools/step_fingerprints.py --list

``--compare`` prints one line per set-up that differs (which rank, which fingerprint, the first step that differs
for the per-step ones; for ``stats`` the fields added or removed), then ``N identical, M differ, K refused``, and
exits 0 when nothing differs, 1 when a set-up differs, is missing or is new (a set-up refused before and not now,
or the other way round, differs), 2 when the run itself failed. It runs in about a minute on 2 busy cores (most of
it importing torch, and torch._dynamo at the first optimizer). Run twice on the same code it finds no difference.

``results/identity/before-rebuild.json`` was recorded from the code before the rebuild of the sync (commit
ab5be92, whose ``dgc/`` is af92e50's), in a clean ``git worktree`` of it. The rebuild changes two set-ups on
purpose, ``dgc/dense-1bit/hierarchical-r2`` and ``topk/dense-1bit/hierarchical-r2``: the 1-bit dense values now go
by machine (each machine's mean, compressed between machines), not flat over every rank.
``results/identity/after-sync-rebuild.json`` is the code after it: the baseline of the next change (``make
identity``).

The ``dgc`` imported is the one of the checkout this script lies in (its directory is put first on ``sys.path`` and
``PYTHONPATH``), whatever the virtual environment's editable install points at; the workers check it.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.multiproc import free_port  # noqa: E402  (the tests' own: a free port on 127.0.0.1)

#: training steps per set-up
STEPS = 20
#: steps per epoch for ``sync.set_epoch(step / STEPS_PER_EPOCH)`` (DGC's warm-up spans 2 epochs: 10 steps)
STEPS_PER_EPOCH = 5
#: the processes of every set-up
WORLD = 2
#: DDP bucket cap: several buckets per step for the ~7,000-parameter model
BUCKET_MB = 0.008
#: the step of the NaN (rank 1) and of the checkpoint request (rank 1)
NAN_STEP = 7
REQUEST_STEP = 5
#: StepStats fields holding seconds (timing): left out of the fingerprint
TIMING_FIELDS = {"compress_s", "communicate_s", "decompress_s"}
#: the longest a whole run may take before its processes are killed (seconds)
RUN_TIMEOUT = 900

#: every compressor's options in these set-ups (small sizes: the model has ~7,000 parameters)
OPTIONS: dict[str, dict[str, Any]] = {
    "demo": {"tile": 16, "topk": 8},
    "none": {},
    "fp16": {},
    "bf16": {},
    "dgc": {"density": 0.05, "warmup_epochs": 2},
    "powersgd": {"rank": 2},
    "qsgd": {"bucket_size": 128},
    "sparseloco": {"density": 0.05, "chunk_size": 256},
    "terngrad": {},
    "topk": {"density": 0.05},
}


@dataclass
class Setup:
    """One set-up: what is built and how it is trained."""

    name: str
    compressor: str
    options: dict[str, Any] = field(default_factory=dict)
    #: keyword arguments of GradientSync, besides ``policy`` (``dense_values`` below)
    sync: dict[str, Any] = field(default_factory=dict)
    #: Policy(dense_values=...), or None for the default policy
    dense_values: str | None = None
    #: keyword arguments of dgc.SGD
    optim: dict[str, Any] = field(default_factory=lambda: {"lr": 0.05, "momentum": 0.9})
    #: "library" (sync.step()), "ddp" (DDP + dgc.ddp_comm_hook) or "local" (dgc.LocalSteps)
    path: str = "library"
    #: LocalStepsConfig options (path "local")
    local: dict[str, Any] = field(default_factory=dict)
    #: StepLR(step_size=5, gamma=0.5) on the optimizer
    schedule: bool = False
    #: a NaN in rank 1's gradient at NAN_STEP
    nan: bool = False
    #: sync.request("checkpoint") on rank 1 before REQUEST_STEP
    request: bool = False


def setups() -> list[Setup]:
    """Every set-up, in the order they run."""
    out: list[Setup] = []
    names = list(OPTIONS)

    def add(name: str, compressor: str, **kwargs: Any) -> None:
        out.append(Setup(name, compressor, dict(OPTIONS[compressor]), **kwargs))

    for c in names:  # every compressor on the flat exchange
        add(f"{c}/flat", c)
    for c in names:  # hierarchical: one machine of two ranks; one rank per machine (exactly flat: not for the
        for r in (1, 2):  # plain dense compressors, whose one-rank path is none's)
            if r == 1 and c in ("fp16", "bf16", "qsgd", "terngrad"):
                continue
            add(f"{c}/hierarchical-r{r}", c, sync={"exchange": "hierarchical", "ranks_per_node": r})
    for c in ("dgc", "topk", "sparseloco", "powersgd"):  # the sparse-only exchanges (the last two are refused)
        for ex in ("densify", "sparse_allreduce"):
            add(f"{c}/{ex}", c, sync={"exchange": ex})
    out.append(Setup("dgc-chunk/flat", "dgc", {**OPTIONS["dgc"], "selection": "chunk", "chunk_size": 256}))
    out.append(Setup("dgc-chunk/densify", "dgc", {**OPTIONS["dgc"], "selection": "chunk", "chunk_size": 256},
                     sync={"exchange": "densify"}))  # fmt: skip
    for c in ("dgc", "topk", "powersgd", "sparseloco"):  # pack on flat
        for pack in ("dense", "all"):
            add(f"{c}/pack-{pack}/flat", c, sync={"pack": pack})
    add("dgc/pack-all/hierarchical-r2", "dgc", sync={"pack": "all", "exchange": "hierarchical", "ranks_per_node": 2})
    for dv in ("fp16", "bf16", "1bit"):  # the values the policy leaves dense
        add(f"dgc/dense-{dv}/flat", "dgc", dense_values=dv)
    add("topk/dense-1bit/flat", "topk", dense_values="1bit")
    add("powersgd/dense-bf16/flat", "powersgd", dense_values="bf16")
    for r in (1, 2):
        add(f"dgc/dense-1bit/hierarchical-r{r}", "dgc", dense_values="1bit",
            sync={"exchange": "hierarchical", "ranks_per_node": r})  # fmt: skip
    add("topk/dense-1bit/hierarchical-r2", "topk", dense_values="1bit",
        sync={"exchange": "hierarchical", "ranks_per_node": 2})  # fmt: skip
    add("dgc/dense-fp16/hierarchical-r2", "dgc", dense_values="fp16",
        sync={"exchange": "hierarchical", "ranks_per_node": 2})  # fmt: skip
    add("dgc/dense-1bit/pack-all/flat", "dgc", dense_values="1bit", sync={"pack": "all"})
    for c in ("dgc", "topk"):  # Gradient Dropping's accumulation under a changing learning rate
        add(f"{c}/accumulate-updates/flat", c, sync={"accumulate": "updates"}, schedule=True)
    add("dgc/clip-step/flat", "dgc", sync={"clip_norm": 0.5, "clip_scope": "step"})
    add("dgc/clip-tensor/flat", "dgc", sync={"clip_norm": 0.5, "clip_scope": "tensor"})
    add("topk/clip-tensor/flat", "topk", sync={"clip_norm": 0.5, "clip_scope": "tensor"})
    nesterov = {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-3}
    for c in ("dgc", "topk", "none"):
        add(f"{c}/nesterov-wd/flat", c, optim=dict(nesterov))
    add("dgc/ddp-serial", "dgc", path="ddp")
    add("dgc/ddp-serial/clip-step", "dgc", path="ddp", sync={"clip_norm": 0.5, "clip_scope": "step"})
    add("dgc/ddp-overlap", "dgc", path="ddp", sync={"overlap": True})
    add("dgc/ddp-overlap/clip-tensor", "dgc", path="ddp", sync={"overlap": True, "clip_norm": 0.5})
    add("dgc/ddp-overlap/clip-step", "dgc", path="ddp", sync={"overlap": True, "clip_norm": 0.5, "clip_scope": "step"})
    add("dgc/ddp-overlap/pack-all", "dgc", path="ddp", sync={"overlap": True, "pack": "all"})
    add("topk/ddp-overlap", "topk", path="ddp", sync={"overlap": True}, optim=dict(nesterov))
    add("powersgd/ddp-overlap", "powersgd", path="ddp", sync={"overlap": True})
    add("local/none", "none", path="local", local={"every": 4})
    add("local/bf16", "bf16", path="local", local={"every": 4})
    add("local/sparseloco", "sparseloco", path="local",
        local={"every": 4, "outer_lr": 1.0, "outer_momentum": 0.0, "outer_nesterov": False})  # fmt: skip
    add("local/topk", "topk", path="local", local={"every": 4})
    add("local/dgc", "dgc", path="local", local={"every": 4})  # refused: DGC keeps the optimizer's momentum
    add("local/none/nan", "none", path="local", local={"every": 4}, nan=True)
    add("dgc/nan/flat", "dgc", nan=True)
    add("dgc/nan/pack-all/flat", "dgc", sync={"pack": "all"}, nan=True)
    add("dgc/nan/ddp-serial", "dgc", path="ddp", nan=True)
    add("dgc/nan/ddp-overlap", "dgc", path="ddp", sync={"overlap": True}, nan=True)
    add("dgc/request/flat", "dgc", request=True)
    add("dgc/request/pack-all/flat", "dgc", sync={"pack": "all"}, request=True)
    add("dgc/request/ddp-overlap", "dgc", path="ddp", sync={"overlap": True}, request=True)
    return out


# -- fingerprints ---------------------------------------------------------------------------------------------------


def _bytes(t: Any) -> bytes:
    import torch

    t = t.detach().to("cpu").contiguous().reshape(-1)
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return t.view(torch.uint8).numpy().tobytes()


def _feed(h: Any, obj: Any, path: str = "") -> None:
    """Hash ``obj``: tensors by key path, dtype, shape and bytes; mappings in sorted key order; other values by
    repr."""
    import torch

    if isinstance(obj, torch.Tensor):
        h.update(f"{path}:{obj.dtype}:{tuple(obj.shape)}\n".encode())
        h.update(_bytes(obj))
    elif isinstance(obj, dict):
        for key in sorted(obj, key=repr):
            _feed(h, obj[key], f"{path}/{key!r}")
    elif isinstance(obj, list | tuple):
        h.update(f"{path}:{type(obj).__name__}[{len(obj)}]\n".encode())
        for i, v in enumerate(obj):
            _feed(h, v, f"{path}/{i}")
    else:
        h.update(f"{path}={obj!r}\n".encode())


def digest(obj: Any) -> str:
    h = hashlib.sha256()
    _feed(h, obj)
    return h.hexdigest()


def grads_digest(params: list[Any]) -> str:
    """The gradients' bytes concatenated in parameter order (a missing gradient: a marker)."""
    h = hashlib.sha256()
    for p in params:
        h.update(b"none" if p.grad is None else _bytes(p.grad))
    return h.hexdigest()


def stats_record(stats: Any) -> dict[str, Any] | None:
    """A StepStats as a dict without the fields holding seconds."""
    if stats is None:
        return None
    out = dataclasses.asdict(stats)
    return {k: v for k, v in out.items() if k not in TIMING_FIELDS and not k.endswith("_s") and "second" not in k}


class Trace:
    """The fingerprints of one rank's run of one set-up."""

    def __init__(self) -> None:
        self.grads: list[str] = []
        self.stats: list[str] = []
        self.fields: list[str] = []

    def step(self, grads: str, stats: dict[str, Any] | None) -> None:
        self.grads.append(grads)
        text = json.dumps(stats, sort_keys=True, default=repr)
        self.stats.append(hashlib.sha256(text.encode()).hexdigest())
        if stats is not None and not self.fields:
            self.fields = sorted(stats)

    def result(self, state: Any, weights: Any) -> dict[str, Any]:
        return {
            "grads": hashlib.sha256("".join(self.grads).encode()).hexdigest(),
            "grads_steps": [g[:16] for g in self.grads],
            "stats": hashlib.sha256("".join(self.stats).encode()).hexdigest(),
            "stats_steps": [s[:16] for s in self.stats],
            "stats_fields": self.fields,
            "state": digest(state),
            "weights": digest(weights),
        }


# -- one set-up on one rank -------------------------------------------------------------------------------------------


def _model() -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64),
        torch.nn.BatchNorm1d(64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 10),
    )


def _data(rank: int) -> list[tuple[Any, Any]]:
    import torch

    gen = torch.Generator().manual_seed(1000 + rank)
    return [(torch.randn(8, 32, generator=gen), torch.randint(0, 10, (8,), generator=gen)) for _ in range(STEPS)]


def run_setup(s: Setup, rank: int) -> dict[str, Any]:
    """Build and train ``s`` on this rank; ``{"refused": message}`` when building raises a ValueError."""
    import torch
    import torch.nn.functional as F

    import dgc

    model = _model()
    params = list(model.parameters())
    try:
        compressor = dgc.build_compressor(s.compressor, **s.options)
        policy = dgc.Policy(dense_values=s.dense_values) if s.dense_values else None
        sync = dgc.GradientSync(model, compressor, policy=policy, **s.sync)
        local = opt = sched = net = None
        if s.path == "local":
            opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)  # the inner optimizer
            stepper = local = dgc.LocalStepsConfig(**s.local).build(sync, opt)
        else:
            opt = dgc.SGD(params, sync, **s.optim)
            if s.schedule:
                sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
            stepper = dgc.EveryStep(sync, opt, hooked=s.path == "ddp")
        if s.path == "ddp":
            net = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=BUCKET_MB)
            net.register_comm_hook(sync, dgc.ddp_comm_hook)
    except ValueError as exc:
        return {"refused": f"{type(exc).__name__}: {exc}"}

    poison = {"on": False}
    if s.nan and rank == 1 and s.path == "ddp":  # before DDP's hook sees the gradient
        params[0].register_hook(lambda g: g.index_fill(0, torch.tensor([3]), math.nan) if poison["on"] else g)
    forward = net if net is not None else model
    trace = Trace()
    for step, (x, y) in enumerate(_data(rank)):
        sync.set_epoch(step / STEPS_PER_EPOCH)
        if s.request and rank == 1 and step == REQUEST_STEP:
            sync.request("checkpoint")
        poison["on"] = s.nan and step == NAN_STEP
        loss = F.cross_entropy(forward(x), y)
        loss.backward()
        if poison["on"] and rank == 1 and s.path != "ddp":
            with torch.no_grad():
                params[0].grad[3] = math.nan
        seen: list[str] = []  # the gradients the update steps on (zeroed when the step is skipped: read after)
        stepped = stepper.step(before_update=lambda out=seen: out.append(grads_digest(params)))
        grads = seen[0] if seen else grads_digest(params)
        opt.zero_grad()
        if s.path == "local":
            stats = {"before": stats_record(stepped.stats), "after": stats_record(stepped.outer)}
            weights = digest([p.detach() for p in params])
            trace.step(hashlib.sha256((grads + weights).encode()).hexdigest(), stats)
            continue
        trace.step(grads, stats_record(stepped.stats))
        if sched is not None:
            sched.step()
    state = {"sync": sync.state_dict()}
    if local is not None:
        state["local"] = local.state_dict()
    return trace.result(state, model.state_dict())


# -- the two processes ------------------------------------------------------------------------------------------------


def _watch_parent() -> None:
    """End this worker when the process that started it is gone (no worker outlives a killed run)."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(3)

    threading.Thread(target=watch, name="watch-parent", daemon=True).start()


def worker(rank: int, port: int, out: str, only: str) -> None:
    _watch_parent()
    import warnings

    import torch
    import torch.distributed as dist

    import dgc

    warnings.simplefilter("ignore")
    # one thread: every reduction in one order. Not torch.use_deterministic_algorithms(True): on a machine without
    # a GPU it makes init_process_group take seconds (~12 s), and these CPU kernels are deterministic without it
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=120))  # fmt: skip
    results: dict[str, Any] = {"_dgc": dgc.__file__}
    current = "(start)"
    try:
        for s in setups():
            if only and only not in s.name:
                continue
            current = s.name
            results[s.name] = run_setup(s, rank)
            dist.barrier()
        tmp = out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(results, f)
        os.replace(tmp, out)
        code = 0
    except BaseException:
        print(f"rank {rank}: set-up {current} failed:\n{traceback.format_exc()}", file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no gloo teardown: the results are written


def fail(message: str) -> None:
    """Stop with ``message`` and exit status 2 (1 means: a set-up differs)."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def run_all(only: str) -> dict[str, Any]:
    """Run every set-up (matching ``only``) in two worker processes; ``{name: {"rank0": .., "rank1": ..}}``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    env.pop("LOCAL_WORLD_SIZE", None)
    env.pop("SLURM_NTASKS_PER_NODE", None)
    with tempfile.TemporaryDirectory(prefix="fingerprints-") as tmp:
        port = free_port()
        procs: list[subprocess.Popen] = []
        logs = []
        try:
            for rank in range(WORLD):
                log = open(os.path.join(tmp, f"{rank}.log"), "w+")
                logs.append(log)
                cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(rank), str(port),
                       os.path.join(tmp, f"{rank}.json"), only]  # fmt: skip
                procs.append(subprocess.Popen(cmd, env=env, cwd=str(REPO), stdout=log, stderr=subprocess.STDOUT))
            deadline = time.monotonic() + RUN_TIMEOUT
            while any(p.poll() is None for p in procs):
                if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            for p in procs:
                p.wait()
            texts = []
            for log in logs:
                log.seek(0)
                texts.append(log.read())
                log.close()
        codes = [p.returncode for p in procs]
        if codes != [0] * WORLD:
            for rank, text in enumerate(texts):
                print(f"--- rank {rank} (exit {codes[rank]}) ---\n{text[-6000:]}", file=sys.stderr)
            fail(f"the workers failed (exit codes {codes})")
        ranks = []
        for rank in range(WORLD):
            with open(os.path.join(tmp, f"{rank}.json")) as f:
                ranks.append(json.load(f))
    where = {r.pop("_dgc") for r in ranks}
    expected = str(REPO / "dgc" / "__init__.py")
    if where != {expected}:
        fail(f"the workers imported dgc from {sorted(where)}, not {expected}")
    out: dict[str, Any] = {}
    for name in ranks[0]:
        per = [r[name] for r in ranks]
        if "refused" in per[0] or "refused" in per[1]:
            if per[0] != per[1]:
                fail(f"{name}: refused on one rank only: {per}")
            out[name] = per[0]
        else:
            out[name] = {f"rank{i}": p for i, p in enumerate(per)}
    return out


# -- record and compare -----------------------------------------------------------------------------------------------


def meta() -> dict[str, Any]:
    import torch

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True,
                                  check=True).stdout.strip()  # fmt: skip
        except (OSError, subprocess.CalledProcessError):
            return "unknown"

    return {
        "git_revision": git("rev-parse", "HEAD"),
        "dgc_changes": git("status", "--porcelain", "--", "dgc") or "none",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "steps": STEPS,
        "world_size": WORLD,
        "setups": len(setups()),
    }


PER_STEP = ("grads", "stats")
WHOLE = ("state", "weights")


def differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What differs between two set-ups' results (empty: identical)."""
    if "refused" in old or "refused" in new:
        if ("refused" in old) != ("refused" in new):
            return [f"refused {'before' if 'refused' in old else 'now'}: {old.get('refused') or new.get('refused')}"]
        return []
    out = []
    for rank in sorted(set(old) | set(new)):
        a, b = old.get(rank), new.get(rank)
        if a is None or b is None:
            out.append(f"{rank} {'missing' if b is None else 'new'}")
            continue
        for key in PER_STEP:
            if a[key] != b[key]:
                steps_a, steps_b = a[f"{key}_steps"], b[f"{key}_steps"]
                first = next((i for i, (x, y) in enumerate(zip(steps_a, steps_b)) if x != y), None)
                where = f"from step {first}" if first is not None else f"{len(steps_a)} steps, now {len(steps_b)}"
                extra = ""
                if key == "stats" and a["stats_fields"] != b["stats_fields"]:
                    gone = sorted(set(a["stats_fields"]) - set(b["stats_fields"]))
                    added = sorted(set(b["stats_fields"]) - set(a["stats_fields"]))
                    extra = f" (fields removed {gone}, added {added})"
                out.append(f"{rank} {key} {where}{extra}")
        for key in WHOLE:
            if a[key] != b[key]:
                out.append(f"{rank} {key}")
    return out


def compare(path: str, only: str) -> int:
    with open(path) as f:
        baseline = json.load(f)
    recorded = baseline.pop("_meta", {})
    started = time.monotonic()
    now = run_all(only)
    elapsed = time.monotonic() - started
    if only:
        baseline = {k: v for k, v in baseline.items() if only in k}
    identical = differ = refused = 0
    for name in list(baseline) + [n for n in now if n not in baseline]:
        if name not in now:
            print(f"{name}: missing (in the baseline, not run now)")
            differ += 1
            continue
        if name not in baseline:
            print(f"{name}: new (not in the baseline)")
            differ += 1
            continue
        diff = differences(baseline[name], now[name])
        if diff:
            print(f"{name}: differs: {'; '.join(diff)}")
            differ += 1
        elif "refused" in now[name]:
            refused += 1
            if baseline[name]["refused"] != now[name]["refused"]:
                print(f"{name}: refused with another message: {now[name]['refused']}")
        else:
            identical += 1
    print(f"baseline: {path} (git {recorded.get('git_revision', '?')[:12]}, torch {recorded.get('torch', '?')}); "
          f"now: {elapsed:.1f} s")  # fmt: skip
    print(f"{identical} identical, {differ} differ, {refused} refused")
    return 1 if differ else 0


def record(path: str, only: str) -> int:
    started = time.monotonic()
    results = run_all(only)
    out = {"_meta": meta(), **results}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:  # one line per set-up: a change shows as the lines of the set-ups it changed
        f.write("{\n" + ",\n".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in out.items()) + "\n}\n")
    refused = [n for n, r in results.items() if "refused" in r]
    for name in refused:
        print(f"{name}: refused: {results[name]['refused']}")
    print(f"{len(results) - len(refused)} set-ups recorded, {len(refused)} refused, in "
          f"{time.monotonic() - started:.1f} s: {path}")  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        worker(int(argv[1]), int(argv[2]), argv[3], argv[4])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--record", metavar="FILE", help="write the fingerprints of every set-up to FILE (JSON)")
    mode.add_argument("--compare", metavar="FILE", help="recompute and compare with FILE; exit 1 on any difference")
    mode.add_argument("--list", action="store_true", help="print the set-ups' names")
    parser.add_argument("--only", default="", metavar="SUBSTRING", help="only the set-ups whose name contains it")
    args = parser.parse_args(argv)
    if args.list:
        for s in setups():
            if args.only in s.name:
                print(s.name)
        return 0
    if args.record:
        return record(args.record, args.only)
    return compare(args.compare, args.only)


if __name__ == "__main__":
    raise SystemExit(main())
