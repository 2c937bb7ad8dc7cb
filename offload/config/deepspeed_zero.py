"""zero_optimization of a DeepSpeed config, translated: tiers, the NVMe directory, pinning,
the pinned staging budget and the prefetch budgets.

Part of `offload.config.deepspeed.translate_deepspeed` (that module's docstring has the
kinds of keys); this section is the largest and the one whose units differ most from ours
(DeepSpeed counts elements, offload bytes), so it has a file of its own.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from offload.config.checks import ConfigError, coerce, positive_int, require, rule_error
from offload.config.deepspeed_keys import Translation, class_names, only_off, read_section
from offload.config.sections import OffloadConfig, ShardingConfig

__all__ = ["translate_zero", "translate_sharding"]

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
    "zero_quantized_gradients", "zenflow", "leaf_module", "gather_16bit_weights_on_model_save",
    "zero_hpz_partition_size",
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
    "stage3_gather_fp16_weights_on_model_save": "use engine.full_state_dict()",
    "module_granularity_threshold": "offload's units are chosen by unit_modules",
    "use_all_reduce_for_fetch_params": "communication detail",
    "allgather_sequential": "communication detail",
    "ignore_unused_parameters": "offload accepts unused parameters",
    "legacy_stage1": "a stage 1 option",
    "round_robin_gradients": "a stage 1/2 option",
    "parameter_alignment": "a stage 1/2 option",
    "memory_efficient_linear": "offload patches no modules",
    "pipeline_loading_checkpoint": "checkpoint detail",
    "override_module_apply": "offload patches no modules",
    "log_trace_cache_warnings": "logging",
    "enable_sanity_checks": "debugging",
    "save_muon_momentum_buffer_in_memory": "offload has no Muon optimizer",
}

_ZERO_REMOVED = frozenset({"mics_shard_size", "mics_hierarchical_params_gather", "zeropp_loco_param"})

_OFFLOAD_PARAM_KEYS = ("device", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pin_memory")
_OFFLOAD_OPTIMIZER_KEYS = ("device", "nvme_path", "buffer_count", "pin_memory", "pipeline_read",
                           "pipeline_write", "fast_init", "ratio", "super_offload", "cpuadam_cores_perc")
_OFFLOAD_OPTIMIZER_IGNORED = {
    "pipeline_read": "offload always pipelines optimizer-state reads",
    "pipeline_write": "offload always pipelines optimizer-state writes",
    "fast_init": "initialisation detail",
    "super_offload": "a DeepSpeed superchip mode",
    "cpuadam_cores_perc": "use cpu_adam_threads in offload's format",
}
_PARAM_BUFFER_COUNT = 5
_PARAM_BUFFER_SIZE = 100_000_000
_OPTIMIZER_BUFFER_COUNT = 4
"""DeepSpeed's defaults for offload_param.buffer_count / buffer_size (elements) and
offload_optimizer.buffer_count (deepspeed/runtime/zero/offload_config.py)."""
_DEVICE = Literal["none", "cpu", "nvme"]


def _ratio(t: Translation, value: Any, key: str, optim_device: str) -> None:
    """ZeRO-Offload++'s `offload_optimizer.ratio`: the share of the optimizer states (by bytes)
    updated on the CPU; the rest live on the GPU and update there. offload's
    `optimizer_device_fraction` is its complement (the root and first blocks go first)."""
    ratio = coerce(key, value, float)
    require(0.0 <= ratio <= 1.0, key, ratio, "the share of the optimizer states on the CPU must be "
            "between 0 and 1", "e.g. 0.7 keeps 70 % on the CPU and updates 30 % on the GPU")
    if optim_device == "none":
        t.ignore(key, "the optimizer states are all on the GPU (device 'none')")
    elif ratio < 1.0:
        t.set("offload.optimizer_device_fraction", round(1.0 - ratio, 12), key)


def _removed(full: str, key: str, value: Any) -> ConfigError:
    """The error for a key DeepSpeed 0.19 removed; MiCS's shard size names offload's own
    section, which does what it did (shard within groups, replicate across)."""
    if key == "mics_shard_size":
        return ConfigError(full, f"= {value!r} was removed from DeepSpeed (0.19 rejects it); offload's "
                           "hybrid sharding does what MiCS did (shard within groups of ranks, "
                           "replicate across them)",
                           f'remove it and add offload\'s section "sharding": {{"shard_group_size": '
                           f'{value!r}}} at the top level of this config (docs/multinode.md)')
    return ConfigError(full, "was removed from DeepSpeed (0.19 rejects it) and offload does "
                       "not implement it", "remove it")


def translate_sharding(t: Translation) -> None:
    """A DeepSpeed config's top-level `sharding`: offload's own section (HSDP, hpZ), applied
    after zero_optimization, so it wins over `zero_hpz_partition_size`."""
    names = [f.name for f in dataclasses.fields(ShardingConfig)]
    for key, value in read_section("sharding", t.ds.get("sharding"), names).items():
        t.set(f"sharding.{key}", value, f"sharding.{key}")


def translate_zero(t: Translation, elem_bytes: int) -> None:
    """zero_optimization -> offload (tiers, nvme_path, pinning, budget) and prefetch."""
    raw = t.ds.get("zero_optimization")
    if raw is None or isinstance(raw, bool):
        raise ConfigError("zero_optimization", "is missing, so DeepSpeed would run without ZeRO "
                          "(stage 0), but offload implements ZeRO stages 1, 2 and 3",
                          'add "zero_optimization": {"stage": 2} (or 3, with offload_param / '
                          "offload_optimizer as needed)")
    known = sorted(_ZERO_MAPPED | set(_ZERO_IGNORED) | set(_ZERO_ALIASES) | _ZERO_REMOVED)
    zero: dict[str, Any] = {}
    key_of: dict[str, str] = {}  # canonical name -> the full key as the user spelt it
    for key, value in read_section("zero_optimization", raw, known).items():
        full = f"zero_optimization.{key}"
        if key in _ZERO_REMOVED:
            raise _removed(full, key, value)
        name = _ZERO_ALIASES.get(key, key)
        if name in zero:
            raise ConfigError(full, f"and {key_of[name]} are two names for one setting",
                              "keep one of them")
        zero[name], key_of[name] = value, full

    stage = coerce(key_of.get("stage", "zero_optimization.stage"), zero.get("stage", 0), int)
    if stage not in (1, 2, 3):
        raise ConfigError("zero_optimization.stage", f"= {stage} is not supported: offload implements "
                          "ZeRO stages 1, 2 and 3 (stage 0, plain data parallelism with every "
                          "rank holding the whole optimizer state, is not); the stage decides "
                          "where state lives, not what the model learns",
                          'set "stage": 2 (ZeRO-Offload) or 3')
    t.set("top.zero_stage", stage, key_of.get("stage", "zero_optimization.stage"))
    if stage < 3 and zero.get("offload_param") is not None:
        device = zero["offload_param"].get("device", "none") if isinstance(zero["offload_param"], dict) else None
        if device not in (None, "none"):
            raise ConfigError(key_of.get("offload_param", "zero_optimization.offload_param"),
                              f"needs stage 3 (DeepSpeed offloads parameters only at stage 3), but "
                              f"stage is {stage}", 'set "stage": 3, or remove offload_param')
    for name, why in (("zero_quantized_weights", "quantised weight gathers change the numerics"),
                      ("zero_quantized_nontrainable_weights", "quantised frozen weights change the numerics"),
                      ("zero_quantized_gradients", "quantised gradient reduction changes the numerics")):
        only_off(key_of.get(name, name), zero.get(name), False, why, "remove it")
    only_off(key_of.get("compute_grad_norm", ""), zero.get("compute_grad_norm"), True,
             "ZeRO stage 3 always computes the gradient norm (DeepSpeed rejects false too)", "remove it")
    if zero.get("zero_hpz_partition_size") is not None and stage < 3:
        t.ignore(key_of["zero_hpz_partition_size"], "hpZ's secondary partition exists at stage 3 only "
                 "(DeepSpeed ignores it below)")
    elif zero.get("zero_hpz_partition_size") is not None:
        key = key_of["zero_hpz_partition_size"]  # honoured: offload's sharding.hpz_partition_size
        t.set("sharding.hpz_partition_size", positive_int(key, zero["zero_hpz_partition_size"],
                                                          "use 1 (off) or the ranks per node"), key)
    if zero.get("leaf_module") is not None:
        _leaf_module(t, zero["leaf_module"], key_of["leaf_module"])
    if zero.get("zenflow") is not None:
        raise ConfigError(key_of["zenflow"], "is not supported: ZenFlow applies stale, partial updates, "
                          "which changes training", "remove it")
    for name, why in _ZERO_IGNORED.items():
        if name in zero:
            t.ignore(key_of[name], why)
    # True is what offload always does (save_16bit_model, the Trainer's save_model and
    # full_state_dict write the consolidated weights), so it is honoured, not ignored: the
    # stock Hugging Face ZeRO-3 template sets it, and "use engine.full_state_dict()" would
    # mislead a Trainer user, whose save_model already writes them.
    if "gather_16bit_weights_on_model_save" in zero and not coerce(
            key_of["gather_16bit_weights_on_model_save"], zero["gather_16bit_weights_on_model_save"], bool):
        t.notes.append(f"{key_of['gather_16bit_weights_on_model_save']} is false: DeepSpeed's "
                       "save_16bit_model would then save nothing at stage 3; offload's (and the "
                       "Trainer's save_model) always write the consolidated weights")

    # Deprecated spellings, mapped as DeepSpeed maps them (and, as there, not together with
    # their replacement).
    for old, new in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
        if zero.get(old) is not None:
            if zero.get(new) is not None:
                raise ConfigError(key_of[old], f"is the deprecated form of zero_optimization.{new}, "
                                  "and both are given", f"keep only zero_optimization.{new}")
            if coerce(key_of[old], zero[old], bool):
                zero[new], key_of[new] = {"device": "cpu"}, key_of[old]

    param_path = key_of.get("offload_param", "zero_optimization.offload_param")
    optim_path = key_of.get("offload_optimizer", "zero_optimization.offload_optimizer")
    param = read_section(param_path, zero.get("offload_param"), _OFFLOAD_PARAM_KEYS)
    optim = read_section(optim_path, zero.get("offload_optimizer"), _OFFLOAD_OPTIMIZER_KEYS)
    param_device = coerce(f"{param_path}.device", param.get("device", "none"), _DEVICE)
    optim_device = coerce(f"{optim_path}.device", optim.get("device", "none"), _DEVICE)

    t.set("offload.param_tier", {"none": "device", "cpu": "cpu", "nvme": "nvme"}[param_device],
          f"{param_path}.device")
    if optim_device == "none" and (param_device != "none" or "device" in optim):
        # DeepSpeed keeps the optimizer states on the GPU and updates them there: so does offload
        # (the optimizer tier "device": [Note: the update split] in offload/storage/device_states.py)
        t.set("offload.optimizer_tier", "device", f"{optim_path}.device")
    elif optim_device == "none":
        t.set("offload.optimizer_tier", "cpu", f"{optim_path}.device")
        t.notes.append(f"{optim_path} is missing, and so is every offload section: offload keeps the "
                       "optimizer states in CPU memory and updates them with its CPU Adam (the same "
                       "update), so optimizer_tier is 'cpu'; set offload_optimizer.device to 'none' to "
                       "keep them on the GPU as DeepSpeed would")
    else:
        t.set("offload.optimizer_tier", optim_device, f"{optim_path}.device")
    if optim.get("ratio") is not None:
        _ratio(t, optim["ratio"], f"{optim_path}.ratio", optim_device)

    # One NVMe directory serves both tiers.
    paths: dict[str, str] = {}
    for path, sec, device in ((param_path, param, param_device), (optim_path, optim, optim_device)):
        if device == "nvme":
            if not sec.get("nvme_path"):
                raise ConfigError(f"{path}.nvme_path", "is required when its device is 'nvme'",
                                  "set it to a directory on a local NVMe disk")
            paths[f"{path}.nvme_path"] = coerce(f"{path}.nvme_path", sec["nvme_path"], str)
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
        pins[key_of["cpu_offload_use_pin_memory"]] = coerce(
            key_of["cpu_offload_use_pin_memory"], zero["cpu_offload_use_pin_memory"], bool)
    for path, sec in ((param_path, param), (optim_path, optim)):
        if "pin_memory" in sec:
            pins[f"{path}.pin_memory"] = coerce(f"{path}.pin_memory", sec["pin_memory"], bool)
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
            elements = coerce(key_of[name], zero[name], int)
            if elements < 0:
                raise rule_error(key_of[name], elements, "it must be >= 0 elements", "use 0 to disable")
            t.set(f"prefetch.{ours}", elements * elem_bytes, key_of[name])


def _pinned_budget(t: Translation, zero: dict[str, Any], key_of: dict[str, str],
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
        count = positive_int(f"{param_path}.buffer_count", param.get("buffer_count", _PARAM_BUFFER_COUNT),
                             "use e.g. 5 (DeepSpeed's default)")
        size = positive_int(f"{param_path}.buffer_size", param.get("buffer_size", _PARAM_BUFFER_SIZE),
                            "use e.g. 100000000 elements (DeepSpeed's default)")
        budget += count * size * elem_bytes
    else:
        for name in ("buffer_count", "buffer_size"):
            if name in param:
                t.ignore(f"{param_path}.{name}", "only used when parameters are on NVMe")
    sub_group = zero.get("sub_group_size")
    if optim_device == "nvme":
        count = positive_int(f"{optim_path}.buffer_count", optim.get("buffer_count", _OPTIMIZER_BUFFER_COUNT),
                             "use e.g. 4 (DeepSpeed's default)")
        if sub_group is not None:
            # A count of parameters per sub-group, and a sub-group never splits a parameter:
            # DeepSpeed's buffers hold the largest sub-group, at least the largest parameter.
            # So a small sub_group_size (DeepSpeed's tests use 100) is no budget: the
            # optimizer part is never below offload's default.
            groups = count * positive_int(key_of["sub_group_size"], sub_group,
                                          "use e.g. 1000000000 elements (DeepSpeed's default)") * 4
            budget += max(groups, OffloadConfig.pinned_budget_bytes)
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


def _leaf_module(t: Translation, raw: Any, path: str) -> None:
    """zero_optimization.leaf_module {classes, names, name_suffixes} -> leaf_modules. Names
    and suffixes pick modules by where they sit; offload names classes (or marks modules with
    `set_z3_leaf_modules`), so a non-empty list of either is refused rather than ignored: a
    leaf that is not one desynchronises ranks that route differently."""
    sec = read_section(path, raw, ("classes", "names", "name_suffixes"))
    for key in ("names", "name_suffixes"):
        if sec.get(key):
            raise ConfigError(f"{path}.{key}", f"= {sec[key]!r}: offload chooses leaf modules by class",
                              f"list their classes in {path}.classes, or call "
                              "offload.compat.deepspeed.utils.set_z3_leaf_modules(model, [classes])")
    t.set("top.leaf_modules", class_names(f"{path}.classes", sec.get("classes") or []), f"{path}.classes")
