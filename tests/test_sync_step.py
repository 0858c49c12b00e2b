"""The copies of the compression state a step may put back (dgc.sync.step): StateCopy (sync.pack=all) and an OpenStep's
saves (the overlapped hook), both through put_back."""

from __future__ import annotations

import torch

import dgc
from dgc.sync.step import OpenStep, StateCopy
from dgc.timing import Phases


def _compressor():
    comp = dgc.build_compressor("dgc", density=0.1)
    comp.state = {"w": {"momentum": torch.arange(4.0), "residual": torch.ones(4)}}
    comp.thresholds = {"w": [0.5]}
    return comp


def _step_on(comp) -> None:
    """What a step does to the state: in place (the state may be views of a flat bucket), new state, new extra."""
    comp.state["w"]["momentum"].mul_(-1)
    comp.state["w"]["residual"].add_(7)
    comp.state["w"]["fresh"] = torch.full((4,), 3.0)  # made by the step: starts at zero again when undone
    comp.thresholds = {"w": [9.0]}


def test_a_state_copy_puts_back_in_place_and_is_taken_again_into_the_same_buffers():
    comp, copy = _compressor(), StateCopy()
    momentum = comp.state["w"]["momentum"]
    copy.take([comp], ["w"])
    buffers = dict(copy._buffers)
    _step_on(comp)
    copy.put_back()
    assert comp.state["w"]["momentum"] is momentum  # in place: a view of a bucket stays one
    assert torch.equal(momentum, torch.arange(4.0)) and torch.equal(comp.state["w"]["residual"], torch.ones(4))
    assert torch.equal(comp.state["w"]["fresh"], torch.zeros(4))
    assert comp.thresholds == {"w": [0.5]}
    copy.take([comp], ["w"])  # the next step's copy: no new buffers
    assert all(copy._buffers[k] is b for k, b in buffers.items())


def test_an_open_steps_saves_put_back_what_its_parts_changed_into_buffers_kept_for_the_next_step():
    comp = _compressor()
    comp.state["b"] = {"residual": torch.full((2,), 5.0)}
    kept = StateCopy()
    step = OpenStep(Phases(), before=kept)
    step.before.start([comp])
    step.save([comp], ["w"])  # one part
    step.save([comp], ["b"])  # the next: added to the same copy, not replacing it
    _step_on(comp)
    comp.state["b"]["residual"].zero_()
    step.restore()
    assert torch.equal(comp.state["w"]["momentum"], torch.arange(4.0))
    assert torch.equal(comp.state["w"]["residual"], torch.ones(4))
    assert torch.equal(comp.state["b"]["residual"], torch.full((2,), 5.0))
    assert torch.equal(comp.state["w"]["fresh"], torch.zeros(4)) and comp.thresholds == {"w": [0.5]}
    buffers = dict(kept._buffers)
    nxt = OpenStep(Phases(), before=kept)  # the next step starts a new copy in the same buffers
    nxt.before.start([comp])
    nxt.save([comp], ["b"])
    assert all(kept._buffers[k] is b for k, b in buffers.items() if k[1] == "b")
    comp.state["b"]["residual"].add_(1)
    comp.state["w"]["residual"].add_(1)
    nxt.restore()
    assert torch.equal(comp.state["b"]["residual"], torch.full((2,), 5.0))  # saved by this step
    assert torch.equal(comp.state["w"]["residual"], torch.full((4,), 2.0))  # not saved by it: left alone
