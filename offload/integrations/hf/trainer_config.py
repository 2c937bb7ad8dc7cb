"""The engine's config for an `OffloadTrainer` run, from the user's config and the
`TrainingArguments`.

The Trainer's arguments drive the loop (batches, accumulation windows, when to clip and
log), the engine does the arithmetic: the two must agree, so every setting both have is
taken from one place and checked against the other.

- A DeepSpeed config (as Trainer users write them, `"auto"` included) is resolved by
  `resolve_auto` with the run's length and the model, by transformers' own rules: "auto"
  takes the training argument, any other value must agree with it (one error lists every
  disagreement). Keys it does not have are not filled, as with DeepSpeed: a DeepSpeed config
  without `gradient_clipping` does not clip, whatever `max_grad_norm` says.
- offload's own format: a setting the config leaves out is filled from the arguments
  (`gradient_accumulation_steps`, `gradient_clipping` from `max_grad_norm`, the precision
  from `bf16`/`fp16`, the CPU from `use_cpu`); one it gives must agree with them, with the
  same one error for every disagreement.
- The optimizer: a config with its own optimizer section runs it over every trainable
  parameter (as DeepSpeed does); without one, the Trainer's AdamW from the arguments
  (learning_rate, adam_beta1/2, adam_epsilon, weight_decay) with its weight-decay split
  (`Trainer.get_decay_parameter_names`: no decay for biases and norms), as `create_optimizer`
  builds it. `args.optim` must then be one of torch's AdamW variants: they all compute the
  update the engine's CPU AdamW computes.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from typing import Any, Mapping, Optional, Union

from offload.config import Config, ConfigError, ConfigTypeError, load_config, read_config_file
from offload.config.load import is_deepspeed_config
from offload.integrations.hf.auto import resolve_auto

__all__ = ["engine_config", "ADAMW_OPTIMS", "ADAMW_8BIT_OPTIMS"]

ADAMW_OPTIMS = frozenset({"adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw_apex_fused"})
"""`TrainingArguments.optim` values whose update the engine's AdamW computes."""

ADAMW_8BIT_OPTIMS = frozenset({"adamw_8bit", "adamw_bnb_8bit", "adamw_torch_8bit"})
"""`TrainingArguments.optim` values the engine runs as AdamW with 8-bit moments
(`optimizer.moments_dtype: "8bit"`, the blockwise definition bitsandbytes and torchao use;
the engine quantises every parameter, where they keep tensors under 4096 elements in fp32)."""

ConfigSource = Union[Config, Mapping[str, Any], str, "os.PathLike[str]", None]


def engine_config(source: ConfigSource, args: Any, *, num_training_steps: Optional[int],
                  model: Any) -> tuple[Config, bool]:
    """(the engine's `Config`, whether it has its own optimizer section) for a Trainer run
    with `args` of `num_training_steps` optimizer steps; see the module docstring."""
    if isinstance(source, Config):
        data: Optional[dict[str, Any]] = None
        config = source
        _check_typed(config, args)
        own_optimizer = True  # a typed Config always has one: the user built it on purpose
    else:
        data = _as_dict(source)
        if is_deepspeed_config(data):
            data = resolve_auto(data, args, num_training_steps=num_training_steps, model=model)
            own_optimizer = "optimizer" in data
        else:
            own_optimizer = "optimizer" in data
            _fill_native(data, args)
        config = load_config(data)
    if not own_optimizer:
        optim = getattr(args, "optim", "adamw_torch")
        optim = str(getattr(optim, "value", optim))  # an OptimizerNames member
        if optim not in ADAMW_OPTIMS | ADAMW_8BIT_OPTIMS:
            raise ConfigError(
                "TrainingArguments.optim", f"= {optim!r}, which the engine cannot run: it runs "
                "AdamW on the CPU over its fp32 shards",
                f"use one of {sorted(ADAMW_OPTIMS)} (the same update), one of "
                f"{sorted(ADAMW_8BIT_OPTIMS)} (8-bit moments), or give the offload config an "
                "optimizer section")
        if optim in ADAMW_8BIT_OPTIMS:  # (a config without an optimizer section: fp32 moments)
            config = dataclasses.replace(
                config, optimizer=dataclasses.replace(config.optimizer, moments_dtype="8bit"))
    return config, own_optimizer


def adamw_groups(model: Any, args: Any, decay_names: Any) -> list[dict[str, Any]]:
    """The Trainer's two AdamW groups over the trainable parameters (the second without
    weight decay), with the arguments' hyperparameters; empty groups dropped."""
    hyper = {"lr": args.learning_rate, "betas": (args.adam_beta1, args.adam_beta2),
             "eps": args.adam_epsilon}
    decay = set(decay_names)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in named if n in decay], "weight_decay": args.weight_decay, **hyper},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0, **hyper},
    ]
    return [g for g in groups if g["params"]]


def _as_dict(source: Any) -> dict[str, Any]:
    if source is None:
        return {}
    if isinstance(source, (str, os.PathLike)):
        return copy.deepcopy(dict(read_config_file(source)))
    if isinstance(source, Mapping):
        return copy.deepcopy(dict(source))
    raise ConfigTypeError("offload_config", f"= {type(source).__name__} object, not a config",
                          "pass an offload.Config, a dict (offload's format or a DeepSpeed "
                          "config), or the path of a JSON or YAML file")


def _precision_of(args: Any) -> Optional[str]:
    if getattr(args, "bf16", False):
        return "bf16"
    if getattr(args, "fp16", False):
        return "fp16"
    return None


def _fill_native(data: dict[str, Any], args: Any) -> None:
    """offload's format: fill what the config leaves out from `args`, collect what disagrees."""
    mismatches: list[tuple[str, Any, str, Any]] = []

    def fill(key: str, value: Any, arg_name: str, node: dict[str, Any]) -> None:
        name = key.rsplit(".", 1)[-1]
        if name not in node or node[name] is None:
            node[name] = value
        elif node[name] != value:
            mismatches.append((key, node[name], arg_name, value))

    fill("gradient_accumulation_steps", int(args.gradient_accumulation_steps),
         "gradient_accumulation_steps", data)
    fill("gradient_clipping", float(args.max_grad_norm or 0.0), "max_grad_norm", data)
    wanted = _precision_of(args)
    if wanted is not None:
        precision = data.setdefault("precision", {})
        if not isinstance(precision, dict):
            raise ConfigTypeError("precision", "is not a section", "write precision: {dtype: ...}")
        fill("precision.dtype", wanted, "bf16" if wanted == "bf16" else "fp16", precision)
    if getattr(args, "use_cpu", False):
        fill("compute_device", "cpu", "use_cpu", data)
    if mismatches:
        lines = "".join(f"\n  {key} = {mine!r}, but TrainingArguments {arg} = {theirs!r}"
                        for key, mine, arg, theirs in mismatches)
        raise ConfigError(mismatches[0][0], f"conflicts with the training arguments "
                          f"({len(mismatches)} value(s) in all):{lines}\n",
                          "leave these out of the offload config (they are then taken from the "
                          "TrainingArguments), or change the TrainingArguments to agree")


def _check_typed(config: Config, args: Any) -> None:
    """A typed `Config` is taken as it is: it must agree with `args` on the loop's settings."""
    rows: list[tuple[str, object, str, object]] = []  # (our key, ours, their argument, theirs)
    if int(config.gradient_accumulation_steps) != int(args.gradient_accumulation_steps):
        rows.append(("gradient_accumulation_steps", config.gradient_accumulation_steps,
                     "gradient_accumulation_steps", args.gradient_accumulation_steps))
    if float(config.gradient_clipping) != float(args.max_grad_norm or 0.0):
        rows.append(("gradient_clipping", config.gradient_clipping, "max_grad_norm", args.max_grad_norm))
    wanted = _precision_of(args)
    if wanted is not None and config.precision.dtype != wanted:
        rows.append(("precision.dtype", config.precision.dtype, wanted, True))
    if rows:
        lines = "".join(f"\n  {k} = {v!r}, but TrainingArguments {a} = {w!r}" for k, v, a, w in rows)
        raise ConfigError(rows[0][0], f"conflicts with the training arguments:{lines}\n",
                          "build the Config with the TrainingArguments' values, or pass a dict "
                          "that leaves them out (they are then filled from the arguments)")
