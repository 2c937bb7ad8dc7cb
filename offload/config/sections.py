"""Typed engine configuration, validated once at the door.

Downstream code receives these frozen dataclasses, never dicts. Three ways in, one way out:

- `Config(...)` / `Config.from_dict(d)` / `Config.from_file(path)`: offload's own format, the
  dataclass field names nested by section (`{"offload": {"param_tier": "nvme", ...}}`).
- `Config.from_deepspeed(d_or_path)`: a DeepSpeed config, translated in one place
  (`offload.config.deepspeed.translate_deepspeed`): every key is either mapped, reported by
  name as accepted but not honoured (one `DeepSpeedConfigWarning`, and
  `Config.ignored_keys`), or an error that names it and says what to do.
- `load_config(obj)`: what `offload.initialize` calls; takes any of the above and tells the
  two formats apart.

Every value is checked in `__post_init__` (types, ranges, combinations), so a `Config` that
exists is valid; what depends on the machine (the NVMe path exists and takes O_DIRECT, the
pinned budget holds one unit) is checked by `initialize`. Errors are `ConfigError`
(a `ValueError`; `ConfigTypeError` is also a `TypeError`) whose message names the key, the
value, the rule and the fix. docs/config.md has the format and the DeepSpeed key table.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import os
import typing
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Literal, Mapping, Optional, Union

__all__ = [
    "Config",
    "OffloadConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "PrecisionConfig",
    "AIOConfig",
    "PrefetchConfig",
    "TimelineConfig",
    "ConfigError",
    "ConfigTypeError",
    "DeepSpeedConfigWarning",
    "load_config",
    "SCHEDULER_PARAMS",
]

ParamTier = Literal["device", "cpu", "nvme"]
OptimizerTier = Literal["cpu", "nvme"]
Precision = Literal["fp32", "bf16", "fp16"]

_KiB = 1 << 10
_MiB = 1 << 20
_IO_ALIGN_BYTES = 4 * _KiB
"""O_DIRECT needs block sizes that are multiples of the logical block size; 4 KiB covers
every NVMe drive we know of (and is what the native I/O layer aligns to)."""


# --------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------


class ConfigError(ValueError):
    """A configuration value or combination offload cannot run with.

    `key` is the dotted path of the offending key (`offload.nvme_path`,
    `zero_optimization.offload_param.device`); the message is
    "<key> <problem>; <fix>".
    """

    def __init__(self, key: str, problem: str, fix: str) -> None:
        self.key = key
        self.problem = problem
        self.fix = fix
        super().__init__(f"{key} {problem}; {fix}")

    def __reduce__(self):  # picklable across processes (torchrun workers, spawn)
        return type(self), (self.key, self.problem, self.fix)

    def retarget(self, key: str) -> "ConfigError":
        """The same error reported under another key (a DeepSpeed key mapped onto ours)."""
        return type(self)(key, self.problem, self.fix)


class ConfigTypeError(ConfigError, TypeError):
    """A configuration value of the wrong type (also a `TypeError`)."""


class DeepSpeedConfigWarning(UserWarning):
    """A DeepSpeed config had keys offload accepts but does not honour (listed by name)."""


def _fail(key: str, value: Any, rule: str, fix: str) -> ConfigError:
    return ConfigError(key, f"= {value!r}, but {rule}", fix)


def _fail_type(key: str, value: Any, expected: str, fix: Optional[str] = None) -> ConfigTypeError:
    return ConfigTypeError(key, f"= {value!r} ({type(value).__name__}), but it must be {expected}",
                           fix or f"set {key} to {expected}")


def _suggest(word: Any, choices: typing.Iterable[str], what: str = "") -> str:
    """" (did you mean 'x'?)" for the closest choice, or "" when nothing is close."""
    choices = list(choices)
    lowered = {c.lower(): c for c in choices}
    if isinstance(word, str) and word.lower() in lowered:
        return f" (did you mean {lowered[word.lower()]!r}{what}?)"
    close = difflib.get_close_matches(str(word), choices, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}{what}?)" if close else ""


def _valid_keys(where: str, names: list[str]) -> str:
    """The fix for an unknown key: the valid keys, or where to find them if they are many."""
    if len(names) > 15:
        return f"docs/config.md lists the {len(names)} valid keys {where}"
    return f"valid keys {where} are: {', '.join(names)}"


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


# --------------------------------------------------------------------------------------
# Field checking shared by every section
# --------------------------------------------------------------------------------------


def _dataclass_in(hint: Any) -> Optional[type]:
    """The dataclass a field annotation names (through Optional), if any."""
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return hint
    if typing.get_origin(hint) is Union:
        for arg in typing.get_args(hint):
            if dataclasses.is_dataclass(arg) and isinstance(arg, type):
                return arg
    return None


def _coerce(key: str, value: Any, hint: Any) -> Any:
    """`value` checked against the annotation `hint`, lightly normalised.

    Normalisations are the ones JSON and YAML force on us: a list for a tuple, an integral
    float (`5e8`) for an int, an int for a float, a path-like for a str. Anything else of
    the wrong type is a `ConfigTypeError` naming the key.
    """
    origin = typing.get_origin(hint)
    if isinstance(value, str) and value == "auto" and (hint in (bool, int, float) or origin is tuple):
        raise ConfigError(key, "= 'auto', which offload does not resolve",
                          "'auto' is filled in by the Hugging Face Trainer integration before "
                          "DeepSpeed reads the config; replace it with a concrete value")
    if hint is Any:
        return value
    if origin is Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None:
            return None
        assert len(args) == 1, f"unsupported annotation {hint!r}"
        return _coerce(key, value, args[0])
    if origin is Literal:
        allowed = typing.get_args(hint)
        if value not in allowed:
            choices = ", ".join(repr(a) for a in allowed)
            raise ConfigError(key, f"= {value!r}, which is not one of {choices}"
                              f"{_suggest(value, [str(a) for a in allowed])}",
                              f"set {key} to one of {choices}")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise _fail_type(key, value, "true or false")
        return value
    if hint is int:
        if isinstance(value, bool):
            raise _fail_type(key, value, "an integer")
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if not isinstance(value, int):
            raise _fail_type(key, value, "an integer")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _fail_type(key, value, "a number")
        value = float(value)
        if not math.isfinite(value):
            raise _fail(key, value, "it must be a finite number", f"set {key} to a finite number")
        return value
    if hint is str:
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        if not isinstance(value, str):
            raise _fail_type(key, value, "a string")
        return value
    if origin is tuple:
        args = typing.get_args(hint)
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise _fail_type(key, value, "a list")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(f"{key}[{i}]", v, args[0]) for i, v in enumerate(value))
        if len(value) != len(args):
            raise _fail(key, value, f"it must have exactly {len(args)} entries",
                        f"give {key} as a list of {len(args)} values")
        return tuple(_coerce(f"{key}[{i}]", v, a) for i, (v, a) in enumerate(zip(value, args)))
    if origin is dict:
        if not isinstance(value, Mapping):
            raise _fail_type(key, value, "a mapping (a JSON object)")
        return dict(value)
    sub = _dataclass_in(hint)
    if sub is not None:
        if isinstance(value, sub):
            return value
        if isinstance(value, Mapping):
            return sub._from_mapping(value, key)
        raise _fail_type(key, value, f"a mapping or an offload.{sub.__name__}")
    raise AssertionError(f"unsupported annotation {hint!r} for {key}")  # pragma: no cover


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


class _Section:
    """Shared behaviour of the config dataclasses (which are frozen and kw_only).

    `_SECTION` is the section's dotted place in offload's format, so errors name the full
    key. `__post_init__` type-checks every field against its annotation, then runs the
    section's own `_check` (ranges, combinations).
    """

    _SECTION: ClassVar[str] = ""
    _NOT_LOADED: ClassVar[frozenset[str]] = frozenset()
    """Fields that are provenance, not settings: not read by from_dict, not written by to_dict."""

    def __post_init__(self) -> None:
        hints = _hints(type(self))
        for f in fields(self):  # type: ignore[arg-type]
            value = _coerce(self._key(f.name), getattr(self, f.name), hints[f.name])
            object.__setattr__(self, f.name, value)
        self._check()

    def _check(self) -> None:
        """Ranges and combinations; raise ConfigError naming the key."""

    @classmethod
    def _key(cls, name: str) -> str:
        return _join(cls._SECTION, name)

    @classmethod
    def _from_mapping(cls, data: Any, prefix: str):
        if not isinstance(data, Mapping):
            raise _fail_type(prefix or "config", data, "a mapping (a JSON object / YAML mapping)")
        names = [f.name for f in fields(cls) if f.init and f.name not in cls._NOT_LOADED]  # type: ignore[arg-type]
        for key in data:
            if key not in names:
                raise cls._unknown_key(prefix, key, names)
        return cls(**dict(data))

    @classmethod
    def _unknown_key(cls, prefix: str, key: Any, names: list[str]) -> ConfigError:
        where = f"under {prefix!r}" if prefix else "at the top level"
        hint = _suggest(key, names)
        if not prefix and not hint:
            from offload.config.deepspeed import DS_ONLY_TOP_KEYS

            # A misspelt DeepSpeed key is not recognised as DeepSpeed, so it lands here.
            hint = _suggest(key, DS_ONLY_TOP_KEYS, ", a DeepSpeed key")
        return ConfigError(_join(prefix, str(key)), f"is not a known key {where}{hint}",
                           _valid_keys(where, names))

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON/YAML-ready values (tuples as lists), nested by section."""
        out: dict[str, Any] = {}
        for f in fields(self):  # type: ignore[arg-type]
            if f.name in self._NOT_LOADED:
                continue
            out[f.name] = _plain(getattr(self, f.name))
        return out


def _plain(value: Any) -> Any:
    if isinstance(value, _Section):
        return value.to_dict()
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _require(ok: bool, key: str, value: Any, rule: str, fix: str) -> None:
    if not ok:
        raise _fail(key, value, rule, fix)


# --------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig(_Section):
    _SECTION: ClassVar[str] = "optimizer"

    type: Literal["AdamW", "Adam"] = "AdamW"
    """AdamW: decoupled weight decay; Adam: L2 added to the gradient."""
    lr: float = 1e-3
    """Learning rate (before any schedule), per optimizer step."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Decay rates of the first and second moment, each in [0, 1)."""
    eps: float = 1e-8
    """Added to the denominator's square root (torch's placement), >= 0."""
    weight_decay: float = 0.01
    """Per-step decay coefficient (decoupled for AdamW, L2 for Adam), >= 0."""
    moments_dtype: Literal["fp32", "bf16"] = "fp32"
    """Adam moments' storage dtype; bf16 halves their memory and I/O (opt-in)."""

    def _check(self) -> None:
        _require(self.lr >= 0, self._key("lr"), self.lr, "the learning rate must be >= 0",
                 "set a non-negative learning rate (1e-3 is DeepSpeed's and torch's default)")
        for i, beta in enumerate(self.betas):
            _require(0.0 <= beta < 1.0, self._key(f"betas[{i}]"), beta, "each beta must be in [0, 1)",
                     "use values like [0.9, 0.999]")
        _require(self.eps >= 0, self._key("eps"), self.eps, "eps must be >= 0",
                 "use a small positive value such as 1e-8")
        _require(self.weight_decay >= 0, self._key("weight_decay"), self.weight_decay,
                 "weight decay must be >= 0", "use 0 to disable weight decay")


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
class SchedulerConfig(_Section):
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
                raise ConfigError(_join(prefix, str(name)),
                                  f"is not a parameter of {self.type}{_suggest(name, spec)}",
                                  f"{self.type} takes: {', '.join(spec)}")
        for name, default in spec.items():
            if default is ... and name not in self.params:
                raise ConfigError(_join(prefix, name), f"is missing; {self.type} requires it",
                                  f"set {_join(prefix, name)} to the total number of optimizer "
                                  f"steps of the run")
        params = dict(self.params)
        for name, value in self.params.items():
            key = _join(prefix, name)
            if name in ("warmup_num_steps", "total_num_steps"):
                value = _coerce(key, value, int)
                _require(value > 0, key, value, "it must be a positive number of optimizer steps",
                         f"set {key} to an integer >= 1")
            elif name == "last_batch_iteration":
                value = _coerce(key, value, int)
                _require(value >= -1, key, value, "it must be >= -1 (-1 = a fresh run)",
                         f"leave {key} out unless resuming")
            elif name == "warmup_type":
                value = _coerce(key, value, Literal["log", "linear"])
            elif name in ("warmup_min_lr", "warmup_max_lr"):
                if value is None and name == "warmup_max_lr" and self.type == "WarmupLR":
                    pass  # None: each param group's own learning rate
                elif isinstance(value, (list, tuple)):
                    value = [_coerce(f"{key}[{i}]", v, float) for i, v in enumerate(value)]
                    for i, v in enumerate(value):
                        _require(v >= 0, f"{key}[{i}]", v, "learning rates must be >= 0",
                                 "use non-negative learning rates")
                else:
                    value = _coerce(key, value, float)
                    _require(value >= 0, key, value, "learning rates must be >= 0",
                             "use a non-negative learning rate")
            elif name in ("warmup_min_ratio", "cos_min_ratio"):
                value = _coerce(key, value, float)
                _require(0.0 <= value <= 1.0, key, value,
                         "it is a fraction of the optimizer's learning rate and must be in [0, 1]",
                         f"set {key} between 0 and 1")
            params[name] = value
        object.__setattr__(self, "params", params)


@dataclass(frozen=True, kw_only=True)
class PrecisionConfig(_Section):
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

    def _check(self) -> None:
        _require(self.loss_scale >= 0, self._key("loss_scale"), self.loss_scale,
                 "it must be >= 0 (0 selects dynamic loss scaling)",
                 "use 0 for dynamic scaling or a positive static scale such as 1024")
        # 2**127 is the largest power of two an fp32 scale factor can hold.
        _require(0 <= self.initial_scale_power <= 127, self._key("initial_scale_power"),
                 self.initial_scale_power, "2**initial_scale_power must be a finite fp32 number",
                 "use a value in [0, 127]; 16 (DeepSpeed's default) suits most models")
        _require(self.loss_scale_window >= 1, self._key("loss_scale_window"), self.loss_scale_window,
                 "it must be >= 1 step", "use e.g. 1000 (DeepSpeed's default)")
        _require(self.hysteresis >= 1, self._key("hysteresis"), self.hysteresis,
                 "it must be >= 1", "use e.g. 2 (DeepSpeed's default)")
        _require(self.min_loss_scale > 0, self._key("min_loss_scale"), self.min_loss_scale,
                 "the dynamic scale's floor must be > 0", "use e.g. 1 (DeepSpeed's default)")


@dataclass(frozen=True, kw_only=True)
class OffloadConfig(_Section):
    _SECTION: ClassVar[str] = "offload"

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
    placement: Literal["manual", "auto"] = "manual"
    """manual = use param_tier and optimizer_tier as given; auto = `initialize` runs the
    memory planner (offload.plan.planner) on this machine and picks the fastest placement that fits
    (an nvme one only when nvme_path is set), logging its choice."""

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
        _require(self.pinned_budget_bytes > 0, self._key("pinned_budget_bytes"),
                 self.pinned_budget_bytes, "the budget must be a positive number of bytes",
                 "use at least a few unit shards' worth, e.g. 1073741824 (1 GiB)")


@dataclass(frozen=True, kw_only=True)
class AIOConfig(_Section):
    _SECTION: ClassVar[str] = "aio"

    block_size: int = 1 << 20
    """Bytes per I/O request submitted to the kernel."""
    queue_depth: int = 32
    """Requests in flight per worker thread."""
    threads: int = 2
    """I/O worker threads."""

    def _check(self) -> None:
        _require(self.block_size > 0 and self.block_size % _IO_ALIGN_BYTES == 0,
                 self._key("block_size"), self.block_size,
                 f"O_DIRECT requests must be a positive multiple of {_IO_ALIGN_BYTES} bytes",
                 "use a power of two such as 1048576 (1 MiB)")
        _require(self.queue_depth >= 1, self._key("queue_depth"), self.queue_depth,
                 "at least one request must be in flight", "use e.g. 32")
        _require(self.threads >= 1, self._key("threads"), self.threads,
                 "at least one I/O worker thread is needed", "use e.g. 2")


@dataclass(frozen=True, kw_only=True)
class PrefetchConfig(_Section):
    _SECTION: ClassVar[str] = "prefetch"

    prefetch_bytes: int = 256 * _MiB
    """Gathered-parameter bytes fetched ahead of the unit now computing (in the traced
    order, through every stage NVMe -> pinned -> device -> all-gather); 0 = fetch on demand."""
    keep_bytes: int = 256 * _MiB
    """Gathered-parameter bytes kept on the compute device after use because the trace
    says they are needed again soon (end of forward = start of backward); 0 = always release."""
    optimizer_in_backward: bool = True
    """Update each unit as soon as its gradient shard is final, while backward goes on
    (state read ahead, CPU Adam, write-back). Only where it is exact: no gradient
    clipping (which needs the global norm) and no fp16 (whose overflow check needs every
    gradient); otherwise the update runs in `engine.step()`. The learning rate and other
    hyperparameters are then read at backward: change them before `engine.backward`."""

    def _check(self) -> None:
        for name in ("prefetch_bytes", "keep_bytes"):
            value = getattr(self, name)
            _require(value >= 0, self._key(name), value, "a byte budget must be >= 0",
                     "use 0 to switch this off")


@dataclass(frozen=True, kw_only=True)
class TimelineConfig(_Section):
    _SECTION: ClassVar[str] = "timeline"

    enabled: bool = False
    """Record when each unit's read, copy, gather, compute, reduce, optimizer and write-back
    began and ended, and the stall time, per step (off: nothing is recorded or timed)."""
    path: Optional[str] = None
    """File to write the recorded steps to as Chrome/Perfetto trace JSON; None = keep them
    in memory only (the engine exposes them)."""

    def _check(self) -> None:
        if self.path is not None and not self.enabled:
            raise ConfigError(self._key("path"), f"= {self.path!r} is set but timeline.enabled is false",
                              "set timeline.enabled to true to record the trace, or remove timeline.path")
        if self.path is not None and not self.path:
            raise _fail(self._key("path"), self.path, "it must be a file name",
                        "give a path such as 'trace.json', or leave it out")


@dataclass(frozen=True, kw_only=True)
class Config(_Section):
    _SECTION: ClassVar[str] = ""
    _NOT_LOADED: ClassVar[frozenset[str]] = frozenset({"ignored_keys", "notes"})

    offload: OffloadConfig = field(default_factory=OffloadConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: Optional[SchedulerConfig] = None
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    aio: AIOConfig = field(default_factory=AIOConfig)
    prefetch: PrefetchConfig = field(default_factory=PrefetchConfig)
    timeline: TimelineConfig = field(default_factory=TimelineConfig)
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
    nonfinite_loss: Literal["skip", "raise", "off"] = "skip"
    """bf16/fp32: what a NaN/inf loss on any rank does. 'skip': that micro-batch runs no
    backward and its optimizer step is skipped (as fp16's loss scaler skips an overflow),
    logged and counted in `engine.skipped_steps`; 'raise': `engine.backward` raises before
    anything is applied; 'off': no check (NaN then reaches every weight). The check is one
    scalar per micro-batch (and a one-element all-reduce at world size > 1). fp16 leaves
    it to the loss scaler."""
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
        _require(self.gradient_clipping >= 0, "gradient_clipping", self.gradient_clipping,
                 "the clipping threshold must be >= 0", "use 0 to disable clipping, e.g. 1.0 to clip")
        _require(self.gradient_accumulation_steps >= 1, "gradient_accumulation_steps",
                 self.gradient_accumulation_steps, "it must be >= 1 micro-batch per step",
                 "use 1 for no accumulation")
        if self.train_micro_batch_size_per_gpu is not None:
            _require(self.train_micro_batch_size_per_gpu >= 1, "train_micro_batch_size_per_gpu",
                     self.train_micro_batch_size_per_gpu, "a batch holds at least one sample",
                     "use a positive integer or leave it out")
        for i, name in enumerate(self.unit_modules):
            _require(bool(name.strip()), f"unit_modules[{i}]", name, "a class name cannot be empty",
                     "list module class names such as 'GPTBlock'")
        _require(self.cpu_adam_threads >= 0, "cpu_adam_threads", self.cpu_adam_threads,
                 "it must be >= 0 (0 = the cores this process may use)", "use 0 or a thread count")
        _require(self.collective_timeout_s > 0, "collective_timeout_s", self.collective_timeout_s,
                 "a timeout must be > 0 seconds", "use e.g. 1800 (torch.distributed's default)")

    # -- ways in ---------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Config":
        """offload's own format: field names, one nested mapping per section."""
        if isinstance(data, Mapping):
            from offload.config.deepspeed import DS_ONLY_TOP_KEYS

            ds_keys = [k for k in data if k in DS_ONLY_TOP_KEYS]
            if ds_keys:
                raise ConfigError(str(ds_keys[0]), "is a DeepSpeed key, not part of offload's format",
                                  "pass a DeepSpeed config to offload.load_config or "
                                  "Config.from_deepspeed, which translate it")
        return cls._from_mapping(data, "")

    @classmethod
    def from_file(cls, path: Union[str, os.PathLike], *, world_size: Optional[int] = None) -> "Config":
        """A JSON or YAML file in either offload's format or DeepSpeed's (told apart as by
        `load_config`)."""
        return _from_any_mapping(_read_file(path), world_size=world_size)

    @classmethod
    def from_deepspeed(cls, ds_config: Union[Mapping[str, Any], str, os.PathLike], *,
                       world_size: Optional[int] = None) -> "Config":
        """A DeepSpeed config (dict or JSON/YAML path), translated by
        `offload.config.deepspeed.translate_deepspeed`."""
        from offload.config.deepspeed import translate_deepspeed

        if isinstance(ds_config, (str, os.PathLike)):
            ds_config = _read_file(ds_config)
        return translate_deepspeed(ds_config, world_size=world_size)


def load_config(obj: Union[Config, Mapping[str, Any], str, os.PathLike, None] = None, *,
                world_size: Optional[int] = None) -> Config:
    """THE entry point: anything a user may pass as `config` -> a validated `Config`.

    None -> defaults; a `Config` -> itself; a mapping -> offload's format or a DeepSpeed
    config (see `_is_deepspeed`); a str / path -> a JSON or YAML file, then as a mapping.
    `world_size` is only used to check DeepSpeed's batch sizes; by default it is taken from
    an initialised torch.distributed, else $WORLD_SIZE (set by torchrun), else 1.
    """
    if obj is None:
        return Config()
    if isinstance(obj, Config):
        return obj
    if isinstance(obj, (str, os.PathLike)):
        return _from_any_mapping(_read_file(obj), world_size=world_size)
    if isinstance(obj, Mapping):
        return _from_any_mapping(obj, world_size=world_size)
    raise ConfigTypeError("config", f"= {type(obj).__name__} object, which offload cannot read",
                          "pass an offload.Config, a dict (offload's format or a DeepSpeed "
                          "config), or the path of a JSON or YAML file")


# --------------------------------------------------------------------------------------
# Files and format detection
# --------------------------------------------------------------------------------------


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # Like DeepSpeed's dict_raise_error_on_duplicate_keys: a key given twice is a mistake,
    # and the json module would otherwise keep the last one silently.
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ConfigError(str(key), "appears twice in the same object",
                              "keep one of the two entries")
        out[key] = value
    return out


def _yaml_load(text: str) -> Any:
    import yaml

    class _StrictLoader(yaml.SafeLoader):
        pass

    def _mapping(loader: Any, node: Any) -> dict[Any, Any]:
        loader.flatten_mapping(node)
        return _reject_duplicates([(loader.construct_object(k, deep=True),
                                    loader.construct_object(v, deep=True)) for k, v in node.value])

    _StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)
    return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass


def _read_file(path: Union[str, os.PathLike]) -> Mapping[str, Any]:
    """Parse a JSON (.json) or YAML (.yaml/.yml) file; other extensions try JSON, then YAML."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(2, f"config file {path!r} does not exist; pass the path of a "
                                   f"JSON or YAML file, a dict, or an offload.Config", path)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    ext = os.path.splitext(path)[1].lower()
    data: Any
    if ext == ".json":
        try:
            data = json.loads(text, object_pairs_hook=_reject_duplicates)
        except json.JSONDecodeError as e:
            raise ConfigError(path, f"is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}",
                              "fix the syntax (JSON allows no comments or trailing commas)") from None
    else:
        import yaml  # a dependency in pyproject; imported only when a YAML file is read

        try:
            if ext in (".yaml", ".yml"):
                data = _yaml_load(text)
            else:
                try:
                    data = json.loads(text, object_pairs_hook=_reject_duplicates)
                except json.JSONDecodeError:
                    data = _yaml_load(text)  # YAML also reads most JSON-with-comments
        except yaml.YAMLError as e:
            raise ConfigError(path, f"is not valid YAML{'' if ext in ('.yaml', '.yml') else ' (nor JSON)'}: "
                              f"{e}", "fix the syntax (a .json / .yaml extension gives a more "
                              "precise error)") from None
    if not isinstance(data, Mapping):
        raise ConfigTypeError(path, f"holds a {type(data).__name__} at its top level, not a mapping",
                              "a config file must be one JSON object / YAML mapping")
    return data


_OFFLOAD_ONLY_TOP_KEYS = frozenset({"offload", "precision", "prefetch", "timeline", "unit_modules",
                                    "compute_device", "cpu_adam_threads", "nonfinite_loss",
                                    "collective_timeout_s"})
"""Top-level keys of offload's format that DeepSpeed does not have."""


def _is_deepspeed(data: Mapping[str, Any]) -> bool:
    """Whether a mapping is a DeepSpeed config rather than offload's format.

    DeepSpeed when it has a key only DeepSpeed uses (zero_optimization, fp16, bf16,
    train_batch_size, ...) or its optimizer section has DeepSpeed's "params";
    offload's when it has a key only offload uses (offload, precision, ...); both at once
    is an error. A mapping with only shared keys (gradient_clipping, optimizer without
    params, ...) is taken as offload's. Every config DeepSpeed can run with ZeRO-3 has
    zero_optimization, so a real DeepSpeed config is never misread.
    """
    from offload.config.deepspeed import DS_ONLY_TOP_KEYS

    ds_keys = [k for k in data if k in DS_ONLY_TOP_KEYS]
    # Both formats write scheduler as {type, params}; only DeepSpeed nests optimizer params.
    if isinstance(data.get("optimizer"), Mapping) and "params" in data["optimizer"]:
        ds_keys.append("optimizer.params")
    ours = [k for k in data if k in _OFFLOAD_ONLY_TOP_KEYS]
    if ds_keys and ours:
        raise ConfigError(str(ours[0]), f"is offload's key but the same config also has DeepSpeed's "
                          f"{ds_keys[0]!r}",
                          "use one format: offload's (docs/config.md) or a DeepSpeed config, not both")
    return bool(ds_keys)


def _from_any_mapping(data: Mapping[str, Any], *, world_size: Optional[int]) -> Config:
    if _is_deepspeed(data):
        from offload.config.deepspeed import translate_deepspeed

        return translate_deepspeed(data, world_size=world_size)
    return Config.from_dict(data)
