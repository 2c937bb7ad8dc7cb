"""The step-time model: a placement's optimizer step, unit by unit, scheduled over the
resources the engine overlaps, with rates from a machine profile (offload/plan/profile.py).

    predict_step(shape, profile, StepSettings(param_tier="cpu", optimizer_tier="nvme", ...))

[Note: the step as the engine issues it]
Per unit, in the engine's order (offload/runtime/schedule.py, prefetch.py, optimizer_step.py):
- forward, units in order: the parameter shard's fetch (an NVMe read when parameters are on
  NVMe; a host-to-GPU copy when they are in host memory or read from NVMe on a GPU run),
  issued ahead within `prefetch_bytes` (always the next unit), then the unit's forward;
- backward, units in reverse: the fetch again unless the unit was kept gathered from forward
  (the last units of forward within `keep_bytes`), the unit's backward (the forward again
  first with recompute), its gradients into the fp32 gradient shard (a copy on the CPU, a
  device-to-host copy on a GPU), and with updates in backward the unit's update;
- the updates (in backward, or all at `step()` when the non-finite guard, clipping or fp16
  needs the whole gradient first: offload/runtime/update_mode.py): the optimizer state's
  read when it is on NVMe (issued ahead within the pinned budget), the CPU update, the
  state's write, the new parameter shard's write (NVMe) or copy to the GPU.
Resources: on a GPU run the compute stream, the host-to-device and device-to-host copy
engines, the NVMe queue and the CPU optimizer threads (`worker`: the optimizer worker; else
autograd's thread, which then holds up the next unit's backward); on a CPU run compute,
copies and the optimizer share one resource, the CPU's cores, and only NVMe runs beside.

[Note: the times of one unit]
forward = fwd FLOPs / matmul rate(dtype, d_model) + fwd traffic x dtype bytes / host
bandwidth + launches x the profile's launch latency x COLD_LAUNCH_FRACTION (a CPU run) +
UNIT_OVERHEAD_S (the engine's hooks and Python per unit); backward = 2 x the FLOPs and
traffic with the backward's launches (+ forward with recompute); gradient copy = params x (dtype + 4) B / host bandwidth (CPU) or
params x 4 B / D2H (GPU); update = trainable elements / optimizer rate(moments, threads);
NVMe read or write = bytes / its measured GB/s (reads and writes share the one queue).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from offload.plan.event_schedule import EventSchedule, Schedule
from offload.plan.profile import MachineProfile
from offload.plan.shapes import ModelShape

__all__ = ["StepSettings", "StepPrediction", "predict_step", "UpdateTimes", "update_times",
           "UNIT_OVERHEAD_S", "STATE_BYTES", "COLD_LAUNCH_FRACTION"]

UNIT_OVERHEAD_S = 0.5e-3
"""Per unit and pass, the engine's own time beside the kernels (hooks, gathers' bookkeeping,
Python), measured on this project's CPU machine: [Note: calibration] in docs/plan.md."""

COLD_LAUNCH_FRACTION = 0.7
"""Of a step's kernel launches, the share that costs the profile's `parallel_op` (measured
after a pause, the threads idle); the rest follow the previous kernel closely enough that its
threads are still spinning. Fitted on this project's CPU machine (docs/plan.md, "Calibration"):
the median predicted/measured step of bench_train's engine contenders at two sizes over two
interleaved rounds was 1.21-1.35 at 1.0, 0.96-1.02 at 0.7 (0.86 for one contender); a third
round, not used for the fit, checks it."""

STATE_BYTES = {"fp32": 8.0, "bf16": 4.0, "8bit": 2.0 + 8 / 256}
"""Optimizer state bytes per element beside the 4 B master (Adam's two moments)."""

_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True, kw_only=True)
class StepSettings:
    param_tier: str
    optimizer_tier: str
    dtype: str = "bf16"
    moments: str = "fp32"
    on_gpu: bool = False
    world_size: int = 1
    prefetch_bytes: int = 256 << 20
    keep_bytes: int = 256 << 20
    pinned_budget_bytes: int = 1 << 30
    updates_in_backward: bool = False
    """Where the updates run: the engine's default guard (nonfinite_loss 'skip') runs them
    at step(); 'off', no clipping, no fp16 lets them run during backward."""
    worker: bool = False
    """The optimizer worker thread (GPU runs: prefetch.optimizer_worker 'auto' is on there)."""
    optimizer_threads: Optional[int] = None

    @staticmethod
    def from_config(config: Any, param_tier: str, optimizer_tier: str, *, on_gpu: bool,
                    world_size: int = 1) -> "StepSettings":
        """The settings an `offload.Config` gives (its tiers replaced by the placement's)."""
        pf = config.prefetch
        in_backward = (bool(pf.optimizer_in_backward) and config.nonfinite_loss == "off"
                       and float(config.gradient_clipping) <= 0 and config.precision.dtype != "fp16")
        worker = pf.optimizer_worker == "on" or (pf.optimizer_worker == "auto" and on_gpu)
        return StepSettings(param_tier=param_tier, optimizer_tier=optimizer_tier,
                            dtype=config.precision.dtype, moments=config.optimizer.moments_dtype,
                            on_gpu=on_gpu, world_size=world_size, prefetch_bytes=pf.prefetch_bytes,
                            keep_bytes=pf.keep_bytes, pinned_budget_bytes=config.offload.pinned_budget_bytes,
                            updates_in_backward=in_backward, worker=worker,
                            optimizer_threads=config.cpu_adam_threads or None)


@dataclass(frozen=True)
class StepPrediction:
    placement: str
    step_s: float
    tokens: int
    binding: str
    """The resource busy the longest ('cpu', 'gpu', 'nvme', 'h2d', 'd2h', 'optimizer')."""
    busy_s: dict[str, float]
    forward_s: float
    """When the last forward ends."""
    backward_s: float
    """When the last backward ends (from the step's start)."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_s if self.step_s > 0 else 0.0

    def bound_text(self) -> str:
        share = self.busy_s.get(self.binding, 0.0) / self.step_s if self.step_s > 0 else 0.0
        word = {"cpu": "CPU (compute and optimizer)", "gpu": "GPU compute", "nvme": "NVMe",
                "h2d": "host-to-GPU copies", "d2h": "GPU-to-host copies", "optimizer": "CPU optimizer"}
        return f"{word.get(self.binding, self.binding)} {100 * share:.0f}% busy"

    def to_dict(self) -> dict[str, Any]:
        return {"placement": self.placement, "step_s": self.step_s, "tokens_per_s": self.tokens_per_s,
                "binding": self.binding, "busy_s": dict(self.busy_s), "forward_s": self.forward_s,
                "backward_s": self.backward_s}


@dataclass(frozen=True)
class UpdateTimes:
    """What `update_times` predicts for one unit's optimizer update."""

    cpu_s: float
    """The CPU's part: its elements at the CPU optimizer's rate."""
    device_s: float
    """The device's part at its rate (0 when none)."""
    copy_s: float
    """Gradients down and parameters up for the CPU's part over the host link (0 on a CPU run)."""

    @property
    def exposed_s(self) -> float:
        """The two parts run side by side: the longer, with the CPU part's copies."""
        return max(self.cpu_s + self.copy_s, self.device_s)


def update_times(elements: int, *, cpu_elements_per_s: float, device_fraction: float = 0.0,
                 device_elements_per_s: Optional[float] = None, link_bytes_per_s: Optional[float] = None,
                 grad_bytes: int = 4, param_bytes: int = 2) -> UpdateTimes:
    """One unit's update split between the device (`device_fraction` of its elements) and the
    CPU: rates in (elements/s, the profile's `optimizer_rate`; bytes/s of the host link),
    times out. For a GPU/CPU optimizer split choosing its fraction: the fraction that
    minimises `exposed_s`."""
    if not 0.0 <= device_fraction <= 1.0:
        raise ValueError(f"device_fraction {device_fraction} must be within [0, 1]")
    if cpu_elements_per_s <= 0 or (device_fraction > 0 and not device_elements_per_s):
        raise ValueError("rates must be positive (a device share needs device_elements_per_s)")
    on_device = elements * device_fraction
    on_cpu = elements - on_device
    copy = on_cpu * (grad_bytes + param_bytes) / link_bytes_per_s if link_bytes_per_s else 0.0
    return UpdateTimes(on_cpu / cpu_elements_per_s,
                       on_device / device_elements_per_s if device_elements_per_s else 0.0, copy)


def _on_disk(tier: str) -> bool:
    return tier == "nvme"


def predict_step(shape: ModelShape, profile: MachineProfile, s: StepSettings) -> StepPrediction:
    """The predicted step of `shape` under `s` on `profile`'s machine ([Note: the step as the
    engine issues it])."""
    p_bytes = _DTYPE_BYTES[s.dtype]
    ws = s.world_size
    compute_dtype = "fp32" if s.dtype == "fp32" else "bf16"
    device = "cuda" if s.on_gpu else "cpu"
    host_bw = profile.host_bandwidth.value * 1e9
    needs_nvme = _on_disk(s.param_tier) or _on_disk(s.optimizer_tier)
    if needs_nvme and (profile.nvme_read is None or profile.nvme_write is None):
        raise ValueError(f"placement {s.param_tier}/{s.optimizer_tier} needs NVMe figures; the profile "
                         "has none: measure with --nvme-path DIR")
    if s.on_gpu and (profile.h2d is None or profile.d2h is None or not profile.gpu_matmul):
        raise ValueError("a GPU run needs the profile's GPU figures: measure on the GPU machine "
                         "(python -m offload.plan --measure) and pass it with --profile")
    read_bw = profile.nvme_read.value * 1e9 if profile.nvme_read else 0.0
    write_bw = profile.nvme_write.value * 1e9 if profile.nvme_write else 0.0
    h2d = profile.h2d.value * 1e9 if profile.h2d else 0.0
    d2h = profile.d2h.value * 1e9 if profile.d2h else 0.0
    opt_rate = profile.optimizer_rate(s.moments, s.optimizer_threads)
    compute_r = "gpu" if s.on_gpu else "cpu"
    copy_up, copy_down = ("h2d", "d2h") if s.on_gpu else ("cpu", "cpu")
    opt_r = ("optimizer" if s.worker else "optimizer_autograd") if s.on_gpu else "cpu"

    # GPU launches overlap its work; on the CPU see COLD_LAUNCH_FRACTION
    launch = 0.0 if s.on_gpu else profile.parallel_op.value * COLD_LAUNCH_FRACTION

    def fwd_s(u: Any) -> float:
        rate = profile.matmul_rate(device, compute_dtype, u.d_model)
        # A GPU's memory bandwidth is not measured: its non-matmul traffic is left out there.
        traffic = 0.0 if s.on_gpu else u.fwd_traffic_elems * p_bytes / host_bw
        return u.fwd_flops / rate + traffic + (u.matmuls + u.ops_fwd) * launch + UNIT_OVERHEAD_S

    def bwd_s(u: Any) -> float:
        """2 x the forward's work (gradients of the input and of the weights) with its own
        launches ([Note: the times of one unit])."""
        rate = profile.matmul_rate(device, compute_dtype, u.d_model)
        traffic = 0.0 if s.on_gpu else 2 * u.fwd_traffic_elems * p_bytes / host_bw
        return 2 * u.fwd_flops / rate + traffic + (2 * u.matmuls + u.ops_bwd) * launch + 2 * UNIT_OVERHEAD_S

    units = shape.units
    n = len(units)
    shard = [u.params / ws for u in units]
    full_b = [u.params * p_bytes for u in units]
    ev = EventSchedule()
    # Which units stay gathered from forward to backward (the last ones, within keep_bytes).
    kept: set[int] = set()
    if s.param_tier != "device":
        room = s.keep_bytes
        for i in reversed(range(n)):
            if full_b[i] > room:
                break
            kept.add(i)
            room -= full_b[i]
    fetches_param = s.param_tier != "device" and (s.on_gpu or _on_disk(s.param_tier))

    def fetch(i: int, after: tuple[int, ...]) -> tuple[int, ...]:
        """The unit's parameter shard to where compute reads it; the task indices to wait on."""
        out: list[int] = []
        if _on_disk(s.param_tier):
            out.append(ev.add(f"read param {i}", "nvme", shard[i] * p_bytes / read_bw, after))
        if s.on_gpu and s.param_tier != "device":
            out.append(ev.add(f"h2d param {i}", "h2d", full_b[i] / h2d, tuple(out) or after))
        return tuple(out[-1:])

    def ahead(sizes: list[float], budget: int) -> int:
        biggest = max(sizes, default=1.0) or 1.0
        return max(1, int(budget // biggest))

    # forward
    fwd_ids: list[int] = []
    fetched: dict[int, tuple[int, ...]] = {}
    look = ahead([float(b) for b in full_b], s.prefetch_bytes)
    for i in range(n):
        if fetches_param:
            for j in range(i, min(n, i + look + 1)):
                if j not in fetched:
                    gate = j - look - 1  # the budget frees as earlier units finish
                    fetched[j] = fetch(j, (fwd_ids[gate],) if 0 <= gate < len(fwd_ids) else ())
        after = fetched.get(i, ()) + ((fwd_ids[-1],) if fwd_ids else ())
        fwd_ids.append(ev.add(f"fwd {i}", compute_r, fwd_s(units[i]), after))
    forward_end = fwd_ids[-1]

    # backward, and the updates in it or after it
    state_b = [sh * (4 + STATE_BYTES.get(s.moments, 8.0)) for sh in shard]
    opt_look = ahead(state_b, s.pinned_budget_bytes // 2)
    last = forward_end
    update_ids: list[int] = []
    grad_ids: dict[int, int] = {}
    bwd_fetched: dict[int, tuple[int, ...]] = {}
    bwd_order = list(reversed(range(n)))
    bwd_ids: list[int] = []

    def update(i: int, after: tuple[int, ...], issued: int) -> int:
        """Unit i's update after `after`; its state read is issued once task `issued` ends
        (the unit's turn in backward, or the end of backward for updates at step()) and no
        more than `opt_look` reads ahead of the updates (the pinned budget)."""
        deps = after
        if _on_disk(s.optimizer_tier):
            k = len(update_ids)
            gate = (update_ids[k - opt_look],) if k - opt_look >= 0 else ()
            deps = deps + (ev.add(f"read state {i}", "nvme", state_b[i] / read_bw, gate + (issued,)),)
        u = ev.add(f"update {i}", opt_r, shard[i] / opt_rate, deps)
        update_ids.append(u)
        if _on_disk(s.optimizer_tier):
            ev.add(f"write state {i}", "nvme", state_b[i] / write_bw, (u,))
        if _on_disk(s.param_tier):
            ev.add(f"write param {i}", "nvme", shard[i] * p_bytes / write_bw, (u,))
        elif s.on_gpu and s.param_tier == "device":
            ev.add(f"h2d new shard {i}", "h2d", shard[i] * p_bytes / h2d, (u,))
        return u

    for pos, i in enumerate(bwd_order):
        if fetches_param:
            for j in bwd_order[pos:pos + look + 1]:
                if j not in kept and j not in bwd_fetched:
                    gate_pos = bwd_order.index(j) - look - 1
                    bwd_fetched[j] = fetch(j, (bwd_ids[gate_pos],) if 0 <= gate_pos < len(bwd_ids) else (last,))
        u = units[i]
        seconds = bwd_s(u) + (fwd_s(u) if shape.recompute and i > 0 else 0.0)
        deps = bwd_fetched.get(i, ()) + (last,)
        if s.on_gpu and s.updates_in_backward and not s.worker and update_ids:
            deps += (update_ids[-1],)  # autograd's thread ran the last update before this backward
        turn = last
        b = ev.add(f"bwd {i}", compute_r, seconds, deps)
        bwd_ids.append(b)
        grad_s = (u.params * (p_bytes + 4) / host_bw) if not s.on_gpu else (u.params * 4 / d2h)
        grad_ids[i] = ev.add(f"grad {i}", copy_down, grad_s, (b,))
        last = b
        if s.updates_in_backward:
            update(i, (grad_ids[i],), turn)
    backward_end = last
    if not s.updates_in_backward:
        all_grads = tuple(grad_ids.values())
        for i in bwd_order:
            update(i, all_grads, backward_end)
    sched: Schedule = ev.run()
    busy = {k: v for k, v in sched.busy_s.items()}
    if "optimizer_autograd" in busy:  # autograd's thread: shown as the optimizer
        busy["optimizer"] = busy.pop("optimizer_autograd") + busy.get("optimizer", 0.0)
    step = sched.makespan_s
    binding = max(busy, key=lambda r: busy[r]) if busy else "nothing"
    return StepPrediction(f"{s.param_tier}/{s.optimizer_tier}", step, shape.tokens, binding, busy,
                          sched.ends[forward_end], sched.ends[backward_end])
