"""Recurrent models of the language and speech tasks (registered in :mod:`dgc.tasks.models`).

* ``lstm_lm``: the word language model of PyTorch's ``word_language_model`` example (Zaremba et al.
  2014 with tied weights, Inan et al. / Press & Wolf 2017): embedding, dropout, a multi-layer
  ``nn.LSTM``, dropout, a linear decoder whose weight is the embedding. With a 10,000-word vocabulary,
  2 layers of 1500 units and tied weights it has 51,034,000 parameters, i.e. the 194.68 MB (MiB) of
  gradient in the paper's Table 4.
* ``deepspeech``: a DeepSpeech 2-style acoustic model as in ``deepspeech.pytorch`` (which the paper's
  speech experiments build on): two 2-D convolutions over (frequency, time) with BatchNorm and
  Hardtanh(0, 20), a stack of (bi)directional LSTM or GRU layers (sequence-wise BatchNorm before every
  layer but the first, the two directions summed), BatchNorm and a bias-free linear layer to the
  characters; it returns time-major log-probabilities for ``nn.CTCLoss``. Padded frames are zeroed
  after every convolution module and skipped by the recurrent layers (packed sequences).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

# -- word language model ---------------------------------------------------------------------


class LSTMLanguageModel(nn.Module):
    """Time-major input ``(T, B)`` of token ids; returns logits ``(T, B, vocab)`` and the new hidden state."""

    def __init__(
        self,
        vocab_size: int,
        embed: int = 1500,
        hidden: int = 1500,
        layers: int = 2,
        dropout: float = 0.65,
        tied: bool = True,
        init_range: float = 0.1,
    ):
        super().__init__()
        if vocab_size < 2 or embed < 1 or hidden < 1 or layers < 1:
            raise ValueError("lstm_lm needs vocab_size >= 2 and embed, hidden, layers >= 1")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"lstm_lm dropout must be in [0, 1), got {dropout}")
        if tied and embed != hidden:
            raise ValueError(f"lstm_lm with tied=true needs embed == hidden, got {embed} and {hidden}")
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(vocab_size, embed)
        self.rnn = nn.LSTM(embed, hidden, layers, dropout=dropout if layers > 1 else 0.0)
        self.decoder = nn.Linear(hidden, vocab_size)
        nn.init.uniform_(self.encoder.weight, -init_range, init_range)
        nn.init.zeros_(self.decoder.bias)
        if tied:
            self.decoder.weight = self.encoder.weight
        else:
            nn.init.uniform_(self.decoder.weight, -init_range, init_range)
        self.vocab_size = vocab_size

    def forward(self, x: torch.Tensor, hidden: tuple[torch.Tensor, torch.Tensor] | None = None):
        out, hidden = self.rnn(self.drop(self.encoder(x)), hidden)
        return self.decoder(self.drop(out)), hidden


#: registered as model ``lstm_lm`` (``build_model`` checks arguments against ``__init__``)
lstm_lm = LSTMLanguageModel


# -- DeepSpeech ------------------------------------------------------------------------------


class _SequenceBatchNorm(nn.BatchNorm1d):
    """BatchNorm1d over the features of a time-major ``(T, B, D)`` sequence."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, b, d = x.shape
        return super().forward(x.reshape(t * b, d)).reshape(t, b, d)


RNN_TYPES = {"lstm": nn.LSTM, "gru": nn.GRU}


class DeepSpeech(nn.Module):
    """Input features ``(B, F, T)`` and their lengths; output ``(T', B, classes)`` log-probabilities and lengths."""

    def __init__(
        self,
        n_feats: int,
        num_classes: int,
        rnn_type: str = "lstm",
        hidden: int = 800,
        layers: int = 5,
        bidirectional: bool = True,
        conv_channels: int = 32,
    ):
        super().__init__()
        if rnn_type not in RNN_TYPES:
            raise ValueError(f"deepspeech rnn_type must be one of {', '.join(RNN_TYPES)}, got {rnn_type!r}")
        if n_feats < 1 or num_classes < 2 or hidden < 1 or layers < 1 or conv_channels < 0:
            raise ValueError("deepspeech needs n_feats, hidden, layers >= 1, num_classes >= 2, conv_channels >= 0")
        self.conv_channels = conv_channels
        if conv_channels:
            c = conv_channels
            self.conv = nn.ModuleList(
                [
                    nn.Conv2d(1, c, kernel_size=(41, 11), stride=(2, 2), padding=(20, 5)),
                    nn.BatchNorm2d(c),
                    nn.Hardtanh(0, 20, inplace=True),
                    nn.Conv2d(c, c, kernel_size=(21, 11), stride=(2, 1), padding=(10, 5)),
                    nn.BatchNorm2d(c),
                    nn.Hardtanh(0, 20, inplace=True),
                ]
            )
            freq = (n_feats - 1) // 2 + 1
            freq = (freq - 1) // 2 + 1
            rnn_input = c * freq
        else:
            self.conv = nn.ModuleList()
            rnn_input = n_feats
        cls = RNN_TYPES[rnn_type]
        self.norms = nn.ModuleList()
        self.rnns = nn.ModuleList()
        for i in range(layers):
            size = rnn_input if i == 0 else hidden
            self.norms.append(nn.Identity() if i == 0 else _SequenceBatchNorm(size))
            self.rnns.append(cls(size, hidden, bidirectional=bidirectional))
        self.bidirectional = bidirectional
        self.out_norm = _SequenceBatchNorm(hidden)
        self.fc = nn.Linear(hidden, num_classes, bias=False)

    def output_lengths(self, lengths: torch.Tensor) -> torch.Tensor:
        """Frames after the convolutions (the first one halves time: ``ceil(T / 2)``)."""
        if self.conv_channels:
            return torch.div(lengths - 1, 2, rounding_mode="floor") + 1
        return lengths

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out_lengths = self.output_lengths(lengths)
        if self.conv_channels:
            x = x.unsqueeze(1)  # (B, 1, F, T)
            lengths = lengths.to(x.device)
            for layer in self.conv:
                x = layer(x)
                if isinstance(layer, nn.Conv2d) and layer.stride[1] > 1:
                    lengths = out_lengths.to(x.device)
                # zero the padding frames after every module (deepspeech.pytorch's MaskConv), so a padded
                # utterance gives the same output as alone (in eval mode)
                t = torch.arange(x.shape[-1], device=x.device)
                x = x * (t.unsqueeze(0) < lengths.unsqueeze(1))[:, None, None, :].to(x.dtype)
            b, c, f, t = x.shape
            x = x.reshape(b, c * f, t)
        x = x.permute(2, 0, 1).contiguous()  # (T', B, D)
        cpu_lengths = out_lengths.cpu()
        for norm, rnn in zip(self.norms, self.rnns):
            x = norm(x)
            packed = pack_padded_sequence(x, cpu_lengths, enforce_sorted=False)
            x, _ = rnn(packed)
            x, _ = pad_packed_sequence(x, total_length=cpu_lengths.max().item() if len(cpu_lengths) else 0)
            if self.bidirectional:
                x = x.view(x.shape[0], x.shape[1], 2, -1).sum(2)
        logits = self.fc(self.out_norm(x))
        return F.log_softmax(logits, dim=-1), out_lengths


#: registered as model ``deepspeech``
deepspeech = DeepSpeech
