"""GradientSync: the one object that turns local gradients into averaged ones.

Used two ways, with the same arithmetic:

* library path: ``loss.backward(); sync.step(); optimizer.step()``;
* DDP: ``ddp_model.register_comm_hook(sync, dgc.ddp_comm_hook)`` (see :mod:`dgc.hook`).

Per step, over all gradients of the step:

1. **local gradient clipping** (``clip_norm``): this worker's gradient is scaled so its global L2
   norm is at most ``clip_norm * N**0.5``, before anything is accumulated (a residual keeps
   unsent gradient for hundreds of steps, so clipping after aggregation would be too late) and
   without waiting for other workers. ``clip_norm`` is the dense run's clip of the *averaged*
   gradient: N independent local gradients of norm ``c * sqrt(N)`` average to norm about ``c``.
   The paper's ``N**-0.5`` scales a worker's 1/N share of a *summed* gradient; on the worker's
   mean gradient the same rule reads ``N**0.5`` (docs/design.md).
2. **weight decay** for tensors whose momentum the compressor keeps (DGC with momentum
   correction): ``g += wd * w`` locally, so it enters the momentum like in ``torch.optim.SGD``.
   Other tensors get weight decay in the optimizer after aggregation.
3. tensors are split by the :class:`Policy`: compressed ones go to the compressor, the rest
   (biases, BatchNorm) are exchanged dense in one collective.
4. the compressor exchanges and writes the averaged result into the gradients.

Before step 1, the workers agree in one tiny allreduce (a byte per flag) on two things:

* **non-finite gradients**: when any worker's gradient holds a NaN or an Inf, every worker skips
  the step: nothing enters momentum, residuals or the model, the gradients are zeroed and
  :attr:`StepStats.skipped` is set (:class:`dgc.SGD` then does not step; with another optimizer,
  skip ``optimizer.step()`` yourself);
* **requests** (:meth:`GradientSync.request`, e.g. from a signal handler): a ``"stop"`` or
  ``"checkpoint"`` asked for on any worker is seen by all of them at the same step
  (:attr:`StepStats.requests`), so they can stop or checkpoint at the same step boundary.

Everything runs in one thread in a fixed tensor order, so every worker issues the same
collectives in the same order. Every collective goes through the :class:`~dgc.comm.Comm` the
sync is given (by default the default process group): the seam where another exchange topology
plugs in.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from dgc.comm import Comm, Traffic
from dgc.compressors import Compressor
from dgc.compressors.base import Item
from dgc.compressors.onebit import OneBit
from dgc.exchanges import Exchange, build_exchange
from dgc.guard import REQUESTS, StepGuard
from dgc.openstep import OpenStep, StateCopy
from dgc.packing import Rider
from dgc.policy import Policy
from dgc.stats import StepStats
from dgc.timing import Phases
from dgc.wire import DTYPES

#: ``accumulate``: what the compressed tensors' momentum and residual hold
ACCUMULATE = ("gradients", "updates")


def check_accumulate(accumulate: Any) -> None:
    if accumulate not in ACCUMULATE:
        raise ValueError(f"sync.accumulate must be one of {', '.join(ACCUMULATE)}, got {accumulate!r}")


def check_clip_norm(clip_norm: Any) -> None:
    if clip_norm is None:
        return
    if isinstance(clip_norm, bool) or not isinstance(clip_norm, int | float) or math.isnan(clip_norm) or clip_norm <= 0:
        raise ValueError(f"clip_norm must be a number > 0 or None, got {clip_norm!r}")


#: ``pack``: what else travels in the compressor's own message (:mod:`dgc.packing`)
PACKS = ("none", "dense", "all")


def check_pack(pack: Any, exchange: str, dense_values: str) -> None:
    """ValueError unless ``pack`` is one of :data:`PACKS` that the exchange and the dense values' format allow (the
    overlapped exchange packs every one: each bucket's flags ride in its own message, read at the step's end)."""
    if pack not in PACKS:
        raise ValueError(f"sync.pack must be one of {', '.join(PACKS)}, got {pack!r}")
    if pack != "none" and exchange != "flat":
        raise ValueError(f"sync.pack={pack} needs sync.exchange=flat, got {exchange} (it sends the dense values its "
                         "own way)")  # fmt: skip
    if pack != "none" and dense_values == "1bit":
        raise ValueError(f"sync.pack={pack} sends the dense values as they are: not with "
                         "sync.policy.dense_values=1bit (1-bit keeps residuals of its own); "
                         "use fp32, fp16 or bf16")  # fmt: skip


#: ``clip_scope``: what local clipping bounds (GradientSync's docstring)
CLIP_SCOPES = ("auto", "step", "tensor")


def resolve_clip_scope(clip_scope: Any, overlap: bool, clip_norm: float | None) -> str:
    """``step`` or ``tensor`` from a ``clip_scope`` (:data:`CLIP_SCOPES`); ValueError for a scope the overlap cannot
    clip by."""
    if clip_scope not in CLIP_SCOPES:
        raise ValueError(f"sync.clip_scope must be one of {', '.join(CLIP_SCOPES)}, got {clip_scope!r}")
    if clip_scope == "auto":
        return "tensor" if overlap else "step"
    if clip_scope == "step" and overlap and clip_norm is not None:
        raise ValueError("sync.clip_scope=step clips by the norm of the whole gradient, which the overlapped exchange "
                         "never holds (it sends each bucket as it is ready): use clip_scope=tensor (or auto) with "
                         "sync.overlap=true")  # fmt: skip
    return clip_scope


class Hyper(Protocol):
    """What GradientSync needs from the optimizer (implemented by :class:`dgc.optim.SGD`)."""

    def hyper(self, param: torch.Tensor) -> tuple[float, bool, float]:
        """``(momentum, nesterov, weight_decay)`` for ``param``."""
        ...

    def learning_rate(self, param: torch.Tensor) -> float:
        """The learning rate ``param`` is stepped with now (``accumulate="updates"``)."""
        ...


class GradientSync:
    """Compress, exchange and average the gradients of ``model`` (see the module docstring).

    Args:
        model: a module, or an iterable of ``(name, parameter)``; names key the state.
        compressor: from :func:`dgc.build_compressor`.
        policy: which tensors are compressed (ignored by dense compressors).
        clip_norm: the clip of the averaged gradient; each worker clips its own at ``clip_norm * N**0.5``; None: off.
        comm: the collectives to use (default: ``Comm(group)``).
        group: process group of the default ``Comm`` (None: the default group, or a single process).
        timing: time the phases (on CUDA this synchronizes the device at phase boundaries).
        check_finite: skip, on every worker, a step in which any worker's gradient is not finite.
        exchange: how the compressed tensors travel (:mod:`dgc.exchanges`): ``flat``, ``hierarchical``,
            ``sparse_allreduce``, or an :class:`~dgc.exchanges.Exchange`.
        ranks_per_node: for ``hierarchical`` (None: from the launcher's environment).
        local_bus: for ``hierarchical``, how a machine's ranks share data (:data:`dgc.localbus.LOCAL_BUSES`).
        accumulate: ``"gradients"`` (the paper's) or ``"updates"``: the compressed gradients are multiplied by
            their learning rate (``optimizer.learning_rate(param)``, :class:`dgc.SGD`) before they enter the
            compressor and the exchanged result is divided by it again, so the optimizer's ``lr * G`` applies
            the sum of rate-scaled contributions: a value that waited in the residual while the rate dropped
            moves the weights by the rate of the step that computed it, not the rate of the step that sends it
            (Gradient Dropping's accumulation). The same as ``"gradients"`` while the rate is constant.
        overlap: under :func:`dgc.ddp_comm_hook`, compress and exchange each DDP bucket as soon as DDP hands it
            over, in a thread of its own, while the backward pass goes on (:mod:`dgc.overlap`). The library path
            (:meth:`step`) is unchanged, except that it clips like the overlapped hook.
        clip_scope: ``"step"``: local clipping bounds the norm of the whole local gradient (needs every tensor: the
            serial exchange only); ``"tensor"``: each tensor is clipped on its own, to its share of the same bound,
            ``clip_norm * N**0.5 * (numel / total numel)**0.5`` (a gradient whose every tensor is at its bound has
            exactly the whole-gradient bound); ``"auto"``: ``tensor`` with ``overlap``, ``step`` otherwise.
        pack: what else travels in the compressor's own message (:mod:`dgc.packing`): ``"none"``; ``"dense"``: the
            values the policy leaves dense (biases, BatchNorm), instead of in an allreduce of their own (one
            collective fewer per step, the same average up to rounding, more bytes received where the compressor
            allgathers); ``"all"``: those and the step's agreement (non-finite gradients, requests), instead of in an
            allreduce before the step (one more collective fewer; the compression state of the step is copied first
            and put back when any worker's gradient was not finite; with ``overlap``, each bucket's flags ride in
            its message and are read once, at the step's end). ``flat`` exchange only; not with
            ``policy.dense_values="1bit"``.
    """

    def __init__(
        self,
        model: torch.nn.Module | Iterable[tuple[str, torch.nn.Parameter]],
        compressor: Compressor,
        *,
        policy: Policy | None = None,
        clip_norm: float | None = None,
        comm: Comm | None = None,
        group: dist.ProcessGroup | None = None,
        timing: bool = True,
        check_finite: bool = True,
        exchange: str | Exchange = "flat",
        ranks_per_node: int | None = None,
        local_bus: str = "auto",
        accumulate: str = "gradients",
        overlap: bool = False,
        clip_scope: str = "auto",
        pack: str = "none",
    ):
        named = model.named_parameters() if isinstance(model, torch.nn.Module) else model
        self.params: list[tuple[str, torch.nn.Parameter]] = [(n, p) for n, p in named if p.requires_grad]
        self._names = {id(p): n for n, p in self.params}
        self._order = {n: i for i, (n, _) in enumerate(self.params)}
        check_clip_norm(clip_norm)
        check_accumulate(accumulate)
        self.accumulate = accumulate
        #: exchange each DDP bucket as DDP hands it over, under the rest of the backward pass (:mod:`dgc.overlap`)
        self.overlap = bool(overlap)
        #: what local clipping bounds: ``step`` (the whole gradient) or ``tensor`` (each tensor its share)
        self.clip_scope = resolve_clip_scope(clip_scope, self.overlap, clip_norm)
        self._total_numel = sum(p.numel() for _, p in self.params)
        if comm is not None and group is not None:
            raise ValueError("give GradientSync a comm or a group, not both")
        self.compressor = compressor
        self.policy = policy or Policy()
        self.clip_norm = clip_norm
        self.comm = comm if comm is not None else Comm(group)
        # a comm made here without a process group: checked at the first step (one built too early)
        self._check_group = comm is None and not self.comm.distributed
        self.compressor.bind(self.comm)
        self.exchange = (
            exchange
            if isinstance(exchange, Exchange)
            else build_exchange(exchange, self.comm, ranks_per_node, local_bus)
        )
        if not compressor.handles_all_tensors or self.exchange.name != "flat":
            self.exchange.check(compressor)
        check_pack(pack, self.exchange.name, self.policy.dense_values)
        #: what else travels in the compressor's message: none, dense (values), all (and the agreement)
        self.pack = pack
        #: why the exchange was chosen (SyncConfig with exchange=auto), empty otherwise
        self.exchange_reason = ""
        #: the exchange of the tensors left dense, when it keeps state (1-bit with error feedback)
        self.dense_compressor: OneBit | None = None
        if self.policy.dense_values == "1bit" and not compressor.handles_all_tensors:
            self.dense_compressor = OneBit()
            self.dense_compressor.bind(self.comm)
        self.timing = timing
        self.optimizer: Hyper | None = None
        self.steps = 0
        self.last: StepStats | None = None
        #: whether load_state_dict restored this sync's state (dgc.SGD warns on a resume without it)
        self.restored = False
        self.guard = StepGuard(self.comm, check_finite, self.exchange.agree_max_)
        #: with ``pack="all"``: the agreement's flags averaged over the workers, once they have travelled
        self._agreed: torch.Tensor | None = None
        self._before = StateCopy()
        #: the overlapped hook's copy, added to bucket by bucket (:meth:`sync_part`); one step is open at a time
        self._part_before = StateCopy()
        self._epoch_set = False

    # -- configuration -------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.comm.world_size

    def bind_optimizer(self, optimizer: Hyper) -> None:
        self.optimizer = optimizer

    def is_compressed(self, param: torch.Tensor) -> bool:
        return self.compressor.handles_all_tensors or self.policy.compresses(param)

    def owns_momentum(self, param: torch.Tensor) -> bool:
        """True when the averaged gradient of ``param`` already includes momentum and weight decay."""
        return self.compressor.owns_momentum and self.is_compressed(param)

    def set_epoch(self, epoch: float) -> None:
        """Drive the compression warm-up: call it every step with the fractional epoch
        (``epoch + i / steps_per_epoch``). Without it the density stays at the first warm-up stage."""
        self._epoch_set = True
        self.compressor.set_epoch(epoch)

    def request(self, what: str) -> None:
        """Ask every worker to see ``what`` (one of :data:`dgc.guard.REQUESTS`) in the next step's
        :attr:`StepStats.requests`. Safe to call from a signal handler."""
        self.guard.request(what)

    def name_of(self, param: torch.Tensor) -> str:
        try:
            return self._names[id(param)]
        except KeyError:
            raise KeyError("parameter not registered with this GradientSync (built from another model?)") from None

    # -- the step ------------------------------------------------------------------
    def step(self) -> StepStats:
        """Average the ``.grad`` of every parameter (library path). A missing grad counts as zeros."""
        return self.sync(self._all_grads())

    def _all_grads(self) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        """``(param, param.grad)`` of every parameter, a missing grad made zeros."""
        pairs = []
        for _, p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            pairs.append((p, p.grad))
        return pairs

    def _norms(self, grads: list[torch.Tensor], clip: bool) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """The gradients' norms (one dispatch for every tensor; none when neither the clip nor the non-finite check
        needs them) and whether one is not finite, left on the device (None: unchecked)."""
        norms = list(torch._foreach_norm(grads)) if grads and (self.guard.check_finite or clip) else []
        return norms, self.guard.not_finite(norms)

    def _guard(self, grads: list[torch.Tensor], phases: Phases, clip: bool
               ) -> tuple[list[torch.Tensor], bool, tuple[str, ...], int]:  # fmt: skip
        """The agreement every step starts with: the gradient norms (for the clip and the non-finite check: one
        dispatch for every tensor; whether one is not finite stays on the device until the agreement reads it
        with the requests, one host read for both), whether to skip, what was requested, and the control bytes
        (not gradient traffic: reported apart). A skipped step's gradients are zeroed."""
        norms, agreed, control = self._agree_later(grads, phases, clip)
        skipped, requests = self.guard.read(agreed)
        if skipped:
            torch._foreach_zero_(grads)
        return norms, skipped, requests, control

    def _agree_later(self, grads: list[torch.Tensor], phases: Phases, clip: bool
                     ) -> tuple[list[torch.Tensor], torch.Tensor, int]:  # fmt: skip
        """:meth:`_guard` without the host read (a part of a step, :meth:`sync_part`, where :meth:`end` reads every
        part's): the gradient norms, the workers' flags reduced by maximum and left on the device, the control
        bytes."""
        self.comm.phases = phases
        self.comm.reset_traffic()
        with phases("compress"):
            norms, bad = self._norms(grads, clip)
        agreed = self.guard.reduce(bad)
        return norms, agreed, self.comm.reset_traffic().sent

    def _packs_agreement(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Whether these pairs' exchange carries the agreement's flags (``pack="all"`` and a compressed tensor)."""
        return self.pack == "all" and any(self.is_compressed(p) for p, _ in pairs)

    def _flags(self, grads: list[torch.Tensor], phases: Phases, clip: bool
               ) -> tuple[list[torch.Tensor], torch.Tensor, int]:  # fmt: skip
        """:meth:`_guard`'s counterpart when the flags ride in the compressor's message: the gradient norms, this
        worker's flags (nothing sent yet) and their bytes in the message (control, reported apart)."""
        self.comm.phases = phases
        self.comm.reset_traffic()
        with phases("compress"):
            norms, bad = self._norms(grads, clip)
            flags = self.guard.flags(bad, grads[0].device)
        return norms, flags, flags.numel() * DTYPES.get(self.policy.dense_values, torch.float32).itemsize

    def check_local(self) -> StepStats:
        """This worker's own check, nothing sent (the inner steps of :mod:`dgc.localsteps`, where each worker steps on
        its own): a non-finite gradient here zeroes this worker's gradients and sets :attr:`StepStats.skipped` (one
        host read); requests wait for the next agreement (the next exchange). ``dense_bytes`` is what a dense
        exchange of this step would have sent."""
        pairs = self._all_grads()
        grads = [g for _, g in pairs]
        phases = Phases(cuda_sync=False)
        with phases("compress"):
            _, bad = self._norms(grads, clip=False)
        skipped = bad is not None and bool(bad)
        if skipped:
            torch._foreach_zero_(grads)
        self.comm.reset_traffic()
        return self._finish(pairs, [], phases, 0, 0, skipped, ())

    def sync(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> StepStats:
        """Exchange ``(param, grad)`` pairs in place; grads must be contiguous."""
        pairs = sorted(pairs, key=lambda pg: self._order[self.name_of(pg[0])])
        if self._check_group:
            self._check_group = False
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                raise RuntimeError(
                    "GradientSync was built before the process group existed (a world of one), but this job has "
                    f"{dist.get_world_size()} workers: build it after init_process_group (Lightning: in setup() or "
                    "configure_optimizers(); Accelerate: after Accelerator())"
                )
        if self.steps == 0 and not self._epoch_set:
            self._warn_no_epoch()
        phases = Phases(cuda_sync=self.timing and any(g.is_cuda for _, g in pairs))
        grads = [g for _, g in pairs]
        if self._packs_agreement(pairs):
            return self._sync_in_one(pairs, grads, phases)
        norms, skipped, requests, control = self._guard(grads, phases, clip=bool(self.clip_norm))
        if skipped:
            return self._finish(pairs, [], phases, control, 0, skipped, requests)
        with phases("compress"):
            self._clip(grads, norms)
            compressed, dense = self._prepare(pairs)
        dense_sent = self._exchange(compressed, dense, phases)
        return self._finish(pairs, compressed, phases, control, dense_sent, skipped, requests)

    def _sync_in_one(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], grads: list[torch.Tensor],
                     phases: Phases) -> StepStats:  # fmt: skip
        """``pack="all"``: the step's agreement rides in the compressor's message with the dense values. So the step
        runs before the workers agree on it: its compression state is copied first and put back, on every worker,
        when any worker's gradient was not finite (a non-finite gradient here still goes through the compressor:
        the step is undone everywhere, as :meth:`end` undoes an overlapped one)."""
        norms, flags, control = self._flags(grads, phases, clip=bool(self.clip_norm))
        with phases("compress"):
            self._clip(grads, norms)
            compressed, dense = self._prepare(pairs)
            if self.guard.check_finite:
                self._before.take(self._compressors(), [it.name for it in compressed])
        dense_sent = self._exchange(compressed, dense, phases, flags)
        skipped, requests = self.guard.read(self._agreed)
        if skipped:  # only a step with a non-finite gradient somewhere: then check_finite is on, the copy taken
            self._before.put_back()
            torch._foreach_zero_(grads)
        return self._finish(pairs, [] if skipped else compressed, phases, control, dense_sent, skipped, requests)

    def _prepare(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[list[Item], list[Item]]:
        """The items of the compressed and of the dense tensors; weight decay added where the compressor keeps the
        momentum."""
        compressed, dense = [], []
        decay: dict[float, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for p, g in pairs:
            item, weight_decay = self._item(p, g)
            (compressed if self.is_compressed(p) else dense).append(item)
            if weight_decay:
                grads_of, params_of = decay.setdefault(weight_decay, ([], []))
                grads_of.append(g)
                params_of.append(p)
        with torch.no_grad():  # g += wd * w, one dispatch per weight decay value
            for weight_decay, (grads_of, params_of) in decay.items():
                torch._foreach_add_(grads_of, params_of, alpha=weight_decay)
        return compressed, dense

    def _exchange(self, compressed: list[Item], dense: list[Item], phases: Phases,
                  flags: torch.Tensor | None = None) -> int:  # fmt: skip
        """Exchange the dense, then the compressed tensors (with ``pack``: the dense values, and ``flags`` (the
        agreement's) when given, in the compressor's collectives; their mean over the workers is left in
        :attr:`_agreed`), their averages written into their gradients; returns the bytes of the dense values sent
        (traffic counted from zero before it)."""
        dtype = DTYPES.get(self.policy.dense_values, torch.float32)
        if self.pack != "none" and compressed and (dense or flags is not None):
            bucket = self.exchange.buckets.of("dense", dense) if dense else None
            rider = Rider(dense, dtype, bucket, flags, phases)
            rates = self._scale_by_rate(compressed, phases)
            self.exchange.run_packed(self.compressor, compressed, rider)
            self._agreed = rider.agreed
            dense_sent = sum(it.grad.numel() for it in dense) * dtype.itemsize
        else:
            if self.dense_compressor is not None:
                self.dense_compressor.exchange(dense, self.comm, phases)
            else:
                self.exchange.dense(dense, phases, dtype)
            dense_sent = self.comm.traffic.sent
            rates = self._scale_by_rate(compressed, phases)
            self.exchange.run(self.compressor, compressed, phases)
        if rates is not None:
            with phases("decompress"):  # back to the gradient the optimizer multiplies by its rate
                scaled = [(it.grad, lr) for it, lr in zip(compressed, rates) if lr]
                if scaled:
                    torch._foreach_div_([g for g, _ in scaled], [lr for _, lr in scaled])
        return dense_sent

    # -- the step in parts: one call per DDP bucket (dgc.overlap) --------------------------------------------------
    def begin(self) -> OpenStep:
        """Start a step whose gradients come in parts (:meth:`sync_part`, then :meth:`end`)."""
        if self.steps == 0 and not self._epoch_set:
            self._warn_no_epoch()
        step = OpenStep(Phases(cuda_sync=False), before=self._part_before)
        step.before.start(self._compressors() if self.guard.check_finite else [])
        return step

    def sync_part(self, step: OpenStep, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Exchange one part of the step's ``(param, grad)`` pairs in place, as :meth:`sync` does the whole: its own
        agreement first (a non-finite gradient in this part on any worker, or a request: a small allreduce, or with
        ``pack="all"`` flags in the part's message when it has a compressed tensor), clipping per tensor. Every
        worker must give the same parts in the same order. No part waits for its agreement: :meth:`end` reads
        every part's at once (one host read a step) and, when any worker's gradient was not finite, zeroes every
        part's gradients and puts back the compression state the parts changed."""
        pairs = sorted(pairs, key=lambda pg: self._order[self.name_of(pg[0])])
        step.pairs.extend(pairs)
        grads = [g for _, g in pairs]
        phases = step.phases
        flags = None
        if self._packs_agreement(pairs):
            norms, flags, control = self._flags(grads, phases, clip=bool(self.clip_norm))
        else:
            norms, agreed, control = self._agree_later(grads, phases, clip=bool(self.clip_norm))
            step.agreed.append(agreed)
        step.control += control
        with phases("compress"):
            self._clip(grads, norms)
            compressed, dense = self._prepare(pairs)
            if self.guard.check_finite:
                step.save(self._compressors(), [it.name for it in compressed + dense])
        step.dense_sent += self._exchange(compressed, dense, phases, flags)
        if flags is not None:
            step.agreed.append(self._agreed)
        step.compressed.extend(compressed)
        step.add(self.comm.reset_traffic())

    def end(self, step: OpenStep) -> StepStats:
        """Finish a step given in parts: when any part was skipped, every part's gradients are zeroed and the
        compression state is as it was before the step, on every worker."""
        if step.agreed:  # every part's agreement (its own allreduce, or its message's flags), read at once
            device = step.agreed[0].device
            skipped, requests = self.guard.read(torch.stack([a.to(device, torch.float32) for a in step.agreed]).amax(0))
            step.skipped = step.skipped or skipped
            step.requests.update(requests)
        if step.skipped:
            step.restore()
            if step.pairs:
                torch._foreach_zero_([g for _, g in step.pairs])
        requests = tuple(r for r in REQUESTS if r in step.requests)
        compressed = [] if step.skipped else step.compressed
        return self._finish(step.pairs, compressed, step.phases, step.control, step.dense_sent, step.skipped,
                            requests, step.traffic)  # fmt: skip

    def _compressors(self) -> list[Compressor]:
        return [self.compressor] + ([self.dense_compressor] if self.dense_compressor is not None else [])

    def _warn_no_epoch(self) -> None:
        schedule = getattr(self.compressor, "schedule", None)
        if schedule is not None and schedule.warmup_epochs > 0:
            warnings.warn(
                f"the compressor warms its density up over {schedule.warmup_epochs:g} epochs, but "
                "GradientSync.set_epoch() was never called: the density stays at the first stage "
                f"({schedule(0.0):g}); call sync.set_epoch(epoch + i / steps_per_epoch) every step, before "
                "backward() (Lightning: in on_train_batch_start)",
                stacklevel=4,
            )

    def _scale_by_rate(self, items: list[Item], phases: Phases) -> list[float] | None:
        """accumulate="updates": multiply the gradients by their learning rates (returned; None otherwise)."""
        if self.accumulate != "updates" or not items:
            return None
        if self.optimizer is None or not hasattr(self.optimizer, "learning_rate"):
            raise RuntimeError("accumulate='updates' needs the learning rate: build the optimizer with "
                               "dgc.SGD(params, sync, ...)")  # fmt: skip
        rates = [self.optimizer.learning_rate(it.param) for it in items]
        with phases("compress"):
            torch._foreach_mul_([it.grad for it in items], rates)
        return rates

    def _finish(self, pairs, compressed, phases, control, dense_sent, skipped, requests,  # noqa: ANN001
                traffic: Traffic | None = None) -> StepStats:  # fmt: skip
        traffic = self.comm.reset_traffic() if traffic is None else traffic
        self.steps += 1
        self.last = StepStats(
            step=self.steps,
            epoch=self.compressor.epoch,
            density=self.compressor.density(),
            dense_bytes=sum(g.numel() for _, g in pairs) * 4,
            sent_bytes=traffic.sent,
            recv_bytes=traffic.recv,
            collectives=traffic.collectives,
            dense_sent_bytes=dense_sent,
            values_sent=phases.counters.get("values_sent", 0),
            compressed_numel=sum(it.grad.numel() for it in compressed),
            compress_s=phases.seconds["compress"],
            communicate_s=phases.seconds["communicate"],
            decompress_s=phases.seconds["decompress"],
            counters=dict(phases.counters),
            skipped=skipped,
            requests=requests,
            control_bytes=control,
            local_bytes=traffic.local_sent,
        )
        return self.last

    def _item(self, param: torch.Tensor, grad: torch.Tensor) -> tuple[Item, float]:
        """The item of ``param`` and the weight decay to add to its gradient here (0: none)."""
        name = self.name_of(param)
        if not self.owns_momentum(param):
            return Item(name, param, grad), 0.0
        if self.optimizer is None:
            raise RuntimeError(
                f"compressor {self.compressor.name!r} keeps the momentum (momentum correction): build the optimizer "
                "with dgc.SGD(params, sync, ...) so the momentum and weight decay reach it, or use another "
                "optimizer (AdamW, ...) with momentum_correction=false"
            )
        momentum, nesterov, weight_decay = self.optimizer.hyper(param)
        return Item(name, param, grad, momentum=momentum, nesterov=nesterov), weight_decay

    def _clip(self, grads: list[torch.Tensor], norms: list[torch.Tensor]) -> None:
        """Scale this worker's gradient to global norm at most ``clip_norm * N**0.5`` (``clip_scope="step"``), or each
        tensor to its share of it (``"tensor"``; ``norms``: per tensor, finite: a non-finite gradient skips the step
        before it gets here)."""
        if self.clip_norm is None or not grads:
            return
        limit = self.clip_norm * self.world_size**0.5
        if self.clip_scope == "tensor":
            shares = torch.tensor([g.numel() / self._total_numel for g in grads], dtype=norms[0].dtype,
                                  device=norms[0].device)  # fmt: skip
            scales = torch.clamp(limit * shares.sqrt_() / (torch.stack(norms) + 1e-6), max=1.0)
            torch._foreach_mul_(grads, list(scales.to(grads[0].dtype).unbind()))
            return
        norm = torch.linalg.vector_norm(torch.stack(norms))
        scale = torch.clamp(limit / (norm + 1e-6), max=1.0)
        torch._foreach_mul_(grads, scale)

    # -- state ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This worker's compression state, keyed by parameter name."""
        out = {
            "compressor": self.compressor.state_dict(),
            "steps": self.steps,
            "world_size": self.world_size,
            "rank": self.comm.rank,
            "format": 1,
        }
        if self.dense_compressor is not None:
            out["dense_compressor"] = self.dense_compressor.state_dict()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """This worker's own state (its residuals and momenta are not another worker's)."""
        saved = (state.get("rank"), state.get("world_size"))
        if saved[0] is not None and saved != (self.comm.rank, self.world_size):
            raise ValueError(
                f"GradientSync.load_state_dict: state saved by rank {saved[0]} of {saved[1]} loaded on rank "
                f"{self.comm.rank} of {self.world_size}: save every rank's sync.state_dict() and load each its own"
            )
        self.compressor.load_state_dict(state["compressor"])
        if self.dense_compressor is not None:
            if "dense_compressor" not in state:
                raise ValueError("state has no 1-bit residuals: it was saved with another policy.dense_values")
            self.dense_compressor.load_state_dict(state["dense_compressor"])
        self.steps = int(state["steps"])
        self.restored = True

    def __repr__(self) -> str:
        return (
            f"GradientSync({self.compressor!r}, policy={self.policy}, clip_norm={self.clip_norm}, "
            f"world_size={self.world_size})"
        )
