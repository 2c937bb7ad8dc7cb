"""Frozen parameters cost their parameter shard only ([Note: frozen parameters cost their
shard only] in offload/units/layout.py): no fp32 master, moments or gradient shard for a
parameter that does not require grad, whatever unit it shares with trainable ones.

- Layout: the frozen suffix starts on a shard-aligned boundary; masters and gradient
  shards stop there (pure arithmetic).
- Training: a GPT with its embeddings and a block frozen and a block mixing frozen and
  trained parameters, with accumulation and clipping, at world sizes 1 and 2, optimizer
  state in host memory and on NVMe, trains within the measured bound of a plain
  `torch.optim.AdamW` loop; frozen weights stay bit-identical to their initial values
  (bf16: to their values rounded once to bf16, as `model.to(bf16)` rounds). Negative
  control: the same engine with everything trainable lands far outside the bound.
- LoRA through `peft` on a tiny Llama (fp32 and bf16): the adapters train as in a plain
  loop, and `engine.memory_bytes()` per parameter is within 5 % of the ideal (frozen
  parameters in their storage dtype, adapters with master, moments, gradient and shard);
  the same model with every parameter trainable lands far above.
- Checkpoints: save / load / go on reproduces the uninterrupted run bit for bit; a
  checkpoint saved at world size 2 loads at world size 1 with the same weights and state;
  `full_state_dict`, consolidation and `save_pretrained` give the frozen values.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import pytest
import torch
from torch import nn

import offload
from offload.units.layout import FROZEN_GROUP, SHARD_ALIGN_ELEMS, layout_unit
from tests.conftest import TinyGPT, gpt_batches, run_distributed
from tests.parity import Fp32Bound, TrajectoryBound, plain_loop
from tests.test_engine import LR, WD, make_config

STEPS = 12
FROZEN_PREFIXES = ("wte.", "wpe.", "lm_head.", "blocks.0.", "blocks.1.qkv.", "blocks.1.proj.")


# -- layout ------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_masters_stop_at_an_aligned_frozen_suffix(world_size):
    params = [("f", (5000,), FROZEN_GROUP), ("a", (300,), 0), ("b", (7,), 1), ("g", (40,), FROZEN_GROUP)]
    lay = layout_unit(params, world_size)
    first_frozen = min(s.offset for s in lay.slots if s.group == FROZEN_GROUP)
    assert lay.master_end == first_frozen and first_frozen % SHARD_ALIGN_ELEMS == 0
    assert lay.optimized_numel <= lay.master_end < lay.optimized_numel + SHARD_ALIGN_ELEMS
    masters = [lay.shard_master_numel(r) for r in range(world_size)]
    assert sum(masters) == lay.master_end  # the ranks' prefixes tile [0, master_end)
    for r, n in enumerate(masters):
        assert n % SHARD_ALIGN_ELEMS == 0  # a 4 KiB-aligned prefix in bf16
        assert lay.shard_optimized_numel(r) <= n <= lay.shard_numel
    # no frozen parameter: the master covers the whole shard; nothing optimized: nothing
    trained = layout_unit([("a", (300,), 0)], world_size)
    assert [trained.shard_master_numel(r) for r in range(world_size)] == [trained.shard_numel] * world_size
    frozen = layout_unit([("f", (300,), FROZEN_GROUP)], world_size)
    assert frozen.master_end == 0 and not frozen.has_optimized


# -- training against plain PyTorch ------------------------------------------------------------


def frozen_gpt(freeze: bool = True) -> nn.Module:
    """Tied embeddings and block 0 frozen, block 1 half frozen (attention) and half trained,
    block 2 and the final norm trained: the root and block 1 mix both."""
    torch.manual_seed(0)
    m = TinyGPT(n_layer=3)
    if freeze:
        for mod in (m.wte, m.wpe, m.blocks[0], m.blocks[1].qkv, m.blocks[1].proj):
            mod.requires_grad_(False)
    return m


def is_frozen(key: str) -> bool:
    return key.startswith(FROZEN_PREFIXES)


def tier_config(dtype: str, tiers: str, nvme_path: Any = None) -> offload.Config:
    cfg = make_config(dtype=dtype, gas=2, clip=0.05)
    if tiers == "cpu":
        return cfg
    return replace(cfg, offload=replace(cfg.offload, param_tier="nvme", optimizer_tier="nvme",
                                        nvme_path=str(nvme_path), pinned_budget_bytes=1 << 22))


def train(cfg: offload.Config, rank: int = 0, world_size: int = 1, freeze: bool = True,
          steps: int = STEPS) -> tuple[dict, dict]:
    engine = offload.initialize(frozen_gpt(freeze), cfg)
    for x, y in gpt_batches(steps):
        n = x.shape[0] // world_size
        engine.backward(engine(x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]))
        engine.step()
    sd, mem = engine.full_state_dict(), engine.memory_bytes()
    engine.close()
    return sd, mem


def reference(**kw: Any) -> dict[str, torch.Tensor]:
    return plain_loop(frozen_gpt, gpt_batches(STEPS), lr=LR, weight_decay=WD, gas=2, clip=0.05, **kw)


_BOUNDS: dict[str, Any] = {}


def fp32_bound() -> Fp32Bound:
    if "fp32" not in _BOUNDS:
        _BOUNDS["fp32"] = Fp32Bound.measure(reference)
    return _BOUNDS["fp32"]


def check_frozen_unchanged(sd: dict, dtype: str, what: str) -> None:
    init = frozen_gpt().state_dict()
    frozen = [k for k in init if is_frozen(k)]
    assert frozen
    for k in frozen:
        want = init[k] if dtype == "fp32" else init[k].to(torch.bfloat16).float()
        assert torch.equal(sd[k], want), f"{what}: frozen {k} changed"


def _ws2(rank: int, world_size: int, nvme_path: str) -> dict:
    return {tiers: train(tier_config("fp32", tiers, nvme_path), rank, world_size)[0]
            for tiers in ("cpu", "nvme")}


def test_fp32_training_with_frozen_parameters_matches_plain_adamw(tmp_path):
    bound = fp32_bound()
    runs = {f"ws1 {t}": train(tier_config("fp32", t, tmp_path))[0] for t in ("cpu", "nvme")}
    ws2 = run_distributed(_ws2, 2, str(tmp_path))
    assert ws2[1] == {"cpu": {}, "nvme": {}}  # full_state_dict lands on rank 0 only
    runs.update({f"ws2 {t}": sd for t, sd in ws2[0].items()})
    for what, sd in runs.items():
        bound.check(sd, f"frozen gpt, {what}")
        check_frozen_unchanged(sd, "fp32", what)
    # negative control: the same engine training every parameter is far outside the bound
    unfrozen, _ = train(tier_config("fp32", "cpu"), freeze=False)
    ratio, key, _ = bound.worst(unfrozen)
    assert ratio > 100 and is_frozen(key), (ratio, key)


def test_bf16_frozen_values_are_rounded_once_and_the_rest_trains_as_plain_bf16(tmp_path):
    sd, _ = train(tier_config("bf16", "cpu"))
    check_frozen_unchanged(sd, "bf16", "bf16 host tiers")
    # NVMe: the optimizer writes back only the shard's master prefix (a partial O_DIRECT
    # store); the frozen suffix it never touches must survive, bit for bit.
    on_nvme, _ = train(tier_config("bf16", "nvme", tmp_path))
    for k in sd:
        assert torch.equal(sd[k], on_nvme[k]), k
    # The plain bf16 loop keeps fp32 frozen values (its master) while computing with them
    # rounded once: compare the trained tensors' trajectories.
    trained = lambda d: {k: v for k, v in d.items() if not is_frozen(k)}  # noqa: E731
    ref = reference(compute_dtype=torch.bfloat16)
    variants = {f"split {s}": trained(reference(compute_dtype=torch.bfloat16, split=s)) for s in (2, 4)}
    bound = TrajectoryBound(trained(ref), variants, trained(frozen_gpt().state_dict()))
    bound.check(trained(sd), "bf16 frozen gpt")


# -- LoRA through peft ---------------------------------------------------------------------------


class LoraLM(nn.Module):
    """A peft LoRA model as the engine and the plain loop both call it: (ids, labels) -> loss."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, labels=labels).loss


def lora_llama(r: int = 8, hidden: int = 128, lora: bool = True) -> nn.Module:
    transformers = pytest.importorskip("transformers", reason="the LoRA tests need transformers")
    peft = pytest.importorskip("peft", reason="the LoRA tests need peft (the optional extra)")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden + 96,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=512, max_position_embeddings=32, tie_word_embeddings=True,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = transformers.LlamaForCausalLM(cfg)
    if lora:
        torch.manual_seed(1)
        model = peft.get_peft_model(model, peft.LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0,
                                                           target_modules=["q_proj", "v_proj"]))
        for n, p in model.named_parameters():  # lora_B starts at zero: move it, so A trains too
            if "lora_B" in n:
                with torch.no_grad():
                    p.normal_(0.0, 0.02)
    return LoraLM(model)


def token_batches(n: int, batch: int = 4, seq: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 512, (batch, seq), generator=g)
        out.append((ids, ids.clone()))
    return out


LORA_STEPS = 8


def lora_config(dtype: str) -> offload.Config:
    cfg = make_config(dtype=dtype, gas=2, clip=1.0)
    # The plain bf16 loop runs `model.to(bf16)`, which casts Llama's rotary inv_freq too.
    return replace(cfg, precision=replace(cfg.precision, buffer_dtype="compute"))


def lora_engine_run(dtype: str, lora: bool = True) -> tuple[dict, dict, Any]:
    model = lora_llama(lora=lora)
    engine = offload.initialize(model, lora_config(dtype))
    params = sum(u.layout.numel for u in engine.units)
    trainable = sum(s.numel for u in engine.units for s in u.layout.slots if s.group != FROZEN_GROUP)
    for x, y in token_batches(LORA_STEPS):
        engine.backward(engine(x, y))
        engine.step()
    mem = engine.memory_bytes()
    buffers = sum(b.numel() * b.element_size() for b in engine.module.buffers())
    sd = engine.full_state_dict()
    engine.close()
    held = mem["device"] + mem["host"] + mem["pinned"] - buffers  # a CPU run: all host memory
    return sd, {"params": params, "trainable": trainable, "bytes": held}, mem


def lora_reference(**kw: Any) -> dict[str, torch.Tensor]:
    return plain_loop(lora_llama, token_batches(LORA_STEPS), lr=LR, weight_decay=WD, gas=2, clip=1.0, **kw)


def ideal_bytes(params: int, trainable: int, dtype: str) -> int:
    """Frozen parameters in their storage dtype; a trained one: fp32 master 4 + moments 8 +
    gradient shard 4 + its parameter shard (bf16 2; fp32: the master itself, 0)."""
    p = 2 if dtype == "bf16" else 4
    return (params - trainable) * p + trainable * (16 + (p if dtype == "bf16" else 0))


MEMORY_SLACK = 1.05
"""Measured / ideal bytes: layout padding (each shard rounded up to 2048 elements, a unit's
master to the 2048-aligned start of its frozen suffix) costs < 5 % at this model's size."""


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_peft_lora_trains_its_adapters_with_host_memory_of_frozen_weights_plus_adapters(dtype):
    sd, got, _ = lora_engine_run(dtype)
    assert got["trainable"] * 50 < got["params"]  # a LoRA: few trained parameters
    init = lora_llama().state_dict()
    adapters = [k for k in sd if "lora_" in k]
    assert adapters and all(not torch.equal(sd[k], init[k]) for k in adapters)
    for k in sd:
        if "lora_" not in k:
            want = init[k] if dtype == "fp32" else init[k].to(torch.bfloat16).to(init[k].dtype)
            assert torch.equal(sd[k], want), k
    if dtype == "fp32":
        Fp32Bound.measure(lora_reference).check(sd, "peft LoRA fp32")
    else:
        only = lambda d: {k: v for k, v in d.items() if "lora_" in k}  # noqa: E731
        ref = only(lora_reference(compute_dtype=torch.bfloat16))
        variants = {f"split {s}": only(lora_reference(compute_dtype=torch.bfloat16, split=s)) for s in (2, 4)}
        TrajectoryBound(ref, variants, only(init)).check(only(sd), "peft LoRA bf16 adapters")
    ideal = ideal_bytes(got["params"], got["trainable"], dtype)
    ratio = got["bytes"] / ideal
    print(f"LoRA {dtype}: {got['bytes'] / got['params']:.2f} B/param held, ideal "
          f"{ideal / got['params']:.2f} ({got['trainable']} of {got['params']} trained)")
    assert 1.0 <= ratio <= MEMORY_SLACK, (got, ideal)
    # negative control: every parameter trained costs master, moments and gradient each
    _, full, _ = lora_engine_run(dtype, lora=False)
    assert full["bytes"] > 3.5 * ideal_bytes(full["params"], 0, dtype), full


# -- checkpoints ---------------------------------------------------------------------------------


def _train_steps(engine: Any, batches: list, rank: int, world_size: int) -> None:
    for x, y in batches:
        n = x.shape[0] // world_size
        engine.backward(engine(x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]))
        engine.step()


def unit_state(engine: Any) -> dict:
    out = {}
    for u in engine.units:
        with engine.optimizer.unit_state(u.index) as s:
            out[u.name] = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()}
        out[u.name]["frozen"] = u.read_frozen().clone()
    return out


@pytest.mark.parametrize("dtype,tiers", [("fp32", "cpu"), ("bf16", "nvme")])
def test_save_load_go_on_reproduces_the_run_with_frozen_parameters(dtype, tiers, tmp_path):
    batches = gpt_batches(8)
    os.makedirs(tmp_path / "swap")
    cfg = tier_config(dtype, tiers, tmp_path / "swap")
    engine = offload.initialize(frozen_gpt(), cfg)
    _train_steps(engine, batches[:4], 0, 1)
    engine.save_checkpoint(tmp_path / "ckpt", tag="mid")
    _train_steps(engine, batches[4:], 0, 1)
    straight, state = engine.full_state_dict(), unit_state(engine)
    engine.close()
    resumed = offload.initialize(frozen_gpt(freeze=True), cfg)
    resumed.load_checkpoint(tmp_path / "ckpt", tag="mid")
    _train_steps(resumed, batches[4:], 0, 1)
    again = resumed.full_state_dict()
    for k in straight:
        assert torch.equal(straight[k], again[k]), k
    for name, s in unit_state(resumed).items():
        for k in ("master", "exp_avg", "exp_avg_sq", "frozen"):
            assert torch.equal(s[k], state[name][k]), (name, k)
    check_frozen_unchanged(again, dtype, "resumed")
    resumed.close()


def _save_ws2(rank: int, world_size: int, path: str) -> dict:
    engine = offload.initialize(frozen_gpt(), tier_config("bf16", "cpu"))
    _train_steps(engine, gpt_batches(4), rank, world_size)
    engine.save_checkpoint(path, tag="ws2")
    sd = engine.full_state_dict()
    engine.close()
    return sd


def test_a_world_size_2_checkpoint_loads_at_world_size_1_and_exports_the_frozen_values(tmp_path):
    from offload.checkpoint.consolidate import consolidate

    saved = run_distributed(_save_ws2, 2, str(tmp_path / "ckpt"))[0]
    engine = offload.initialize(frozen_gpt(), tier_config("bf16", "cpu"))
    engine.load_checkpoint(tmp_path / "ckpt", tag="ws2")
    loaded = engine.full_state_dict()
    assert list(loaded) == list(saved)
    for k in saved:
        assert torch.equal(loaded[k], saved[k]), k
    check_frozen_unchanged(loaded, "bf16", "loaded at world size 1")
    # consolidation reads masters and frozen values from the rank files
    safetensors = pytest.importorskip("safetensors.torch", reason="consolidation output is read with safetensors")
    consolidate(str(tmp_path / "ckpt"), str(tmp_path / "out"), tag="ws2")
    flat = safetensors.load_file(str(tmp_path / "out" / "model.safetensors"))
    for k in saved:
        assert torch.equal(flat[k], saved[k]), k
    # save_pretrained (the live engine's path) writes the frozen values too
    engine.save_pretrained(tmp_path / "hf", dtype="fp32")
    hf = safetensors.load_file(str(tmp_path / "hf" / "model.safetensors"))
    for k in hf:
        assert torch.equal(hf[k], saved[k]), k
    # and training goes on from the loaded state (one step, frozen values kept)
    _train_steps(engine, gpt_batches(2), 0, 1)
    check_frozen_unchanged(engine.full_state_dict(), "bf16", "trained after the load")
    engine.close()
