"""A DeepSpeed config, translated into offload's `Config` in one place.

`translate_deepspeed(ds)` reads a config the way DeepSpeed 0.19 does and returns the
equivalent `Config`; `Config.from_deepspeed` and `load_config` call it. Every DeepSpeed key
offload knows is one of four kinds:

- mapped:   read into a Config field, possibly after a unit conversion (elements -> bytes);
- ignored:  valid DeepSpeed that cannot change the trained model here (logging, bucket
            sizes, communication tuning): accepted, reported by name with the reason in one
            `DeepSpeedConfigWarning` and in `Config.ignored_keys`;
- semantic: would change training (quantised weights, AMSGrad, fp16 master weights ...):
            accepted only at the value that means "off", otherwise an error naming it;
- removed:  keys DeepSpeed 0.19 itself rejects: an error.

Anything else is unknown: an error that names the key's path and the closest valid key.
Settings offload resolves differently from DeepSpeed (optimizer states on the GPU become
CPU) are explained in `Config.notes` and the same warning. docs/config.md has the table.
"""

from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal, Mapping, Optional

from offload.config.sections import (
    SCHEDULER_PARAMS,
    AIOConfig,
    Config,
    ConfigError,
    DeepSpeedConfigWarning,
    OffloadConfig,
    OptimizerConfig,
    PrecisionConfig,
    PrefetchConfig,
    SchedulerConfig,
    _coerce,
    _fail,
    _fail_type,
    _suggest,
    _valid_keys,
)

__all__ = ["translate_deepspeed", "DS_ONLY_TOP_KEYS"]

# -- top level --------------------------------------------------------------------------

_TOP_MAPPED = frozenset({
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "optimizer", "scheduler", "fp16", "bf16", "bfloat16", "gradient_clipping",
    "zero_optimization", "aio", "data_types", "gradient_allreduce_op", "torch_autocast",
    "managed_gradient_accumulation", "sequence_parallel_size", "hybrid_engine",
    "data_efficiency", "tensor_parallel",
})

_TOP_IGNORED = {
    "steps_per_print": "logging",
    "wall_clock_breakdown": "logging (offload's timeline section is the equivalent)",
    "memory_breakdown": "logging",
    "dump_state": "logging",
    "tensorboard": "monitoring",
    "wandb": "monitoring",
    "csv_monitor": "monitoring",
    "comet": "monitoring",
    "flops_profiler": "profiling",
    "comms_logger": "logging",
    "timers": "profiling",
    "log_level": "logging",
    "autotuning": "a DeepSpeed launcher feature",
    "zero_allow_untested_optimizer": "offload runs its own CPU Adam only",
    "zero_force_ds_cpu_optimizer": "offload always uses its own CPU Adam",
    "disable_allgather": "communication detail",
    "prescale_gradients": "where the 1/world_size division happens; the mean is the same",
    "gradient_predivide_factor": "where the 1/world_size division happens; the mean is the same",
    "communication_data_type": "offload reduce-scatters gradients in its own dtype",
    "seq_parallel_communication_data_type": "offload has no sequence parallelism",
    "activation_checkpointing": "only affects deepspeed.checkpointing; use torch.utils.checkpoint",
    "checkpoint": "checkpoint I/O options of DeepSpeed's engine",
    "dataloader_drop_last": "only offload.compat.deepspeed.initialize builds a data loader (and honours it); offload.initialize builds none",
    "disable_python_gc": "runtime detail",
    "compile": "DeepSpeed's compile backend",
    "pipeline": "pipeline parallelism is not used by offload",
    "use_data_before_expert_parallelism": "offload has no expert parallelism",
    "vocabulary_size": "informational",
}

_TOP_UNSUPPORTED = {
    "weight_quantization": "quantised weights change the trained model",
    "expert_parallel": "offload has no expert (MoE) parallelism",
}

_TOP_REMOVED = frozenset({
    "nebula", "compression_training", "amp", "quantize_training", "sparse_gradients",
    "eigenvalue", "sparse_attention", "elasticity", "graph_harvesting", "curriculum_learning",
    "progressive_layer_drop",
})
"""deepspeed/runtime/config.py _REMOVED_TOP_LEVEL_CONFIG_KEYS (0.19)."""

_SHARED_TOP_KEYS = frozenset({"optimizer", "scheduler", "aio", "gradient_clipping",
                              "gradient_accumulation_steps", "train_micro_batch_size_per_gpu"})

DS_ONLY_TOP_KEYS = (_TOP_MAPPED | frozenset(_TOP_IGNORED) | frozenset(_TOP_UNSUPPORTED)
                    | _TOP_REMOVED) - _SHARED_TOP_KEYS
"""Top-level keys that mark a mapping as a DeepSpeed config (offload's format has none)."""

# -- zero_optimization ---------------------------------------------------------------------

_ZERO_ALIASES = {
    "stage3_prefetch_bucket_size": "prefetch_bucket_size",
    "stage3_param_persistence_threshold": "param_persistence_threshold",
    "stage3_model_persistence_threshold": "model_persistence_threshold",
    "stage3_max_live_parameters": "max_live_parameters",
    "stage3_max_reuse_distance": "max_reuse_distance",
    "stage3_gather_16bit_weights_on_model_save": "gather_16bit_weights_on_model_save",
    "stage3_module_granularity_threshold": "module_granularity_threshold",
    "stage3_use_all_reduce_for_fetch_params": "use_all_reduce_for_fetch_params",
    "stage3_allgather_sequential": "allgather_sequential",
}
"""DeepSpeed's pydantic aliases: either spelling is accepted (not both)."""

_ZERO_MAPPED = frozenset({
    "stage", "offload_param", "offload_optimizer", "prefetch_bucket_size", "max_reuse_distance",
    "sub_group_size", "cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory",
    "compute_grad_norm", "zero_quantized_weights", "zero_quantized_nontrainable_weights",
    "zero_quantized_gradients", "zenflow",
})

_ZERO_IGNORED = {
    "contiguous_gradients": "offload's gradient shards are always contiguous",
    "reduce_scatter": "offload always reduce-scatters gradients",
    "reduce_bucket_size": "offload reduces one unit at a time",
    "use_multi_rank_bucket_allreduce": "communication detail",
    "allgather_partitions": "offload always all-gathers",
    "allgather_bucket_size": "offload gathers one unit at a time",
    "overlap_comm": "offload always overlaps communication (the prefetch section tunes it)",
    "load_from_fp32_weights": "offload checkpoints keep fp32 master weights",
    "elastic_checkpoint": "checkpoint format detail",
    "max_live_parameters": "offload bounds live parameters by prefetch.prefetch_bytes + prefetch.keep_bytes",
    "param_persistence_threshold": "offload partitions every parameter of a unit",
    "model_persistence_threshold": "offload partitions every parameter of a unit",
    "gather_16bit_weights_on_model_save": "use engine.full_state_dict()",
    "stage3_gather_fp16_weights_on_model_save": "use engine.full_state_dict()",
    "module_granularity_threshold": "offload's units are chosen by unit_modules",
    "use_all_reduce_for_fetch_params": "communication detail",
    "allgather_sequential": "communication detail",
    "ignore_unused_parameters": "offload accepts unused parameters",
    "legacy_stage1": "a stage 1 option",
    "round_robin_gradients": "a stage 1/2 option",
    "parameter_alignment": "a stage 1/2 option",
    "zero_hpz_partition_size": "offload has no hierarchical partitioning",
    "memory_efficient_linear": "offload patches no modules",
    "pipeline_loading_checkpoint": "checkpoint detail",
    "override_module_apply": "offload patches no modules",
    "log_trace_cache_warnings": "logging",
    "enable_sanity_checks": "debugging",
    "save_muon_momentum_buffer_in_memory": "offload has no Muon optimizer",
    "leaf_module": "offload's units are chosen by unit_modules",
}

_ZERO_REMOVED = frozenset({"mics_shard_size", "mics_hierarchical_params_gather", "zeropp_loco_param"})

_OFFLOAD_PARAM_KEYS = ("device", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pin_memory")
_OFFLOAD_OPTIMIZER_KEYS = ("device", "nvme_path", "buffer_count", "pin_memory", "pipeline_read",
                           "pipeline_write", "fast_init", "ratio", "super_offload", "cpuadam_cores_perc")
_OFFLOAD_OPTIMIZER_IGNORED = {
    "pipeline_read": "offload always pipelines optimizer-state reads",
    "pipeline_write": "offload always pipelines optimizer-state writes",
    "fast_init": "initialisation detail",
    "ratio": "offload runs the whole optimizer step on the CPU",
    "super_offload": "a DeepSpeed superchip mode",
    "cpuadam_cores_perc": "use cpu_adam_threads in offload's format",
}
_PARAM_BUFFER_COUNT = 5
_PARAM_BUFFER_SIZE = 100_000_000
_OPTIMIZER_BUFFER_COUNT = 4
"""DeepSpeed's defaults for offload_param.buffer_count / buffer_size (elements) and
offload_optimizer.buffer_count (deepspeed/runtime/zero/offload_config.py)."""

# -- other sections --------------------------------------------------------------------------

_OPTIMIZER_PARAMS = ("lr", "betas", "eps", "weight_decay", "bias_correction", "amsgrad",
                     "adam_w_mode", "torch_adam", "fp32_optimizer_states", "foreach",
                     "set_grad_none", "max_grad_norm")
_FP16_KEYS = ("enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window",
              "hysteresis", "consecutive_hysteresis", "min_loss_scale", "fp16_master_weights_and_grads")
_BF16_KEYS = ("enabled", "immediate_grad_update", "check_grad_overflow", "check_overflow",
              "bf16_master_weights_and_grads", "bf16_optimizer_states")
_AIO_KEYS = ("block_size", "queue_depth", "intra_op_parallelism", "thread_count", "single_submit",
             "overlap_events", "use_gds")
_DATA_TYPES_KEYS = ("grad_accum_dtype", "param_dtype", "buffer_dtype", "keep_in_fp32_modules")
_OTHER_DS_SCHEDULES = ("LRRangeTest", "OneCycle")
_DEVICE = Literal["none", "cpu", "nvme"]


@dataclass
class _Translation:
    """What one translation has gathered: our sections' keyword arguments, the report."""

    ds: Mapping[str, Any]
    sections: dict[str, dict[str, Any]] = field(default_factory=lambda: {
        name: {} for name in ("offload", "optimizer", "precision", "aio", "prefetch", "top")})
    ignored: dict[str, str] = field(default_factory=dict)
    """DeepSpeed key path -> why it is not honoured."""
    notes: list[str] = field(default_factory=list)
    origin: dict[str, str] = field(default_factory=dict)
    """Our key -> the DeepSpeed key it came from, so range errors name the user's key."""

    def set(self, ours: str, value: Any, ds_key: str) -> None:
        section, _, name = ours.rpartition(".")
        self.sections[section or "top"][name] = value
        self.origin[ours] = ds_key

    def ignore(self, ds_key: str, why: str) -> None:
        self.ignored[ds_key] = why


def _section(path: str, value: Any, allowed: Iterable[str]) -> dict[str, Any]:
    """The mapping found at `path` ({} when absent), its keys checked against `allowed`."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise _fail_type(path, value, "a mapping (a JSON object)")
    allowed = list(allowed)
    for key in value:
        if key not in allowed:
            raise ConfigError(f"{path}.{key}", f"is not a DeepSpeed key that offload knows"
                              f"{_suggest(key, allowed)}", _valid_keys(f"under {path!r}", allowed))
    return dict(value)


def _only_off(key: str, value: Any, off: Any, why: str, fix: str) -> None:
    """A semantic key: accepted at the value meaning "off" (or absent), an error otherwise."""
    if value is not None and value != off:
        raise ConfigError(key, f"= {value!r} is not supported: {why}", fix)


def _positive(key: str, value: Any, fix: str) -> int:
    value = _coerce(key, value, int)
    if value < 1:
        raise _fail(key, value, "it must be >= 1", fix)
    return value


def _world_size_now() -> int:
    """The data-parallel world size DeepSpeed's batch arithmetic would see, without
    importing torch: an initialised torch.distributed, else $WORLD_SIZE (torchrun sets
    it), else 1."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size())
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def _caller_stacklevel() -> int:
    """warnings.warn's stacklevel that points at the first frame outside this package (the
    user's call to initialize / load_config), however deep inside we are."""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def _ds_key_for(key: str, origin: Mapping[str, str]) -> str:
    """The DeepSpeed spelling of one of our keys (`optimizer.betas[0]` ->
    `optimizer.params.betas[0]`), by its longest mapped prefix."""
    for ours in sorted(origin, key=len, reverse=True):
        if key == ours or key.startswith(ours + "[") or key.startswith(ours + "."):
            return origin[ours] + key[len(ours):]
    return key


def translate_deepspeed(ds: Mapping[str, Any], *, world_size: Optional[int] = None) -> Config:
    """A DeepSpeed config (as DeepSpeed 0.19 reads it) -> the equivalent `Config`.

    Harmless keys offload does not read are reported together in one
    `DeepSpeedConfigWarning` and in `Config.ignored_keys`; settings resolved differently
    from DeepSpeed are in `Config.notes` (and the same warning). `world_size` is for
    DeepSpeed's batch-size arithmetic; by default an initialised torch.distributed's, else
    $WORLD_SIZE, else 1.
    """
    if not isinstance(ds, Mapping):
        raise _fail_type("config", ds, "a mapping (a DeepSpeed config dict)")
    t = _Translation(ds)
    _top_level(t)
    elem_bytes = _precision(t)
    _zero(t, elem_bytes)
    _optimizer(t)
    scheduler = _scheduler(t)
    _batch(t, _world_size_now() if world_size is None else world_size)
    _aio(t)
    try:
        sections = {"offload": OffloadConfig(**t.sections["offload"]),
                    "optimizer": OptimizerConfig(**t.sections["optimizer"]),
                    "precision": PrecisionConfig(**t.sections["precision"]),
                    "aio": AIOConfig(**t.sections["aio"]),
                    "prefetch": PrefetchConfig(**t.sections["prefetch"])}
        config = Config(scheduler=scheduler, ignored_keys=tuple(sorted(t.ignored)),
                        notes=tuple(t.notes), **sections, **t.sections["top"])
    except ConfigError as e:
        raise e.retarget(_ds_key_for(e.key, t.origin)) from None
    if t.ignored or t.notes:
        text = "DeepSpeed config translated by offload."
        if t.ignored:
            text += (f" {len(t.ignored)} valid DeepSpeed key(s) are not honoured and were ignored "
                     "(Config.ignored_keys):\n"
                     + "\n".join(f"  {key}: {why}" for key, why in sorted(t.ignored.items())))
        if t.notes:
            text += "\nNotes (Config.notes):\n" + "\n".join(f"  {note}" for note in t.notes)
        warnings.warn(text, DeepSpeedConfigWarning, stacklevel=_caller_stacklevel())
    return config


def _top_level(t: _Translation) -> None:
    """Classify the top-level keys; handle the small sections that only say "off"."""
    ds = t.ds
    known = sorted(_TOP_MAPPED | set(_TOP_IGNORED))
    for key in ds:
        if key in _TOP_REMOVED:
            raise ConfigError(str(key), "was removed from DeepSpeed (0.19 rejects it) and offload "
                              "does not implement it", f"remove {key!r} from the config")
        if key in _TOP_UNSUPPORTED:
            raise ConfigError(str(key), f"is not supported: {_TOP_UNSUPPORTED[key]}",
                              f"remove {key!r}, or train this model with DeepSpeed")
        if key in _TOP_IGNORED:
            t.ignore(str(key), _TOP_IGNORED[key])
        elif key not in _TOP_MAPPED:
            raise ConfigError(str(key), f"is not a DeepSpeed key that offload knows{_suggest(key, known)}",
                              "check the spelling against DeepSpeed's config reference; "
                              "docs/config.md lists every key offload reads")

    # Sections that change training when enabled; disabled, they are honoured as they are.
    for key, why in (("hybrid_engine", "the RLHF hybrid engine is DeepSpeed's"),
                     ("data_efficiency", "data sampling and routing change what the model trains on"),
                     ("torch_autocast", "offload computes in the precision's dtype; autocast would "
                                        "change which ops run in low precision")):
        sec = ds.get(key)
        if sec is None:
            continue
        if not isinstance(sec, Mapping):
            raise _fail_type(key, sec, "a mapping (a JSON object)")
        enabled = _coerce(f"{key}.enabled", sec.get("enabled", False), bool)
        _only_off(f"{key}.enabled", enabled, False, why, f"remove {key!r} or set its enabled to false")
    _only_off("managed_gradient_accumulation", ds.get("managed_gradient_accumulation"), True,
              "offload's engine.step() always owns the accumulation boundary",
              "remove it (offload steps the optimizer every gradient_accumulation_steps micro-batches)")
    if ds.get("sequence_parallel_size") is not None:
        _only_off("sequence_parallel_size",
                  _coerce("sequence_parallel_size", ds["sequence_parallel_size"], int), 1,
                  "offload has no sequence parallelism", "remove it")
    tp = ds.get("tensor_parallel")
    if tp is not None:
        # Only the sizes matter here; size 1 means no tensor parallelism.
        tp = _section("tensor_parallel", tp, list(tp) if isinstance(tp, Mapping) else [])
        for name in ("autotp_size", "tp_size"):
            if tp.get(name) is not None:
                _only_off(f"tensor_parallel.{name}", _coerce(f"tensor_parallel.{name}", tp[name], int),
                          1, "offload has no tensor parallelism", "remove 'tensor_parallel'")
    if ds.get("gradient_allreduce_op") is not None:
        op = _coerce("gradient_allreduce_op", ds["gradient_allreduce_op"], Literal["mean", "sum"])
        _only_off("gradient_allreduce_op", op, "mean",
                  "summed gradients would change the update; offload averages over ranks as torch "
                  "DDP does", "remove it or set 'mean'")

    data_types = _section("data_types", ds.get("data_types"), _DATA_TYPES_KEYS)
    grad_dtype = data_types.get("grad_accum_dtype")
    if grad_dtype not in (None, "fp32", "float32", "torch.float32", "float"):
        raise ConfigError("data_types.grad_accum_dtype", f"= {grad_dtype!r} is not supported: offload "
                          "accumulates gradients in fp32", "remove it or set 'fp32'")
    for name in ("param_dtype", "buffer_dtype"):
        _only_off(f"data_types.{name}", data_types.get(name), None,
                  "offload keeps parameters in the precision's dtype and buffers as loaded",
                  f"remove data_types.{name} and choose the dtype with bf16 / fp16")
    if "keep_in_fp32_modules" in data_types:
        t.ignore("data_types.keep_in_fp32_modules", "offload keeps buffers in their loaded dtype")


def _precision(t: _Translation) -> int:
    """fp16 / bf16 -> precision; returns the compute dtype's bytes per element."""
    ds = t.ds
    fp16 = _section("fp16", ds.get("fp16"), _FP16_KEYS)
    if "bf16" in ds and "bfloat16" in ds:
        raise ConfigError("bfloat16", "is given together with 'bf16' (its newer name)", "keep only 'bf16'")
    bf16_key = "bfloat16" if "bfloat16" in ds else "bf16"
    bf16 = _section(bf16_key, ds.get(bf16_key), _BF16_KEYS)
    fp16_on = _coerce("fp16.enabled", fp16.get("enabled", False), bool)
    bf16_on = _coerce(f"{bf16_key}.enabled", bf16.get("enabled", False), bool)
    if fp16_on and bf16_on:
        raise ConfigError("fp16.enabled", f"and {bf16_key}.enabled are both true, but one compute "
                          "dtype is used", "enable at most one of fp16 and bf16")
    dtype = "fp16" if fp16_on else "bf16" if bf16_on else "fp32"
    t.set("precision.dtype", dtype, "fp16.enabled" if fp16_on else f"{bf16_key}.enabled")
    # A disabled section's other keys have no effect in DeepSpeed either: not read, not reported.
    if fp16_on:
        _only_off("fp16.auto_cast", fp16.get("auto_cast"), False, "offload does not cast the "
                  "model's inputs", "cast inputs to fp16 yourself and remove fp16.auto_cast")
        _only_off("fp16.consecutive_hysteresis", fp16.get("consecutive_hysteresis"), False,
                  "offload's loss scaler does not refill hysteresis", "remove it")
        _only_off("fp16.fp16_master_weights_and_grads", fp16.get("fp16_master_weights_and_grads"),
                  False, "offload's master weights are always fp32", "remove it")
        for name in ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                     "min_loss_scale"):
            if name in fp16:
                t.set(f"precision.{name}", fp16[name], f"fp16.{name}")
    if bf16_on:
        _only_off(f"{bf16_key}.bf16_master_weights_and_grads", bf16.get("bf16_master_weights_and_grads"),
                  False, "offload's master weights and gradient shards are always fp32", "remove it")
        _only_off(f"{bf16_key}.bf16_optimizer_states", bf16.get("bf16_optimizer_states"), False,
                  "it requires bf16 master weights, which offload does not keep",
                  "remove it; offload's own format has optimizer.moments_dtype: bf16 (bf16 moments, "
                  "fp32 master weights)")
        for name, why in (("immediate_grad_update", "an implementation detail of DeepSpeed's bf16 optimizer"),
                          ("check_grad_overflow", "offload checks for overflow only with fp16"),
                          ("check_overflow", "offload checks for overflow only with fp16")):
            if name in bf16:
                t.ignore(f"{bf16_key}.{name}", why)
    return 4 if dtype == "fp32" else 2


def _zero(t: _Translation, elem_bytes: int) -> None:
    """zero_optimization -> offload (tiers, nvme_path, pinning, budget) and prefetch."""
    raw = t.ds.get("zero_optimization")
    if raw is None or isinstance(raw, bool):
        raise ConfigError("zero_optimization", "is missing, so DeepSpeed would run without ZeRO "
                          "(stage 0), but offload implements ZeRO stage 3 only",
                          'add "zero_optimization": {"stage": 3} (with offload_param / '
                          "offload_optimizer as needed)")
    known = sorted(_ZERO_MAPPED | set(_ZERO_IGNORED) | set(_ZERO_ALIASES) | _ZERO_REMOVED)
    zero: dict[str, Any] = {}
    key_of: dict[str, str] = {}  # canonical name -> the full key as the user spelt it
    for key, value in _section("zero_optimization", raw, known).items():
        full = f"zero_optimization.{key}"
        if key in _ZERO_REMOVED:
            raise ConfigError(full, "was removed from DeepSpeed (0.19 rejects it) and offload does "
                              "not implement it", "remove it")
        name = _ZERO_ALIASES.get(key, key)
        if name in zero:
            raise ConfigError(full, f"and {key_of[name]} are two names for one setting",
                              "keep one of them")
        zero[name], key_of[name] = value, full

    stage = _coerce(key_of.get("stage", "zero_optimization.stage"), zero.get("stage", 0), int)
    if stage != 3:
        raise ConfigError("zero_optimization.stage", f"= {stage} is not supported: offload implements "
                          "ZeRO stage 3 only (parameters, gradients and optimizer states all "
                          "partitioned, which is what lets parameters live on CPU or NVMe); the "
                          "stage decides where state lives, not what the model learns",
                          'set "stage": 3')
    for name, why in (("zero_quantized_weights", "quantised weight gathers change the numerics"),
                      ("zero_quantized_nontrainable_weights", "quantised frozen weights change the numerics"),
                      ("zero_quantized_gradients", "quantised gradient reduction changes the numerics")):
        _only_off(key_of.get(name, name), zero.get(name), False, why, "remove it")
    _only_off(key_of.get("compute_grad_norm", ""), zero.get("compute_grad_norm"), True,
              "ZeRO stage 3 always computes the gradient norm (DeepSpeed rejects false too)", "remove it")
    if zero.get("zenflow") is not None:
        raise ConfigError(key_of["zenflow"], "is not supported: ZenFlow applies stale, partial updates, "
                          "which changes training", "remove it")
    for name, why in _ZERO_IGNORED.items():
        if name in zero:
            t.ignore(key_of[name], why)

    # Deprecated spellings, mapped as DeepSpeed maps them (and, as there, not together with
    # their replacement).
    for old, new in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
        if zero.get(old) is not None:
            if zero.get(new) is not None:
                raise ConfigError(key_of[old], f"is the deprecated form of zero_optimization.{new}, "
                                  "and both are given", f"keep only zero_optimization.{new}")
            if _coerce(key_of[old], zero[old], bool):
                zero[new], key_of[new] = {"device": "cpu"}, key_of[old]

    param_path = key_of.get("offload_param", "zero_optimization.offload_param")
    optim_path = key_of.get("offload_optimizer", "zero_optimization.offload_optimizer")
    param = _section(param_path, zero.get("offload_param"), _OFFLOAD_PARAM_KEYS)
    optim = _section(optim_path, zero.get("offload_optimizer"), _OFFLOAD_OPTIMIZER_KEYS)
    param_device = _coerce(f"{param_path}.device", param.get("device", "none"), _DEVICE)
    optim_device = _coerce(f"{optim_path}.device", optim.get("device", "none"), _DEVICE)

    t.set("offload.param_tier", {"none": "device", "cpu": "cpu", "nvme": "nvme"}[param_device],
          f"{param_path}.device")
    if optim_device == "none":
        t.set("offload.optimizer_tier", "cpu", f"{optim_path}.device")
        t.notes.append(f"{optim_path}.device is 'none' (or the section is missing): DeepSpeed would "
                       "keep optimizer states on the GPU; offload always keeps them in CPU memory and "
                       "updates them with its CPU Adam (the same update), so optimizer_tier is 'cpu'")
    else:
        t.set("offload.optimizer_tier", optim_device, f"{optim_path}.device")

    # One NVMe directory serves both tiers.
    paths: dict[str, str] = {}
    for path, sec, device in ((param_path, param, param_device), (optim_path, optim, optim_device)):
        if device == "nvme":
            if not sec.get("nvme_path"):
                raise ConfigError(f"{path}.nvme_path", "is required when its device is 'nvme'",
                                  "set it to a directory on a local NVMe disk")
            paths[f"{path}.nvme_path"] = _coerce(f"{path}.nvme_path", sec["nvme_path"], str)
        elif "nvme_path" in sec:
            t.ignore(f"{path}.nvme_path", f"its device is {device!r}, not 'nvme'")
    if len(set(paths.values())) > 1:
        (k1, v1), (k2, v2) = paths.items()
        raise ConfigError(k2, f"= {v2!r} differs from {k1} = {v1!r}, but offload keeps both tiers' "
                          "swap files in one directory", "set both nvme_path entries to the same directory")
    if paths:
        key, value = next(iter(paths.items()))
        t.set("offload.nvme_path", value, key)

    # pin_memory: one setting for all host buffers. The stricter (false) wins, since pinning is
    # turned off for a reason (memlock limits, little RAM).
    pins: dict[str, bool] = {}
    if zero.get("cpu_offload_use_pin_memory") is not None:
        pins[key_of["cpu_offload_use_pin_memory"]] = _coerce(
            key_of["cpu_offload_use_pin_memory"], zero["cpu_offload_use_pin_memory"], bool)
    for path, sec in ((param_path, param), (optim_path, optim)):
        if "pin_memory" in sec:
            pins[f"{path}.pin_memory"] = _coerce(f"{path}.pin_memory", sec["pin_memory"], bool)
    if pins:
        t.set("offload.pin_memory", all(pins.values()), next(iter(pins)))
        if len(set(pins.values())) > 1:
            t.notes.append(f"pin_memory differs between {', '.join(pins)}; offload uses one setting "
                           "for all host buffers: false")

    _pinned_budget(t, zero, key_of, param_path, param, param_device, optim_path, optim, optim_device,
                   elem_bytes)
    if "max_in_cpu" in param:
        t.ignore(f"{param_path}.max_in_cpu", "offload caches no NVMe parameters in CPU memory")
    for name, why in _OFFLOAD_OPTIMIZER_IGNORED.items():
        if name in optim:
            t.ignore(f"{optim_path}.{name}", why)

    # DeepSpeed counts parameter elements; offload counts bytes of the compute dtype.
    for name, ours in (("prefetch_bucket_size", "prefetch_bytes"), ("max_reuse_distance", "keep_bytes")):
        if name in zero:
            elements = _coerce(key_of[name], zero[name], int)
            if elements < 0:
                raise _fail(key_of[name], elements, "it must be >= 0 elements", "use 0 to disable")
            t.set(f"prefetch.{ours}", elements * elem_bytes, key_of[name])


def _pinned_budget(t: _Translation, zero: dict[str, Any], key_of: dict[str, str],
                   param_path: str, param: dict[str, Any], param_device: str,
                   optim_path: str, optim: dict[str, Any], optim_device: str, elem_bytes: int) -> None:
    """[Note: pinned budget from DeepSpeed buffers]

    DeepSpeed stages NVMe traffic through fixed buffer pools; offload has one byte budget
    for its pinned staging pool (`offload.pinned_budget_bytes`). We size it from the pools
    DeepSpeed would allocate: for parameters, buffer_count x buffer_size elements of the
    compute dtype (defaults 5 x 1e8); for optimizer states, buffer_count x sub_group_size
    fp32 elements when sub_group_size is given (DeepSpeed sizes those buffers by the largest
    sub-group, known only with the model, so without it offload's default, 1 GiB, is
    added). The budget is an upper bound: the engine allocates what its units need, and
    `initialize` checks that it holds one unit.
    """
    budget = 0
    if param_device == "nvme":
        count = _positive(f"{param_path}.buffer_count", param.get("buffer_count", _PARAM_BUFFER_COUNT),
                          "use e.g. 5 (DeepSpeed's default)")
        size = _positive(f"{param_path}.buffer_size", param.get("buffer_size", _PARAM_BUFFER_SIZE),
                         "use e.g. 100000000 elements (DeepSpeed's default)")
        budget += count * size * elem_bytes
    else:
        for name in ("buffer_count", "buffer_size"):
            if name in param:
                t.ignore(f"{param_path}.{name}", "only used when parameters are on NVMe")
    sub_group = zero.get("sub_group_size")
    if optim_device == "nvme":
        count = _positive(f"{optim_path}.buffer_count", optim.get("buffer_count", _OPTIMIZER_BUFFER_COUNT),
                          "use e.g. 4 (DeepSpeed's default)")
        if sub_group is not None:
            budget += count * _positive(key_of["sub_group_size"], sub_group,
                                        "use e.g. 1000000000 elements (DeepSpeed's default)") * 4
        else:
            budget += OffloadConfig.pinned_budget_bytes
    else:
        if "buffer_count" in optim:
            t.ignore(f"{optim_path}.buffer_count", "only used when optimizer states are on NVMe")
        if sub_group is not None:
            t.ignore(key_of["sub_group_size"], "offload's optimizer step is pipelined per unit")
    if budget:
        sources = [k for k in (f"{param_path}.buffer_size", key_of.get("sub_group_size")) if k]
        t.set("offload.pinned_budget_bytes", budget, sources[0])


def _optimizer(t: _Translation) -> None:
    """optimizer -> optimizer, with DeepSpeed's Adam/AdamW semantics and defaults."""
    if t.ds.get("optimizer") is None:
        return
    opt = _section("optimizer", t.ds["optimizer"], ("type", "params", "legacy_fusion"))
    if "legacy_fusion" in opt:
        t.ignore("optimizer.legacy_fusion", "fused-kernel choice")
    if "type" not in opt:
        raise ConfigError("optimizer.type", "is missing", "set it to 'Adam' or 'AdamW'")
    name = _coerce("optimizer.type", opt["type"], str)
    if name.lower() not in ("adam", "adamw"):  # DeepSpeed lower-cases its optimizer names
        raise ConfigError("optimizer.type", f"= {name!r} is not supported: offload's optimizer is its "
                          "CPU Adam/AdamW", "use 'Adam' or 'AdamW' (or train this model with DeepSpeed)")
    params = _section("optimizer.params", opt.get("params"), _OPTIMIZER_PARAMS)
    if "max_grad_norm" in params:
        raise ConfigError("optimizer.params.max_grad_norm", "is not supported (DeepSpeed rejects it too)",
                          "use the top-level 'gradient_clipping' instead")
    _only_off("optimizer.params.amsgrad", params.get("amsgrad"), False,
              "offload's Adam has no AMSGrad variant", "remove it")
    _only_off("optimizer.params.bias_correction", params.get("bias_correction"), True,
              "offload's Adam always applies bias correction", "remove it")
    _only_off("optimizer.params.fp32_optimizer_states", params.get("fp32_optimizer_states"), True,
              "offload keeps Adam moments in fp32 unless its own optimizer.moments_dtype says bf16",
              "remove it")
    torch_adam = _coerce("optimizer.params.torch_adam", params.get("torch_adam", False), bool)
    adam_w_mode = _coerce("optimizer.params.adam_w_mode", params.get("adam_w_mode", True), bool)
    # DeepSpeed (engine._configure_basic_optimizer): "AdamW" is always decoupled; "Adam" is
    # decoupled too unless adam_w_mode is false. Defaults are those of the class DeepSpeed
    # builds: DeepSpeedCPUAdam / FusedAdam (lr 1e-3, weight_decay 0), or with torch_adam
    # torch.optim.AdamW (weight_decay 0.01) / torch.optim.Adam (0).
    decoupled = name.lower() == "adamw" or adam_w_mode
    t.set("optimizer.type", "AdamW" if decoupled else "Adam", "optimizer.type")
    t.set("optimizer.lr", 1e-3, "optimizer.params.lr")
    t.set("optimizer.weight_decay", 0.01 if torch_adam and decoupled else 0.0,
          "optimizer.params.weight_decay")
    for key in ("lr", "betas", "eps", "weight_decay"):
        if key in params:
            t.set(f"optimizer.{key}", params[key], f"optimizer.params.{key}")
    for key, why in (("torch_adam", "implementation choice (its defaults were applied)"),
                     ("foreach", "implementation choice"),
                     ("set_grad_none", "implementation choice")):
        if key in params:
            t.ignore(f"optimizer.params.{key}", why)


def _scheduler(t: _Translation) -> Optional[SchedulerConfig]:
    if t.ds.get("scheduler") is None:
        return None
    sch = _section("scheduler", t.ds["scheduler"], ("type", "params"))
    if "type" not in sch:
        raise ConfigError("scheduler.type", "is missing", f"set it to one of {', '.join(SCHEDULER_PARAMS)}")
    name = _coerce("scheduler.type", sch["type"], str)
    if name not in SCHEDULER_PARAMS:  # DeepSpeed looks the name up case-sensitively too
        hint = "" if name in _OTHER_DS_SCHEDULES else _suggest(name, SCHEDULER_PARAMS)
        raise ConfigError("scheduler.type", f"= {name!r} is not supported{hint}",
                          f"offload implements {', '.join(SCHEDULER_PARAMS)}; for another schedule "
                          "build a torch scheduler on engine.optimizer or pass "
                          "initialize(..., lr_scheduler=...)")
    # Our keys are DeepSpeed's here (scheduler.params.*), so errors already name them.
    return SchedulerConfig(type=name, params=sch.get("params") or {})


def _batch(t: _Translation, world: int) -> None:
    """Batch sizes with DeepSpeed's arithmetic (runtime/config.py,
    _set_batch_related_parameters and _batch_assertion): any two of the three determine the
    third by integer division, and then train = micro x accumulation x world_size must hold.
    """
    ds = t.ds
    given = {}
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        if ds.get(key) is not None:
            given[key] = _positive(key, ds[key], "use a positive integer")
    train = given.get("train_batch_size")
    micro = given.get("train_micro_batch_size_per_gpu")
    accum = given.get("gradient_accumulation_steps")
    if train is not None:
        if micro is not None and accum is None:
            accum = train // micro // world
        elif accum is not None and micro is None:
            micro = train // world // accum
        elif micro is None and accum is None:
            accum, micro = 1, train // world
        if not micro or not accum or train != micro * accum * world:
            raise ConfigError("train_batch_size", f"= {train} does not equal train_micro_batch_size_per_gpu "
                              f"({micro}) x gradient_accumulation_steps ({accum}) x world size ({world})",
                              "make train_batch_size = micro batch x accumulation steps x number of "
                              "processes, or give only two of the three")
    if accum is not None:
        t.set("gradient_accumulation_steps", accum, "gradient_accumulation_steps")
    if micro is not None:
        t.set("train_micro_batch_size_per_gpu", micro, "train_micro_batch_size_per_gpu")
    if ds.get("gradient_clipping") is not None:
        t.set("gradient_clipping", ds["gradient_clipping"], "gradient_clipping")


def _aio(t: _Translation) -> None:
    aio = _section("aio", t.ds.get("aio"), _AIO_KEYS)
    if "intra_op_parallelism" in aio and "thread_count" in aio:
        raise ConfigError("aio.thread_count", "and aio.intra_op_parallelism (its newer name) are both "
                          "given", "keep only aio.intra_op_parallelism")
    # Keys left out keep offload's defaults, not DeepSpeed's (queue_depth 8, one thread):
    # they tune speed only, and offload's are chosen for its own I/O engine.
    for ds_name, ours in (("block_size", "block_size"), ("queue_depth", "queue_depth"),
                          ("intra_op_parallelism", "threads"), ("thread_count", "threads")):
        if ds_name in aio:
            t.set(f"aio.{ours}", aio[ds_name], f"aio.{ds_name}")
    for name, why in (("single_submit", "offload's I/O engine chooses its own submission batching"),
                      ("overlap_events", "offload's I/O engine always overlaps completions"),
                      ("use_gds", "offload has no GPUDirect Storage path")):
        if name in aio:
            t.ignore(f"aio.{name}", why)
