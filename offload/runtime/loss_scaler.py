"""fp16 loss scaling, with DeepSpeed's semantics so its users see the same scale history.

Dynamic: start at 2**initial_scale_power; on an overflow the step is skipped and, once
`hysteresis` overflows have been absorbed, the scale halves (never below min_loss_scale);
after `loss_scale_window` steps since the last overflow it doubles. Static: a fixed scale
(`loss_scale > 0`); an overflow still skips the step. (DeepSpeed's DynamicLossScaler with
consecutive_hysteresis=False: hysteresis refills only when the scale grows.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class LossScaler:
    scale: float
    dynamic: bool
    scale_window: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    scale_factor: float = 2.0

    def __post_init__(self) -> None:
        self._cur_hysteresis = self.hysteresis
        self._iter = 0
        self._last_overflow_iter = -1

    @classmethod
    def from_precision(cls, precision: Any) -> "LossScaler":
        """From a `PrecisionConfig`; fp32/bf16 get a static scale of 1 (a no-op)."""
        if precision.dtype != "fp16":
            return cls(scale=1.0, dynamic=False)
        if precision.loss_scale > 0:
            return cls(scale=float(precision.loss_scale), dynamic=False)
        return cls(
            scale=float(2.0**precision.initial_scale_power),
            dynamic=True,
            scale_window=precision.loss_scale_window,
            hysteresis=precision.hysteresis,
            min_scale=float(precision.min_loss_scale),
        )

    def update(self, overflow: bool) -> None:
        """Record one optimizer step's outcome (call once per step, skipped or not)."""
        if self.dynamic:
            if overflow:
                if self.hysteresis == 1 or self._cur_hysteresis == 1:
                    self.scale = max(self.scale / self.scale_factor, self.min_scale)
                else:
                    self._cur_hysteresis -= 1
                self._last_overflow_iter = self._iter
            elif (self._iter - self._last_overflow_iter) % self.scale_window == 0:
                self._cur_hysteresis = self.hysteresis
                self.scale *= self.scale_factor
        self._iter += 1

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "cur_hysteresis": self._cur_hysteresis,
            "iter": self._iter,
            "last_overflow_iter": self._last_overflow_iter,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.scale = float(sd["scale"])
        self._cur_hysteresis = int(sd["cur_hysteresis"])
        self._iter = int(sd["iter"])
        self._last_overflow_iter = int(sd["last_overflow_iter"])
