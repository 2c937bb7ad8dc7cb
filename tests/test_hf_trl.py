"""TRL's trainers with `OffloadTrainerMixin` against plain TRL (CPU, tiny Llama from a config).

SFTTrainer, DPOTrainer (its frozen reference model under an engine of its own, as TRL puts it
under a DeepSpeed inference engine) and GRPOTrainer (sampled completions scored by a toy
reward function). Each is compared with plain TRL on the same data: the truth is plain TRL
with the model in float64, the fp32 references are plain TRL with torch's for-loop and fused
AdamW; the final weights must lie within `Fp32Bound` ([Note: derived tolerances] in
tests/parity.py). SFTTrainer(model, args) is built positionally, DPOTrainer and GRPOTrainer by
keyword, as TRL's examples do: `args=` reached DPOTrainer's `ref_model` and GRPOTrainer's
`reward_funcs` slots before the mixin forwarded every argument by keyword.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from tests.conftest import run_distributed
from tests.parity import Fp32Bound
from tests.test_hf_trainer import CLIP, LR, VOCAB, tiny_model, token_data

transformers = pytest.importorskip("transformers", reason="TRL's trainers are transformers Trainers")
pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")
trl = pytest.importorskip("trl", reason="the TRL tests need trl (the trl extra)")
datasets = pytest.importorskip("datasets", reason="TRL's trainers take a datasets.Dataset")

FP32_VARIANTS = ("plain", "fused")


def tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t0")


def words(g: torch.Generator, n: int) -> str:
    return " ".join(f"t{int(i)}" for i in torch.randint(2, VOCAB, (n,), generator=g))


def common_args(variant: str, outdir: str) -> dict[str, Any]:
    # TRL's configs default to bf16=True (autocast in the plain runs, bf16 compute in the
    # engine): fp32 here, whose noise the bound measures.
    return dict(output_dir=outdir, bf16=False, gradient_accumulation_steps=2, num_train_epochs=1, learning_rate=LR,
                max_grad_norm=CLIP, logging_steps=1, report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
                save_strategy="no", optim="adamw_torch_fused" if variant == "fused" else "adamw_torch")


def weights_of(model: Any, variant: str) -> dict[str, torch.Tensor]:
    dtype = torch.float64 if variant == "truth" else torch.float32
    return {k: v.detach().to(dtype, copy=True) for k, v in model.state_dict().items()}


def check(runs: dict[str, dict[str, torch.Tensor]], what: str) -> Fp32Bound:
    bound = Fp32Bound(runs["truth"], {v: runs[v] for v in FP32_VARIANTS})
    bound.check(runs["offload"], what)
    return bound


# -- SFTTrainer ---------------------------------------------------------------------------------


def test_sft_trainer_with_the_mixin_matches_plain_trl(tmp_path) -> None:
    from offload.integrations.hf import OffloadTrainerMixin

    class OffloadSFTTrainer(OffloadTrainerMixin, trl.SFTTrainer):
        pass

    ds = datasets.Dataset.from_list([{"input_ids": s["input_ids"].tolist()} for s in token_data()])
    runs: dict[str, Any] = {}
    for variant in ("truth", *FP32_VARIANTS, "offload"):
        args = trl.SFTConfig(per_device_train_batch_size=2, **common_args(variant, str(tmp_path / variant)))
        model = tiny_model("llama", torch.float64 if variant == "truth" else torch.float32)
        if variant == "offload":
            t = OffloadSFTTrainer(model, args, train_dataset=ds, processing_class=tokenizer(),
                                  offload_config={"compute_device": "cpu"})
            t.train()
            runs[variant] = t.engine.full_state_dict()
            assert t.engine.global_steps == t.state.global_step == 7
            t.engine.close()
        else:
            t = trl.SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tokenizer())
            t.train()
            runs[variant] = weights_of(model, variant)
    check(runs, "TRL SFTTrainer + OffloadTrainerMixin")


# -- DPOTrainer: a policy and its frozen reference ------------------------------------------------


def preference_data() -> Any:
    g = torch.Generator().manual_seed(3)
    rows = [{"prompt": words(g, 6) + " ", "chosen": words(g, 4) + " t0", "rejected": words(g, 5) + " t0"}
            for _ in range(16)]
    return datasets.Dataset.from_list(rows)


def dpo_run(variant: str, outdir: str, reference_shift: float = 0.0) -> dict[str, Any]:
    """One DPO run (16 pairs, micro-batches of 2, 2 accumulation steps: 4 updates);
    `reference_shift` moves every reference weight by that much (the negative control)."""
    from offload.integrations.hf import OffloadTrainerMixin

    class OffloadDPOTrainer(OffloadTrainerMixin, trl.DPOTrainer):
        pass

    dtype = torch.float64 if variant == "truth" else torch.float32
    args = trl.DPOConfig(per_device_train_batch_size=2, beta=0.5, **common_args(variant, outdir))
    model, ref = tiny_model("llama", dtype), tiny_model("llama", dtype)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(reference_shift)
    if variant == "offload":
        # by keyword, as TRL's examples pass them (args reached the ref_model slot before)
        t = OffloadDPOTrainer(model=model, ref_model=ref, args=args, train_dataset=preference_data(), processing_class=tokenizer(),
                              offload_config={"compute_device": "cpu"})
        t.train()
        assert t.engine.global_steps == t.state.global_step == 4 // t.args.world_size
        assert t.ref_engine is not None and t.ref_model is ref
        assert not any(p.requires_grad for p in ref.parameters())
        out = {"weights": t.engine.full_state_dict(rank0_only=False),
               "reference": t.ref_engine.full_state_dict(rank0_only=False)}
        t.engine.close()
        t.ref_engine.close()
        return out
    t = trl.DPOTrainer(model=model, ref_model=ref, args=args, train_dataset=preference_data(),
                       processing_class=tokenizer())
    t.train()
    return {"weights": weights_of(model, variant)}


def test_dpo_trainer_with_the_mixin_matches_plain_trl(tmp_path) -> None:
    runs = {v: dpo_run(v, str(tmp_path / v)) for v in ("truth", *FP32_VARIANTS, "offload")}
    bound = check({v: r["weights"] for v, r in runs.items()}, "TRL DPOTrainer + OffloadTrainerMixin")
    # The reference, under its own engine, is what it was: frozen, never stepped.
    start = tiny_model("llama").state_dict()
    for k, v in runs["offload"]["reference"].items():
        assert torch.equal(v, start[k]), f"{k}: the reference model moved"
    # Negative control: a reference 1e-3 off in every weight (what a reference engine
    # serving stale or wrong shards would do) lands far outside the bound.
    worst, _, _ = bound.worst(dpo_run("plain", str(tmp_path / "control"), reference_shift=1e-3)["weights"])
    assert worst > 100, f"the DPO negative control is only {worst:.3g}x the bound"


def _dpo_ws2(rank: int, world_size: int) -> dict[str, Any]:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        return {v: dpo_run(v, f"{d}/{v}") for v in ("truth", *FP32_VARIANTS, "offload")}


def test_dpo_trainer_with_the_mixin_matches_plain_trl_world_size_2() -> None:
    """Two processes (gloo; plain TRL under DDP): the policy's and the reference's engines
    gather over the same ranks, one after the other, in the same order on each."""
    for rank, runs in enumerate(run_distributed(_dpo_ws2, 2, init_group=False)):
        check({v: r["weights"] for v, r in runs.items()}, f"TRL DPOTrainer + OffloadTrainerMixin, ws2 rank {rank}")
        start = tiny_model("llama").state_dict()
        assert all(torch.equal(v, start[k]) for k, v in runs["offload"]["reference"].items())


def test_sync_ref_model_is_refused_by_name(tmp_path) -> None:
    from offload.integrations.hf import OffloadTrainerMixin

    class OffloadDPOTrainer(OffloadTrainerMixin, trl.DPOTrainer):
        pass

    args = trl.DPOConfig(per_device_train_batch_size=2, sync_ref_model=True, **common_args("plain", str(tmp_path)))
    t = OffloadDPOTrainer(tiny_model("llama"), tiny_model("llama"), args, train_dataset=preference_data(),
                          processing_class=tokenizer(), offload_config={"compute_device": "cpu"})
    with pytest.raises(NotImplementedError, match="sync_ref_model=False"):
        t.train()
    t.engine.close()


def test_arguments_given_twice_or_too_many_are_refused(tmp_path) -> None:
    from offload.integrations.hf import OffloadTrainerMixin

    class OffloadDPOTrainer(OffloadTrainerMixin, trl.DPOTrainer):
        pass

    args = trl.DPOConfig(**common_args("plain", str(tmp_path)))
    with pytest.raises(TypeError, match="multiple values for args"):
        OffloadDPOTrainer(tiny_model("llama"), None, args, args=args)
    with pytest.raises(TypeError, match="positional arguments"):
        OffloadDPOTrainer(*([None] * 20))


# -- GRPOTrainer: sampled completions, a toy reward ------------------------------------------------


def even_tokens(completions: list[str], **kw: Any) -> list[float]:
    """The toy reward: how many of the completion's tokens are even."""
    return [float(sum(int(w[1:]) % 2 == 0 for w in c.split())) for c in completions]


def grpo_run(variant: str, outdir: str, reward: Callable[..., list[float]] = even_tokens) -> dict[str, Any]:
    """8 prompts, 4 completions of 6 tokens each, micro-batches of 4, 2 accumulation steps:
    4 updates. The completions are sampled; the float64 and fp32 runs sample the same ones
    (checked: the logged rewards are equal), so their weights are comparable."""
    from offload.integrations.hf import OffloadTrainerMixin

    class OffloadGRPOTrainer(OffloadTrainerMixin, trl.GRPOTrainer):
        pass

    g = torch.Generator().manual_seed(3)
    ds = datasets.Dataset.from_list([{"prompt": words(g, 6)} for _ in range(8)])
    args = trl.GRPOConfig(per_device_train_batch_size=4, num_generations=4, max_completion_length=6,
                          shuffle_dataset=False, **common_args(variant, outdir))
    model = tiny_model("llama", torch.float64 if variant == "truth" else torch.float32)
    if variant == "offload":
        t = OffloadGRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=ds, processing_class=tokenizer(),
                               offload_config={"compute_device": "cpu"})
        t.train()
        assert t.engine.global_steps == t.state.global_step == 4
        weights = t.engine.full_state_dict()
        t.engine.close()
    else:
        t = trl.GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=ds,
                            processing_class=tokenizer())
        t.train()
        weights = weights_of(model, variant)
    rewards = [h["reward"] for h in t.state.log_history if "reward" in h]
    return {"weights": weights, "rewards": rewards}


def test_grpo_trainer_with_the_mixin_matches_plain_trl(tmp_path) -> None:
    runs = {v: grpo_run(v, str(tmp_path / v)) for v in ("truth", *FP32_VARIANTS, "offload")}
    rewards = {v: r["rewards"] for v, r in runs.items()}
    assert len(rewards["truth"]) == 4 and all(r == rewards["truth"] for r in rewards.values()), rewards
    bound = check({v: r["weights"] for v, r in runs.items()}, "TRL GRPOTrainer + OffloadTrainerMixin")
    # Negative control: the reward's sign flipped (the update's direction reversed).
    worst, _, _ = bound.worst(grpo_run("plain", str(tmp_path / "control"),
                                       reward=lambda completions, **kw: [-r for r in even_tokens(completions)])["weights"])
    assert worst > 100, f"the GRPO negative control is only {worst:.3g}x the bound"
