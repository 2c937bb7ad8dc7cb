"""Parameters outside training (offload/runtime/gathered.py; docs/engine.md, "Parameters
outside training"): `engine.gathered`, submodules called outside the model's forward, and
state dicts, at world sizes 1 and 2 (two real processes: at world size 1 on the CPU every
unit is aliased to its full buffer, which would hide a missing gather).

Training after an edit is compared with the same edit in a plain torch loop, against the
fp32 bound measured in the same test (tests/parity.py, [Note: derived tolerances]); the
negative controls (the edit discarded, or not made) land far outside it. Reads (state dicts,
embedding and head calls, saved and reloaded Hugging Face models) are compared exactly: they
copy the engine's values, they compute nothing.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import warnings
from typing import Any

import pytest
import torch

import offload
from offload.config import Config, OffloadConfig, OptimizerConfig, PrecisionConfig
from tests.conftest import TinyGPT, gpt_batches, run_distributed
from tests.parity import Fp32Bound, plain_loop

LR, WD = 2e-3, 0.01
STEPS, EDIT_AT = 6, 3
"""Six steps; the edit is made before the fourth (its moments are then non-zero)."""
HAVE_HF = importlib.util.find_spec("transformers") is not None


def config(dtype: str = "fp32", **kw: Any) -> Config:
    return Config(compute_device="cpu", optimizer=OptimizerConfig(lr=LR, weight_decay=WD),
                  precision=PrecisionConfig(dtype=dtype), **kw)


def gpt() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT()


def edit(model: Any) -> None:
    """The edit: zero token 3's embedding row (root unit), halve block 0's fc weight (a block
    unit). Both are exact in every dtype, so the plain loop can make the same edit."""
    with torch.no_grad():
        model.wte.weight[3].zero_()
        model.blocks[0].fc.weight.mul_(0.5)


def train(rank: int, ws: int, mode: str, dtype: str = "fp32") -> tuple[dict, list[str]]:
    """TinyGPT for STEPS steps, each rank on its share of every batch; before step EDIT_AT:
    'modifier' edits on the last rank inside gathered(modifier_rank=last), 'discarded' edits on
    every rank inside gathered() without one, 'none' makes no edit."""
    m = gpt()
    engine = offload.initialize(m, config(dtype))
    caught: list[str] = []
    for i, (x, y) in enumerate(gpt_batches(STEPS)):
        if i == EDIT_AT and mode != "none":
            named = [m.wte, m.blocks[0].fc.weight]
            with warnings.catch_warnings(record=True) as got:
                warnings.simplefilter("always")
                with engine.gathered(named, modifier_rank=ws - 1 if mode == "modifier" else None):
                    if mode == "discarded" or rank == ws - 1:
                        edit(m)
            caught += [str(w.message) for w in got]
        n = x.shape[0] // ws
        engine.backward(engine(x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]))
        engine.step()
    sd = engine.full_state_dict(rank0_only=False)
    engine.close()
    return sd, caught


@functools.lru_cache(maxsize=None)
def bound(edited: bool) -> Fp32Bound:
    """The plain AdamW loop with (or without) the same edit before step EDIT_AT."""
    before = (lambda model, i: edit(model) if i == EDIT_AT else None) if edited else None
    return Fp32Bound.measure(lambda **o: plain_loop(gpt, gpt_batches(STEPS), lr=LR, weight_decay=WD,
                                                     before_forward=before, **o))


def check_edit_runs(modifier: dict, discarded: dict, none: dict, what: str) -> None:
    bound(True).check(modifier, f"{what}: gathered(modifier_rank) edit")
    bound(False).check(none, f"{what}: no edit")
    # Negative controls: a run that lost the edit is far outside the edited bound, and the
    # edited run far outside the unedited one (an edit moves weights by O(0.01); the noise
    # is O(1e-7)).
    assert bound(True).worst(none)[0] > 100 and bound(False).worst(modifier)[0] > 100
    for k in none:  # without a modifier rank the edit is discarded, bit for bit
        assert torch.equal(discarded[k], none[k]), f"{what}: {k} changed by a discarded edit"


# -- world size 1 -------------------------------------------------------------------------------


def test_modifier_edit_trains_like_the_same_edit_in_plain_torch_world_size_1():
    (mod, caught), (none, _) = train(0, 1, "modifier"), train(0, 1, "none")
    assert not caught
    bound(True).check(mod, "ws1 modifier edit")
    assert bound(True).worst(none)[0] > 100 and bound(False).worst(mod)[0] > 100
    # fp32 on the CPU at world size 1: the parameters are the fp32 master itself, so a write
    # without a modifier rank cannot be undone; it is kept and the warning says so.
    kept, caught = train(0, 1, "discarded")
    assert any("was kept" in c for c in caught), caught
    bound(True).check(kept, "ws1 fp32 write without modifier (kept)")


def test_writes_without_modifier_rank_are_discarded_and_warned_world_size_1():
    # bf16: the aliased shard is the full buffer, the master is apart: republished from it.
    (discarded, caught), (none, _) = train(0, 1, "discarded", "bf16"), train(0, 1, "none", "bf16")
    assert any("without modifier_rank: the change is discarded" in c for c in caught), caught
    for k in none:
        assert torch.equal(discarded[k], none[k]), k


def test_a_modifier_edit_keeps_the_fp32_master_bits_it_did_not_touch():
    m = gpt()
    engine = offload.initialize(m, config("bf16"))
    before = engine.full_state_dict()["wte.weight"]
    assert not torch.equal(before, before.bfloat16().float())  # fp32 bits bf16 would round away
    with engine.gathered(m.wte, modifier_rank=0):
        assert m.wte.weight.dtype == torch.bfloat16  # the compute dtype inside the context
        with torch.no_grad():
            m.wte.weight[3].zero_()
    after = engine.full_state_dict()["wte.weight"]
    assert bool((after[3] == 0).all())
    rest = torch.arange(after.shape[0]) != 3
    assert torch.equal(after[rest], before[rest])  # not rounded to bf16
    engine.close()


def test_state_dict_calls_and_edits_on_the_nvme_param_tier_world_size_1(tmp_path):
    """The NVMe parameter tier is never aliased: every read must gather."""
    m, plain = gpt(), gpt()
    engine = offload.initialize(m, config(offload=OffloadConfig(
        param_tier="nvme", optimizer_tier="nvme", nvme_path=str(tmp_path))))
    assert m.wte.weight.untyped_storage().nbytes() == 0  # freed between uses
    check_reads(m, plain, engine)
    with engine.gathered(m.wte, modifier_rank=0):
        with torch.no_grad():
            m.wte.weight[5].fill_(0.25)
    assert bool((engine.full_state_dict()["wte.weight"][5] == 0.25).all())
    sd = m.state_dict()
    sd["ln_f.weight"] = torch.full_like(sd["ln_f.weight"], 0.5)
    sd["lm_head.weight"] = torch.full_like(sd["lm_head.weight"], 0.75)  # tied: wins, as in torch
    m.load_state_dict(sd)
    full = engine.full_state_dict()
    assert bool((full["ln_f.weight"] == 0.5).all()) and bool((full["wte.weight"] == 0.75).all())
    assert torch.equal(full["wpe.weight"], sd["wpe.weight"])
    engine.close()


def check_reads(m: Any, plain: Any, engine: Any) -> dict[str, Any]:
    """state_dict() is the engine's weights as real CPU tensors, tied names sharing one;
    embedding and head called alone equal the plain model's. Asserted here, on every rank."""
    sd, full = m.state_dict(), engine.full_state_dict(rank0_only=False)
    assert list(sd) == list(full)
    for k, v in sd.items():
        assert v.device.type == "cpu" and v.untyped_storage().nbytes() > 0, k
        assert torch.equal(v, full[k].to(v.dtype)), k
    assert sd["lm_head.weight"].data_ptr() == sd["wte.weight"].data_ptr()  # tied, as torch gives
    assert m.state_dict(keep_vars=True)["wte.weight"] is m.wte.weight  # the live views, as asked
    ids = torch.tensor([[1, 2, 3, 60]])
    with torch.no_grad():
        assert torch.equal(m.wte(ids), plain.wte(ids).to(engine.dtype))
        h = torch.randn(2, 3, 32).to(engine.dtype)  # called alone, inputs are not cast for it
        assert torch.equal(m.lm_head(h), torch.nn.functional.linear(h, plain.lm_head.weight.to(h.dtype)))
    assert m.wte.weight.untyped_storage().nbytes() == 0 or engine.units[0].aliased  # freed again
    # With gradients enabled such a call is training (issue #29, item 5): the unit stays
    # gathered for the backward that follows (tests/test_reused_units.py trains that way).
    return sd


def test_clear_errors_world_size_1():
    m = gpt()
    engine = offload.initialize(m, config())
    x, y = gpt_batches(1)[0]

    def enter(*_: Any) -> None:
        with engine.gathered(m.wte):
            pass

    hook = m.blocks[0].register_forward_pre_hook(enter)
    with pytest.raises(RuntimeError, match="engine.gathered inside the model's forward"), torch.no_grad():
        engine(x, y)
    hook.remove()
    messages: list[str] = []

    def enter_in_backward(grad: torch.Tensor) -> None:
        try:
            enter()
        except RuntimeError as exc:
            messages.append(str(exc))

    def arm(module: Any, args: Any, out: torch.Tensor) -> None:
        out.register_hook(enter_in_backward)  # runs in backward, once the blocks after it ran

    hook = m.blocks[0].register_forward_hook(arm)
    loss = engine(x, y)
    with pytest.raises(RuntimeError, match="whose backward has not run"):
        enter()
    engine.backward(loss)
    hook.remove()
    assert messages and "engine.gathered inside a backward pass" in messages[0]
    engine.step()
    with pytest.raises(ValueError, match="modifier_rank=1"):
        engine.gathered(m.wte, modifier_rank=1)
    with pytest.raises(ValueError, match="modifier_rank=True"):
        engine.gathered(m.wte, modifier_rank=True)
    with pytest.raises(ValueError, match="not a parameter of this engine's model"):
        engine.gathered(torch.zeros(3))
    with pytest.raises(TypeError, match="takes parameters, modules"):
        engine.gathered(3)
    with engine.gathered(m.blocks[1]):
        with pytest.raises(RuntimeError, match="engine.step inside engine.gathered"):
            engine.step()
        with pytest.raises(RuntimeError, match="load_full_state_dict while units"):
            engine.load_full_state_dict(engine.full_state_dict())
        with pytest.raises(RuntimeError, match="gradients enabled inside engine.gathered"):
            engine(x, y)
        with torch.no_grad():
            inside = engine(x, y)  # generation and evaluation are allowed
    with torch.no_grad():
        assert torch.equal(inside, engine(x, y))
    with pytest.raises(ValueError, match=r"assign=True"):
        m.load_state_dict(m.state_dict(), assign=True)
    engine.health.fail(OSError(5, "injected write error"))  # as a failed optimizer step leaves it
    with pytest.raises(RuntimeError, match="engine.gathered: an earlier optimizer step failed"):
        engine.gathered(m.wte)
    engine.close()


def test_deepspeed_gathered_parameters_maps_onto_engine_gathered():
    import offload.compat.deepspeed as deepspeed

    m = gpt()
    engine = offload.initialize(m, config("bf16"))
    with deepspeed.zero.GatheredParameters([m.wte.weight], modifier_rank=0):
        with torch.no_grad():
            m.wte.weight[2].fill_(1.5)
    with deepspeed.zero.GatheredParameters([torch.nn.Parameter(torch.ones(2))], modifier_rank=0):
        pass  # no engine owns it: a no-op, as DeepSpeed does for a parameter that is not ZeRO's
    with deepspeed.zero.GatheredParameters(m.wte.weight, enabled=False):
        pass
    assert bool((engine.full_state_dict()["wte.weight"][2] == 1.5).all())
    engine.close()


def hf_model(kind: str) -> tuple[Any, tuple[str, ...]]:
    import transformers as tf

    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = tf.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                            bos_token_id=0, eos_token_id=0)
        return tf.GPT2LMHeadModel(cfg).eval(), ("GPT2Block",)
    cfg = tf.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, vocab_size=64)
    return tf.LlamaForCausalLM(cfg).eval(), ("LlamaDecoderLayer",)


def hf_round_trip(kind: str, dtype: str, path: str, rank: int = 0) -> dict[str, float]:
    """save_pretrained from the engine's model (every rank calls it: its state_dict gathers;
    rank 0 writes), from_pretrained into a plain model; the distances from the engine's
    weights (cast to the saved dtype), and of embedding calls and logits from the plain
    model's."""
    import torch.distributed as dist

    m, units = hf_model(kind)
    plain, _ = hf_model(kind)
    engine = offload.initialize(m, config(dtype, unit_modules=units))
    m.save_pretrained(path)
    if dist.is_initialized():
        dist.barrier()  # rank 0 has written the files
    loaded = type(plain).from_pretrained(path).state_dict()
    full = engine.full_state_dict(rank0_only=False)
    ids = torch.tensor([[1, 2, 3, 4, 60]])
    with torch.no_grad():
        emb = m.get_input_embeddings()(ids).float() - plain.get_input_embeddings()(ids).to(engine.dtype).float()
        logits = m(ids).logits.float() - plain(ids).logits.float()
    engine.close()
    save_dtype = engine.dtype
    return {
        "saved": max(float((loaded[k].float() - full[k].to(save_dtype).float()).abs().max()) for k in loaded),
        "keys": float(len(set(loaded) ^ set(full))),
        "embedding": float(emb.abs().max()),
        "logits": float(logits.abs().max()),
    }


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hugging_face_save_pretrained_and_embeddings_world_size_1(kind, tmp_path):
    pytest.importorskip("transformers", reason="the Hugging Face models need transformers")
    got = hf_round_trip(kind, "fp32", str(tmp_path))
    assert got == {"saved": 0.0, "keys": 0.0, "embedding": 0.0, "logits": 0.0}, got


# -- world size 2 -------------------------------------------------------------------------------


def _ws2_all(rank: int, ws: int, hf_dir: str, dcp_dir: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    out: dict[str, Any] = {mode: train(rank, ws, mode) for mode in ("modifier", "discarded", "none")}
    m, plain = gpt(), gpt()
    engine = offload.initialize(m, config("bf16"))
    sd = check_reads(m, plain, engine)
    try:  # ranks that name different parameters are told so, instead of hanging or diverging
        with engine.gathered(m.wte if rank == 0 else m.wpe, modifier_rank=0):
            pass
        out["mismatch"] = "no error"
    except RuntimeError as exc:
        out["mismatch"] = str(exc)
    # A (bf16) state dict loads into the fp32 masters as given: upcast, exactly.
    sd["ln_f.bias"] += 0.5
    m.load_state_dict(sd)
    after = engine.full_state_dict(rank0_only=False)
    out["state dict loads as given"] = all(torch.equal(after[k], sd[k].float()) for k in sd)
    # DCP: every rank saves its full copy (DCP writes each replicated tensor once) and loads it
    # back into a state dict of the same shape, which load_state_dict writes into the masters.
    dcp.save({"model": m.state_dict()}, checkpoint_id=dcp_dir)
    x, y = gpt_batches(1)[0]
    engine.backward(engine(x[rank * 4 : rank * 4 + 4], y[rank * 4 : rank * 4 + 4]))
    engine.step()
    moved = engine.full_state_dict(rank0_only=False)
    template = {"model": m.state_dict()}
    dcp.load(template, checkpoint_id=dcp_dir)
    m.load_state_dict(template["model"])
    back = engine.full_state_dict(rank0_only=False)
    out["dcp moved by the step"] = max(float((moved[k] - after[k]).abs().max()) for k in after)
    out["dcp round trip"] = max(float((back[k] - after[k]).abs().max()) for k in after)
    engine.close()
    if HAVE_HF:
        for kind in ("gpt2", "llama"):
            for dtype in ("fp32", "bf16"):
                out[f"hf {kind} {dtype}"] = hf_round_trip(kind, dtype, os.path.join(hf_dir, kind + dtype), rank)
    return out


@pytest.fixture(scope="module")
def ws2(tmp_path_factory) -> list[dict[str, Any]]:
    base = tmp_path_factory.mktemp("ws2")
    return run_distributed(_ws2_all, 2, str(base / "hf"), str(base / "dcp"))


def test_modifier_edit_trains_like_the_same_edit_in_plain_torch_world_size_2(ws2):
    for rank, out in enumerate(ws2):
        (mod, _), (discarded, caught), (none, _) = out["modifier"], out["discarded"], out["none"]
        check_edit_runs(mod, discarded, none, f"ws2 rank {rank}")
        assert any("the change is discarded" in c for c in caught), caught
    # the edit was made on rank 1 only: rank 0 has it through the broadcast
    for k in ws2[0]["modifier"][0]:
        assert torch.equal(ws2[0]["modifier"][0][k], ws2[1]["modifier"][0][k]), k


def test_state_dicts_are_real_tensors_and_load_back_world_size_2(ws2):
    # check_reads asserted real, equal and tied tensors and the calls on each rank (or raised)
    for out in ws2:
        assert out["state dict loads as given"]
        assert "ranks named different parameters" in out["mismatch"], out["mismatch"]
        assert out["dcp moved by the step"] > 1e-4  # the negative control: the step moved it
        assert out["dcp round trip"] == 0.0


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_hugging_face_save_pretrained_and_embeddings_world_size_2(ws2, kind, dtype):
    pytest.importorskip("transformers", reason="the Hugging Face models need transformers")
    for out in ws2:
        got = out[f"hf {kind} {dtype}"]
        assert got["saved"] == 0.0 and got["keys"] == 0.0 and got["embedding"] == 0.0, got
        if dtype == "fp32":
            assert got["logits"] == 0.0, got
        else:
            # bf16 against the fp32 plain model: the engine computes in bf16 (3 significant
            # digits); a wrong weight moves logits by O(1).
            assert got["logits"] < 0.05, got
