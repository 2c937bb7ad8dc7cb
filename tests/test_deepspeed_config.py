"""DeepSpeed configs translated into offload's Config: the documented examples map to the
expected Config; harmless keys are reported by name; keys that would change training,
removed, unknown or misspelt keys and impossible combinations are errors naming the key."""

from __future__ import annotations

import copy
import json
import sys
import warnings

import pytest
import yaml

from offload.config import (
    AIOConfig,
    Config,
    ConfigError,
    DeepSpeedConfigWarning,
    LoggingConfig,
    OffloadConfig,
    OptimizerConfig,
    PrecisionConfig,
    PrefetchConfig,
    SchedulerConfig,
    load_config,
)
from offload.config.deepspeed import translate_deepspeed

# ZeRO-3 with parameters and optimizer states offloaded to CPU memory (ZeRO-Offload), as in
# DeepSpeed's ZeRO-3 Offload examples.
ZERO_OFFLOAD_CPU = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW",
                  "params": {"lr": 3e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupLR",
                  "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-5, "warmup_num_steps": 500}},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": 5e8,
        "stage3_prefetch_bucket_size": 5e7,
        "stage3_param_persistence_threshold": 1e5,
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "steps_per_print": 100,
    "wall_clock_breakdown": False,
}

# ZeRO-Infinity: parameters and optimizer states on NVMe, fp16 with dynamic loss scaling.
ZERO_INFINITY_NVME = {
    "train_batch_size": 64,
    "train_micro_batch_size_per_gpu": 8,
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 1000,
             "hysteresis": 2, "min_loss_scale": 1},
    "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                             "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupDecayLR",
                  "params": {"total_num_steps": 10000, "warmup_min_lr": 0, "warmup_max_lr": 1e-4,
                             "warmup_num_steps": 1000}},
    "zero_optimization": {
        "stage": 3,
        "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True,
                          "buffer_count": 5, "buffer_size": 1e8, "max_in_cpu": 1e9},
        "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True,
                              "buffer_count": 4, "fast_init": False},
        "sub_group_size": 1e8,
        "stage3_prefetch_bucket_size": 2e7,
        "stage3_max_reuse_distance": 0,
    },
    "aio": {"block_size": 1048576, "queue_depth": 16, "intra_op_parallelism": 2,
            "single_submit": False, "overlap_events": True},
    "gradient_clipping": 1.0,
}


def _translate(ds, **kwargs) -> Config:
    """Translate, swallowing the (separately tested) report warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeepSpeedConfigWarning)
        return translate_deepspeed(ds, world_size=kwargs.pop("world_size", 1), **kwargs)


def _ds(**extra):
    base = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
    for key, value in extra.items():
        if key == "zero":
            base["zero_optimization"].update(value)
        else:
            base[key] = value
    return base


def _error(ds, world_size=1) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        _translate(ds, world_size=world_size)
    return info.value


# ---- the documented examples ---------------------------------------------------------------

def test_zero_offload_cpu_example_translates_to_the_expected_config():
    config = _translate(ZERO_OFFLOAD_CPU)
    assert config == Config(
        offload=OffloadConfig(param_tier="cpu", optimizer_tier="cpu", pin_memory=True),
        optimizer=OptimizerConfig(type="AdamW", lr=3e-5, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01),
        scheduler=SchedulerConfig(type="WarmupLR",
                                  params={"warmup_min_lr": 0.0, "warmup_max_lr": 3e-5, "warmup_num_steps": 500}),
        precision=PrecisionConfig(dtype="bf16"),
        # DeepSpeed counts elements; offload bytes of the bf16 compute dtype.
        prefetch=PrefetchConfig(prefetch_bytes=5e7 * 2, keep_bytes=1e9 * 2),
        gradient_clipping=1.0,
        gradient_accumulation_steps=2,
        train_micro_batch_size_per_gpu=4,
        logging=LoggingConfig(steps_per_print=100, print_unconfigured=True),  # the step report (tests/test_logging.py)
    )
    assert config.ignored_keys == (
        "zero_optimization.contiguous_gradients",
        "zero_optimization.overlap_comm", "zero_optimization.reduce_bucket_size",
        "zero_optimization.stage3_max_live_parameters",
        "zero_optimization.stage3_param_persistence_threshold", "zero_optimization.sub_group_size",
    )
    assert config.notes == ()


def test_zero_infinity_nvme_example_translates_to_the_expected_config():
    config = _translate(ZERO_INFINITY_NVME)
    assert config == Config(
        # Pinned budget (see [Note: pinned budget from DeepSpeed buffers]): parameters
        # 5 x 1e8 fp16 elements, optimizer 4 x sub_group_size 1e8 fp32 elements.
        offload=OffloadConfig(param_tier="nvme", optimizer_tier="nvme", nvme_path="/local_nvme",
                              pin_memory=True, pinned_budget_bytes=5 * 10**8 * 2 + 4 * 10**8 * 4),
        # DeepSpeed's "Adam" with adam_w_mode left at its default (true) is AdamW.
        optimizer=OptimizerConfig(type="AdamW", lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1),
        scheduler=SchedulerConfig(type="WarmupDecayLR",
                                  params={"total_num_steps": 10000, "warmup_min_lr": 0.0,
                                          "warmup_max_lr": 1e-4, "warmup_num_steps": 1000}),
        precision=PrecisionConfig(dtype="fp16", loss_scale=0.0, initial_scale_power=12, loss_scale_window=1000,
                                  hysteresis=2, min_loss_scale=1.0),
        aio=AIOConfig(block_size=1 << 20, queue_depth=16, threads=2),
        prefetch=PrefetchConfig(prefetch_bytes=2e7 * 2, keep_bytes=0),
        gradient_clipping=1.0,
        gradient_accumulation_steps=8,  # 64 / 8 / world size 1, as DeepSpeed derives it
        train_micro_batch_size_per_gpu=8,
    )
    assert set(config.ignored_keys) == {
        "aio.overlap_events", "aio.single_submit", "zero_optimization.offload_optimizer.fast_init",
        "zero_optimization.offload_param.max_in_cpu"}


def test_examples_are_configs_deepspeed_itself_accepts():
    ds_config = pytest.importorskip("deepspeed.runtime.config")
    for example in (ZERO_OFFLOAD_CPU, ZERO_INFINITY_NVME):
        parsed = ds_config.DeepSpeedConfig(copy.deepcopy(example))
        ours = _translate(example)
        assert parsed.zero_optimization_stage == 3
        assert parsed.gradient_accumulation_steps == ours.gradient_accumulation_steps
        assert parsed.train_micro_batch_size_per_gpu == ours.train_micro_batch_size_per_gpu


def test_translation_round_trips_through_offloads_own_format(tmp_path):
    config = _translate(ZERO_INFINITY_NVME)
    path = tmp_path / "offload.yaml"
    path.write_text(yaml.safe_dump(config.to_dict()))
    assert load_config(path) == config


@pytest.mark.parametrize("suffix,dump", [(".json", json.dumps), (".yaml", yaml.safe_dump), ("", json.dumps)])
def test_deepspeed_files_are_detected_and_translated(tmp_path, suffix, dump):
    path = tmp_path / f"ds_config{suffix}"
    path.write_text(dump(ZERO_OFFLOAD_CPU))
    expected = _translate(ZERO_OFFLOAD_CPU)
    with pytest.warns(DeepSpeedConfigWarning):
        assert load_config(path, world_size=1) == expected
    with pytest.warns(DeepSpeedConfigWarning):
        assert Config.from_deepspeed(path, world_size=1) == expected
    with pytest.warns(DeepSpeedConfigWarning):
        assert Config.from_file(path, world_size=1) == expected


def test_load_config_detects_a_deepspeed_dict():
    with pytest.warns(DeepSpeedConfigWarning):
        assert load_config(ZERO_OFFLOAD_CPU, world_size=1) == _translate(ZERO_OFFLOAD_CPU)


# ---- reporting ----------------------------------------------------------------------------

def test_ignored_keys_are_reported_once_by_name_with_the_reason():
    ds = _ds(flops_profiler={"enabled": False}, comet={"enabled": False}, zero={"overlap_comm": True})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = translate_deepspeed(ds, world_size=1)
    reports = [w for w in caught if issubclass(w.category, DeepSpeedConfigWarning)]
    assert len(reports) == 1
    text = str(reports[0].message)
    assert "3 valid DeepSpeed key(s) are not honoured" in text
    assert "flops_profiler: offload has no FLOPs profiler; use torch.profiler" in text
    assert "comet: offload has no Comet monitor" in text
    assert "zero_optimization.overlap_comm: offload always overlaps communication" in text
    assert reports[0].filename == __file__  # points at the caller, not at offload's internals
    assert config.ignored_keys == ("comet", "flops_profiler", "zero_optimization.overlap_comm")


@pytest.mark.parametrize("library", ["transformers.trainer", "accelerate.accelerator", "trl.trainer.dpo_trainer"])
def test_the_report_names_the_users_call_through_a_library_that_calls_offload(library):
    # The Trainer translates the config inside `trainer.train()`: the warning named
    # transformers/trainer.py's line instead of the user's. A function of a module named as
    # the library's (the frames between the user and offload) stands in for it.
    ns: dict = {"__name__": library, "translate_deepspeed": translate_deepspeed}
    exec(compile("def train(ds):\n    return translate_deepspeed(ds, world_size=1)\n",
                 f"/site-packages/{library.replace('.', '/')}.py", "exec"), ns)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = sys._getframe().f_lineno + 1
        ns["train"](_ds(comet={"enabled": False}))
    (report,) = [w for w in caught if issubclass(w.category, DeepSpeedConfigWarning)]
    assert (report.filename, report.lineno) == (__file__, line)


def test_a_users_own_module_between_is_the_call_named():
    # Negative control: a module that is not a library calling on the user's behalf is the
    # user's code, and the warning names its line.
    ns: dict = {"__name__": "my_training_lib", "translate_deepspeed": translate_deepspeed}
    exec(compile("def train(ds):\n    return translate_deepspeed(ds, world_size=1)\n", "/home/me/my_training_lib.py",
                 "exec"), ns)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ns["train"](_ds(comet={"enabled": False}))
    (report,) = [w for w in caught if issubclass(w.category, DeepSpeedConfigWarning)]
    assert (report.filename, report.lineno) == ("/home/me/my_training_lib.py", 2)


def test_nothing_to_report_means_no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = translate_deepspeed(_ds(), world_size=1)
    assert config.ignored_keys == () and config.notes == ()


@pytest.mark.parametrize("key", ["stage3_gather_16bit_weights_on_model_save",
                                 "gather_16bit_weights_on_model_save"])
def test_gathering_16bit_weights_on_save_is_honoured_not_ignored(key):
    """True is what offload always does (save_16bit_model and the Trainer's save_model write
    the consolidated weights): no report, which inside the Trainer used to say "use
    engine.full_state_dict()", misleading there. False gets a note that they are written anyway."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = translate_deepspeed(_ds(zero={key: True}), world_size=1)
    assert config.ignored_keys == () and config.notes == ()
    with pytest.warns(DeepSpeedConfigWarning, match="always write the consolidated weights"):
        config = translate_deepspeed(_ds(zero={key: False}), world_size=1)
    assert config.ignored_keys == () and len(config.notes) == 1 and key in config.notes[0]


def test_optimizer_offload_missing_maps_to_cpu_with_a_note():
    # (offload_optimizer.device 'none' said explicitly, or with offload_param set, keeps the
    # state on the device: tests/test_update_split.py)
    with pytest.warns(DeepSpeedConfigWarning, match="offload keeps the optimizer states in CPU memory"):
        config = translate_deepspeed({"zero_optimization": {"stage": 3}}, world_size=1)
    assert config.offload.optimizer_tier == "cpu"
    assert config.offload.param_tier == "device"  # no offload_param: parameters stay on the device
    assert len(config.notes) == 1 and "optimizer_tier is 'cpu'" in config.notes[0]


def test_ignored_and_notes_do_not_affect_equality():
    with_report = _translate(_ds(memory_breakdown=True))
    assert with_report.ignored_keys and with_report == _translate(_ds())


# ---- mapping details ------------------------------------------------------------------------

@pytest.mark.parametrize("ds_type,params,want_type,want_wd", [
    ("Adam", {}, "AdamW", 0.0),                                   # adam_w_mode defaults to true
    ("Adam", {"adam_w_mode": False}, "Adam", 0.0),                # L2 Adam
    ("AdamW", {"adam_w_mode": False}, "AdamW", 0.0),              # AdamW ignores adam_w_mode
    ("adamw", {}, "AdamW", 0.0),                                  # names are case-insensitive
    ("ADAM", {"adam_w_mode": False}, "Adam", 0.0),
    ("AdamW", {"torch_adam": True}, "AdamW", 0.01),               # torch.optim.AdamW's default
    ("Adam", {"torch_adam": True, "adam_w_mode": False}, "Adam", 0.0),  # torch.optim.Adam's
    ("Adam", {"weight_decay": 0.05, "adam_w_mode": False}, "Adam", 0.05),
])
def test_adam_variants_follow_deepspeeds_semantics(ds_type, params, want_type, want_wd):
    config = _translate(_ds(optimizer={"type": ds_type, "params": params}))
    assert config.optimizer.type == want_type
    assert config.optimizer.weight_decay == want_wd
    assert config.optimizer.lr == 1e-3  # DeepSpeed's Adam default


def test_offload_param_devices_map_to_tiers(tmp_path):
    for device, tier in (("none", "device"), ("cpu", "cpu"), ("nvme", "nvme")):
        config = _translate(_ds(zero={"offload_param": {"device": device, "nvme_path": str(tmp_path)}}))
        assert config.offload.param_tier == tier


def test_one_nvme_tier_takes_its_path_and_budget():
    config = _translate(_ds(zero={"offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"}}))
    assert config.offload == OffloadConfig(param_tier="device", optimizer_tier="nvme", nvme_path="/nvme",
                                           pinned_budget_bytes=OffloadConfig.pinned_budget_bytes)
    config = _translate(_ds(bf16={"enabled": True}, zero={
        "offload_param": {"device": "nvme", "nvme_path": "/nvme", "buffer_count": 3, "buffer_size": 1000}}))
    assert config.offload.pinned_budget_bytes == 3 * 1000 * 2


def test_pin_memory_false_anywhere_wins_and_a_difference_is_noted():
    config = _translate(_ds(zero={"offload_param": {"device": "cpu", "pin_memory": True},
                                  "offload_optimizer": {"device": "cpu", "pin_memory": False}}))
    assert config.offload.pin_memory is False
    assert any("pin_memory differs" in note for note in config.notes)


def test_deprecated_cpu_offload_flags_map_like_deepspeed():
    config = _translate({"zero_optimization": {"stage": 3, "cpu_offload": True, "cpu_offload_param": True,
                                               "cpu_offload_use_pin_memory": False}})
    assert (config.offload.optimizer_tier, config.offload.param_tier, config.offload.pin_memory) == (
        "cpu", "cpu", False)
    assert config.notes == ()


def test_stage3_aliases_are_accepted_under_either_name():
    a = _translate(_ds(zero={"stage3_prefetch_bucket_size": 1000, "stage3_max_reuse_distance": 10}))
    b = _translate(_ds(zero={"prefetch_bucket_size": 1000, "max_reuse_distance": 10}))
    assert a == b and a.prefetch == PrefetchConfig(prefetch_bytes=4000, keep_bytes=40)


def test_fp16_settings_map_to_precision():
    config = _translate(_ds(fp16={"enabled": True, "loss_scale": 128, "hysteresis": 4}))
    assert config.precision == PrecisionConfig(dtype="fp16", loss_scale=128.0, hysteresis=4)


def test_disabled_precision_sections_are_fp32_and_not_reported():
    config = _translate(_ds(fp16={"enabled": False, "loss_scale": 0}, bf16={"enabled": False}))
    assert config.precision.dtype == "fp32" and config.ignored_keys == ()


def test_legacy_bfloat16_name_is_read():
    assert _translate(_ds(bfloat16={"enabled": True})).precision.dtype == "bf16"


def test_aio_legacy_thread_count_maps_to_threads():
    assert _translate(_ds(aio={"thread_count": 3})).aio.threads == 3


@pytest.mark.parametrize("given,world,want_accum,want_micro", [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2, 4, 4),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 4, 2, 4),
    ({"train_batch_size": 32}, 4, 1, 8),
    ({"train_micro_batch_size_per_gpu": 4}, 8, None, 4),
    ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}, 2, 4, 2),
])
def test_batch_sizes_follow_deepspeeds_arithmetic(given, world, want_accum, want_micro):
    config = _translate(_ds(**given), world_size=world)
    assert config.gradient_accumulation_steps == (want_accum or 1)
    assert config.train_micro_batch_size_per_gpu == want_micro


def test_world_size_defaults_to_the_launchers_environment(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeepSpeedConfigWarning)
        config = translate_deepspeed(_ds(train_batch_size=32, train_micro_batch_size_per_gpu=2))
    assert config.gradient_accumulation_steps == 4


@pytest.mark.parametrize("given", [
    {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4},
    {"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4},
    {"train_batch_size": 12, "gradient_accumulation_steps": 5},
    {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2},
])
def test_batch_arithmetic_agrees_with_deepspeed_itself(given):
    ds_config = pytest.importorskip("deepspeed.runtime.config")
    ds = _ds(**given)
    try:
        theirs = ds_config.DeepSpeedConfig(copy.deepcopy(ds))  # world size 1 without a process group
    except AssertionError:
        with pytest.raises(ConfigError, match="train_batch_size"):
            _translate(ds)
        return
    ours = _translate(ds)
    assert ours.gradient_accumulation_steps == theirs.gradient_accumulation_steps
    assert ours.train_micro_batch_size_per_gpu == theirs.train_micro_batch_size_per_gpu


# ---- errors ---------------------------------------------------------------------------------

@pytest.mark.parametrize("ds,key,fragments", [
    # ZeRO stage
    ({"zero_optimization": {"stage": 0}}, "zero_optimization.stage",
     ["= 0 is not supported", "stages 1, 2 and 3", 'set "stage": 2']),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, "zero_optimization.offload_param",
     ["needs stage 3", "stage is 2"]),
    ({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}}, "zero_optimization",
     ["is missing", "stage 0", '"stage": 2']),
    ({"zero_optimization": {"offload_param": {"device": "cpu"}}}, "zero_optimization.stage", ["= 0"]),
    # unknown / misspelt keys, at every level, with the closest valid key
    (_ds(zero={"overlap_com": True}), "zero_optimization.overlap_com", ["did you mean 'overlap_comm'"]),
    (_ds(zero={"offload_param": {"device": "cpu", "pin_memmory": True}}),
     "zero_optimization.offload_param.pin_memmory", ["did you mean 'pin_memory'"]),
    (_ds(optimizer={"type": "AdamW", "params": {"weight_decy": 0.1}}), "optimizer.params.weight_decy",
     ["did you mean 'weight_decay'"]),
    (_ds(fp16={"enabled": True, "initial_scale_pow": 8}), "fp16.initial_scale_pow",
     ["did you mean 'initial_scale_power'"]),
    (_ds(aio={"queue_dept": 8}), "aio.queue_dept", ["did you mean 'queue_depth'"]),
    (_ds(gradient_clip=1.0), "gradient_clip", ["did you mean 'gradient_clipping'"]),
    (_ds(scheduler={"type": "WarmupLR", "params": {"warmup_max": 0.1}}), "scheduler.params.warmup_max",
     ["did you mean 'warmup_max_lr'"]),
    # values
    (_ds(zero={"offload_param": {"device": "disk"}}), "zero_optimization.offload_param.device",
     ["'none', 'cpu', 'nvme'"]),
    (_ds(zero={"offload_optimizer": {"device": "nvme"}}), "zero_optimization.offload_optimizer.nvme_path",
     ["required when its device is 'nvme'", "local NVMe disk"]),
    (_ds(zero={"offload_param": {"device": "nvme"}}), "zero_optimization.offload_param.nvme_path",
     ["required"]),
    (_ds(zero={"offload_param": {"device": "nvme", "nvme_path": "/a"},
               "offload_optimizer": {"device": "nvme", "nvme_path": "/b"}}),
     "zero_optimization.offload_optimizer.nvme_path", ["differs", "same directory"]),
    (_ds(optimizer={"type": "AdamW", "params": {"lr": -0.1}}), "optimizer.params.lr",
     ["-0.1", ">= 0", "non-negative"]),
    (_ds(optimizer={"type": "AdamW", "params": {"betas": [0.9, 1.2]}}), "optimizer.params.betas[1]",
     ["[0, 1)"]),
    (_ds(fp16={"enabled": True, "loss_scale": -4}), "fp16.loss_scale", [">= 0"]),
    (_ds(fp16={"enabled": True, "loss_scale_window": 0}), "fp16.loss_scale_window", [">= 1"]),
    (_ds(fp16={"enabled": True}, bf16={"enabled": True}), "fp16.enabled",
     ["bf16.enabled are both true", "at most one"]),
    (_ds(fp16={"enabled": "yes"}), "fp16.enabled", ["true or false"]),
    (_ds(gradient_clipping=-1.0), "gradient_clipping", [">= 0"]),
    (_ds(aio={"block_size": 1000}), "aio.block_size", ["multiple of 4096"]),
    (_ds(aio={"intra_op_parallelism": 0}), "aio.intra_op_parallelism", ["at least one"]),
    (_ds(aio={"thread_count": 2, "intra_op_parallelism": 2}), "aio.thread_count", ["both given"]),
    (_ds(zero={"offload_param": {"device": "nvme", "nvme_path": "/n", "buffer_count": 0}}),
     "zero_optimization.offload_param.buffer_count", [">= 1"]),
    (_ds(zero={"stage3_prefetch_bucket_size": -1}), "zero_optimization.stage3_prefetch_bucket_size",
     [">= 0"]),
    (_ds(train_micro_batch_size_per_gpu="auto"), "train_micro_batch_size_per_gpu",
     ["'auto'", "Hugging Face Trainer"]),
    (_ds(train_batch_size=10, train_micro_batch_size_per_gpu=3), "train_batch_size",
     ["does not equal", "(3) x gradient_accumulation_steps (3) x world size (1)"]),
    (_ds(gradient_accumulation_steps=0), "gradient_accumulation_steps", [">= 1"]),
    # keys that would change training
    (_ds(optimizer={"type": "Lamb", "params": {}}), "optimizer.type", ["'Lamb' is not supported", "'AdamW'"]),
    (_ds(optimizer={"params": {"lr": 1e-3}}), "optimizer.type", ["is missing"]),
    (_ds(optimizer={"type": "AdamW", "params": {"amsgrad": True}}), "optimizer.params.amsgrad", ["AMSGrad"]),
    (_ds(optimizer={"type": "AdamW", "params": {"bias_correction": False}}), "optimizer.params.bias_correction",
     ["always applies bias correction"]),
    (_ds(optimizer={"type": "AdamW", "params": {"max_grad_norm": 1.0}}), "optimizer.params.max_grad_norm",
     ["gradient_clipping"]),
    (_ds(optimizer={"type": "AdamW", "params": {"fp32_optimizer_states": False}}),
     "optimizer.params.fp32_optimizer_states", ["moments in fp32"]),
    (_ds(scheduler={"type": "OneCycle", "params": {}}), "scheduler.type",
     ["'OneCycle' is not supported", "lr_scheduler="]),
    (_ds(scheduler={"type": "WarmupCosineLR", "params": {}}), "scheduler.params.total_num_steps", ["is missing"]),
    (_ds(fp16={"enabled": True, "auto_cast": True}), "fp16.auto_cast", ["does not cast"]),
    (_ds(fp16={"enabled": True, "fp16_master_weights_and_grads": True}),
     "fp16.fp16_master_weights_and_grads", ["always fp32"]),
    (_ds(bf16={"enabled": True, "bf16_master_weights_and_grads": True}),
     "bf16.bf16_master_weights_and_grads", ["always fp32"]),
    (_ds(bf16={"enabled": True, "bf16_optimizer_states": True}), "bf16.bf16_optimizer_states",
     ["moments_dtype"]),
    (_ds(zero={"zero_quantized_weights": True}), "zero_optimization.zero_quantized_weights", ["numerics"]),
    (_ds(zero={"zero_quantized_gradients": True}), "zero_optimization.zero_quantized_gradients", ["numerics"]),
    (_ds(zero={"zenflow": {"topk_ratio": 0.1}}), "zero_optimization.zenflow", ["stale"]),
    (_ds(torch_autocast={"enabled": True}), "torch_autocast.enabled", ["autocast"]),
    (_ds(gradient_allreduce_op="sum"), "gradient_allreduce_op", ["averages"]),
    (_ds(managed_gradient_accumulation=False), "managed_gradient_accumulation", ["accumulation boundary"]),
    (_ds(data_types={"grad_accum_dtype": "bf16"}), "data_types.grad_accum_dtype", ["fp32"]),
    (_ds(tensor_parallel={"autotp_size": 2}), "tensor_parallel.autotp_size", ["tensor parallelism"]),
    (_ds(weight_quantization={"post_init_quant": {}}), "weight_quantization", ["quantised weights"]),
    # removed from DeepSpeed itself
    (_ds(amp={"enabled": True}), "amp", ["removed from DeepSpeed"]),
    (_ds(zero={"mics_shard_size": 8}), "zero_optimization.mics_shard_size", ["removed from DeepSpeed"]),
    # two spellings of one setting
    (_ds(zero={"stage3_max_reuse_distance": 1, "max_reuse_distance": 2}), "zero_optimization.max_reuse_distance",
     ["two names for one setting"]),
    (_ds(zero={"cpu_offload": True}), "zero_optimization.cpu_offload", ["deprecated form", "both are given"]),
    (_ds(bf16={"enabled": True}, bfloat16={"enabled": True}), "bfloat16", ["keep only 'bf16'"]),
])
def test_errors_name_the_deepspeed_key_and_what_is_allowed(ds, key, fragments):
    error = _error(ds)
    assert error.key == key, str(error)
    message = str(error)
    assert message.startswith(key + " "), message
    for fragment in fragments:
        assert fragment in message, message


def test_not_a_mapping_is_a_type_error():
    with pytest.raises(TypeError, match="a mapping"):
        translate_deepspeed(["zero_optimization"])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="zero_optimization.offload_param"):
        _translate(_ds(zero={"offload_param": "cpu"}))


def test_world_size_comes_from_an_initialised_process_group(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setenv("WORLD_SIZE", "7")  # the process group takes precedence
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeepSpeedConfigWarning)
            config = translate_deepspeed(_ds(train_batch_size=8, train_micro_batch_size_per_gpu=2))
    finally:
        dist.destroy_process_group()
    assert config.gradient_accumulation_steps == 4


def test_offloads_prefetch_section_in_a_deepspeed_config():
    """`prefetch.optimizer_in_backward: false` (the fix full_grad's error names) can be set
    from a DeepSpeed config: offload's `prefetch` section at its top level (issue #33)."""
    import warnings

    from offload.config import ConfigError, load_config

    base = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert load_config(base).prefetch.optimizer_in_backward is True
        cfg = load_config({**base, "prefetch": {"optimizer_in_backward": False, "keep_bytes": 0}})
    assert cfg.prefetch.optimizer_in_backward is False and cfg.prefetch.keep_bytes == 0
    with pytest.raises(ConfigError, match="did you mean 'optimizer_in_backward'"):
        load_config({**base, "prefetch": {"optimizer_in_bakward": False}})


def test_a_small_sub_group_size_is_not_a_tiny_pinned_budget(tmp_path):
    """sub_group_size counts parameters per optimizer sub-group (DeepSpeed's buffers hold the
    largest sub-group, at least the largest parameter): 100 became a 1,600-byte budget that
    initialize refused (issue #33). Now the budget is never below offload's default, and the
    engine initializes."""
    import warnings

    import offload
    from offload.config import OffloadConfig, load_config
    from tests.conftest import TinyGPT

    ds = {"train_micro_batch_size_per_gpu": 1,
          "zero_optimization": {"stage": 3, "sub_group_size": 100,
                                "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = load_config(ds)
    assert cfg.offload.pinned_budget_bytes >= OffloadConfig.pinned_budget_bytes
    engine = offload.initialize(TinyGPT(), cfg)
    engine.close()


def test_checkpoint_tag_validation_is_read():
    import warnings

    from offload.config import ConfigError, load_config

    base = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert load_config(base).checkpoint_tag_validation == "Warn"  # DeepSpeed's default
        assert load_config({**base, "checkpoint": {"tag_validation": "FAIL"}}).checkpoint_tag_validation == "Fail"
        cfg = load_config({**base, "checkpoint": {"tag_validation": "Ignore", "use_node_local_storage": True}})
    assert cfg.checkpoint_tag_validation == "Ignore" and "checkpoint.use_node_local_storage" in cfg.ignored_keys
    with pytest.raises(ConfigError, match="checkpoint.tag_validation"):
        load_config({**base, "checkpoint": {"tag_validation": "Maybe"}})
    with pytest.raises(ConfigError, match="load_universal"):
        load_config({**base, "checkpoint": {"load_universal": True}})


def test_the_translation_report_is_warned_on_rank_0_only(monkeypatch):
    """Hugging Face's stock ZeRO-3 template drew the same 9-line warning on every rank (issue #36)."""
    import warnings

    from offload.config import DeepSpeedConfigWarning, load_config

    ds = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "reduce_bucket_size": 1000}}
    for rank, expected in (("0", 1), ("1", 0)):
        monkeypatch.setenv("RANK", rank)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cfg = load_config(ds)
        assert len([w for w in caught if issubclass(w.category, DeepSpeedConfigWarning)]) == expected, rank
        assert "zero_optimization.reduce_bucket_size" in cfg.ignored_keys  # the record is on every rank
