"""The optimizers the engine runs: the registry of native kinds, and param-group resolution.

Each native `optimizer.type` ("Adam", "AdamW", "Lion", "Adagrad") is one `OptimizerKind`
record (offload/optim/kind.py) in `REGISTRY`: the names of its state tensors per unit
(torch's names: Adam's `exp_avg` and `exp_avg_sq`, Lion's `exp_avg`, Adagrad's `sum`), the
hyperparameters a param group carries, the value a state tensor starts at, the flat-shard
kernel one update run calls (offload/optim/functional.py, offload/optim/one_state.py), the
torch optimizers it takes over and the flags it refuses. A generic kind (any elementwise
torch optimizer) is a record `generic.kind_for` builds for the engine that runs it.
`ShardedOptimizer` (offload/optim/sharded.py), the stores, the checkpoints and the planner
ask the record instead of assuming Adam's two moments.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from offload.config.sections import OptimizerConfig
from offload.optim import generic
from offload.optim.adam8bit import adam8bit_step_flat
from offload.optim.device_update import adagrad_device_update, adam_device_update, lion_device_update
from offload.optim.functional import adam_step_flat
from offload.optim.kind import MOMENT_FORMATS, OptimizerKind, UpdateFn
from offload.optim.one_state import adagrad_step_flat, lion_step_flat
from offload.storage.state_layout import StateSpec

__all__ = ["REGISTRY", "KINDS", "MOMENT_FORMATS", "OptimizerKind", "kind_of", "state_specs",
           "base_group", "kind_of_torch_optimizer", "resolve_param_groups", "TORCH_TYPES",
           "OptimizerArg", "KindLike"]

# -- the updates: one builder per kernel family (module globals, so tests can swap a kernel) --


def _adam_update(kind: OptimizerKind, *, decoupled: bool, extra: dict[str, Any],
                 adam_fn: Optional[Callable[..., None]], moments: str) -> UpdateFn:
    if moments == "8bit":

        def adam8bit_update(master: torch.Tensor, grad: torch.Tensor, states: Sequence[torch.Tensor], *,
                            step: int, group: dict[str, Any], grad_scale: float,
                            out_lowp: Optional[torch.Tensor]) -> None:
            beta1, beta2 = group["betas"]
            m, v, m_scale, v_scale = states
            (adam_fn or adam8bit_step_flat)(
                master, grad, m, m_scale, v, v_scale, step=step, lr=float(group["lr"]),
                beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                weight_decay=float(group["weight_decay"]), decoupled_weight_decay=decoupled,
                grad_scale=float(grad_scale), out_lowp=out_lowp, **extra)

        return adam8bit_update
    adam = adam_fn or adam_step_flat

    def adam_update(master: torch.Tensor, grad: torch.Tensor, states: Sequence[torch.Tensor], *,
                    step: int, group: dict[str, Any], grad_scale: float,
                    out_lowp: Optional[torch.Tensor]) -> None:
        beta1, beta2 = group["betas"]
        adam(master, grad, states[0], states[1], step=step, lr=float(group["lr"]),
             beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
             weight_decay=float(group["weight_decay"]), decoupled_weight_decay=decoupled,
             grad_scale=float(grad_scale), out_lowp=out_lowp, **extra)

    return adam_update


def _lion_update(kind: OptimizerKind, *, decoupled: bool, extra: dict[str, Any],
                 adam_fn: Optional[Callable[..., None]], moments: str) -> UpdateFn:
    def lion_update(master: torch.Tensor, grad: torch.Tensor, states: Sequence[torch.Tensor], *,
                    step: int, group: dict[str, Any], grad_scale: float,
                    out_lowp: Optional[torch.Tensor]) -> None:
        beta1, beta2 = group["betas"]
        lion_step_flat(master, grad, states[0], lr=float(group["lr"]), beta1=float(beta1),
                       beta2=float(beta2), weight_decay=float(group["weight_decay"]),
                       grad_scale=float(grad_scale), out_lowp=out_lowp, step=step, **extra)

    return lion_update


def _adagrad_update(kind: OptimizerKind, *, decoupled: bool, extra: dict[str, Any],
                    adam_fn: Optional[Callable[..., None]], moments: str) -> UpdateFn:
    def adagrad_update(master: torch.Tensor, grad: torch.Tensor, states: Sequence[torch.Tensor], *,
                       step: int, group: dict[str, Any], grad_scale: float,
                       out_lowp: Optional[torch.Tensor]) -> None:
        adagrad_step_flat(master, grad, states[0], step=step, lr=float(group["lr"]),
                          lr_decay=float(group["lr_decay"]),
                          weight_decay=float(group["weight_decay"]), eps=float(group["eps"]),
                          grad_scale=float(grad_scale), out_lowp=out_lowp, **extra)

    return adagrad_update


# -- the records ----------------------------------------------------------------------------

_ADAM_STATES = ("exp_avg", "exp_avg_sq")
_ADAM_HP = ("lr", "betas", "eps", "weight_decay")
_TORCH_ONLY_FLAGS = ("amsgrad", "maximize", "capturable", "differentiable")


def _is_adamw(o: torch.optim.Optimizer) -> bool:
    return isinstance(o, torch.optim.AdamW) or (
        isinstance(o, torch.optim.Adam) and bool(o.defaults.get("decoupled_weight_decay", False)))


REGISTRY: Mapping[str, OptimizerKind] = MappingProxyType({k.name: k for k in (
    OptimizerKind("Adam", _ADAM_STATES, _ADAM_HP, _adam_update,
                  takes_over=lambda o: isinstance(o, torch.optim.Adam) and not _is_adamw(o),
                  generic_flags=_TORCH_ONLY_FLAGS, eight_bit=True, device_build=adam_device_update),
    OptimizerKind("AdamW", _ADAM_STATES, _ADAM_HP, _adam_update, takes_over=_is_adamw,
                  generic_flags=_TORCH_ONLY_FLAGS, eight_bit=True, decoupled=True,
                  device_build=adam_device_update),
    OptimizerKind("Lion", ("exp_avg",), ("lr", "betas", "weight_decay"), _lion_update,
                  takes_over=lambda o: type(o).__name__ == "Lion"
                  and type(o).__module__.startswith("lion_pytorch"),
                  refused_flags={"use_triton": bool, "decoupled_weight_decay": bool,
                                 "cautious_factor": lambda v: v not in (0.0, None)},
                  device_build=lion_device_update),
    OptimizerKind("Adagrad", ("sum",), ("lr", "lr_decay", "weight_decay", "eps", "initial_accumulator_value"),
                  _adagrad_update, takes_over=lambda o: isinstance(o, torch.optim.Adagrad),
                  generic_flags=("maximize", "differentiable"),
                  starts_at={"sum": "initial_accumulator_value"}, device_build=adagrad_device_update),
)})
"""The native kinds, by `optimizer.type`: each one record (offload/optim/kind.py)."""

KINDS = tuple(REGISTRY)
"""Every `optimizer.type` the engine runs natively (config/sections.py `OptimizerConfig.type`)."""

KindLike = Union[str, OptimizerKind]

OptimizerArg = Any
"""The user's `optimizer=` argument to `initialize` (and the planner): None, a dict of
hyperparameters, a list of torch-style param groups, or a torch optimizer (any subclass,
third-party ones included). A user-input union resolved here, in `resolve_param_groups`,
which is why it stays `Any` at the signatures that pass it down unchanged."""


def kind_of(kind: KindLike) -> OptimizerKind:
    """The record of `kind` (a record already, or a native kind's name)."""
    if isinstance(kind, OptimizerKind):
        return kind
    try:
        return REGISTRY[kind]
    except KeyError:
        raise ValueError(f"optimizer type {kind!r}; the engine runs {', '.join(KINDS)} natively and "
                         "any elementwise torch optimizer passed as optimizer= (offload/optim/generic.py)"
                         ) from None


def state_specs(kind: KindLike, moments: str = "fp32") -> tuple[StateSpec, ...]:
    """`OptimizerKind.specs` of `kind`."""
    return kind_of(kind).specs(moments)


def base_group(oc: OptimizerConfig) -> dict[str, Any]:
    """The default param group of `oc` (an `OptimizerConfig`): its type's hyperparameters."""
    out = {}
    for key in kind_of(oc.type).hyperparams:
        value = getattr(oc, key)
        out[key] = tuple(value) if key == "betas" else value
    return out


def kind_of_torch_optimizer(optimizer: torch.optim.Optimizer) -> OptimizerKind:
    """The engine's kind for a torch optimizer whose groups `initialize` takes over; a type
    it cannot run, or a flag its kernel lacks, is refused by name."""
    for kind in REGISTRY.values():
        if kind.takes_over(optimizer):
            if kind.refuse_flags(optimizer):
                return generic.kind_for(optimizer)  # torch's class runs it (amsgrad, maximize)
            return kind
    return generic.kind_for(optimizer)  # the generic path, if elementwise (raises why not)


def resolve_param_groups(
    model: nn.Module, oc: OptimizerConfig, optimizer: OptimizerArg
) -> tuple[list[dict[str, Any]], dict[int, int], OptimizerKind]:
    """What `initialize(optimizer=...)` asks for, over `oc` (an `OptimizerConfig`):
    (hyperparameters per group, id(param) -> group index, the optimizer's kind: a native
    record of `REGISTRY`, or a generic one built for this engine). A torch optimizer brings
    its own type (`kind_of_torch_optimizer`); otherwise `oc.type` decides. See
    `offload.initialize` for the accepted forms."""
    all_params = [p for p in model.parameters()]
    if oc.type in TORCH_TYPES and not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = _torch_optimizer_of_config(oc, all_params, optimizer)
    if isinstance(optimizer, torch.optim.Optimizer):
        kind = kind_of_torch_optimizer(optimizer)
    else:
        kind = kind_of(oc.type)
    base = base_group(oc) if kind.name == oc.type else _torch_defaults(optimizer, kind)
    if optimizer is None:
        return [base], {id(p): 0 for p in all_params}, kind
    if isinstance(optimizer, torch.optim.Optimizer):
        specs = optimizer.param_groups
    elif isinstance(optimizer, Mapping):
        unknown = set(optimizer) - set(base)
        if unknown:
            raise ValueError(
                f"optimizer hyperparameters {sorted(unknown)} are not known to {kind.name}; allowed: "
                f"{sorted(base)}"
            )
        return [_checked({**base, **optimizer}, kind, 0)], {id(p): 0 for p in all_params}, kind
    else:
        specs = list(optimizer)
    known = {id(p) for p in all_params}
    groups, group_of = [], {}
    for gi, spec in enumerate(specs):
        if not isinstance(spec, Mapping) or "params" not in spec:
            raise TypeError("each optimizer param group must be a dict with a 'params' list")
        hp = {k: v for k, v in spec.items() if k in base}
        g = _checked({**base, **hp}, kind, gi)
        for p in spec["params"]:
            if id(p) not in known:
                raise ValueError(
                    f"optimizer param group {gi} lists a tensor of shape {tuple(p.shape)} that "
                    "is not a parameter of the model"
                )
            if id(p) in group_of:
                raise ValueError(f"a parameter appears in more than one group (group {gi})")
            group_of[id(p)] = gi
        groups.append(g)
    return groups, group_of, kind


TORCH_TYPES: dict[str, tuple[type, tuple[str, ...]]] = {
    "SGD": (torch.optim.SGD, ("lr", "momentum", "dampening", "weight_decay", "nesterov")),
}
"""Config `optimizer.type`s that torch's class runs on the shards (the generic path), with
the config keys it takes."""


def _torch_optimizer_of_config(oc: OptimizerConfig, all_params: list,
                               optimizer: OptimizerArg) -> torch.optim.Optimizer:
    """A config type of `TORCH_TYPES` as its torch optimizer: over every parameter with the
    config's hyperparameters, updated by a dict of them, or over the given param groups."""
    cls, keys = TORCH_TYPES[oc.type]
    hp = {k: getattr(oc, k) for k in keys}
    if isinstance(optimizer, Mapping):
        unknown = set(optimizer) - set(keys)
        if unknown:
            raise ValueError(f"optimizer hyperparameters {sorted(unknown)} are not known to "
                             f"{oc.type}; allowed: {sorted(keys)}")
        return cls(all_params, **{**hp, **optimizer})
    return cls(all_params if optimizer is None else list(optimizer), **hp)


def _torch_defaults(optimizer: OptimizerArg, kind: OptimizerKind) -> dict[str, Any]:
    """A torch optimizer of another type than the config's: its own defaults (a generic
    one's all of them, flags included: its class takes them back)."""
    if kind.generic:
        return {k: v for k, v in optimizer.defaults.items() if k != "params"}
    return {k: optimizer.defaults[k] for k in kind.hyperparams}


def _checked(g: dict[str, Any], kind: OptimizerKind, gi: int) -> dict[str, Any]:
    """A group's hyperparameters in range for `kind` (as the config checks its own)."""
    if "betas" in g:
        g["betas"] = tuple(float(b) for b in g["betas"])
        if len(g["betas"]) != 2 or not all(0.0 <= b <= 1.0 for b in g["betas"]):
            raise ValueError(f"optimizer param group {gi}: betas={g['betas']}; {kind.name} takes two "
                             "values in [0, 1], e.g. (0.9, 0.99)")
    for key in ("lr", "eps", "weight_decay", "lr_decay", "initial_accumulator_value"):
        if key in g and not float(g[key]) >= 0.0:
            raise ValueError(f"optimizer param group {gi}: {key}={g[key]} must be >= 0 for {kind.name}")
    return g
