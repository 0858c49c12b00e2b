"""Compressors ask for their collectives by yielding them (dgc.collectives); the exchange runs them."""

from __future__ import annotations

import pytest
import torch

from dgc.collectives import Allgather, AllgatherBytes, AllreduceMax, AllreduceMean, drive
from dgc.comm import Comm
from dgc.compressors import build_compressor
from dgc.compressors.base import Item
from dgc.compressors.dense import AverageDense
from dgc.compressors.onebit import OneBit
from dgc.timing import Phases

#: what each compressor yields per step, in order
EXPECTED = {
    "none": [AverageDense],
    "fp16": [AverageDense],
    "bf16": [AverageDense],
    "demo": [Allgather],
    "sparseloco": [Allgather],
    "dgc": [AllgatherBytes],
    "topk": [AllgatherBytes],
    "qsgd": [Allgather],
    "terngrad": [AllreduceMax, Allgather],
    "powersgd": [AllreduceMean, AllreduceMean],
    "1bit": [Allgather],
}


def make_items(seed: int = 0) -> list[Item]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(64, 32), (16, 8, 3, 3), (100,)]
    out = []
    for i, shape in enumerate(shapes):
        p = torch.zeros(shape)
        out.append(Item(f"t{i}", p, torch.randn(shape, generator=gen), momentum=0.9))
    return out


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_compressor_yields_its_collectives_in_order(name):
    comp = OneBit() if name == "1bit" else build_compressor(name)
    comp.bind(Comm.local())
    steps = comp.steps(make_items(), Phases())
    seen, op = [], next(steps)
    comm = Comm.local()
    try:
        while True:
            seen.append(type(op))
            op = steps.send(op.run(comm))
    except StopIteration:
        pass
    assert seen == EXPECTED[name]


@pytest.mark.parametrize("name", ["dgc", "terngrad", "powersgd"])
def test_driving_the_steps_is_the_exchange(name):
    """``exchange(items, comm)`` is ``drive(steps(items), comm)``: the same gradients out, the same bytes counted."""
    results = []
    for way in ("exchange", "drive"):
        comp = build_compressor(name)
        comm = Comm.local()
        comp.bind(comm)
        items = make_items(1)
        for _ in range(3):
            if way == "exchange":
                comp.exchange(items, comm, Phases())
            else:
                drive(comp.steps(items, Phases()), comm)
        results.append(([it.grad.clone() for it in items], comm.reset_traffic().sent))
    (a, sent_a), (b, sent_b) = results
    assert sent_a == sent_b > 0
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_a_compressor_without_steps_says_so():
    from dgc.compressors.base import Compressor

    with pytest.raises(NotImplementedError):
        Compressor().exchange(make_items(), Comm.local(), Phases())
