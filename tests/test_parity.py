"""The fp32 bound's premise, checked in the same run ([Note: kinks] in tests/parity.py).

`Fp32Bound.measure` refuses a model and data where a non-smooth function's input lies within
rounding distance of its kink: there two correct fp32 runs may land on either side, and no
multiple of the references' noise bounds the run under test (issue #54: OPT's ReLU at world
size 2 on a Zen 3 CPU landed 521x outside a bound every reference met). Each case below is
built so that the float64 truth sits exactly on a kink (a ReLU input of 0, two equal router
logits) or far from every kink, so the outcome is the same on every CPU.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.parity import Fp32Bound, IllConditioned, KinkInputs, assert_smooth, plain_loop

D = 8
LR, WD = 2e-3, 0.01


def batches(n: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(16, D, generator=g), torch.randn(16, D, generator=g)) for _ in range(n)]


class Mlp(nn.Module):
    """x -> fc2(act(fc1(x))), MSE to y. `dead`: fc1's first unit has zero weights and bias,
    so its input is exactly 0 for every sample (on the kink, in float64 and in fp32)."""

    def __init__(self, act: str, dead: bool = False, offset: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        self.act = act
        with torch.no_grad():
            self.fc1.bias.add_(offset)
            if dead:
                self.fc1.weight[0].zero_()
                self.fc1.bias[0] = 0.0

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x, y = x.to(self.fc1.weight.dtype), y.to(self.fc1.weight.dtype)  # float64 for the truth
        h = self.fc1(x)
        h = F.relu(h) if self.act == "relu" else F.gelu(h)
        return F.mse_loss(self.fc2(h), y)


class Routed(nn.Module):
    """Top-1 routing between two experts (`tie`: the router's second row is the first plus
    1e-9 where fp32 holds it: each sample's two logits differ by ~1e-10, below the fp32
    forward's rounding, ~1e-9 here)."""

    def __init__(self, tie: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.router = nn.Linear(D, 2)
        self.experts = nn.ModuleList(nn.Linear(D, D) for _ in range(2))
        if tie:
            with torch.no_grad():
                self.router.weight[1] = self.router.weight[0].double() + 1e-9
                self.router.bias[1] = self.router.bias[0].double() + 1e-9

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x, y = x.to(self.router.weight.dtype), y.to(self.router.weight.dtype)
        gates = self.router(x).softmax(-1)
        top = gates.topk(1, dim=-1).indices.squeeze(-1)
        out = torch.stack([self.experts[int(e)](x[i]) * gates[i, int(e)] for i, e in enumerate(top)])
        return F.mse_loss(out, y)


def measure(make) -> Fp32Bound:
    return Fp32Bound.measure(lambda **o: plain_loop(make, batches(), lr=LR, weight_decay=WD, **o))


def test_a_relu_input_on_its_kink_is_named():
    with pytest.raises(IllConditioned, match=r"relu on \(16, 16\).* 0 from a kink.*smooth activation"):
        measure(functools.partial(Mlp, "relu", dead=True))


def test_a_top_k_tie_is_named():
    with pytest.raises(IllConditioned, match=r"topk on \(16, 2\)"):
        measure(functools.partial(Routed, tie=True))


def test_relu_far_from_its_kink_is_measured_with_its_margin():
    """Every fc1 input is 3 or more from 0 (the bias moved by +5, the inputs' spread is below
    2): the margin is finite and far above 1, and the bound is measured."""
    bound = measure(functools.partial(Mlp, "relu", offset=5.0))
    assert 1e3 < bound.kink_margin < math.inf, bound.kink_margin
    assert bound.bound


def test_a_smooth_model_calls_no_kink():
    assert measure(functools.partial(Mlp, "gelu", dead=True)).kink_margin == math.inf


def relu_calls(truth_inputs: list[torch.Tensor], ref_inputs: list[torch.Tensor]) -> tuple[KinkInputs, KinkInputs]:
    """The records of F.relu on each input: the truth's (as float64) and the reference's."""
    records = KinkInputs(), KinkInputs()
    for rec, inputs, dtype in zip(records, (truth_inputs, ref_inputs), (torch.float64, torch.float32)):
        with rec:
            for x in inputs:
                F.relu(x.to(dtype))
    return records


def test_a_run_that_took_another_route_is_named():
    """A selection that went another way shows as a different call sequence."""
    truth, ref = relu_calls([torch.ones(3)], [torch.ones(3), torch.ones(3)])
    with pytest.raises(IllConditioned, match="made 2 non-smooth calls and the float64 truth 1"):
        assert_smooth(truth, {"fp32": ref})


def test_inputs_no_rounding_reaches_are_not_judged():
    """Data (bit-identical in every run) on a kink decides nothing: no run can cross it."""
    truth, ref = relu_calls([torch.zeros(3)], [torch.zeros(3)])
    assert assert_smooth(truth, {"fp32": ref}) == math.inf
