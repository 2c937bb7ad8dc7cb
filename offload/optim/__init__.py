"""Optimizers that run on the CPU over fp32 master partitions."""

from offload.optim.cpu_adam import CPUAdam
from offload.optim.functional import (
    adam_isa,
    adam_step_flat,
    adam_step_flat_reference,
    get_num_threads,
    set_num_threads,
    supported_isas,
)

__all__ = [
    "CPUAdam",
    "adam_isa",
    "adam_step_flat",
    "adam_step_flat_reference",
    "get_num_threads",
    "set_num_threads",
    "supported_isas",
]
