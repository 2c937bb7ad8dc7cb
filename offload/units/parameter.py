"""The parameter type of a unit's views: `nn.Parameter`, plus one refusal.

A unit's parameters are views into its full buffer (offload/units/shard.py). Their
gradients never stay in `.grad`: the backward tracker reduce-scatters them into the rank's
fp32 gradient shard and sets `.grad` back to None. So `torch.nn.utils.clip_grad_norm_(
model.parameters(), 1.0)`, written for a plain model, finds no gradient, returns 0 and
clips nothing — silently. [Note: clipping refused]

[Note: clipping refused]
torch's clipping functions (`torch/nn/utils/clip_grad.py`: `clip_grad_norm_`,
`clip_grad_value_`, torch 2.13) touch a parameter only through `p.grad`, read in that
module; with every `.grad` None they return `tensor(0.)` before any tensor operation runs,
so neither a torch function mode nor a tensor subclass's `__torch_function__` sees the call.
The one point they pass through is the `grad` getter. `UnitParameter` overrides it: when a
parameter has no gradient *and* the reader is code of `torch.nn.utils.clip_grad` (the
caller's module, one frame up), it raises with the supported ways instead. Nothing else
changes: every other reader gets torch's own getter, autograd accumulates through C++
without calling it, `isinstance(p, nn.Parameter)` holds, `deepcopy` keeps the type and
pickling rebuilds a plain `nn.Parameter` (torch's `__reduce_ex__`). The check costs one
frame lookup on reads that find no gradient. (FSDP2 also gives its parameters their own
type: `DTensor`.)
"""

from __future__ import annotations

import sys
import types
from typing import Optional

import torch
from torch import nn

__all__ = ["UnitParameter"]

# torch's stubs declare `grad` a plain attribute; at run time it is the C getset descriptor.
_GRAD: types.GetSetDescriptorType = torch._C.TensorBase.grad  # type: ignore[assignment]
"""torch's own `grad` descriptor (C getter and setter)."""

_CLIPPING_MODULE = "torch.nn.utils.clip_grad"

CLIPPING_REFUSED = (
    "torch.nn.utils.clip_grad_norm_ / clip_grad_value_ over the parameters of an offload "
    "engine would find no gradient (the engine keeps them reduced in its fp32 shards, not in "
    ".grad), return 0 and clip nothing. Call engine.clip_grad_norm_(max_norm) between "
    "engine.backward() and engine.step(), or set gradient_clipping=<max_norm> in the config "
    "(the engine then clips every step); engine.get_global_grad_norm() reports the norm"
)


class UnitParameter(nn.Parameter):
    """A parameter view of a unit; see the module docstring ([Note: clipping refused])."""

    @property
    def grad(self) -> Optional[torch.Tensor]:
        g = _GRAD.__get__(self)
        if g is None and sys._getframe(1).f_globals.get("__name__") == _CLIPPING_MODULE:
            raise RuntimeError(CLIPPING_REFUSED)
        return g

    @grad.setter
    def grad(self, value: Optional[torch.Tensor]) -> None:
        _GRAD.__set__(self, value)

    @grad.deleter
    def grad(self) -> None:
        _GRAD.__delete__(self)

    # nn.Parameter's own __repr__ takes no `tensor_contents` either (torch's stub of
    # Tensor.__repr__ has it).
    def __repr__(self) -> str:  # type: ignore[override]
        # As nn.Parameter prints, without this class's name inside.
        return "Parameter containing:\n" + repr(self.detach())
