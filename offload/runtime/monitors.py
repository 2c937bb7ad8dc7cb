"""Where the step report's scalars go besides the log: TensorBoard, W&B, a CSV file.

One `Monitor` per enabled block of `config.monitors` (offload's own, or DeepSpeed's
`tensorboard`, `wandb`, `csv_monitor` translated onto it). The `StepReporter`
(offload/runtime/report.py) owns them: it builds them on rank 0 at `initialize`, hands each
a step's scalars (`write(step, scalars)`, x-axis = the optimizer step) and closes them with
the engine. The libraries are optional (`pip install offload[monitors]`):
`check_monitors` runs on every rank before anything is built, so a missing one is an error
at `initialize` that names the extra, not a hang of the other ranks.

A monitor that fails while training (a full disk, say) must not fail the step whose update
is already applied: the reporter logs a warning once and drops it.
"""

from __future__ import annotations

import csv
import importlib.util
import logging
import os
from typing import Any, Mapping, Optional

__all__ = ["Monitor", "check_monitors", "open_monitors"]

_LIBRARIES = {"tensorboard": "tensorboard", "wandb": "wandb"}
"""Block of config.monitors -> the package it needs."""


def check_monitors(monitors: Any) -> None:
    """Raise ImportError naming the extra when an enabled monitor's library is missing."""
    for block, package in _LIBRARIES.items():
        if getattr(monitors, block).enabled and importlib.util.find_spec(package) is None:
            raise ImportError(
                f"monitors.{block}.enabled is true (DeepSpeed's '{block}' block), but the "
                f"'{package}' package is not installed; pip install 'offload[monitors]' (or "
                f"pip install {package}), or disable the {block} monitor")


class Monitor:
    """One destination of the scalars; subclasses write them. `scalars` always has the
    same keys for one run (a value is None when the step has none: no loss given)."""

    name = "monitor"
    where = ""
    """Where it writes (a directory or file), for the initialize line."""

    def write(self, step: int, scalars: Mapping[str, Optional[float]]) -> None:
        """The step's scalars; None for one this step has not (a skipped step's norm)."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class TensorBoardMonitor(Monitor):
    """Events under output_path/job_name, by torch.utils.tensorboard's SummaryWriter."""

    name = "tensorboard"

    def __init__(self, cfg: Any) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.where = os.path.join(cfg.output_path, cfg.job_name)
        self._writer = SummaryWriter(log_dir=self.where)

    def write(self, step: int, scalars: Mapping[str, Optional[float]]) -> None:
        for key, value in scalars.items():
            if value is not None:
                self._writer.add_scalar(key, value, step)
        self._writer.flush()  # a report step is rare enough; a crash then loses nothing

    def close(self) -> None:
        self._writer.close()


class WandbMonitor(Monitor):
    """A W&B run (WANDB_MODE=offline keeps it on disk; `wandb sync` uploads it later)."""

    name = "wandb"

    def __init__(self, cfg: Any) -> None:
        import wandb

        if cfg.output_path is not None:
            os.makedirs(cfg.output_path, exist_ok=True)
        self._run = wandb.init(project=cfg.project, group=cfg.group, entity=cfg.team,
                               name=cfg.job_name, dir=cfg.output_path)
        self.where = str(getattr(self._run, "dir", "") or cfg.project)

    def write(self, step: int, scalars: Mapping[str, Optional[float]]) -> None:
        self._run.log({k: v for k, v in scalars.items() if v is not None}, step=step)

    def close(self) -> None:
        self._run.finish()


class CSVMonitor(Monitor):
    """output_path/job_name/metrics.csv: a `step` column, then one column per scalar in the
    reporter's fixed order; a scalar a step does not have (None: no loss given) is an empty
    cell. One file
    (not DeepSpeed's file per metric) so that one `csv.DictReader` reads a run back."""

    name = "csv"

    def __init__(self, cfg: Any) -> None:
        directory = os.path.join(cfg.output_path, cfg.job_name)
        os.makedirs(directory, exist_ok=True)
        self.path = self.where = os.path.join(directory, "metrics.csv")
        self._columns: Optional[list[str]] = None
        if os.path.exists(self.path) and os.path.getsize(self.path) > 0:
            # A resumed run appends under the header already there (as DeepSpeed's does).
            with open(self.path, newline="", encoding="utf-8") as f:
                self._columns = next(csv.reader(f), None)
        self._file = open(self.path, "a", newline="", encoding="utf-8")

    def write(self, step: int, scalars: Mapping[str, Optional[float]]) -> None:
        if self._columns is None:
            self._columns = ["step", *scalars]
            csv.writer(self._file).writerow(self._columns)
        row = {"step": step, **scalars}
        csv.writer(self._file).writerow(["" if row.get(c) is None else row[c] for c in self._columns])
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def open_monitors(monitors: Any) -> list[Monitor]:
    """The enabled monitors, opened (rank 0 calls this; `check_monitors` ran first on every
    rank). One that cannot open (a directory it cannot write, W&B refusing) is left out
    with a warning, as a monitor failing mid-run is: raising here on rank 0 alone would
    leave the other ranks waiting in the first forward's collectives."""
    out: list[Monitor] = []
    for block, cls in (("tensorboard", TensorBoardMonitor), ("wandb", WandbMonitor),
                       ("csv", CSVMonitor)):
        if getattr(monitors, block).enabled:
            try:
                out.append(cls(getattr(monitors, block)))
            except Exception as exc:  # noqa: BLE001 - named in the warning; training goes on
                logging.getLogger("offload.monitors").warning(
                    "the %s monitor could not be opened (%s: %s); it writes nothing this run",
                    block, type(exc).__name__, exc)
    return out
