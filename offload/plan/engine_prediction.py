"""The planner's predicted step for an engine being built, for its step report.

The engine (the api layer) calls `predict_for_engine` at `initialize` and hands the number
down to the step report (offload/runtime/report.py), which shows it beside the measured step:
the runtime never imports the planner. A prediction needs the tokens per step
(`logging.tokens_per_step`, which the report's tokens/s uses too) and this machine's cached
profile (`python -m offload.plan --measure`): a training run never measures the machine on
its own, and without either there is no prediction (None).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from torch import nn

from offload.plan.profile import this_machine_cached
from offload.plan.shapes import shape_from_model
from offload.plan.step_time import StepPrediction, StepSettings, predict_step

__all__ = ["predict_for_engine"]

logger = logging.getLogger("offload")


def predict_for_engine(model: nn.Module, config: Any, *, on_gpu: bool, world_size: int) -> Optional[StepPrediction]:
    """The step `config`'s placement should take for `model` on this machine, or None (no
    tokens per step, no cached profile of this machine, or a figure the placement needs
    missing from it)."""
    tokens = config.logging.tokens_per_step
    if not tokens:
        return None
    profile = this_machine_cached(config.offload.nvme_path)
    if profile is None:
        return None
    # tokens_per_step is one rank's, accumulation included: the step this rank computes.
    shape = shape_from_model(model, tokens=int(tokens),
                             unit_modules=tuple(config.unit_modules), leaf_modules=tuple(config.leaf_modules))
    settings = StepSettings.from_config(config, config.offload.param_tier, config.offload.optimizer_tier,
                                        on_gpu=on_gpu, world_size=world_size)
    try:
        return predict_step(shape, profile, settings)
    except ValueError as e:
        logger.debug("no predicted step: %s", e)
        return None
