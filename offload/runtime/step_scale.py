"""One optimizer step's scale, or its skip, with the reason: a pure function of numbers.

What `engine.step()` folds into the one `grad_scale` the update multiplies every gradient
by: the loss scale and the accumulation (`unscale`), then the clip factor, unless the step is
skipped. The inputs are what the step policy measured across ranks (the fp16 overflow flag,
a non-finite loss seen in the window, the global gradient norm); the collectives stay with
the policy. In order:
1. an fp16 overflow, or a non-finite loss in the window (`nonfinite_loss` skip), skips the
   step before any norm is taken (`needs_norm` is False);
2. else the norm is taken (reported every step: [Note: the norm of every step]); a
   non-finite norm under the guard (`nonfinite_loss` skip or raise) skips the step, and
   raises after the bookkeeping under `raise`, provided no unit was updated during backward
   yet (then the step is still whole to skip);
3. else the clip factor, as torch's `clip_grad_norm_` takes it: max_norm / (norm + 1e-6),
   at most 1.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Optional

__all__ = ["Outcome", "StepScale", "needs_norm", "step_scale"]


class Outcome(enum.Enum):
    """What the step does."""

    APPLY = "apply"
    OVERFLOW = "overflow"
    """fp16: a gradient overflowed (the loss scale backs off)."""
    NONFINITE_LOSS = "nonfinite_loss"
    """A micro-batch's loss was NaN or inf (nonfinite_loss skip); its backward never ran."""
    NONFINITE_GRAD = "nonfinite_grad"
    """A finite loss, a non-finite gradient norm (the guard: skip)."""
    NONFINITE_GRAD_RAISE = "nonfinite_grad_raise"
    """The same under nonfinite_loss raise: skipped, then raised."""

    @property
    def skipped(self) -> bool:
        return self is not Outcome.APPLY


@dataclass(frozen=True)
class StepScale:
    outcome: Outcome
    grad_scale: Optional[float]
    """What the update multiplies each gradient by; None when the step is skipped."""
    reported_norm: float
    """The step's gradient norm as reported (inf for a skipped step, as DeepSpeed's ZeRO-3)."""


def needs_norm(overflow: bool, nonfinite_loss: bool) -> bool:
    """Whether the step takes the global norm (a collective) at all."""
    return not (overflow or nonfinite_loss)


def step_scale(*, unscale: float, overflow: bool, nonfinite_loss: bool, norm: Optional[float],
               guard: str, updated_in_backward: bool, clip: float) -> StepScale:
    """The step's outcome. `norm`: the un-scaled global gradient norm (None where
    `needs_norm` said not to take it); `guard`: config.nonfinite_loss ('off', 'skip',
    'raise'); `clip`: the max norm (0: no clipping)."""
    inf = float("inf")
    if overflow:
        return StepScale(Outcome.OVERFLOW, None, inf)
    if nonfinite_loss:
        return StepScale(Outcome.NONFINITE_LOSS, None, inf)
    if norm is None:
        raise ValueError("step_scale: the norm is needed (needs_norm) and was not given")
    if guard != "off" and not updated_in_backward and not math.isfinite(norm):
        outcome = Outcome.NONFINITE_GRAD_RAISE if guard == "raise" else Outcome.NONFINITE_GRAD
        return StepScale(outcome, None, inf)
    if clip > 0.0:
        return StepScale(Outcome.APPLY, unscale * min(1.0, clip / (norm + 1e-6)), norm)
    return StepScale(Outcome.APPLY, unscale, norm)
