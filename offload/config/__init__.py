"""The typed configuration, validated once at the door (docs/config.md).

`load_config` takes an `offload.Config`, a dict, a JSON/YAML file, ours or DeepSpeed's;
everything past it sees only the typed dataclasses of `offload.config.sections`.
"""

from offload.config.sections import (
    SCHEDULER_PARAMS,
    AIOConfig,
    Config,
    ConfigError,
    ConfigTypeError,
    DeepSpeedConfigWarning,
    OffloadConfig,
    OptimizerConfig,
    PrecisionConfig,
    PrefetchConfig,
    SchedulerConfig,
    TimelineConfig,
    load_config,
)

__all__ = [
    "Config", "OffloadConfig", "OptimizerConfig", "SchedulerConfig", "PrecisionConfig",
    "AIOConfig", "PrefetchConfig", "TimelineConfig", "ConfigError", "ConfigTypeError",
    "DeepSpeedConfigWarning", "load_config", "SCHEDULER_PARAMS",
]
