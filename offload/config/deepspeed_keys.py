"""DeepSpeed's top-level keys by kind, and the ledger one translation fills.

Every DeepSpeed key offload knows is one of four kinds (offload/config/deepspeed.py has the
full story): mapped (read into a `Config` field), ignored (accepted, reported by name with
the reason), semantic (accepted only at the value meaning "off") and removed (DeepSpeed 0.19
itself rejects it). The top-level tables are here because two readers need them: the
translation (deepspeed.py) and the format detection that decides a mapping is a DeepSpeed
config at all (`DS_ONLY_TOP_KEYS`, read by sections.py and load.py). Each section's own keys
sit beside the code that translates it (deepspeed.py, deepspeed_zero.py).

`Translation` records, for one translation, which of our keys got which value from which
DeepSpeed key, and which keys were ignored and why; `read_section` and `only_off` apply
the kinds "unknown is an error" and "semantic" to one key or section.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from offload.config.checks import ConfigError, did_you_mean, type_error, valid_keys_fix

__all__ = ["class_names", "TOP_MAPPED", "TOP_IGNORED", "TOP_UNSUPPORTED", "TOP_REMOVED", "DS_ONLY_TOP_KEYS",
           "Translation", "read_section", "only_off"]

TOP_MAPPED = frozenset({
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "optimizer", "scheduler", "fp16", "bf16", "bfloat16", "gradient_clipping",
    "zero_optimization", "aio", "data_types", "gradient_allreduce_op", "torch_autocast",
    "managed_gradient_accumulation", "sequence_parallel_size", "hybrid_engine",
    "data_efficiency", "tensor_parallel", "steps_per_print", "wall_clock_breakdown",
    "tensorboard", "wandb", "csv_monitor", "activation_checkpointing", "checkpoint",
})

TOP_IGNORED = {
    # steps_per_print, wall_clock_breakdown, tensorboard, wandb and csv_monitor are mapped
    # (offload's logging and monitors sections); these are not:
    "memory_breakdown": "DeepSpeed's allocator printout; offload's step report gives memory_bytes() "
                        "per tier instead",
    "dump_state": "DeepSpeed prints its own engine state; offload's initialize logs what it built",
    "comet": "offload has no Comet monitor; use tensorboard, wandb or csv_monitor",
    "flops_profiler": "offload has no FLOPs profiler; use torch.profiler around engine(batch)",
    "comms_logger": "offload does not log each collective; the step report's "
                    "wall_clock_breakdown gives their time per step",
    "timers": "DeepSpeed's own timers; offload's step report and timeline section time each step",
    "log_level": "offload logs through Python's logging: set the 'offload' logger's level",
    "autotuning": "a DeepSpeed launcher feature",
    "zero_allow_untested_optimizer": "offload runs its own CPU Adam only",
    "zero_force_ds_cpu_optimizer": "offload always uses its own CPU Adam",
    "disable_allgather": "communication detail",
    "prescale_gradients": "where the 1/world_size division happens; the mean is the same",
    "gradient_predivide_factor": "where the 1/world_size division happens; the mean is the same",
    "communication_data_type": "offload reduce-scatters gradients in its own dtype",
    "seq_parallel_communication_data_type": "offload has no sequence parallelism",
    "dataloader_drop_last": "only offload.compat.deepspeed.initialize builds a data loader (and honours it); offload.initialize builds none",
    "disable_python_gc": "runtime detail",
    "compile": "DeepSpeed's compile backend",
    "pipeline": "pipeline parallelism is not used by offload",
    "use_data_before_expert_parallelism": "offload has no expert parallelism",
    "vocabulary_size": "informational",
}

TOP_UNSUPPORTED = {
    "weight_quantization": "quantised weights change the trained model",
    "expert_parallel": "offload has no expert (MoE) parallelism",
}

TOP_REMOVED = frozenset({
    "nebula", "compression_training", "amp", "quantize_training", "sparse_gradients",
    "eigenvalue", "sparse_attention", "elasticity", "graph_harvesting", "curriculum_learning",
    "progressive_layer_drop",
})
"""deepspeed/runtime/config.py _REMOVED_TOP_LEVEL_CONFIG_KEYS (0.19)."""

_SHARED_TOP_KEYS = frozenset({"optimizer", "scheduler", "aio", "gradient_clipping",
                              "gradient_accumulation_steps", "train_micro_batch_size_per_gpu",
                              "activation_checkpointing"})

DS_ONLY_TOP_KEYS = (TOP_MAPPED | frozenset(TOP_IGNORED) | frozenset(TOP_UNSUPPORTED)
                    | TOP_REMOVED) - _SHARED_TOP_KEYS
"""Top-level keys that mark a mapping as a DeepSpeed config (offload's format has none)."""


@dataclass
class Translation:
    """What one translation has gathered: our sections' keyword arguments, the report."""

    ds: Mapping[str, Any]
    sections: dict[str, dict[str, Any]] = field(default_factory=lambda: {
        name: {} for name in ("offload", "optimizer", "precision", "aio", "prefetch", "logging",
                              "monitors", "activation_checkpointing", "sharding", "top")})
    ignored: dict[str, str] = field(default_factory=dict)
    """DeepSpeed key path -> why it is not honoured."""
    notes: list[str] = field(default_factory=list)
    origin: dict[str, str] = field(default_factory=dict)
    """Our key -> the DeepSpeed key it came from, so range errors name the user's key."""

    def set(self, ours: str, value: Any, ds_key: str) -> None:
        section, _, name = ours.rpartition(".")
        self.sections[section or "top"][name] = value
        self.origin[ours] = ds_key

    def ignore(self, ds_key: str, why: str) -> None:
        self.ignored[ds_key] = why


def read_section(path: str, value: Any, allowed: Iterable[str]) -> dict[str, Any]:
    """The mapping found at `path` ({} when absent), its keys checked against `allowed`."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise type_error(path, value, "a mapping (a JSON object)")
    allowed = list(allowed)
    for key in value:
        if key not in allowed:
            raise ConfigError(f"{path}.{key}", f"is not a DeepSpeed key that offload knows"
                              f"{did_you_mean(key, allowed)}", valid_keys_fix(f"under {path!r}", allowed))
    return dict(value)


def only_off(key: str, value: Any, off: Any, why: str, fix: str) -> None:
    """A semantic key: accepted at the value meaning "off" (or absent), an error otherwise."""
    if value is not None and value != off:
        raise ConfigError(key, f"= {value!r} is not supported: {why}", fix)


def class_names(key: str, value: Any) -> tuple[str, ...]:
    """A list of module class names at `key` (a lone string is one name)."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise type_error(key, value, "a list of module class names")
    return tuple(value)
