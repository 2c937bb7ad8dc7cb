"""Every way into a `Config`: `load_config`, config files, and telling offload's format
from DeepSpeed's.

`load_config(obj)` is what `offload.initialize` calls: None, a `Config`, a mapping in either
format, or the path of a JSON/YAML file in either format. `read_config_file` parses a file
(duplicate keys are an error, as in DeepSpeed); `is_deepspeed_config` decides which format a
mapping is in; offload's is read by `Config.from_dict` (sections.py), DeepSpeed's by
`translate_deepspeed` (deepspeed.py). This is the one module that imports both, so it also
gives `Config` its `from_file` and `from_deepspeed` ([Note: Config's ways in] in sections.py).
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping, Optional, Union

from offload.config.checks import ConfigError, ConfigTypeError
from offload.config.deepspeed import translate_deepspeed
from offload.config.deepspeed_keys import DS_ONLY_TOP_KEYS
from offload.config.sections import Config

__all__ = ["load_config", "read_config_file", "is_deepspeed_config", "from_file", "from_deepspeed"]


def load_config(obj: Union[Config, Mapping[str, Any], str, os.PathLike, None] = None, *,
                world_size: Optional[int] = None) -> Config:
    """THE entry point: anything a user may pass as `config` -> a validated `Config`.

    None -> defaults; a `Config` -> itself; a mapping -> offload's format or a DeepSpeed
    config (see `is_deepspeed_config`); a str / path -> a JSON or YAML file, then as a mapping.
    `world_size` is only used to check DeepSpeed's batch sizes; by default it is taken from
    an initialised torch.distributed, else $WORLD_SIZE (set by torchrun), else 1.
    """
    if obj is None:
        return Config()
    if isinstance(obj, Config):
        return obj
    if isinstance(obj, (str, os.PathLike)):
        return _from_any_mapping(read_config_file(obj), world_size=world_size)
    if isinstance(obj, Mapping):
        return _from_any_mapping(obj, world_size=world_size)
    raise ConfigTypeError("config", f"= {type(obj).__name__} object, which offload cannot read",
                          "pass an offload.Config, a dict (offload's format or a DeepSpeed "
                          "config), or the path of a JSON or YAML file")


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # Like DeepSpeed's dict_raise_error_on_duplicate_keys: a key given twice is a mistake,
    # and the json module would otherwise keep the last one silently.
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ConfigError(str(key), "appears twice in the same object",
                              "keep one of the two entries")
        out[key] = value
    return out


def _yaml_load(text: str) -> Any:
    import yaml

    class _StrictLoader(yaml.SafeLoader):
        pass

    def _mapping(loader: Any, node: Any) -> dict[Any, Any]:
        loader.flatten_mapping(node)
        return _reject_duplicates([(loader.construct_object(k, deep=True),
                                    loader.construct_object(v, deep=True)) for k, v in node.value])

    _StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)
    return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass


def read_config_file(path: Union[str, os.PathLike]) -> Mapping[str, Any]:
    """Parse a JSON (.json) or YAML (.yaml/.yml) file; other extensions try JSON, then YAML."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(2, f"config file {path!r} does not exist; pass the path of a "
                                   f"JSON or YAML file, a dict, or an offload.Config", path)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    ext = os.path.splitext(path)[1].lower()
    data: Any
    if ext == ".json":
        try:
            data = json.loads(text, object_pairs_hook=_reject_duplicates)
        except json.JSONDecodeError as e:
            raise ConfigError(path, f"is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}",
                              "fix the syntax (JSON allows no comments or trailing commas)") from None
    else:
        import yaml  # a dependency in pyproject; imported only when a YAML file is read

        try:
            if ext in (".yaml", ".yml"):
                data = _yaml_load(text)
            else:
                try:
                    data = json.loads(text, object_pairs_hook=_reject_duplicates)
                except json.JSONDecodeError:
                    data = _yaml_load(text)  # YAML also reads most JSON-with-comments
        except yaml.YAMLError as e:
            raise ConfigError(path, f"is not valid YAML{'' if ext in ('.yaml', '.yml') else ' (nor JSON)'}: "
                              f"{e}", "fix the syntax (a .json / .yaml extension gives a more "
                              "precise error)") from None
    if not isinstance(data, Mapping):
        raise ConfigTypeError(path, f"holds a {type(data).__name__} at its top level, not a mapping",
                              "a config file must be one JSON object / YAML mapping")
    return data


_OFFLOAD_ONLY_TOP_KEYS = frozenset({"offload", "precision", "timeline", "compute_device",
                                    "cpu_adam_threads", "nonfinite_loss", "collective_timeout_s",
                                    "logging", "monitors", "zero_stage", "checkpoint_tag_validation"})
"""Top-level keys of offload's format that DeepSpeed does not have. `unit_modules`,
`leaf_modules` and `prefetch` are offload's too, but a DeepSpeed config may carry them (the
translation reads them: offload/config/deepspeed.py), so they mark neither format."""


def is_deepspeed_config(data: Mapping[str, Any]) -> bool:
    """Whether a mapping is a DeepSpeed config rather than offload's format.

    DeepSpeed when it has a key only DeepSpeed uses (zero_optimization, fp16, bf16,
    train_batch_size, ...) or its optimizer section has DeepSpeed's "params";
    offload's when it has a key only offload uses (offload, precision, ...); both at once
    is an error. A mapping with only shared keys (gradient_clipping, optimizer without
    params, ...) is taken as offload's. Every config DeepSpeed can run with ZeRO-3 has
    zero_optimization, so a real DeepSpeed config is never misread.
    """
    ds_keys = [k for k in data if k in DS_ONLY_TOP_KEYS]
    # Both formats write scheduler as {type, params}; only DeepSpeed nests optimizer params.
    if isinstance(data.get("optimizer"), Mapping) and "params" in data["optimizer"]:
        ds_keys.append("optimizer.params")
    ours = [k for k in data if k in _OFFLOAD_ONLY_TOP_KEYS]
    if ds_keys and ours:
        raise ConfigError(str(ours[0]), f"is offload's key but the same config also has DeepSpeed's "
                          f"{ds_keys[0]!r}",
                          "use one format: offload's (docs/config.md) or a DeepSpeed config, not both")
    return bool(ds_keys)


def _from_any_mapping(data: Mapping[str, Any], *, world_size: Optional[int]) -> Config:
    if is_deepspeed_config(data):
        return translate_deepspeed(data, world_size=world_size)
    return Config.from_dict(data)


# [Note: Config's ways in] (sections.py): the constructors that need this module.


def from_file(path: Union[str, os.PathLike], *, world_size: Optional[int] = None) -> Config:
    """A JSON or YAML file in either offload's format or DeepSpeed's (told apart as by
    `load_config`)."""
    return _from_any_mapping(read_config_file(path), world_size=world_size)


def from_deepspeed(ds_config: Union[Mapping[str, Any], str, os.PathLike], *,
                   world_size: Optional[int] = None) -> Config:
    """A DeepSpeed config (dict or JSON/YAML path), translated by `translate_deepspeed`."""
    if isinstance(ds_config, (str, os.PathLike)):
        ds_config = read_config_file(ds_config)
    return translate_deepspeed(ds_config, world_size=world_size)


# The one install from above this project keeps, on purpose: `Config.from_file` and
# `Config.from_deepspeed` are public and documented (docs/config.md), and their bodies need
# this module, which imports sections.py (the other way round is an import circle). So the
# functions live here (`offload.config.from_file` / `from_deepspeed`, the way the docs
# show) and the class gets them as aliases when this module is imported, which
# offload/config/__init__.py always does. Nothing else is set on a class from outside it.
Config.from_file = staticmethod(from_file)
Config.from_deepspeed = staticmethod(from_deepspeed)
