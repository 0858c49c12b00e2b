"""Causal language modelling on token files (GPT): next-token prediction on fixed-length windows.

Training: the training split is cut into windows of ``model.args.block_size + 1`` tokens (input and the same
shifted by one) that start at ``offset + i * block_size``; the offset (in ``[0, block_size)``) and the order of
the windows are drawn anew every epoch from ``(seed, epoch)``, the same on every worker, and worker ``r`` of
``N`` takes its ``1/N`` of that order (:func:`dgc.tasks.base.shard_indices`), ``train.batch_size`` windows per
micro-batch. An epoch is one pass over the training tokens; ``data.limit``: only the first tokens. Nothing is
carried between batches, so a resumed run continues exactly from its batch counter.

Evaluation: the mean negative log-likelihood per token (nats) over the non-overlapping windows of the test and
validation splits (``data.eval_limit``: only the first tokens of each), spread over the workers and summed:
``loss`` / ``val_loss``, ``ppl`` / ``val_ppl`` (``exp`` of it) and bits per token, ``bpc`` / ``val_bpc`` on
character-level data (``meta.json`` unit ``char``), ``bpt`` / ``val_bpt`` otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import torch
import torch.nn.functional as F
from dgc.tasks.base import Task, shard_indices
from dgc.tasks.models import build_model
from dgc.tasks.token_files import TOKEN_DATA, load_tokens
from torch import nn

from dgc import seeding
from dgc.distributed import all_reduce_sum


def windows(tokens: np.ndarray, starts: np.ndarray | torch.Tensor, length: int, device: torch.device) -> torch.Tensor:
    """``(len(starts), length)`` int64 tokens ``tokens[s : s + length]`` for each start ``s``."""
    starts = np.asarray(starts, dtype=np.int64)
    rows = np.stack([np.asarray(tokens[s : s + length], dtype=np.int64) for s in starts])
    out = torch.from_numpy(rows)
    if device.type == "cuda":
        return out.pin_memory().to(device, non_blocking=True)
    return out.to(device)


class CausalLM(Task):
    metric = "loss"
    higher_is_better = False
    has_validation = True

    def check(self) -> None:
        data, model = self.cfg.data, self.cfg.model
        if data.name not in TOKEN_DATA:
            raise ValueError(f"unknown token data {data.name!r}; valid: {', '.join(TOKEN_DATA)}")
        if data.args:
            raise ValueError(f"data.args has no {', '.join(sorted(data.args))}: the context length is "
                             "model.args.block_size")  # fmt: skip
        self.files = load_tokens(data.name, data.root)
        self.block = int(model.args.get("block_size", 64))
        train = self.files.split("train")
        self.train_tokens = train if data.limit is None else train[: data.limit]
        # windows at every offset fit: the last starts at offset + (n - 1) * block with offset < block
        self.num_windows = max((len(self.train_tokens) - 1) // self.block - 1, 0)
        if self.batches_per_epoch() < 1:
            raise ValueError(
                f"{len(self.train_tokens)} training tokens are too few for {self.info.world_size} worker(s) x "
                f"{self.cfg.train.batch_size} windows of model.args.block_size={self.block} + 1 tokens"
            )
        self.bits_key = "bpc" if self.files.unit == "char" else "bpt"

    def build_model(self) -> nn.Module:
        args = dict(self.cfg.model.args)
        vocab = self.files.vocab_size
        if vocab is not None and args.setdefault("vocab_size", vocab) < vocab:
            raise ValueError(f"model.args.vocab_size={args['vocab_size']} but {self.files.root}/meta.json says "
                             f"the corpus has {vocab} tokens")  # fmt: skip
        if "vocab_size" not in args:
            raise ValueError(f"{self.files.root} has no meta.json naming its vocabulary: set model.args.vocab_size")
        return build_model(self.cfg.model.name, **args)

    def batches_per_epoch(self) -> int:
        return (self.num_windows // self.info.world_size) // self.cfg.train.batch_size

    def epoch_starts(self, epoch: int) -> torch.Tensor:
        """This worker's window starts for ``epoch``, in the order they are read."""
        offset = int(torch.randint(self.block, (1,), generator=seeding.generator(self.cfg.seed, epoch, 1)))
        order = shard_indices(self.num_windows, self.info, self.cfg.seed, epoch)
        return offset + order * self.block

    def train_batches(self, epoch: int, start: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        starts = self.epoch_starts(epoch).numpy()
        size = self.cfg.train.batch_size
        for i in range(start, self.batches_per_epoch()):
            rows = windows(self.train_tokens, starts[i * size : (i + 1) * size], self.block + 1, self.info.device)
            yield rows[:, :-1], rows[:, 1:]

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        logits = model(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))

    @torch.no_grad()
    def split_nll(self, model: nn.Module, split: str) -> tuple[float, int]:
        """Summed NLL and number of predicted tokens of this worker's windows of ``split``: every ``N``-th of its
        non-overlapping full windows from window ``rank`` on; the last worker also takes the short last window,
        so every token of the split is predicted once."""
        tokens = self.files.split(split)
        if self.cfg.data.eval_limit is not None:
            tokens = tokens[: self.cfg.data.eval_limit]
        full = (len(tokens) - 1) // self.block
        starts = np.arange(self.info.rank, full, self.info.world_size, dtype=np.int64) * self.block
        batches = [(starts[i : i + self.cfg.train.eval_batch_size], self.block)
                   for i in range(0, len(starts), max(1, self.cfg.train.eval_batch_size))]  # fmt: skip
        tail = len(tokens) - 1 - full * self.block
        if tail and self.info.rank == self.info.world_size - 1:
            batches.append((np.array([full * self.block]), tail))
        nll, count = 0.0, 0
        for picked, length in batches:
            rows = windows(tokens, picked, length + 1, self.info.device)
            logits = model(rows[:, :-1])
            target = rows[:, 1:].reshape(-1)
            nll += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target, reduction="sum"))
            count += target.numel()
        return nll, count

    def evaluate(self, model: nn.Module, test: bool = True) -> dict[str, float]:
        model.eval()
        val_nll, val_n = self.split_nll(model, "valid")
        test_nll, test_n = self.split_nll(model, "test") if test else (0.0, 0)
        model.train()
        test_nll, test_n, val_nll, val_n = all_reduce_sum([test_nll, test_n, val_nll, val_n], self.info.device)
        out = self._metrics("val_", val_nll, val_n)
        if test:
            out = {**self._metrics("", test_nll, test_n), **out}
        return out

    def _metrics(self, prefix: str, nll: float, n: float) -> dict[str, float]:
        loss = nll / n if n else float("nan")
        return {f"{prefix}loss": loss, f"{prefix}ppl": math.exp(loss) if loss < 700 else float("inf"),
                f"{prefix}{self.bits_key}": loss / math.log(2)}  # fmt: skip
