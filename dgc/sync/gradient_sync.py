"""GradientSync: the one object that turns local gradients into averaged ones.

Used two ways, with the same arithmetic:

* library path: ``loss.backward(); sync.step(); optimizer.step()``;
* DDP: ``ddp_model.register_comm_hook(sync, dgc.ddp_comm_hook)`` (see :mod:`dgc.hook`; with ``overlap`` bucket by
  bucket, :mod:`dgc.overlap`).

Every step has one shape, whether its gradients come whole or in parts (DDP buckets): :meth:`begin` opens it (the
agreement strategy, the optimizer's hyperparameters read as data), :meth:`sync_part` runs each part, :meth:`end`
reads what is left of the agreement and closes it; :meth:`sync` is the step in one part. Each part:

1. **the agreement** (:mod:`dgc.sync.agreement`): whether any worker's gradient holds a NaN or an Inf (then every
   worker skips the step: nothing enters momentum, residuals or the model, the gradients are zeroed,
   :attr:`StepStats.skipped` is set; :class:`dgc.SGD` then does not step, with another optimizer skip
   ``optimizer.step()`` yourself) and what any worker requested (:meth:`request`: ``"stop"``, ``"checkpoint"``, seen
   by all at the same step). Read before compressing (serial), at the step's end (parts), or carried in the
   compressor's message (``pack="all"``); the last two copy the compression state first and put it back on a skip.
2. **local gradient clipping** (``clip_norm``, :mod:`dgc.sync.clip`): this worker's gradient scaled to global L2 norm
   at most ``clip_norm * N**0.5`` (or each tensor to its share) before anything is accumulated.
3. **weight decay** for tensors whose momentum the compressor keeps (momentum correction): ``g += wd * w`` locally,
   so it enters the momentum as in ``torch.optim.SGD``; other tensors get it in the optimizer after aggregation.
4. **the exchange** (:mod:`dgc.exchanges`): the tensors the :class:`Policy` leaves dense (biases, BatchNorm) in their
   format (fp32/fp16/bf16, or 1-bit with error feedback), then the compressed ones through the compressor; the
   averages are written into the gradients.

Everything runs in one thread in a fixed tensor order, so every worker issues the same collectives in the same
order, all through the :class:`~dgc.comm.Comm` the sync is given (by default the default process group).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from dgc.comm import Comm
from dgc.compressors import Compressor
from dgc.compressors.base import Item
from dgc.compressors.onebit import OneBit
from dgc.exchanges import Exchange, build_exchange
from dgc.packing import Rider
from dgc.policy import Policy
from dgc.stats import StepStats
from dgc.sync.agreement import Flags, build_agreement
from dgc.sync.agreement import read as read_agreed
from dgc.sync.clip import clip_local
from dgc.sync.config import SyncConfig, check_accumulate, check_clip_norm, check_pack, resolve_clip_scope
from dgc.sync.step import Hyper, OpenStep, StateCopy, hypers_of
from dgc.timing import Phases
from dgc.wire import DTYPES


class GradientSync:
    """Compress, exchange and average the gradients of ``model`` (see the module docstring).

    Args:
        model: a module, or an iterable of ``(name, parameter)``; names key the state.
        compressor: from :func:`dgc.build_compressor`.
        policy: which tensors are compressed (ignored by dense compressors) and the dense ones' format.
        clip_norm: the clip of the averaged gradient; each worker clips its own at ``clip_norm * N**0.5``; None: off.
        comm: the collectives to use (default: ``Comm(group)``).
        group: process group of the default ``Comm`` (None: the default group, or a single process).
        timing: time the phases (on CUDA this synchronizes the device at phase boundaries).
        check_finite: skip, on every worker, a step in which any worker's gradient is not finite.
        exchange: how the tensors travel (:mod:`dgc.exchanges`): ``flat``, ``hierarchical``, ``densify``,
            ``sparse_allreduce``, or an :class:`~dgc.exchanges.Exchange`.
        ranks_per_node: for ``hierarchical`` (None: from the launcher's environment).
        local_bus: for ``hierarchical``, how a machine's ranks share data (:data:`dgc.localbus.LOCAL_BUSES`).
        accumulate: ``"gradients"`` (the paper's) or ``"updates"``: the compressed gradients are multiplied by their
            learning rate before they enter the compressor and the exchanged result divided by it again, so a value
            that waited in the residual while the rate dropped moves the weights by the rate of the step that
            computed it (Gradient Dropping's accumulation; the same as ``"gradients"`` while the rate is constant).
            The rates are read from the optimizer bound by :class:`dgc.SGD` (:meth:`bind_optimizer`).
        overlap: under :func:`dgc.ddp_comm_hook`, compress and exchange each DDP bucket as DDP hands it over, in a
            thread of its own, under the rest of the backward pass (:mod:`dgc.overlap`).
        clip_scope: ``"step"``: local clipping bounds the norm of the whole local gradient (the serial exchange only);
            ``"tensor"``: each tensor is clipped to its share of the same bound,
            ``clip_norm * N**0.5 * (numel / total numel)**0.5``; ``"auto"``: ``tensor`` with ``overlap``, else ``step``.
        pack: what else travels in the compressor's own message (:mod:`dgc.packing`): ``"none"``; ``"dense"``: the
            values the policy leaves dense (one collective fewer per step); ``"all"``: those and the step's agreement
            (one more fewer; the step's compression state is copied first and put back when any worker's gradient
            was not finite). ``flat`` exchange only; not with ``policy.dense_values="1bit"``.
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
        self._total_numel = sum(p.numel() for _, p in self.params)
        check_clip_norm(clip_norm)
        check_accumulate(accumulate)
        if comm is not None and group is not None:
            raise ValueError("give GradientSync a comm or a group, not both")
        self.accumulate, self.clip_norm, self.timing = accumulate, clip_norm, timing
        #: exchange each DDP bucket as DDP hands it over, under the rest of the backward pass (:mod:`dgc.overlap`)
        self.overlap = bool(overlap)
        #: what local clipping bounds: ``step`` (the whole gradient) or ``tensor`` (each tensor its share)
        self.clip_scope = resolve_clip_scope(clip_scope, self.overlap, clip_norm)
        self.compressor = compressor
        self.policy = policy or Policy()
        self.comm = comm if comm is not None else Comm(group)
        # a comm made here without a process group: checked at the first step (one built too early)
        self._check_group = comm is None and not self.comm.distributed
        self.compressor.bind(self.comm)
        if not isinstance(exchange, Exchange):
            exchange = build_exchange(exchange, self.comm, ranks_per_node, local_bus)
        self.exchange = exchange
        if not compressor.handles_all_tensors or self.exchange.name != "flat":
            self.exchange.check(compressor)
        check_pack(pack, self.exchange.name, self.policy.dense_values)
        #: what else travels in the compressor's message: none, dense (values), all (and the agreement)
        self.pack = pack
        #: why the exchange was chosen (SyncConfig with exchange=auto), empty otherwise
        self.exchange_reason = ""
        #: the format of the tensors left dense: a dtype, or 1-bit with error feedback (a compressor with state)
        self.dense_compressor: OneBit | None = None
        if self.policy.dense_values == "1bit" and not compressor.handles_all_tensors:
            self.dense_compressor = OneBit()
            self.dense_compressor.bind(self.comm)
        self.flags = Flags(self.comm, check_finite, self.exchange.agree_max_)
        value_bytes = DTYPES.get(self.policy.dense_values, torch.float32).itemsize
        #: the agreement of a step given whole (:meth:`sync`) and of one given in parts (:meth:`begin`)
        self._agreements = {parts: build_agreement(self.flags, parts, pack == "all", value_bytes)
                            for parts in (False, True)}  # fmt: skip
        self._before = StateCopy()  # one step is open at a time: its buffers are reused from step to step
        self.optimizer: torch.optim.Optimizer | None = None
        self.steps = 0
        self.last: StepStats | None = None
        #: whether load_state_dict restored this sync's state (dgc.SGD warns on a resume without it)
        self.restored = False
        self._epoch_set = False

    @classmethod
    def from_config(cls, config: SyncConfig, model: Any, compressor: Compressor, comm: Comm | None = None
                    ) -> GradientSync:  # fmt: skip
        """The sync a :class:`SyncConfig` describes (``exchange=auto``: the one its cost model chooses, and why)."""
        exchange, reason = config.exchange, ""
        if exchange == "auto":
            exchange, reason = config.choose(model, compressor, comm)
        sync = cls(model, compressor, policy=config.policy, clip_norm=config.clip_norm, comm=comm, exchange=exchange,
                   ranks_per_node=config.ranks_per_node, local_bus=config.local_bus, accumulate=config.accumulate,
                   overlap=config.overlap, clip_scope=config.clip_scope, pack=config.pack)  # fmt: skip
        sync.exchange_reason = reason
        return sync

    # -- configuration -------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.comm.world_size

    def bind_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer whose ``param_groups`` give each step's momentum, Nesterov, weight decay and learning rate
        (read once as data when the step begins; :class:`dgc.SGD` binds itself)."""
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
        """Ask every worker to see ``what`` (one of :data:`dgc.sync.agreement.REQUESTS`) in the next step's
        :attr:`StepStats.requests`. Safe to call from a signal handler."""
        self.flags.request(what)

    def name_of(self, param: torch.Tensor) -> str:
        try:
            return self._names[id(param)]
        except KeyError:
            raise KeyError("parameter not registered with this GradientSync (built from another model?)") from None

    # -- the step ------------------------------------------------------------------
    def step(self) -> StepStats:
        """Average the ``.grad`` of every parameter (library path). A missing grad counts as zeros."""
        return self.sync(self._all_grads())

    def sync(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> StepStats:
        """Exchange ``(param, grad)`` pairs in place (grads contiguous): the step in one part."""
        step = self.begin(parts=False)
        self.sync_part(step, pairs)
        return self.end(step)

    def begin(self, parts: bool = True) -> OpenStep:
        """Open a step; its gradients then come in one or more parts (:meth:`sync_part`), closed by :meth:`end`."""
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
        cuda = not parts and self.timing and any(p.is_cuda for _, p in self.params[:1])
        agreement = self._agreements[parts]
        hypers = {}
        if self.optimizer is not None and (self.compressor.owns_momentum or self.accumulate == "updates"):
            hypers = hypers_of(self.optimizer.param_groups)
        step = OpenStep(Phases(cuda_sync=cuda), agreement, hypers, before=self._before)
        step.before.start(self._compressors() if agreement.undoes and self.flags.check_finite else [])
        return step

    def sync_part(self, step: OpenStep, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Exchange one part of the step's ``(param, grad)`` pairs in place. Every worker gives the same parts in the
        same order; with several parts, clip per tensor (``clip_scope="tensor"``)."""
        pairs = sorted(pairs, key=lambda pg: self._order[self.name_of(pg[0])])
        step.pairs.extend(pairs)
        grads = [g for _, g in pairs]
        phases = self.comm.phases = step.phases
        self.comm.reset_traffic()
        with phases("compress"):
            norms = self._norms(grads, clip=bool(self.clip_norm))
            bad = self.flags.not_finite(norms)
        carries = self.pack == "all" and any(self.is_compressed(p) for p, _ in pairs)
        agreed = step.agreement.open(bad, grads[0].device if grads else self.comm.device, carries)
        self.comm.reset_traffic()  # the agreement's bytes are control, reported apart
        step.control += agreed.control
        if agreed.known is not None:
            skipped, requests = agreed.known
            step.requests.update(requests)
            if skipped:
                step.skipped = True
                torch._foreach_zero_(grads)
                return
        with phases("compress"):
            if self.clip_norm is not None:
                clip_local(grads, norms, self.clip_norm * self.world_size**0.5, self.clip_scope, self._total_numel)
            compressed, dense = self._prepare(step, pairs)
            if agreed.known is None and self.flags.check_finite:  # read later: the part may have to be undone
                step.save(self._compressors(), [it.name for it in compressed + dense])
        dense_sent, carried = self._exchange(step, compressed, dense, agreed.carry)
        step.dense_sent += dense_sent
        step.agreed.extend(a for a in (agreed.pending, carried) if a is not None)
        step.compressed.extend(compressed)
        step.add(self.comm.reset_traffic())

    def end(self, step: OpenStep) -> StepStats:
        """Close a step: the agreements not read yet are read at once (one host read); when any worker's gradient was
        not finite, every part's gradients are zeroed and the compression state is as it was before the step."""
        if step.agreed:
            device = step.agreed[0].device
            skipped, requests = read_agreed(torch.stack([a.to(device, torch.float32) for a in step.agreed]).amax(0))
            step.skipped = step.skipped or skipped
            step.requests.update(requests)
            if skipped and step.pairs:
                step.restore()
                torch._foreach_zero_([g for _, g in step.pairs])
        return self._finish(step)

    def check_local(self) -> StepStats:
        """This worker's own check, nothing sent (the inner steps of :mod:`dgc.localsteps`, where each worker steps on
        its own): a non-finite gradient here zeroes this worker's gradients and sets :attr:`StepStats.skipped` (one
        host read); requests wait for the next agreement. ``dense_bytes`` is what a dense exchange would send."""
        step = OpenStep(Phases(cuda_sync=False), pairs=self._all_grads())
        grads = [g for _, g in step.pairs]
        with step.phases("compress"):
            bad = self.flags.not_finite(self._norms(grads, clip=False))
        step.skipped = bad is not None and bool(bad)
        if step.skipped:
            torch._foreach_zero_(grads)
        self.comm.reset_traffic()
        return self._finish(step)

    # -- the parts of a part -------------------------------------------------------
    def _all_grads(self) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        """``(param, param.grad)`` of every parameter, a missing grad made zeros."""
        for _, p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return [(p, p.grad) for _, p in self.params]

    def _norms(self, grads: list[torch.Tensor], clip: bool) -> list[torch.Tensor]:
        """The gradients' norms, one dispatch for every tensor; none when neither the clip nor the non-finite check
        needs them."""
        return list(torch._foreach_norm(grads)) if grads and (self.flags.check_finite or clip) else []

    def _hyper(self, step: OpenStep, param: torch.Tensor) -> Hyper:
        hyper = step.hypers.get(id(param))
        if hyper is not None:
            return hyper
        if self.optimizer is None and self.compressor.owns_momentum:
            raise RuntimeError(
                f"compressor {self.compressor.name!r} keeps the momentum (momentum correction): build the optimizer "
                "with dgc.SGD(params, sync, ...) so the momentum and weight decay reach it, or use another "
                "optimizer (AdamW, ...) with momentum_correction=false"
            )
        if self.optimizer is None:
            raise RuntimeError("accumulate='updates' needs the learning rate: build the optimizer with "
                               "dgc.SGD(params, sync, ...)")  # fmt: skip
        raise RuntimeError(f"parameter {self.name_of(param)!r} is in no param group of the bound optimizer")

    def _prepare(self, step: OpenStep, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[list[Item], list[Item]]:
        """The items of the compressed and of the dense tensors; weight decay added where the compressor keeps the
        momentum."""
        compressed, dense = [], []
        decay: dict[float, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for p, g in pairs:
            if not self.owns_momentum(p):
                (compressed if self.is_compressed(p) else dense).append(Item(self.name_of(p), p, g))
                continue
            h = self._hyper(step, p)
            compressed.append(Item(self.name_of(p), p, g, momentum=h.momentum, nesterov=h.nesterov))
            if h.weight_decay:
                grads_of, params_of = decay.setdefault(h.weight_decay, ([], []))
                grads_of.append(g)
                params_of.append(p)
        with torch.no_grad():  # g += wd * w, one dispatch per weight decay value
            for weight_decay, (grads_of, params_of) in decay.items():
                torch._foreach_add_(grads_of, params_of, alpha=weight_decay)
        return compressed, dense

    def _exchange(self, step: OpenStep, compressed: list[Item], dense: list[Item],
                  carry: torch.Tensor | None) -> tuple[int, torch.Tensor | None]:  # fmt: skip
        """Exchange the dense, then the compressed tensors, their averages written into their gradients (with
        ``pack``: the dense values and ``carry``, the agreement's flags, in the compressor's collectives). Returns
        the bytes of the dense values sent and the carried flags' mean over the workers (None: none carried)."""
        phases, dtype = step.phases, DTYPES.get(self.policy.dense_values, torch.float32)
        carried = None
        if self.pack != "none" and compressed and (dense or carry is not None):
            rider = Rider(dense, dtype, self.exchange.buckets.of("dense", dense) if dense else None, carry, phases)
            rates = self._scale_by_rate(step, compressed)
            carried = self.exchange.run_packed(self.compressor, compressed, rider)
            dense_sent = sum(it.grad.numel() for it in dense) * dtype.itemsize
        else:
            self.exchange.dense(dense, phases, self.dense_compressor or dtype)
            dense_sent = self.comm.traffic.sent
            rates = self._scale_by_rate(step, compressed)
            self.exchange.run(self.compressor, compressed, phases)
        if rates is not None:
            with phases("decompress"):  # back to the gradient the optimizer multiplies by its rate
                scaled = [(it.grad, lr) for it, lr in zip(compressed, rates) if lr]
                if scaled:
                    torch._foreach_div_([g for g, _ in scaled], [lr for _, lr in scaled])
        return dense_sent, carried

    def _scale_by_rate(self, step: OpenStep, items: list[Item]) -> list[float] | None:
        """accumulate="updates": multiply the gradients by their learning rates (returned; None otherwise)."""
        if self.accumulate != "updates" or not items:
            return None
        rates = [self._hyper(step, it.param).lr for it in items]
        with step.phases("compress"):
            torch._foreach_mul_([it.grad for it in items], rates)
        return rates

    def _finish(self, step: OpenStep) -> StepStats:
        self.steps += 1
        self.last = step.stats(self.steps, self.compressor.epoch, self.compressor.density())
        return self.last

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
                stacklevel=5,
            )

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
