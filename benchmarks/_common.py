"""What every benchmark shares: the machine header, interleaved repeats, medians, the table.

Contenders are run interleaved (A B C A B C ...) and summarised by their median, because
the machines we run on are noisy: a slow minute then hits every contender alike, and ratios
taken within one run stay meaningful when absolute figures wander.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence


def base_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="a small run, under a minute")
    p.add_argument("--json", metavar="PATH", help="also write the table (with ratios) as JSON")
    p.add_argument("--repeats", type=int, default=None, help="interleaved rounds per contender")
    return p


def machine_info(disk_path: Optional[str] = None) -> dict[str, Any]:
    """CPU, cores, memory and (optionally) the filesystem a benchmark writes to."""
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cores_usable": len(os.sched_getaffinity(0)),
    }
    try:
        with open("/proc/meminfo") as f:
            kb = int(f.readline().split()[1])
        info["memory_gib"] = round(kb / 2**20, 1)
    except OSError:
        pass
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    except ImportError:
        pass
    try:
        from offload._native import cpu_features

        info["simd"] = ",".join(k for k, v in cpu_features().items() if v) or "none"
    except ImportError:
        pass
    if disk_path:
        usage = shutil.disk_usage(disk_path)
        info["disk_path"] = disk_path
        info["disk_free_gib"] = round(usage.free / 2**30, 1)
        info["filesystem"] = _filesystem_of(disk_path)
    return info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _filesystem_of(path: str) -> str:
    try:
        out = subprocess.run(["df", "-T", path], capture_output=True, text=True, check=True)
        fields = out.stdout.splitlines()[1].split()
        return f"{fields[1]} on {fields[0]}"
    except (OSError, subprocess.CalledProcessError, IndexError):
        return "unknown"


def print_machine(info: dict[str, Any]) -> None:
    print("machine: " + ", ".join(f"{k}={v}" for k, v in info.items()))


@dataclass
class Samples:
    """Repeated measurements of one contender on one case."""

    values: list[float] = field(default_factory=list)

    def add(self, v: float) -> None:
        self.values.append(v)

    @property
    def median(self) -> float:
        return statistics.median(self.values) if self.values else float("nan")


def interleave(
    contenders: dict[str, Callable[[], float]], repeats: int
) -> dict[str, Samples]:
    """Run each contender once per round, in turn, `repeats` rounds; collect what each returns.

    A contender returns its own measurement (seconds, GB/s, ...), so setup it does outside
    the timed region stays out of the figure. A contender that raises is dropped with its
    reason printed, and the others go on.
    """
    samples = {name: Samples() for name in contenders}
    alive = dict(contenders)
    for _ in range(repeats):
        for name, fn in list(alive.items()):
            try:
                samples[name].add(fn())
            except Exception as exc:  # a peer failing must not sink the whole benchmark
                print(f"  [{name}] dropped: {type(exc).__name__}: {exc}")
                del alive[name]
    return samples


def timed(fn: Callable[[], Any]) -> float:
    """Wall-clock seconds of one call."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def print_table(rows: Sequence[dict[str, Any]], columns: Optional[Sequence[str]] = None) -> None:
    """A plain aligned table; the caller puts ratio columns last."""
    if not rows:
        print("(no rows)")
        return
    columns = list(columns or rows[0].keys())
    cells = [[_fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if v != v:
            return "-"
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
    return str(v)


def write_json(path: Optional[str], payload: dict[str, Any]) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, default=str)
    print(f"wrote {path}")


def ratio(a: float, b: float) -> float:
    return a / b if b and b == b and a == a else float("nan")


def chunks(it: Iterable[Any], n: int) -> Iterable[list[Any]]:
    buf: list[Any] = []
    for x in it:
        buf.append(x)
        if len(buf) == n:
            yield buf
            buf = []
    if buf:
        yield buf
