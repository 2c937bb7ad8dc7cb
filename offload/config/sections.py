"""offload's configuration as typed sections, each checked once when it is built.

Downstream code receives these frozen dataclasses, never dicts. `Config` is the tree; its
sections (`OffloadConfig`, `OptimizerConfig`, ...) own one concern each. Ways in:

- `Config(...)` / `Config.from_dict(d)`: offload's own format, the dataclass field names
  nested by section (`{"offload": {"param_tier": "nvme", ...}}`).
- `Config.from_file(path)`, `Config.from_deepspeed(d_or_path)` and `load_config(obj)` read
  files, tell the two formats apart and translate DeepSpeed's; they live in
  offload/config/load.py and offload/config/deepspeed.py ([Note: Config's ways in]).

Every value is checked in `__post_init__` (types, ranges, combinations), so a `Config` that
exists is valid; what depends on the machine (the NVMe path exists and takes O_DIRECT, the
pinned budget holds one unit) is checked by `initialize`. The checking machinery (the
`Section` base, `coerce`) and the errors, `ConfigError` (a `ValueError`; `ConfigTypeError` is
also a `TypeError`) whose message names the key, the value, the rule and the fix, are in
checks.py. docs/config.md has the format.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Literal, Mapping, Optional

from offload.config.checks import (
    ConfigError,
    Section,
    at_most,
    coerce,
    did_you_mean,
    join_key,
    require,
    rule_error,
)
from offload.config.deepspeed_keys import DS_ONLY_TOP_KEYS
from offload.config.monitor_sections import (
    CSVMonitorConfig,
    LoggingConfig,
    MonitorsConfig,
    TensorBoardConfig,
    TimelineConfig,
    WandbConfig,
)
from offload.config.sharding import ShardingConfig
from offload.sizes import ALIGNMENT, GiB, MiB

MAX_THREADS = 4096
"""The most threads a key may ask for (CPU optimizer, AIO workers): more than any machine
offload runs on has cores; a larger number is a typo, refused before any thread starts."""
MAX_TIMEOUT_S = 365 * 24 * 3600.0

__all__ = [
    "Config",
    "OffloadConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "PrecisionConfig",
    "AIOConfig",
    "PrefetchConfig",
    "TimelineConfig",
    "LoggingConfig",
    "MonitorsConfig",
    "TensorBoardConfig",
    "WandbConfig",
    "CSVMonitorConfig",
    "ActivationCheckpointingConfig",
    "ShardingConfig",
    "SCHEDULER_PARAMS",
]

ParamTier = Literal["device", "cpu", "nvme"]
OptimizerTier = Literal["cpu", "nvme", "device"]
Precision = Literal["fp32", "bf16", "fp16"]
BufferDtype = Literal["keep", "compute", "fp32", "bf16", "fp16"]


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig(Section):
    _SECTION: ClassVar[str] = "optimizer"

    type: Literal["AdamW", "Adam", "Lion", "Adagrad", "SGD"] = "AdamW"
    """AdamW: decoupled weight decay; Adam: L2 added to the gradient; Lion (lr, betas,
    weight_decay: decoupled); Adagrad (lr, lr_decay, weight_decay as L2, eps,
    initial_accumulator_value); SGD (lr, momentum, dampening, nesterov, weight_decay as L2:
    torch.optim.SGD on the shards, offload/optim/generic.py). docs/adam.md, "The engine's
    optimizers"."""
    lr: float = 1e-3
    """Learning rate (before any schedule), per optimizer step."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Decay rates of the first and second moment, each in [0, 1) (Lion: the update's
    interpolation and the momentum's decay, each in [0, 1])."""
    eps: float = 1e-8
    """Added to the denominator's square root (torch's placement), >= 0."""
    weight_decay: float = 0.01
    """Per-step decay coefficient (decoupled for AdamW, L2 for Adam), >= 0."""
    moments_dtype: Literal["fp32", "bf16", "8bit"] = "fp32"
    """The optimizer state's storage dtype (Adam's moments, Lion's momentum, Adagrad's sum);
    bf16 halves their memory and I/O (opt-in). "8bit" (Adam and AdamW): each moment as a
    one-byte code plus an fp32 scale per block of 256, bitsandbytes' and torchao's blockwise
    8-bit definition (offload/optim/adam8bit.py): 2.03 B/param for both moments instead of 8."""
    lr_decay: float = 0.0
    """Adagrad only: the step size is lr / (1 + (step - 1) * lr_decay), >= 0."""
    initial_accumulator_value: float = 0.0
    """Adagrad only: the value its sum of squared gradients starts at, >= 0."""
    momentum: float = 0.0
    """SGD only: the momentum factor, >= 0 (0: no momentum buffer)."""
    dampening: float = 0.0
    """SGD only: dampening for momentum, >= 0."""
    nesterov: bool = False
    """SGD only: Nesterov momentum (needs momentum > 0 and dampening 0)."""

    def _check(self) -> None:
        require(self.lr >= 0, self._key("lr"), self.lr, "the learning rate must be >= 0",
                "set a non-negative learning rate (1e-3 is DeepSpeed's and torch's default)")
        top = 1.0 if self.type == "Lion" else 0.0  # Lion's betas may be 1 (lion-pytorch's check)
        for i, beta in enumerate(self.betas):
            require(0.0 <= beta and (beta < 1.0 or beta <= top), self._key(f"betas[{i}]"), beta,
                    f"each beta must be in [0, {'1]' if top else '1)'} for {self.type}",
                    "use values like [0.9, 0.99] for Lion, [0.9, 0.999] for Adam")
        require(self.eps >= 0, self._key("eps"), self.eps, "eps must be >= 0",
                "use a small positive value such as 1e-8")
        require(self.weight_decay >= 0, self._key("weight_decay"), self.weight_decay,
                "weight decay must be >= 0", "use 0 to disable weight decay")
        require(self.moments_dtype != "8bit" or self.type in ("Adam", "AdamW"),
                self._key("moments_dtype"), self.moments_dtype,
                f"8-bit moments are Adam's; {self.type} keeps its state in fp32 or bf16",
                "set moments_dtype to 'fp32' or 'bf16', or optimizer.type to 'AdamW'")
        for key in ("lr_decay", "initial_accumulator_value"):
            value = getattr(self, key)
            require(value >= 0, self._key(key), value, f"{key} must be >= 0",
                    "use 0 (torch.optim.Adagrad's default)")
            require(value == 0 or self.type == "Adagrad", self._key(key), value,
                    f"only Adagrad has {key}, this optimizer is {self.type}",
                    "remove it, or set optimizer.type='Adagrad'")
        for key in ("momentum", "dampening"):
            value = getattr(self, key)
            require(value >= 0, self._key(key), value, f"{key} must be >= 0", "use 0 to disable it")
            require(value == 0 or self.type == "SGD", self._key(key), value,
                    f"only SGD has {key}, this optimizer is {self.type}",
                    "remove it, or set optimizer.type='SGD'")
        if self.nesterov:
            require(self.type == "SGD" and self.momentum > 0 and self.dampening == 0,
                    self._key("nesterov"), self.nesterov,
                    "Nesterov momentum is SGD's and needs momentum > 0 and dampening 0",
                    "set optimizer.momentum (e.g. 0.9) and dampening 0, or remove nesterov")


SCHEDULER_PARAMS: dict[str, dict[str, Any]] = {
    "WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": None, "warmup_num_steps": 1000,
                 "warmup_type": "log", "last_batch_iteration": -1},
    "WarmupDecayLR": {"total_num_steps": ..., "warmup_min_lr": 0.0, "warmup_max_lr": 0.001,
                      "warmup_num_steps": 1000, "warmup_type": "log", "last_batch_iteration": -1},
    "WarmupCosineLR": {"total_num_steps": ..., "warmup_min_ratio": 0.0, "warmup_num_steps": 1000,
                       "cos_min_ratio": 0.0001, "warmup_type": "log", "last_batch_iteration": -1},
}
"""Each schedule's parameters and DeepSpeed's defaults (`...` = required). Kept equal to the
constructors in offload/optim/lr_schedules.py (a test compares them); here so that a config is
checked without importing torch."""


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig(Section):
    _SECTION: ClassVar[str] = "scheduler"

    type: Literal["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
    """DeepSpeed's schedule name; offload/optim/lr_schedules.py has the formulas."""
    params: dict[str, Any] = field(default_factory=dict)
    """DeepSpeed's parameter names for the chosen schedule (warmup_num_steps, ...)."""

    def _check(self) -> None:
        spec = SCHEDULER_PARAMS[self.type]
        prefix = self._key("params")
        for name in self.params:
            if name not in spec:
                raise ConfigError(join_key(prefix, str(name)),
                                  f"is not a parameter of {self.type}{did_you_mean(name, spec)}",
                                  f"{self.type} takes: {', '.join(spec)}")
        for name, default in spec.items():
            if default is ... and name not in self.params:
                raise ConfigError(join_key(prefix, name), f"is missing; {self.type} requires it",
                                  f"set {join_key(prefix, name)} to the total number of optimizer "
                                  f"steps of the run")
        params = dict(self.params)
        for name, value in self.params.items():
            key = join_key(prefix, name)
            if name in ("warmup_num_steps", "total_num_steps"):
                value = coerce(key, value, int)
                require(value > 0, key, value, "it must be a positive number of optimizer steps",
                        f"set {key} to an integer >= 1")
            elif name == "last_batch_iteration":
                value = coerce(key, value, int)
                require(value >= -1, key, value, "it must be >= -1 (-1 = a fresh run)",
                        f"leave {key} out unless resuming")
            elif name == "warmup_type":
                value = coerce(key, value, Literal["log", "linear"])
            elif name in ("warmup_min_lr", "warmup_max_lr"):
                if value is None and name == "warmup_max_lr" and self.type == "WarmupLR":
                    pass  # None: each param group's own learning rate
                elif isinstance(value, (list, tuple)):
                    value = [coerce(f"{key}[{i}]", v, float) for i, v in enumerate(value)]
                    for i, v in enumerate(value):
                        require(v >= 0, f"{key}[{i}]", v, "learning rates must be >= 0",
                                "use non-negative learning rates")
                else:
                    value = coerce(key, value, float)
                    require(value >= 0, key, value, "learning rates must be >= 0",
                            "use a non-negative learning rate")
            elif name in ("warmup_min_ratio", "cos_min_ratio"):
                value = coerce(key, value, float)
                require(0.0 <= value <= 1.0, key, value,
                        "it is a fraction of the optimizer's learning rate and must be in [0, 1]",
                        f"set {key} between 0 and 1")
            params[name] = value
        object.__setattr__(self, "params", params)


@dataclass(frozen=True, kw_only=True)
class PrecisionConfig(Section):
    _SECTION: ClassVar[str] = "precision"

    dtype: Precision = "fp32"
    """Compute/parameter dtype on the device; master weights are always fp32."""
    loss_scale: float = 0.0
    """fp16 only: 0 = dynamic loss scaling, > 0 = this static scale."""
    initial_scale_power: int = 16
    """fp16 dynamic scaling starts at 2**initial_scale_power."""
    loss_scale_window: int = 1000
    """Steps without overflow before the dynamic scale doubles."""
    hysteresis: int = 2
    """Overflowing steps (since the last decrease) it takes to halve the dynamic scale
    (DeepSpeed's delayed shift); 1 = halve on every overflow."""
    min_loss_scale: float = 1.0
    """Floor of the dynamic loss scale, > 0."""
    buffer_dtype: BufferDtype = "keep"
    """Floating-point buffers (RoPE's inv_freq, running statistics): 'keep' = the dtype the
    model gave them (DeepSpeed's and FSDP2's default); 'compute' = precision.dtype, as
    model.to(dtype) would; or that named dtype (DeepSpeed's data_types.buffer_dtype).
    Exceptions: docs/engine.md, Buffers."""
    keep_in_fp32_modules: Optional[tuple[str, ...]] = None
    """bf16/fp16: name patterns of tensors to keep in fp32 (transformers' rule: `*` = any
    characters, found anywhere in the full name). None = the model's own transformers lists
    (`_keep_in_fp32_modules_strict`, and `_keep_in_fp32_modules` under fp16); [] = none.
    Matching buffers stay fp32; a matching parameter is refused by initialize (a unit holds
    one dtype)."""

    def _check(self) -> None:
        require(self.loss_scale >= 0, self._key("loss_scale"), self.loss_scale,
                "it must be >= 0 (0 selects dynamic loss scaling)",
                "use 0 for dynamic scaling or a positive static scale such as 1024")
        # 2**127 is the largest power of two an fp32 scale factor can hold.
        require(0 <= self.initial_scale_power <= 127, self._key("initial_scale_power"),
                self.initial_scale_power, "2**initial_scale_power must be a finite fp32 number",
                "use a value in [0, 127]; 16 (DeepSpeed's default) suits most models")
        require(self.loss_scale_window >= 1, self._key("loss_scale_window"), self.loss_scale_window,
                "it must be >= 1 step", "use e.g. 1000 (DeepSpeed's default)")
        require(self.hysteresis >= 1, self._key("hysteresis"), self.hysteresis,
                "it must be >= 1", "use e.g. 2 (DeepSpeed's default)")
        require(self.min_loss_scale > 0, self._key("min_loss_scale"), self.min_loss_scale,
                "the dynamic scale's floor must be > 0", "use e.g. 1 (DeepSpeed's default)")
        for i, pattern in enumerate(self.keep_in_fp32_modules or ()):
            key = self._key(f"keep_in_fp32_modules[{i}]")
            require(bool(pattern.strip()), key, pattern, "an empty pattern would match every tensor",
                    "name modules or tensors, e.g. 'wo' or 'e_score_correction_bias', or use [] "
                    "to keep nothing in fp32")
            try:
                re.compile(pattern.replace("*", ".*"))
            except re.error as exc:
                raise rule_error(key, pattern, f"it is not a valid pattern ({exc})",
                                 "use a module or tensor name, with * for any characters") from None


@dataclass(frozen=True, kw_only=True)
class OffloadConfig(Section):
    _SECTION: ClassVar[str] = "offload"

    param_tier: ParamTier = "cpu"
    """Where a rank's low-precision parameter shard lives between uses."""
    optimizer_tier: OptimizerTier = "cpu"
    """Where fp32 master weights and Adam moments live; "device": every unit's on the compute
    device, updated there (docs/config.md, "The update split")."""
    nvme_path: Optional[str] = None
    """Directory for swap files (required when either tier is nvme)."""
    pin_memory: bool = True
    """Pinned (page-locked) host buffers when CUDA is in use."""
    pinned_budget_bytes: int = GiB
    """Upper bound on pinned host staging buffers for the NVMe tier, in bytes."""
    placement: Literal["manual", "auto"] = "manual"
    """manual = use param_tier and optimizer_tier as given; auto = `initialize` runs the
    memory planner (offload.plan.planner) on this machine and picks the fastest placement that fits
    (an nvme one only when nvme_path is set), and the host memory left over for `ram_budget_bytes`,
    logging its choice."""
    ram_budget_bytes: Optional[int] = None
    """With an NVMe tier: host memory (bytes, per rank) for units' parameter shards and
    optimizer states kept in RAM instead of on NVMe, chosen to save the most disk traffic per
    step (offload/storage/placement.py); None or 0 = every unit on its NVMe tier."""
    ram_fraction: Optional[float] = None
    """Instead of `ram_budget_bytes`: the share (0 to 1) of the NVMe tiers' bytes to keep in RAM."""
    optimizer_device_units: Any = None
    """Units whose fp32 master and optimizer state live on the compute device and update there:
    a count (the root and the first blocks: their CPU update would finish last) or a list of
    unit names ("<root>", "blocks.0", ...); the others follow optimizer_tier. None: none."""
    optimizer_device_fraction: Optional[float] = None
    """Instead of `optimizer_device_units`: the share (0 to 1) of the optimizer state's bytes
    on the compute device, filled in the same order."""

    def _check(self) -> None:
        if self.placement == "auto" and (self.param_tier, self.optimizer_tier) != ("cpu", "cpu"):
            raise ConfigError(self._key("placement"),
                              f"= 'auto' chooses the tiers, but param_tier={self.param_tier!r} / "
                              f"optimizer_tier={self.optimizer_tier!r} were also set",
                              "either leave the tiers out and keep placement 'auto', or set the "
                              "tiers with placement 'manual'")
        for tier_key in ("param_tier", "optimizer_tier"):
            if getattr(self, tier_key) == "nvme" and not self.nvme_path:
                raise ConfigError(self._key("nvme_path"),
                                  f"is required when {self._key(tier_key)} is 'nvme'",
                                  "set it to a directory on a local NVMe disk")
        self._check_ram_budget()
        self._check_device_units()
        require(self.pinned_budget_bytes > 0, self._key("pinned_budget_bytes"),
                self.pinned_budget_bytes, "the budget must be a positive number of bytes",
                "use at least a few unit shards' worth, e.g. 1073741824 (1 GiB)")


    def _check_device_units(self) -> None:
        """`optimizer_device_units` (a count or names) or `optimizer_device_fraction`, one of them,
        with a tier they split; normalised: an integral number to an int, a list to a tuple."""
        units, frac = self.optimizer_device_units, self.optimizer_device_fraction
        key = self._key("optimizer_device_units")
        if units is None and frac is None:
            return
        if units is not None and frac is not None:
            raise ConfigError(self._key("optimizer_device_fraction"), "and optimizer_device_units are "
                              "both set", "say which units' optimizer state is on the device one way")
        given = key if units is not None else self._key("optimizer_device_fraction")
        if self.placement == "auto" or self.optimizer_tier == "device":
            why = "placement 'auto' sizes the split" if self.placement == "auto" else \
                "optimizer_tier 'device' puts every unit there"
            raise ConfigError(given, f"is set, but {why}", f"leave {given} out, or use placement "
                              "'manual' with optimizer_tier 'cpu' or 'nvme'")
        if frac is not None:
            require(0.0 <= frac <= 1.0, given, frac, "the fraction must be between 0 and 1",
                    "e.g. 0.4 puts 40 % of the optimizer state's bytes on the compute device")
            return
        if isinstance(units, float) and units.is_integer():
            units = int(units)
        if isinstance(units, int) and not isinstance(units, bool):
            require(units >= 0, key, units, "a count of units must be >= 0",
                    "e.g. 4: the root and the first three blocks")
        elif isinstance(units, (list, tuple)) and all(isinstance(u, str) and u for u in units):
            require(len(set(units)) == len(units), key, units, "a unit is named twice",
                    "name each unit once")
            units = tuple(units)
        else:
            raise ConfigError(key, f"= {units!r}, which is neither a count of units nor a list of "
                              "unit names", "give a count (e.g. 4), a list such as ['<root>', "
                              "'blocks.0'], or a share of the bytes as optimizer_device_fraction")
        object.__setattr__(self, "optimizer_device_units", units)

    def _check_ram_budget(self) -> None:
        keys = [k for k in ("ram_budget_bytes", "ram_fraction") if getattr(self, k) is not None]
        if not keys:
            return
        if len(keys) == 2:
            raise ConfigError(self._key("ram_fraction"), "and ram_budget_bytes are both set",
                              "give the host memory for units kept in RAM one way: bytes or a fraction")
        key = keys[0]
        if self.placement == "auto":
            raise ConfigError(self._key(key), "is chosen by placement 'auto' (the host memory "
                              "the planner finds left over)",
                              f"leave {key} out, or set the tiers with placement 'manual'")
        if "nvme" not in (self.param_tier, self.optimizer_tier):
            raise ConfigError(self._key(key), "keeps units of an NVMe tier in RAM, but neither "
                              "param_tier nor optimizer_tier is 'nvme'",
                              f"leave {key} out (every unit is in memory already)")
        if self.ram_budget_bytes is not None:  # the one of the two that is set
            require(self.ram_budget_bytes >= 0, self._key(key), self.ram_budget_bytes,
                    "the budget must be a number of bytes >= 0", "e.g. 17179869184 (16 GiB)")
        elif self.ram_fraction is not None:
            require(0.0 <= self.ram_fraction <= 1.0, self._key(key), self.ram_fraction,
                    "the fraction must be between 0 and 1", "e.g. 0.4 keeps 40 % of the NVMe bytes in RAM")


@dataclass(frozen=True, kw_only=True)
class AIOConfig(Section):
    _SECTION: ClassVar[str] = "aio"

    block_size: int = MiB
    """Bytes per I/O request submitted to the kernel."""
    queue_depth: int = 32
    """Requests in flight per worker thread."""
    threads: int = 2
    """I/O worker threads."""

    def _check(self) -> None:
        # O_DIRECT needs requests in multiples of the logical block size; ALIGNMENT (4 KiB)
        # covers every NVMe drive we know of and is what the native I/O layer aligns to.
        require(self.block_size > 0 and self.block_size % ALIGNMENT == 0,
                self._key("block_size"), self.block_size,
                f"O_DIRECT requests must be a positive multiple of {ALIGNMENT} bytes",
                "use a power of two such as 1048576 (1 MiB)")
        require(self.queue_depth >= 1, self._key("queue_depth"), self.queue_depth,
                "at least one request must be in flight", "use e.g. 32")
        require(self.threads >= 1, self._key("threads"), self.threads,
                "at least one I/O worker thread is needed", "use e.g. 2")
        at_most(self._key("block_size"), self.block_size, GiB, "1 GiB: larger requests gain nothing and "
                "each worker holds queue_depth of them", "use a power of two such as 1048576 (1 MiB)")
        at_most(self._key("queue_depth"), self.queue_depth, 65536, "the kernel's default limit on AIO "
                "requests in flight, fs.aio-max-nr", "use e.g. 32")
        at_most(self._key("threads"), self.threads, MAX_THREADS, "a larger count is more than any machine's cores",
                "use e.g. 2")


@dataclass(frozen=True, kw_only=True)
class PrefetchConfig(Section):
    _SECTION: ClassVar[str] = "prefetch"

    prefetch_bytes: int = 256 * MiB
    """Gathered-parameter bytes fetched ahead of the unit now computing (in the traced
    order, through every stage NVMe -> pinned -> device -> all-gather); 0 = fetch on demand."""
    keep_bytes: int = 256 * MiB
    """Gathered-parameter bytes kept on the compute device after use because the trace
    says they are needed again soon (end of forward = start of backward); 0 = always release."""
    optimizer_in_backward: bool = True
    """Update each unit as soon as its gradient shard is final, while backward goes on
    (state read ahead, CPU Adam, write-back). Only where it is exact: no gradient
    clipping (which needs the global norm) and no fp16 (whose overflow check needs every
    gradient); otherwise the update runs in `engine.step()`. The learning rate and other
    hyperparameters are then read at backward: change them before `engine.backward`."""
    optimizer_worker: Literal["auto", "on", "off"] = "auto"
    """Where those updates run (offload/runtime/optimizer_worker.py): "on", a thread of
    their own while autograd goes on (on a GPU, gradients come down asynchronously and the
    step is about max(GPU, PCIe, CPU Adam) instead of their sum); "off", autograd's thread;
    "auto", on with a CUDA compute device and no NVMe tier, off on the CPU (where the
    update and the backward compete for the same cores). Bit-identical either way."""

    def _check(self) -> None:
        for name in ("prefetch_bytes", "keep_bytes"):
            value = getattr(self, name)
            require(value >= 0, self._key(name), value, "a byte budget must be >= 0",
                    "use 0 to switch this off")


@dataclass(frozen=True, kw_only=True)
class ActivationCheckpointingConfig(Section):
    _SECTION: ClassVar[str] = "activation_checkpointing"

    cpu_offload: bool = False
    """`offload.checkpointing.checkpoint` keeps each checkpointed region's inputs in pinned
    host memory from its forward to its recomputation, brought back ahead of it on a side
    stream (ZeRO-R's CPU checkpointing; DeepSpeed's `cpu_checkpointing`). On a GPU the
    device then holds no checkpointed activation between forward and backward; on the CPU
    it saves nothing (offload/runtime/activations.py)."""


@dataclass(frozen=True, kw_only=True)
class Config(Section):
    _SECTION: ClassVar[str] = ""
    _NOT_LOADED: ClassVar[frozenset[str]] = frozenset({"ignored_keys", "notes"})

    offload: OffloadConfig = field(default_factory=OffloadConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: Optional[SchedulerConfig] = None
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    aio: AIOConfig = field(default_factory=AIOConfig)
    prefetch: PrefetchConfig = field(default_factory=PrefetchConfig)
    timeline: TimelineConfig = field(default_factory=TimelineConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    monitors: MonitorsConfig = field(default_factory=MonitorsConfig)
    activation_checkpointing: ActivationCheckpointingConfig = field(
        default_factory=ActivationCheckpointingConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    """Past one node: HSDP or ZeRO++ hpZ (offload/config/sharding.py, docs/multinode.md)."""
    gradient_clipping: float = 0.0
    """Global-norm gradient clipping threshold; 0 disables."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step."""
    zero_stage: Literal[1, 2, 3] = 3
    """ZeRO stage (DeepSpeed's zero_optimization.stage). 3: parameters partitioned too,
    gathered unit by unit when used (they may live on CPU or NVMe). 2: parameters whole and
    resident on the compute device between steps (no gathers in forward or backward; each
    unit is gathered again once after its update), gradients reduce-scattered into each
    rank's partition, optimizer state partitioned and tiered. 1: as 2, with gradients
    all-reduced (the rank keeps its partition). Same trained model at every stage."""
    train_micro_batch_size_per_gpu: Optional[int] = None
    """Informational (the engine does not batch); kept for DeepSpeed configs."""
    unit_modules: tuple[str, ...] = ()
    """Class names of modules that become units; empty = each nn.ModuleList child."""
    leaf_modules: tuple[str, ...] = ()
    """Class names (short, or module-qualified) of modules whose whole subtree is one unit,
    gathered together, beside the units `unit_modules` chooses: a mixture-of-experts block
    whose ranks route to different experts then needs no per-expert collective (DeepSpeed's
    leaf modules; a module marked by `set_z3_leaf_modules` counts too)."""
    compute_device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto = cuda when available, else cpu."""
    cpu_adam_threads: int = 0
    """Threads each rank's CPU optimizer runs on; 0 = the cores this process may use divided
    by LOCAL_WORLD_SIZE (the node's ranks; 1 when unset), at least 1 (offload/optim/threads.py)."""
    nonfinite_loss: Literal["skip", "raise", "off"] = "skip"
    """bf16/fp32: what a NaN/inf loss on any rank does. 'skip': that micro-batch runs no
    backward and its optimizer step is skipped (as fp16's loss scaler skips an overflow),
    logged and counted in `engine.skipped_steps`; 'raise': `engine.backward` raises before
    anything is applied; 'off': no check (NaN then reaches every weight). The check is one
    scalar per micro-batch (and a one-element all-reduce at world size > 1). fp16 leaves
    it to the loss scaler."""
    checkpoint_tag_validation: Literal["Warn", "Ignore", "Fail"] = "Warn"
    """What `save_checkpoint` does when the ranks pass different tags (DeepSpeed's
    checkpoint.tag_validation): 'Warn' (rank 0's tag is used, a warning names the others),
    'Ignore' (rank 0's, silently), 'Fail' (an error on every rank before anything is written)."""
    collective_timeout_s: float = 1800.0
    """Seconds a collective may wait for the other ranks before the process group gives up
    (torch.distributed's timeout), when the engine starts the group itself."""
    ignored_keys: tuple[str, ...] = field(default=(), compare=False)
    """Provenance, not a setting: DeepSpeed keys (dotted paths) that were accepted but are
    not honoured; filled by `translate_deepspeed`, empty otherwise."""
    notes: tuple[str, ...] = field(default=(), compare=False)
    """Provenance, not a setting: how the DeepSpeed translation resolved settings this engine
    handles differently (e.g. optimizer states kept on CPU instead of the GPU)."""

    def _check(self) -> None:
        require(self.gradient_clipping >= 0, "gradient_clipping", self.gradient_clipping,
                "the clipping threshold must be >= 0", "use 0 to disable clipping, e.g. 1.0 to clip")
        require(self.gradient_accumulation_steps >= 1, "gradient_accumulation_steps",
                self.gradient_accumulation_steps, "it must be >= 1 micro-batch per step",
                "use 1 for no accumulation")
        if self.train_micro_batch_size_per_gpu is not None:
            require(self.train_micro_batch_size_per_gpu >= 1, "train_micro_batch_size_per_gpu",
                    self.train_micro_batch_size_per_gpu, "a batch holds at least one sample",
                    "use a positive integer or leave it out")
        for key in ("unit_modules", "leaf_modules"):
            for i, name in enumerate(getattr(self, key)):
                require(bool(name.strip()), f"{key}[{i}]", name, "a class name cannot be empty",
                        "list module class names such as 'GPTBlock'")
        require(self.cpu_adam_threads >= 0, "cpu_adam_threads", self.cpu_adam_threads,
                "it must be >= 0 (0 = the cores this process may use, divided among the node's ranks)",
                "use 0 or a thread count")
        require(self.collective_timeout_s > 0, "collective_timeout_s", self.collective_timeout_s,
                "a timeout must be > 0 seconds", "use e.g. 1800 (torch.distributed's default)")
        at_most("cpu_adam_threads", self.cpu_adam_threads, MAX_THREADS, "a larger count is more than any machine's cores",
                "use 0 (the cores this process may use, divided among the node's ranks) or a thread count")
        at_most("collective_timeout_s", self.collective_timeout_s, MAX_TIMEOUT_S, "one year: torch.distributed "
                "keeps timeouts in milliseconds", "use e.g. 1800 (torch.distributed's default)")
        require(self.zero_stage in (1, 2, 3), "zero_stage", self.zero_stage,
                "offload runs ZeRO stages 1, 2 and 3", "use 3 (partitioned parameters) or 2")
        require(self.zero_stage == 3 or self.offload.param_tier != "nvme", "zero_stage",
                self.zero_stage, "stages 1 and 2 keep the parameters whole on the compute device, "
                "so an NVMe parameter tier would only add a write and a read of every shard per step",
                "use zero_stage 3 with offload.param_tier 'nvme', or param_tier 'device' / 'cpu'")
        require(self.zero_stage == 3 or not self.sharding.hybrid, "zero_stage", self.zero_stage,
                "hybrid sharding (sharding.shard_group_size / hpz_partition_size) runs at stage 3 only",
                "use zero_stage 3, or leave the sharding section out")


    # -- ways in ---------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Config":
        """offload's own format: field names, one nested mapping per section."""
        if isinstance(data, Mapping):
            ds_keys = [k for k in data if k in DS_ONLY_TOP_KEYS]
            if ds_keys:
                raise ConfigError(str(ds_keys[0]), "is a DeepSpeed key, not part of offload's format",
                                  "pass a DeepSpeed config to offload.load_config or "
                                  "Config.from_deepspeed, which translate it")
        return cls._from_mapping(data, "")

    @classmethod
    def _top_level_hint(cls, key: Any) -> str:
        # A misspelt DeepSpeed key is not recognised as DeepSpeed, so it lands here.
        return did_you_mean(key, DS_ONLY_TOP_KEYS, ", a DeepSpeed key")

    # [Note: Config's ways in]
    # Reading a file, telling the formats apart and translating a DeepSpeed config live above
    # this module (load.py, deepspeed.py), and the translation builds a Config: importing them
    # here would close an import circle. So the two constructors that need them are declared
    # here and set by offload/config/load.py when it is imported; offload/config/__init__.py
    # imports it, so every Config class anyone can reach has them.
    from_file: ClassVar[Callable[..., "Config"]]
    """`Config.from_file(path, *, world_size=None)`: a JSON or YAML file in either offload's
    format or DeepSpeed's (told apart as by `load_config`)."""
    from_deepspeed: ClassVar[Callable[..., "Config"]]
    """`Config.from_deepspeed(ds_config_or_path, *, world_size=None)`: a DeepSpeed config
    (dict or JSON/YAML path), translated by `offload.config.deepspeed.translate_deepspeed`."""
