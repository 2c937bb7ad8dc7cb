"""The backward tracker alone (offload/runtime/backward.py), driven call by call: when a unit
is reduced ([Note: when a unit's gradients are final]), what the end of backward catches, and
what an aborted pass puts back. An engine only builds the units and their gradient shards;
its hooks never run (the model is never called)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import offload
from offload.config import Config, OptimizerConfig
from offload.optim.grad_shard import GradState
from offload.runtime.backward import BackwardTracker, Pass
from offload.runtime.timeline import Timeline
from offload.units.partition import ROOT


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # never run here
        for b in self.blocks:
            x = b(x)
        return self.head(x).sum()


@pytest.fixture
def parts():
    torch.manual_seed(0)
    engine = offload.initialize(_Net(), Config(compute_device="cpu", optimizer=OptimizerConfig(lr=1e-3)))
    tracker = BackwardTracker(engine.units, engine.states, False, Timeline(), lambda unit: 0.0)
    blocks = {u.name: u for u in engine.units if u.index != ROOT}
    yield tracker, blocks, engine.states
    engine.close()


def _ok(unit) -> None:
    pass


def _input() -> torch.Tensor:
    return torch.ones(2, 4, requires_grad=True)


def test_a_unit_called_twice_is_reduced_when_both_triggers_fired(parts):
    tracker, blocks, states = parts
    u = blocks["blocks.1"]
    for _ in range(2):  # a reused unit: two forward calls, two triggers
        (out,) = tracker.forward_with_grad(u, [_input()], lambda: None)
        assert out.requires_grad
    assert tracker.start() and tracker.state is Pass.BACKWARD and not tracker.start()
    tracker.entered(u)
    assert tracker.post_backward(u, _ok) == [], "one of two calls' gradients are in: not final"
    assert states[u.index].grad_shard.state is GradState.EMPTY
    assert tracker.post_backward(u, _ok) == [u], "both in: reduced (and complete at world size 1)"
    shard = states[u.index].grad_shard
    assert shard.state is GradState.SUMMED and shard.reduces == 1


def test_an_untracked_call_leaves_the_unit_to_the_end_of_backward(parts):
    tracker, blocks, states = parts
    u, v = blocks["blocks.0"], blocks["blocks.2"]
    tracker.forward_with_grad(u, [_input()], lambda: None)
    assert tracker.forward_with_grad(u, [], lambda: None) == []  # inputs need no grad: untracked
    tracker.forward_with_grad(v, [_input()], lambda: None)
    tracker.start()
    assert tracker.post_backward(u, _ok) == [], "a call no trigger sees may still add gradients"
    assert tracker.post_backward(v, _ok) == [v]
    seen: list = []
    tracker.finish(_ok, seen.extend)
    assert seen == [u], "the end of backward reduces what the triggers could not, once"
    assert states[u.index].grad_shard.reduces == 1 and states[v.index].grad_shard.reduces == 1
    assert tracker.state is Pass.FORWARD and not tracker.has_work()


def test_a_unit_that_must_not_receive_gradients_is_not_reduced(parts):
    tracker, blocks, states = parts
    u = blocks["blocks.1"]
    tracker.forward_with_grad(u, [_input()], lambda: None)
    tracker.start()

    def refuse(unit) -> None:
        raise RuntimeError(f"{unit.name} was updated already")

    with pytest.raises(RuntimeError, match="blocks.1 was updated already"):
        tracker.post_backward(u, refuse)
    assert states[u.index].grad_shard.state is GradState.EMPTY and states[u.index].grad_shard.reduces == 0


def test_an_aborted_pass_puts_back_what_held_nothing_and_says_when_it_cannot(parts):
    tracker, blocks, states = parts
    u = blocks["blocks.0"]
    tracker.forward_with_grad(u, [_input()], lambda: None)
    tracker.start()
    tracker.post_backward(u, _ok)
    assert tracker.abort() is True, "a shard that held nothing before the pass: exact"
    assert states[u.index].grad_shard.state is GradState.EMPTY and states[u.index].grad_shard.reduces == 0
    assert tracker.state is Pass.FORWARD
    # A finished micro-batch's sum, then a pass that adds to it and dies: no exact way back.
    tracker.forward_with_grad(u, [_input()], lambda: None)
    tracker.start()
    tracker.post_backward(u, _ok)
    tracker.finish(_ok, lambda units: None)
    tracker.forward_with_grad(u, [_input()], lambda: None)
    tracker.start()
    tracker.post_backward(u, _ok)
    assert states[u.index].grad_shard.reduces == 2
    assert tracker.abort() is False
    assert states[u.index].grad_shard.state is GradState.SUMMED, "the window is the caller's to drop"


def test_a_recomputation_inside_backward_is_left_alone(parts):
    tracker, blocks, _ = parts
    u = blocks["blocks.2"]
    assert not tracker.is_recomputation(u)
    tracker.forward_with_grad(u, [_input()], lambda: None)
    assert not tracker.is_recomputation(u), "outside backward a forward is a forward"
    tracker.start()
    assert tracker.is_recomputation(u), "its original forward carries the trigger"
