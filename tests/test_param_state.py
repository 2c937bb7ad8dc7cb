"""One parameter's fp32 master and optimizer state across the shards (issue #33):
`engine.param_state` and DeepSpeed's `deepspeed.utils.safe_get/set_full/local_*`.

Pinned exactly (`torch.equal`: these are copies, no arithmetic): the full fp32 value is the
engine's trained weight; the ranks' local parts put together are the full tensor; a value set
is read back, reaches the model's forward and survives NVMe; frozen parameters, 8-bit
moments and unknown keys get clear refusals; `zero_optimization_stage()` is the configured
stage.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import offload
from offload.compat.deepspeed import utils as ds_utils
from offload.config import OffloadConfig
from tests.conftest import TinyGPT, gpt_batches, run_distributed
from tests.test_engine import make_config


def trained(cfg, rank: int = 0, world_size: int = 1, steps: int = 2):
    torch.manual_seed(0)
    engine = offload.initialize(TinyGPT(n_layer=2), cfg)
    for x, y in gpt_batches(steps):
        n = x.shape[0] // world_size
        engine.backward(engine(x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]))
        engine.step()
    return engine


def nvme_config(path):
    return dataclasses.replace(make_config(), offload=OffloadConfig(
        param_tier="nvme", optimizer_tier="nvme", nvme_path=str(path), pinned_budget_bytes=1 << 22))


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_full_fp32_is_the_trained_weight_and_a_set_value_is_trained_from(tier, tmp_path):
    cfg = make_config() if tier == "cpu" else nvme_config(tmp_path)
    engine = trained(cfg)
    sd = engine.full_state_dict()
    params = dict(engine.named_parameters())
    for name, p in params.items():
        assert torch.equal(ds_utils.safe_get_full_fp32_param(p), sd[name]), name
        assert torch.equal(engine.param_state.full(name), sd[name]), name  # by name too
    # set: read back, seen by the forward, and the next step starts from it
    name = "blocks.0.attn.proj.weight" if "blocks.0.attn.proj.weight" in params else next(iter(params))
    p = params[name]
    new = torch.randn(p.shape)
    ds_utils.safe_set_full_fp32_param(p, new)
    assert torch.equal(ds_utils.safe_get_full_fp32_param(p), new)
    assert torch.equal(engine.full_state_dict()[name], new)
    m = torch.randn(p.shape).abs()
    ds_utils.safe_set_full_optimizer_state(p, m, "exp_avg_sq")
    assert torch.equal(ds_utils.safe_get_full_optimizer_state(p, "exp_avg_sq"), m)
    plain = TinyGPT(n_layer=2)
    plain.load_state_dict(engine.full_state_dict())
    x, y = gpt_batches(1)[0]
    with torch.no_grad():
        assert torch.equal(engine(x, y), plain(x, y))  # the forward uses the value set
    engine.backward(engine(x, y))
    engine.step()
    assert not torch.equal(ds_utils.safe_get_full_fp32_param(p), new)  # trained on from it
    engine.close()


def test_refusals():
    torch.manual_seed(0)
    model = TinyGPT(n_layer=2)
    model.blocks[0].requires_grad_(False)
    engine = offload.initialize(model, make_config())
    frozen = model.blocks[0].ln1.weight
    assert ds_utils.safe_get_full_fp32_param(frozen) is None
    with pytest.raises(ValueError, match="frozen"):
        ds_utils.safe_set_full_fp32_param(frozen, torch.zeros(frozen.shape))
    live = model.blocks[1].ln1.weight
    with pytest.raises(KeyError, match="no state 'momentum_buffer'.*exp_avg"):
        ds_utils.safe_get_full_optimizer_state(live, "momentum_buffer")
    with pytest.raises(ValueError, match="shape"):
        ds_utils.safe_set_full_fp32_param(live, torch.zeros(3))
    with pytest.raises(ValueError, match="no live offload engine"):
        ds_utils.safe_get_full_fp32_param(torch.nn.Parameter(torch.zeros(2)))
    engine.close()
    cfg8 = make_config()
    cfg8 = dataclasses.replace(cfg8, optimizer=dataclasses.replace(cfg8.optimizer, moments_dtype="8bit"))
    engine8 = offload.initialize(TinyGPT(n_layer=2), cfg8)
    with pytest.raises(NotImplementedError, match="8 bits"):
        ds_utils.safe_get_full_optimizer_state(next(engine8.parameters()), "exp_avg")
    engine8.close()


def _ws2(rank: int, world_size: int) -> dict:
    engine = trained(make_config(zero_stage=2), rank, world_size)
    out = {}
    for name, p in engine.named_parameters():
        out[name] = (ds_utils.safe_get_full_fp32_param(p), ds_utils.safe_get_local_fp32_param(p),
                     ds_utils.safe_get_full_optimizer_state(p, "exp_avg"),
                     ds_utils.safe_get_local_optimizer_state(p, "exp_avg"))
    out["sd"] = engine.full_state_dict(rank0_only=False)
    p = next(engine.parameters())
    local = ds_utils.safe_get_local_fp32_param(p)
    if local is not None:
        ds_utils.safe_set_local_fp32_param(p, torch.full_like(local, float(rank + 1)))
    out["after set_local"] = ds_utils.safe_get_full_fp32_param(p)
    engine.close()
    return out


def test_world_size_2_local_parts_make_the_full_tensor():
    r0, r1 = run_distributed(_ws2, 2)
    for name, got in r0.items():
        if name in ("after set_local", "sd"):
            continue
        full0, loc0, m0, mloc0 = got
        full1, loc1, m1, mloc1 = r1[name]
        assert torch.equal(full0, full1) and torch.equal(m0, m1), name
        assert torch.equal(full0, r0["sd"][name]), name
        parts = [t for t in (loc0, loc1) if t is not None]
        assert torch.equal(torch.cat(parts), full0.reshape(-1)), name
        mparts = [t for t in (mloc0, mloc1) if t is not None]
        assert torch.equal(torch.cat(mparts), m0.reshape(-1)), name
    after = r0["after set_local"].reshape(-1)
    assert set(after.unique().tolist()) <= {1.0, 2.0} and torch.equal(after, r1["after set_local"].reshape(-1))
