"""The typed configuration, validated once at the door (docs/config.md).

`load_config` takes an `offload.Config`, a dict, a JSON/YAML file, ours or DeepSpeed's;
everything past it sees only the typed dataclasses of `offload.config.sections`.

Modules, bottom to top: `checks` (errors, value checks, the `Section` base) -> `deepspeed_keys`
(DeepSpeed's top-level keys by kind) -> `monitor_sections` (timeline, logging, monitors), `sharding` (HSDP, hpZ) ->
`sections` (the other dataclasses and the `Config` tree) -> `deepspeed_zero`,
`deepspeed` (the DeepSpeed translation) -> `load` (`load_config`, files, format detection).
"""

from offload.config.checks import ConfigError, ConfigTypeError, DeepSpeedConfigWarning
from offload.config.load import from_deepspeed, from_file, load_config, read_config_file
from offload.config.sections import (
    SCHEDULER_PARAMS,
    ActivationCheckpointingConfig,
    AIOConfig,
    Config,
    CSVMonitorConfig,
    LoggingConfig,
    MonitorsConfig,
    OffloadConfig,
    OptimizerConfig,
    PrecisionConfig,
    PrefetchConfig,
    SchedulerConfig,
    ShardingConfig,
    TensorBoardConfig,
    TimelineConfig,
    WandbConfig,
)

__all__ = [
    "Config", "OffloadConfig", "OptimizerConfig", "SchedulerConfig", "PrecisionConfig",
    "AIOConfig", "PrefetchConfig", "TimelineConfig", "LoggingConfig", "MonitorsConfig",
    "TensorBoardConfig", "WandbConfig", "CSVMonitorConfig", "ConfigError", "ConfigTypeError",
    "DeepSpeedConfigWarning", "load_config", "read_config_file", "from_file", "from_deepspeed", "SCHEDULER_PARAMS",
    "ActivationCheckpointingConfig", "ShardingConfig",
]
