"""A non-finite gradient behind a finite loss never reaches a weight or a moment (issue #43,
item 1; [Note: no non-finite value is applied] in offload/runtime/optimizer_step.py).

The model injects +inf into the gradient flowing out of its second block at one chosen step
(an autograd function that is the identity forward): the blocks after it (updated first in
backward) get finite gradients, the blocks before it and the root's embedding get inf/NaN.
Before the guard covered it, a run with the update in backward (gas 1, no clipping: the
default CPU configuration) updated blocks 3 and 2, then applied the inf to the rest, every
weight ended NaN and `skipped_steps` stayed 0; 'raise' did not raise.

Each case runs in both modes the step has (the configuration that updates in backward: gas 1
and no clipping; and one that updates at `step()`: clipping at 1.0), in fp32 and bf16, at
world size 1 and 2 (at 2, rank 1 alone sees the inf):
- 'skip' (the default): the step is skipped on every rank, counted and logged naming a unit,
  and the weights are bit-identical to the same engine's run without that batch;
- 'raise': `engine.step()` raises naming the unit and the step, nothing is applied (the
  weights are those before the step), and the engine trains on;
- 'off' (the negative control): the inf reaches the weights: the test sees NaN.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import offload
from offload.config.sections import Config, OptimizerConfig, PrecisionConfig
from tests.conftest import gpt_batches, run_distributed

STEPS, BAD, VOCAB, D = 4, 2, 64, 32
MODES = {"in backward": {}, "at step": {"gradient_clipping": 1.0}}


class InfGrad(torch.autograd.Function):
    """The identity forward; backward puts +inf into the gradient's first element."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor) -> torch.Tensor:
        return h.view_as(h)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        g = g.clone()
        g.view(-1)[0] = float("inf")
        return g


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(D), nn.Linear(D, D)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + F.gelu(self.fc(self.norm(h)))


class Poisoned(nn.Module):
    """Embedding, 4 blocks (the units), head; `poison`: the inf enters after blocks.1."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(D, VOCAB)
        self.poison = False

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for i, block in enumerate(self.blocks):
            h = block(h)
            if i == 1 and self.poison:
                h = InfGrad.apply(h)
        logits = self.head(h).float()
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def config(dtype: str, guard: str, mode: str) -> Config:
    return Config(compute_device="cpu", optimizer=OptimizerConfig(lr=2e-3, weight_decay=0.01),
                  precision=PrecisionConfig(dtype=dtype), nonfinite_loss=guard, **MODES[mode])


def train(dtype: str, guard: str, mode: str, rank: int = 0, world_size: int = 1, bad: Any = BAD,
          drop: Any = None) -> dict[str, Any]:
    """STEPS steps; the inf enters at step `bad` (on the last rank only); `drop`: that step's
    batch is left out instead."""
    model = Poisoned()
    engine = offload.initialize(model, config(dtype, guard, mode))
    out: dict[str, Any] = {"error": None}
    n = 8 // world_size
    for step, (x, y) in enumerate(gpt_batches(STEPS, vocab=VOCAB)):
        if step == drop:
            continue
        model.poison = step == bad and rank == world_size - 1
        engine.backward(engine(x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]))
        if step == bad:  # every rank: it gathers
            out["before"] = engine.full_state_dict(rank0_only=False)
        try:
            engine.step()
        except FloatingPointError as exc:
            out["error"] = str(exc)
            out["after_error"] = engine.full_state_dict(rank0_only=False)
    model.poison = False
    out["skipped"] = engine.skipped_steps
    out["global_steps"] = engine.global_steps
    out["sd"] = engine.full_state_dict(rank0_only=False)
    engine.close()
    return out


def nan_free(sd: dict[str, torch.Tensor]) -> bool:
    return all(torch.isfinite(v).all() for v in sd.values() if v.is_floating_point())


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Bit for bit (a NaN equal to a NaN where both have one)."""
    return list(a) == list(b) and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        and torch.allclose(a[k], b[k], rtol=0, atol=0, equal_nan=True) for k in a)


CASES = [(d, m) for d in ("fp32", "bf16") for m in MODES]


def _ws2(rank: int, world_size: int) -> dict[tuple, Any]:
    out = {}
    for dtype, mode in CASES:
        for guard in ("skip", "raise", "off"):
            out[(dtype, mode, guard)] = train(dtype, guard, mode, rank, world_size)
        out[(dtype, mode, "dropped")] = train(dtype, "skip", mode, rank, world_size, bad=None, drop=BAD)
    return out


@pytest.fixture(scope="module")
def ws2() -> list[dict[tuple, Any]]:
    return run_distributed(_ws2, 2)


def check_skip(r: dict[str, Any], dropped: dict[str, Any], what: str) -> None:
    assert r["error"] is None, what
    assert r["skipped"] == 1 and r["global_steps"] == STEPS - 1, (what, r["skipped"], r["global_steps"])
    assert nan_free(r["sd"]), f"{what}: a non-finite value reached the weights"
    assert same(r["sd"], dropped["sd"]), f"{what}: the weights differ from the run without that batch"


def check_raise(r: dict[str, Any], what: str) -> None:
    assert r["error"] is not None, f"{what}: nonfinite_loss='raise' did not raise"
    assert "optimizer step 2" in r["error"] and "units <root>, blocks.0, blocks.1" in r["error"], (what, r["error"])
    assert "nothing was applied" in r["error"], r["error"]
    assert same(r["after_error"], r["before"]), f"{what}: the refused step changed weights"
    assert r["skipped"] == 1 and nan_free(r["sd"]), what


def check_off(r: dict[str, Any], what: str) -> None:
    """The negative control: with the guard off the test sees the NaN."""
    assert r["skipped"] == 0 and not nan_free(r["sd"]), f"{what}: the negative control saw no NaN"


@pytest.mark.parametrize("dtype, mode", CASES)
def test_world_size_1(dtype, mode, caplog):
    with caplog.at_level(logging.WARNING, logger="offload"):
        skipped = train(dtype, "skip", mode)
    what = f"ws1 {dtype} {mode}"
    check_skip(skipped, train(dtype, "skip", mode, bad=None, drop=BAD), what)
    assert any("optimizer step 2 skipped: a non-finite gradient" in r.getMessage()
               and "units <root>, blocks.0, blocks.1 " in r.getMessage() for r in caplog.records), caplog.text
    check_raise(train(dtype, "raise", mode), what)
    check_off(train(dtype, "off", mode), what)


@pytest.mark.parametrize("dtype, mode", CASES)
def test_world_size_2_one_ranks_inf_skips_every_rank(dtype, mode, ws2):
    for rank, res in enumerate(ws2):
        what = f"ws2 rank {rank} {dtype} {mode}"
        check_skip(res[(dtype, mode, "skip")], res[(dtype, mode, "dropped")], what)
        check_raise(res[(dtype, mode, "raise")], what)
        check_off(res[(dtype, mode, "off")], what)
    for key in ws2[0]:  # one model: the same on both ranks
        assert same(ws2[0][key]["sd"], ws2[1][key]["sd"]), key


def test_the_guard_updates_at_step_and_off_in_backward():
    """The cost side of the guard: with it on, the default configuration's updates run at
    step() (none during backward); with it off they run during backward again."""
    x, y = gpt_batches(1, vocab=VOCAB)[0]
    counts = {}
    for guard in ("skip", "off"):
        engine = offload.initialize(Poisoned(), config("fp32", guard, "in backward"))
        for _ in range(2):  # the first step learns the pass pattern
            engine.backward(engine(x, y))
            engine.step()
        counts[guard] = engine.step_stats()["optimizer_in_backward_units"]
        engine.close()
    assert counts == {"skip": 0, "off": 5}, counts
