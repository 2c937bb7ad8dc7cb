"""A DeepSpeed config's `"auto"` values, resolved from Hugging Face `TrainingArguments`.

Hugging Face users write DeepSpeed configs with `"auto"` wherever the value is already in
their `TrainingArguments` (batch sizes, learning rate, clipping, precision, ...), and
transformers fills them in before DeepSpeed reads the config
(`transformers/integrations/deepspeed.py`, `HfTrainerDeepSpeedConfig.trainer_config_process`
and `trainer_config_finalize`). `resolve_auto` applies the same rules, so the result is the
config DeepSpeed would have been given, and offload's translation (`offload.load_config`)
reads it as it reads any DeepSpeed config.

As in transformers, a key that is *not* "auto" must agree with the training arguments it
would have been filled from; every disagreement is collected and reported in one error
naming both values. Keys whose rule needs the model (hidden size) or the run's length
(`num_training_steps`) are resolved only when those are passed; otherwise one error names
them and what to pass. Keys transformers does not fill stay as they are: `load_config`
lists any "auto" left.

Two rules of transformers are not applied, because they are not "auto" resolution:
`save_on_each_node` (transformers then adds `checkpoint.use_node_local_storage`, a key
offload ignores) and `auto_find_batch_size` (the Trainer's batch-size search; offload's
engine does not build batches).

transformers is never imported: `args` is read by attribute, so any object with the
`TrainingArguments` fields used below works.
"""

from __future__ import annotations

import copy
import math
import os
from typing import Any, Mapping, Optional, Union

from offload.config import ConfigError, ConfigTypeError, read_config_file

__all__ = ["resolve_auto"]

_HIDDEN_SIZE_KEYS = ("zero_optimization.reduce_bucket_size",
                     "zero_optimization.stage3_prefetch_bucket_size",
                     "zero_optimization.stage3_param_persistence_threshold")
"""Keys transformers fills from the model's hidden size. Of these offload's translation
reads only stage3_prefetch_bucket_size (prefetch.prefetch_bytes); the other two are
reported as ignored, but are filled all the same so that the config is DeepSpeed's."""


def resolve_auto(ds_config: Union[Mapping[str, Any], str, os.PathLike], args: Any, *,
                 num_training_steps: Optional[int] = None, model: Any = None) -> dict[str, Any]:
    """A copy of `ds_config` (a dict or a JSON/YAML path) with every `"auto"` that the
    Hugging Face Trainer fills replaced by its value from `args` (`TrainingArguments`).

    `num_training_steps` (the run's optimizer steps) fills `scheduler.params.total_num_steps`
    and, with `args.warmup_steps` as a ratio (< 1), `warmup_num_steps`; `model` (a
    transformers model, or its config) fills the hidden-size keys. A value that is not
    "auto" and disagrees with `args` is a `ConfigError` listing every disagreement.
    """
    if isinstance(ds_config, (str, os.PathLike)):
        config = copy.deepcopy(dict(read_config_file(ds_config)))
    elif isinstance(ds_config, Mapping):
        config = copy.deepcopy(dict(ds_config))
    else:
        raise ConfigTypeError("ds_config", f"= {type(ds_config).__name__} object, not a DeepSpeed config",
                              "pass a dict or the path of a JSON or YAML file")
    filler = _Filler(config)
    _from_training_args(filler, args)
    _from_model_and_length(filler, args, num_training_steps, model)
    filler.raise_if_any()
    return config


class _Filler:
    """One resolution: the config being filled, the disagreements and the keys it could not
    fill, each collected so that one error reports them all."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.mismatches: list[tuple[str, Any, str, Any]] = []
        """(DeepSpeed key, its value, TrainingArguments name, its value)."""
        self.unresolved: dict[str, list[str]] = {}
        """What to pass -> the "auto" keys that need it."""

    def _node(self, key: str) -> tuple[Optional[dict[str, Any]], str]:
        # transformers' find_config_node: a missing (or non-mapping) parent section means
        # the key is absent, and absent keys are neither filled nor checked.
        *parents, name = key.split(".")
        node: Any = self.config
        for parent in parents:
            node = node.get(parent) if isinstance(node, dict) else None
            if node is None:
                return None, name
        return (node if isinstance(node, dict) else None), name

    def is_auto(self, key: str) -> bool:
        node, name = self._node(key)
        return node is not None and _is_auto(node.get(name))

    def fill(self, key: str, value: Any, hf_name: Optional[str] = None) -> None:
        """"auto" at `key` becomes `value`; any other value must equal it when `hf_name`
        (the training argument it comes from) is given (transformers' fill_match), and is
        left alone when not (fill_only)."""
        node, name = self._node(key)
        if node is None:
            return
        current = node.get(name)
        if _is_auto(current):
            node[name] = value
        elif hf_name is not None and current is not None and not _same(current, value):
            self.mismatches.append((key, current, hf_name, value))

    def needs(self, what: str, key: str) -> None:
        if self.is_auto(key):
            self.unresolved.setdefault(what, []).append(key)

    def raise_if_any(self) -> None:
        if self.mismatches:
            lines = "".join(f"\n  {key} = {ds!r}, but TrainingArguments {hf} = {hf_value!r}"
                            for key, ds, hf, hf_value in self.mismatches)
            raise ConfigError(self.mismatches[0][0], f"conflicts with the training arguments "
                              f"({len(self.mismatches)} DeepSpeed value(s) in all):{lines}\n",
                              'set each of these DeepSpeed values to "auto" so that it is taken from '
                              "the TrainingArguments, or change the TrainingArguments to agree")
        if self.unresolved:
            parts = [f"pass {what} for {', '.join(keys)}" for what, keys in self.unresolved.items()]
            first = next(iter(self.unresolved.values()))[0]
            raise ConfigError(first, f"is 'auto', which needs more than the training arguments: "
                              f"{'; '.join(parts)}",
                              "call resolve_auto(config, args, num_training_steps=..., model=...) "
                              "with them, or replace these 'auto' values with numbers")


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == "auto"


def _same(ds_value: Any, hf_value: Any) -> bool:
    # transformers compares with !=; a tuple of betas given in a Python dict is the same
    # value as JSON's list.
    if isinstance(ds_value, (list, tuple)) and isinstance(hf_value, (list, tuple)):
        return list(ds_value) == list(hf_value)
    return ds_value == hf_value


def _arg(args: Any, name: str) -> Any:
    try:
        return getattr(args, name)
    except AttributeError:
        raise ConfigTypeError("args", f"has no attribute {name!r}",
                              "pass a transformers.TrainingArguments (or an object with its fields)") from None


def _from_training_args(f: _Filler, args: Any) -> None:
    """transformers' trainer_config_process: what TrainingArguments alone determines."""
    micro = _arg(args, "per_device_train_batch_size")
    accumulation = _arg(args, "gradient_accumulation_steps")
    f.fill("train_micro_batch_size_per_gpu", micro, "per_device_train_batch_size")
    f.fill("gradient_accumulation_steps", accumulation, "gradient_accumulation_steps")
    # DeepSpeed's identity: train_batch_size = world size x micro batch x accumulation.
    f.fill("train_batch_size", _arg(args, "world_size") * micro * accumulation,
           "world_size x per_device_train_batch_size x gradient_accumulation_steps")
    f.fill("gradient_clipping", _arg(args, "max_grad_norm"), "max_grad_norm")

    lr = _arg(args, "learning_rate")
    f.fill("optimizer.params.lr", lr, "learning_rate")
    f.fill("optimizer.params.betas", [_arg(args, "adam_beta1"), _arg(args, "adam_beta2")],
           "(adam_beta1, adam_beta2)")
    f.fill("optimizer.params.eps", _arg(args, "adam_epsilon"), "adam_epsilon")
    f.fill("optimizer.params.weight_decay", _arg(args, "weight_decay"), "weight_decay")

    f.fill("scheduler.params.warmup_min_lr", 0)  # not a training argument: filled, never checked
    f.fill("scheduler.params.warmup_max_lr", lr, "learning_rate")

    # A precision used only for evaluation enables it too, as in transformers.
    f.fill("fp16.enabled", bool(_arg(args, "fp16") or getattr(args, "fp16_full_eval", False)),
           "fp16 or fp16_full_eval")
    f.fill("bf16.enabled", bool(_arg(args, "bf16") or getattr(args, "bf16_full_eval", False)),
           "bf16 or bf16_full_eval")


def _from_model_and_length(f: _Filler, args: Any, num_training_steps: Optional[int],
                           model: Any) -> None:
    """transformers' trainer_config_finalize: what needs the model or the run's length."""
    if any(f.is_auto(key) for key in _HIDDEN_SIZE_KEYS):
        if model is None:
            for key in _HIDDEN_SIZE_KEYS:
                f.needs("model= (the model or its config: its hidden size)", key)
        else:
            hidden = _hidden_size(model)
            f.fill("zero_optimization.reduce_bucket_size", hidden * hidden)
            zero = f.config.get("zero_optimization")
            if isinstance(zero, dict) and zero.get("stage") == 3:
                f.fill("zero_optimization.stage3_prefetch_bucket_size", int(0.9 * hidden * hidden))
                f.fill("zero_optimization.stage3_param_persistence_threshold", 10 * hidden)

    if num_training_steps is not None:
        f.fill("scheduler.params.total_num_steps", num_training_steps, "num_training_steps")
    else:
        f.needs("num_training_steps= (the run's optimizer steps)", "scheduler.params.total_num_steps")
    warmup = _warmup_steps(args, num_training_steps)
    if warmup is not None:
        # transformers keeps it >= 1: DeepSpeed >= 0.19.6 rejects 0 warmup steps.
        f.fill("scheduler.params.warmup_num_steps", max(1, warmup), "warmup_steps")
    else:
        f.needs("num_training_steps= (warmup_steps < 1 is a ratio of it)",
                "scheduler.params.warmup_num_steps")


def _warmup_steps(args: Any, num_training_steps: Optional[int]) -> Optional[int]:
    """args.get_warmup_steps(n) where it can be computed: warmup_steps >= 1 is a step count
    and needs no n; below 1 it is a ratio of n (transformers' TrainingArguments)."""
    steps = _arg(args, "warmup_steps")
    if steps < 1 and num_training_steps is None:
        return None
    if hasattr(args, "get_warmup_steps"):
        return int(args.get_warmup_steps(num_training_steps))
    return int(steps) if steps >= 1 else math.ceil(num_training_steps * steps)


def _hidden_size(model: Any) -> int:
    """The model's hidden size by transformers' rule: config.hidden_size, else the largest
    of config.hidden_sizes, else the same in config.text_config."""
    config = getattr(model, "config", model)
    for source in (config, getattr(config, "text_config", None)):
        if source is None:
            continue
        if getattr(source, "hidden_size", None) is not None:
            return int(source.hidden_size)
        if getattr(source, "hidden_sizes", None):
            return int(max(source.hidden_sizes))
    keys = ", ".join(key for key in _HIDDEN_SIZE_KEYS)
    raise ConfigError("model", f"has no config.hidden_size nor config.hidden_sizes, so the 'auto' values "
                      f"of {keys} cannot be filled", "replace those 'auto' values with integers")
