"""Speech recognition (AN4, LibriSpeech, the offline espeak-ng corpus): DeepSpeech + CTC, WER and CER.

``data.name`` picks the layout (``an4`` or ``librispeech``, see :mod:`dgc.tasks.speech_data`); ``data.args``:

* ``train_splits`` / ``eval_splits``: split names (LibriSpeech: ``train-clean-100``, ...; AN4: ``train``,
  ``test``). The first evaluation split gives the headline ``wer``, ``cer`` and ``loss``; the others
  are reported as ``<split>_wer`` / ``<split>_cer`` (``-`` becomes ``_``).
* ``features``: ``{kind: spectrogram|mel, window_s, hop_s, n_mels}`` (:class:`dgc.tasks.speech_data.Features`).
* ``librivox``: also evaluate on the five real LibriVox clips of pocketsphinx-testdata
  (``librivox_wer``, ``librivox_cer``).
* ``max_seconds``: drop longer training utterances (null: keep all).
* ``cache_features``: keep the features of every utterance in memory after the first epoch (small corpora;
  only with ``data.loader_workers=0``, loader processes do not outlive an epoch).
* ``bucket``: training batches are drawn from a shuffled list and sorted by duration within windows
  of ``bucket`` batches (less padding); the batch order is shuffled again.

Loss: ``nn.CTCLoss(blank=0, reduction="sum")`` divided by the batch size (``deepspeech.pytorch``'s
warp-ctc convention). Decoding: greedy best path. WER/CER: corpus totals of edit distances over
reference lengths, in percent, summed over all workers' shards.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import torch
from dgc.tasks.base import Task, shard_indices
from dgc.tasks.models import build_model
from dgc.tasks.speech_data import (
    ALPHABET,
    BLANK,
    SPEECH_DATA,
    Features,
    SpeechDataset,
    Utterance,
    collate,
    error_counts,
    greedy_decode,
    librivox_clips,
)
from torch import nn
from torch.utils.data import DataLoader

from dgc import seeding
from dgc.distributed import all_reduce_sum

DEFAULTS: dict[str, Any] = {
    "train_splits": ["train"],
    "eval_splits": ["test"],
    "features": {},
    "librivox": False,
    "max_seconds": None,
    "cache_features": False,
    "bucket": 20,
}


class SpeechRecognition(Task):
    metric = "wer"
    higher_is_better = False

    def check(self) -> None:
        data = self.cfg.data
        if data.name not in SPEECH_DATA:
            raise ValueError(f"unknown speech data {data.name!r}; valid: {', '.join(SPEECH_DATA)}")
        unknown = sorted(set(data.args) - set(DEFAULTS))
        if unknown:
            raise ValueError(f"data.args has no {', '.join(unknown)}; valid: {', '.join(DEFAULTS)}")
        args = {**DEFAULTS, **data.args}
        self.features = Features(**dict(args["features"]))
        lister = SPEECH_DATA[data.name]
        train: list[Utterance] = []
        for split in args["train_splits"]:
            train += lister(data.root, split)
        if args["max_seconds"] is not None:
            train = [u for u in train if u.seconds <= args["max_seconds"]]
        train = [u for u in train if u.text]
        if data.limit is not None:
            train = train[: data.limit]
        self.train_set = SpeechDataset(train, self.features, cache=bool(args["cache_features"]))
        self.eval_sets: list[tuple[str, SpeechDataset]] = []
        for k, split in enumerate(args["eval_splits"]):
            items = lister(data.root, split)
            if data.eval_limit is not None:
                items = items[: data.eval_limit]
            prefix = "" if k == 0 else split.replace("-", "_") + "_"
            self.eval_sets.append((prefix, SpeechDataset(items, self.features, cache=bool(args["cache_features"]))))
        if args["librivox"]:
            self.eval_sets.append(("librivox_", SpeechDataset(librivox_clips(), self.features, cache=True)))
        # a dev split is the validation split; the others (test, LibriVox) are test sets
        self.has_validation = any(prefix.startswith("dev") for prefix, _ in self.eval_sets)
        self.bucket = max(1, int(args["bucket"]))
        need = self.info.world_size * self.cfg.train.batch_size
        if len(self.train_set) < need:
            raise ValueError(
                f"{len(self.train_set)} training utterances are fewer than one batch per worker "
                f"({self.info.world_size} x {self.cfg.train.batch_size})"
            )
        self.ctc = nn.CTCLoss(blank=BLANK, reduction="sum", zero_infinity=True)

    def build_model(self) -> nn.Module:
        args = dict(self.cfg.model.args)
        for key, value in (("n_feats", self.features.n_feats), ("num_classes", len(ALPHABET))):
            if args.setdefault(key, value) != value:
                raise ValueError(f"model.args.{key}={args[key]} but the data gives {value}: drop it from model.args")
        return build_model(self.cfg.model.name, **args)

    def batches_per_epoch(self) -> int:
        return len(self.train_set) // (self.info.world_size * self.cfg.train.batch_size)

    def _epoch_batches(self, epoch: int) -> list[list[int]]:
        """This worker's batches of ``epoch``: a shuffled shard, sorted by duration within buckets."""
        bs = self.cfg.train.batch_size
        idx = shard_indices(len(self.train_set), self.info, self.cfg.seed, epoch).tolist()
        idx = idx[: self.batches_per_epoch() * bs]
        rng = random.Random(seeding.mix(self.cfg.seed, epoch * 7919 + self.info.rank, multiplier=100_003))
        window = bs * self.bucket
        batches = []
        for lo in range(0, len(idx), window):
            chunk = sorted(idx[lo : lo + window], key=lambda i: self.train_set.items[i].seconds)
            batches += [chunk[k : k + bs] for k in range(0, len(chunk), bs)]
        rng.shuffle(batches)
        return batches

    def _loader(self, ds: SpeechDataset, batches: list[list[int]]) -> DataLoader:
        return DataLoader(
            ds,
            batch_sampler=batches,
            collate_fn=collate,
            num_workers=self.cfg.data.loader_workers,
            pin_memory=self.info.device.type == "cuda",
            generator=torch.Generator().manual_seed(0),  # nothing random here: leave the global RNG alone
        )

    def train_batches(self, epoch: int, start: int = 0) -> Iterator[Any]:
        dev = self.info.device
        for x, lengths, targets, target_lengths, _ in self._loader(self.train_set, self._epoch_batches(epoch)[start:]):
            yield x.to(dev, non_blocking=True), lengths, targets.to(dev), target_lengths

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        x, lengths, targets, target_lengths = batch
        log_probs, out_lengths = model(x, lengths.to(x.device))
        return self.ctc(log_probs.float(), targets, out_lengths.cpu(), target_lengths) / x.shape[0]

    @torch.no_grad()
    def evaluate(self, model: nn.Module, test: bool = True) -> dict[str, float]:
        model.eval()
        out: dict[str, float] = {}
        for prefix, ds in self.eval_sets:
            if not test and not prefix.startswith("dev"):
                continue
            n, ws, rank = len(ds), self.info.world_size, self.info.rank
            per = n // ws
            lo, hi = rank * per, (n if rank == ws - 1 else (rank + 1) * per)
            order = sorted(range(lo, hi), key=lambda i: ds.items[i].seconds)
            bs = self.cfg.train.eval_batch_size
            batches = [order[k : k + bs] for k in range(0, len(order), bs)]
            totals = [0.0] * 6  # loss, utterances, word errors, words, char errors, chars
            for x, lengths, targets, target_lengths, texts in self._loader(ds, batches):
                x = x.to(self.info.device)
                log_probs, out_lengths = model(x, lengths.to(x.device))
                loss = self.ctc(log_probs.float(), targets.to(x.device), out_lengths.cpu(), target_lengths)
                totals[0] += float(loss)
                totals[1] += len(texts)
                we, wn, ce, cn = error_counts(texts, greedy_decode(log_probs, out_lengths))
                for k, v in enumerate((we, wn, ce, cn)):
                    totals[2 + k] += v
            loss, count, we, wn, ce, cn = all_reduce_sum(totals, self.info.device)
            if not prefix:
                out["loss"] = loss / max(count, 1)
            out[prefix + "wer"] = 100.0 * we / max(wn, 1)
            out[prefix + "cer"] = 100.0 * ce / max(cn, 1)
        model.train()
        return out
