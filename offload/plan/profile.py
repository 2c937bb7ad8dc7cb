"""A machine profile: what this machine's links and engines measured, each figure with its
unit and how it was measured (offload/plan/measure.py measures them), cached per machine.

The step-time model (offload/plan/step_time.py) reads its rates from here: host memory
bandwidth, the CPU optimizer's rate per moments format and thread count, NVMe read and write
(O_DIRECT, the tiers' block size), the matmul rate of the compute device, and with a GPU the
pinned host-to-device and device-to-host bandwidths and its free memory.

[Note: the profile cache]
A profile is a small JSON file under the user's cache directory
(`$XDG_CACHE_HOME/offload/machine_profile.json`, else `~/.cache/offload/...`), holding the
hardware fingerprint it was measured on (`fingerprint()`: CPU model and cores in this
process's affinity, host memory, GPUs, torch's version, and the filesystem under
`nvme_path`). `cached_profile` measures again when the fingerprint differs (another machine,
a different disk, a new GPU) and when the file cannot be read as a profile (a warning says
so; never a crash): a stale profile is worse than the minute a new one costs. A profile
from elsewhere (`--profile FILE`) is used as it is: planning an 8 x H100 node from a laptop.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

import torch

__all__ = ["Figure", "OptimizerRate", "MatmulRate", "MachineProfile", "PROFILE_VERSION",
           "cache_path", "fingerprint", "hardware_text", "load_profile", "save_profile",
           "cached_profile", "this_machine_cached"]

logger = logging.getLogger("offload")

PROFILE_VERSION = 2
"""Bumped when the record's fields change: an older file is measured again."""


@dataclass(frozen=True, kw_only=True)
class Figure:
    """One measured figure."""

    value: float
    unit: str
    """e.g. 'GB/s' (1e9 bytes per second), 'elements/s', 'FLOP/s', 'bytes'."""
    method: str
    """How it was measured, in a sentence: sizes, repetitions, the statistic."""


@dataclass(frozen=True, kw_only=True)
class OptimizerRate:
    """The CPU optimizer's update rate for one moments format at one thread count."""

    moments: str
    """'fp32', 'bf16' or '8bit' (offload.optim.kinds.MOMENT_FORMATS)."""
    threads: int
    rate: Figure
    """Parameters updated per second (unit 'elements/s')."""


@dataclass(frozen=True, kw_only=True)
class MatmulRate:
    """A compute device's matmul rate at one size: (tokens x d) @ (d x 4d), a transformer
    block's MLP, which is where most of a step's FLOPs are."""

    device: str
    """'cpu' or 'cuda'."""
    dtype: str
    """'fp32' or 'bf16'."""
    d_model: int
    rate: Figure
    """Unit 'FLOP/s' (2 m n k per matmul)."""


@dataclass(frozen=True, kw_only=True)
class MachineProfile:
    """What one machine measured. Absent figures (no GPU, no nvme_path) are None, with the
    reason in `absent`."""

    version: int = PROFILE_VERSION
    fingerprint: str
    hardware: str
    """The fingerprint's inputs, readable: CPU model, cores, memory, GPUs, torch."""
    measured_at: str
    """UTC, ISO 8601."""
    quick: bool = False
    """Measured with the small sizes (tests): rates are rougher."""
    cpu_threads: int
    """Cores in the measuring process's affinity: the most threads the optimizer uses."""
    host_bandwidth: Figure
    """Host memory copy bandwidth, GB/s (bytes read + written)."""
    parallel_op: Figure
    """Seconds one CPU kernel launch on several threads costs beyond its bytes (unit 's'):
    microseconds on an idle machine, a scheduler's time slice where other work keeps the
    cores busy (each launch waits for all its threads). [Note: the cost of a launch]"""
    optimizer: tuple[OptimizerRate, ...]
    cpu_matmul: tuple[MatmulRate, ...]
    nvme_block_size: int = 0
    """The tiers' block size the NVMe figures were measured at (bytes); 0 without NVMe."""
    nvme_path: Optional[str] = None
    nvme_read: Optional[Figure] = None
    nvme_write: Optional[Figure] = None
    h2d: Optional[Figure] = None
    """Pinned host to GPU, GB/s."""
    d2h: Optional[Figure] = None
    gpu_matmul: tuple[MatmulRate, ...] = ()
    gpu_free_bytes: Optional[Figure] = None
    gpu_name: Optional[str] = None
    absent: tuple[str, ...] = field(default_factory=tuple)
    """Why a figure is missing, one line each ('no GPU: ...', 'no nvme_path: ...')."""

    # -- lookups --------------------------------------------------------------------------

    def optimizer_rate(self, moments: str, threads: Optional[int] = None) -> float:
        """Elements/s of the CPU optimizer for `moments` at `threads` (default: all measured
        cores): the measured thread count nearest below it (a rate at more threads than
        measured is not extrapolated)."""
        rows = [r for r in self.optimizer if r.moments == moments]
        if not rows:
            rows = [r for r in self.optimizer if r.moments == "fp32"]
        if not rows:
            raise ValueError(f"the profile has no CPU optimizer rate for {moments!r} moments")
        want = threads or self.cpu_threads
        below = [r for r in rows if r.threads <= want] or [min(rows, key=lambda r: r.threads)]
        return max(below, key=lambda r: r.threads).rate.value

    def matmul_rate(self, device: str, dtype: str, d_model: int) -> float:
        """FLOP/s of a d_model-wide matmul on `device` in `dtype`: log-linear between the
        measured sizes, the nearest measured size outside them."""
        table = self.cpu_matmul if device == "cpu" else self.gpu_matmul
        rows = sorted((r for r in table if r.dtype == dtype), key=lambda r: r.d_model)
        if not rows:
            rows = sorted((r for r in table if r.dtype == "fp32"), key=lambda r: r.d_model)
        if not rows:
            raise ValueError(f"the profile has no {device} matmul rate (absent: "
                             f"{'; '.join(self.absent) or 'not measured'})")
        if d_model <= rows[0].d_model:
            return rows[0].rate.value
        for a, b in zip(rows, rows[1:]):
            if d_model <= b.d_model:
                import math

                t = (math.log(d_model) - math.log(a.d_model)) / (math.log(b.d_model) - math.log(a.d_model))
                return a.rate.value * (b.rate.value / a.rate.value) ** t
        return rows[-1].rate.value

    # -- the file -------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(d: Any) -> "MachineProfile":
        """The record from `to_dict`'s JSON; ValueError naming what is wrong otherwise."""
        if not isinstance(d, dict):
            raise ValueError(f"a machine profile is a JSON object, not {type(d).__name__}")
        if d.get("version") != PROFILE_VERSION:
            raise ValueError(f"profile version {d.get('version')!r}, this offload reads {PROFILE_VERSION}")
        try:
            def fig(x: Any) -> Optional[Figure]:
                return None if x is None else Figure(value=float(x["value"]), unit=str(x["unit"]),
                                                     method=str(x["method"]))

            def mm(rows: Any) -> tuple[MatmulRate, ...]:
                return tuple(MatmulRate(device=str(r["device"]), dtype=str(r["dtype"]),
                                        d_model=int(r["d_model"]), rate=_need(fig(r["rate"])))
                             for r in rows)

            kw = dict(d)
            for key in ("host_bandwidth", "parallel_op", "nvme_read", "nvme_write", "h2d", "d2h",
                        "gpu_free_bytes"):
                kw[key] = fig(kw.get(key))
            kw["host_bandwidth"] = _need(kw["host_bandwidth"])
            kw["parallel_op"] = _need(kw["parallel_op"])
            kw["optimizer"] = tuple(OptimizerRate(moments=str(r["moments"]), threads=int(r["threads"]),
                                                  rate=_need(fig(r["rate"]))) for r in d["optimizer"])
            kw["cpu_matmul"] = mm(d["cpu_matmul"])
            kw["gpu_matmul"] = mm(d.get("gpu_matmul", ()))
            kw["absent"] = tuple(str(a) for a in d.get("absent", ()))
            prof = MachineProfile(**kw)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a machine profile: {type(e).__name__}: {e}") from None
        bad = [f for f in _all_figures(prof) if not (f.value > 0 and f.value < float("inf"))]
        if bad or not prof.optimizer or not prof.cpu_matmul:
            raise ValueError("not a machine profile: a figure is missing, zero or negative")
        return prof

    def describe(self) -> str:
        """The figures, one line each, with unit and method."""
        lines = [f"machine profile {self.fingerprint} ({self.hardware}), measured {self.measured_at}"
                 + (" (quick)" if self.quick else "")]

        def line(name: str, f: Optional[Figure]) -> None:
            if f is not None:
                lines.append(f"  {name}: {f.value:.4g} {f.unit} -- {f.method}")

        line("host memory bandwidth", self.host_bandwidth)
        line("CPU kernel launch on several threads", self.parallel_op)
        for r in self.optimizer:
            line(f"CPU optimizer, {r.moments} moments, {r.threads} thread(s)", r.rate)
        for m in self.cpu_matmul + self.gpu_matmul:
            line(f"{m.device} matmul {m.dtype}, d_model {m.d_model}", m.rate)
        line(f"NVMe read ({self.nvme_path}, block {self.nvme_block_size} B)", self.nvme_read)
        line(f"NVMe write ({self.nvme_path}, block {self.nvme_block_size} B)", self.nvme_write)
        line("pinned host to GPU", self.h2d)
        line("GPU to pinned host", self.d2h)
        line(f"GPU free memory ({self.gpu_name})", self.gpu_free_bytes)
        lines.extend(f"  absent: {a}" for a in self.absent)
        return "\n".join(lines)


def _need(f: Optional[Figure]) -> Figure:
    if f is None:
        raise ValueError("a required figure is null")
    return f


def _all_figures(p: MachineProfile) -> list[Figure]:
    out = [p.host_bandwidth, p.parallel_op] + [r.rate for r in p.optimizer] + [m.rate for m in p.cpu_matmul + p.gpu_matmul]
    return out + [f for f in (p.nvme_read, p.nvme_write, p.h2d, p.d2h, p.gpu_free_bytes) if f is not None]


# --------------------------------------------------------------------------------------
# The fingerprint and the cache ([Note: the profile cache])
# --------------------------------------------------------------------------------------


def cpu_model() -> str:
    """The CPU's model name as /proc/cpuinfo gives it (else what `platform` knows): part of the
    profile's fingerprint, and the benchmarks' machine line."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _mem_total_gib() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20)
    except OSError:
        pass
    return 0


def hardware_text(nvme_path: Optional[str] = None) -> str:
    """What the fingerprint hashes, readable."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    gpus = "no GPU"
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        gpus = f"{len(names)} x {names[0]}"
    disk = "no nvme_path"
    if nvme_path:
        try:
            disk = f"nvme_path filesystem {os.stat(nvme_path).st_dev:#x}"
        except OSError:
            disk = f"nvme_path {nvme_path} (missing)"
    torch_v = ".".join(torch.__version__.split(".")[:2])
    return f"{cpu_model()}, {cores} cores, {_mem_total_gib()} GiB, {gpus}, torch {torch_v}, {disk}"


def fingerprint(nvme_path: Optional[str] = None) -> str:
    """16 hex digits of the hardware this process runs on (`hardware_text`)."""
    return hashlib.sha256(hardware_text(nvme_path).encode()).hexdigest()[:16]


def cache_path() -> str:
    """$XDG_CACHE_HOME/offload/machine_profile.json, else ~/.cache/offload/machine_profile.json."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "offload", "machine_profile.json")


def load_profile(path: str) -> MachineProfile:
    """A profile file (`--profile FILE`); ValueError saying what is wrong with it."""
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise ValueError(f"cannot read machine profile {path}: {e.strerror or e}; measure one with "
                         "python -m offload.plan --measure") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"machine profile {path} is not JSON ({e}); measure it again with "
                         "python -m offload.plan --measure") from None
    try:
        return MachineProfile.from_dict(data)
    except ValueError as e:
        raise ValueError(f"machine profile {path}: {e}; measure it again with python -m offload.plan "
                         "--measure") from None


def save_profile(profile: MachineProfile, path: str) -> None:
    """Write atomically (a reader never sees half a file)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(profile.to_dict(), f, indent=1)
    os.replace(tmp, path)


def cached_profile(measure: Callable[[], MachineProfile], nvme_path: Optional[str] = None,
                   path: Optional[str] = None, refresh: bool = False) -> MachineProfile:
    """The cached profile of this machine, measured (by `measure`) and written when there is
    none, when its fingerprint is not this machine's, when it cannot be read (a warning), or
    with `refresh`. [Note: the profile cache]"""
    path = path or cache_path()
    want = fingerprint(nvme_path)
    if not refresh and os.path.exists(path):
        try:
            prof = load_profile(path)
        except ValueError as e:
            logger.warning("offload: %s -- measuring this machine again", e)
        else:
            if prof.fingerprint == want:
                return prof
            logger.info("offload: the cached machine profile is of other hardware (%s; this is %s): "
                        "measuring again", prof.hardware, hardware_text(nvme_path))
    prof = measure()
    try:
        save_profile(prof, path)
    except OSError as e:  # a read-only home: the profile still serves this process
        logger.warning("offload: cannot write the machine profile to %s (%s)", path, e)
    return prof


def this_machine_cached(nvme_path: Optional[str] = None) -> Optional[MachineProfile]:
    """The cached profile when it is this machine's (same fingerprint), else None; never
    measures (a training run does not stop for a minute to measure by itself)."""
    path = cache_path()
    if not os.path.exists(path):
        return None
    try:
        prof = load_profile(path)
    except ValueError as e:
        logger.debug("offload: no usable machine profile: %s", e)
        return None
    return prof if prof.fingerprint == fingerprint(nvme_path) else None
