"""`deepspeed.zero` over the offload engine: `Init` (-> `offload.init`: the construction
recorded, each parameter computed into its shard) and `GatheredParameters` (-> the owning
engine's `gathered`). Reached as `offload.compat.deepspeed.zero`."""

from __future__ import annotations

import types
import warnings
from typing import Any, Optional

import torch
from torch import nn

import offload
from offload.compat.deepspeed_utils import live_engines

__all__ = ["zero"]


class _ZeroInit:
    """`deepspeed.zero.Init(config_dict_or_path=...)` -> `offload.init(config)`: the
    construction inside is recorded and each parameter computed into its shard by
    `initialize`, bit-identical to an eager construction (offload/units/deferred.py)."""

    _IGNORED = ("data_parallel_group", "mem_efficient_linear", "remote_device", "pin_memory",
                "dtype", "sequence_data_parallel_group", "param_swapper")

    def __init__(self, module: Optional[nn.Module] = None, config_dict_or_path: Any = None,
                 config: Any = None, enabled: bool = True, mpu: Any = None, **kwargs: Any) -> None:
        if module is not None:
            raise NotImplementedError("zero.Init(module=...) partitions an existing model; with "
                                      "offload, pass the model to initialize() directly")
        if mpu is not None:
            raise NotImplementedError("zero.Init(mpu=...): offload has no model parallelism")
        unknown = [k for k in kwargs if k not in self._IGNORED]
        if unknown:
            raise TypeError(f"zero.Init got unexpected arguments {unknown}")
        set_ = [k for k, v in kwargs.items() if v not in (None, False, True)]
        if set_:
            warnings.warn(f"zero.Init: {set_} are not used by offload (the config's offload "
                          "section decides placement and dtype)", stacklevel=2)
        self._ctx = offload.init(config_dict_or_path or config) if enabled else None

    def __enter__(self) -> "_ZeroInit":
        if self._ctx is not None:
            self._ctx.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(*exc)


class _GatheredParameters:
    """`deepspeed.zero.GatheredParameters(params, modifier_rank=None)` -> `engine.gathered(params,
    modifier_rank)` of the live engine that owns the parameters (a collective: every rank
    enters it). As in DeepSpeed, parameters no engine owns are ignored (none: a no-op), and
    `enabled=False` is a no-op. `fwd_module` registers external parameters in DeepSpeed, which
    offload has no need of (a unit owns every parameter its module holds): accepted, unused."""

    def __init__(self, params: Any, modifier_rank: Optional[int] = None, fwd_module: Any = None,
                 enabled: bool = True) -> None:

        self._ctx: Any = None
        if not enabled or params is None:
            return
        items = [params] if isinstance(params, torch.Tensor) else list(params)
        owners = []
        for engine in live_engines():
            mine = [p for p in items if engine.gathering.owns(p)]
            if mine:
                owners.append((engine, mine))
        if len(owners) > 1:
            raise ValueError("zero.GatheredParameters: the parameters belong to more than one engine; "
                             "gather each engine's parameters in its own context")
        if owners:
            engine, mine = owners[0]
            self._ctx = engine.gathered(mine, modifier_rank=modifier_rank)

    def __enter__(self) -> None:
        if self._ctx is not None:
            self._ctx.__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(*exc)


zero = types.SimpleNamespace(Init=_ZeroInit, GatheredParameters=_GatheredParameters)
"""`deepspeed.zero`: `Init` (-> offload.init), `GatheredParameters` (-> `engine.gathered`)."""


