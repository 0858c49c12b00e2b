"""Error feedback (dgc.memory): nothing is lost, only delayed; DGC's momentum correction and masking."""

from __future__ import annotations

import torch

from dgc.memory import MomentumCorrection, Residual


def test_a_residual_loses_nothing_sparse_or_dense_16_bit_or_not():
    gen = torch.Generator().manual_seed(0)
    for value_dtype in (torch.float32, torch.float16):
        memory = Residual()
        buffers = {"residual": torch.zeros(50)}
        total_in, total_out = torch.zeros(50, dtype=torch.float64), torch.zeros(50, dtype=torch.float64)
        for step in range(10):
            g = torch.randn(50, generator=gen) * (1e5 if step == 3 else 1)  # fp16 overflows at step 3: clamped
            total_in += g.double()
            acc = memory.compensate(g, buffers)
            assert acc is buffers["residual"]
            if step % 2:
                at = torch.topk(acc.abs(), 5).indices
                values = memory.sent(buffers, at, value_dtype)
                assert values.abs().max() <= torch.finfo(value_dtype).max
                total_out.index_add_(0, at, values.double())
            else:
                sent = torch.sign(acc) * acc.abs().mean()
                memory.update(buffers, sent)
                total_out += sent.double()
        assert torch.allclose(total_out + buffers["residual"].double(), total_in, rtol=0, atol=1e-6 * 1e5)


def test_momentum_correction_accumulates_momentum_and_masks_what_was_sent():
    memory = MomentumCorrection()
    buffers = {"u": torch.zeros(4), "v": torch.zeros(4)}
    g = torch.tensor([1.0, 2.0, 3.0, 4.0])
    memory.compensate(g, buffers, momentum=0.5)
    v = memory.compensate(g, buffers, momentum=0.5)  # u = 1.5 g, v = g + 1.5 g
    assert torch.equal(buffers["u"], 1.5 * g) and torch.equal(v, 2.5 * g)
    sent = memory.sent(buffers, torch.tensor([3]), torch.float32)
    assert sent.tolist() == [10.0] and buffers["v"][3] == 0 and buffers["u"][3] == 0 and buffers["u"][0] == 1.5
    unmasked = MomentumCorrection(masking=False)
    buffers = {"u": torch.ones(2), "v": torch.ones(2)}
    unmasked.sent(buffers, torch.tensor([0]), torch.float32)
    assert buffers["u"].tolist() == [1.0, 1.0] and buffers["v"].tolist() == [0.0, 1.0]
    nesterov = MomentumCorrection()
    buffers = {"u": torch.zeros(1), "v": torch.zeros(1)}
    assert nesterov.compensate(torch.ones(1), buffers, momentum=0.5, nesterov=True).item() == 1.5  # u = .5, v = u + g
    assert MomentumCorrection(correction=False).keys == ("v",)
