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

Each run is also evaluated at its end (`trainer.evaluate`, the same bound on eval_loss).
Also: world size 2 (real processes, gloo; the plain run is DDP); save at step 3 and resume
gives the uninterrupted run's weights bit for bit; `save_model` output loads with
`from_pretrained` and gives the engine's logits; a DeepSpeed config full of "auto" values;
conflicts named; PEFT LoRA against plain PEFT, its adapter saved and reloaded.
"""

from __future__ import annotations

import math
import os
import tempfile
from typing import Any

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


def train_variant(kind: str, variant: str, outdir: str, n_samples: int = N_SAMPLES, cuda: bool = False,
                  **kw: Any) -> dict[str, Any]:
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
    args_kw["use_cpu"] = not cuda
    model = tiny_model(kind, dtype)
    args = training_args(outdir, **args_kw)
    if variant in ("offload", "dropping"):
        cls = OffloadTrainer if variant == "offload" else _dropping_trainer_cls()
        trainer = cls(model=model, args=args, train_dataset=token_data(n_samples),
                      offload_config={"compute_device": "cuda" if cuda else "cpu"})
        trainer.train()
        weights = trainer.engine.full_state_dict(rank0_only=False)
        steps = (trainer.engine.global_steps, trainer.state.global_step)
    else:
        trainer = transformers.Trainer(model=model, args=args, train_dataset=token_data(n_samples))
        trainer.train()
        weights = {k: v.detach().to("cpu", torch.float64 if variant == "truth" else torch.float32, copy=True)
                   for k, v in model.state_dict().items()}
        steps = (trainer.state.global_step, trainer.state.global_step)
    logged = curves(trainer)
    logged["eval_loss"] = [trainer.evaluate(eval_dataset=token_data(6))["eval_loss"]]
    if variant in ("offload", "dropping"):
        trainer.engine.close()
    return {"curves": logged, "weights": weights, "steps": steps}


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
    for key in ("loss", "grad_norm", "eval_loss"):
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


@pytest.mark.cuda
def test_trainer_matches_plain_trainer_on_cuda(tmp_path) -> None:
    """The same comparison with the model computing on the GPU (the Trainer's and the
    engine's), the engine's shards in pinned host memory."""
    runs = {v: train_variant("llama", v, str(tmp_path / v), cuda=True) for v in VARIANTS}
    check_parity(runs, "llama, CUDA", steps=7)


def test_trainer_matches_plain_trainer_world_size_2() -> None:
    results = run_distributed(_all_variants, 2, "gpt2", init_group=False)
    for r, runs in enumerate(results):
        check_parity(runs, f"gpt2, world size 2, rank {r}", steps=4)


# -- checkpoints: save at step 3, resume, save_model ------------------------------------------


def test_resume_from_step_3_equals_the_uninterrupted_run(tmp_path) -> None:
    from offload.integrations.hf import OffloadTrainer

    def trainer(outdir: str) -> Any:
        args = training_args(outdir, save_strategy="steps", save_steps=3, logging_steps=1)
        return OffloadTrainer(model=tiny_model("llama"), args=args, train_dataset=token_data(),
                              offload_config={"compute_device": "cpu"})

    whole = trainer(str(tmp_path / "whole"))
    whole.train()
    want = whole.engine.full_state_dict()
    want_curves = curves(whole)
    whole.engine.close()
    ckpt = tmp_path / "whole" / "checkpoint-3"
    names = set(os.listdir(ckpt))
    # The engine's checkpoint (every rank's shards) instead of a rank-0 optimizer.pt, beside
    # what save_model writes and the Trainer's own state.
    assert {"latest", "global_step3", "config.json", "model.safetensors", "trainer_state.json"} <= names, names
    assert not names & {"optimizer.pt", "scheduler.pt"}, names

    resumed = trainer(str(tmp_path / "resumed"))
    resumed.train(resume_from_checkpoint=str(ckpt))
    got = resumed.engine.full_state_dict()
    assert resumed.engine.global_steps == resumed.state.global_step == 7
    assert list(got) == list(want)
    for k in want:
        assert torch.equal(got[k], want[k]), f"{k} differs after resuming at step 3"
    assert curves(resumed)["loss"] == want_curves["loss"]  # steps 1-3 from the checkpoint's history
    # Negative control: the weights at step 3 are not the final ones.
    at_3 = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).state_dict()
    assert not torch.equal(at_3["model.embed_tokens.weight"], want["model.embed_tokens.weight"])
    resumed.engine.close()


def test_resume_from_a_checkpoint_without_engine_state_is_refused(tmp_path) -> None:
    from offload.integrations.hf import OffloadTrainer

    (tmp_path / "checkpoint-1").mkdir()
    t = OffloadTrainer(model=tiny_model("gpt2"), args=training_args(str(tmp_path)),
                       train_dataset=token_data(), offload_config={"compute_device": "cpu"})
    with pytest.raises(FileNotFoundError, match="no offload engine checkpoint"):
        t.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_save_model_loads_with_from_pretrained_and_gives_the_engine_logits(tmp_path, kind: str) -> None:
    from offload.integrations.hf import OffloadTrainer

    t = OffloadTrainer(model=tiny_model(kind), args=training_args(str(tmp_path / "run")),
                       train_dataset=token_data(), offload_config={"compute_device": "cpu"})
    t.train()
    t.save_model(str(tmp_path / "model"))
    ids = torch.stack([s["input_ids"] for s in token_data(4)])
    t.model.eval()
    with torch.no_grad():
        want = t.model(input_ids=ids).logits
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32).eval()
    with torch.no_grad():
        got = loaded(input_ids=ids).logits
    assert torch.equal(got, want)
    assert os.path.isfile(tmp_path / "model" / "training_args.bin")
    # Negative control: the trained model is not the initial one.
    with torch.no_grad():
        initial = tiny_model(kind).eval()(input_ids=ids).logits
    assert not torch.allclose(initial, want)
    t.engine.close()


# -- configs: DeepSpeed's with "auto", offload's, conflicts ---------------------------------


AUTO_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {
        "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto",
        "total_num_steps": "auto"}},
    "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
    "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"},
        "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto"},
}


@pytest.mark.parametrize("bf16", [False, True])
def test_a_deepspeed_config_full_of_auto_values_trains(tmp_path, bf16: bool) -> None:
    from offload.integrations.hf import OffloadTrainer

    args = training_args(str(tmp_path), bf16=bf16)
    t = OffloadTrainer(model=tiny_model("gpt2"), args=args, train_dataset=token_data(),
                       offload_config=AUTO_CONFIG)
    t.train()
    cfg = t.engine.config
    assert cfg.gradient_accumulation_steps == 2 and cfg.gradient_clipping == CLIP
    assert cfg.precision.dtype == ("bf16" if bf16 else "fp32")
    assert cfg.optimizer.lr == LR and tuple(cfg.optimizer.betas) == (args.adam_beta1, args.adam_beta2)
    assert cfg.scheduler is not None and cfg.scheduler.type == "WarmupDecayLR"
    assert cfg.scheduler.params["total_num_steps"] == 7 and cfg.scheduler.params["warmup_num_steps"] == 2
    assert t.engine.global_steps == t.state.global_step == 7
    # The logged rates are the config's schedule (DeepSpeed's WarmupDecayLR, log warm-up),
    # stepped once per update by the engine: replayed here on a bare optimizer.
    from offload.optim.lr_schedules import resolve_scheduler

    bare = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=LR)
    schedule = resolve_scheduler(bare, None, cfg.scheduler)
    want = []
    for _ in range(7):
        want.append(bare.param_groups[0]["lr"])
        bare.step()
        schedule.step()
    assert curves(t)["learning_rate"] == want
    assert max(want) == LR and want[-1] < want[3]  # warms up, then decays
    assert all(math.isfinite(x) for x in curves(t)["loss"])
    t.engine.close()


def test_conflicts_between_the_config_and_the_arguments_are_named(tmp_path) -> None:
    from offload.config import ConfigError
    from offload.integrations.hf import OffloadTrainer

    def attempt(config: Any, **kw: Any) -> str:
        t = OffloadTrainer(model=tiny_model("gpt2"), args=training_args(str(tmp_path), **kw),
                           train_dataset=token_data(), offload_config=config)
        with pytest.raises(ConfigError) as info:
            t.train()
        return str(info.value)

    msg = attempt({"gradient_accumulation_steps": 4, "gradient_clipping": 2.0, "compute_device": "cpu"})
    assert "gradient_accumulation_steps = 4" in msg and "gradient_accumulation_steps = 2" in msg
    assert "gradient_clipping = 2.0" in msg and "max_grad_norm = 0.5" in msg
    msg = attempt({"gradient_accumulation_steps": 4, "zero_optimization": {"stage": 3}})
    assert "gradient_accumulation_steps = 4" in msg and "gradient_accumulation_steps = 2" in msg
    msg = attempt({"compute_device": "cpu"}, optim="adafactor")
    assert "adafactor" in msg and "adamw_torch" in msg


def test_adamw_8bit_runs_the_engines_8bit_moments(tmp_path) -> None:
    """`optim="adamw_8bit"` (and bitsandbytes'/torchao's names) trains with the engine's
    8-bit moments, without bitsandbytes; the same run with "adamw_torch" keeps fp32 ones."""
    from offload.integrations.hf import OffloadTrainer

    runs = {}
    for optim in ("adamw_8bit", "adamw_torch"):
        t = OffloadTrainer(model=tiny_model("llama"), args=training_args(str(tmp_path), optim=optim),
                           train_dataset=token_data(), offload_config={"compute_device": "cpu"})
        t.train()
        runs[optim] = (t.engine.optimizer.moments, {s.moments["exp_avg"].dtype for s in t.engine.states
                                                    if s.moments}, curves(t)["loss"])
        t.engine.close()
    assert runs["adamw_8bit"][:2] == ("8bit", {torch.uint8})
    assert runs["adamw_torch"][:2] == ("fp32", {torch.float32})
    # the same data and first loss (logged before any update); the curves then part: the
    # 8-bit state is what the steps used (its accuracy: tests/test_adam8bit.py, test_engine_8bit.py)
    loss8, loss32 = runs["adamw_8bit"][2], runs["adamw_torch"][2]
    assert loss8[0] == loss32[0] and loss8[2:] != loss32[2:]
    assert all(math.isfinite(v) for v in loss8)


def test_args_deepspeed_is_read_as_the_config(tmp_path) -> None:
    pytest.importorskip("deepspeed", reason="TrainingArguments(deepspeed=...) itself needs DeepSpeed "
                        "installed (transformers builds its DeepSpeed plugin there)")
    from offload.integrations.hf import OffloadTrainer

    args = training_args(str(tmp_path), deepspeed=AUTO_CONFIG)
    t = OffloadTrainer(model=tiny_model("gpt2"), args=args, train_dataset=token_data())
    assert t.args.deepspeed is None and not t.is_deepspeed_enabled
    t.train()
    assert t.engine.config.scheduler.type == "WarmupDecayLR"
    assert t.engine.global_steps == 7
    t.engine.close()
    with pytest.raises(ValueError, match="both offload_config and"):
        OffloadTrainer(model=tiny_model("gpt2"), args=training_args(str(tmp_path), deepspeed=AUTO_CONFIG),
                       train_dataset=token_data(), offload_config={})


# -- PEFT / LoRA ----------------------------------------------------------------------------


def lora_model(dtype: torch.dtype = torch.float32) -> Any:
    peft = pytest.importorskip("peft", reason="the LoRA tests need peft")
    model = tiny_model("llama")
    torch.manual_seed(2)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                      target_modules=["q_proj", "v_proj"]))
    for n, p in lora.named_parameters():  # lora_B starts at zero: move it, so A gets gradients
        if "lora_B" in n:
            with torch.no_grad():
                p.normal_(0.0, 0.02)
    return lora.to(dtype)


def test_lora_through_offload_trainer_matches_plain_peft(tmp_path) -> None:
    peft = pytest.importorskip("peft", reason="the LoRA tests need peft")
    from offload.integrations.hf import OffloadTrainer

    runs: dict[str, Any] = {}
    for variant in ("truth", "plain", "fused", "split", "offload"):
        kw: dict[str, Any] = {"fused": {"optim": "adamw_torch_fused"},
                              "split": {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 4}
                              }.get(variant, {})
        model = lora_model(torch.float64 if variant == "truth" else torch.float32)
        args = training_args(str(tmp_path / variant), learning_rate=5e-2, **kw)
        if variant == "offload":
            t = OffloadTrainer(model=model, args=args, train_dataset=token_data(),
                               offload_config={"compute_device": "cpu"})
            t.train()
            weights = t.engine.full_state_dict()
        else:
            t = transformers.Trainer(model=model, args=args, train_dataset=token_data())
            t.train()
            weights = {k: v.detach().to(torch.float64 if variant == "truth" else torch.float32).clone()
                       for k, v in model.state_dict().items()}
        runs[variant] = {"weights": weights, "trainer": t}
    bound = Fp32Bound(runs["truth"]["weights"], {v: runs[v]["weights"] for v in ("plain", "fused", "split")})
    bound.check(runs["offload"]["weights"], "OffloadTrainer LoRA")
    trained = [k for k in runs["offload"]["weights"] if "lora_" in k]
    assert trained, "no LoRA weights in the engine's state dict"
    initial = lora_model().state_dict()
    assert all(not torch.equal(runs["offload"]["weights"][k], initial[k]) for k in trained)
    frozen = [k for k in initial if "lora_" not in k]
    assert all(torch.equal(runs["offload"]["weights"][k], initial[k]) for k in frozen)

    # save_model writes the adapter as PEFT does; PEFT loads it onto the base model.
    t = runs["offload"]["trainer"]
    t.save_model(str(tmp_path / "adapter"))
    assert os.path.isfile(tmp_path / "adapter" / "adapter_model.safetensors")
    assert not os.path.exists(tmp_path / "adapter" / "model.safetensors")
    ids = torch.stack([s["input_ids"] for s in token_data(4)])
    t.model.eval()
    with torch.no_grad():
        want = t.model(input_ids=ids).logits
        loaded = peft.PeftModel.from_pretrained(tiny_model("llama"), tmp_path / "adapter").eval()
        got = loaded(input_ids=ids).logits
    assert torch.equal(got, want)
    t.engine.close()


def test_activation_checkpointing_gives_the_same_run(tmp_path) -> None:
    """The Trainer's activation checkpointing recomputes each layer's forward in backward:
    the engine gathers the layer again for it, and the arithmetic is the same."""
    from offload.integrations.hf import OffloadTrainer

    out = {}
    for ckpt in (False, True):
        t = OffloadTrainer(model=tiny_model("llama"), args=training_args(str(tmp_path / str(ckpt)),
                           gradient_checkpointing=ckpt), train_dataset=token_data(),
                           offload_config={"compute_device": "cpu"})
        t.train()
        out[ckpt] = t.engine.full_state_dict()
        t.engine.close()
    assert all(torch.equal(out[True][k], out[False][k]) for k in out[False])
    assert not torch.equal(out[True]["model.norm.weight"], tiny_model("llama").state_dict()["model.norm.weight"])


def test_a_model_loaded_into_shards_evaluates_and_trains(tmp_path) -> None:
    """`from_pretrained` into shards, then the Trainer: evaluate() before train() builds the
    engine (the weights exist only there), and gives transformers' own model's eval loss."""
    from offload.integrations.hf import OffloadTrainer, from_pretrained

    tiny_model("llama").save_pretrained(tmp_path / "pretrained", max_shard_size="20KB")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "pretrained", dtype=torch.float32)
    plain = transformers.Trainer(model=loaded, args=training_args(str(tmp_path / "plain")))
    want = plain.evaluate(eval_dataset=token_data(6))["eval_loss"]
    model = from_pretrained(str(tmp_path / "pretrained"))
    assert all(p.is_meta for p in model.parameters())
    t = OffloadTrainer(model=model, args=training_args(str(tmp_path / "run")), train_dataset=token_data(),
                       offload_config={"compute_device": "cpu"})
    assert t.evaluate(eval_dataset=token_data(6))["eval_loss"] == want
    t.train()
    assert t.engine.global_steps == t.state.global_step == 7
    trained = t.engine.full_state_dict()
    assert not torch.equal(trained["model.norm.weight"], loaded.state_dict()["model.norm.weight"])
    t.engine.close()


# -- torchrun on a CPU-only machine without use_cpu (issue #33) --------------------------------------


def _without_use_cpu(rank: int, world_size: int) -> dict:
    import transformers
    from transformers import TrainingArguments

    from offload.integrations.hf import OffloadTrainer

    class Batches(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return {"input_ids": torch.full((8,), i), "labels": torch.full((8,), i)}

    seen: list[list[int]] = []

    class Spy(OffloadTrainer):
        def training_step(self, model, inputs, *args, **kwargs):
            seen.append(inputs["input_ids"][:, 0].tolist())
            return super().training_step(model, inputs, *args, **kwargs)

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32,
                                                                 n_positions=16))
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=2, report_to=[],
                                 save_strategy="no", logging_strategy="no", disable_tqdm=True)  # no use_cpu
        trainer = Spy(model=model, args=args, train_dataset=Batches(), offload_config={"compute_device": "cpu"})
        trainer.train()
        return {"seen": seen, "engine world size": trainer.engine.world_size,
                "args world size": trainer.args.world_size}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only launch (a GPU machine distributes by itself)")
def test_torchrun_on_a_cpu_machine_without_use_cpu_shards_the_data():
    """It trained both ranks on the same batches (the engine averaging identical gradients);
    now use_cpu is set and each rank sees its own share."""
    r0, r1 = run_distributed(_without_use_cpu, 2, init_group=False)
    assert r0["engine world size"] == r0["args world size"] == 2
    flat0 = [i for batch in r0["seen"] for i in batch]
    flat1 = [i for batch in r1["seen"] for i in batch]
    assert not set(flat0) & set(flat1), (r0["seen"], r1["seen"])  # disjoint shares of the data
