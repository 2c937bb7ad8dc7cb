"""Buffers keep their dtype; parameters named for fp32 are refused; generate() does not hang.

- A tiny Llama (transformers config, no download) trains in bf16 with its RoPE `inv_freq`
  still fp32, along a plain bf16-autocast loop's trajectory within a bound derived below;
  the negative control is the same engine with `precision.buffer_dtype: compute`.
- `_keep_in_fp32_modules`: named parameters are refused at initialize with the fixes, named
  buffers stay fp32, BatchNorm statistics follow their parameters (torch requires it).
- At world size 2 (two real processes) `generate()` with other prompt lengths and
  max_new_tokens per rank finishes, and each rank's greedy output equals the plain model's.
- The config option's validation, in offload's format and from DeepSpeed's.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import offload
from offload.config import Config, ConfigError, OptimizerConfig, PrecisionConfig, load_config
from tests.conftest import run_distributed
from tests.parity import TrajectoryBound, trajectory_error

LR, WD, STEPS, SEQ = 3e-3, 0.01, 12, 64
TRANSFORMERS = "the Llama / T5 tests build Hugging Face models from configs (no download)"
INV_FREQ = "model.rotary_emb.inv_freq"


def tiny_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2, vocab_size=64, eos_token_id=None, bos_token_id=1, pad_token_id=0)
    return LlamaForCausalLM(cfg)


def llama_batches() -> list[torch.Tensor]:
    """Token sequences x_t = (start + stride * t) mod 64: a pattern the model can learn."""
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(STEPS):
        start = torch.randint(0, 64, (8, 1), generator=g)
        stride = torch.randint(1, 4, (8, 1), generator=g)
        out.append((start + stride * torch.arange(SEQ)) % 64)
    return out


def bf16_copy(model: nn.Module, keep_buffers: bool) -> nn.Module:
    """`model` with bf16 parameters; its floating buffers kept as they are, or cast too."""
    low = copy.deepcopy(model).to(torch.bfloat16)
    if keep_buffers:
        for (_, b), (_, b0) in zip(low.named_buffers(), model.named_buffers()):
            b.data = b0.data.clone()
    return low


def plain_llama(kind: str, split: int = 1) -> dict[str, torch.Tensor]:
    """Plain torch AdamW on fp32 master weights, as a user would train in bf16.

    kind 'autocast': fp32 weights, `torch.autocast("cpu", bfloat16)`: matmul operands are
        rounded to bf16 per op, the residual stream and norms stay fp32.
    kind 'bf16' / 'bf16 cast buffers': a bf16 copy of the weights, refreshed from the master
        every step, runs forward and backward (every activation in bf16), its gradients
        applied to the master in fp32: the engine's arithmetic (and tests/parity.py
        `plain_loop`'s), with `inv_freq` kept fp32 or cast to bf16.
    `split`: each batch in that many chunks whose losses are averaged (another rounding)."""
    master = tiny_llama()
    opt = torch.optim.AdamW(master.parameters(), lr=LR, weight_decay=WD, foreach=False)
    compute = master if kind == "autocast" else bf16_copy(master, keep_buffers=kind == "bf16")
    for x in llama_batches():
        if compute is not master:
            with torch.no_grad():
                for pc, pm in zip(compute.parameters(), master.parameters()):
                    pc.copy_(pm)
        n = x.shape[0] // split
        for s in range(split):
            xs = x[s * n : (s + 1) * n]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=kind == "autocast"):
                loss = compute(input_ids=xs, labels=xs).loss
            (loss / split).backward()
        if compute is not master:
            for pc, pm in zip(compute.parameters(), master.parameters()):
                pm.grad, pc.grad = pc.grad.float(), None
        opt.step()
        opt.zero_grad()
    return master.state_dict()


def engine_llama(buffer_dtype: str, rows: slice = slice(None)
                 ) -> tuple[dict[str, torch.Tensor], list[torch.dtype], torch.Tensor]:
    """The engine in bf16 on `rows` of each batch; returns its weights, inv_freq's dtype
    seen at each step and inv_freq at the end (non-persistent: not in the state dict)."""
    model = tiny_llama()
    config = Config(compute_device="cpu", unit_modules=("LlamaDecoderLayer",),
                    optimizer=OptimizerConfig(lr=LR, weight_decay=WD),
                    precision=PrecisionConfig(dtype="bf16", buffer_dtype=buffer_dtype))
    engine = offload.initialize(model, config)
    seen = []
    for x in llama_batches():
        x = x[rows]
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
        seen.append(model.get_buffer(INV_FREQ).dtype)
    sd = engine.full_state_dict()
    engine.close()
    return sd, seen, model.get_buffer(INV_FREQ)


def test_llama_rope_buffer_stays_fp32_and_bf16_training_follows_autocast():
    """[Note: the bf16 bound against autocast]
    The reference the brief names is a plain bf16-autocast loop (A). Autocast and the engine
    are two different kinds of bf16: autocast keeps fp32 weights and a fp32 residual
    stream and rounds only matmul operands; the engine (like tests/parity.py's plain_loop)
    holds bf16 weights and rounds every activation. The distance between the two kinds is
    larger than either's rounding noise (measured here: autocast with the batch split in 2
    or 4 lands 0.006 from A; the engine's kind run in plain torch, P, lands 0.024), so a
    bound from autocast's own noise would fail a correct engine. The honest noise is the
    largest distance from A of the valid bf16 runs of this loop, both kinds included: A
    split in 2 and in 4, and P. The bound is tests/parity.py's LOWP_MULTIPLE (3) times that.
    The engine lands at 1/3 of it (at P's distance); trained on half of each batch it lands
    at ~8x the bound (the control that the bound is not vacuous).
    What the bound cannot tell apart (the kind gap is larger than inv_freq's effect on a
    12-step trajectory) the second check does: the engine must land next to the plain run
    that uses inv_freq in fp32 (measured 0.0005), not next to the one that casts it
    (0.015); with the option on it must swap sides (the negative control)."""
    pytest.importorskip("transformers", reason=TRANSFORMERS)
    init = tiny_llama().state_dict()
    original = tiny_llama().get_buffer(INV_FREQ).clone()
    assert original.dtype == torch.float32

    # The forward first, exactly: the engine computes what the plain bf16 model with an
    # fp32 inv_freq computes (world size 1: the same ops on the same bf16 values).
    x = llama_batches()[0][:2]
    with torch.no_grad():
        want = bf16_copy(tiny_llama(), keep_buffers=True)(input_ids=x).logits
        cast = bf16_copy(tiny_llama(), keep_buffers=False)(input_ids=x).logits
        model = tiny_llama()
        engine = offload.initialize(model, Config(compute_device="cpu", unit_modules=("LlamaDecoderLayer",),
                                                  precision=PrecisionConfig(dtype="bf16")))
        buf = model.get_buffer(INV_FREQ)
        assert buf.dtype == torch.float32 and torch.equal(buf, original)
        got = engine(input_ids=x).logits
        engine.close()
    assert torch.equal(got, want)
    assert not torch.equal(want, cast)  # the cast is visible in the logits

    keep, seen, buf = engine_llama("keep")
    assert seen == [torch.float32] * STEPS and torch.equal(buf, original)

    ref = plain_llama("autocast")
    bound = TrajectoryBound(ref, {
        "autocast, batch split in 2": plain_llama("autocast", split=2),
        "autocast, batch split in 4": plain_llama("autocast", split=4),
        "bf16 weights and activations (the engine's arithmetic) in plain torch": plain_llama("bf16"),
    }, init)
    bound.check(keep, "engine bf16 (buffers kept) vs bf16 autocast")
    half, _, _ = engine_llama("keep", rows=slice(0, 4))  # a rank's gradients lost, say
    assert bound.ratio(half) > 3, bound.ratio(half)

    # Which plain run does the engine follow? Buffers kept: the one with inv_freq in fp32.
    plain_keep, plain_cast = plain_llama("bf16"), plain_llama("bf16 cast buffers")
    d_keep_keep = trajectory_error(keep, plain_keep, init)
    d_keep_cast = trajectory_error(keep, plain_cast, init)
    assert 4 * d_keep_keep < d_keep_cast, (d_keep_keep, d_keep_cast)
    # Negative control: buffers cast (the option on) follow the plain run that casts them.
    cast_sd, seen, buf = engine_llama("compute")
    assert seen == [torch.bfloat16] * STEPS and torch.equal(buf, original.to(torch.bfloat16))
    d_cast_keep = trajectory_error(cast_sd, plain_keep, init)
    d_cast_cast = trajectory_error(cast_sd, plain_cast, init)
    assert 4 * d_cast_cast < d_cast_keep, (d_cast_cast, d_cast_keep)
    assert d_cast_keep > 4 * d_keep_keep, (d_cast_keep, d_keep_keep)


# -- _keep_in_fp32_modules and BatchNorm ----------------------------------------------------


def tiny_t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    cfg = T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
                   decoder_start_token_id=0)
    return T5ForConditionalGeneration(cfg)


def _t5_config(dtype: str, **precision: Any) -> Config:
    return Config(compute_device="cpu", unit_modules=("T5Block",),
                  precision=PrecisionConfig(dtype=dtype, **precision))


def test_keep_in_fp32_parameters_are_refused_with_the_fixes():
    pytest.importorskip("transformers", reason=TRANSFORMERS)
    model = tiny_t5()
    assert "wo" in model._keep_in_fp32_modules  # transformers keeps T5's `wo` in fp32 under fp16
    with pytest.raises(ValueError) as info:
        offload.initialize(model, _t5_config("fp16"))
    msg = str(info.value)
    for part in ("T5ForConditionalGeneration._keep_in_fp32_modules = ['wo']",
                 "'encoder.block.0.layer.1.DenseReluDense.wo.weight'", "one fp16 buffer",
                 "precision.dtype='fp32'", "precision.dtype='bf16'",
                 "precision.keep_in_fp32_modules to []"):
        assert part in msg, (part, msg)
    # transformers applies the plain list under fp16 only: bf16 trains, `wo` in bf16.
    model = tiny_t5()
    offload.initialize(model, _t5_config("bf16")).close()
    # Opting out knowingly: fp16 with nothing kept in fp32.
    model = tiny_t5()
    offload.initialize(model, _t5_config("fp16", keep_in_fp32_modules=[])).close()
    # An explicit pattern naming a parameter is refused under bf16 too.
    with pytest.raises(ValueError, match=r"precision.keep_in_fp32_modules = \['wo'\] asks to keep 2 param"):
        offload.initialize(tiny_t5(), _t5_config("bf16", keep_in_fp32_modules=["wo"]))


class BufferModel(nn.Module):
    """Buffers of every kind: one named for fp32 by a transformers-style list (stored in
    bf16: it becomes fp32), a plain fp32 constant, an integer counter, and BatchNorms."""

    _keep_in_fp32_modules_strict = ["router.bias_*"]

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Module()
        self.router.register_buffer("bias_correction", torch.linspace(5, 6, 8).to(torch.bfloat16))
        self.register_buffer("pe", torch.linspace(-1, 1, 8))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.pe.to(x.dtype) + self.router.bias_correction.to(x.dtype)
        for blk in self.blocks:
            h = blk(h)
        return h.float().pow(2).mean()


@pytest.mark.parametrize("buffer_dtype", ["keep", "compute"])
def test_buffers_named_for_fp32_stay_fp32_and_batchnorm_follows_its_weights(buffer_dtype):
    torch.manual_seed(0)
    model = BufferModel()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    engine = offload.initialize(model, Config(compute_device="cpu", precision=PrecisionConfig(
        dtype="bf16", buffer_dtype=buffer_dtype)))
    dtypes = {name: b.dtype for name, b in model.named_buffers()}
    assert dtypes["router.bias_correction"] == torch.float32  # named: fp32 whatever buffer_dtype
    assert dtypes["pe"] == (torch.float32 if buffer_dtype == "keep" else torch.bfloat16)
    assert dtypes["calls"] == torch.long
    # torch's batch_norm takes weights and statistics in one dtype: the statistics follow.
    assert dtypes["blocks.0.1.running_mean"] == dtypes["blocks.0.1.running_var"] == torch.bfloat16
    for _ in range(2):  # train mode updates the running statistics in bf16
        engine.backward(engine(torch.randn(16, 8)))
        engine.step()
    engine.eval()
    with torch.no_grad():
        assert torch.isfinite(engine(torch.randn(4, 8)))
    sd = engine.full_state_dict()
    engine.close()
    # Saved in the dtype the model gave each buffer; kept ones bit-exact.
    assert {k: v.dtype for k, v in sd.items()} == {k: v.dtype for k, v in before.items()}
    assert torch.equal(sd["router.bias_correction"], before["router.bias_correction"])
    if buffer_dtype == "keep":
        assert torch.equal(sd["pe"], before["pe"])
    assert not torch.equal(sd["blocks.0.1.running_mean"], before["blocks.0.1.running_mean"])


def test_fp32_bias_added_to_bf16_activations_is_torchs_dtype_error():
    # What 'keep' costs a model that mixes an fp32 buffer into bf16 activations itself
    # (docs/engine.md, Buffers): torch's own error; buffer_dtype 'compute' is the fix.
    class Mixes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("pe", torch.linspace(-1, 1, 8))
            self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

        def forward(self, x):
            h = x + self.pe
            for blk in self.blocks:
                h = blk(h)
            return h.float().pow(2).mean()

    torch.manual_seed(0)
    engine = offload.initialize(Mixes(), Config(compute_device="cpu", precision=PrecisionConfig(dtype="bf16")))
    with pytest.raises(RuntimeError, match="dtype"):
        engine(torch.randn(4, 8))
    engine.close()
    torch.manual_seed(0)
    engine = offload.initialize(Mixes(), Config(compute_device="cpu", precision=PrecisionConfig(
        dtype="bf16", buffer_dtype="compute")))
    assert torch.isfinite(engine(torch.randn(4, 8)))
    engine.close()


# -- the option's validation ------------------------------------------------------------------


def test_buffer_options_are_validated_at_the_door():
    with pytest.raises(ConfigError, match=r"precision.buffer_dtype = 'bfloat16', which is not one of "
                                          r"'keep', 'compute', 'fp32', 'bf16', 'fp16' \(did you mean 'bf16'\?\)"):
        PrecisionConfig(buffer_dtype="bfloat16")
    with pytest.raises(ConfigError, match=r"precision.keep_in_fp32_modules\[1\] = '', but an empty pattern"):
        Config.from_dict({"precision": {"keep_in_fp32_modules": ["wo", ""]}})
    with pytest.raises(ConfigError, match=r"keep_in_fp32_modules\[0\] = 'wo\(', but it is not a valid pattern"):
        PrecisionConfig(keep_in_fp32_modules=["wo("])
    with pytest.raises(TypeError, match="keep_in_fp32_modules = 'wo' .* must be a list"):
        PrecisionConfig(keep_in_fp32_modules="wo")
    assert PrecisionConfig().buffer_dtype == "keep" and PrecisionConfig().keep_in_fp32_modules is None


def _ds(**data_types: Any) -> Config:
    ds = {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}, "data_types": data_types}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_config(ds)


def test_deepspeed_data_types_map_onto_the_buffer_options():
    assert _ds().precision.buffer_dtype == "keep"  # DeepSpeed: unset keeps the loaded dtype
    assert _ds(buffer_dtype="bfloat16").precision.buffer_dtype == "bf16"
    assert _ds(buffer_dtype="torch.float32").precision.buffer_dtype == "fp32"
    assert _ds(keep_in_fp32_modules="auto").precision.keep_in_fp32_modules is None
    assert _ds(keep_in_fp32_modules=[]).precision.keep_in_fp32_modules == ()
    assert _ds(keep_in_fp32_modules=["e_score*"]).precision.keep_in_fp32_modules == ("e_score*",)
    assert "data_types.keep_in_fp32_modules" not in _ds(keep_in_fp32_modules=[]).ignored_keys
    with pytest.raises(ConfigError, match="data_types.buffer_dtype = 'int8' is not a floating dtype"):
        _ds(buffer_dtype="int8")
    with pytest.raises(TypeError, match="data_types.keep_in_fp32_modules = 'wo' .* 'auto' or a list"):
        _ds(keep_in_fp32_modules="wo")


# -- generate() at world size 2 ---------------------------------------------------------------


def _prompt(rank: int) -> tuple[torch.Tensor, int]:
    """Rank r's prompt (3 + 4r tokens) and max_new_tokens (3 + 5r): the ranks run different
    numbers of forwards."""
    g = torch.Generator().manual_seed(7 + rank)
    return torch.randint(2, 64, (1, 3 + 4 * rank), generator=g), 3 + 5 * rank


def _generate_ws2(rank: int, world_size: int) -> dict[str, Any]:
    model = tiny_llama().eval()
    engine = offload.initialize(model, Config(compute_device="cpu", unit_modules=("LlamaDecoderLayer",),
                                              precision=PrecisionConfig(dtype="bf16")))
    marked = getattr(model, "_is_fsdp_managed_module", False)
    prompt, new = _prompt(rank)
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=new, do_sample=False)
    inv_freq = model.get_buffer(INV_FREQ).dtype
    engine.close()
    return {"out": out, "marked": marked, "unmarked": not hasattr(model, "_is_fsdp_managed_module"),
            "inv_freq": inv_freq}


def test_generate_with_other_prompt_lengths_per_rank_finishes_world_size_2():
    """Without the mark HF's synced_gpus is off and the rank with fewer tokens leaves the
    other waiting in a gather forever (seen: the run hits the timeout with 1 of 2 ranks
    done); run_distributed's timeout turns a hang into a failure."""
    pytest.importorskip("transformers", reason=TRANSFORMERS)
    results = run_distributed(_generate_ws2, 2, timeout_s=120)
    plain = bf16_copy(tiny_llama().eval(), keep_buffers=True)  # the engine's arithmetic
    for rank, res in enumerate(results):
        assert res["marked"] and res["unmarked"] and res["inv_freq"] == torch.float32
        prompt, new = _prompt(rank)
        with torch.no_grad():
            want = plain.generate(prompt, max_new_tokens=new, do_sample=False)
        assert want.shape[1] == prompt.shape[1] + new
        assert torch.equal(res["out"], want), (rank, res["out"], want)


def test_world_size_1_leaves_the_model_unmarked():
    pytest.importorskip("transformers", reason=TRANSFORMERS)
    model = tiny_llama()
    engine = offload.initialize(model, Config(compute_device="cpu", unit_modules=("LlamaDecoderLayer",)))
    assert not hasattr(model, "_is_fsdp_managed_module")  # HF needs no sync at world size 1
    engine.close()
