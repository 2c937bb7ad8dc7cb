"""`from_pretrained` into shards: a Hugging Face checkpoint directory streamed into the
engine unit by unit, never whole in memory.

    from offload.integrations.hf import from_pretrained
    model = from_pretrained("path/to/dir")              # AutoModelForCausalLM by default
    model = from_pretrained("dir", model_class=AutoModelForSequenceClassification, num_labels=3)
    engine = offload.initialize(model, config)          # the weights are read here

`from_pretrained` builds the model from the directory's `config.json` with its parameters on
the meta device (no memory) and its buffers real (the constructor computes the
non-persistent ones, e.g. rotary `inv_freq`; persistent ones found in the checkpoint are
copied in right away), ties its weights, reads the safetensors headers, matches the
checkpoint's names to the model's, and attaches the checkpoint to the model
(`offload.units.materialize.attach_source`). The next `offload.initialize(model, ...)`
then reads each parameter from its file as its unit is filled and keeps only its rank's
slice, so the host holds the shards, the tiers' own budgets (pinned staging for NVMe) and
one or two full parameters beside them: a model larger than the machine's memory loads
with the NVMe tiers. Every rank reads the tensors of the unit being filled (the files are
read, never mapped: offload.checkpoint.safetensors_dir).

What the engine then holds equals what `transformers`' `from_pretrained(dir, dtype=...)`
gives, bit for bit, for the weights it loads:
- names as transformers matches them: exact, or with the model's `base_model_prefix` added
  or stripped (a base-model checkpoint into a model with a head, and back), after the
  model's plain renamings (legacy `LayerNorm.gamma` ...); a checkpoint that needs one of
  transformers' weight *converters* (tensors merged or split, e.g. Mixtral's experts) is a
  `NotImplementedError` naming the key;
- dtypes: `dtype="auto"` (transformers' default) builds the model in the config's `dtype`
  (else the checkpoint's first floating tensor's, else torch's default); each value is cast
  to its parameter's dtype, as transformers casts on load, and the engine's fp32 master
  takes that value exactly. So a bf16 checkpoint gives bf16-representable masters, equal to
  `from_pretrained(dir, dtype=torch.float32)`'s weights; `dtype=torch.bfloat16` on an fp32
  checkpoint rounds the values to bf16 first, as transformers does;
- tied weights are one parameter, read under the name the checkpoint has;
- `requires_grad`: a parameter read from the checkpoint is trainable (floating point), as
  transformers makes every loaded parameter, even one the model's constructor froze
  (Whisper's `embed_positions`); one the checkpoint lacks keeps the constructor's flag;
- checkpoint keys the model does not use are named in one warning (less the model's
  `_keys_to_ignore_on_load_unexpected`); a parameter of the base model that the checkpoint
  lacks is a `ValueError` naming it (transformers warns and trains it from random values,
  which is how its own conversion bugs went unseen), unless `allow_missing=True`; a task
  head's parameters the checkpoint lacks (a new `score` or `classifier`), and with
  `allow_missing` the others, are named in one
  warning and initialized at `initialize` by the model's `_init_weights` on their module
  (same distribution as transformers'; the same values under the same seed when, as for a
  new head, they are the only ones drawn); a shape mismatch is a `ValueError` naming the
  key and both shapes, or with `ignore_mismatched_sizes=True` a warning and a fresh init.
  Every rank draws these values and keeps its slice: seed the ranks alike;
- PEFT: `get_peft_model(from_pretrained(dir), LoraConfig(...))` loads the base weights under
  their names from before PEFT renamed them, and initializes the LoRA adapters (on the meta
  device like the base) with PEFT's own `reset_lora_parameters` at `initialize`.

Not done here: downloads (pass a local directory), pickled `.bin` checkpoints (re-save with
safetensors), quantized checkpoints, adapters other than LoRA. The model is returned in eval mode, as
transformers returns it. The checkpoint is consumed by the next `initialize` of this model
(a failed `initialize` that got as far as reading needs a new `from_pretrained`).
"""

from __future__ import annotations

import logging
import os
import re
import weakref
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

if TYPE_CHECKING:  # transformers is imported where it is used (the `hf` extra)
    from transformers import PreTrainedModel

import offload.units.materialize as materialize
from offload.checkpoint.safetensors_dir import RenamedSource, SafetensorsDir

__all__ = ["from_pretrained"]

logger = logging.getLogger("offload")


def from_pretrained(path: str, model_class: Any = None, *, dtype: Any = "auto",
                    ignore_mismatched_sizes: bool = False, allow_missing: bool = False,
                    **kwargs: Any) -> nn.Module:
    """A model of `model_class` (default `transformers.AutoModelForCausalLM`) built from
    `path`'s config with its parameters on the meta device, whose weights the next
    `offload.initialize(model, ...)` streams from `path`'s safetensors into the shards
    (module docstring). `kwargs` go to the config as transformers' `from_pretrained` sends
    them (`num_labels=3`); those the config does not take go to the model's constructor.
    `allow_missing`: a weight of the base model that the checkpoint lacks is initialized
    (with a warning) instead of being an error (module docstring)."""
    import transformers

    try:
        from accelerate import init_empty_weights
    except ImportError:
        raise ImportError("from_pretrained into shards needs accelerate (to build the model with "
                          "its parameters on the meta device): pip install -e '.[hf]'") from None
    reader = SafetensorsDir(path)  # a missing or unsupported directory fails before anything else
    try:
        kwargs.setdefault("local_files_only", True)
        config, model_kwargs = transformers.AutoConfig.from_pretrained(
            reader.path, return_unused_kwargs=True, **kwargs)
        model_kwargs.pop("local_files_only", None)
        if model_class is None:
            model_class = transformers.AutoModelForCausalLM
        torch_dtype = _resolve_dtype(dtype, config, reader)
        # Parameters on meta, buffers real; tied after the context, whose parameter hook
        # would re-wrap a tied parameter into a second object.
        with init_empty_weights(include_buffers=False):
            if hasattr(model_class, "_model_mapping"):  # an Auto class
                model = model_class.from_config(config, dtype=torch_dtype, **model_kwargs)
            else:
                model = model_class._from_config(config, dtype=torch_dtype, **model_kwargs)
        model.tie_weights()
        model.config.name_or_path = reader.path
        _load_generation_config(model, reader.path, transformers)
        param_keys = _match_and_load_buffers(model, reader, ignore_mismatched_sizes, allow_missing)
        _trainable_as_transformers_loads(model, param_keys)
        source = RenamedSource(reader, param_keys)
    except BaseException:
        reader.close()
        raise
    materialize.attach_source(model, source, _module_init(model))
    model.eval()
    return model


def _resolve_dtype(dtype: Any, config: Any, reader: SafetensorsDir) -> torch.dtype:
    """transformers' `dtype` rule (modeling_utils._get_dtype): "auto" is the config's dtype,
    else the checkpoint's first floating tensor's, else torch's default."""
    if isinstance(dtype, str) and dtype == "auto":
        dtype = getattr(config, "dtype", None)
        if dtype is None:
            floating = [reader.info(k).dtype for k in reader.keys() if reader.info(k).dtype.is_floating_point]
            dtype = floating[0] if floating else torch.get_default_dtype()
    if isinstance(dtype, str):
        resolved = getattr(torch, dtype, None)
        if not isinstance(resolved, torch.dtype):
            raise ValueError(f"dtype={dtype!r} is not a torch dtype; pass 'auto', a torch.dtype "
                             "or its name ('bfloat16', 'float32')")
        dtype = resolved
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be 'auto' or a floating torch dtype, got {dtype!r}")
    return dtype


def _load_generation_config(model: PreTrainedModel, path: str, transformers: Any) -> None:
    if not (hasattr(model, "can_generate") and model.can_generate()):
        return
    if os.path.isfile(os.path.join(path, "generation_config.json")):
        model.generation_config = transformers.GenerationConfig.from_pretrained(path)


def _plain_renamer(model: PreTrainedModel) -> Any:
    """key -> key after the model's renamings (transformers' conversion mapping); raises
    NotImplementedError for a key one of its converters would merge or split."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:  # a transformers without conversion mappings: names are used as they are
        return lambda key: key
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]

    def rename(key: str) -> str:
        renamed, converter = rename_source_key(key, renamings, converters)
        if converter is not None:
            raise NotImplementedError(
                f"checkpoint key {key!r} needs transformers' weight converter {converter!r} for "
                f"{type(model).__name__} (tensors merged or split on load), which from_pretrained "
                "into shards does not do yet; load this model with transformers' from_pretrained "
                "and pass it to offload.initialize")
        return renamed

    return rename


def _target(key: str, expected: dict[str, Any], prefix: str) -> Optional[str]:
    """The model key a checkpoint key fills: transformers' base_model_prefix rule
    (core_model_loading.rename_source_key): stripped if that names a model key, else added
    if that does, else as it is; None when the model has no such key."""
    if prefix:
        if key.startswith(prefix + ".") and key[len(prefix) + 1:] in expected:
            return key[len(prefix) + 1:]
        if f"{prefix}.{key}" in expected:
            return f"{prefix}.{key}"
    return key if key in expected else None


def _match_and_load_buffers(model: PreTrainedModel, reader: SafetensorsDir,
                            ignore_mismatched_sizes: bool, allow_missing: bool) -> dict[str, str]:
    """Match checkpoint keys to the model's state-dict keys, copy the persistent buffers
    found, warn about unused and missing keys; return {parameter name: checkpoint key}."""
    expected = model.state_dict(keep_vars=True)  # meta parameters (every tied name), real buffers
    param_ids = {id(p) for p in model.parameters()}
    prefix = getattr(model, "base_model_prefix", "") or ""
    rename = _plain_renamer(model)
    key_of: dict[str, str] = {}
    unexpected: list[str] = []
    mismatched: list[str] = []
    reinit: set[str] = set()  # initialized anew on purpose (ignore_mismatched_sizes)
    for key in reader.keys():
        target = _target(rename(key), expected, prefix)
        if target is None:
            unexpected.append(key)
            continue
        if target in key_of and key_of[target] == target:
            continue  # the exact name wins over a prefixed twin
        want, got = tuple(expected[target].shape), reader.info(key).shape
        if want != got:
            what = (f"checkpoint key {key!r} in {reader.info(key).file} has shape {got}, but "
                    f"{type(model).__name__}'s {target!r} has shape {want}")
            if not ignore_mismatched_sizes:
                raise ValueError(f"{what}; load a checkpoint of this configuration, or pass "
                                 "ignore_mismatched_sizes=True to initialize it anew instead")
            mismatched.append(what)
            reinit.add(target)
            continue
        key_of[target] = key

    names_of: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    missing: list[str] = []
    for names in names_of.values():
        if not any(n in key_of for n in names):
            missing.append(names[0])
    for name, value in expected.items():
        if id(value) in param_ids:
            continue
        if name in key_of:
            with torch.no_grad():
                value.copy_(reader.read(key_of.pop(name)))
        else:
            missing.append(name)

    _warn(model, reader.path, unexpected, [k for k in missing if k not in reinit], mismatched, allow_missing)
    return key_of  # the buffers' keys were taken out above: parameters only


def _trainable_as_transformers_loads(model: nn.Module, loaded: dict[str, str]) -> None:
    """`requires_grad` as transformers' `from_pretrained` leaves it: every parameter it reads
    from the checkpoint is a new `nn.Parameter`, trainable when floating point, whatever the
    model's constructor set (Whisper's encoder freezes `embed_positions`; loaded, it trains);
    a parameter the checkpoint lacks keeps the constructor's flag."""
    for name, p in model.named_parameters(remove_duplicate=False):
        if name in loaded:
            p.requires_grad_(p.is_floating_point())


def _warn(model: nn.Module, path: str, unexpected: list[str], missing: list[str],
          mismatched: list[str], allow_missing: bool) -> None:
    """transformers' load report, one line each (less the keys the model says to ignore);
    a weight of the base model missing is an error unless `allow_missing`."""
    def ignoring(patterns: Any) -> Any:
        patterns = set(patterns or ())
        return re.compile("|".join(f"({p})" for p in sorted(patterns))) if patterns else None

    extra = set()
    buffers = [n for n, _ in model.named_buffers()]
    if any(n.endswith("rotary_emb.inv_freq") for n in buffers):
        extra.add(r"rotary_emb\.inv_freq")  # old checkpoints kept one per layer
    if any(n.endswith("position_ids") for n in buffers):
        extra.add(r"(^|\.)position_ids$")  # once persistent, now not
    skip_unexpected = ignoring(set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()) | extra)
    skip_missing = ignoring(getattr(model, "_keys_to_ignore_on_load_missing", None))
    unexpected = [k for k in unexpected if skip_unexpected is None or not skip_unexpected.search(k)]
    missing = [k for k in missing if skip_missing is None or not skip_missing.search(k)]
    cls = type(model).__name__
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}  # a buffer keeps its built value
    in_base = [k for k in missing if k in params and _in_base_model(model, k)]
    if in_base and not allow_missing:
        raise ValueError(
            f"from_pretrained into shards: {len(in_base)} weight(s) of {cls}'s base model are not "
            f"in the checkpoint at {path}: {in_base[:8]}{' ...' if len(in_base) > 8 else ''}; they "
            "would train from random values. Check that the checkpoint is of this architecture "
            "and was written whole (a conversion transformers did not apply leaves weights "
            "out), or pass allow_missing=True to initialize them with the model's _init_weights")
    if unexpected:
        logger.warning(f"from_pretrained into shards: {len(unexpected)} weight(s) of the checkpoint "
                       f"at {path} are not used by {cls}: {unexpected}")
    if missing:
        logger.warning(f"from_pretrained into shards: {len(missing)} weight(s) of {cls} are not in "
                       f"the checkpoint at {path} and are newly initialized by the model's "
                       f"_init_weights at offload.initialize: {missing}")
    for what in mismatched:
        logger.warning(f"from_pretrained into shards: {what}; newly initialized "
                       "(ignore_mismatched_sizes=True)")


def _in_base_model(model: nn.Module, key: str) -> bool:
    """Whether `key` belongs to the model's base model (transformers' `base_model_prefix`
    submodule, or the whole model when it is the base model itself); a task head added on
    top (`score`, `classifier`, an untied `lm_head`) does not."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    base = getattr(model, prefix, None) if prefix else None
    if not isinstance(base, nn.Module) or base is model:
        return True
    return key.startswith(prefix + ".")


def _module_init(model: nn.Module) -> Any:
    """init_fn for the parameters the checkpoint lacks: those of a PEFT LoRA adapter added
    since (`get_peft_model` on this model makes them on the meta device, as the base
    weights are) by the adapter's own `reset_lora_parameters` with its config's
    `init_lora_weights`; the others by the `_init_weights` of the nearest `PreTrainedModel`
    at or above the module (composite models have several), as transformers'
    `initialize_weights` dispatches it. Holds the model weakly: the source registry is
    keyed by it."""
    ref = weakref.ref(model)

    def init(module: nn.Module) -> None:
        root = ref()
        if root is None:  # the model is gone: nothing is initialized for it any more
            return
        chain = _ancestors(root, module)
        tuner = next((m for m in reversed(chain) if hasattr(m, "adapter_layer_names")), None)
        if tuner is not None:
            _init_adapter(root, tuner, module)
            return
        # The nearest module with transformers' `_init_weights` (a PreTrainedModel), duck-typed.
        owner: Any = next((m for m in reversed(chain) if hasattr(m, "_init_weights")), root)
        owner._init_weights(module)

    return init


def _ancestors(root: nn.Module, module: nn.Module) -> list[nn.Module]:
    """root, ..., module: the path down to `module` (empty when it is not inside root)."""
    for name, m in root.named_modules(remove_duplicate=False):
        if m is module:
            path = [root]
            for part in name.split(".") if name else []:
                child = path[-1]._modules[part]
                assert child is not None, "named_modules walks only the submodules that are set"
                path.append(child)
            return path
    return []


def _init_adapter(root: nn.Module, layer: nn.Module, module: nn.Module) -> None:
    """A PEFT adapter's parameters, as PEFT initializes them when it creates them on real
    weights (LoRA: `reset_lora_parameters(adapter, init_lora_weights)`: A as nn.Linear's
    default, B zero, so the adapted model starts equal to the base one)."""
    adapter = None
    for attr in getattr(layer, "adapter_layer_names", ()):
        group = getattr(layer, attr, None)
        for name, sub in (group.items() if isinstance(group, (nn.ModuleDict, nn.ParameterDict)) else ()):
            if sub is module or (isinstance(sub, nn.Module) and any(m is module for m in sub.modules())):
                adapter = name
        if group is module and isinstance(group, (nn.ModuleDict, nn.ParameterDict)):
            adapter = next(iter(group.keys()), None)  # a ParameterDict owns its parameters: every adapter in it
    config = (getattr(root, "peft_config", None) or {}).get(adapter)
    how = getattr(config, "init_lora_weights", None)
    reset_lora = getattr(layer, "reset_lora_parameters", None)  # PEFT's LoRA layers have it
    if reset_lora is None or adapter is None or config is None:
        raise NotImplementedError(
            f"{type(layer).__name__} adapters on a model loaded by from_pretrained into shards: "
            "only LoRA adapters are initialized at offload.initialize; add the adapter to a model "
            "loaded with transformers' from_pretrained, or use LoRA")
    if how is False:  # PEFT keeps the layers' own (random) init
        for m in module.modules():
            reset = getattr(m, "reset_parameters", None)
            if callable(reset):
                reset()
        return
    if how is not True and how != "gaussian":
        raise NotImplementedError(
            f"LoRA init_lora_weights={how!r} derives the adapter from the base weights, which a "
            "model loaded into shards does not have before offload.initialize; use "
            "init_lora_weights=True or 'gaussian', or add the adapter to a model loaded with "
            "transformers' from_pretrained")
    reset_lora(adapter, how)
