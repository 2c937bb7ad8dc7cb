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
from offload.optim.one_state import (
    adagrad_step_flat,
    adagrad_step_flat_reference,
    lion_step_flat,
    lion_step_flat_reference,
)

__all__ = [
    "CPUAdam",
    "adagrad_step_flat",
    "adagrad_step_flat_reference",
    "adam_isa",
    "adam_step_flat",
    "adam_step_flat_reference",
    "get_num_threads",
    "lion_step_flat",
    "lion_step_flat_reference",
    "set_num_threads",
    "supported_isas",
]
