"""Several `engine.backward()` calls before one `engine.step()` (issue #29, item 6).

DeepSpeed accumulates them; the engine refused a second one whenever the first had already
run the updates during backward (the default at a boundary). Now the policy learns the
pattern ([Note: several backward passes per step] in offload/runtime/optimizer_step.py):
a run whose boundary micro-batches run several passes accumulates them and updates at
`step()`; only a run with transient gradient shards (a CPU run at gas 1 without clipping)
still updates during the first pass, and refuses a second with the fix in its message.

The plain PyTorch reference of two passes per micro-batch is `plain_loop(..., split=2)`
(tests/parity.py): each half of the batch runs forward and `(loss / (gas * 2)).backward()`,
then one optimizer step; it is one of the fp32 references `Fp32Bound.measure` runs, and
its float64 truth is the same loop's (the halves' mean is the batch's).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from torch import nn

import offload
from tests.conftest import run_distributed
from tests.parity import Fp32Bound, plain_loop
from tests.test_engine import LR, WD
from tests.test_reused_units import fp32_bound, random_batches
from tests.test_reused_units import tier_config as _tier_config


def tier_config(*args):
    """test_reused_units' config with the non-finite guard off: these tests are about the
    updates during backward, which the guard moves to step() ([Note: no non-finite value is
    applied] in offload/runtime/optimizer_step.py)."""
    return dataclasses.replace(_tier_config(*args), nonfinite_loss="off")

D = 16
STEPS = 6
SWITCH = 3
"""The step at which the switched run calls a second backward."""


class Stack(nn.Module):
    """Three units in a row."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(D, D) for _ in range(3)])

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = x.to(self.layers[0].weight.dtype)  # the float64 truth too
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return torch.nn.functional.mse_loss(h, y.to(h.dtype))


def stack() -> nn.Module:
    torch.manual_seed(0)
    return Stack()


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return random_batches(seed=3, steps=STEPS, d=D)


def bound(gas: int, clip: float) -> Fp32Bound:
    return fp32_bound(stack, batches, gas, clip)


def share(rank: int, world_size: int, x: torch.Tensor) -> torch.Tensor:
    n = x.shape[0] // world_size
    return x[rank * n : (rank + 1) * n]


def train(rank: int, world_size: int, gas: int, clip: float, tier: str, path: str,
          passes: int = 2, mark: bool = False) -> dict:
    """`passes` backward passes per micro-batch, each on its part of this rank's share of the
    batch with the loss divided by `passes`; `mark`: DeepSpeed's way, every pass but the last
    marked as no boundary. Returns the weights and, per optimizer step, the units updated
    during backward."""
    engine = offload.initialize(stack(), tier_config(rank, gas, clip, tier, path))
    in_backward = []
    for i, (x, y) in enumerate(batches()):
        x, y = share(rank, world_size, x), share(rank, world_size, y)
        h = x.shape[0] // passes
        for k in range(passes):
            if mark:
                engine.set_gradient_accumulation_boundary(None if k == passes - 1 else False)
            engine.backward(engine(x[k * h : (k + 1) * h], y[k * h : (k + 1) * h]) / passes)
        engine.step()
        if (i + 1) % gas == 0:
            in_backward.append(engine.step_stats()["optimizer_in_backward_units"])
    out = {"sd": {k: v.clone() for k, v in engine.full_state_dict(rank0_only=False).items()},
           "in_backward": in_backward, "transient": engine.policy.transient_grads}
    engine.close()
    return out


def train_switched(rank: int, world_size: int, tier: str, path: str) -> dict:
    """gas 1, no clipping (transient shards on a CPU): one backward per step, but at step
    SWITCH a second one on the other half. Returns the weights and the error's message."""
    engine = offload.initialize(stack(), tier_config(rank, 1, 0.0, tier, path))
    message = None
    for i, (x, y) in enumerate(batches()):
        x, y = share(rank, world_size, x), share(rank, world_size, y)
        if i != SWITCH:
            engine.backward(engine(x, y))
        else:
            h = x.shape[0] // 2
            engine.backward(engine(x[:h], y[:h]) / 2)
            try:
                engine.backward(engine(x[h:], y[h:]) / 2)
            except RuntimeError as exc:
                message = str(exc)
        engine.step()
    out = {"sd": {k: v.clone() for k, v in engine.full_state_dict(rank0_only=False).items()},
           "message": message, "transient": engine.policy.transient_grads,
           "global_steps": engine.global_steps}
    engine.close()
    return out


@functools.lru_cache(maxsize=None)
def switched_bound(world_size: int) -> Fp32Bound:
    """The plain loop of what the switched run applied: at step SWITCH, the first half of
    every rank's share with the loss halved (the refused pass added nothing)."""
    data = batches()
    x, y = data[SWITCH]
    n = x.shape[0] // world_size
    rows = torch.cat([torch.arange(r * n, r * n + n // 2) for r in range(world_size)])
    data[SWITCH] = (x[rows], y[rows])
    return Fp32Bound.measure(lambda **o: plain_loop(
        stack, data, lr=LR, weight_decay=WD, scales=lambda step: 0.5 if step == SWITCH else 1.0, **o))


def check_switched(out: dict, what: str, world_size: int = 1) -> None:
    assert out["transient"], "the switched run is meant to have transient gradient shards"
    msg = out["message"]
    assert msg is not None, f"{what}: the second backward was not refused"
    # what happened, what the weights hold, and both fixes
    assert f"second engine.backward() before engine.step() at optimizer step {SWITCH}" in msg, msg
    assert "transient gradient shards" in msg and "the first backward's update" in msg, msg
    assert "set_gradient_accumulation_boundary(False) before every engine.backward()" in msg, msg
    assert "prefetch.optimizer_in_backward=false" in msg, msg
    assert out["global_steps"] == STEPS
    # The weights are the first pass's update at SWITCH, and the run went on as plain PyTorch.
    switched_bound(world_size).check(out["sd"], what)


# -- world size 1 ----------------------------------------------------------------------------------


# (gas, clip): the boundary micro-batch runs both passes (accumulation; clipping at gas 1)
MODES = [(2, 0.0), (1, 0.5)]


@pytest.mark.parametrize("gas,clip", MODES)
@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_two_backward_per_step_trains_as_plain_pytorch(gas, clip, tier, tmp_path):
    out = train(0, 1, gas, clip, tier, str(tmp_path))
    assert not out["transient"]
    bound(gas, clip).check(out["sd"], f"two backward per step ws1 gas{gas} clip{clip} {tier}")
    # the learning step and every later one update at step(), after both passes
    assert out["in_backward"] == [0] * len(out["in_backward"]), out["in_backward"]


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_a_second_backward_after_updates_in_backward_is_refused_with_the_fix(tier, tmp_path):
    check_switched(train_switched(0, 1, tier, str(tmp_path)), f"switched to two backward ws1 {tier}")


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_the_fix_trains_as_plain_pytorch_and_keeps_the_update_in_backward(tier, tmp_path):
    """DeepSpeed's way on a transient run: the first pass is marked as no boundary, the last
    one updates during backward, on the accumulated gradients."""
    out = train(0, 1, 1, 0.0, tier, str(tmp_path), mark=True)
    assert out["transient"]
    bound(1, 0.0).check(out["sd"], f"two backward per step, boundary marked, ws1 {tier}")
    assert all(n > 0 for n in out["in_backward"]), out["in_backward"]


def test_one_backward_per_step_updates_in_backward_after_the_learning_step(tmp_path):
    """The learning step costs one step's overlap: from the second step on, a run with one
    backward per micro-batch updates during backward; with transient shards from the first."""
    out = train(0, 1, 2, 0.0, "cpu", str(tmp_path), passes=1)
    bound(2, 0.0).check(out["sd"], "one backward per step ws1 gas2")
    assert out["in_backward"][0] == 0 and all(n > 0 for n in out["in_backward"][1:]), out["in_backward"]
    out = train(0, 1, 1, 0.0, "cpu", str(tmp_path), passes=1)
    assert out["transient"]
    bound(1, 0.0).check(out["sd"], "one backward per step ws1 gas1 transient")
    assert all(n > 0 for n in out["in_backward"]), out["in_backward"]


def test_a_run_that_switches_after_learning_one_backward_is_refused_then_accumulates():
    """Without transient shards (gas 2): steps with one backward teach the update in backward;
    a step that then runs two is refused at its second (the updates already ran), and the
    steps after it accumulate their passes and update at step()."""
    engine = offload.initialize(stack(), tier_config(0, 2, 0.0, "cpu", ""))
    assert not engine.policy.transient_grads
    data = batches()
    for x, y in data[:2]:  # step 0: the learning step
        engine.backward(engine(x, y))
        engine.step()
    engine.backward(engine(*data[2]))
    engine.step()
    x, y = data[3]
    engine.backward(engine(x[:4], y[:4]) / 2)  # the boundary: updates during backward
    assert engine.policy.updated
    with pytest.raises(RuntimeError, match=r"every step so far ran one backward.*from the next step on, "
                                           r"the engine accumulates"):
        engine.backward(engine(x[4:], y[4:]) / 2)
    engine.step()
    assert engine.step_stats()["optimizer_in_backward_units"] > 0
    for x, y in data[4:]:
        engine.backward(engine(x[:4], y[:4]) / 2)
        engine.backward(engine(x[4:], y[4:]) / 2)
        engine.step()
    assert engine.step_stats()["optimizer_in_backward_units"] == 0
    assert engine.global_steps == 3
    engine.close()


def test_negative_control_dropping_the_first_backward_lands_far_outside():
    """A run that loses the first pass's gradients (trains on the second halves only) is far
    outside the bound: the check can fail."""
    got = plain_loop(stack, [(x[4:], y[4:]) for x, y in batches()], lr=LR, weight_decay=WD)
    worst, key, _ = bound(1, 0.0).worst(got, "second backward only")
    assert worst > 100, (key, worst)


# -- world size 2 ----------------------------------------------------------------------------------


def _ws2(rank: int, world_size: int, path: str) -> dict:
    out = {f"gas{gas} clip{clip}": train(rank, world_size, gas, clip, "cpu", path) for gas, clip in MODES}
    out["switched"] = train_switched(rank, world_size, "cpu", path)
    out["marked"] = train(rank, world_size, 1, 0.0, "cpu", path, mark=True)
    return out


def test_world_size_2(tmp_path):
    r0, r1 = run_distributed(_ws2, 2, str(tmp_path))
    for gas, clip in MODES:
        key = f"gas{gas} clip{clip}"
        assert all(torch.equal(r0[key]["sd"][k], r1[key]["sd"][k]) for k in r0[key]["sd"])
        bound(gas, clip).check(r0[key]["sd"], f"two backward per step ws2 {key}")
        assert r0[key]["in_backward"] == [0] * len(r0[key]["in_backward"]), r0[key]["in_backward"]
    for r in (r0, r1):  # every rank refuses at the same point
        check_switched(r["switched"], "switched to two backward ws2", world_size=2)
    bound(1, 0.0).check(r0["marked"]["sd"], "two backward per step, boundary marked, ws2")
    assert all(n > 0 for n in r0["marked"]["in_backward"]), r0["marked"]["in_backward"]


# -- CUDA ------------------------------------------------------------------------------------------


@pytest.mark.cuda
def test_cuda_two_backward_per_step_at_gas_1_trains_as_plain_pytorch():
    """A GPU run keeps its gradient shards (no transient shards), so even at gas 1 it learns:
    two passes per step accumulate and update at step()."""
    cfg = dataclasses.replace(tier_config(0, 1, 0.0, "cpu", ""), compute_device="cuda")
    engine = offload.initialize(stack(), cfg)
    assert not engine.policy.transient_grads
    in_backward = []
    for x, y in batches():
        engine.backward(engine(x[:4], y[:4]) / 2)
        engine.backward(engine(x[4:], y[4:]) / 2)
        engine.step()
        in_backward.append(engine.step_stats()["optimizer_in_backward_units"])
    sd = engine.full_state_dict()
    engine.close()
    # cuBLAS sums in another order than the CPU's GEMMs: one more fp32 realisation, judged
    # against the CPU's measured fp32 noise like every other.
    bound(1, 0.0).check(sd, "two backward per step cuda gas1")
    assert in_backward == [0] * STEPS, in_backward
