"""The observability sections of offload's configuration: the step timeline, the step
report, and the monitors (TensorBoard, Weights & Biases, CSV). Split from
offload/config/sections.py (which holds the rest and the `Config` tree) by concern; the
same `Section` machinery checks them once when they are built (docs/config.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Optional

from offload.config.checks import ConfigError, Section, require, rule_error

__all__ = ["TimelineConfig", "LoggingConfig", "MonitorsConfig", "TensorBoardConfig", "WandbConfig",
           "CSVMonitorConfig"]


@dataclass(frozen=True, kw_only=True)
class TimelineConfig(Section):
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
            raise rule_error(self._key("path"), self.path, "it must be a file name",
                             "give a path such as 'trace.json', or leave it out")


@dataclass(frozen=True, kw_only=True)
class LoggingConfig(Section):
    _SECTION: ClassVar[str] = "logging"

    steps_per_print: int = 10
    """Optimizer steps between step reports (an INFO record of the `offload` logger:
    offload/runtime/report.py); 0 = no report. 10 is DeepSpeed's default."""
    wall_clock_breakdown: bool = False
    """Add the step's time split (fetch waits, collectives, optimizer, optimizer I/O) to the
    report and the monitors (DeepSpeed's key of the same name)."""
    all_ranks: bool = False
    """Log on every rank (each line names its rank); False = rank 0 only."""
    print_unconfigured: bool = False
    """Show the step report on stderr even when the program configured no logging (no
    handler on the `offload` logger or the root): DeepSpeed's habit, whose logger prints by
    itself. A DeepSpeed config that sets `steps_per_print` turns it on; offload's own
    default stays quiet as a library should (`offload.enable_logging()` shows it)."""
    tokens_per_step: Optional[int] = None
    """Tokens one rank processes per optimizer step (micro batch x sequence length x
    gradient_accumulation_steps); the report's tokens/s is this x world size / step time.
    None = no tokens/s."""

    def _check(self) -> None:
        require(self.steps_per_print >= 0, self._key("steps_per_print"), self.steps_per_print,
                "it must be >= 0 optimizer steps (0 = no step report)", "use e.g. 10, or 0 for none")
        if self.tokens_per_step is not None:
            require(self.tokens_per_step >= 1, self._key("tokens_per_step"), self.tokens_per_step,
                    "a step processes at least one token",
                    "give micro batch x sequence length x gradient_accumulation_steps, or leave it out")


def _check_output_path(section: Section, path: Optional[str]) -> None:
    if path is not None and not path.strip():
        raise rule_error(section._key("output_path"), path, "it must name a directory",
                         "give a directory such as 'runs', or leave it out")


@dataclass(frozen=True, kw_only=True)
class TensorBoardConfig(Section):
    _SECTION: ClassVar[str] = "monitors.tensorboard"

    enabled: bool = False
    """Write the step report's scalars as TensorBoard events (needs the `tensorboard`
    package: `pip install offload[monitors]`)."""
    output_path: str = "runs"
    """Directory of the runs; events go to output_path/job_name."""
    job_name: str = "offload"
    """This run's sub-directory (DeepSpeed's job_name)."""

    def _check(self) -> None:
        _check_output_path(self, self.output_path)


@dataclass(frozen=True, kw_only=True)
class WandbConfig(Section):
    _SECTION: ClassVar[str] = "monitors.wandb"

    enabled: bool = False
    """Log the step report's scalars to Weights & Biases (needs the `wandb` package: `pip
    install offload[monitors]`); WANDB_MODE=offline keeps the run on disk."""
    project: str = "offload"
    """W&B project."""
    group: Optional[str] = None
    """W&B run group."""
    team: Optional[str] = None
    """W&B entity (DeepSpeed's name for it: team)."""
    job_name: Optional[str] = None
    """The run's name; None = W&B picks one."""
    output_path: Optional[str] = None
    """Directory W&B writes its files under (wandb.init's dir); None = W&B's default."""

    def _check(self) -> None:
        _check_output_path(self, self.output_path)


@dataclass(frozen=True, kw_only=True)
class CSVMonitorConfig(Section):
    _SECTION: ClassVar[str] = "monitors.csv"

    enabled: bool = False
    """Append the step report's scalars to output_path/job_name/metrics.csv (one row per
    written step, one column per scalar; the csv module, nothing to install)."""
    output_path: str = "runs"
    """Directory of the runs."""
    job_name: str = "offload"
    """This run's sub-directory."""

    def _check(self) -> None:
        _check_output_path(self, self.output_path)


@dataclass(frozen=True, kw_only=True)
class MonitorsConfig(Section):
    _SECTION: ClassVar[str] = "monitors"

    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    csv: CSVMonitorConfig = field(default_factory=CSVMonitorConfig)
    steps_per_write: int = 1
    """Optimizer steps between monitor writes (rank 0); 1 = every step, as DeepSpeed's
    monitors write."""

    def _check(self) -> None:
        require(self.steps_per_write >= 1, self._key("steps_per_write"), self.steps_per_write,
                "it must be >= 1 optimizer step", "use 1 to write every step")

    @property
    def any_enabled(self) -> bool:
        return self.tensorboard.enabled or self.wandb.enabled or self.csv.enabled
