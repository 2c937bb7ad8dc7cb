"""The non-finite guard's pieces beside the step policy (offload/runtime/optimizer_step.py):
where updates may run under it, which units a non-finite gradient is in, and the window a
failed backward lost.

[Note: no non-finite value is applied]
`nonfinite_loss` ('skip', the default, or 'raise') guards the loss and the gradients: no
NaN or inf ever reaches a master weight or a moment, and a step with one anywhere is skipped
whole, on every rank. The gradient's finiteness is known only when the last unit's gradient
is: an update that ran during backward before a bad unit was reduced would already have
changed its unit (an inf behind a finite loss: a custom backward, an overflow in a bf16
kernel). Undoing it exactly means keeping every updated unit's weights and moments from
before the update (12 bytes per parameter for the whole model, more than the gradient
shards), so the guard instead runs the step's updates at `engine.step()`, after the global
norm (which it takes every step anyway) is known finite. That costs the overlap of the
update with backward (measured on the 134M CPU step: docs/prefetch.md) and, on a CPU run,
transient gradient shards (`transient_grad_shards` follows this choice, and the planner
with it). `nonfinite_loss: off` restores the updates in backward, unguarded: a non-finite
gradient then reaches the weights, as in a plain loop.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Sequence

import torch

from offload.config.sections import Config

__all__ = ["LostWindow", "may_update_in_backward", "nonfinite_units", "sum_of_squares"]


def may_update_in_backward(config: Config) -> bool:
    """Whether `config`'s non-finite guard lets updates run during backward: only with it
    off ([Note: no non-finite value is applied])."""
    return config.nonfinite_loss == "off"


def nonfinite_units(sums_of_squares: Sequence[Optional[torch.Tensor]], names: Sequence[str],
                    agree: Callable[[torch.Tensor], torch.Tensor]) -> str:
    """The units whose gradient is non-finite on some rank, named. `agree` takes the max of
    the per-unit flags over the ranks (a collective: every rank calls it, having seen the
    same non-finite norm)."""
    flags = agree(torch.tensor([0.0 if sq is None or math.isfinite(float(sq)) else 1.0 for sq in sums_of_squares],
                               dtype=torch.float32))
    bad = [name or "<root>" for name, f in zip(names, flags.tolist()) if f]
    if not bad:
        return "no unit's gradient alone (their squares overflowed in the sum)"
    shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
    return f"unit{'s' if len(bad) > 1 else ''} {shown}"


class LostWindow:
    """The error of a failed backward that had added to gradient sums of earlier
    micro-batches of this accumulation window: they cannot be restored exactly, so the
    window is lost until `zero_grad` (`clear`)."""

    def __init__(self) -> None:
        self.cause: Optional[BaseException] = None

    def lose(self, cause: BaseException) -> None:
        self.cause = cause

    def clear(self) -> None:
        self.cause = None

    def check(self, what: str) -> None:
        """Raise when the window is lost."""
        if self.cause is not None:
            cause = self.cause
            raise RuntimeError(
                f"{what}: a backward pass of this accumulation window failed ({type(cause).__name__}: "
                f"{cause}) after adding part of its gradients to the sums of the window's earlier "
                "micro-batches, which cannot be taken back exactly; nothing was applied. Call "
                "engine.zero_grad() to discard the window's gradients, then run its micro-batches "
                "again (or go on with the next ones)")


def sum_of_squares(st: Any) -> Optional[torch.Tensor]:
    """A unit's gradient sum of squares over its optimized elements, as a float64 tensor
    (the dot in fp32, as clipping always took it), or None when it holds none this step."""
    # A unit no micro-batch reached holds an earlier step's gradient: not this one's.
    if not st.grad_shard.has_gradient or st.optimized_numel == 0:
        return None
    g = st.grad[: st.optimized_numel]
    return torch.dot(g, g).double()
