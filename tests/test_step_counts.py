"""Adam's step counts on every rank, whatever its shard of a unit holds.

A unit's shard on a rank can hold none of its optimized elements: a small unit's shard is all
padding on every rank but 0 (shards are aligned to 2048 elements), and a unit whose trained
parameters come first can leave the last ranks only frozen values. Such a rank rightly skips
the update's work, but the step count is state too: DeepSpeed requires every rank's count to
equal the global step (TestZeroAdamOptimizerStepCount), and a checkpoint re-sharded to another
world size hands a rank elements of a parameter whose count it read from its own file. A count
left at 0 there restarts Adam's bias correction: a silently different update, 2-3x the size.

The model below is built so that this happens: at world size 2 rank 1's shard of block 0 is
frozen values and padding only, and at world size 4 rank 1's shard of block 0 holds trained
elements (the numbers are in `test_the_layout_is_the_case_it_tests`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from torch import nn

import offload
from offload.config import Config, OffloadConfig, OptimizerConfig, PrecisionConfig
from offload.units.layout import FROZEN_GROUP, layout_unit
from tests.conftest import run_distributed
from tests.parity import Fp32Bound, plain_loop

LR, WD, STEPS, BATCH = 3e-3, 0.01, 6, 8

pytestmark = pytest.mark.filterwarnings("ignore:one unit, blocks.0:UserWarning")  # block 0 is 97 %, on purpose


class Big(nn.Module):
    """A trained layer of 4,970 parameters, then a frozen one of 7,100."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(70, 70)
        self.b = nn.Linear(70, 100)
        self.b.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


class Model(nn.Module):
    """Block 0 is `Big`; block 1 (404 parameters) is all padding on every rank but 0."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([Big(), nn.Linear(100, 4)])

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x, y = x.to(self.blocks[1].weight.dtype), y.to(self.blocks[1].weight.dtype)  # float64 truth
        return ((self.blocks[1](torch.tanh(self.blocks[0](x))) - y) ** 2).mean()


def batches(n: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 70, generator=g), torch.randn(BATCH, 4, generator=g)) for _ in range(n)]


def config(stage: int = 3, tier: str = "cpu", nvme_path: Any = None, clip: float = 0.0) -> Config:
    """Without clipping the updates run in backward, unit by unit (the path that skips a unit
    with nothing to do on this rank); with clipping they all run at step()."""
    return Config(
        gradient_clipping=clip,
        compute_device="cpu",
        zero_stage=stage,
        optimizer=OptimizerConfig(lr=LR, weight_decay=WD),
        precision=PrecisionConfig(dtype="fp32"),
        offload=OffloadConfig(optimizer_tier=tier, nvme_path=None if nvme_path is None else str(nvme_path)),
        nonfinite_loss="off",
    )


def train(engine: Any, data: list, rank: int, world_size: int) -> None:
    n = BATCH // world_size
    for x, y in data:
        engine.backward(engine(x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]))
        engine.step()


def trained_counts(engine: Any) -> dict[str, list[int]]:
    """Each unit's step counts of its trained parameters, as this rank holds them."""
    out = {}
    for st in engine.optimizer.unit_states:
        steps = [s for s, slot in zip(st.slot_steps, st.layout.slots) if slot.group != FROZEN_GROUP]
        if steps:
            out[st.unit.name] = steps
    assert sorted(out) == ["blocks.0", "blocks.1"], sorted(out)
    return out


def test_the_layout_is_the_case_it_tests():
    params = [(n, tuple(p.shape), FROZEN_GROUP if not p.requires_grad else 0) for n, p in Big().named_parameters()]
    at2, at4 = layout_unit(params, 2), layout_unit(params, 4)
    assert at2.shard_optimized_numel(0) > 0 and at2.shard_optimized_numel(1) == 0
    assert at4.shard_optimized_numel(1) > 0
    small = layout_unit([("w", (4, 100), 0), ("b", (4,), 0)], 4)
    assert [small.shard_optimized_numel(r) for r in range(4)][1:] == [0, 0, 0]


def _counts(rank: int, world_size: int, stage: int, tier: str, clip: float, nvme_path: str) -> list[dict]:
    cfg = config(stage, tier, f"{nvme_path}/{rank}" if tier == "nvme" else None, clip)
    if tier == "nvme":
        import os

        os.makedirs(cfg.offload.nvme_path, exist_ok=True)
    engine = offload.initialize(Model(), cfg)
    seen = []
    for step, batch in enumerate(batches(3)):
        train(engine, [batch], rank, world_size)
        assert engine.global_steps == step + 1
        seen.append(trained_counts(engine))
    engine.close()
    return seen


@pytest.mark.parametrize("world_size,stage,tier,clip", [
    (2, 1, "cpu", 0.0), (2, 2, "cpu", 1.0), (2, 3, "nvme", 0.0), (2, 3, "cpu", 1.0), (4, 3, "cpu", 0.0)])
def test_every_rank_counts_every_step_of_every_trained_parameter(world_size, stage, tier, clip, tmp_path):
    per_rank = run_distributed(_counts, world_size, stage, tier, clip, str(tmp_path))
    for rank, seen in enumerate(per_rank):
        for step, counts in enumerate(seen):
            for unit, steps in counts.items():
                assert all(s == step + 1 for s in steps), (
                    f"rank {rank}, unit {unit or '<root>'}: step counts {steps} after global step {step + 1}")


def _deepspeed_counts(rank: int, world_size: int) -> list[list[int]]:
    """DeepSpeed's TestZeroAdamOptimizerStepCount shape, through offload.compat.deepspeed."""
    import warnings

    import offload.compat.deepspeed as deepspeed

    conf = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
            "zero_optimization": {"stage": 1, "sub_group_size": 4},
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "bf16": {"enabled": True}}
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(12)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=conf)
    counts = []
    g = torch.Generator().manual_seed(2)
    for _ in range(4):  # 2 optimizer steps of 2 micro-batches
        x = torch.randn(2, 4, generator=g)
        engine.backward(engine(x).pow(2).mean())
        engine.step()
        counts.append([s for u in optimizer.state_dict()["state"].values() for s in u["slot_steps"]])
    engine.close()
    return counts


def test_deepspeeds_step_count_test_holds_on_every_rank():
    for rank, counts in enumerate(run_distributed(_deepspeed_counts, 2)):
        assert [set(c) for c in counts] == [{0}, {1}, {1}, {2}], f"rank {rank}: {counts}"


# -- a checkpoint re-sharded to another world size ------------------------------------------------


def reference(**kw: Any) -> dict[str, torch.Tensor]:
    return plain_loop(Model, batches(), lr=LR, weight_decay=WD, **kw)


def _save(rank: int, world_size: int, path: str) -> dict:
    engine = offload.initialize(Model(), config())
    train(engine, batches()[: STEPS // 2], rank, world_size)
    engine.save_checkpoint(path, tag="half")
    engine.close()
    return {}


def _resume(rank: int, world_size: int, path: str) -> tuple[dict, dict]:
    engine = offload.initialize(Model(), config())
    engine.load_checkpoint(path, tag="half")
    counts = trained_counts(engine)
    train(engine, batches()[STEPS // 2 :], rank, world_size)
    sd = engine.full_state_dict()
    engine.close()
    return sd, counts


def test_a_world_size_2_checkpoint_goes_on_at_world_sizes_1_and_4_like_the_uninterrupted_run(tmp_path):
    bound = Fp32Bound.measure(reference)
    straight = offload.initialize(Model(), config())
    train(straight, batches(), 0, 1)
    bound.check(straight.full_state_dict(), "uninterrupted, world size 1")
    straight.close()
    run_distributed(_save, 2, str(tmp_path / "ckpt"))
    for world_size in (1, 4):
        results = [_resume(0, 1, str(tmp_path / "ckpt"))] if world_size == 1 else \
            run_distributed(_resume, world_size, str(tmp_path / "ckpt"))
        for rank, (sd, counts) in enumerate(results):
            for unit, steps in counts.items():
                assert all(s == STEPS // 2 for s in steps), (
                    f"loaded at world size {world_size}, rank {rank}, unit {unit or '<root>'}: step counts {steps}")
            if rank == 0:  # full_state_dict: the whole model on rank 0
                bound.check(sd, f"saved at world size 2, resumed at {world_size}")
