"""Optimizers that run on the CPU over fp32 master partitions."""

from offload.optim.functional import adam_step_flat, adam_step_flat_reference

__all__ = ["adam_step_flat", "adam_step_flat_reference"]
