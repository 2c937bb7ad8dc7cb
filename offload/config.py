"""Typed engine configuration, validated once at the door.

Downstream code receives these frozen dataclasses, never dicts. A DeepSpeed config is
translated in one place (`Config.from_deepspeed`).

NOTE (skeleton): field names here are the contract the engine codes against; validation,
loading from JSON/YAML and the DeepSpeed translation are filled in by the config work.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

ParamTier = Literal["device", "cpu", "nvme"]
OptimizerTier = Literal["cpu", "nvme"]
Precision = Literal["fp32", "bf16", "fp16"]


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    type: Literal["AdamW", "Adam"] = "AdamW"
    """AdamW: decoupled weight decay; Adam: L2 added to the gradient."""
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    moments_dtype: Literal["fp32", "bf16"] = "fp32"
    """Adam moments' storage dtype; bf16 halves their memory and I/O (opt-in)."""


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    type: Literal["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
    params: dict[str, Any] = field(default_factory=dict)
    """DeepSpeed's parameter names for the chosen schedule (warmup_num_steps, ...)."""


@dataclass(frozen=True, kw_only=True)
class PrecisionConfig:
    dtype: Precision = "fp32"
    """Compute/parameter dtype on the device; master weights are always fp32."""
    loss_scale: float = 0.0
    """fp16 only: 0 = dynamic loss scaling, > 0 = this static scale."""
    initial_scale_power: int = 16
    """fp16 dynamic scaling starts at 2**initial_scale_power."""
    loss_scale_window: int = 1000
    """Steps without overflow before the dynamic scale doubles."""
    hysteresis: int = 2
    min_loss_scale: float = 1.0


@dataclass(frozen=True, kw_only=True)
class OffloadConfig:
    param_tier: ParamTier = "cpu"
    """Where a rank's low-precision parameter shard lives between uses."""
    optimizer_tier: OptimizerTier = "cpu"
    """Where fp32 master weights and Adam moments live."""
    nvme_path: Optional[str] = None
    """Directory for swap files (required when either tier is nvme)."""
    pin_memory: bool = True
    """Pinned (page-locked) host buffers when CUDA is in use."""
    pinned_budget_bytes: int = 1 << 30
    """Upper bound on pinned host staging buffers for the NVMe tier, in bytes."""


@dataclass(frozen=True, kw_only=True)
class AIOConfig:
    block_size: int = 1 << 20
    """Bytes per I/O request submitted to the kernel."""
    queue_depth: int = 32
    """Requests in flight per worker thread."""
    threads: int = 2
    """I/O worker threads."""


@dataclass(frozen=True, kw_only=True)
class Config:
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: Optional[SchedulerConfig] = None
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    aio: AIOConfig = field(default_factory=AIOConfig)
    gradient_clipping: float = 0.0
    """Global-norm gradient clipping threshold; 0 disables."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step."""
    train_micro_batch_size_per_gpu: Optional[int] = None
    """Informational (the engine does not batch); kept for DeepSpeed configs."""
    unit_modules: tuple[str, ...] = ()
    """Class names of modules that become units; empty = each nn.ModuleList child."""
    compute_device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto = cuda when available, else cpu."""
    cpu_adam_threads: int = 0
    """Threads for the CPU Adam; 0 = the cores this process may use."""
