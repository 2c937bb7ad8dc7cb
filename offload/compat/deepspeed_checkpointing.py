"""`deepspeed.checkpointing` for `offload.compat.deepspeed`: activation checkpointing, CPU
checkpoints included, through `offload.checkpointing` (offload/runtime/activations.py)."""

from __future__ import annotations

import types
import warnings
from typing import Any, Callable

import offload.checkpointing as ckpt
from offload.config import load_config

__all__ = ["checkpointing"]


def _checkpointing_configure(mpu_: Any = None, deepspeed_config: Any = None, partition_activations: Any = None,
                             contiguous_checkpointing: Any = None, num_checkpoints: Any = None,
                             checkpoint_in_cpu: Any = None, synchronize: Any = None,
                             profile: Any = None) -> None:
    """`deepspeed.checkpointing.configure(mpu, deepspeed_config=..., checkpoint_in_cpu=...)` ->
    `offload.checkpointing.configure`: CPU checkpointing from the config's
    activation_checkpointing.cpu_checkpointing or `checkpoint_in_cpu`; the model-parallel
    and memory-layout settings have nothing to act on (no model parallelism)."""
    if mpu_ is not None:
        raise NotImplementedError("deepspeed.checkpointing.configure(mpu_=...): offload has no model "
                                  "parallelism; pass None")
    cpu = False
    if deepspeed_config is not None:
        cpu = load_config(deepspeed_config).activation_checkpointing.cpu_offload
    if checkpoint_in_cpu is not None:
        cpu = bool(checkpoint_in_cpu)
    unused = {k for k, v in (("partition_activations", partition_activations),
                             ("contiguous_checkpointing", contiguous_checkpointing),
                             ("num_checkpoints", num_checkpoints), ("synchronize", synchronize),
                             ("profile", profile)) if v}
    if unused:
        warnings.warn(f"deepspeed.checkpointing.configure: {sorted(unused)} have no effect in offload "
                      "(data parallelism only: nothing to partition; see offload/runtime/activations.py)",
                      stacklevel=2)
    ckpt.configure(cpu_offload=cpu)


def _checkpointing_checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """`deepspeed.checkpointing.checkpoint(function, *args)` -> `offload.checkpointing.checkpoint`."""
    return ckpt.checkpoint(function, *args)


def _checkpointing_is_configured() -> bool:
    return ckpt.is_configured()


def _checkpointing_reset() -> None:
    ckpt.reset()


checkpointing = types.SimpleNamespace(
    configure=_checkpointing_configure, checkpoint=_checkpointing_checkpoint,
    is_configured=_checkpointing_is_configured, reset=_checkpointing_reset)
"""`deepspeed.checkpointing`: activation checkpointing, CPU checkpoints included (-> `offload.checkpointing`)."""
