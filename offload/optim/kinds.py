"""The optimizers the engine runs, and what each one needs from it.

For each `optimizer.type` ("Adam", "AdamW", "Lion", "Adagrad"): the names of its state
tensors per unit (torch's names: Adam's `exp_avg` and `exp_avg_sq`, Lion's `exp_avg`,
Adagrad's `sum`), the hyperparameters a param group carries, the value a state tensor starts
at, and the flat-shard kernel one update run calls (offload/optim/functional.py,
offload/optim/one_state.py). `ShardedOptimizer` (offload/optim/sharded.py), the stores, the
checkpoints and the planner ask this module instead of assuming Adam's two moments.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence, TypedDict

import torch
from torch import nn

from offload.config.sections import OptimizerConfig
from offload.dtypes import MOMENT_DTYPES
from offload.optim import generic
from offload.optim.adam8bit import BLOCK_SIZE, adam8bit_step_flat, zero_code
from offload.optim.functional import adam_step_flat
from offload.optim.one_state import adagrad_step_flat, lion_step_flat
from offload.storage.state_layout import StateSpec, uniform_specs

KINDS = ("Adam", "AdamW", "Lion", "Adagrad")
"""Every `optimizer.type` the engine runs (config/sections.py `OptimizerConfig.type`)."""

STATE_NAMES: dict[str, tuple[str, ...]] = {
    "Adam": ("exp_avg", "exp_avg_sq"),
    "AdamW": ("exp_avg", "exp_avg_sq"),
    "Lion": ("exp_avg",),
    "Adagrad": ("sum",),
}
"""Each optimizer's per-unit state tensors beside the fp32 master, in slot order; all in
`optimizer.moments_dtype` over the shard's optimized prefix."""

HYPERPARAMS: dict[str, tuple[str, ...]] = {
    "Adam": ("lr", "betas", "eps", "weight_decay"),
    "AdamW": ("lr", "betas", "eps", "weight_decay"),
    "Lion": ("lr", "betas", "weight_decay"),
    "Adagrad": ("lr", "lr_decay", "weight_decay", "eps", "initial_accumulator_value"),
}
"""What one param group carries (torch's keys), per optimizer."""

UpdateFn = Callable[..., None]
"""`fn(master, grad, states, *, step, group, grad_scale, out_lowp)`: one run's update;
`states` the optimizer's state tensors over the run, in `STATE_NAMES` order."""


def state_names(kind: str) -> tuple[str, ...]:
    try:
        return STATE_NAMES[kind]
    except KeyError:
        raise ValueError(f"optimizer type {kind!r}; the engine runs {', '.join(KINDS)} natively and "
                         "any elementwise torch optimizer passed as optimizer= (offload/optim/generic.py)"
                         ) from None


MOMENT_FORMATS = ("fp32", "bf16", "8bit")
"""`optimizer.moments_dtype`: the state tensors in fp32 or bf16, or Adam's moments as
blockwise 8-bit codes with a per-block scale (offload/optim/adam8bit.py)."""


def state_specs(kind: str, moments: str = "fp32") -> tuple[StateSpec, ...]:
    """The state tensors one unit of `kind` keeps beside its fp32 master, in slot order, for
    `optimizer.moments_dtype` `moments`: `STATE_NAMES` in that dtype, or with "8bit" (Adam
    and AdamW only) the two moments as uint8 codes (torch's names: `exp_avg`, `exp_avg_sq`)
    followed by their per-block fp32 scales (`exp_avg_scale`, `exp_avg_sq_scale`, one per
    `BLOCK_SIZE` elements)."""
    names = state_names(kind)
    if moments == "8bit":
        if kind not in ("Adam", "AdamW"):
            raise ValueError(
                f"optimizer.moments_dtype='8bit' is blockwise 8-bit Adam moments; the engine's "
                f"{kind} keeps its state ({', '.join(names)}) in 'fp32' or 'bf16': set one of those"
            )
        return (StateSpec("exp_avg", torch.uint8, zero=float(zero_code(True))),
                StateSpec("exp_avg_sq", torch.uint8, zero=float(zero_code(False))),
                StateSpec("exp_avg_scale", torch.float32, BLOCK_SIZE),
                StateSpec("exp_avg_sq_scale", torch.float32, BLOCK_SIZE))
    if moments not in MOMENT_DTYPES:
        raise ValueError(f"optimizer.moments_dtype={moments!r}; allowed: {', '.join(MOMENT_FORMATS)}")
    return uniform_specs(names, MOMENT_DTYPES[moments])


def base_group(oc: OptimizerConfig) -> dict[str, Any]:
    """The default param group of `oc` (an `OptimizerConfig`): its type's hyperparameters."""
    out = {}
    for key in HYPERPARAMS[oc.type]:
        value = getattr(oc, key)
        out[key] = tuple(value) if key == "betas" else value
    return out


def initial_value(spec: StateSpec, group: dict[str, Any]) -> float:
    """What state tensor `spec` starts at for parameters of `group` (torch's choice):
    Adagrad's `sum` at initial_accumulator_value, every other at zero (`spec.zero`)."""
    return float(group.get("initial_accumulator_value", 0.0)) if spec.name == "sum" else spec.zero


class _Threads(TypedDict, total=False):
    """The kernels' `threads` argument, passed only when set (a test's `adam_fn` lacks it)."""

    threads: int


def update_fn(kind: str, *, decoupled: bool, threads: int = 0,
              adam_fn: Optional[Callable[..., None]] = None, moments: str = "fp32") -> UpdateFn:
    """The update one run of `kind` calls, over its `state_specs(kind, moments)` in order.
    `threads` > 0 is passed to the kernel (config.cpu_adam_threads); `adam_fn` replaces
    Adam's kernel (tests, benchmarks)."""
    extra: _Threads = {"threads": threads} if threads > 0 and adam_fn is None else {}
    if kind in ("Adam", "AdamW") and moments == "8bit":

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
    if kind in ("Adam", "AdamW"):
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
    if kind == "Lion":

        def lion_update(master: torch.Tensor, grad: torch.Tensor, states: Sequence[torch.Tensor], *,
                        step: int, group: dict[str, Any], grad_scale: float,
                        out_lowp: Optional[torch.Tensor]) -> None:
            beta1, beta2 = group["betas"]
            lion_step_flat(master, grad, states[0], lr=float(group["lr"]), beta1=float(beta1),
                           beta2=float(beta2), weight_decay=float(group["weight_decay"]),
                           grad_scale=float(grad_scale), out_lowp=out_lowp, step=step, **extra)

        return lion_update
    if kind == "Adagrad":

        def adagrad_update(master: torch.Tensor, grad: torch.Tensor, states: Sequence[torch.Tensor], *,
                           step: int, group: dict[str, Any], grad_scale: float,
                           out_lowp: Optional[torch.Tensor]) -> None:
            adagrad_step_flat(master, grad, states[0], step=step, lr=float(group["lr"]),
                              lr_decay=float(group["lr_decay"]),
                              weight_decay=float(group["weight_decay"]), eps=float(group["eps"]),
                              grad_scale=float(grad_scale), out_lowp=out_lowp, **extra)

        return adagrad_update
    if kind in generic.GENERIC:
        return generic.generic_update(kind)
    state_names(kind)  # raises, naming the types
    raise AssertionError(kind)


def kind_of_torch_optimizer(optimizer: torch.optim.Optimizer) -> str:
    """The engine's type for a torch optimizer whose groups `initialize` takes over; a type
    it cannot run, or a flag its kernel lacks, is refused by name."""
    name = type(optimizer).__name__
    if isinstance(optimizer, torch.optim.AdamW):
        kind = "AdamW"
    elif isinstance(optimizer, torch.optim.Adam):
        kind = "AdamW" if optimizer.defaults.get("decoupled_weight_decay", False) else "Adam"
    elif isinstance(optimizer, torch.optim.Adagrad):
        kind = "Adagrad"
    elif name == "Lion" and type(optimizer).__module__.startswith("lion_pytorch"):
        kind = "Lion"
    else:
        return _generic_kind(optimizer)  # the generic path, if elementwise (raises why not)
    unsupported = {"Adam": ("amsgrad", "maximize", "capturable", "differentiable"),
                   "AdamW": ("amsgrad", "maximize", "capturable", "differentiable"),
                   "Adagrad": ("maximize", "differentiable"),
                   "Lion": ("use_triton", "decoupled_weight_decay", "cautious_factor")}[kind]
    for gi, g in enumerate(optimizer.param_groups):
        for flag in unsupported:
            if flag == "cautious_factor":
                on = g.get(flag, 0.0) not in (0.0, None)
            else:
                on = bool(g.get(flag, False))
            if on and kind in ("Adam", "AdamW", "Adagrad"):
                return _generic_kind(optimizer)  # torch's class runs it (amsgrad, maximize)
            if on:
                raise NotImplementedError(
                    f"optimizer={name} param group {gi} sets {flag}=True, which the engine's CPU "
                    f"{kind} does not implement; remove it"
                )
    return kind


def _generic_kind(optimizer: torch.optim.Optimizer) -> str:
    """Register `optimizer`'s class on the generic path (offload/optim/generic.py) and make
    its state names and hyperparameters known here; its kind name."""
    kind, names, keys = generic.register(optimizer)
    STATE_NAMES[kind], HYPERPARAMS[kind] = names, keys
    return kind


def resolve_param_groups(
    model: nn.Module, oc: OptimizerConfig, optimizer: Any
) -> tuple[list[dict[str, Any]], dict[int, int], str]:
    """What `initialize(optimizer=...)` asks for, over `oc` (an `OptimizerConfig`):
    (hyperparameters per group, id(param) -> group index, the optimizer type: one of
    `KINDS`; "AdamW" means decoupled weight decay). A torch optimizer brings its own type
    (`kind_of_torch_optimizer`); otherwise `oc.type` decides. See `offload.initialize` for
    the accepted forms."""
    kind: str = oc.type
    all_params = [p for p in model.parameters()]
    if oc.type in TORCH_TYPES and not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = _torch_optimizer_of_config(oc, all_params, optimizer)
    if isinstance(optimizer, torch.optim.Optimizer):
        kind = kind_of_torch_optimizer(optimizer)
    base = base_group(oc) if kind == oc.type else _torch_defaults(optimizer, kind)
    if optimizer is None:
        return [base], {id(p): 0 for p in all_params}, kind
    if isinstance(optimizer, torch.optim.Optimizer):
        specs = optimizer.param_groups
    elif isinstance(optimizer, Mapping):
        unknown = set(optimizer) - set(base)
        if unknown:
            raise ValueError(
                f"optimizer hyperparameters {sorted(unknown)} are not known to {kind}; allowed: "
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
                               optimizer: Any) -> torch.optim.Optimizer:
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


def _torch_defaults(optimizer: Any, kind: str) -> dict[str, Any]:
    """A torch optimizer of another type than the config's: its own defaults (a generic
    one's all of them, flags included: its class takes them back)."""
    if kind in generic.GENERIC:
        return {k: v for k, v in optimizer.defaults.items() if k != "params"}
    return {k: optimizer.defaults[k] for k in HYPERPARAMS[kind]}


def _checked(g: dict[str, Any], kind: str, gi: int) -> dict[str, Any]:
    """A group's hyperparameters in range for `kind` (as the config checks its own)."""
    if "betas" in g:
        g["betas"] = tuple(float(b) for b in g["betas"])
        if len(g["betas"]) != 2 or not all(0.0 <= b <= 1.0 for b in g["betas"]):
            raise ValueError(f"optimizer param group {gi}: betas={g['betas']}; {kind} takes two "
                             "values in [0, 1], e.g. (0.9, 0.99)")
    for key in ("lr", "eps", "weight_decay", "lr_decay", "initial_accumulator_value"):
        if key in g and not float(g[key]) >= 0.0:
            raise ValueError(f"optimizer param group {gi}: {key}={g[key]} must be >= 0 for {kind}")
    return g
