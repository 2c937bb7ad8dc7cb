"""One optimizer type the engine runs, as a record: `OptimizerKind`.

Everything the engine, its stores, checkpoints and the planner need to know about an
optimizer type is one value of this class: its state tensors (names, in slot order, and the
hyperparameter any starts at), the hyperparameters a param group carries, how to build the
update one run calls, which torch optimizers it takes over and what of theirs it refuses.
The native kinds are records in `offload.optim.kinds.REGISTRY`; a generic kind (any
elementwise torch optimizer, offload/optim/generic.py) is a record built for the engine that
runs it, never written into a module table. A new optimizer is one record.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

import torch

from offload.dtypes import MOMENT_DTYPES
from offload.optim.adam8bit import BLOCK_SIZE, zero_code
from offload.storage.state_layout import StateSpec, uniform_specs

__all__ = ["OptimizerKind", "UpdateFn", "UpdateBuilder", "MOMENT_FORMATS"]

UpdateFn = Callable[..., None]
"""`fn(master, grad, states, *, step, group, grad_scale, out_lowp)`: one run's update;
`states` the optimizer's state tensors over the run, in `OptimizerKind.state_names` order."""

UpdateBuilder = Callable[..., UpdateFn]
"""`build(kind, *, decoupled, extra, adam_fn, moments)` -> the update: `extra` the kernels'
keyword arguments (`threads` when set), `adam_fn` a replacement Adam kernel (tests)."""

MOMENT_FORMATS = ("fp32", "bf16", "8bit")
"""`optimizer.moments_dtype`: the state tensors in fp32 or bf16, or Adam's moments as
blockwise 8-bit codes with a per-block scale (offload/optim/adam8bit.py)."""


@dataclass(frozen=True)
class OptimizerKind:
    """One optimizer type; see the module docstring."""

    name: str
    """`optimizer.type` ("Adam", "AdamW", "Lion", "Adagrad"), or a generic class's import path."""
    state_names: tuple[str, ...]
    """Its per-unit state tensors beside the fp32 master, in slot order (torch's names)."""
    hyperparams: tuple[str, ...]
    """What one param group carries (torch's keys)."""
    build: UpdateBuilder
    """Builds the update one run calls."""
    takes_over: Callable[[torch.optim.Optimizer], bool] = lambda optimizer: False
    """Whether a torch optimizer passed to `initialize` is this kind (its groups taken over)."""
    generic_flags: tuple[str, ...] = ()
    """Group flags torch's class runs but this kernel does not: such an optimizer goes the
    generic path (amsgrad, maximize)."""
    refused_flags: Mapping[str, Callable[[Any], bool]] = field(default_factory=dict)
    """Group flags neither runs, each with the test of "set": refused by name."""
    eight_bit: bool = False
    """Whether `moments_dtype: 8bit` (blockwise 8-bit moments) applies."""
    starts_at: Mapping[str, str] = field(default_factory=dict)
    """State name -> the group key whose value it starts at (others start at zero)."""
    decoupled: bool = False
    """Decoupled weight decay (AdamW's)."""
    torch_class: Optional[type] = None
    """Generic kinds: the torch optimizer class that runs the update."""
    device_build: Optional[UpdateBuilder] = None
    """Builds the update of a unit whose state lives on the compute device (torch's kernels:
    offload/optim/device_update.py); None for a generic kind, whose `build` runs torch's
    class on any device."""

    @property
    def generic(self) -> bool:
        return self.torch_class is not None

    def specs(self, moments: str = "fp32") -> tuple[StateSpec, ...]:
        """The state tensors one unit keeps beside its fp32 master, in slot order, for
        `optimizer.moments_dtype` `moments`: `state_names` in that dtype, or with "8bit"
        (Adam and AdamW only) the two moments as uint8 codes (torch's names) followed by
        their per-block fp32 scales (`exp_avg_scale`, `exp_avg_sq_scale`, one per
        `BLOCK_SIZE` elements)."""
        if moments == "8bit":
            if not self.eight_bit:
                raise ValueError(
                    f"optimizer.moments_dtype='8bit' is blockwise 8-bit Adam moments; the engine's "
                    f"{self.name} keeps its state ({', '.join(self.state_names)}) in 'fp32' or "
                    "'bf16': set one of those")
            return (StateSpec("exp_avg", torch.uint8, zero=float(zero_code(True))),
                    StateSpec("exp_avg_sq", torch.uint8, zero=float(zero_code(False))),
                    StateSpec("exp_avg_scale", torch.float32, BLOCK_SIZE),
                    StateSpec("exp_avg_sq_scale", torch.float32, BLOCK_SIZE))
        if moments not in MOMENT_DTYPES:
            raise ValueError(f"optimizer.moments_dtype={moments!r}; allowed: {', '.join(MOMENT_FORMATS)}")
        return uniform_specs(self.state_names, MOMENT_DTYPES[moments])

    def initial_value(self, spec: StateSpec, group: dict[str, Any]) -> float:
        """What state tensor `spec` starts at for parameters of `group` (torch's choice)."""
        key = self.starts_at.get(spec.name)
        return float(group.get(key, 0.0)) if key is not None else spec.zero

    def update(self, *, decoupled: Optional[bool] = None, threads: int = 0,
               adam_fn: Optional[Callable[..., None]] = None, moments: str = "fp32") -> UpdateFn:
        """The update one run calls, over `specs(moments)` in order. `threads` > 0 is passed
        to the kernel (config.cpu_adam_threads); `adam_fn` replaces Adam's kernel."""
        extra = {"threads": threads} if threads > 0 and adam_fn is None else {}
        return self.build(self, decoupled=self.decoupled if decoupled is None else decoupled,
                          extra=extra, adam_fn=adam_fn, moments=moments)

    def device_update(self, *, decoupled: Optional[bool] = None, moments: str = "fp32") -> UpdateFn:
        """The update one run of a device unit calls ([Note: the update split] in
        offload/storage/device_states.py): `device_build`'s, or a generic kind's own."""
        build = self.device_build if self.device_build is not None else self.build if self.generic else None
        if build is None:
            raise NotImplementedError(f"optimizer {self.name} has no update on the compute device; keep "
                                      "its state off the device (optimizer_tier 'cpu' or 'nvme')")
        return build(self, decoupled=self.decoupled if decoupled is None else decoupled,
                     extra={}, adam_fn=None, moments=moments)

    def refuse_flags(self, optimizer: torch.optim.Optimizer) -> bool:
        """For a torch optimizer this kind takes over: True when a group sets a flag torch's
        class runs and this kernel does not (the generic path runs it instead); raises
        naming a flag neither runs."""
        for gi, g in enumerate(optimizer.param_groups):
            if any(bool(g.get(flag, False)) for flag in self.generic_flags):
                return True
            for flag, is_set in self.refused_flags.items():
                if is_set(g.get(flag)):
                    raise NotImplementedError(
                        f"optimizer={type(optimizer).__name__} param group {gi} sets {flag}=True, "
                        f"which the engine's CPU {self.name} does not implement; remove it")
        return False

