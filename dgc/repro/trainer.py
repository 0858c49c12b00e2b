"""The shared trainer: any task, any compressor, one process or many.

``Trainer(cfg, info).fit()`` validates everything before touching the disk (a bad
configuration raises :class:`ConfigError` and leaves no run directory), then trains
with per-worker batches, the learning rate scaled by the number of workers with a
linear warm-up and a cosine or multistep schedule, the compression warm-up driven
by the fractional epoch, gradient accumulation, optional bf16 autocast on CUDA,
evaluation after every epoch, ``metrics.jsonl``, checkpoints and ``summary.json``
(see :mod:`dgc.repro.rundir`). Only rank 0 writes.

``callbacks`` (objects with ``after_backward(trainer)`` and/or ``after_step(trainer)``) see every
step from outside the loop: the test-only fault injection of :mod:`dgc.repro.faults` is one.

Unattended runs: SIGTERM or SIGUSR1 on any rank makes every rank stop at the same step boundary
after a checkpoint (:class:`Interrupted`); checkpoints are also written every
``train.checkpoint_every`` steps and every ``train.checkpoint_minutes``; a step with a non-finite
gradient on any rank is skipped on all of them, and ``train.max_bad_steps`` in a row end the run
(:class:`Diverged`). With local steps nothing is agreed between exchanges: a rank skips its own non-finite inner
steps, and signals, checkpoint requests and a rank's ``train.max_bad_steps`` are seen by every rank at the next
exchange.
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import dgc
from dgc import seeding
from dgc.comm import Comm
from dgc.distributed import DistInfo
from dgc.repro import checkpoint
from dgc.repro.config import Config, ConfigError, check_ranges, method_name
from dgc.repro.rundir import RunFiles

SCHEDULES = ("cosine", "multistep", "constant")
#: ``optim.name``: momentum SGD (:class:`dgc.SGD`) or AdamW (``torch.optim.AdamW``)
OPTIMIZERS = ("sgd", "adamw")
#: when the test split is read: at every evaluation, at the run's last one only, never (the validation split only)
TEST_EVAL = ("every", "end", "never")
#: the signals that stop a run at the next step boundary (Slurm: --signal=USR1@<seconds>; preemption: TERM)
#: each stops the run at the next step boundary after a checkpoint (SIGINT: Ctrl-C, or passed on by the launcher)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class Interrupted(Exception):
    """The run stopped at a step boundary after a checkpoint, on a signal: the same command with ``resume=auto``
    continues it (:meth:`RunFiles.continue_with`)."""


class Diverged(Exception):
    """Too many steps in a row had non-finite gradients."""


def learning_rate(cfg: Config, base: float, epoch: float) -> float:
    """Rate at a fractional epoch: linear warm-up, then cosine / multistep / constant."""
    opt = cfg.optim
    if opt.warmup_epochs > 0 and epoch < opt.warmup_epochs:
        return base * (epoch + 1e-3) / opt.warmup_epochs
    if opt.schedule == "cosine":
        span = max(cfg.train.epochs - opt.warmup_epochs, 1e-9)
        progress = min(max((epoch - opt.warmup_epochs) / span, 0.0), 1.0)
        floor = opt.final_lr_ratio
        return base * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))
    if opt.schedule == "multistep":
        return base * opt.gamma ** sum(epoch >= m for m in opt.milestones)
    return base


def validate(cfg: Config) -> None:
    """The settings' ranges (:func:`dgc.repro.config.check_ranges`, from the schema: again here, for a config changed
    after it was made) and the choices and combinations the schema cannot say; ConfigError with one line."""
    try:
        check_ranges(cfg)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    t, o = cfg.train, cfg.optim
    checks = [
        (o.schedule in SCHEDULES, f"optim.schedule must be one of {', '.join(SCHEDULES)}, got {o.schedule!r}"),
        (o.name in OPTIMIZERS, f"optim.name must be one of {', '.join(OPTIMIZERS)}, got {o.name!r}"),
        (len(o.betas) == 2, f"optim.betas must be two numbers in [0, 1), got {list(o.betas)}"),
        (
            o.name == "sgd" or cfg.sync.accumulate == "gradients",
            "sync.accumulate=updates scales each gradient by its SGD learning rate, which AdamW's normalized step "
            "undoes: use it with optim.name=sgd, or set sync.accumulate=gradients",
        ),
        (cfg.logger.mode in ("offline", "online", "disabled"), "logger.mode must be offline, online or disabled"),
        (cfg.resume in (True, False, "auto"), f"resume must be true, false or auto, got {cfg.resume!r}"),
        (cfg.resume is not True or cfg.run_dir, "resume=true needs run_dir=PATH of the run to continue"),
        (t.test_eval in TEST_EVAL, f"train.test_eval must be one of {', '.join(TEST_EVAL)}, got {t.test_eval!r}"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)


class Trainer:
    """Args:
    cfg: the run's configuration.
    info: this process's place in the job (:func:`dgc.distributed.init_distributed`).
    comm: the collectives of the gradient exchange (default: the default process group).
    callbacks: objects called after each backward pass and each step (see the module docstring).
    """

    def __init__(self, cfg: Config, info: DistInfo, comm: Comm | None = None, callbacks: Iterable[Any] = ()):
        validate(cfg)
        if cfg.train.bf16 and info.device.type != "cuda":
            raise ConfigError("train.bf16=true needs CUDA (bf16 autocast is for GPUs); set train.bf16=false")
        self.cfg, self.info = cfg, info
        from dgc.tasks import build_task

        try:
            self.task = build_task(cfg, info)
            self.task.check()
            if cfg.train.test_eval == "never" and not self.task.has_validation:
                raise ConfigError(f"train.test_eval=never evaluates the validation split only, and {cfg.task.name} "
                                  "has none here (image tasks: data.validation=N)")  # fmt: skip
            torch.manual_seed(cfg.seed)  # identical initialization on every worker
            self.model = self.task.build_model().to(info.device)
            compressor = dgc.build_compressor(cfg.compression)
            self.sync = dgc.GradientSync.from_config(cfg.sync, self.model, compressor, comm)
        except ConfigError:
            raise
        except (ValueError, TypeError) as exc:
            raise ConfigError(str(exc).splitlines()[0]) from None
        torch.manual_seed(seeding.mix(cfg.seed, info.rank))  # data order/augmentation differ per worker
        if info.collectives:
            for tensor in self.model.state_dict().values():
                dist.broadcast(tensor, src=0)
        if self.sync.exchange_reason and info.is_main:
            print(self.sync.exchange_reason, flush=True)
        if cfg.local_steps.every and cfg.sync.ddp_hook:
            raise ConfigError("local_steps.every needs sync.ddp_hook=false: DDP would average every step's "
                              "gradient")  # fmt: skip
        self.net: torch.nn.Module = self.model
        self._weights = [p.detach() for p in self.model.parameters() if p.is_floating_point()]  # checked each step
        self._buffers = list(self.model.buffers())
        self._buffers_before = [b.detach().clone() for b in self._buffers]
        if cfg.sync.ddp_hook and info.collectives:
            self.net = DistributedDataParallel(
                self.model, device_ids=[info.device] if info.device.type == "cuda" else None
            )
            self.net.register_comm_hook(self.sync, dgc.ddp_comm_hook)
        o = cfg.optim
        self.base_lr = o.lr * (info.world_size if o.scale_lr else 1)
        params = [p for p in self.model.parameters() if p.requires_grad]
        groups: list[dict[str, Any]] = [{"params": params}]
        if o.no_decay_1d:
            groups = [
                {"params": [p for p in params if p.dim() > 1]},
                {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0},
            ]
        self.optimizer = self._optimizer(groups)
        #: local steps (DiLoCo, SparseLoCo): the sync exchanges a pseudo-gradient every H steps
        self.local: dgc.LocalSteps | None = None
        if cfg.local_steps.every:
            try:  # after the broadcast: every worker's anchor is equal
                self.local = cfg.local_steps.build(self.sync, self.optimizer)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        #: the exchange and the update, one call in every mode (per step, DDP's hook, local steps)
        self.stepper: dgc.EveryStep | dgc.LocalSteps = self.local or dgc.EveryStep(
            self.sync, self.optimizer, hooked=self.net is not self.model
        )
        schedule = getattr(compressor, "schedule", None)
        self.compression_warmup = schedule.warmup_epochs if schedule is not None else 0.0
        self.steps_per_epoch = self.task.batches_per_epoch() // cfg.train.accumulate
        if self.steps_per_epoch < 1:
            raise ConfigError("fewer micro-batches per epoch than train.accumulate: lower it or use more data")
        total = math.ceil(cfg.train.epochs * self.steps_per_epoch)
        self.total_steps = min(total, cfg.train.max_steps) if cfg.train.max_steps else total
        # counters (checkpointed)
        self.step = 0
        self.epoch = 0
        self.batch = 0  # micro-batches done in the current epoch
        self.totals = {"dense": 0, "sent": 0, "steps": 0, "dense_all": 0, "sent_all": 0, "wall": 0.0,
                       "skipped": 0, "bad_streak": 0}  # fmt: skip
        self.last_eval: dict[str, float] = {}
        self.last_eval_step = -1
        self.window: list[dict[str, float]] = []  # the steps since the last log line (checkpointed)
        self.saved_step: int | None = None  # the step of the last checkpoint this run saved or resumed from
        self.files = RunFiles(cfg, info)
        self.callbacks = list(callbacks)
        self.stop_signal: str | None = None  # the signal that asked this worker to stop
        self._stopping = False  # every worker agreed to stop after this step
        self._checkpoint_requested = False  # rank 0 asked for a checkpoint by time
        self._last_checkpoint = time.monotonic()

    def _optimizer(self, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        """``optim.name``'s optimizer. AdamW steps on the averaged gradient; it cannot be fed by a compressor that
        keeps the momentum itself (DGC's momentum correction: its averaged gradient is already a momentum step)."""
        o = self.cfg.optim
        if o.name == "sgd":
            return dgc.SGD(groups, self.sync, lr=self.base_lr, momentum=o.momentum, nesterov=o.nesterov,
                           weight_decay=o.weight_decay)  # fmt: skip
        if self.sync.compressor.owns_momentum:
            raise ConfigError(
                f"compression={self.cfg.compression.name} keeps the optimizer's momentum (momentum correction), "
                "which optim.name=adamw cannot take: use optim.name=sgd (DGC as published), or "
                "compression.momentum_correction=false (sparse gradients with error feedback, AdamW on their average)"
            )
        return torch.optim.AdamW(groups, lr=self.base_lr, betas=tuple(o.betas), eps=o.eps,
                                 weight_decay=o.weight_decay)  # fmt: skip

    # -- the loop ------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """Train to the end (the summary), or raise :class:`Interrupted` / :class:`Diverged` / ConfigError."""
        handlers = self._catch_stop_signals()
        try:
            state = self.files.open()
            if state is not None:
                self._restore(state)
                done = self.step >= self.total_steps and self.last_eval_step == self.step
                if done and self.files.complete(self.step):  # (else the summary is not written yet: the loop does)
                    return self._summary()
            return self._loop()
        finally:
            for signum, handler in handlers.items():
                signal.signal(signum, handler)
            self.files.close()

    def _catch_stop_signals(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}

        def stop(signum: int, frame: Any) -> None:
            self.stop_signal = signal.Signals(signum).name
            self.sync.request("stop")

        return {signum: signal.signal(signum, stop) for signum in STOP_SIGNALS}

    def _loop(self) -> dict[str, Any]:
        self.files.start_progress(self.total_steps, self.step)
        started = time.perf_counter() - self.totals["wall"]
        per_epoch = self.steps_per_epoch * self.cfg.train.accumulate
        while self.step < self.total_steps:
            if self.batch == 0:
                self.task.start_epoch(self.model, self.epoch)
            batches = self.task.train_batches(self.epoch, start=self.batch)
            while self.step < self.total_steps and self.batch + self.cfg.train.accumulate <= per_epoch:
                self.window.append(self.train_step(batches))
                self.files.tick(self.step)
                self.totals["wall"] = time.perf_counter() - started
                if self.step % self.cfg.train.log_every == 0 or self.step == self.total_steps:
                    self.files.log_step(self._summarize(self.window))
                    self.window = []
                # at the end of an epoch or of the run, the checkpoint comes after the evaluation (below):
                # one taken before it would, on resume, evaluate and log that step a second time
                ends = self.step == self.total_steps or self.batch >= per_epoch
                every = self.cfg.train.checkpoint_every
                if not ends and (self._stopping or self._checkpoint_requested or (every and self.step % every == 0)):
                    self._checkpoint()
                self._notify("after_step")
                if self._stopping and not ends:
                    raise Interrupted(self._stopped())
            if self.batch >= per_epoch:
                self._evaluate(end_of_epoch=True)
                self.epoch += 1
                self.batch = 0
                self._checkpoint()
                if self._stopping and self.step < self.total_steps:
                    raise Interrupted(self._stopped())
        if self.last_eval_step != self.step:
            self._evaluate(end_of_epoch=False)
            self._checkpoint()
        self.totals["wall"] = time.perf_counter() - started
        summary = self._summary()
        self.files.finish(summary)
        return summary

    def _diverged(self, steps: str, where: str) -> str:
        n = self.cfg.train.max_bad_steps
        return (f"{n} {steps} had non-finite gradients {where} and were skipped (train.max_bad_steps={n}): "
                f"the run diverged; lower optim.lr, or check the data; {self._last_good()}")  # fmt: skip

    def _check_weights(self) -> None:
        """After an update from a finite gradient: the weights are still finite, else the run ends here
        (:class:`Diverged`), before a checkpoint can hold them. The weights are equal on every rank (one averaged
        gradient), so every rank decides alike; one host read a step."""
        if bool(torch.stack(torch._foreach_norm(self._weights, ord=math.inf)).isfinite().all()):
            return
        bad = [n for n, p in self.model.named_parameters() if not bool(torch.isfinite(p.detach()).all())]
        names = ", ".join(bad[:3]) + (", ..." if len(bad) > 3 else "")
        raise Diverged(f"the update of step {self.step + 1} made the weights non-finite ({names}) from a finite "
                       f"gradient: the run diverged; lower optim.lr; {self._last_good()}")  # fmt: skip

    def _last_good(self) -> str:
        """Where the last good state is, for the line that ends a diverged run."""
        if self.saved_step is None:
            return "no checkpoint was saved before"
        return f"the last checkpoint (step {self.saved_step}, {self.files.run_dir}) holds the last good state"

    def _stopped(self) -> str:
        why = f"on {self.stop_signal}" if self.stop_signal else "on another rank's signal"
        return f"stopped at step {self.step} {why}; checkpoint saved in {self.files.run_dir}: to continue, " + (
            self.files.continue_with()
        )

    def _notify(self, event: str) -> None:
        for callback in self.callbacks:
            hook = getattr(callback, event, None)
            if hook is not None:
                hook(self)

    def train_step(self, batches: Iterator[Any]) -> dict[str, float]:
        """One optimizer step on the next micro-batches of ``batches``; the step's measurements."""
        cfg = self.cfg
        acc = cfg.train.accumulate
        epoch_f = self.epoch + self.batch / (self.steps_per_epoch * acc)
        lr = learning_rate(cfg, self.base_lr, epoch_f)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.sync.set_epoch(epoch_f)
        minutes = self.cfg.train.checkpoint_minutes
        if self.info.is_main and minutes and time.monotonic() - self._last_checkpoint >= 60 * minutes:
            self.sync.request("checkpoint")  # agreed by every rank in this step's exchange
        self._notify("before_step")
        t0 = time.perf_counter()
        # what the forward passes change besides the loss (BatchNorm statistics), put back if the step is skipped
        if self._buffers:
            torch._foreach_copy_(self._buffers_before, self._buffers)
        loss_sum = 0.0
        for i in range(acc):
            batch = next(batches)
            no_sync = isinstance(self.net, DistributedDataParallel) and i < acc - 1
            with self.net.no_sync() if no_sync else contextlib.nullcontext(), self._autocast():
                loss = self.task.loss(self.net, batch) / acc
            loss.backward()
            loss_sum += float(loss.detach())
        self._notify("after_backward")
        # clipping after aggregation is the dense baseline's; with local clipping on (DGC), each worker
        # already clipped its own gradient before accumulating it, and the aggregated sparse update
        # (many steps' accumulated gradient) must not be clipped again (paper, section 3.2)
        clip = cfg.optim.grad_clip if cfg.sync.clip_norm is None else 0.0
        stepped = self.stepper.step(
            before_update=(lambda: torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)) if clip else None,
            last=self.step + 1 == self.total_steps,
        )
        if stepped.skipped and self._buffers:  # nothing of a skipped step stays: not its batch's statistics either
            torch._foreach_copy_(self._buffers, self._buffers_before)
        if not stepped.skipped and self.local is None:  # (with local steps each rank's weights are its own)
            self._check_weights()
        self.optimizer.zero_grad(set_to_none=True)
        stats, sent_bytes = stepped.stats, stepped.sent_bytes
        skipped = stepped.skipped or stepped.outer_skipped  # nothing of this step counts
        t2 = time.perf_counter()
        self.step += 1
        self.batch += acc
        self._stopping |= "stop" in stepped.requests
        self._checkpoint_requested |= "checkpoint" in stepped.requests
        if "diverged" in stepped.requests:  # local steps: some rank's own streak, seen by all at this exchange
            raise Diverged(
                self._diverged("inner steps in a row", f"on some rank (seen at the exchange of step {self.step})")
            )
        if skipped:
            self.totals["skipped"] += 1
            self.totals["bad_streak"] += 1
            if self.totals["bad_streak"] == cfg.train.max_bad_steps and self.local is not None:
                self.sync.request("diverged")  # this rank's own inner steps: every rank ends at the next exchange
            elif self.totals["bad_streak"] >= cfg.train.max_bad_steps and self.local is None:
                raise Diverged(self._diverged(f"steps in a row (to step {self.step})", "on some rank"))
        else:
            self.totals["bad_streak"] = 0
            # the wire ratio counts steps that sent gradients: not the skipped ones
            self.totals["dense_all"] += stats.dense_bytes
            self.totals["sent_all"] += sent_bytes
            if epoch_f >= self.compression_warmup:
                self.totals["dense"] += stats.dense_bytes
                self.totals["sent"] += sent_bytes
                self.totals["steps"] += 1
        return {
            "train_loss": loss_sum,
            "lr": lr,
            "epoch": epoch_f,
            "density": stats.density,
            "sent_bytes": sent_bytes,
            "dense_bytes": stats.dense_bytes,
            "compute_s": (t2 - t0) - stepped.exchange_s,
            "compress_s": stepped.exchange_s - stepped.communicate_s,
            "communicate_s": stepped.communicate_s,
            "step_s": t2 - t0,
            "skipped": float(skipped),
        }

    def _autocast(self):
        if self.cfg.train.bf16:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _summarize(self, window: list[dict[str, float]]) -> dict[str, Any]:
        mean = {k: sum(w[k] for w in window) / len(window) for k in window[0]}
        last = window[-1]
        out = {
            "kind": "train",
            "step": self.step,
            "epoch": round(last["epoch"], 4),
            "train_loss": mean["train_loss"] if math.isfinite(mean["train_loss"]) else None,
            "lr": last["lr"],
            "density": last["density"],
            "sent_bytes": last["sent_bytes"],
            "wire_ratio": last["dense_bytes"] / max(last["sent_bytes"], 1),
            "compute_s": mean["compute_s"],
            "compress_s": mean["compress_s"],
            "communicate_s": mean["communicate_s"],
            "step_s": mean["step_s"],
            "skipped": int(sum(w["skipped"] for w in window)),
        }
        if self.local is not None:  # most steps send nothing and one sends H steps' worth: over the line's steps
            out["sent_bytes"] = sum(w["sent_bytes"] for w in window)
            out["wire_ratio"] = sum(w["dense_bytes"] for w in window) / max(out["sent_bytes"], 1)
            out["ratio_steps"] = len(window)
        return out

    def _evaluate(self, end_of_epoch: bool) -> None:
        per_epoch = self.steps_per_epoch * self.cfg.train.accumulate
        epoch = self.epoch + 1 if end_of_epoch else round(self.epoch + self.batch / per_epoch, 4)
        # train.test_eval=end: the test split once, at the run's last evaluation; the validation split before it
        # train.test_eval=never: the validation split only (runs that choose settings)
        when = self.cfg.train.test_eval
        test = when == "every" or (when == "end" and self.step == self.total_steps)
        if not test and not self.task.has_validation:
            return
        split = "" if test else f" (validation split only; {'test at the end' if when == 'end' else 'no test'})"
        self.files.console(f"evaluating at step {self.step} (epoch {epoch:g}){split}")
        with self.local.synced() if self.local is not None else contextlib.nullcontext():
            # local steps: the weights every worker last agreed on (the run's last step is an exchange)
            self.last_eval = self.task.evaluate(self.model, test=test)
        self.last_eval_step = self.step
        bad = [k for k, v in self.last_eval.items() if isinstance(v, float) and not math.isfinite(v)]
        if bad:
            self.files.console(f"warning: the evaluation at step {self.step} is not finite ({', '.join(bad)}); "
                               "check the evaluation data")  # fmt: skip
        record = {"kind": "eval", "step": self.step, "epoch": epoch}
        record.update(self.last_eval)
        record["wire_ratio"] = self._wire_ratio()
        self.files.log_eval(record)

    def _wire_ratio(self) -> float | None:
        """Over the steps after the compression warm-up; over all steps when the run has none of those."""
        if self.totals["steps"]:
            return self.totals["dense"] / self.totals["sent"] if self.totals["sent"] else None
        return self.totals["dense_all"] / self.totals["sent_all"] if self.totals["sent_all"] else None

    def _summary(self) -> dict[str, Any]:
        t = self.totals
        after_warmup = t["steps"] > 0
        dense, sent, steps = (t["dense"], t["sent"], t["steps"]) if after_warmup else (t["dense_all"], t["sent_all"], 0)
        counted = steps if after_warmup else self.step - t["skipped"]
        return {
            "task": self.cfg.task.name,
            "compression": self.cfg.compression.name,
            "method": method_name(self.cfg),
            "local_steps": self.cfg.local_steps.every,
            "world_size": self.info.world_size,
            "steps": self.step,
            "epochs": self.step / self.steps_per_epoch,
            "metrics": self.last_eval,
            "wire_ratio": dense / sent if sent else None,
            "bytes_per_step": sent / counted if counted else None,
            "dense_bytes_per_step": dense / counted if counted else None,
            # which steps the ratio and the bytes are over
            "wire_ratio_over": "steps after the compression warm-up"
            if after_warmup
            else "all steps (the run ended inside the compression warm-up)",
            "wire_ratio_steps": counted,
            "wire_ratio_all_steps": t["dense_all"] / max(t["sent_all"], 1),
            "compression_warmup_epochs": self.compression_warmup,
            "skipped_steps": t["skipped"],
            "wall_s": t["wall"],
            "run_dir": str(self.files.run_dir),
        }

    # -- checkpoints ---------------------------------------------------------------------
    def _checkpoint(self) -> None:
        local = {"compression": self.sync.state_dict(), "rng": torch.get_rng_state(), "task": self.task.state_dict()}
        if self.info.world_size > 1:  # each worker's own BatchNorm statistics (the model holds rank 0's)
            local["buffers"] = {n: b.detach().cpu().clone() for n, b in self.model.named_buffers()}
        if self.local is not None:  # between exchanges each worker's weights and inner optimizer are its own
            local["local_steps"] = self.local.state_dict()
            local["weights"] = {n: p.detach().cpu().clone() for n, p in self.model.named_parameters()}
            local["optimizer"] = self.optimizer.state_dict()
        if self.info.device.type == "cuda":
            local["cuda_rng"] = torch.cuda.get_rng_state(self.info.device)
        per_rank = _gather(local, self.info)
        if self.info.is_main:
            state = {
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "counters": {
                    "step": self.step,
                    "epoch": self.epoch,
                    "batch": self.batch,
                    "totals": dict(self.totals),
                    "window": list(self.window),
                },  # fmt: skip
                "last_eval": (self.last_eval, self.last_eval_step),
                "world_size": self.info.world_size,
                "ranks": per_rank,
                "config": asdict(self.cfg),
            }
            error: tuple[str, str] | None = None
            bad = checkpoint.nonfinite(state)
            if bad:  # never saved: it would rotate the last good checkpoint out
                error = ("diverged", f"the state of step {self.step} holds non-finite values ({', '.join(bad)}): "
                         f"not saved; the run diverged; {self._last_good()}")  # fmt: skip
            else:
                try:
                    self.files.save_checkpoint(state)
                except ConfigError as exc:  # e.g. the disk is full: every rank stops with the same message
                    error = ("config", str(exc))
        else:
            error = None
        if self.info.collectives:
            box = [error]
            dist.broadcast_object_list(box, src=0)
            error = box[0]
        if error:
            raise (Diverged if error[0] == "diverged" else ConfigError)(error[1])
        self.saved_step = self.step
        self._checkpoint_requested = False
        self._last_checkpoint = time.monotonic()

    def _restore(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint (its world size and settings were checked by :meth:`RunFiles.open`)."""
        self.saved_step = state["counters"]["step"]
        if state["world_size"] != self.info.world_size:
            self._restore_elsewhere(state)
            return
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        mine = state["ranks"][self.info.rank]
        self.sync.load_state_dict(mine["compression"])
        self.task.load_state_dict(mine.get("task") or {})
        torch.set_rng_state(mine["rng"])
        if "buffers" in mine:
            with torch.no_grad():
                for name, buf in self.model.named_buffers():
                    buf.copy_(mine["buffers"][name])
        if self.local is not None:
            if "local_steps" not in mine:
                raise ConfigError("the checkpoint was written without local steps: it cannot continue with "
                                  "local_steps.every set")  # fmt: skip
            self.local.load_state_dict(mine["local_steps"])
            self.optimizer.load_state_dict(mine["optimizer"])
            with torch.no_grad():
                for name, p in self.model.named_parameters():
                    p.copy_(mine["weights"][name])
        if "cuda_rng" in mine and self.info.device.type == "cuda":
            torch.cuda.set_rng_state(mine["cuda_rng"], self.info.device)
        c = state["counters"]
        self.step, self.epoch, self.batch = c["step"], c["epoch"], c["batch"]
        self.totals.update(c["totals"])
        self.window = list(c.get("window", []))
        self.last_eval, self.last_eval_step = state["last_eval"]

    def _restore_elsewhere(self, state: dict[str, Any]) -> None:
        """Continue a checkpoint of N workers on N' (``resume_allow=[world_size]``): every rank's compression state
        remapped so that the mean over workers of each residual and momentum is kept (:mod:`dgc.elastic`), each
        worker's BatchNorm statistics from old rank ``rank mod N``, the position in the epoch kept in samples, the
        step count and the random streams made again for N' workers."""
        from dgc import elastic

        old, new, rank = state["world_size"], self.info.world_size, self.info.rank
        if self.local is not None:
            raise ConfigError("a run with local steps resumes on the same number of workers only (between exchanges "
                              "each worker's weights are its own)")  # fmt: skip
        if any(r.get("task") for r in state["ranks"]):
            raise ConfigError(f"{self.cfg.task.name} keeps its data position per worker: it resumes on the same "
                              f"number of workers only ({old})")  # fmt: skip
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.sync.load_state_dict(elastic.remap([r["compression"] for r in state["ranks"]], new)[rank])
        theirs = state["ranks"][rank % old]
        if "buffers" in theirs:
            with torch.no_grad():
                for name, buf in self.model.named_buffers():
                    buf.copy_(theirs["buffers"][name])
        c = state["counters"]
        acc = self.cfg.train.accumulate
        self.epoch = c["epoch"]
        # the samples of this epoch already seen stay seen: batch counts one worker's micro-batches
        self.batch = (c["batch"] * old // new) // acc * acc
        self.step = self.epoch * self.steps_per_epoch + self.batch // acc
        torch.manual_seed(seeding.mix(self.cfg.seed, rank, self.step))
        self.totals.update(c["totals"])
        self.window = []
        self.last_eval, last_step = state["last_eval"]
        self.last_eval_step = self.step if last_step == c["step"] else -1
        self.files.console(f"resuming on {new} workers a checkpoint of {old} (step {c['step']} of {old} workers = "
                           f"step {self.step} of {new}): residuals and momenta remapped, their mean over workers "
                           "kept")  # fmt: skip


def _gather(obj: Any, info: DistInfo) -> list[Any]:
    if not info.collectives:
        return [obj]
    out = [None] * info.world_size if info.is_main else None
    dist.gather_object(obj, out, dst=0)
    return out if out is not None else []
