"""DeepSpeed configs as Hugging Face users write them: "auto" filled from TrainingArguments
(offload.integrations.hf.resolve_auto), then read by offload.load_config; and the one error
load_config gives for "auto" left unresolved."""

from __future__ import annotations

import copy
import json
import warnings
from types import SimpleNamespace

import pytest

from offload.config import ConfigError, DeepSpeedConfigWarning, load_config
from offload.integrations.hf import resolve_auto

STEPS = 100
HIDDEN = 64


def _hf_zero3(scheduler: str = "WarmupLR", device: str = "cpu", nvme_path: str = "") -> dict:
    """The Hugging Face docs' ZeRO-3 example config (every value it leaves "auto")."""
    sched_params = {"WarmupLR": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                 "warmup_num_steps": "auto"},
                    "WarmupDecayLR": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                      "warmup_num_steps": "auto", "total_num_steps": "auto"},
                    "WarmupCosineLR": {"warmup_num_steps": "auto", "total_num_steps": "auto"}}[scheduler]
    tier = {"device": device, "pin_memory": True, **({"nvme_path": nvme_path} if device == "nvme" else {})}
    return {
        "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000,
                 "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
        "bf16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                  "weight_decay": "auto"}},
        "scheduler": {"type": scheduler, "params": sched_params},
        "zero_optimization": {
            "stage": 3, "offload_optimizer": dict(tier), "offload_param": dict(tier),
            "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
            "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
            "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True},
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
        "wall_clock_breakdown": False,
    }


def _plain_args(**overrides) -> SimpleNamespace:
    """The TrainingArguments fields resolve_auto reads (it never imports transformers)."""
    fields = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, world_size=1,
                  max_grad_norm=0.5, learning_rate=3e-4, adam_beta1=0.9, adam_beta2=0.999,
                  adam_epsilon=1e-8, weight_decay=0.01, fp16=False, bf16=True, warmup_steps=0.1)
    fields.update(overrides)
    return SimpleNamespace(**fields)


def _model() -> SimpleNamespace:
    return SimpleNamespace(config=SimpleNamespace(hidden_size=HIDDEN))


def _training_args(tmp_path, **overrides):
    transformers = pytest.importorskip("transformers", reason="the Hugging Face extra is not installed")
    pytest.importorskip("accelerate", reason="transformers.TrainingArguments needs accelerate >= 1.1")
    kwargs = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4,
                  gradient_accumulation_steps=2, learning_rate=3e-4, max_grad_norm=0.5,
                  weight_decay=0.01, warmup_steps=0.1, bf16=True, report_to=[], use_cpu=True)
    kwargs.update(overrides)
    return transformers.TrainingArguments(**kwargs)


def _load_quietly(ds):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeepSpeedConfigWarning)  # the ignored bucket keys
        return load_config(ds, world_size=1)


def _assert_matches_args(resolved: dict, config, args) -> None:
    """The resolved DeepSpeed values and the loaded Config's fields equal the arguments'."""
    assert resolved["train_micro_batch_size_per_gpu"] == args.per_device_train_batch_size
    assert resolved["gradient_accumulation_steps"] == args.gradient_accumulation_steps
    assert resolved["train_batch_size"] == (args.world_size * args.per_device_train_batch_size
                                            * args.gradient_accumulation_steps)
    assert config.gradient_accumulation_steps == args.gradient_accumulation_steps
    assert config.train_micro_batch_size_per_gpu == args.per_device_train_batch_size
    assert config.gradient_clipping == args.max_grad_norm
    assert config.optimizer.type == "AdamW"
    assert config.optimizer.lr == args.learning_rate
    assert config.optimizer.betas == (args.adam_beta1, args.adam_beta2)
    assert config.optimizer.eps == args.adam_epsilon
    assert config.optimizer.weight_decay == args.weight_decay
    assert config.precision.dtype == ("bf16" if args.bf16 else "fp16" if args.fp16 else "fp32")


@pytest.mark.parametrize("scheduler", ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"])
@pytest.mark.parametrize("device", ["cpu", "nvme"])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_hf_zero3_config_resolves_and_loads(tmp_path, scheduler, device, precision):
    args = _plain_args(bf16=precision == "bf16", fp16=precision == "fp16")
    ds = _hf_zero3(scheduler, device, str(tmp_path))
    original = copy.deepcopy(ds)
    resolved = resolve_auto(ds, args, num_training_steps=STEPS, model=_model())
    assert ds == original, "the caller's dict is not modified"
    config = _load_quietly(resolved)
    _assert_matches_args(resolved, config, args)
    params = config.scheduler.params
    assert config.scheduler.type == scheduler
    assert params["warmup_num_steps"] == 10  # ceil(0.1 x 100), transformers' get_warmup_steps
    if scheduler != "WarmupLR":
        assert params["total_num_steps"] == STEPS
    if scheduler != "WarmupCosineLR":
        assert (params["warmup_min_lr"], params["warmup_max_lr"]) == (0, args.learning_rate)
    zero = resolved["zero_optimization"]
    assert (zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"],
            zero["stage3_param_persistence_threshold"]) == (HIDDEN ** 2, int(0.9 * HIDDEN ** 2), 10 * HIDDEN)
    # stage3_prefetch_bucket_size is the one offload reads: elements x bytes of the 16-bit dtype.
    assert config.prefetch.prefetch_bytes == int(0.9 * HIDDEN ** 2) * 2
    assert config.offload.param_tier == config.offload.optimizer_tier == device
    assert "zero_optimization.reduce_bucket_size" in config.ignored_keys
    if device == "nvme":
        assert config.offload.nvme_path == str(tmp_path)


def test_a_json_path_is_read_and_warmup_steps_as_a_count_needs_no_length(tmp_path):
    path = tmp_path / "ds.json"
    ds = _hf_zero3("WarmupLR")
    path.write_text(json.dumps(ds))
    resolved = resolve_auto(path, _plain_args(warmup_steps=7), model=_model())
    assert resolved["scheduler"]["params"]["warmup_num_steps"] == 7
    # No warmup at all is kept at one step, as transformers does (DeepSpeed rejects 0).
    resolved = resolve_auto(ds, _plain_args(warmup_steps=0), num_training_steps=STEPS, model=_model())
    assert resolved["scheduler"]["params"]["warmup_num_steps"] == 1


def test_training_arguments_resolve_into_a_config_with_their_values(tmp_path):
    args = _training_args(tmp_path)
    resolved = resolve_auto(_hf_zero3("WarmupDecayLR"), args, num_training_steps=STEPS, model=_model())
    config = _load_quietly(resolved)
    _assert_matches_args(resolved, config, args)
    assert config.scheduler.params["warmup_num_steps"] == args.get_warmup_steps(STEPS) == 10


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_same_resolution_as_transformers_own(tmp_path, precision):
    pytest.importorskip("deepspeed", reason="transformers' HfTrainerDeepSpeedConfig needs DeepSpeed")
    args = _training_args(tmp_path, bf16=precision == "bf16", fp16=precision == "fp16")
    from transformers import AutoConfig  # a real model config: transformers reads its hidden size
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig, unset_hf_deepspeed_config

    model = SimpleNamespace(config=AutoConfig.for_model("llama", hidden_size=HIDDEN))
    ds = _hf_zero3("WarmupDecayLR")
    theirs = HfTrainerDeepSpeedConfig(ds)
    try:
        theirs.trainer_config_process(args)
        theirs.trainer_config_finalize(args, model, STEPS)
        expected = theirs.config
    finally:
        # It registers itself globally (is_deepspeed_zero3_enabled); leave no trace for other tests.
        del theirs
        unset_hf_deepspeed_config()
    assert resolve_auto(ds, args, num_training_steps=STEPS, model=model) == expected


def test_conflicting_values_are_refused_together_with_both_values():
    ds = _hf_zero3("WarmupDecayLR")
    ds["train_micro_batch_size_per_gpu"] = 8
    ds["optimizer"]["params"]["lr"] = 1e-3
    ds["bf16"]["enabled"] = False
    ds["scheduler"]["params"]["total_num_steps"] = 50
    ds["gradient_clipping"] = 0.5  # agrees: not reported
    with pytest.raises(ConfigError) as info:
        resolve_auto(ds, _plain_args(), num_training_steps=STEPS, model=_model())
    message = str(info.value)
    assert info.value.key == "train_micro_batch_size_per_gpu"
    assert "4 DeepSpeed value(s)" in message
    for fragment in ("train_micro_batch_size_per_gpu = 8, but TrainingArguments per_device_train_batch_size = 4",
                     "optimizer.params.lr = 0.001, but TrainingArguments learning_rate = 0.0003",
                     "bf16.enabled = False, but TrainingArguments bf16 or bf16_full_eval = True",
                     "scheduler.params.total_num_steps = 50, but TrainingArguments num_training_steps = 100",
                     '"auto"'):
        assert fragment in message, message
    assert "gradient_clipping" not in message
    # Negative control: values that agree (a tuple of betas included) are accepted.
    ds = _hf_zero3("WarmupDecayLR")
    ds["train_micro_batch_size_per_gpu"], ds["optimizer"]["params"]["betas"] = 4, (0.9, 0.999)
    assert resolve_auto(ds, _plain_args(), num_training_steps=STEPS, model=_model())["train_batch_size"] == 8


def test_keys_needing_the_model_or_the_length_name_what_to_pass():
    with pytest.raises(ConfigError) as info:
        resolve_auto(_hf_zero3("WarmupDecayLR"), _plain_args())
    message = str(info.value)
    for fragment in ("pass model=", "zero_optimization.stage3_prefetch_bucket_size",
                     "pass num_training_steps=", "scheduler.params.total_num_steps",
                     "scheduler.params.warmup_num_steps"):
        assert fragment in message, message
    with pytest.raises(ConfigError, match="hidden_size"):
        resolve_auto(_hf_zero3(), _plain_args(), num_training_steps=STEPS, model=SimpleNamespace(config=None))


def test_load_config_lists_every_unresolved_auto_in_one_error():
    ds = _hf_zero3("WarmupDecayLR")
    ds["data_types"] = {"keep_in_fp32_modules": "auto"}  # DeepSpeed's own "auto": not reported
    with pytest.raises(ConfigError) as info:
        load_config(ds, world_size=1)
    message = str(info.value)
    assert info.value.key == "fp16.enabled"
    assert "offload.integrations.hf.resolve_auto" in message
    expected = ["bf16.enabled", "optimizer.params.lr", "optimizer.params.betas", "scheduler.params.total_num_steps",
                "zero_optimization.reduce_bucket_size", "gradient_accumulation_steps", "train_batch_size",
                "train_micro_batch_size_per_gpu", "gradient_clipping"]
    for key in expected:
        assert key in message, message
    assert "keep_in_fp32_modules" not in message
    # Resolved, the same config loads.
    _load_quietly(resolve_auto(ds, _plain_args(), num_training_steps=STEPS, model=_model()))
