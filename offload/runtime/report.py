"""What a run tells its user: the line `initialize` logs, and a report every N steps.

offload logs through Python's `logging`, under the `offload` logger (module loggers below it:
`offload.runtime.report`, `offload.engine`, ...). It configures nothing: no handler, no
level, never the root logger. So, as for any library, WARNING and above reach stderr
through Python's last-resort handler while the application has configured no logging,
and INFO (the lines below) is shown once the application asks for it:
`logging.basicConfig(level=logging.INFO)`, or `offload.enable_logging()` (a handler on the
`offload` logger only, like transformers' `logging.set_verbosity_info()`).

`StepReporter` owns the reporting state of one engine:
- at `initialize`, one INFO line saying what was built (units, parameters, tiers, bytes per
  kind of memory, prefetch budgets, where the optimizer runs, world size, compute dtype and
  device);
- every `logging.steps_per_print` optimizer steps, one INFO line (the step report): step,
  loss, learning rate, gradient norm, loss scale, step time, tokens/s, stall share, memory
  per tier, with an NVMe tier the swap bytes written and read per step (measured), past
  world size 1 the bytes the step's collectives sent within and across nodes
  (offload/runtime/collective_traffic.py), and with `logging.wall_clock_breakdown` the stall's parts. With an NVMe tier `initialize` also logs
  the terabytes the node writes per 1,000 steps (offload/runtime/swap_traffic.py). Times are means over
  the steps since the previous report; the loss is the mean over the micro-batches of the
  reported step (this rank's: no collective is added);
- every `monitors.steps_per_write` steps, the same scalars to the enabled monitors
  (offload/runtime/monitors.py).
Rank 0 only, unless `logging.all_ranks` (logs; monitors stay on rank 0).

Cost: nothing is computed for a step nobody reads (no INFO listener, no monitor due). The
loss is read to the host (`float`, a device sync on a GPU) only for the micro-batches of a
step that will be reported; the engine's `nonfinite_loss` check (on by default) has already
synchronised at that point, so the read adds no wait there.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Optional

import torch

from offload.config.sections import Config
from offload.optim.sharded import ShardedOptimizer
from offload.runtime.accounting import memory_bytes
from offload.runtime.collective_traffic import CollectiveMeter, collective_text
from offload.runtime.monitors import Monitor, open_monitors
from offload.runtime.schedule import bounded_by_model
from offload.runtime.swap_traffic import SwapMeter, WearEstimate, swap_text, wear_estimate
from offload.runtime.timeline import StepStats
from offload.runtime.view import ShardedState
from offload.sizes import format_bytes, format_count
from offload.storage.swap import swap_held

__all__ = ["StepReporter", "enable_logging"]

logger = logging.getLogger(__name__)

_HANDLER_NAME = "offload.enable_logging"


def logger_configured() -> bool:
    """Whether the program configured logging that shows offload's records: a handler on
    the `offload` logger (or one above it below the root), or on the root."""
    log: Optional[logging.Logger] = logging.getLogger("offload")
    while log is not None:
        if log.handlers:
            return True
        log = log.parent if log.propagate else None
    return False


def enable_logging(level: int = logging.INFO, stream: Any = None) -> logging.Handler:
    """Show offload's records at `level` and above on `stream` (default stderr): one
    handler on the `offload` logger (added once; later calls change its level). Leaves
    the root logger alone; with the root also showing INFO (`logging.basicConfig`), each
    record is printed by both: use one or the other."""
    root = logging.getLogger("offload")
    handler = next((h for h in root.handlers if h.get_name() == _HANDLER_NAME), None)
    if handler is None:
        handler = logging.StreamHandler(stream)
        handler.set_name(_HANDLER_NAME)
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
        root.addHandler(handler)
    handler.setLevel(level)
    root.setLevel(level)
    return handler


class _Window:
    """Sums over the steps since a consumer last read them."""

    def __init__(self) -> None:
        self.steps = 0
        self.sums: dict[str, float] = {}

    def add(self, stats: Optional[StepStats]) -> None:
        self.steps += 1
        if stats is None:
            return
        for key in ("step_s", "stall_s", "fetch_wait_s", "collective_s", "optimizer_s",
                    "optimizer_io_s", "optimizer_in_backward_s"):
            self.sums[key] = self.sums.get(key, 0.0) + float(getattr(stats, key))
        self.sums["optimizer_in_backward_units"] = (self.sums.get("optimizer_in_backward_units", 0)
                                                    + stats.optimizer_in_backward_units)

    def take(self) -> dict[str, float]:
        """Means per step (stall_fraction: of the summed step time), then start over."""
        n = max(1, self.steps)
        out = {key: value / n for key, value in self.sums.items()}
        step_s = self.sums.get("step_s", 0.0)
        out["stall_fraction"] = self.sums.get("stall_s", 0.0) / step_s if step_s > 0 else 0.0
        self.steps, self.sums = 0, {}
        return out


class StepReporter:
    """The initialize line, the step report and the monitors of one engine.

    The engine calls `observe_loss(loss)` from `backward` and `after_step(stats)` at the end
    of every optimizer step (applied or skipped); everything else it reads from the
    `ShardedState` (counters, scaler, optimizer, memory). `last` is the latest report as a
    dict (None before the first), for progress bars and tests."""

    def __init__(self, state: ShardedState) -> None:
        self.state = state
        self.cfg = state.config.logging
        self.monitor_cfg = state.config.monitors
        world = state.pg.world  # HSDP: `state.rank` is the shard group's; rank 0 is the world's
        self.speaks = world.rank == 0 or self.cfg.all_ranks
        self.monitors: list[Monitor] = []
        if world.rank == 0 and self.monitor_cfg.any_enabled:
            self.monitors = open_monitors(self.monitor_cfg)
        if self.cfg.print_unconfigured and self.speaks and not logger_configured():
            enable_logging()  # a DeepSpeed config's steps_per_print: printed as DeepSpeed does
        self._losses: list[float] = []
        self._log_window, self._monitor_window = _Window(), _Window()
        self.last: Optional[dict[str, Any]] = None
        self.swap = SwapMeter(state.nvme, state.pg.local_world_size)
        """The step report's swap bytes per step (taken when a report is logged)."""
        self.collectives = CollectiveMeter(state.pg)
        """The step report's collective bytes per step, within and across nodes."""
        self.wear: Optional[WearEstimate] = None
        """`log_built`'s estimate of the swap bytes written per step (None: no NVMe tier)."""
        self.predicted_step_s: Optional[float] = None
        """The planner's predicted step (seconds), set by the engine when it has one
        (offload/plan/engine_prediction.py); the report shows it beside the measured step."""
        self.predicted_bound: Optional[str] = None
        """What the prediction says bounds the step ('CPU (compute and optimizer) 98% busy')."""

    # -- when -----------------------------------------------------------------------------

    def _at_log_interval(self, n: int) -> bool:
        every = self.cfg.steps_per_print
        return self.speaks and every > 0 and n % every == 0

    def _log_due(self, n: int) -> bool:
        return self._at_log_interval(n) and logger.isEnabledFor(logging.INFO)

    def _monitor_due(self, n: int) -> bool:
        return bool(self.monitors) and n % self.monitor_cfg.steps_per_write == 0

    def _steps_taken(self) -> int:
        c = self.state.counters
        return c.global_steps + c.skipped_steps

    # -- the engine's calls ------------------------------------------------------------------

    def observe_loss(self, loss: torch.Tensor) -> None:
        """A micro-batch's loss (before scaling): kept as a float only when the step it
        belongs to will be reported."""
        n = self._steps_taken() + 1  # the step this micro-batch accumulates into
        if self._log_due(n) or self._monitor_due(n):
            self._losses.append(float(loss.detach().float()))

    def after_step(self, stats: Optional[StepStats]) -> None:
        """The optimizer step just ended (`stats`: the engine's measure of it, or None):
        log and write what is due. Never raises for a monitor's failure: the step is done."""
        losses, self._losses = self._losses, []
        n = self._steps_taken()
        log_due, monitor_due = self._log_due(n), self._monitor_due(n)
        if self.speaks:
            self._log_window.add(stats)
        if self.monitors:
            self._monitor_window.add(stats)
        log_means = self._log_window.take() if self._at_log_interval(n) else None
        if not (log_due or monitor_due):
            return
        loss = sum(losses) / len(losses) if losses else None
        memory = memory_bytes(self.state)  # once, for the log and the monitors
        if log_due:
            self.last = {**self._record(n, loss, log_means or {}, memory), **(self.swap.per_step(n) or {}),
                         **(self.collectives.per_step(n) or {})}
            logger.info(self._line(self.last), extra={"step_report": self.last})
        if monitor_due:
            record = self._record(n, loss, self._monitor_window.take(), memory)
            self.last = self.last if log_due else record
            self._write_monitors(n, _scalars(record, self.cfg.wall_clock_breakdown))

    def log_built(self) -> None:
        """The INFO line of `initialize`: what was built; with an NVMe tier, a second one
        with the node's swap bytes written per 1,000 steps (`self.wear`)."""
        self.wear = wear_estimate(self.state)
        if not (self.speaks and logger.isEnabledFor(logging.INFO)):
            return
        s, c = self.state, self.state.config
        params = sum(u.layout.numel for u in s.units)
        moments = c.optimizer.moments_dtype
        logger.info(
            "initialized%s: %d units (%s), %s parameters, world size %d, compute %s on %s | "
            "parameters on %s, optimizer state (fp32 master, %s moments) on %s | memory %s | "
            "prefetch %s ahead, keep %s | optimizer %s | %s%s",
            _rank_tag(s), len(s.units), s.units_chosen, format_count(params), s.pg.world.world_size,
            str(s.dtype).replace("torch.", ""), s.device, c.offload.param_tier, moments,
            _state_tier_text(s), _memory_text(memory_bytes(s)),
            format_bytes(c.prefetch.prefetch_bytes), _keep_text(s),
            _optimizer_placement(c, s.dtype), _optimizer_threads(s.optimizer, c.cpu_adam_threads),
            "".join(f" | {m.name} monitor: {m.where}" for m in self.monitors))
        if self.wear is not None:
            logger.info("%s%s", self.wear.line(), _rank_tag(s), extra={"swap_wear": self.wear.as_dict()})
        if s.nvme is not None:
            engines, held = swap_held(s.nvme.directory.path)
            if engines > 1:  # [Note: one claim per process, one name per engine] in storage/swap_claim.py
                logger.info("swap files%s: %d engines of this process are alive in %s, holding %s together "
                            "(this one's: %s); each deletes its own at close()", _rank_tag(s), engines,
                            s.nvme.directory.path, format_bytes(held),
                            format_bytes(sum(f.total_bytes for f in s.nvme.directory.files.values())))

    def close(self) -> None:
        monitors, self.monitors = self.monitors, []
        for monitor in monitors:
            try:
                monitor.close()
            except Exception as exc:  # closing must go on: the engine's close follows
                logger.warning("monitor %s could not be closed (%s)", monitor.name, exc)

    # -- what ---------------------------------------------------------------------------------

    def _record(self, n: int, loss: Optional[float], means: dict[str, float],
                memory: dict[str, int]) -> dict[str, Any]:
        s = self.state
        lrs = [float(g["lr"]) for g in s.optimizer.param_groups]
        step_s = means.get("step_s")
        tokens = self.cfg.tokens_per_step
        record = {
            "step": n, "global_steps": s.counters.global_steps,
            "skipped_steps": s.counters.skipped_steps, "loss": loss,
            "lr": lrs[0] if lrs else None, "lrs": lrs, "grad_norm": s.counters.last_grad_norm,
            "loss_scale": float(s.scaler.scale), "step_time_s": step_s,
            "tokens_per_s": (tokens * s.pg.world.world_size / step_s) if tokens and step_s else None,
            "stall_fraction": means.get("stall_fraction", 0.0),
            "memory": memory,
            "predicted_step_s": self.predicted_step_s, "predicted_bound": self.predicted_bound,
        }
        for key in ("fetch_wait_s", "collective_s", "optimizer_s", "optimizer_io_s",
                    "optimizer_in_backward_s", "optimizer_in_backward_units"):
            record[key] = means.get(key, 0.0)
        return record

    def _line(self, r: dict[str, Any]) -> str:
        parts = [f"step {r['step']}{_rank_tag(self.state)}"]
        if r["skipped_steps"]:
            parts[0] += f" ({r['skipped_steps']} skipped so far)"
        if r["loss"] is not None:
            parts.append(f"loss {r['loss']:.5g}")
        lrs = r["lrs"]
        parts.append("lr " + (f"{lrs[0]:.3e}" if len(set(lrs)) <= 1
                              else "[" + ", ".join(f"{x:.3e}" for x in lrs) + "]"))
        if r["grad_norm"] is not None:
            parts.append(f"grad norm {r['grad_norm']:.4g}")
        parts.append(f"loss scale {r['loss_scale']:g}")
        if r["step_time_s"] is not None:
            parts.append(f"step {r['step_time_s']:.3f} s")
            if r.get("predicted_step_s") is not None:
                parts[-1] += (f" (predicted {r['predicted_step_s']:.3f} s, bound by "
                              f"{r['predicted_bound']})")
        if r["tokens_per_s"] is not None:
            parts.append(f"{r['tokens_per_s']:,.0f} tokens/s")
        parts.append(f"stall {100 * r['stall_fraction']:.1f}%")
        if self.cfg.wall_clock_breakdown:
            parts.append(
                f"fetch wait {r['fetch_wait_s']:.3f} s, collectives {r['collective_s']:.3f} s, "
                f"optimizer {r['optimizer_s']:.3f} s (I/O {r['optimizer_io_s']:.3f} s, "
                f"{r['optimizer_in_backward_s']:.3f} s in backward)")
        if "swap_written_bytes" in r:
            parts.append(swap_text(r))
        if "collective_across_nodes_bytes" in r:
            parts.append(collective_text(r))
        parts.append("memory " + _memory_text(r["memory"]))
        return " | ".join(parts)

    def _write_monitors(self, n: int, scalars: dict[str, Optional[float]]) -> None:
        for monitor in list(self.monitors):
            try:
                monitor.write(n, scalars)
            except Exception as exc:
                # The step's update is applied: a monitor that cannot write must not fail it
                # (nor every later step). Say so once and stop writing to it.
                logger.warning("monitor %s failed (%s: %s); it writes nothing more this run",
                               monitor.name, type(exc).__name__, exc)
                self.monitors.remove(monitor)


def _scalars(r: dict[str, Any], breakdown: bool) -> dict[str, Optional[float]]:
    """The monitors' scalars: the same keys every step of a run (None = none this step)."""
    grad_norm = r["grad_norm"]
    out = {
        "train/loss": r["loss"], "train/lr": r["lr"],
        # A skipped step's norm is inf: not a point a plot can draw.
        "train/grad_norm": grad_norm if grad_norm is not None and math.isfinite(grad_norm) else None,
        "train/loss_scale": r["loss_scale"], "train/step_time_s": r["step_time_s"],
        "train/tokens_per_s": r["tokens_per_s"], "train/stall_fraction": r["stall_fraction"],
    }
    for tier, value in r["memory"].items():
        out[f"memory/{tier}_bytes"] = value
    if breakdown:
        for key in ("fetch_wait_s", "collective_s", "optimizer_s", "optimizer_io_s",
                    "optimizer_in_backward_s"):
            out[f"time/{key}"] = r[key]
    return out


def _rank_tag(state: ShardedState) -> str:
    return f" [rank {state.pg.world.rank}]" if state.config.logging.all_ranks else ""


def _memory_text(memory: dict[str, int]) -> str:
    return ", ".join(f"{tier} {format_bytes(value)}" for tier, value in memory.items())


def _optimizer_threads(optimizer: ShardedOptimizer, configured: int) -> str:
    """What runs the updates, and on how many threads (`offload.optim.threads`)."""
    if optimizer.record.generic:
        return f"{optimizer.kind} through torch's class (torch's threads; cpu_adam_threads does not apply)"
    n = optimizer.threads
    how = " (cpu_adam_threads=0: this process's cores / LOCAL_WORLD_SIZE)" if configured == 0 else ""
    return f"{optimizer.kind} on {n} CPU thread{'s' if n != 1 else ''}{how}"


def _optimizer_placement(config: Config, dtype: torch.dtype) -> str:
    """Where updates run, by StepPolicy.start_backward's static conditions."""
    if not config.prefetch.optimizer_in_backward:
        return "step in engine.step() (prefetch.optimizer_in_backward is false)"
    if config.gradient_clipping > 0:
        return "step in engine.step() (gradient_clipping needs the global norm first)"
    if dtype == torch.float16:
        return "step in engine.step() (fp16's overflow check needs every gradient first)"
    return "updates during backward (prefetch.optimizer_in_backward)"


def _keep_text(s: ShardedState) -> str:
    """The keep budget as the engine uses it: bounded by the bytes the model has gathered in
    all (`schedule.bounded_by_model`), the configured value beside a budget it cut."""
    fulls = [0 if u.aliased else u.layout.padded_numel * s.dtype.itemsize for u in s.units]
    requested = s.config.prefetch.keep_bytes
    used = bounded_by_model(requested, fulls)
    return format_bytes(used) + (f" (bounded by the model's gathered bytes; configured {format_bytes(requested)})"
                                 if used < requested else "")


def _state_tier_text(s: ShardedState) -> str:
    """Where the optimizer state is: its tier, and the units on the compute device, updated
    there ([Note: the update split] in offload/storage/device_states.py)."""
    on = [st.unit.name or "<root>" for st in s.states if st.on_device]
    if not on:
        return s.config.offload.optimizer_tier
    if len(on) == len(s.states):
        return f"the compute device (all {len(on)} units, updated there)"
    rest = s.config.offload.optimizer_tier
    shown = ", ".join(on[:3]) + (f", ... {on[-1]}" if len(on) > 3 else "")
    return f"{rest}, and for {len(on)}/{len(s.states)} units ({shown}) on the compute device, updated there"
