"""Per-unit placement: with an NVMe tier, `offload.ram_budget_bytes` / `ram_fraction` keep
some units' parameter shards and optimizer states in RAM (offload/storage/placement.py).

The choice is arithmetic (tested on sizes); the engine with a mixed placement must train
bit-identically to the all-in-memory engine (placement moves bytes, never the arithmetic),
at world sizes 1 and 2, with every I/O block delayed too; its disk traffic per step must
fall by what the units kept in RAM would have moved; checkpoints load across placements.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

import offload
from offload.config import ConfigError, load_config
from offload.storage.placement import PARAM_TRAFFIC, STATE_TRAFFIC, Placement, choose_placement
from offload.storage.tier_kind import TierKind
from tests.conftest import TinyGPT, gpt_batches, run_distributed
from tests.test_engine import engine_train, fp32_bound
from tests.test_nvme import CASES, slow_io, swap_dir_is_gone, tier_config  # noqa: F401 (fixture)

NVME, CPU = TierKind.NVME, TierKind.CPU

# -- the choice ----------------------------------------------------------------------------------


def test_parameter_shards_come_first_then_the_earliest_units_state():
    # 3 units: parameter shards of 10 B, states of 60 B. A budget of 95 B keeps all three
    # shards (3 B moved per byte kept) and one state (2 B per byte): unit 0's, the earliest.
    p = choose_placement([10, 10, 10], [60, 60, 60], NVME, NVME, 95)
    assert p.param_on_nvme == (False, False, False)
    assert p.state_on_nvme == (False, True, True)
    assert p.param == (CPU,) * 3 and p.state == (CPU, NVME, NVME)  # one kind per unit: NVMe's ram_kind
    assert p.kept_bytes([10] * 3, [60] * 3, NVME, NVME) == 90
    assert p.nvme_traffic([10] * 3, [60] * 3) == STATE_TRAFFIC * 120
    assert p.describe() == ("parameters: 3/3 units in RAM; optimizer state: 1/3 units in RAM "
                            "(units 0)")


def test_an_item_that_does_not_fit_is_skipped_and_smaller_ones_still_fill():
    # unit 0's state (100 B) does not fit in 70 B left; unit 1's (50 B) does.
    p = choose_placement([0, 0], [100, 50], CPU, NVME, 70)
    assert p.state_on_nvme == (True, False) and p.param_on_nvme == (False, False)
    # A tier that is not NVMe is never "kept": its units are in memory already.
    assert p.kept_bytes([0, 0], [100, 50], CPU, NVME) == 50


def test_no_budget_is_the_uniform_placement_and_a_full_budget_keeps_all():
    sizes = ([4, 4, 4, 4], [8, 8, 8, 8])
    assert choose_placement(*sizes, NVME, NVME, 0) == Placement.uniform(4, NVME, NVME)
    everything = choose_placement(*sizes, NVME, NVME, 48)
    assert not everything.any_nvme and not everything.mixed
    assert choose_placement(*sizes, NVME, NVME, 47).mixed
    with pytest.raises(ValueError, match="negative"):
        choose_placement(*sizes, NVME, NVME, -1)


def test_the_traffic_model_prefers_the_bytes_that_move_most():
    # One byte of RAM saves PARAM_TRAFFIC bytes on a parameter shard and STATE_TRAFFIC on a
    # state: with room for one of two equal items the parameter shard wins.
    assert PARAM_TRAFFIC > STATE_TRAFFIC
    p = choose_placement([8], [8], NVME, NVME, 8)
    assert p.param_on_nvme == (False,) and p.state_on_nvme == (True,)


def test_config_errors_say_what_to_do(tmp_path):
    base = {"param_tier": "nvme", "optimizer_tier": "nvme", "nvme_path": str(tmp_path)}
    with pytest.raises(ConfigError, match="both set"):
        load_config({"offload": {**base, "ram_budget_bytes": 1, "ram_fraction": 0.5}})
    with pytest.raises(ConfigError, match="between 0 and 1"):
        load_config({"offload": {**base, "ram_fraction": 2}})
    with pytest.raises(ConfigError, match="neither param_tier nor optimizer_tier is 'nvme'"):
        load_config({"offload": {"ram_budget_bytes": 1 << 30}})
    with pytest.raises(ConfigError, match="chosen by placement 'auto'"):
        load_config({"offload": {"placement": "auto", "ram_fraction": 0.5, "nvme_path": str(tmp_path)}})


# -- the engine ------------------------------------------------------------------------------------


def mixed_config(path, dtype, fraction, param_tier="nvme", optimizer_tier="nvme", **kw):
    cfg = tier_config(path, param_tier, optimizer_tier, dtype, **kw)
    return replace(cfg, offload=replace(cfg.offload, ram_fraction=fraction))


@pytest.fixture(scope="module")
def baselines():
    return {case: engine_train(case[0], tier_config(None, "cpu", "cpu", case[1]))[0] for case in CASES}


def _placement_of(model: str, cfg) -> Placement:
    from tests.test_engine import MODELS

    torch.manual_seed(0)
    engine = offload.initialize(MODELS[model](), cfg)
    try:
        return engine.placement
    finally:
        engine.close()


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}")
@pytest.mark.parametrize("tiers,fraction", [(("nvme", "nvme"), 0.2), (("nvme", "nvme"), 0.6),
                                           (("nvme", "cpu"), 0.5), (("cpu", "nvme"), 0.5)])
def test_a_mixed_placement_trains_bit_identically(case, tiers, fraction, baselines, tmp_path):
    model, dtype = case
    cfg = mixed_config(tmp_path, dtype, fraction, *tiers)
    placement = _placement_of(model, cfg)
    assert placement.mixed, placement  # the case is a real split: some units each way
    sd, info = engine_train(model, cfg)
    for k, v in baselines[case].items():
        assert torch.equal(sd[k], v), (k, placement)
    if dtype == "fp32":
        fp32_bound(model, 2, 0.05).check(sd, f"{model} {tiers} ram_fraction {fraction}")
    assert info["memory"]["nvme"] > 0 and swap_dir_is_gone(tmp_path)


def test_a_mixed_placement_with_every_io_block_delayed(baselines, tmp_path, slow_io):  # noqa: F811
    # A small pinned budget: buffers are reused while writes are in flight, and the
    # NVMe pipeline reads its next unit across the units kept in RAM.
    cfg = mixed_config(tmp_path, "bf16", 0.6, budget=1 << 17)
    assert _placement_of("edge", cfg).mixed
    sd, _ = engine_train("edge", cfg)
    for k, v in baselines[("edge", "bf16")].items():
        assert torch.equal(sd[k], v), k


def test_disk_traffic_falls_by_what_the_kept_units_would_move(tmp_path):
    """Measured, not modelled: the bytes the NVMe tiers move in the same steps with every
    unit on NVMe and with part of them kept in RAM. The difference must be at least what
    the kept units' bytes move once per step (a state is read and written: twice its
    bytes; a parameter shard at least written once), and the mixed run must move bytes."""
    def traffic(fraction):
        cfg = replace(tier_config(tmp_path, "nvme", "nvme", "bf16"), gradient_accumulation_steps=1)
        if fraction:
            cfg = replace(cfg, offload=replace(cfg.offload, ram_fraction=fraction))
        torch.manual_seed(0)
        engine = offload.initialize(TinyGPT(), cfg)
        batches = gpt_batches(4)
        x, y = batches[0]
        engine.backward(engine(x, y))
        engine.step()  # the first step writes every state once: measure the later ones
        before = engine.io_stats()
        for x, y in batches[1:]:
            engine.backward(engine(x, y))
            engine.step()
        after = engine.io_stats()
        placement = engine.placement
        sizes = [u.layout.shard_numel * 2 for u in engine.units]
        states = [engine.optimizer.store.layouts[i].nbytes for i in range(len(engine.units))] \
            if not fraction else None
        engine.close()
        moved = sum(after[k] - before[k] for k in ("bytes_read", "bytes_written")) / 3
        return moved, placement, sizes, states

    full, _, sizes, states = traffic(0)
    part, placement, _, _ = traffic(0.5)
    assert placement.mixed and part > 0
    kept_state = sum(s for s, on in zip(states, placement.state_on_nvme) if not on)
    kept_param = sum(p for p, on in zip(sizes, placement.param_on_nvme) if not on)
    assert full - part >= 2 * kept_state + kept_param, (full, part, kept_state, kept_param)


def _ws2_mixed(rank: int, world_size: int, path: str):
    out = {}
    for case in CASES:
        out[(case, "base")] = engine_train(case[0], tier_config(path, "cpu", "cpu", case[1]), rank, world_size)[0]
        cfg = mixed_config(path, case[1], 0.5)
        out[(case, "mixed")] = engine_train(case[0], cfg, rank, world_size)[0]
    return out


def test_a_mixed_placement_at_world_size_2(tmp_path):
    rank0, _ = run_distributed(_ws2_mixed, 2, str(tmp_path))
    for case in CASES:
        base, sd = rank0[(case, "base")], rank0[(case, "mixed")]
        for k in base:
            assert torch.equal(sd[k], base[k]), (case, k)
    assert swap_dir_is_gone(tmp_path)


@pytest.mark.parametrize("save_at,load_at", [(0.0, 0.5), (0.5, None), (0.3, 0.7)])
def test_checkpoints_load_across_placements(tmp_path, save_at, load_at):
    """Saved with one placement (fraction 0: all on NVMe; None: all in memory), loaded into
    another: training goes on exactly as without the save."""
    batches = gpt_batches(6)

    def config(fraction, where):
        os.makedirs(where, exist_ok=True)
        if fraction is None:
            cfg = tier_config(None, "cpu", "cpu", "bf16")
        else:
            cfg = tier_config(where, "nvme", "nvme", "bf16")
            cfg = replace(cfg, offload=replace(cfg.offload, ram_fraction=fraction or None))
        return replace(cfg, gradient_accumulation_steps=1)

    def train(engine, part):
        for x, y in part:
            engine.backward(engine(x, y))
            engine.step()

    torch.manual_seed(0)
    first = offload.initialize(TinyGPT(), config(save_at, tmp_path / "a"))
    train(first, batches[:3])
    first.save_checkpoint(str(tmp_path / "ck"))
    train(first, batches[3:])
    want = first.full_state_dict()
    first.close()

    torch.manual_seed(1)  # other initial weights: the load must replace them all
    second = offload.initialize(TinyGPT(), config(load_at, tmp_path / "b"))
    second.load_checkpoint(str(tmp_path / "ck"))
    train(second, batches[3:])
    got = second.full_state_dict()
    second.close()
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_a_pinned_pool_smaller_than_three_units_says_the_pipeline_will_not_overlap(tmp_path, caplog):
    import logging

    def init(budget):
        cfg = tier_config(tmp_path, "nvme", "nvme", "bf16", budget=budget)
        with caplog.at_level(logging.WARNING, logger="offload"):
            caplog.clear()
            offload.initialize(TinyGPT(), cfg).close()
        return caplog.text

    small = init(1 << 18)  # about 1.6 units of TinyGPT's largest working set
    assert "will not overlap" in small and "three units" in small, small
    assert "will not overlap" not in init(1 << 24)  # the control: room for three
