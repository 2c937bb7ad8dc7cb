"""DeepSpeed's warmup learning-rate schedules, as `torch.optim.lr_scheduler.LRScheduler`s.

`WarmupLR`, `WarmupDecayLR` and `WarmupCosineLR` take DeepSpeed's parameter names and
produce, step for step, the learning rates DeepSpeed 0.19's `deepspeed/runtime/
lr_schedules.py` produces, so a DeepSpeed config's `scheduler` section trains the same way
here. Being real `LRScheduler`s they also work with anything that drives a torch scheduler
(`state_dict`, `get_last_lr`, checkpointing code), and `build_scheduler` turns a validated
`SchedulerConfig` into one (the engine calls it).

[Note: step offset] DeepSpeed counts `last_batch_iteration` from -1: constructing a schedule
sets the learning rate for iteration -1 (the first optimizer step runs with it), and each
`scheduler.step()` after an optimizer step advances it. torch counts `last_epoch` from 0
after construction. We keep torch's counter and evaluate DeepSpeed's formula at
`last_batch_iteration = last_epoch - 1`, so the k-th optimizer step (0-based) runs with the
same rate in both: DeepSpeed's value at iteration k - 1. `last_batch_iteration` is exposed
as a property, and `load_state_dict` also accepts DeepSpeed's `{"last_batch_iteration": n}`.

Two deliberate differences, both stricter, neither changing a produced rate:
- an unknown `warmup_type` is a `ValueError` (DeepSpeed logs a warning and uses "log");
- resuming with `last_batch_iteration=n` sets the rate for iteration n at construction
  (DeepSpeed leaves the optimizer's rate untouched until the next `step()`).
"""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

if TYPE_CHECKING:  # pragma: no cover
    from offload.config import SchedulerConfig

__all__ = ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "build_scheduler", "SCHEDULES"]

WARMUP_TYPES = ("log", "linear")

LRValue = Union[float, list[float], tuple[float, ...]]


def _per_group(optimizer: Optimizer, value: LRValue, name: str) -> list[float]:
    """One value per param group: a scalar is broadcast, a list must match the groups."""
    if isinstance(value, (list, tuple)):
        if len(value) != len(optimizer.param_groups):
            raise ValueError(
                f"{name} has {len(value)} values but the optimizer has "
                f"{len(optimizer.param_groups)} param groups; give one value per group or a "
                f"single number for all of them"
            )
        return [float(v) for v in value]
    return [float(value)] * len(optimizer.param_groups)


def _check_steps(name: str, value: Any) -> int:
    # DeepSpeed rejects a non-int warmup_num_steps too (isinstance(..., int)); a bool is
    # an int to Python but never what the user meant.
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer (a count of optimizer steps), "
                         f"got {value!r}")
    return value


def _check_warmup_type(value: Any) -> str:
    if value not in WARMUP_TYPES:
        raise ValueError(f"warmup_type must be one of {', '.join(map(repr, WARMUP_TYPES))}, "
                         f"got {value!r}")
    return value


def _warmup_gamma(iteration: int, warmup_num_steps: int, warmup_type: str) -> float:
    """Fraction of the warmup done at `iteration` (< warmup_num_steps), in [0, 1).

    log: log(i + 1) / log(W); linear: i / W. W is already clamped to >= 2 (so log(W) > 0),
    as DeepSpeed does.
    """
    if warmup_type == "log":
        # Multiplying by the reciprocal (not dividing) is DeepSpeed's order of operations:
        # it keeps the rates bit-identical to theirs.
        return (1.0 / math.log(warmup_num_steps)) * math.log(iteration + 1)
    return iteration / warmup_num_steps


class _DeepSpeedSchedule(LRScheduler):
    """Shared counter handling; see [Note: step offset]."""

    def __init__(self, optimizer: Optimizer, last_batch_iteration: int) -> None:
        if isinstance(last_batch_iteration, bool) or not isinstance(last_batch_iteration, int) \
                or last_batch_iteration < -1:
            raise ValueError(f"last_batch_iteration must be an integer >= -1 (-1 = a fresh "
                             f"run), got {last_batch_iteration!r}")
        if last_batch_iteration != -1:
            # torch insists on 'initial_lr' when resuming; the group's current rate is what
            # DeepSpeed would have read at this point.
            for group in optimizer.param_groups:
                group.setdefault("initial_lr", group["lr"])
        # torch's initial step moves last_epoch from -1 to 0 (DeepSpeed iteration -1), or
        # from n to n + 1 (DeepSpeed iteration n) when resuming.
        super().__init__(optimizer, last_epoch=last_batch_iteration)

    @property
    def last_batch_iteration(self) -> int:
        """DeepSpeed's counter: the iteration whose rate the optimizer holds now."""
        return self.last_epoch - 1

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load our own `state_dict()`, or DeepSpeed's `{"last_batch_iteration": n}`."""
        if "last_epoch" not in state_dict and "last_batch_iteration" in state_dict:
            self.last_epoch = int(state_dict["last_batch_iteration"]) + 1
            return
        super().load_state_dict(state_dict)

    def get_lr(self) -> list[Union[float, torch.Tensor]]:  # torch's type: a value may be a tensor
        return list(self._lrs_at(self.last_epoch - 1))

    def _lrs_at(self, iteration: int) -> list[float]:
        raise NotImplementedError


class WarmupLR(_DeepSpeedSchedule):
    """Rise from `warmup_min_lr` to `warmup_max_lr` over `warmup_num_steps`, then hold.

    At DeepSpeed iteration i (see [Note: step offset]), W = max(2, warmup_num_steps):
    lr = min + (max - min) * gamma, gamma = log(i + 1) / log(W) ("log") or i / W
    ("linear") while i < W, else 1; at i = -1 (construction) lr = min.
    `warmup_max_lr=None` takes each param group's own learning rate.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        warmup_min_lr: LRValue = 0.0,
        warmup_max_lr: Optional[LRValue] = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        _check_steps("warmup_num_steps", warmup_num_steps)
        if warmup_max_lr is None:
            warmup_max_lr = [group.get("initial_lr", group["lr"]) for group in optimizer.param_groups]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.delta_lrs = [hi - lo for hi, lo in zip(self.max_lrs, self.min_lrs)]
        # DeepSpeed clamps to 2 so that log(W) is never 0.
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = _check_warmup_type(warmup_type)
        super().__init__(optimizer, last_batch_iteration)

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return _warmup_gamma(iteration, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def _lrs_at(self, iteration: int) -> list[float]:
        if iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma(iteration)
        return [lo + delta * gamma for lo, delta in zip(self.min_lrs, self.delta_lrs)]


class WarmupDecayLR(WarmupLR):
    """`WarmupLR`'s warmup, then a linear decay to 0 at `total_num_steps`.

    After warmup (i >= W): gamma = max(0, (T - i) / max(1, T - W)).
    Unlike `WarmupLR`, `warmup_max_lr` defaults to 0.001 (not the optimizer's rate), as in
    DeepSpeed.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        total_num_steps: int,
        warmup_min_lr: LRValue = 0.0,
        warmup_max_lr: LRValue = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = _check_steps("total_num_steps", total_num_steps)
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)
        if self.total_num_steps < self.warmup_num_steps:
            warnings.warn(f"WarmupDecayLR: total_num_steps {total_num_steps} is less than "
                          f"warmup_num_steps {self.warmup_num_steps}; the rate drops to 0 right "
                          f"after warmup", UserWarning, stacklevel=2)

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return _warmup_gamma(iteration, self.warmup_num_steps, self.warmup_type)
        return max(0.0, float(self.total_num_steps - iteration)
                   / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(_DeepSpeedSchedule):
    """Scale each group's learning rate by a ratio: warmup, then a cosine down to a floor.

    Ratio at DeepSpeed iteration i, W = max(2, warmup_num_steps), T = total_num_steps:
    i = -1: 0; i < W: r0 + gamma * (1 - r0) with r0 = warmup_min_ratio and gamma as in
    `WarmupLR`; else with p = min(1, (i - W + 1) / max(1, T - W)):
    max(0, c + (1 - c) * (1 + cos(pi * p)) / 2), c = cos_min_ratio. The ratio multiplies
    the group's rate when the schedule was built. The clamp of p to 1 is DeepSpeed 0.19's
    (older versions let the cosine swing back up past T).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        _check_steps("warmup_num_steps", warmup_num_steps)
        self.total_num_steps = _check_steps("total_num_steps", total_num_steps)
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.cos_min_ratio = float(cos_min_ratio)
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = _check_warmup_type(warmup_type)
        if self.total_num_steps < self.warmup_num_steps:
            warnings.warn(f"WarmupCosineLR: total_num_steps {total_num_steps} is less than "
                          f"warmup_num_steps {self.warmup_num_steps}; the rate sits at "
                          f"cos_min_ratio right after warmup", UserWarning, stacklevel=2)
        super().__init__(optimizer, last_batch_iteration)

    def lr_ratio(self, iteration: int) -> float:
        """The multiplier at DeepSpeed iteration `iteration`."""
        if iteration < 0:
            return 0.0
        if iteration < self.warmup_num_steps:
            gamma = _warmup_gamma(iteration, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + gamma * (1.0 - self.warmup_min_ratio)
        real_last_step = iteration - self.warmup_num_steps + 1
        real_total_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, real_last_step / real_total_steps)
        cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def _lrs_at(self, iteration: int) -> list[float]:
        ratio = self.lr_ratio(iteration)
        # base_lrs are the groups' rates when the schedule was built ('initial_lr').
        return [float(base) * ratio for base in self.base_lrs]


SCHEDULES: dict[str, type[_DeepSpeedSchedule]] = {
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
}
"""Schedule name (DeepSpeed's `scheduler.type`) -> class."""


def build_scheduler(optimizer: Optimizer, config: "SchedulerConfig") -> LRScheduler:
    """The schedule `config` names, driving `optimizer`'s param groups.

    `config` was validated when it was built (names and ranges of its params); the
    constructors check again what depends on the optimizer (per-group lists).
    """
    try:
        cls = SCHEDULES[config.type]
    except KeyError:
        raise ValueError(f"scheduler.type {config.type!r} is not a known schedule; use one of "
                         f"{', '.join(SCHEDULES)}") from None
    return cls(optimizer, **config.params)


def resolve_scheduler(optimizer: Optimizer, given: Any, config: Optional["SchedulerConfig"]) -> Any:
    """The scheduler `initialize(lr_scheduler=...)` asks for, on the engine's `optimizer`:
    a callable `optimizer -> scheduler` is called; a scheduler must already drive
    `optimizer`; None builds `config` (or no scheduler without one)."""
    if given is not None:
        if callable(given) and not hasattr(given, "step"):
            return given(optimizer)
        if getattr(given, "optimizer", None) is not optimizer:
            raise TypeError(
                "lr_scheduler must be a callable taking engine.optimizer (e.g. "
                "lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, fn)); a scheduler built "
                "on another optimizer would not drive the engine's learning rate"
            )
        return given
    return None if config is None else build_scheduler(optimizer, config)
