"""ZeRO stages 1 and 2: parameters whole and resident between steps, the rest as stage 3.

At world size 1 on the CPU every unit is aliased to its shard, so the stage changes nothing
there; world size 2 (real processes, gloo) is where resident units, the once-per-step
re-gather and stage 1's all-reduce run. Checked:
- each stage against a plain AdamW loop (tests/parity.py bounds, measured), fp32 with
  accumulation and clipping, and bf16 (trajectory bound), parameter tier cpu and device;
- stage 2 equals stage 3 bit for bit (the same reduce-scatter and update; only when the
  full buffers are gathered differs); stage 1 differs from them only by its all-reduce's
  rounding;
- resident means resident: between micro-batches and steps the full buffers of a stage-2
  engine stay allocated (`memory_bytes()['device']` holds them), a stage-3 engine's do not,
  and the stage-2 forward/backward issues no gather (the engine's timeline counts them);
- checkpoints: saved at stage 2, loaded at stage 3 and at stage 1 (and back), the runs go on
  exactly as the uninterrupted one;
- DeepSpeed configs with stage 1 and 2 translate (ZeRO-Offload: stage 2 with
  offload_optimizer cpu), offload_param at stage < 3 and stage 0 are refused with the fix.
"""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch

import offload
from offload.config import ConfigError, load_config
from offload.config.sections import OffloadConfig
from tests.conftest import run_distributed
from tests.test_engine import engine_train, fp32_bound, lowp_bound, make_config


def _cfg(stage: int, dtype: str = "fp32", tier: str = "cpu", **kw: Any):
    return make_config(dtype=dtype, gas=2, clip=0.05 if dtype == "bf16" else 1.0,
                       zero_stage=stage, offload=OffloadConfig(param_tier=tier), **kw)


def _gathers(rank: int, world_size: int, stage: int) -> dict[str, Any]:
    """Bytes of full buffers held after each step, and gathers per optimizer step."""
    from tests.test_engine import batches_for, make_model

    torch.manual_seed(0)
    engine = offload.initialize(make_model("gpt"), _cfg(stage))
    calls = [0]
    for unit in engine.units:  # count the gathers that fill a full buffer
        def counting(*a: Any, _orig: Any = unit.gather, **k: Any) -> Any:
            calls[0] += 1
            return _orig(*a, **k)
        unit.gather = counting
    held, per_step = [], []
    for i, (x, y) in enumerate(batches_for("gpt")):
        n = x.shape[0] // world_size
        engine.backward(engine(x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]))
        engine.step()
        if i % 2 == 1:  # an optimizer step (2 micro-batches)
            held.append(sum(u.full_bytes() for u in engine.units))
            per_step.append(calls[0])
            calls[0] = 0
    units = len(engine.units)
    engine.close()
    return {"held": held, "gathers": per_step, "units": units}


def _all_stages(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for stage in (1, 2, 3):
        for tier in ("cpu", "device"):
            out[f"fp32 stage {stage} {tier}"] = engine_train("gpt", _cfg(stage, tier=tier), rank, world_size)
    out["bf16 stage 2"] = engine_train("gpt", _cfg(2, "bf16"), rank, world_size)
    for stage in (2, 3):
        out[f"held {stage}"] = _gathers(rank, world_size, stage)
    out["resume"] = _resume(rank, world_size)
    return out


@pytest.fixture(scope="module")
def ws2() -> dict[str, Any]:
    return run_distributed(_all_stages, 2)[0]


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("tier", ["cpu", "device"])
def test_each_stage_matches_plain_adamw_at_world_size_2(ws2, stage: int, tier: str) -> None:
    sd, info = ws2[f"fp32 stage {stage} {tier}"]
    assert info["global_steps"] > 0
    fp32_bound("gpt", 2, 1.0).check(sd, f"stage {stage}, param tier {tier}, ws2")


def test_stage_2_equals_stage_3_bit_for_bit_and_stage_1_by_rounding(ws2) -> None:
    s3, _ = ws2["fp32 stage 3 cpu"]
    s2, _ = ws2["fp32 stage 2 cpu"]
    s1, _ = ws2["fp32 stage 1 cpu"]
    assert all(torch.equal(s2[k], s3[k]) for k in s3)
    # Stage 1's all-reduce sums gradients divided by the world size: another rounding of
    # the same mean, far inside the bound the plain loop's own noise sets.
    assert fp32_bound("gpt", 2, 1.0).worst(s1)[0] < 1


def test_bf16_stage_2_within_the_trajectory_bound(ws2) -> None:
    sd, _ = ws2["bf16 stage 2"]
    lowp_bound("gpt", "bf16", 2, 0.05).check(sd, "bf16 stage 2 ws2")


def test_stage_2_keeps_parameters_resident(ws2) -> None:
    s2, s3 = ws2["held 2"], ws2["held 3"]
    held2, held3 = s2["held"], s3["held"]
    assert min(held2) > 0 and all(h == held2[0] for h in held2), held2  # allocated, never dropped
    assert max(held3) < held2[0] / 2, (held3, held2)  # stage 3 frees them between uses
    # Stage 2: each unit gathered once per step (its new shard, at its first use after the
    # update), none in forward and backward of later micro-batches; stage 3 gathers in
    # forward and again in backward of every micro-batch (a few kept in between).
    assert all(g <= s2["units"] for g in s2["gathers"][1:]), s2
    assert all(g >= 2 * s3["units"] for g in s3["gathers"][1:]), s3


# -- checkpoints across stages ------------------------------------------------------------


def _resume(rank: int, world_size: int) -> dict[str, Any]:
    from tests.test_engine import batches_for, make_model

    batches = batches_for("gpt")
    half = len(batches) // 2

    def run(stage: int, steps: list, load: Any = None, save: Any = None) -> Any:
        torch.manual_seed(0)
        engine = offload.initialize(make_model("gpt"), _cfg(stage))
        if load is not None:
            engine.load_checkpoint(load)
        for x, y in steps:
            n = x.shape[0] // world_size
            engine.backward(engine(x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]))
            engine.step()
        if save is not None:
            engine.save_checkpoint(save, tag="half")
        sd = engine.full_state_dict(rank0_only=False)
        engine.close()
        return sd

    with tempfile.TemporaryDirectory() as d:
        # every rank must use the same directory: rank 0's, broadcast by name
        import torch.distributed as dist

        name = [d]
        dist.broadcast_object_list(name, src=0)
        d = name[0]
        whole = run(2, batches)
        run(2, batches[:half], save=d)
        return {f"stage {s}": run(s, batches[half:], load=d) for s in (1, 2, 3)} | {"whole": whole}


def test_a_stage_2_checkpoint_loads_at_stages_1_2_and_3(ws2) -> None:
    r = ws2["resume"]
    for s in (2, 3):
        assert all(torch.equal(r[f"stage {s}"][k], r["whole"][k]) for k in r["whole"]), s
    assert fp32_bound("gpt", 2, 1.0).worst(r["stage 1"])[0] < 1


# -- configs ----------------------------------------------------------------------------


def test_deepspeed_stage_1_and_2_translate() -> None:
    zero_offload = {"train_micro_batch_size_per_gpu": 1,
                    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    cfg = load_config(zero_offload, world_size=1)
    assert cfg.zero_stage == 2 and cfg.offload.param_tier == "device" and cfg.offload.optimizer_tier == "cpu"
    assert load_config({**zero_offload, "zero_optimization": {"stage": 1}}, world_size=1).zero_stage == 1
    with pytest.raises(ConfigError, match="needs stage 3"):
        load_config({**zero_offload, "zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
                    world_size=1)
    with pytest.raises(ConfigError, match="stage 0"):
        load_config({**zero_offload, "zero_optimization": {"stage": 0}}, world_size=1)
    with pytest.raises(ConfigError, match="NVMe parameter tier"):
        load_config({"zero_stage": 2, "offload": {"param_tier": "nvme", "nvme_path": "/tmp"}})
    assert load_config({"zero_stage": 2}).zero_stage == 2
