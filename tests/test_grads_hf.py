"""get_global_grad_norm on Hugging Face models (issue 17), against plain PyTorch.

A tiny `LlamaForCausalLM` and a tiny `GPT2LMHeadModel`, built from transformers configs (no
download), one unit per decoder layer, fp32, accumulation 2, updates during backward, at
world sizes 1 and 2: `engine.get_global_grad_norm()` after every optimizer step equals what
`torch.nn.utils.get_total_norm` (what `clip_grad_norm_` returns) gives on the plain model
trained by torch's AdamW on the same batches. The loss is the model's own,
`model(input_ids=x, labels=x).loss` (it shifts the labels).

Bounds as tests/test_grads.py's `NormBound` measures them ([Note: derived tolerances] in
tests/parity.py): per step, 8x the largest distance of three fp32 runs of the plain loop
(for-loop and fused AdamW, each batch split in 2) from its float64 run. Negative control: the
norms of the same loop on half of every batch land far outside.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import offload
from offload.config import PrefetchConfig
from tests.conftest import gpt_batches, run_distributed
from tests.parity import plain_loop
from tests.test_engine import LR, STEPS, WD, make_config
from tests.test_grads import GAS, NormBound

pytest.importorskip("transformers", reason="the Hugging Face models are built from transformers configs")

KINDS = ("llama", "gpt2")


def hf_model(kind: str) -> tuple[nn.Module, tuple[str, ...]]:
    """The model (seed 0) and its unit_modules."""
    import transformers as tf

    torch.manual_seed(0)
    if kind == "gpt2":
        # dropout off (GPT-2 defaults to 0.1): the engine and the plain loop would draw other
        # masks; token ids inside the 64-token vocabulary (the default 50256 draws a warning)
        cfg = tf.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        return tf.GPT2LMHeadModel(cfg), ("GPT2Block",)
    cfg = tf.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, vocab_size=64)
    return tf.LlamaForCausalLM(cfg), ("LlamaDecoderLayer",)


class _CausalLmLoss(nn.Module):
    """The plain loop's `model(x, y)`: the HF model's loss on x (y is unused: HF shifts x).
    HF casts the logits to float32 for its loss, which would put fp32 rounding into the
    float64 truth; in float64 the same mean cross entropy of the shifted tokens is taken here."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.lm = hf_model(kind)[0]

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.lm.dtype != torch.float64:
            return self.lm(input_ids=x, labels=x).loss
        logits = self.lm(input_ids=x).logits
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())


def plain_hf_norms(kind: str, half: bool = False, **o: Any) -> list[float]:
    """The plain loop's global gradient norm per step; `half`: on the first half of every batch."""
    norms: list[float] = []
    batches = gpt_batches(STEPS)
    if half:
        batches = [(x[: x.shape[0] // 2], y[: y.shape[0] // 2]) for x, y in batches]
    plain_loop(functools.partial(_CausalLmLoss, kind), batches, lr=LR, weight_decay=WD, gas=GAS,
               norms=norms, **o)
    return norms


@functools.lru_cache(maxsize=None)
def hf_norm_bound(kind: str) -> NormBound:
    return NormBound("fp32", GAS, 0.0, run=functools.partial(plain_hf_norms, kind))


def engine_hf_norms(kind: str, rank: int = 0, world_size: int = 1) -> dict[str, Any]:
    """Train `kind` with the engine (rank r takes its share of every batch): the norm reported
    after every optimizer step, whether each step's updates ran during backward, the units."""
    model, unit_modules = hf_model(kind)
    engine = offload.initialize(model, make_config(gas=GAS, unit_modules=unit_modules, nonfinite_loss="off",
                                                   prefetch=PrefetchConfig(optimizer_in_backward=True)))
    units = [unit.name for unit in engine.units]
    norms, in_backward = [], []
    for i, (x, _) in enumerate(gpt_batches(STEPS)):
        n = x.shape[0] // world_size
        ids = x[rank * n : (rank + 1) * n]
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        if engine.is_gradient_accumulation_boundary():
            in_backward.append(bool(engine.policy.updated))
        engine.step()
        if (i + 1) % GAS == 0:
            norms.append(engine.get_global_grad_norm())
    engine.close()
    return {"norms": norms, "in_backward": in_backward, "units": units}


def check_hf_norms(kind: str, got: dict[str, Any], what: str) -> None:
    hf_norm_bound(kind).check(got["norms"], f"{what} {kind} grad norm")
    # the path under test ran: updates during backward after the first step (which learns
    # how many backward passes a micro-batch runs), one unit per decoder layer (and the root)
    assert got["in_backward"][1:] and all(got["in_backward"][1:]), got["in_backward"]
    layers = "model.layers" if kind == "llama" else "transformer.h"
    assert got["units"] == ["", f"{layers}.0", f"{layers}.1"], got["units"]


@pytest.mark.parametrize("kind", KINDS)
def test_hf_norm_of_every_step_is_plain_clip_grad_norm_world_size_1(kind):
    check_hf_norms(kind, engine_hf_norms(kind), "engine")


def _ws2(rank: int, world_size: int) -> dict[str, Any]:
    return {kind: engine_hf_norms(kind, rank, world_size) for kind in KINDS}


@pytest.fixture(scope="module")
def ws2_results():
    return run_distributed(_ws2, 2)


@pytest.mark.parametrize("kind", KINDS)
def test_hf_norm_of_every_step_is_plain_clip_grad_norm_world_size_2(kind, ws2_results):
    rank0, rank1 = ws2_results
    check_hf_norms(kind, rank0[kind], "engine ws2")
    assert rank1[kind]["norms"] == rank0[kind]["norms"]  # one global norm, on every rank


@pytest.mark.parametrize("kind", KINDS)
def test_hf_norm_bound_catches_the_norm_of_half_a_batch(kind):
    """Negative control: the norms on half of every batch (as a norm that missed one rank's
    shards or a micro-batch would be) land far outside the bound."""
    ratio = hf_norm_bound(kind).ratio(plain_hf_norms(kind, half=True))
    assert ratio > 100, ratio
