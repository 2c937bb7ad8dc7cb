"""`deepspeed.utils` over the offload engine: the accessors of one parameter's full or local
gradient, fp32 value and optimizer state (-> `engine.full_grad`, `engine.param_state`), and
the z3 leaf-module marks. Reached as `offload.compat.deepspeed.utils`."""

from __future__ import annotations

import types
from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from offload.compat.deepspeed_leaf import (
    get_z3_leaf_modules, set_z3_leaf_modules, unset_z3_leaf_modules, z3_leaf_module,
)

if TYPE_CHECKING:  # pragma: no cover
    from offload.engine import Engine

__all__ = ["utils", "live_engines"]


def live_engines() -> list["Engine"]:
    """The engines of this process not closed yet (each built whole: an engine joins the
    registry at the end of its __init__)."""
    from offload.engine import Engine
    from offload.runtime.lifecycle import LIVE_ENGINES

    return [e for e in list(LIVE_ENGINES) if isinstance(e, Engine)]


def _safe_get_full_grad(param: nn.Parameter) -> Optional[torch.Tensor]:
    """`deepspeed.utils.safe_get_full_grad(param)` -> `engine.full_grad(param)` of the live
    engine that owns `param` (a collective: every rank calls it); `param.grad` for a
    parameter no engine owns, as DeepSpeed returns for a plain one."""

    for engine in live_engines():
        if engine.grads.owns(param):
            return engine.full_grad(param)
    return param.grad


def _owner(param: nn.Parameter, what: str) -> "Engine":
    for engine in live_engines():
        if engine.grads.owns(param):
            return engine
    raise ValueError(f"deepspeed.utils.{what}: the parameter belongs to no live offload engine "
                     "(pass one of engine.parameters() of an engine not closed)")


def _safe_get_full_fp32_param(param: nn.Parameter) -> Optional[torch.Tensor]:
    """The parameter's whole fp32 master (a collective); None when frozen."""
    return _owner(param, "safe_get_full_fp32_param").param_state.full(param, "fp32")


def _safe_set_full_fp32_param(param: nn.Parameter, value: torch.Tensor) -> None:
    _owner(param, "safe_set_full_fp32_param").param_state.set_full(param, value, "fp32")


def _safe_get_full_optimizer_state(param: nn.Parameter, optim_state_key: str) -> Optional[torch.Tensor]:
    """The parameter's whole optimizer state `optim_state_key` ("exp_avg", "exp_avg_sq")."""
    return _owner(param, "safe_get_full_optimizer_state").param_state.full(param, optim_state_key)


def _safe_set_full_optimizer_state(param: nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    _owner(param, "safe_set_full_optimizer_state").param_state.set_full(param, value, optim_state_key)


def _safe_get_local_fp32_param(param: nn.Parameter) -> Optional[torch.Tensor]:
    """This rank's part of the fp32 master (1-D), or None."""
    return _owner(param, "safe_get_local_fp32_param").param_state.local(param, "fp32")


def _safe_set_local_fp32_param(param: nn.Parameter, value: torch.Tensor) -> None:
    _owner(param, "safe_set_local_fp32_param").param_state.set_local(param, value, "fp32")


def _safe_get_local_optimizer_state(param: nn.Parameter, optim_state_key: str) -> Optional[torch.Tensor]:
    return _owner(param, "safe_get_local_optimizer_state").param_state.local(param, optim_state_key)


def _safe_set_local_optimizer_state(param: nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    _owner(param, "safe_set_local_optimizer_state").param_state.set_local(param, value, optim_state_key)


utils = types.SimpleNamespace(safe_get_full_grad=_safe_get_full_grad,
                              safe_get_full_fp32_param=_safe_get_full_fp32_param,
                              safe_set_full_fp32_param=_safe_set_full_fp32_param,
                              safe_get_full_optimizer_state=_safe_get_full_optimizer_state,
                              safe_set_full_optimizer_state=_safe_set_full_optimizer_state,
                              safe_get_local_fp32_param=_safe_get_local_fp32_param,
                              safe_set_local_fp32_param=_safe_set_local_fp32_param,
                              safe_get_local_optimizer_state=_safe_get_local_optimizer_state,
                              safe_set_local_optimizer_state=_safe_set_local_optimizer_state,
                              set_z3_leaf_modules=set_z3_leaf_modules,
                              unset_z3_leaf_modules=unset_z3_leaf_modules, get_z3_leaf_modules=get_z3_leaf_modules,
                              z3_leaf_module=z3_leaf_module)
"""`deepspeed.utils`: `safe_get_full_grad` (-> `engine.full_grad`), the `safe_get/set_full/local_*`
fp32-parameter and optimizer-state accessors (-> `engine.param_state`), the z3 leaf marks."""

