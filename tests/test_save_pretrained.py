"""engine.save_pretrained and consolidate(config_from=...) write what `from_pretrained` loads.

A tiny `GPT2LMHeadModel` and a tiny `LlamaForCausalLM` with tied embeddings (built from
transformers configs, no download), one unit per decoder layer, trained 2 steps by the engine
at world sizes 1 and 2 (real processes), then saved in fp32 and bf16 with a small
`max_shard_size` (several shards and an index). In this plain process
`AutoModelForCausalLM.from_pretrained` of each directory must give:
- fp32: weights equal to `engine.full_state_dict()` and logits equal to the engine's on a
  batch, bit for bit (the same fp32 weights through the same CPU kernels);
- bf16: the weights cast to bf16, and the logits of the fp32 save loaded in bf16, bit for
  bit;
- each key once in the index and in the files, the tied head loaded tied to the embedding,
  config.json and generation_config.json present.
Negative control: the trained weights differ from the initial ones, so the equality checks
would catch a save of stale shards. A save failing part-way (the writer raising after a few
tensors, on rank 0) raises on every rank and leaves no target directory and no staging one.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch

import offload
from tests.conftest import gpt_batches, run_distributed
from tests.test_engine import make_config

transformers = pytest.importorskip(
    "transformers", reason="save_pretrained's output is checked by transformers' from_pretrained")

KINDS = ("gpt2", "llama")
SHARD = "20KB"  # the tiny models are ~100 KB in fp32: several shards


def hf_model(kind: str) -> tuple[Any, tuple[str, ...]]:
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(cfg), ("GPT2Block",)
    cfg = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, vocab_size=64, tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(cfg), ("LlamaDecoderLayer",)


def _train_and_save(rank: int, world_size: int, outdir: str) -> dict[str, Any]:
    import offload.checkpoint.pretrained as pretrained

    out: dict[str, Any] = {}
    for kind in KINDS:
        model, unit_modules = hf_model(kind)
        initial = {k: v.clone() for k, v in model.state_dict().items()}
        engine = offload.initialize(model, make_config(unit_modules=unit_modules))
        for x, _ in gpt_batches(2):
            n = x.shape[0] // world_size
            ids = x[rank * n : (rank + 1) * n]
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
        d = os.path.join(outdir, f"ws{world_size}", kind)
        sd = engine.full_state_dict()
        engine.save_pretrained(os.path.join(d, "fp32"), dtype="fp32", max_shard_size=SHARD)
        engine.save_pretrained(os.path.join(d, "bf16"), dtype=torch.bfloat16, max_shard_size=SHARD)
        engine.save_pretrained(os.path.join(d, "default"))  # config dtype None: fp32, one file
        engine.save_checkpoint(os.path.join(d, "ckpt"))
        engine.eval()
        batch = gpt_batches(1)[0][0][:2]
        with torch.no_grad():
            logits = engine(input_ids=batch).logits
        # a save failing part-way on rank 0 (the writer raises after a few tensors)
        real, calls = pretrained.pwrite_tensor, [0]

        def failing(fd: int, t: torch.Tensor, offset: int) -> None:
            calls[0] += 1
            if calls[0] > 3:
                raise OSError(28, "injected: no space left on device")
            real(fd, t, offset)

        pretrained.pwrite_tensor = failing
        try:
            engine.save_pretrained(os.path.join(d, "failed"), max_shard_size=SHARD)
            failure = None
        except (OSError, RuntimeError) as exc:
            failure = f"{type(exc).__name__}: {exc}"
        finally:
            pretrained.pwrite_tensor = real
        # into an existing directory: other files kept, the old split replaced
        again = os.path.join(d, "again")
        if rank == 0:
            os.makedirs(again)
            open(os.path.join(again, "tokenizer.json"), "w").write("{}")
        engine.save_pretrained(again, max_shard_size=SHARD)
        engine.save_pretrained(again)
        engine.close()
        out[kind] = {"dir": d, "sd": sd, "initial": initial, "batch": batch, "logits": logits,
                     "failure": failure}
    return out


@pytest.fixture(scope="module", params=[1, 2], ids=["world_size_1", "world_size_2"])
def saved(request, tmp_path_factory):
    ranks = run_distributed(_train_and_save, request.param, str(tmp_path_factory.mktemp("hf")))
    return request.param, ranks


def _load(path: str) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(path).eval()


def _tied(kind: str) -> tuple[str, str]:
    """(the name transformers keeps, the tied name it drops)."""
    return ("transformer.wte.weight", "lm_head.weight") if kind == "gpt2" else \
        ("model.embed_tokens.weight", "lm_head.weight")


def _check_layout(path: str, kind: str, sd: dict[str, torch.Tensor], sharded: bool) -> None:
    from safetensors import safe_open

    kept, dropped = _tied(kind)
    names = sorted(os.listdir(path))
    assert "config.json" in names and "generation_config.json" in names, names
    assert not [n for n in names if n.startswith(".")], names  # no temporaries
    if not sharded:
        assert [n for n in names if "safetensors" in n] == ["model.safetensors"], names
        files = ["model.safetensors"]
    else:
        pairs = json.load(open(os.path.join(path, "model.safetensors.index.json")),
                          object_pairs_hook=lambda p: p)
        index = dict(pairs)
        weight_map = dict(index["weight_map"])
        assert len(weight_map) == len(index["weight_map"]), "a key listed twice in the index"
        assert set(weight_map) == set(sd) - {dropped}
        files = sorted(set(weight_map.values()))
        assert len(files) > 2 and files == [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
                                            for i in range(len(files))]
        assert set(names) == set(files) | {"config.json", "generation_config.json",
                                           "model.safetensors.index.json"}
    keys: list[str] = []
    for f in files:
        with safe_open(os.path.join(path, f), "pt") as st:
            keys += list(st.keys())
    assert sorted(keys) == sorted(set(sd) - {dropped}) and kept in keys  # each key once


def _check_weights(model: Any, kind: str, sd: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    kept, dropped = _tied(kind)
    got = model.state_dict()
    assert set(got) == set(sd)
    for k, v in sd.items():
        assert got[k].dtype == dtype and torch.equal(got[k], v.to(dtype)), k
    assert model.get_parameter(dropped) is model.get_parameter(kept)  # loaded tied


def test_save_pretrained_loads_with_from_pretrained(saved):
    world_size, ranks = saved
    for kind in KINDS:
        r = ranks[0][kind]
        sd, d = r["sd"], r["dir"]
        # negative control: training moved the weights, so stale shards would not pass
        assert any(not torch.equal(sd[k], r["initial"][k]) for k in sd)
        _check_layout(os.path.join(d, "fp32"), kind, sd, sharded=True)
        _check_layout(os.path.join(d, "bf16"), kind, sd, sharded=True)
        _check_layout(os.path.join(d, "default"), kind, sd, sharded=False)
        assert json.load(open(os.path.join(d, "bf16", "config.json")))["dtype"] == "bfloat16"

        fp32 = _load(os.path.join(d, "fp32"))
        _check_weights(fp32, kind, sd, torch.float32)
        _check_weights(_load(os.path.join(d, "default")), kind, sd, torch.float32)
        with torch.no_grad():
            assert torch.equal(fp32(input_ids=r["batch"]).logits, r["logits"]), kind
            bf16 = _load(os.path.join(d, "bf16"))
            _check_weights(bf16, kind, sd, torch.bfloat16)
            # the fp32 save loaded in bf16 (not `.to(bf16)`: that would also cast the
            # non-persistent fp32 rotary buffers from_pretrained keeps in fp32)
            cast = transformers.AutoModelForCausalLM.from_pretrained(
                os.path.join(d, "fp32"), dtype=torch.bfloat16).eval()
            want = cast(input_ids=r["batch"]).logits
            assert torch.equal(bf16(input_ids=r["batch"]).logits, want), kind
        if world_size == 2:
            assert ranks[1][kind]["sd"] == {}  # rank 0 only


def test_a_failed_save_leaves_no_directory_on_any_rank(saved):
    world_size, ranks = saved
    for kind in KINDS:
        d = ranks[0][kind]["dir"]
        assert ranks[0][kind]["failure"].startswith("OSError: [Errno 28] injected"), ranks[0][kind]
        if world_size == 2:
            assert ranks[1][kind]["failure"].startswith("RuntimeError"), ranks[1][kind]
            assert "failed on rank 0" in ranks[1][kind]["failure"]
        assert not os.path.exists(os.path.join(d, "failed"))
        assert not [n for n in os.listdir(d) if n.startswith(".")], os.listdir(d)  # no staging


def test_save_into_an_existing_directory_keeps_other_files(saved):
    world_size, ranks = saved
    for kind in KINDS:
        again = os.path.join(ranks[0][kind]["dir"], "again")
        # the second save (one file) replaced the first's shards and index; tokenizer kept
        assert sorted(os.listdir(again)) == ["config.json", "generation_config.json",
                                             "model.safetensors", "tokenizer.json"]
        _check_weights(_load(again), kind, ranks[0][kind]["sd"], torch.float32)


def test_consolidate_with_config_from_loads_with_from_pretrained(saved, tmp_path):
    from offload.checkpoint import consolidate

    world_size, ranks = saved
    for kind in KINDS:
        r = ranks[0][kind]
        out = str(tmp_path / kind)
        consolidate(os.path.join(r["dir"], "ckpt"), out, max_shard_size=SHARD,
                    config_from=os.path.join(r["dir"], "bf16"))
        _check_layout(out, kind, r["sd"], sharded=True)
        assert json.load(open(os.path.join(out, "config.json")))["dtype"] == "float32"
        _check_weights(_load(out), kind, r["sd"], torch.float32)
    with pytest.raises(FileNotFoundError, match="config_from .* no .*config.json"):
        consolidate(os.path.join(ranks[0]["gpt2"]["dir"], "ckpt"), str(tmp_path / "x"),
                    config_from=str(tmp_path))
