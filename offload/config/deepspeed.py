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

The top-level keys' kinds and the `Translation` ledger are in deepspeed_keys.py,
zero_optimization's translation in deepspeed_zero.py; reading files and deciding that a
mapping is a DeepSpeed config at all is load.py's.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any, Literal, Mapping, Optional

from offload.config.checks import (
    ConfigError,
    caller_stacklevel,
    DeepSpeedConfigWarning,
    coerce,
    did_you_mean,
    positive_int,
    type_error,
)
from offload.config.deepspeed_keys import (
    class_names,
    DS_ONLY_TOP_KEYS,
    TOP_IGNORED,
    TOP_MAPPED,
    TOP_REMOVED,
    TOP_UNSUPPORTED,
    Translation,
    only_off,
    read_section,
)
from offload.config.deepspeed_io import translate_aio, translate_checkpoint, translate_prefetch
from offload.config.deepspeed_zero import translate_sharding, translate_zero
from offload.config.sections import (
    SCHEDULER_PARAMS,
    AIOConfig,
    Config,
    LoggingConfig,
    MonitorsConfig,
    OffloadConfig,
    OptimizerConfig,
    PrecisionConfig,
    PrefetchConfig,
    SchedulerConfig,
    ShardingConfig,
    ActivationCheckpointingConfig,
)

__all__ = ["translate_deepspeed", "DS_ONLY_TOP_KEYS"]

# -- keys of the sections translated here (the top level's: deepspeed_keys.py;
# zero_optimization's: deepspeed_zero.py) ---------------------------------------------------

_OPTIMIZER_PARAMS = ("lr", "betas", "eps", "weight_decay", "bias_correction", "amsgrad",
                     "adam_w_mode", "torch_adam", "fp32_optimizer_states", "foreach",
                     "set_grad_none", "max_grad_norm", "lr_decay", "initial_accumulator_value",
                     "momentum", "dampening", "nesterov", "maximize", "differentiable", "fused")
_FP16_KEYS = ("enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window",
              "hysteresis", "consecutive_hysteresis", "min_loss_scale", "fp16_master_weights_and_grads")
_BF16_KEYS = ("enabled", "immediate_grad_update", "check_grad_overflow", "check_overflow",
              "bf16_master_weights_and_grads", "bf16_optimizer_states")
_MONITOR_KEYS = {"tensorboard": ("tensorboard", ("enabled", "output_path", "job_name")),
                 "csv_monitor": ("csv", ("enabled", "output_path", "job_name")),
                 "wandb": ("wandb", ("enabled", "group", "team", "project"))}
"""DeepSpeed's monitor blocks (monitor/config.py) -> offload's monitors section and their keys."""
_DATA_TYPES_KEYS = ("grad_accum_dtype", "param_dtype", "buffer_dtype", "keep_in_fp32_modules")
_OTHER_DS_SCHEDULES = ("LRRangeTest", "OneCycle")
_DS_FLOAT_DTYPES = {
    **dict.fromkeys(("fp32", "float32", "torch.float32", "float"), "fp32"),
    **dict.fromkeys(("bf16", "bfloat16", "torch.bfloat16"), "bf16"),
    **dict.fromkeys(("fp16", "float16", "torch.float16", "half"), "fp16"),
}
"""DeepSpeed's names of the floating dtypes (runtime/config.py DtypeEnum) -> offload's."""


def _rank_now() -> int:
    """This process's rank, as `_world_size_now` finds the world size: an initialised
    torch.distributed, else $RANK (torchrun sets it), else 0."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


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
        raise type_error("config", ds, "a mapping (a DeepSpeed config dict)")
    _reject_auto(ds)
    t = Translation(ds)
    _top_level(t)
    elem_bytes = _precision(t)
    translate_zero(t, elem_bytes)
    _optimizer(t)
    scheduler = _scheduler(t)
    _batch(t, _world_size_now() if world_size is None else world_size)
    translate_aio(t)
    _logging(t)
    _activation_checkpointing(t)
    translate_prefetch(t)
    translate_sharding(t)
    translate_checkpoint(t)
    try:
        sections = t.sections
        config = Config(offload=OffloadConfig(**sections["offload"]),
                        optimizer=OptimizerConfig(**sections["optimizer"]),
                        precision=PrecisionConfig(**sections["precision"]),
                        aio=AIOConfig(**sections["aio"]),
                        prefetch=PrefetchConfig(**sections["prefetch"]),
                        logging=LoggingConfig(**sections["logging"]),
                        monitors=MonitorsConfig(**sections["monitors"]),
                        activation_checkpointing=ActivationCheckpointingConfig(
                            **sections["activation_checkpointing"]),
                        sharding=ShardingConfig(**sections["sharding"]),
                        scheduler=scheduler, ignored_keys=tuple(sorted(t.ignored)),
                        notes=tuple(t.notes), **sections["top"])
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
        if _rank_now() == 0:  # one report per run, not one per rank (the ranks' are the same)
            warnings.warn(text, DeepSpeedConfigWarning, stacklevel=caller_stacklevel())
    return config


OFFLOAD_EXTENSIONS = ("unit_modules", "leaf_modules", "prefetch", "sharding")
"""offload's keys that a DeepSpeed-format config may carry at its top level (docs/config.md):
the unit choice, and offload's `prefetch` section (e.g. `"prefetch": {"optimizer_in_backward":
false}`, the fix for reading gradients between backward and step), whose keys win over what
the translation derived from `zero_optimization`; and its `sharding` section (HSDP, hpZ: the
place DeepSpeed's removed `mics_shard_size` points at), which wins over
`zero_optimization.zero_hpz_partition_size` in the same way."""


_DS_OWN_AUTO = ("data_types.keep_in_fp32_modules", "pipeline.", "zero_optimization.zenflow.")
"""Where "auto" is DeepSpeed's own value, not the Hugging Face placeholder."""


def _auto_keys(value: Any, path: str = "") -> list[str]:
    """The paths of every "auto" in a config, in order."""
    if isinstance(value, str) and value == "auto":
        return [] if path.startswith(_DS_OWN_AUTO) or path in _DS_OWN_AUTO else [path]
    if isinstance(value, Mapping):
        return [k for key, sub in value.items() for k in _auto_keys(sub, f"{path}.{key}" if path else str(key))]
    if isinstance(value, list):
        return [k for i, sub in enumerate(value) for k in _auto_keys(sub, f"{path}[{i}]")]
    return []


def _reject_auto(ds: Mapping[str, Any]) -> None:
    """Hugging Face's "auto" placeholders, all reported in one error: they are filled from
    the TrainingArguments (offload.integrations.hf.resolve_auto), not by the translation."""
    keys = _auto_keys(ds)
    if keys:
        others = f" (and so are {', '.join(keys[1:])})" if len(keys) > 1 else ""
        raise ConfigError(keys[0], f"= 'auto'{others}: the Hugging Face Trainer's placeholder, which "
                          "offload does not resolve by itself",
                          "fill them from your TrainingArguments with offload.integrations.hf."
                          "resolve_auto(config, training_args, num_training_steps=..., model=...) "
                          "(it fills the keys the Trainer fills), or replace each with a concrete value")


def _top_level(t: Translation) -> None:
    """Classify the top-level keys; handle the small sections that only say "off"."""
    ds = t.ds
    known = sorted(TOP_MAPPED | set(TOP_IGNORED) | set(OFFLOAD_EXTENSIONS))
    for key in ("unit_modules", "leaf_modules"):  # offload's own keys a DeepSpeed config may carry
        if key in ds:
            t.set(key, class_names(key, ds[key]), key)
    for key in ds:
        if key in OFFLOAD_EXTENSIONS:
            continue
        if key in TOP_REMOVED:
            raise ConfigError(str(key), "was removed from DeepSpeed (0.19 rejects it) and offload "
                              "does not implement it", f"remove {key!r} from the config")
        if key in TOP_UNSUPPORTED:
            raise ConfigError(str(key), f"is not supported: {TOP_UNSUPPORTED[key]}",
                              f"remove {key!r}, or train this model with DeepSpeed")
        if key in TOP_IGNORED:
            t.ignore(str(key), TOP_IGNORED[key])
        elif key not in TOP_MAPPED:
            raise ConfigError(str(key), f"is not a DeepSpeed key that offload knows{did_you_mean(key, known)}",
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
            raise type_error(key, sec, "a mapping (a JSON object)")
        enabled = coerce(f"{key}.enabled", sec.get("enabled", False), bool)
        only_off(f"{key}.enabled", enabled, False, why, f"remove {key!r} or set its enabled to false")
    only_off("managed_gradient_accumulation", ds.get("managed_gradient_accumulation"), True,
             "offload's engine.step() always owns the accumulation boundary",
             "remove it (offload steps the optimizer every gradient_accumulation_steps micro-batches)")
    if ds.get("sequence_parallel_size") is not None:
        only_off("sequence_parallel_size",
                 coerce("sequence_parallel_size", ds["sequence_parallel_size"], int), 1,
                 "offload has no sequence parallelism", "remove it")
    tp = ds.get("tensor_parallel")
    if tp is not None:
        # Only the sizes matter here; size 1 means no tensor parallelism.
        tp = read_section("tensor_parallel", tp, list(tp) if isinstance(tp, Mapping) else [])
        for name in ("autotp_size", "tp_size"):
            if tp.get(name) is not None:
                only_off(f"tensor_parallel.{name}", coerce(f"tensor_parallel.{name}", tp[name], int),
                         1, "offload has no tensor parallelism", "remove 'tensor_parallel'")
    if ds.get("gradient_allreduce_op") is not None:
        op = coerce("gradient_allreduce_op", ds["gradient_allreduce_op"], Literal["mean", "sum"])
        only_off("gradient_allreduce_op", op, "mean",
                 "summed gradients would change the update; offload averages over ranks as torch "
                 "DDP does", "remove it or set 'mean'")

    data_types = read_section("data_types", ds.get("data_types"), _DATA_TYPES_KEYS)
    grad_dtype = data_types.get("grad_accum_dtype")
    if grad_dtype not in (None, "fp32", "float32", "torch.float32", "float"):
        raise ConfigError("data_types.grad_accum_dtype", f"= {grad_dtype!r} is not supported: offload "
                          "accumulates gradients in fp32", "remove it or set 'fp32'")
    only_off("data_types.param_dtype", data_types.get("param_dtype"), None,
             "offload keeps parameters in the precision's dtype",
             "remove data_types.param_dtype and choose the dtype with bf16 / fp16")
    # Buffers: both keys mean what they mean in DeepSpeed (runtime/engine.py
    # _cast_module_mixed_precision, runtime/keep_in_fp32.py); absent = keep the loaded dtype.
    buffer_dtype = data_types.get("buffer_dtype")
    if buffer_dtype is not None:
        if not isinstance(buffer_dtype, str) or buffer_dtype not in _DS_FLOAT_DTYPES:
            raise ConfigError("data_types.buffer_dtype", f"= {buffer_dtype!r} is not a floating dtype "
                              "DeepSpeed names", "use 'fp32', 'bf16' or 'fp16', or remove it to keep "
                              "buffers in their loaded dtype")
        t.set("precision.buffer_dtype", _DS_FLOAT_DTYPES[buffer_dtype], "data_types.buffer_dtype")
    keep = data_types.get("keep_in_fp32_modules", "auto")
    if keep != "auto":
        if not (isinstance(keep, list) and all(isinstance(n, str) for n in keep)):
            raise type_error("data_types.keep_in_fp32_modules", keep, "'auto' or a list of name patterns")
        t.set("precision.keep_in_fp32_modules", tuple(keep), "data_types.keep_in_fp32_modules")


def _precision(t: Translation) -> int:
    """fp16 / bf16 -> precision; returns the compute dtype's bytes per element."""
    ds = t.ds
    fp16 = read_section("fp16", ds.get("fp16"), _FP16_KEYS)
    if "bf16" in ds and "bfloat16" in ds:
        raise ConfigError("bfloat16", "is given together with 'bf16' (its newer name)", "keep only 'bf16'")
    bf16_key = "bfloat16" if "bfloat16" in ds else "bf16"
    bf16 = read_section(bf16_key, ds.get(bf16_key), _BF16_KEYS)
    fp16_on = coerce("fp16.enabled", fp16.get("enabled", False), bool)
    bf16_on = coerce(f"{bf16_key}.enabled", bf16.get("enabled", False), bool)
    if fp16_on and bf16_on:
        raise ConfigError("fp16.enabled", f"and {bf16_key}.enabled are both true, but one compute "
                          "dtype is used", "enable at most one of fp16 and bf16")
    dtype = "fp16" if fp16_on else "bf16" if bf16_on else "fp32"
    t.set("precision.dtype", dtype, "fp16.enabled" if fp16_on else f"{bf16_key}.enabled")
    # A disabled section's other keys have no effect in DeepSpeed either: not read, not reported.
    if fp16_on:
        only_off("fp16.auto_cast", fp16.get("auto_cast"), False, "offload does not cast the "
                 "model's inputs", "cast inputs to fp16 yourself and remove fp16.auto_cast")
        only_off("fp16.consecutive_hysteresis", fp16.get("consecutive_hysteresis"), False,
                 "offload's loss scaler does not refill hysteresis", "remove it")
        only_off("fp16.fp16_master_weights_and_grads", fp16.get("fp16_master_weights_and_grads"),
                 False, "offload's master weights are always fp32", "remove it")
        for name in ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                     "min_loss_scale"):
            if name in fp16:
                t.set(f"precision.{name}", fp16[name], f"fp16.{name}")
    if bf16_on:
        only_off(f"{bf16_key}.bf16_master_weights_and_grads", bf16.get("bf16_master_weights_and_grads"),
                 False, "offload's master weights and gradient shards are always fp32", "remove it")
        only_off(f"{bf16_key}.bf16_optimizer_states", bf16.get("bf16_optimizer_states"), False,
                 "it requires bf16 master weights, which offload does not keep",
                 "remove it; offload's own format has optimizer.moments_dtype: bf16 (bf16 moments, "
                 "fp32 master weights)")
        if "immediate_grad_update" in bf16:
            t.ignore(f"{bf16_key}.immediate_grad_update", "an implementation detail of DeepSpeed's bf16 optimizer")
        for name in ("check_overflow", "check_grad_overflow"):  # the later one wins, as in DeepSpeed
            if name in bf16:
                # DeepSpeed skips a bf16 step whose gradients overflow: offload's non-finite
                # guard (nonfinite_loss 'skip', the default) is that check; False turns it off.
                value = bf16[name]
                if not isinstance(value, bool):
                    raise type_error(f"{bf16_key}.{name}", value, "true or false")
                t.set("nonfinite_loss", "skip" if value else "off", f"{bf16_key}.{name}")
    return 4 if dtype == "fp32" else 2


_UNRUNNABLE_OPTIMIZERS = {
    "lamb": "LAMB's layer-wise trust ratio needs each parameter's whole norm, which a flat "
            "shard split across ranks does not hold",
    "onebitadam": "1-bit Adam compresses gradient communication with error feedback, which "
                  "offload's reduce-scatter does not do",
    "onebitlamb": "1-bit LAMB compresses communication and needs whole-parameter norms",
    "zerooneadam": "0/1 Adam compresses communication with variance freezing, which offload "
                   "does not do",
    "muadam": "MuAdam (mup) scales each parameter's learning rate by its shape, which the "
              "flat shards do not carry",
    "muadamw": "MuAdamW (mup) scales each parameter's learning rate by its shape",
    "musgd": "MuSGD (mup) scales each parameter's learning rate by its shape, which the flat "
             "shards do not carry",
    "muon": "Muon orthogonalizes each whole weight matrix, which a flat shard does not hold",
}
"""DeepSpeed optimizer names (lower-cased, as it compares them) offload cannot run, and why."""


def _optimizer(t: Translation) -> None:
    """optimizer -> optimizer, with DeepSpeed's semantics and defaults: Adam/AdamW, Lion
    (DeepSpeedCPULion / FusedLion) and Adagrad (DeepSpeedCPUAdagrad / torch.optim.Adagrad)."""
    if t.ds.get("optimizer") is None:
        return
    opt = read_section("optimizer", t.ds["optimizer"], ("type", "params", "legacy_fusion"))
    if "legacy_fusion" in opt:
        t.ignore("optimizer.legacy_fusion", "fused-kernel choice")
    if "type" not in opt:
        raise ConfigError("optimizer.type", "is missing", "set it to 'Adam', 'AdamW', 'Lion' or 'Adagrad'")
    name = coerce("optimizer.type", opt["type"], str)
    low = name.lower()  # DeepSpeed lower-cases its optimizer names
    if low in _UNRUNNABLE_OPTIMIZERS:
        raise ConfigError("optimizer.type", f"= {name!r} is not supported: {_UNRUNNABLE_OPTIMIZERS[low]}",
                          "use 'Adam', 'AdamW', 'Lion' or 'Adagrad' (or train this model with DeepSpeed)")
    if low not in ("adam", "adamw", "lion", "adagrad", "sgd"):
        raise ConfigError("optimizer.type", f"= {name!r} is not supported: offload runs its CPU "
                          "Adam/AdamW, Lion, Adagrad and SGD (and any elementwise torch optimizer "
                          "passed to initialize)", "use 'Adam', 'AdamW', 'Lion', 'Adagrad' or 'SGD' "
                          "(or train this model with DeepSpeed)")
    params = read_section("optimizer.params", opt.get("params"), _OPTIMIZER_PARAMS)
    if "max_grad_norm" in params:
        raise ConfigError("optimizer.params.max_grad_norm", "is not supported (DeepSpeed rejects it too)",
                          "use the top-level 'gradient_clipping' instead")
    only_off("optimizer.params.fp32_optimizer_states", params.get("fp32_optimizer_states"), True,
             "offload keeps Adam moments in fp32 (Lion's momentum, Adagrad's sum too) unless its own "
             "optimizer.moments_dtype says bf16",
             "remove it")
    if low in ("lion", "adagrad"):
        _lion_or_adagrad(t, low, params)
        return
    if low == "sgd":
        _sgd(t, params)
        return
    for key in ("momentum", "dampening", "nesterov"):
        if key in params:
            raise ConfigError(f"optimizer.params.{key}", f"is an SGD parameter, not {name}'s",
                              "remove it")
    for key in ("lr_decay", "initial_accumulator_value"):
        if key in params:
            raise ConfigError(f"optimizer.params.{key}", f"is an Adagrad parameter, not {name}'s",
                              "remove it")
    only_off("optimizer.params.amsgrad", params.get("amsgrad"), False,
             "offload's Adam has no AMSGrad variant", "remove it")
    only_off("optimizer.params.bias_correction", params.get("bias_correction"), True,
             "offload's Adam always applies bias correction", "remove it")
    torch_adam = coerce("optimizer.params.torch_adam", params.get("torch_adam", False), bool)
    adam_w_mode = coerce("optimizer.params.adam_w_mode", params.get("adam_w_mode", True), bool)
    # DeepSpeed (engine._configure_basic_optimizer): "AdamW" is always decoupled; "Adam" is
    # decoupled too unless adam_w_mode is false. Defaults are those of the class DeepSpeed
    # builds: DeepSpeedCPUAdam / FusedAdam (lr 1e-3, weight_decay 0), or with torch_adam
    # torch.optim.AdamW (weight_decay 0.01) / torch.optim.Adam (0).
    decoupled = low == "adamw" or adam_w_mode
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


def _sgd(t: Translation, params: dict[str, Any]) -> None:
    """SGD: DeepSpeed builds torch.optim.SGD from the params (lr 1e-3, momentum, dampening
    and weight_decay 0, nesterov off: torch's defaults); offload runs that class on the
    shards (offload/optim/generic.py)."""
    takes = ("lr", "momentum", "dampening", "weight_decay", "nesterov")
    for key in params:
        if key in ("foreach", "fused", "set_grad_none", "fp32_optimizer_states"):
            if key in ("foreach", "fused", "set_grad_none"):
                t.ignore(f"optimizer.params.{key}", "implementation choice")
            continue
        if key in ("maximize", "differentiable"):
            only_off(f"optimizer.params.{key}", params[key], False,
                     f"offload's SGD does not take {key}", "remove it")
            continue
        if key not in takes:
            raise ConfigError(f"optimizer.params.{key}", "is not a parameter of SGD",
                              f"SGD takes: {', '.join(takes)}")
    t.set("optimizer.type", "SGD", "optimizer.type")
    t.set("optimizer.lr", 1e-3, "optimizer.params.lr")
    t.set("optimizer.weight_decay", 0.0, "optimizer.params.weight_decay")
    for key in takes:
        if key in params:
            t.set(f"optimizer.{key}", params[key], f"optimizer.params.{key}")


def _lion_or_adagrad(t: Translation, low: str, params: dict[str, Any]) -> None:
    """Lion: DeepSpeedCPULion / FusedLion's parameters and defaults (lr 1e-3, betas
    (0.9, 0.999), weight_decay 0). Adagrad: DeepSpeedCPUAdagrad's (lr 1e-2, eps 1e-10,
    weight_decay 0); lr_decay and initial_accumulator_value, which only torch.optim.Adagrad
    (DeepSpeed without a CPU optimizer) takes, pass through, default 0."""
    kind = "Lion" if low == "lion" else "Adagrad"
    takes = {"Lion": ("lr", "betas", "weight_decay"),
             "Adagrad": ("lr", "eps", "weight_decay", "lr_decay", "initial_accumulator_value")}[kind]
    for key in params:
        if key in ("set_grad_none", "foreach", "fp32_optimizer_states"):
            continue
        if key == "amsgrad" and kind == "Adagrad":
            only_off("optimizer.params.amsgrad", params[key], False,
                     "Adagrad has no AMSGrad variant (DeepSpeedCPUAdagrad ignores it)", "remove it")
            continue
        if key not in takes:
            raise ConfigError(f"optimizer.params.{key}", f"is not a parameter of {kind}",
                              f"{kind} takes: {', '.join(takes)}")
    t.set("optimizer.type", kind, "optimizer.type")
    t.set("optimizer.lr", 1e-3 if kind == "Lion" else 1e-2, "optimizer.params.lr")
    t.set("optimizer.weight_decay", 0.0, "optimizer.params.weight_decay")
    if kind == "Adagrad":
        t.set("optimizer.eps", 1e-10, "optimizer.params.eps")
    for key in takes:
        if key in params:
            t.set(f"optimizer.{key}", params[key], f"optimizer.params.{key}")
    for key in ("set_grad_none", "foreach"):
        if key in params:
            t.ignore(f"optimizer.params.{key}", "implementation choice")


def _scheduler(t: Translation) -> Optional[SchedulerConfig]:
    if t.ds.get("scheduler") is None:
        return None
    sch = read_section("scheduler", t.ds["scheduler"], ("type", "params"))
    if "type" not in sch:
        raise ConfigError("scheduler.type", "is missing", f"set it to one of {', '.join(SCHEDULER_PARAMS)}")
    name = coerce("scheduler.type", sch["type"], str)
    if name not in SCHEDULER_PARAMS:  # DeepSpeed looks the name up case-sensitively too
        hint = "" if name in _OTHER_DS_SCHEDULES else did_you_mean(name, SCHEDULER_PARAMS)
        raise ConfigError("scheduler.type", f"= {name!r} is not supported{hint}",
                          f"offload implements {', '.join(SCHEDULER_PARAMS)}; for another schedule "
                          "build a torch scheduler on engine.optimizer or pass "
                          "initialize(..., lr_scheduler=...)")
    # Our keys are DeepSpeed's here (scheduler.params.*), so errors already name them.
    return SchedulerConfig(type=name, params=sch.get("params") or {})


def _batch(t: Translation, world: int) -> None:
    """Batch sizes with DeepSpeed's arithmetic (runtime/config.py,
    _set_batch_related_parameters and _batch_assertion): any two of the three determine the
    third by integer division, and then train = micro x accumulation x world_size must hold.
    """
    ds = t.ds
    given = {}
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        if ds.get(key) is not None:
            given[key] = positive_int(key, ds[key], "use a positive integer")
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


def _logging(t: Translation) -> None:
    """steps_per_print, wall_clock_breakdown and the monitor blocks -> logging, monitors.

    A key left out keeps offload's default (steps_per_print 10 is DeepSpeed's too; output
    paths 'runs', job name 'offload', W&B project 'offload'); an empty output_path, which
    DeepSpeed resolves to its own default directory, keeps offload's."""
    ds = t.ds
    for key in ("steps_per_print", "wall_clock_breakdown"):
        if ds.get(key) is not None:
            t.set(f"logging.{key}", ds[key], key)
    if ds.get("steps_per_print"):
        t.set("logging.print_unconfigured", True, "steps_per_print")  # DeepSpeed prints by itself
    for ds_name, (ours, keys) in _MONITOR_KEYS.items():
        block = read_section(ds_name, ds.get(ds_name), keys)
        if block.get("output_path") == "":
            del block["output_path"]
        if block:
            t.set(f"monitors.{ours}", block, ds_name)


_ACTIVATION_KEYS = ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
                    "number_checkpoints", "synchronize_checkpoint_boundary", "profile")


def _activation_checkpointing(t: Translation) -> None:
    """DeepSpeed's activation_checkpointing block (deepspeed.checkpointing's settings) ->
    offload's activation_checkpointing section (offload.checkpointing)."""
    block = read_section("activation_checkpointing", t.ds.get("activation_checkpointing"), _ACTIVATION_KEYS)
    if block.get("cpu_checkpointing"):
        t.set("activation_checkpointing.cpu_offload", True, "activation_checkpointing.cpu_checkpointing")
        if not block.get("partition_activations"):
            t.notes.append(
                "activation_checkpointing.cpu_checkpointing is honoured without "
                "partition_activations (DeepSpeed offloads only partitioned checkpoints): "
                "offload.checkpointing.checkpoint keeps every checkpointed region's inputs in "
                "host memory")
    elif "cpu_checkpointing" in block:
        t.set("activation_checkpointing.cpu_offload", False, "activation_checkpointing.cpu_checkpointing")
    for name, why in (
        ("partition_activations", "DeepSpeed splits checkpoints across model-parallel ranks; "
                                  "offload has data parallelism only: each rank's activations are "
                                  "its own micro-batch's, nothing to partition"),
        ("contiguous_memory_optimization", "host copies are one pinned buffer per tensor"),
        ("number_checkpoints", "only used by contiguous_memory_optimization"),
        ("synchronize_checkpoint_boundary", "offload synchronizes only where a copy is needed"),
        ("profile", "use torch.profiler around the step"),
    ):
        if name in block:
            t.ignore(f"activation_checkpointing.{name}", why)
