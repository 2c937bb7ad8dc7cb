"""CPUAdam8bit: torch.optim.AdamW / Adam on CPU tensors with 8-bit moments.

A drop-in for `CPUAdam` (and so for torch.optim.AdamW / Adam: same constructor arguments,
param groups, schedulers) whose moments take 2 B/param instead of 8: per parameter
`adam8bit_step_flat` (offload/optim/adam8bit.py has the definition: blockwise quantisation
with bitsandbytes' dynamic maps, 256 elements per fp32 scale). The parameters stay fp32.

State per parameter: 'step' (a float32 scalar tensor, as torch keeps it), 'exp_avg_codes'
and 'exp_avg_sq_codes' (uint8, the parameter's shape), 'exp_avg_scales' and
'exp_avg_sq_scales' (fp32, one per block of the flattened parameter). The groups have
torch.optim.Adam's keys. A state_dict therefore resumes a CPUAdam8bit exactly (bit for bit),
but does not load into torch's optimizers: its moments are not torch's (`dequantize_blockwise`
turns them into fp32 tensors when needed).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, overload

import torch

from offload.optim.adam8bit import Moments8bit, adam8bit_step_flat
from offload.optim.cpu_adam import CPUAdam

__all__ = ["CPUAdam8bit"]

_MOMENT_KEYS = ("exp_avg_codes", "exp_avg_scales", "exp_avg_sq_codes", "exp_avg_sq_scales")


class CPUAdam8bit(CPUAdam):
    """Adam with decoupled (AdamW, the default) or L2 weight decay, 8-bit moments.

    Arguments and their checks are `CPUAdam`'s; so are the parameter requirements (dense,
    contiguous fp32 CPU tensors; gradients fp32, bf16 or fp16) and `maximize`. `amsgrad` and
    `differentiable` raise at step(). Each parameter is quantised in blocks of 256 of its
    flattened elements, so results do not depend on how parameters are grouped.
    """

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """One update of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, group in enumerate(self.param_groups):
            self._check_group(index, group)
            beta1, beta2 = (float(b) for b in group["betas"])
            decoupled = group.get("decoupled_weight_decay", self.defaults["decoupled_weight_decay"])
            grad_scale = -1.0 if group.get("maximize", False) else 1.0
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = self._checked_grad(p)
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state.update(zip(_MOMENT_KEYS, Moments8bit.zeros(p.numel())))
                    state["exp_avg_codes"] = state["exp_avg_codes"].view(p.shape)
                    state["exp_avg_sq_codes"] = state["exp_avg_sq_codes"].view(p.shape)
                state["step"] += 1
                adam8bit_step_flat(
                    p,
                    grad,
                    *(state[key] for key in _MOMENT_KEYS),
                    step=int(state["step"].item()),
                    lr=float(group["lr"]),
                    beta1=beta1,
                    beta2=beta2,
                    eps=float(group["eps"]),
                    weight_decay=float(group["weight_decay"]),
                    decoupled_weight_decay=bool(decoupled),
                    grad_scale=grad_scale,
                )
                # Written behind autograd's back: bump the version counters as in-place ops
                # would (CPUAdam.step says why).
                torch.autograd.graph.increment_version(p)
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load_state_dict, then the moments back to their own dtypes.

        torch casts every floating-point state tensor to its parameter's dtype, and others
        keep theirs; a state_dict that went through a float conversion (or torch's own
        loading of a checkpoint made elsewhere) may hold the codes as floats. Codes are whole
        numbers 0..255, exact in fp32, so the round trip loses nothing; anything else is a
        state this optimizer did not write, and raises.
        """
        super().load_state_dict(state_dict)
        for p, state in self.state.items():
            if not state:
                continue
            missing = [key for key in _MOMENT_KEYS if key not in state]
            if missing:
                raise ValueError(
                    f"the state of a parameter of shape {tuple(p.shape)} lacks {missing}: this "
                    "state_dict was not written by CPUAdam8bit (a CPUAdam / torch AdamW one has "
                    "fp32 'exp_avg' / 'exp_avg_sq'; quantize them with quantize_blockwise)"
                )
            for key in ("exp_avg_codes", "exp_avg_sq_codes"):
                codes = state[key]
                if codes.dtype != torch.uint8:
                    if codes.is_floating_point() and not torch.equal(codes, codes.round().clamp(0, 255)):
                        raise ValueError(f"state {key!r} holds values that are not codes 0..255")
                    codes = codes.to(torch.uint8)
                state[key] = codes.to(device="cpu").contiguous().view(p.shape)
            for key in ("exp_avg_scales", "exp_avg_sq_scales"):
                state[key] = state[key].to(device="cpu", dtype=torch.float32).contiguous()

    def _check_group(self, index: int, group: dict[str, Any]) -> None:
        if group.get("amsgrad", False):
            raise NotImplementedError(
                f"param group {index} has amsgrad=True, which CPUAdam8bit does not implement; "
                "use torch.optim.Adam(amsgrad=True) for it"
            )
        if group.get("differentiable", False):
            raise NotImplementedError(
                f"param group {index} has differentiable=True, which CPUAdam8bit does not "
                "implement (it updates memory in place, outside autograd)"
            )
