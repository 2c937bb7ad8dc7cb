"""The update split between the compute device and the CPU ([Note: the update split] in
offload/storage/device_states.py): units whose optimizer state lives on the device update
there with torch's kernels, the others with the native CPU Adam.

On this CPU-only suite the compute device is the CPU, and device units take the path a GPU
run takes (device tensors, torch's fused AdamW, the device parameter tier, host copies for
checkpoints). Every split — all on the CPU, mixed, all on the device — trains to plain
`torch.optim.AdamW` within the measured bounds of tests/parity.py, at world sizes 1 and 2,
fp32 and bf16, ZeRO stages 1-3, with accumulation and clipping; a device update that drops
the gradient scale lands far outside. A checkpoint saved with one split loads bit-exactly
into an engine with another.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional

import pytest
import torch

import offload
from offload.config import Config, OffloadConfig, OptimizerConfig, PrecisionConfig
from tests.conftest import TinyGPT, gpt_batches, run_distributed
from tests.parity import Fp32Bound, TrajectoryBound, plain_loop

LR, WD = 2e-3, 0.01
STEPS = 8
"""Micro-batches per run (4 optimizer steps at gas 2): enough for every unit's moments and the
clip factor to matter, short enough for 36 runs."""
GAS, CLIP = 2, 0.05

SPLITS: dict[str, dict[str, Any]] = {
    "cpu": {},
    "mixed": {"optimizer_device_units": 2},  # the root and blocks.0
    "device": {"optimizer_tier": "device"},
}


def config(split: str, dtype: str = "fp32", stage: int = 3, gas: int = GAS, clip: float = CLIP,
           **offload_kw: Any) -> Config:
    return Config(
        compute_device="cpu", zero_stage=stage,
        optimizer=OptimizerConfig(lr=LR, weight_decay=WD, type="AdamW"),
        precision=PrecisionConfig(dtype=dtype), gradient_accumulation_steps=gas, gradient_clipping=clip,
        offload=OffloadConfig(**SPLITS[split], **offload_kw),
    )


def train(cfg: Config, rank: int = 0, world_size: int = 1, steps: int = STEPS,
          tamper: Optional[Callable[[Any], None]] = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    torch.manual_seed(0)
    engine = offload.initialize(TinyGPT(), cfg)
    if tamper is not None:
        tamper(engine)
    norms = []
    for x, y in gpt_batches(steps):
        n = x.shape[0] // world_size
        engine.backward(engine(x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]))
        engine.step()
        norms.append(engine.last_grad_norm)
    info = {"norms": norms, "on_device": [st.on_device for st in engine.states],
            "memory": engine.memory_bytes()}
    sd = engine.full_state_dict()
    engine.close()
    return sd, info


def reference(dtype: str, gas: int, clip: float, **kw: Any) -> dict[str, torch.Tensor]:
    return plain_loop(lambda: _seeded(), gpt_batches(STEPS), lr=LR, weight_decay=WD, gas=gas, clip=clip,
                      compute_dtype=torch.bfloat16 if dtype == "bf16" else None, **kw)


def _seeded() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT()


@functools.lru_cache(maxsize=None)
def bound(dtype: str, gas: int = GAS, clip: float = CLIP) -> Any:
    if dtype == "fp32":
        return Fp32Bound.measure(lambda **o: reference(dtype, gas, clip, **o))
    return TrajectoryBound.measure(lambda **o: reference(dtype, gas, clip, **o), _seeded().state_dict())


def check(sd: dict, info: dict, split: str, dtype: str, what: str, gas: int = GAS, clip: float = CLIP) -> None:
    want = {"cpu": 0, "mixed": 2, "device": len(info["on_device"])}[split]
    assert sum(info["on_device"]) == want, info["on_device"]
    if split == "mixed":
        assert info["on_device"][:2] == [True, True]  # the root and the first block
    bound(dtype, gas, clip).check(sd, what)
    if clip:
        assert max(n for n in info["norms"] if n is not None) > clip  # clipping was active


CASES = [(s, d, st) for s in SPLITS for d in ("fp32", "bf16") for st in (1, 2, 3)]


@pytest.mark.parametrize("split,dtype,stage", CASES)
def test_every_split_matches_plain_adamw_world_size_1(split, dtype, stage):
    sd, info = train(config(split, dtype, stage))
    check(sd, info, split, dtype, f"split {split} {dtype} stage {stage}")


def _ws2(rank: int, world_size: int) -> dict[str, Any]:
    out = {f"{s} {d} {st}": train(config(s, d, st), rank, world_size) for s, d, st in CASES}
    out["wrong"] = train(config("mixed"), 0, world_size)  # both ranks see rank 0's half
    return out


@pytest.fixture(scope="module")
def ws2_results() -> dict[str, Any]:
    return run_distributed(_ws2, 2)[0]


@pytest.mark.parametrize("split,dtype,stage", CASES)
def test_every_split_matches_plain_adamw_world_size_2(split, dtype, stage, ws2_results):
    sd, info = ws2_results[f"{split} {dtype} {stage}"]
    check(sd, info, split, dtype, f"ws2 split {split} {dtype} stage {stage}")


def test_world_size_2_bound_catches_a_lost_half_batch(ws2_results):
    ratio, key, _ = bound("fp32").worst(ws2_results["wrong"][0])
    assert ratio > 100, (key, ratio)


def _drop_grad_scale(engine: Any) -> None:
    """A device update that forgets the gradient scale (accumulation and clip factor)."""
    fn = engine.optimizer._device_fn

    def wrong(*args: Any, grad_scale: float, **kw: Any) -> None:
        fn(*args, grad_scale=1.0, **kw)

    engine.optimizer._device_fn = wrong


@pytest.mark.parametrize("split", ["mixed", "device"])
def test_a_device_update_without_the_gradient_scale_lands_far_outside(split):
    """Negative control: the device units' update is what the comparison sees."""
    sd, _ = train(config(split), tamper=_drop_grad_scale)
    ratio, key, _ = bound("fp32").worst(sd)
    assert ratio > 100, (key, ratio)


@pytest.mark.parametrize("worker", ["off", "on"])
def test_updates_in_backward_on_the_device_match_plain_adamw(worker):
    """No clipping, one micro-batch a step, nonfinite_loss off: every update runs during
    backward (transient gradient shards on a CPU run), the device units' too."""
    cfg = dataclasses.replace(config("mixed", gas=1, clip=0.0), nonfinite_loss="off")
    cfg = dataclasses.replace(cfg, prefetch=dataclasses.replace(cfg.prefetch, optimizer_worker=worker))
    sd, info = train(cfg)
    check(sd, info, "mixed", "fp32", f"split mixed in backward, worker {worker}", gas=1, clip=0.0)


# -- checkpoints across a change of split -------------------------------------------------------


def _states(engine: Any) -> list[dict[str, Any]]:
    out = []
    for st in engine.states:
        with engine.optimizer.unit_state(st.unit.index) as s:
            out.append({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in s.items()})
    return out


def _assert_same(a: list[dict[str, Any]], b: list[dict[str, Any]], what: str) -> None:
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.keys() == y.keys(), (what, i)
        for k in x:
            if isinstance(x[k], torch.Tensor):
                assert torch.equal(x[k], y[k]), f"{what}: unit {i} {k} differs"
            else:
                assert x[k] == y[k], f"{what}: unit {i} {k}: {x[k]} != {y[k]}"


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("save_split,load_split", [("cpu", "mixed"), ("mixed", "device"), ("device", "cpu")])
def test_checkpoint_round_trips_bit_exactly_across_a_change_of_split(tmp_path, dtype, save_split, load_split):
    """Saved with one split, loaded with another: every unit's master, moments and step counts
    and every weight are bit-identical to the saver's; so are the sharded (DTensor) optimizer
    state dict's; then a step trains on from there within the bound of an uninterrupted run."""
    torch.manual_seed(0)
    a = offload.initialize(TinyGPT(), config(save_split, dtype))
    for x, y in gpt_batches(4):
        a.backward(a(x, y))
        a.step()
    a.save_checkpoint(str(tmp_path))
    saved, weights = _states(a), a.full_state_dict()
    model_sd, optim_sd = a.sharded_state_dict(), a.sharded_optimizer_state_dict()
    a.close()
    b = offload.initialize(_seeded(), config(load_split, dtype))
    assert any(st.on_device for st in b.states) == (load_split != "cpu")
    b.load_checkpoint(str(tmp_path))
    _assert_same(saved, _states(b), f"{save_split} -> {load_split} checkpoint")
    got = b.full_state_dict()
    assert all(torch.equal(got[k], weights[k]) for k in weights)
    b.close()
    c = offload.initialize(_seeded(), config(load_split, dtype))
    c.load_sharded_state_dict(model_sd)
    c.load_sharded_optimizer_state_dict(optim_sd)
    _assert_same(saved, _states(c), f"{save_split} -> {load_split} sharded optimizer state dict")
    c.close()


def test_offload_states_parks_the_device_units_state_and_reloads_it_bit_exactly():
    torch.manual_seed(0)
    e = offload.initialize(TinyGPT(), config("mixed"))
    batches = gpt_batches(4)
    for x, y in batches[:2]:
        e.backward(e(x, y))
        e.step()
    before = _states(e)
    device_before = e.memory_bytes()["device"]
    e.offload_states()
    assert e.memory_bytes()["device"] < device_before  # the device units' state went to the host
    e.reload_states()
    _assert_same(before, _states(e), "offload_states / reload_states")
    e.close()


# -- the planner's figures for every split --------------------------------------------------------


@pytest.mark.parametrize("split", ["mixed", "device", "fraction"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("param_tier", ["cpu", "device"])
@pytest.mark.parametrize("stage", [3, 2])
def test_plan_bytes_per_tier_equal_memory_bytes_for_every_split(split, dtype, param_tier, stage):
    """`plan(...)`'s bytes per tier are what `memory_bytes()` reports after a step, with the
    device units' master, moments, gradient and parameter shards counted as 'device'."""
    from offload.plan import make_machine, plan

    kw = {"optimizer_device_fraction": 0.5} if split == "fraction" else SPLITS[split]
    cfg = Config(compute_device="cpu", zero_stage=stage, precision=PrecisionConfig(dtype=dtype),
                 offload=OffloadConfig(param_tier=param_tier, **kw))
    torch.manual_seed(0)
    engine = offload.initialize(TinyGPT(), cfg)
    for x, y in gpt_batches(1):
        engine.backward(engine(x, y))
        engine.step()
    measured = {"pinned": 0, **engine.memory_bytes()}
    assert measured["device"] > 0 and any(st.on_device for st in engine.states)
    with torch.device("meta"):
        meta = TinyGPT()
    est = plan(meta, machine=make_machine(gpus=0, cpu_mem="64GiB"), config=cfg).estimate(param_tier, "cpu")
    assert est.per_rank.as_dict() == measured
    # negative control: the same plan without the split counts other bytes per tier
    plain = dataclasses.replace(cfg, offload=OffloadConfig(param_tier=param_tier))
    other = plan(meta, machine=make_machine(gpus=0, cpu_mem="64GiB"), config=plain).estimate(param_tier, "cpu")
    assert other.per_rank.as_dict() != measured
    engine.close()


# -- the keys -------------------------------------------------------------------------------------


def _ds(offload_optimizer: Optional[dict] = None, offload_param: Optional[dict] = None) -> Config:
    import warnings

    from offload.config import DeepSpeedConfigWarning
    from offload.config.deepspeed import translate_deepspeed

    zero: dict[str, Any] = {"stage": 3}
    if offload_optimizer is not None:
        zero["offload_optimizer"] = offload_optimizer
    if offload_param is not None:
        zero["offload_param"] = offload_param
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeepSpeedConfigWarning)
        return translate_deepspeed({"zero_optimization": zero}, world_size=1)


def test_deepspeed_ratio_puts_the_rest_of_the_optimizer_state_on_the_device():
    """ZeRO-Offload++'s ratio: the share updated on the CPU; offload's device fraction is the rest."""
    cfg = _ds({"device": "cpu", "ratio": 0.3})
    assert cfg.offload.optimizer_tier == "cpu" and cfg.offload.optimizer_device_fraction == pytest.approx(0.7)
    assert "zero_optimization.offload_optimizer.ratio" not in cfg.ignored_keys
    assert _ds({"device": "cpu", "ratio": 1.0}).offload.optimizer_device_fraction is None  # all on the CPU
    assert _ds({"device": "cpu"}).offload.optimizer_device_fraction is None
    with pytest.raises(ValueError, match=r"offload_optimizer.ratio.*between 0 and 1"):
        _ds({"device": "cpu", "ratio": 1.5})
    # and the engine honours it: the root first, within 70 % of the state's bytes
    torch.manual_seed(0)
    e = offload.initialize(TinyGPT(), dataclasses.replace(cfg, compute_device="cpu"))
    on = [st.on_device for st in e.states]
    assert on[0] and not all(on), on
    e.close()


def test_deepspeed_optimizer_device_none_keeps_the_state_on_the_device():
    """offload_optimizer.device 'none' with offload_param set: DeepSpeed keeps the optimizer
    states on the GPU, and so does offload (not a CPU optimizer with a note, as before)."""
    for param in ("cpu", "nvme"):
        cfg = _ds({"device": "none"}, {"device": param, "nvme_path": "/nvme"})
        assert cfg.offload.optimizer_tier == "device", param
        assert cfg.offload.param_tier == param
    assert _ds({"device": "none"}).offload.optimizer_tier == "device"  # said explicitly
    # and the DeepSpeed look-alike engine says so, and trains with the state on the device
    import offload.compat.deepspeed as deepspeed

    ds_cfg = {"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                    "offload_optimizer": {"device": "none"}}}
    model = _seeded()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_cfg)
    assert engine.zero_offload_optimizer() is False and engine.zero_offload_param() is True
    assert all(st.on_device for st in engine.engine.states)
    engine.engine.close()
    plain = _ds()  # no offload section at all: the CPU optimizer, with a note saying how
    assert plain.offload.optimizer_tier == "cpu"
    assert any("offload_optimizer.device to 'none'" in n for n in plain.notes)


@pytest.mark.parametrize("kw,match", [
    ({"optimizer_device_units": -1}, r"optimizer_device_units.*>= 0"),
    ({"optimizer_device_units": 0.5}, r"optimizer_device_units.*neither a count"),
    ({"optimizer_device_units": ["blocks.0", "blocks.0"]}, r"named twice"),
    ({"optimizer_device_units": [""]}, r"neither a count"),
    ({"optimizer_device_fraction": 1.5}, r"optimizer_device_fraction.*between 0 and 1"),
    ({"optimizer_device_units": 2, "optimizer_device_fraction": 0.5}, r"both set"),
    ({"optimizer_device_units": 2, "optimizer_tier": "device"}, r"optimizer_tier 'device' puts every unit"),
    ({"optimizer_device_fraction": 0.5, "placement": "auto"}, r"placement 'auto' sizes the split"),
])
def test_device_split_keys_are_checked_at_the_door(kw, match):
    with pytest.raises(ValueError, match=match):
        OffloadConfig(**kw)


def test_device_split_keys_accept_counts_names_and_fractions():
    assert OffloadConfig(optimizer_device_units=3.0).optimizer_device_units == 3
    assert OffloadConfig(optimizer_device_units=["<root>"]).optimizer_device_units == ("<root>",)
    with pytest.raises(ValueError, match=r"'blocks\.9'\].*not units of this model.*'<root>', 'blocks\.0'"):
        offload.initialize(TinyGPT(), Config(compute_device="cpu",
                                             offload=OffloadConfig(optimizer_device_units=["blocks.9"])))
    with pytest.raises(NotImplementedError, match="8-bit"):
        offload.initialize(TinyGPT(), Config(compute_device="cpu", optimizer={"moments_dtype": "8bit"},
                                             offload=OffloadConfig(optimizer_device_units=1)))


# -- placement: auto sizes the split --------------------------------------------------------------


def test_the_split_rule_balances_device_and_cpu_update_time():
    """[Note: the split rule], by hand: 4 units of 1e9 elements, CPU 1e9/s, device 1e10/s, 1 s
    of compute. k on the device: max(1 + 0.1 k, 4 - k) = 4, 3, 2, 1.3, 1.4 s -> k = 3."""
    from offload.plan.update_split import SplitRates, choose_device_split

    rates = SplitRates(cpu_elems_per_s=1e9, device_elems_per_s=1e10, compute_s=1.0)
    got = choose_device_split([10**9] * 4, [100] * 4, 10**6, rates)
    assert (got.units, got.bytes) == (3, 300) and got.step_s == pytest.approx(1.3)
    assert got.all_cpu_step_s == pytest.approx(4.0)
    assert choose_device_split([10**9] * 4, [100] * 4, 250, rates).units == 2  # the room binds
    assert choose_device_split([10**9] * 4, [100] * 4, 0, rates).units == 0
    # a device no faster than compute hides the CPU updates under: nothing to gain
    slow = SplitRates(cpu_elems_per_s=1e9, device_elems_per_s=1e9, compute_s=10.0)
    assert choose_device_split([10**9] * 4, [100] * 4, 10**6, slow).units == 0


def test_the_planner_sizes_the_split_within_the_gpu_memory_left():
    """On a GPU machine the plan puts the first units' optimizer state on the GPU, as many as
    the rule takes within the GPU memory left after parameters, working set and activations;
    it says how much activation recompute would free, and writes the count into the config."""
    from offload.plan import make_machine, plan
    from offload.plan.shapes import shape_from_dims

    shape = shape_from_dims(layers=24, d_model=2048, heads=16, vocab=50304, seq=1024, batch=8)
    machine = make_machine(gpus=1, gpu_mem="80GiB", cpu_mem="256GiB")
    p = plan(shape, machine=machine, config=Config(precision={"dtype": "bf16"}))
    d = p.device_split
    assert d is not None and 0 < d.units <= len(shape.units) and d.bytes <= d.room_bytes
    assert d.step_s < d.all_cpu_step_s
    assert p.config_snippet()["offload"]["optimizer_device_units"] == d.units
    assert p.recompute_frees_bytes > 0 and "activation recompute" in str(p)
    # less GPU memory, fewer units; none at all without room
    small = plan(shape, machine=make_machine(gpus=1, gpu_mem="24GiB", cpu_mem="256GiB"),
                 config=Config(precision={"dtype": "bf16"}))
    assert small.device_split is None or small.device_split.units < d.units
    assert plan(shape, machine=make_machine(gpus=0, cpu_mem="256GiB"),
                config=Config(precision={"dtype": "bf16"})).device_split is None  # a CPU run: no GPU


def test_the_initialize_line_names_the_units_updated_on_the_device(caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="offload"):
        offload.initialize(TinyGPT(), config("mixed")).close()
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("initialized"))
    assert "for 2/3 units (<root>, blocks.0) on the compute device, updated there" in line, line


# -- other kinds, and the NVMe tier beside the device ---------------------------------------------


@pytest.mark.parametrize("kind", ["Adagrad", "Lion"])
def test_lion_and_adagrad_update_on_the_device_within_their_bound(kind, tmp_path):
    """The kinds' torch reference updates on the device units (offload/optim/device_update.py),
    beside the native CPU kernels and beside the NVMe store, against their plain loops."""
    from tests.test_optimizers_engine import fp32_bound as kind_bound
    from tests.test_optimizers_engine import make_config as kind_config
    from tests.test_optimizers_engine import trained as kind_trained

    bound = kind_bound(kind)
    for split in ({"optimizer_device_units": 1}, {"optimizer_tier": "device"}):
        cfg = kind_config(kind)
        cfg = dataclasses.replace(cfg, offload=dataclasses.replace(cfg.offload, **split))
        bound.check(kind_trained(cfg), f"{kind} engine, {split}")
    cfg = kind_config(kind, "nvme", tmp_path / "n")
    cfg = dataclasses.replace(cfg, offload=dataclasses.replace(cfg.offload, optimizer_device_units=1))
    bound.check(kind_trained(cfg), f"{kind} engine, root on the device, the rest on NVMe")


def test_nvme_beside_the_device_trains_and_checkpoints_across_splits(tmp_path):
    """optimizer_tier nvme with the root and blocks.0 on the device: within the AdamW bound;
    its checkpoint loads bit-exactly into an all-CPU engine, and back."""
    nv = {"nvme_path": str(tmp_path / "swap"), "pinned_budget_bytes": 1 << 26}
    SPLITS["nvme_mixed"] = {"optimizer_tier": "nvme", "optimizer_device_units": 2}
    try:
        sd, info = train(config("nvme_mixed", **nv))
        assert info["on_device"] == [True, True, False] and info["memory"]["nvme"] > 0
        bound("fp32").check(sd, "split nvme + device")
        torch.manual_seed(0)
        a = offload.initialize(TinyGPT(), config("nvme_mixed", **nv))
        for x, y in gpt_batches(4):
            a.backward(a(x, y))
            a.step()
        a.save_checkpoint(str(tmp_path / "ck"))
        saved = _states(a)
        a.close()
        b = offload.initialize(_seeded(), config("cpu"))
        b.load_checkpoint(str(tmp_path / "ck"))
        _assert_same(saved, _states(b), "nvme + device -> cpu")
        b.save_checkpoint(str(tmp_path / "ck2"))
        b.close()
        c = offload.initialize(_seeded(), config("nvme_mixed", **nv))
        c.load_checkpoint(str(tmp_path / "ck2"))
        _assert_same(saved, _states(c), "cpu -> nvme + device")
        c.close()
    finally:
        del SPLITS["nvme_mixed"]


def _save_ws2(rank: int, world_size: int, path: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    e = offload.initialize(TinyGPT(), config("mixed"))
    for x, y in gpt_batches(4):
        n = x.shape[0] // world_size
        e.backward(e(x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]))
        e.step()
    e.save_checkpoint(path)
    sd = e.full_state_dict()
    e.close()
    return sd


def test_a_world_size_2_checkpoint_of_a_split_reshards_into_any_split(tmp_path):
    """Saved at world size 2 with the root and blocks.0 on the device, loaded at world size 1
    with every unit on the device and with none: both hold the same weights as the saver and
    the same optimizer state as each other, bit for bit."""
    weights = run_distributed(_save_ws2, 2, str(tmp_path))[0]
    states = []
    for split in ("device", "cpu"):
        e = offload.initialize(_seeded(), config(split))
        e.load_checkpoint(str(tmp_path))
        got = e.full_state_dict()
        assert all(torch.equal(got[k], weights[k]) for k in weights), split
        states.append(_states(e))
        e.close()
    _assert_same(states[0], states[1], "ws2 checkpoint loaded with every unit on the device and with none")
