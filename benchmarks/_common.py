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
import sys
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
    from offload.plan.profile import cpu_model  # the planner's profile names the CPU the same way

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_model(),
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



def _filesystem_of(path: str) -> str:
    try:
        out = subprocess.run(["df", "-T", path], capture_output=True, text=True, check=True)
        fields = out.stdout.splitlines()[1].split()
        return f"{fields[1]} on {fields[0]}"
    except (OSError, subprocess.CalledProcessError, IndexError):
        return "unknown"


# [Note: ratio direction] Every "vs X" column in every benchmark reads the same way: X's
# time / ours, which for rates (GB/s, params/s) is our rate / X's rate. Above 1 means offload
# (the row's contender) is faster than X; below 1, slower. "vs roofline" / "vs disk" read the
# same way: the share of that limit reached. One direction, so no table needs decoding.
RATIO_LEGEND = ("ratios: every 'vs X' column is X's time / ours (= our rate / X's rate); "
                ">1 means offload is faster than X, <1 slower; n/a when X did not run (why: under the table)")


def peer_reason(exc: BaseException) -> str:
    """Why a peer could not run here, in one short line ("deepspeed not installed (pip install
    deepspeed)" rather than a traceback's last line)."""
    from benchmarks.peer_ops import PeerNotReady

    if isinstance(exc, PeerNotReady):
        return str(exc)
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        top = exc.name.split(".")[0]
        return f"{top} not installed (pip install {top})"
    first = (str(exc).splitlines() or [""])[0][:200]
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def load_average() -> dict[str, Any]:
    """The machine's load now: 1/5/15-minute load averages and the usable cores. Two runs
    back to back differed 3x on a shared VM; this says which figures to distrust."""
    return {"load_avg": [round(x, 2) for x in os.getloadavg()], "cores": os.cpu_count() or 1}


def busy(load: dict[str, Any], share: float = 0.5) -> bool:
    """The machine counts as busy when the 1-minute load average exceeds `share` x cores."""
    return load["load_avg"][0] > share * load["cores"]


def progress_line(desc: str, done: int, total: int) -> None:
    """One round done: a machine-readable line the suite runner turns into its progress bar
    (or echoes as is when its own output is not a terminal)."""
    print(f"[progress] {desc} {done}/{total}", flush=True)


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
    contenders: dict[str, Callable[[], float]], repeats: int, desc: Optional[str] = None
) -> dict[str, Samples]:
    """Run each contender once per round, in turn, `repeats` rounds; collect what each returns.

    A contender returns its own measurement (seconds, GB/s, ...), so setup it does outside
    the timed region stays out of the figure. A contender that raises is dropped with its
    reason printed, and the others go on. With `desc`, each round reports its progress
    (`Progress`: a tqdm bar on a terminal, plain `[progress]` lines otherwise).
    """
    samples = {name: Samples() for name in contenders}
    alive = dict(contenders)
    bar = Progress(desc, repeats) if desc else None
    for _ in range(repeats):
        for name, fn in list(alive.items()):
            try:
                samples[name].add(fn())
            except Exception as exc:  # a peer failing must not sink the whole benchmark
                print(f"  [{name}] dropped: {type(exc).__name__}: {exc}")
                del alive[name]
        if bar is not None:
            bar.update()
    if bar is not None:
        bar.close()
    return samples


class Progress:
    """Rounds done out of `total`: a tqdm bar when stderr is a terminal, else one plain
    `[progress] desc k/n` line per round on stdout (what the suite runner reads, since it
    runs each benchmark with its output piped)."""

    def __init__(self, desc: str, total: int) -> None:
        self.desc, self.total, self.done = desc, total, 0
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit="round", leave=False)

    def update(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update()
        else:
            progress_line(self.desc, self.done, self.total)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def timed(fn: Callable[[], Any]) -> float:
    """Wall-clock seconds of one call."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def print_table(rows: Sequence[dict[str, Any]], columns: Optional[Sequence[str]] = None,
                na: Optional[dict[str, str]] = None) -> None:
    """A plain aligned table; the caller puts ratio columns last. `na` maps a column to the
    reason its empty cells are empty (the peer it compares with did not run): those cells
    read "n/a" in place of a bare dash, and each reason is printed once under the table, with
    the columns it empties, not in every cell (issue #36). The legend of the ratios goes
    above."""
    if not rows:
        print("(no rows)")
        return
    columns = list(columns or rows[0].keys())
    if any(c.startswith("vs") for c in columns):
        print(RATIO_LEGEND)
    na = {c: why for c, why in (na or {}).items() if c in columns}
    cells = [[_fmt(r.get(c), c in na) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))
    by_reason: dict[str, list[str]] = {}
    for c, why in na.items():
        by_reason.setdefault(why, []).append(c)
    for why, cols in by_reason.items():
        print(f"n/a in {', '.join(cols)}: {why}")


def _fmt(v: Any, na: bool = False) -> str:
    empty = "n/a" if na else "-"
    if v is None:
        return empty
    if isinstance(v, float):
        if v != v:
            return empty
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
    """a / b, or nan when either is missing. Callers pass (our rate, X's rate) or (X's time,
    our time), so that every ratio reads as [Note: ratio direction] says."""
    return a / b if b and b == b and a == a else float("nan")


def na_reasons(ratio_peers: dict[str, str], peers_missing: dict[str, str]) -> dict[str, str]:
    """{ratio column: why it is empty} for the columns whose peer did not run."""
    return {col: (why if peer.split("_")[0].lower() in why.lower() else f"{peer}: {why}")
            for col, peer in ratio_peers.items() if (why := peers_missing.get(peer))}


def chunks(it: Iterable[Any], n: int) -> Iterable[list[Any]]:
    buf: list[Any] = []
    for x in it:
        buf.append(x)
        if len(buf) == n:
            yield buf
            buf = []
    if buf:
        yield buf
