"""Any elementwise torch optimizer over the flat shards: the generic path.

The engine's shards are flat fp32 tensors, and an update run is a slice of one. An optimizer
whose update of each element depends only on that element's parameter, gradient and state
(SGD with momentum, RMSprop, Adamax, NAdam, RAdam, ASGD, a third-party Lion, the user's own)
gives the same result on a slice as on the whole tensor, so the engine can run the user's
class itself on its shards, with the state sharded and tiered like Adam's moments (host or
NVMe, checkpointed by name). No native kernel: one `cls([slice], **group)` step per run.

**Which optimizers qualify** is measured, not listed (`probe`): the class steps a small 2-D
parameter, and the same values as a flat tensor split in two parameters, three times with
the same gradients. The results must agree to fp32 rounding (a relative 1e-4 of the update:
an elementwise update differs at most by the order of operations of a vectorised loop,
while a per-tensor norm — LAMB's trust ratio, LARS — or a factored second moment —
Adafactor — moves them by its own size), and the state must be tensors of the parameter's
shape (kept as the unit's state tensors, in insertion order) plus an optional scalar step
(kept as the engine's per-parameter step count). Anything else is refused at `initialize`
with the reason: such optimizers need a parameter's shape, which a flat shard does not have.

**The state's first value is the optimizer's own**: at a run's first step nothing is handed
to the class, so it initialises its state as it would (SGD's momentum buffer is the first
gradient, not zero); the engine then copies that state into its store. At later steps the
stored tensors are handed over (as fp32; a bf16 `moments_dtype` store is widened and written
back) with `step` set to the steps already taken.
"""

from __future__ import annotations

import functools
import numbers
from typing import Any, Optional, Sequence

import torch

from offload.optim.kind import OptimizerKind, UpdateFn

__all__ = ["probe", "kind_for", "kind_name"]

_STEP_KEYS = ("step",)


def kind_name(cls: type) -> str:
    """The engine's type name for a generic optimizer class: its import path."""
    return f"{cls.__module__}.{cls.__qualname__}"


def hyperparameter_keys(defaults: dict[str, Any]) -> tuple[str, ...]:
    """The numeric hyperparameters of a group (what a change between backward and step is
    checked on): numbers and `betas`, not flags."""
    out = []
    for k, v in defaults.items():
        if k == "params" or isinstance(v, bool):
            continue
        if isinstance(v, numbers.Real) or (k == "betas" and isinstance(v, (tuple, list))):
            out.append(k)
    return tuple(out)


def probe(cls: type, group: dict[str, Any]) -> tuple[str, ...]:
    """The state tensor names of `cls` with hyperparameters `group`, when its update is
    elementwise (see the module docstring); raises `TypeError` naming why not."""
    name = kind_name(cls)
    hp = {k: v for k, v in group.items() if k != "params"}
    g = torch.Generator().manual_seed(0)
    whole = torch.randn(4, 6, generator=g)
    grads = [torch.randn(4, 6, generator=g) for _ in range(3)]
    p2 = torch.nn.Parameter(whole.clone())
    halves = [torch.nn.Parameter(whole.reshape(-1)[:10].clone()), torch.nn.Parameter(whole.reshape(-1)[10:].clone())]
    try:
        opt2, opt1 = cls([p2], **hp), cls(halves, **hp)
        for gr in grads:
            p2.grad = gr.clone()
            flat = gr.reshape(-1)
            halves[0].grad, halves[1].grad = flat[:10].clone(), flat[10:].clone()
            opt2.step()
            opt1.step()
    except Exception as exc:  # noqa: BLE001 - any failure on plain tensors disqualifies it
        raise TypeError(f"optimizer={name} cannot step a flat tensor ({type(exc).__name__}: {exc}); "
                        "the engine's generic path runs elementwise optimizers on flat shards") from None
    got = torch.cat([h.detach() for h in halves])
    moved = (p2.detach().reshape(-1) - whole.reshape(-1)).abs().max()
    diff = (p2.detach().reshape(-1) - got).abs().max()
    if not bool(diff <= 1e-4 * max(float(moved), 1e-30)):
        raise TypeError(
            f"optimizer={name} is not elementwise: its update of a tensor differs from its update "
            f"of the same values split in two tensors (by {float(diff):.3g}, the update is "
            f"{float(moved):.3g}): it needs each parameter whole (a per-tensor norm such as LAMB's "
            "or LARS's trust ratio, a factored or matrix preconditioner such as Adafactor's, "
            "Muon's or Shampoo's). The engine's shards are flat slices; use an elementwise "
            "optimizer (Adam, SGD, RMSprop, Lion, Adagrad, ...)")
    names = []
    for key, value in opt2.state[p2].items():
        if key in _STEP_KEYS and (not torch.is_tensor(value) or value.numel() == 1):
            continue
        if torch.is_tensor(value) and value.shape == p2.shape and value.dtype == torch.float32:
            names.append(key)
            continue
        shape = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
        raise TypeError(f"optimizer={name} keeps state {key!r} of shape {shape} for a parameter of "
                        f"shape {tuple(p2.shape)}: the engine stores state tensors shaped as the "
                        "parameter (and a step count) only")
    return tuple(names)


def kind_for(optimizer: torch.optim.Optimizer) -> OptimizerKind:
    """Probe `optimizer`'s class with its first group: the record of its generic kind, for
    the engine that runs it (nothing is registered anywhere else). Its hyperparameters are
    the numeric group keys; the constructor takes every key of its defaults (a scheduler's
    `initial_lr` and the like stay out)."""
    cls = type(optimizer)
    group = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    names = probe(cls, group)
    keys = tuple(k for k in optimizer.defaults if k != "params")
    return OptimizerKind(kind_name(cls), names, hyperparameter_keys(optimizer.defaults),
                         functools.partial(_generic_update, keys=keys), torch_class=cls)


def _generic_update(kind: OptimizerKind, *, keys: tuple[str, ...], **_: Any) -> UpdateFn:
    """The update one run of generic `kind` calls (torch's class over the run's slice)."""
    cls, names = kind.torch_class, kind.state_names
    assert cls is not None

    def update(master: torch.Tensor, grad: torch.Tensor, states: Sequence[torch.Tensor], *,
               step: int, group: dict[str, Any], grad_scale: float,
               out_lowp: Optional[torch.Tensor]) -> None:
        p = torch.nn.Parameter(master, requires_grad=True)  # the same storage: updated in place
        p.grad = grad if grad_scale == 1.0 else grad * grad_scale  # un-scaled and clipped
        opt = cls([p], **{k: group[k] for k in keys if k in group})
        if step > 1:
            state = {n: s if s.dtype == torch.float32 else s.float() for n, s in zip(names, states)}
            state["step"] = torch.tensor(float(step - 1))
            opt.state[p] = state
        opt.step()
        got = opt.state[p]
        for name, dst in zip(names, states):
            src = got[name]  # the stored tensor updated in place, its fp32 copy, or a new one
            if src.data_ptr() != dst.data_ptr():
                dst.copy_(src)
        if p.data_ptr() != master.data_ptr():  # an optimizer that replaced p.data
            master.copy_(p.detach())
        if out_lowp is not None:
            out_lowp.copy_(master)

    return update
