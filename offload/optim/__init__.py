"""Optimizers that run on the CPU over fp32 master partitions."""

from offload.optim.adam8bit import (
    Moments8bit,
    adam8bit_step_flat,
    adam8bit_step_flat_reference,
    dequantize_blockwise,
    quantize_blockwise,
)
from offload.optim.cpu_adam import CPUAdam
from offload.optim.cpu_adam8bit import CPUAdam8bit
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
    "CPUAdam8bit",
    "Moments8bit",
    "adagrad_step_flat",
    "adagrad_step_flat_reference",
    "adam8bit_step_flat",
    "adam8bit_step_flat_reference",
    "adam_isa",
    "adam_step_flat",
    "adam_step_flat_reference",
    "dequantize_blockwise",
    "get_num_threads",
    "lion_step_flat",
    "lion_step_flat_reference",
    "quantize_blockwise",
    "set_num_threads",
    "supported_isas",
]
