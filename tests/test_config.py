"""offload's own config format: validation at the door, errors that name the key and the
fix, round trips through dicts and JSON / YAML files, and `load_config`'s dispatch."""

from __future__ import annotations

import dataclasses
import json

import pytest

import offload.config
import yaml

from offload.config import (
    AIOConfig,
    Config,
    ConfigError,
    ConfigTypeError,
    OffloadConfig,
    OptimizerConfig,
    PrecisionConfig,
    PrefetchConfig,
    SchedulerConfig,
    TimelineConfig,
    load_config,
)


def _full_config() -> Config:
    """Every section away from its defaults."""
    return Config(
        offload=OffloadConfig(param_tier="nvme", optimizer_tier="nvme", nvme_path="/mnt/nvme0/swap",
                              pin_memory=False, pinned_budget_bytes=3 << 30),
        optimizer=OptimizerConfig(type="Adam", lr=3e-4, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1,
                                  moments_dtype="bf16"),
        scheduler=SchedulerConfig(type="WarmupDecayLR",
                                  params={"total_num_steps": 1000, "warmup_num_steps": 100,
                                          "warmup_max_lr": [3e-4, 1e-4], "warmup_type": "linear"}),
        precision=PrecisionConfig(dtype="fp16", loss_scale=0.0, initial_scale_power=12,
                                  loss_scale_window=500, hysteresis=3, min_loss_scale=0.5),
        aio=AIOConfig(block_size=1 << 21, queue_depth=64, threads=4),
        prefetch=PrefetchConfig(prefetch_bytes=1 << 27, keep_bytes=0),
        timeline=TimelineConfig(enabled=True, path="trace.json"),
        gradient_clipping=1.0,
        gradient_accumulation_steps=4,
        train_micro_batch_size_per_gpu=8,
        unit_modules=("GPTBlock", "Embedding"),
        compute_device="cpu",
        cpu_adam_threads=6,
    )


# ---- round trips ------------------------------------------------------------------------

def test_defaults_are_valid_and_round_trip_through_a_dict():
    config = Config()
    assert Config.from_dict(config.to_dict()) == config
    assert load_config(None) == config


def test_full_config_round_trips_through_a_dict():
    config = _full_config()
    data = config.to_dict()
    assert data["optimizer"]["betas"] == [0.8, 0.95]  # plain lists, ready for JSON / YAML
    assert data["unit_modules"] == ["GPTBlock", "Embedding"]
    assert Config.from_dict(data) == config


def test_to_dict_is_json_and_yaml_serialisable(tmp_path):
    config = _full_config()
    for name, dump in (("c.json", json.dumps), ("c.yaml", yaml.safe_dump), ("c.yml", yaml.safe_dump)):
        path = tmp_path / name
        path.write_text(dump(config.to_dict()))
        assert Config.from_file(path) == config
        assert offload.config.from_file(path) == config  # the function Config.from_file aliases
        assert load_config(str(path)) == config
        assert load_config(path) == config


def test_file_without_known_extension_is_read_as_json_then_yaml(tmp_path):
    config = _full_config()
    (tmp_path / "as_json.cfg").write_text(json.dumps(config.to_dict()))
    (tmp_path / "as_yaml.cfg").write_text(yaml.safe_dump(config.to_dict()))
    assert load_config(tmp_path / "as_json.cfg") == config
    assert load_config(tmp_path / "as_yaml.cfg") == config


def test_load_config_returns_a_config_unchanged():
    config = _full_config()
    assert load_config(config) is config


def test_nested_mappings_are_accepted_by_the_constructor():
    config = Config(offload={"param_tier": "nvme", "nvme_path": "/x"}, precision={"dtype": "bf16"})
    assert config.offload == OffloadConfig(param_tier="nvme", nvme_path="/x")
    assert config.precision.dtype == "bf16"


def test_json_friendly_values_are_normalised():
    config = Config.from_dict({"optimizer": {"betas": [0.9, 0.99], "lr": 1}, "offload": {"pinned_budget_bytes": 5e8},
                               "unit_modules": ["Block"]})
    assert config.optimizer.betas == (0.9, 0.99) and isinstance(config.optimizer.lr, float)
    assert config.offload.pinned_budget_bytes == 500_000_000 and isinstance(config.offload.pinned_budget_bytes, int)
    assert config.unit_modules == ("Block",)


def test_path_like_nvme_path_becomes_a_string(tmp_path):
    config = OffloadConfig(optimizer_tier="nvme", nvme_path=tmp_path)
    assert config.nvme_path == str(tmp_path)


def test_configs_are_frozen():
    config = Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.gradient_clipping = 1.0  # type: ignore[misc]


# ---- errors: key, value, rule, fix -------------------------------------------------------

@pytest.mark.parametrize("build,key,fragments", [
    (lambda: OptimizerConfig(lr=-1e-3), "optimizer.lr", ["-0.001", ">= 0", "non-negative"]),
    (lambda: OptimizerConfig(betas=(0.9, 1.0)), "optimizer.betas[1]", ["[0, 1)", "0.999"]),
    (lambda: OptimizerConfig(betas=(0.9,)), "optimizer.betas", ["exactly 2 entries", "list of 2"]),
    (lambda: OptimizerConfig(eps=-1.0), "optimizer.eps", [">= 0", "1e-8"]),
    (lambda: OptimizerConfig(weight_decay=-0.1), "optimizer.weight_decay", [">= 0", "0 to disable"]),
    (lambda: OptimizerConfig(lr=float("nan")), "optimizer.lr", ["finite"]),
    (lambda: OptimizerConfig(type="RMSprop"), "optimizer.type", ["'AdamW', 'Adam'"]),
    (lambda: OptimizerConfig(type="Adam", momentum=0.9), "optimizer.momentum", ["only SGD"]),
    (lambda: OptimizerConfig(type="SGD", nesterov=True), "optimizer.nesterov", ["momentum > 0"]),
    (lambda: OptimizerConfig(type="adamw"), "optimizer.type", ["did you mean 'AdamW'"]),
    (lambda: OptimizerConfig(moments_dtype="fp16"), "optimizer.moments_dtype", ["'fp32', 'bf16'"]),
    (lambda: PrecisionConfig(dtype="float16"), "precision.dtype", ["'fp32', 'bf16', 'fp16'"]),
    (lambda: PrecisionConfig(loss_scale=-1), "precision.loss_scale", [">= 0", "dynamic"]),
    (lambda: PrecisionConfig(initial_scale_power=200), "precision.initial_scale_power", ["[0, 127]"]),
    (lambda: PrecisionConfig(loss_scale_window=0), "precision.loss_scale_window", [">= 1"]),
    (lambda: PrecisionConfig(hysteresis=0), "precision.hysteresis", [">= 1"]),
    (lambda: PrecisionConfig(min_loss_scale=0), "precision.min_loss_scale", ["> 0"]),
    (lambda: OffloadConfig(param_tier="gpu"), "offload.param_tier", ["'device', 'cpu', 'nvme'"]),
    (lambda: OffloadConfig(optimizer_tier="gpu"), "offload.optimizer_tier", ["'cpu', 'nvme', 'device'"]),
    (lambda: OffloadConfig(optimizer_tier="nvme"), "offload.nvme_path",
     ["required when offload.optimizer_tier is 'nvme'", "local NVMe disk"]),
    (lambda: OffloadConfig(param_tier="nvme", nvme_path=""), "offload.nvme_path",
     ["required when offload.param_tier is 'nvme'"]),
    (lambda: OffloadConfig(pinned_budget_bytes=0), "offload.pinned_budget_bytes", ["positive", "1 GiB"]),
    (lambda: AIOConfig(block_size=1000), "aio.block_size", ["multiple of 4096", "1048576"]),
    (lambda: AIOConfig(queue_depth=0), "aio.queue_depth", ["at least one"]),
    (lambda: AIOConfig(threads=0), "aio.threads", ["at least one"]),
    (lambda: PrefetchConfig(prefetch_bytes=-1), "prefetch.prefetch_bytes", [">= 0", "0 to switch"]),
    (lambda: PrefetchConfig(keep_bytes=-1), "prefetch.keep_bytes", [">= 0"]),
    (lambda: TimelineConfig(path="t.json"), "timeline.path", ["timeline.enabled is false", "set timeline.enabled"]),
    (lambda: Config(gradient_clipping=-1.0), "gradient_clipping", [">= 0", "0 to disable"]),
    (lambda: Config(gradient_accumulation_steps=0), "gradient_accumulation_steps", [">= 1"]),
    (lambda: Config(train_micro_batch_size_per_gpu=0), "train_micro_batch_size_per_gpu", ["at least one sample"]),
    (lambda: Config(unit_modules=("Block", " ")), "unit_modules[1]", ["cannot be empty"]),
    (lambda: Config(compute_device="gpu"), "compute_device", ["'auto', 'cpu', 'cuda'"]),
    (lambda: Config(cpu_adam_threads=-2), "cpu_adam_threads", [">= 0"]),
    (lambda: Config(offload={"optimizer_tier": "nvme"}), "offload.nvme_path", ["required"]),
])
def test_bad_values_raise_errors_naming_the_key_and_the_fix(build, key, fragments):
    with pytest.raises(ConfigError) as info:
        build()
    assert info.value.key == key
    message = str(info.value)
    assert message.startswith(key + " ")
    for fragment in fragments:
        assert fragment in message, message


@pytest.mark.parametrize("build,key,expected", [
    (lambda: OffloadConfig(pin_memory=1), "offload.pin_memory", "true or false"),
    (lambda: AIOConfig(threads=2.5), "aio.threads", "an integer"),
    (lambda: AIOConfig(threads=True), "aio.threads", "an integer"),
    (lambda: OptimizerConfig(lr="1e-3"), "optimizer.lr", "a number"),
    (lambda: OptimizerConfig(betas="0.9,0.99"), "optimizer.betas", "a list"),
    (lambda: Config(unit_modules="Block"), "unit_modules", "a list"),
    (lambda: Config(offload=3), "offload", "a mapping or an offload.OffloadConfig"),
    (lambda: SchedulerConfig(type="WarmupLR", params=[1]), "scheduler.params", "a mapping"),
])
def test_wrong_types_raise_type_errors_naming_the_key(build, key, expected):
    with pytest.raises(TypeError) as info:
        build()
    assert isinstance(info.value, ConfigTypeError) and isinstance(info.value, ValueError)
    assert str(info.value).startswith(key + " ") and expected in str(info.value)


def test_hugging_face_auto_placeholder_is_rejected_with_guidance():
    with pytest.raises(ConfigError, match=r"gradient_accumulation_steps = 'auto'.*Hugging Face Trainer"):
        Config.from_dict({"gradient_accumulation_steps": "auto"})


def test_compute_device_auto_is_a_valid_choice_not_a_placeholder():
    assert Config(compute_device="auto").compute_device == "auto"


def test_unknown_key_names_its_path_and_suggests_the_closest():
    with pytest.raises(ConfigError) as info:
        Config.from_dict({"offload": {"nvme_pth": "/x"}})
    assert info.value.key == "offload.nvme_pth"
    assert "did you mean 'nvme_path'" in str(info.value)
    assert "param_tier, optimizer_tier, nvme_path" in str(info.value)

    with pytest.raises(ConfigError, match=r"^gradient_cliping .*did you mean 'gradient_clipping'"):
        Config.from_dict({"gradient_cliping": 1.0})


def test_misspelt_deepspeed_key_is_suggested_as_deepspeeds():
    with pytest.raises(ConfigError, match=r"zero_optimisation .*did you mean 'zero_optimization', a DeepSpeed key"):
        load_config({"zero_optimisation": {"stage": 3}})


def test_from_dict_rejects_a_deepspeed_config_and_points_to_the_translation():
    with pytest.raises(ConfigError, match=r"zero_optimization is a DeepSpeed key.*from_deepspeed"):
        Config.from_dict({"zero_optimization": {"stage": 3}})


def test_mixing_offload_and_deepspeed_keys_is_an_error():
    with pytest.raises(ConfigError, match=r"offload is offload's key.*'bf16'.*one format"):
        load_config({"offload": {"param_tier": "cpu"}, "bf16": {"enabled": True}})


def test_shared_keys_only_read_as_offload_format():
    config = load_config({"gradient_clipping": 0.5, "optimizer": {"type": "Adam", "lr": 0.01}})
    assert config.gradient_clipping == 0.5
    assert config.optimizer == OptimizerConfig(type="Adam", lr=0.01)


def test_load_config_rejects_other_types():
    with pytest.raises(TypeError, match="pass an offload.Config, a dict"):
        load_config(42)  # type: ignore[arg-type]


# ---- scheduler section ------------------------------------------------------------------

def test_scheduler_params_are_checked_against_the_schedule():
    with pytest.raises(ConfigError, match=r"scheduler.params.warmup_num_step .*did you mean 'warmup_num_steps'"):
        SchedulerConfig(type="WarmupLR", params={"warmup_num_step": 10})
    with pytest.raises(ConfigError, match=r"scheduler.params.total_num_steps is missing; WarmupCosineLR requires"):
        SchedulerConfig(type="WarmupCosineLR", params={"warmup_num_steps": 10})
    with pytest.raises(ConfigError, match=r"scheduler.params.warmup_type = 'cosine'.*'log', 'linear'"):
        SchedulerConfig(type="WarmupLR", params={"warmup_type": "cosine"})
    with pytest.raises(ConfigError, match=r"scheduler.params.cos_min_ratio = 1.5.*\[0, 1\]"):
        SchedulerConfig(type="WarmupCosineLR", params={"total_num_steps": 9, "cos_min_ratio": 1.5})
    with pytest.raises(ConfigError, match=r"scheduler.params.warmup_num_steps = 0"):
        SchedulerConfig(type="WarmupLR", params={"warmup_num_steps": 0})
    with pytest.raises(ConfigError, match=r"scheduler.params.warmup_max_lr\[1\] = -0.1"):
        SchedulerConfig(type="WarmupLR", params={"warmup_max_lr": [0.1, -0.1]})
    with pytest.raises(ConfigError, match=r"scheduler.type = 'Warmup'.*'WarmupLR'"):
        SchedulerConfig(type="Warmup")


def test_scheduler_params_are_normalised_for_the_constructor():
    config = SchedulerConfig(type="WarmupDecayLR", params={"total_num_steps": 1e3, "warmup_max_lr": 1})
    assert config.params == {"total_num_steps": 1000, "warmup_max_lr": 1.0}
    assert isinstance(config.params["total_num_steps"], int)


def test_warmup_lr_accepts_none_max_lr_meaning_the_optimizers_rate():
    assert SchedulerConfig(type="WarmupLR", params={"warmup_max_lr": None}).params["warmup_max_lr"] is None


# ---- files ------------------------------------------------------------------------------

def test_missing_file_is_a_file_not_found_error_with_guidance(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist; pass the path of a JSON or YAML file"):
        load_config(tmp_path / "nope.json")


def test_invalid_json_names_the_file_line_and_column(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{\n  "gradient_clipping": 1.0,\n}\n')
    with pytest.raises(ConfigError, match=r"bad.json is not valid JSON: .* line 3 column 1"):
        load_config(path)


def test_invalid_yaml_is_an_error_naming_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("offload: [unclosed\n")
    with pytest.raises(ConfigError, match="bad.yaml is not valid YAML"):
        load_config(path)


@pytest.mark.parametrize("name,text", [
    ("dup.json", '{"gradient_clipping": 1.0, "gradient_clipping": 2.0}'),
    ("dup.yaml", "gradient_clipping: 1.0\ngradient_clipping: 2.0\n"),
])
def test_duplicate_keys_in_a_file_are_an_error(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match="gradient_clipping appears twice"):
        load_config(path)


def test_file_whose_top_level_is_not_a_mapping_is_a_type_error(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(TypeError, match="one JSON object / YAML mapping"):
        load_config(path)


def test_config_errors_survive_pickling_across_processes():
    import pickle

    with pytest.raises(ConfigError) as info:
        OffloadConfig(optimizer_tier="nvme")
    copy = pickle.loads(pickle.dumps(info.value))
    assert type(copy) is ConfigError and str(copy) == str(info.value) and copy.key == "offload.nvme_path"


def test_skeleton_contract_field_names_are_kept():
    # The engine codes against these names; new fields may be added, none renamed or removed.
    names = lambda cls: {f.name for f in dataclasses.fields(cls)}  # noqa: E731
    assert {"type", "lr", "betas", "eps", "weight_decay", "moments_dtype"} <= names(OptimizerConfig)
    assert {"type", "params"} <= names(SchedulerConfig)
    assert {"dtype", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
            "min_loss_scale"} <= names(PrecisionConfig)
    assert {"param_tier", "optimizer_tier", "nvme_path", "pin_memory", "pinned_budget_bytes"} <= names(OffloadConfig)
    assert {"block_size", "queue_depth", "threads"} <= names(AIOConfig)
    assert {"offload", "optimizer", "scheduler", "precision", "aio", "gradient_clipping",
            "gradient_accumulation_steps", "train_micro_batch_size_per_gpu", "unit_modules",
            "compute_device", "cpu_adam_threads"} <= names(Config)


# -- errors a user can act on (issue #36) ------------------------------------------------------------


def test_synonyms_get_the_right_did_you_mean():
    from offload.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"param_tier = 'gpu'.*did you mean 'device'"):
        load_config({"offload": {"param_tier": "gpu"}})
    with pytest.raises(ConfigError, match=r"optimizer.learning_rate is not a known key.*did you mean 'lr'"):
        load_config({"optimizer": {"learning_rate": 1e-3}})


@pytest.mark.parametrize("typed,meant", [("bfloat32", "bf16"), ("bfloat16", "bf16"), ("torch.bfloat16", "bf16"),
                                         ("float16", "fp16"), ("half", "fp16"), ("float32", "fp32"),
                                         ("torch.float32", "fp32")])
def test_a_dtype_by_torchs_name_or_a_mix_of_names_gets_a_did_you_mean(typed, meant):
    """Value typos get the suggestion key typos get (issue #49: 'bfloat32' got none)."""
    from offload.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=rf"precision.dtype = '{typed}'.*\(did you mean '{meant}'\?\)"):
        load_config({"precision": {"dtype": typed}})


def test_sizes_read_as_on_the_command_line_and_yaml_numbers_get_a_hint(tmp_path):
    from offload.config import ConfigError, ConfigTypeError, load_config

    cfg = load_config({"offload": {"pinned_budget_bytes": "1GiB"}})
    assert cfg.offload.pinned_budget_bytes == 1 << 30
    path = tmp_path / "c.yaml"
    path.write_text("optimizer:\n  lr: 3e-4\n")  # YAML 1.1 reads 3e-4 (no dot) as a string
    with pytest.raises(ConfigTypeError, match=r"optimizer.lr = '3e-4' \(str\).*YAML.*write it as 0.0003"):
        load_config(str(path))
    with pytest.raises(ConfigError, match=r"pinned_budget_bytes = '1 lots': cannot read"):
        load_config({"offload": {"pinned_budget_bytes": "1 lots"}})
    with pytest.raises(ConfigTypeError, match=r"optimizer.lr = 'fast' \(str\), but it must be a number"):
        load_config({"optimizer": {"lr": "fast"}})


# -- every key at the door: a property-based fuzz (issue #43, item 5) -------------------------

def _leaves(d: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else k
        out += _leaves(v, key) if isinstance(v, dict) and v else [key]
    return out


def _with(d: dict, key: str, value: object) -> dict:
    import copy

    d = copy.deepcopy(d)
    *path, last = key.split(".")
    node = d
    for p in path:
        node = node[p]
    node[last] = value
    return d


_BASE = offload.config.Config(compute_device="cpu").to_dict()
_BAD_VALUES = ["x", "", None, [1], {}, {"a": 1}, True, -1, -1.5, 0, 2**62, -(2**62), 2**53 + 1, 1e300,
               -1e300, 1e19, 100_000, 7.5]


def _fuzz_model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))


def _door(key: str, value: object, tmp_path) -> None:
    """One mutated config through the door and, if accepted, through a training step."""
    import contextlib
    import os

    import torch

    import offload

    data = _with(_BASE, key, value)
    try:
        cfg = offload.config.Config.from_dict(data)
    except offload.config.ConfigError as exc:
        assert exc.key.split("[")[0] == key or exc.key.startswith(key + "."), (key, value, exc.key, str(exc))
        return
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        engine = offload.initialize(_fuzz_model(), cfg)
    except (offload.config.ConfigError, ImportError) as exc:  # a combination refused at initialize, or a
        assert key in str(exc), (key, value, str(exc))  # monitor whose package this machine lacks
        return
    finally:
        os.chdir(cwd)
    with contextlib.closing(engine):
        x = torch.randn(2, 4)
        engine.backward(engine(x).pow(2).mean())
        engine.step()


def test_config_fuzz_every_key_fails_at_the_door_naming_it(tmp_path):
    """Every leaf key of a valid config, set to a wrong type, a negative, a huge number, an
    empty string or None (hypothesis, 300 examples): `Config.from_dict` raises a ConfigError
    naming that key, or the config is accepted and `offload.initialize` runs a step with it
    (on a tiny model, in a temporary directory); never another error from inside (a pybind11
    TypeError, an OverflowError) and never a hang. Before the bounds (1750db6),
    cpu_adam_threads and aio.queue_depth of 2**62 passed the door and failed inside the native
    bindings, and cpu_adam_threads=100000 started."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(_leaves(_BASE)), st.sampled_from(_BAD_VALUES))
    def case(key: str, value: object) -> None:
        _door(key, value, tmp_path)

    case()


def test_config_sweep_every_key_with_every_bad_value(tmp_path):
    """The fuzz's cases exhaustively: every leaf key with every bad value (the derandomized
    300 examples above reach most, not all, of the pairs)."""
    for key in _leaves(_BASE):
        for value in _BAD_VALUES:
            _door(key, value, tmp_path)
