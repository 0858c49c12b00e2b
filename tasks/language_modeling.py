"""Word-level language modelling (PTB, KJV): truncated BPTT with carried hidden state, perplexity.

Data parallelism over one token stream: worker ``r`` of ``N`` takes the contiguous slice
``[r * T // N, (r + 1) * T // N)`` of the ``T`` training tokens (``data.limit``: only the first
``limit``), cuts it into ``train.batch_size`` equal contiguous streams (the columns of a
``(L, batch_size)`` matrix, like PyTorch's word_language_model ``batchify``) and walks them in windows
of ``data.args.bptt`` tokens. The LSTM state is carried from one window to the next (detached:
truncated BPTT) and reset to zeros at the start of every epoch; every worker sees its windows in
the same order every epoch (the stream order is the data, nothing is shuffled). The carried state
is part of each worker's checkpoint, so a resumed run continues exactly.

Evaluation: perplexity ``exp(mean NLL per token)`` on the test stream (the headline ``ppl`` and
``loss``) and on the validation stream (``val_ppl``, ``val_loss``); each stream is split into
contiguous per-worker slices, each slice into ``train.eval_batch_size`` streams walked with a carried
state, and the NLL sums and token counts are summed over workers. ``data.eval_limit``: only the
first tokens of each evaluation stream.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from dgc.tasks.base import Task
from dgc.tasks.models import build_model
from dgc.tasks.text_corpora import TEXT_DATA, load_corpus
from torch import nn

from dgc.distributed import DistInfo, all_reduce_sum

DEFAULTS: dict[str, Any] = {"bptt": 35}


def worker_slice(tokens: torch.Tensor, info: DistInfo, last_takes_tail: bool = False) -> torch.Tensor:
    """This worker's contiguous part of a token stream (equal parts; the tail goes to the last worker
    only when ``last_takes_tail``)."""
    per = len(tokens) // info.world_size
    lo = info.rank * per
    hi = len(tokens) if last_takes_tail and info.rank == info.world_size - 1 else lo + per
    return tokens[lo:hi]


def batchify(tokens: torch.Tensor, streams: int) -> torch.Tensor:
    """``(L, streams)``: column ``j`` is the ``j``-th contiguous ``1/streams`` of ``tokens`` (tail dropped)."""
    length = len(tokens) // streams
    return tokens[: length * streams].view(streams, length).t().contiguous()


def detach(hidden: Any) -> Any:
    if hidden is None:
        return None
    if isinstance(hidden, torch.Tensor):
        return hidden.detach()
    return tuple(detach(h) for h in hidden)


def perplexity(nll_sum: float, tokens: float) -> float:
    """``exp`` of the mean negative log-likelihood per token (natural log)."""
    return math.exp(nll_sum / tokens) if tokens else float("nan")


class LanguageModeling(Task):
    metric = "ppl"
    higher_is_better = False
    has_validation = True

    def check(self) -> None:
        data = self.cfg.data
        if data.name not in TEXT_DATA:
            raise ValueError(f"unknown text data {data.name!r}; valid: {', '.join(TEXT_DATA)}")
        unknown = sorted(set(data.args) - set(DEFAULTS))
        if unknown:
            raise ValueError(f"data.args has no {', '.join(unknown)}; valid: {', '.join(DEFAULTS)}")
        args = {**DEFAULTS, **data.args}
        self.bptt = int(args["bptt"])
        if self.bptt < 1:
            raise ValueError(f"data.args.bptt must be >= 1, got {self.bptt}")
        self.corpus = load_corpus(data.name, data.root)
        train = self.corpus.train if data.limit is None else self.corpus.train[: data.limit]
        self.streams = batchify(worker_slice(train, self.info), self.cfg.train.batch_size).to(self.info.device)
        if self.batches_per_epoch() < 1:
            raise ValueError(
                f"{len(train)} training tokens are too few for {self.info.world_size} worker(s) x "
                f"{self.cfg.train.batch_size} streams x (bptt {self.bptt} + 1)"
            )
        self.eval_streams = {}
        for split in ("test", "valid"):
            tokens = self.corpus.split(split)
            if data.eval_limit is not None:
                tokens = tokens[: data.eval_limit]
            mine = worker_slice(tokens, self.info, last_takes_tail=True)
            streams = max(1, min(self.cfg.train.eval_batch_size, len(mine) // 2))
            self.eval_streams[split] = batchify(mine, streams).to(self.info.device)
        self.hidden: Any = None

    def build_model(self) -> nn.Module:
        args = dict(self.cfg.model.args)
        vocab = self.corpus.vocab_size
        if args.setdefault("vocab_size", vocab) != vocab:
            raise ValueError(f"model.args.vocab_size={args['vocab_size']} but the corpus has {vocab} words")
        return build_model(self.cfg.model.name, **args)

    def batches_per_epoch(self) -> int:
        return (self.streams.shape[0] - 1) // self.bptt

    def start_epoch(self, model: nn.Module, epoch: int) -> None:
        self.hidden = None

    def state_dict(self) -> dict[str, Any]:
        hidden = None if self.hidden is None else tuple(h.cpu() for h in self.hidden)
        return {"hidden": hidden}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        hidden = state.get("hidden")
        self.hidden = None if hidden is None else tuple(h.to(self.info.device) for h in hidden)

    def train_batches(self, epoch: int, start: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for i in range(start, self.batches_per_epoch()):
            lo = i * self.bptt
            yield self.streams[lo : lo + self.bptt], self.streams[lo + 1 : lo + 1 + self.bptt]

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        logits, hidden = model(x, detach(self.hidden))
        self.hidden = detach(hidden)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))

    @torch.no_grad()
    def stream_nll(self, model: nn.Module, streams: torch.Tensor) -> tuple[float, int]:
        """Summed NLL and number of predicted tokens over ``(L, B)`` streams, state carried along."""
        hidden, nll, count = None, 0.0, 0
        for lo in range(0, streams.shape[0] - 1, self.bptt):
            x = streams[lo : lo + self.bptt]
            y = streams[lo + 1 : lo + 1 + self.bptt]
            x = x[: len(y)]
            logits, hidden = model(x, hidden)
            nll += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1), reduction="sum"))
            count += y.numel()
        return nll, count

    def evaluate(self, model: nn.Module, test: bool = True) -> dict[str, float]:
        model.eval()
        val_nll, val_n = self.stream_nll(model, self.eval_streams["valid"])
        test_nll, test_n = self.stream_nll(model, self.eval_streams["test"]) if test else (0.0, 0)
        model.train()
        test_nll, test_n, val_nll, val_n = all_reduce_sum([test_nll, test_n, val_nll, val_n], self.info.device)
        out = {"val_loss": val_nll / max(val_n, 1), "val_ppl": perplexity(val_nll, val_n)}
        if test:
            out = {"loss": test_nll / max(test_n, 1), "ppl": perplexity(test_nll, test_n), **out}
        return out
