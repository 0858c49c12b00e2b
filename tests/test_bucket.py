"""dgc.bucket: flat buffers whose parts are the tensors' views, state kept by name."""

from __future__ import annotations

import torch

from dgc.bucket import Bucket, Buckets, Layout
from dgc.compressors.base import Item


def _items(shapes: list[tuple[int, ...]], seed: int = 0) -> list[Item]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, shape in enumerate(shapes):
        p = torch.zeros(shape)
        out.append(Item(f"t{i}", p, torch.randn(shape, generator=gen)))
    return out


def test_gather_and_scatter_move_every_gradient_through_one_buffer():
    items = _items([(3, 4), (5,), (2, 2, 2)])
    bucket = Bucket(Layout.of(items))
    assert bucket.layout.offsets == (0, 12, 17) and bucket.layout.total == 25
    flat = bucket.gather(items)
    assert torch.equal(flat, torch.cat([it.grad.view(-1) for it in items]))
    bucket.scatter(items, torch.arange(25.0).to(torch.float16))  # another dtype is converted
    assert torch.equal(items[1].grad, torch.arange(12.0, 17.0))
    assert torch.equal(bucket.ends_t, torch.tensor([12, 17, 25]))


def test_adopt_keeps_the_state_by_name_as_views_of_the_bucket():
    items = _items([(3, 4), (5,)])
    bucket = Bucket(Layout.of(items))
    state = {"t0": {"v": torch.full((12,), 2.0)}}  # a checkpoint's tensor for one of them
    bucket.adopt(state, ("v",))
    assert torch.equal(bucket.buffers["v"][:12], torch.full((12,), 2.0))
    assert torch.equal(state["t1"]["v"], torch.zeros(5))  # missing: starts at zero
    bucket.buffers["v"].add_(1.0)
    assert torch.equal(state["t1"]["v"], torch.ones(5))  # a view: sees the bucket's update
    state["t0"]["v"] = torch.full((12,), 7.0)  # replaced (a load): copied in at the next adopt
    bucket.adopt(state, ("v",))
    assert torch.equal(bucket.buffers["v"][:12], torch.full((12,), 7.0))
    assert state["t0"]["v"].data_ptr() == bucket.buffers["v"].data_ptr()


def test_a_bucket_is_made_again_when_the_tensors_change():
    buckets = Buckets()
    first = buckets.of("dense", _items([(3,), (4,)]))
    assert buckets.of("dense", _items([(3,), (4,)], seed=1)) is first  # same layout: reused
    assert buckets.of("dense", _items([(3,), (5,)])) is not first
    assert buckets.of("other", _items([(3,), (4,)])) is not first
