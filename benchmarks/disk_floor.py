"""The step at the disk's speed (issue #21): the disk's sequential bandwidth, measured in the
benchmark's own run, and the floor a step's NVMe bytes imply.

- `disk_bandwidth`: one file created fresh under the swap directory (any old one unlinked
  first), written once to allocate its blocks (`write_alloc_GBps`), then `rounds` timed
  O_DIRECT overwrites and reads of all of it with offload.storage.io (the tiers' handle
  settings), medians. O_DIRECT: the page cache neither absorbs the writes nor serves the
  reads; what a virtual disk's host does below the guest (its own cache) is not visible
  from here. No fsync: the tiers do not fsync their swap writes either. `direct` says
  whether O_DIRECT was granted (a tmpfs refuses it: then the figures are memory copies and
  the floor means nothing; the benchmark says so). Then one mixed round: a write of one file
  and a read of another, both `nbytes`, issued together; `overlap` = (the read alone + the
  write alone) / the two together: 1.0 = reads and writes share one bandwidth (the sum
  floor is the floor), 2.0 = they run side by side at full speed (the max floor is).
  Last, one overwrite timed with an fsync after it (`write_fsync_GBps`): where it is far
  below `write_GBps`, a write cache under the guest absorbed the O_DIRECT writes; the floor
  uses `write_GBps`, what the tiers' unsynced writes see while that cache keeps up.
- `proc_io`: this process's /proc/self/io read_bytes and write_bytes (bytes it made the
  block layer move, O_DIRECT included, summed over its threads): the byte count for
  DeepSpeed's NVMe offload, which has no io_stats(). O_DIRECT writes count when submitted,
  so a write still in flight when a step returns lands in the next step's window; the
  median over steady-state steps is still the per-step volume (checked against the
  engine's io_stats() over 3 steps of a 17M GPT, both tiers on NVMe: reads equal, writes
  within 2%; one step's window alone differs by up to ~20%).
- `floor_fields`: read_bytes / read_bw + write_bytes / write_bw (the conservative floor,
  reads and writes not overlapping), max() of the two (the floor if they overlap fully),
  and the step's ratio to max(floor, the in-memory step).
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Optional

from offload.sizes import MiB

__all__ = ["disk_bandwidth", "proc_io", "floor_fields"]


def disk_bandwidth(path: str, nbytes: int, block_size: int, queue_depth: int, threads: int,
                   rounds: int = 3) -> dict:
    """Sequential bandwidth of the disk under `path` in GB/s (1e9 B/s); see the module doc."""
    from offload.storage.io import AIOHandle, aligned_empty

    if nbytes <= 0 or nbytes % (1 << 20):
        raise ValueError(f"disk probe size must be a positive multiple of 1 MiB, got {nbytes} bytes")
    os.makedirs(path, exist_ok=True)
    f, g = os.path.join(path, "peak.bin"), os.path.join(path, "peak2.bin")
    for p in (f, g):
        if os.path.exists(p):
            os.unlink(p)  # fresh: no blocks, nothing cached from an earlier run
    buf, other = aligned_empty(nbytes), aligned_empty(nbytes)
    buf.fill_(1)
    other.fill_(2)

    def timed(*reqs) -> float:
        t0 = time.perf_counter()
        for r in reqs:
            r.wait()
        return time.perf_counter() - t0

    w, r = [], []
    try:
        with AIOHandle(block_size, queue_depth, threads) as h:
            first = h.pwrite(buf, f, 0)
            alloc = timed(first)
            direct = bool(first.direct)
            h.pwrite(other, g, 0).wait()
            for _ in range(rounds):
                w.append(timed(h.pwrite(buf, f, 0)))
                r.append(timed(h.pread(buf, f, 0)))
            mixed = timed(h.pwrite(buf, f, 0), h.pread(other, g, 0))
            t0 = time.perf_counter()
            h.pwrite(buf, f, 0).wait()
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)  # to stable storage: a write cache below the guest (a VM host's) drained
            finally:
                os.close(fd)
            synced = time.perf_counter() - t0
    finally:
        for p in (f, g):
            if os.path.exists(p):
                os.unlink(p)
    tw, tr = statistics.median(w), statistics.median(r)
    return {
        "bytes": nbytes, "direct": direct, "rounds": rounds,
        "write_GBps": nbytes / tw / 1e9, "read_GBps": nbytes / tr / 1e9,
        "write_alloc_GBps": nbytes / alloc / 1e9, "write_fsync_GBps": nbytes / synced / 1e9,
        "mixed_GBps": 2 * nbytes / mixed / 1e9, "overlap": (tw + tr) / mixed,
    }


def proc_io() -> Optional[tuple[int, int]]:
    """(read_bytes, write_bytes) of /proc/self/io, or None where it cannot be read."""
    try:
        with open("/proc/self/io") as fh:
            d = dict(line.split(":", 1) for line in fh if ":" in line)
        return int(d["read_bytes"]), int(d["write_bytes"])
    except (OSError, KeyError, ValueError):
        return None


def floor_fields(step_s: float, read_bytes: float, write_bytes: float, disk: Optional[dict],
                 in_memory_s: Optional[float]) -> dict:
    """The NVMe columns of one row: bytes per step, the floor (sum and max), the bound
    max(floor, in-memory step) and step / bound (>= 1; 1.0 = the step at its bound)."""
    out = {"read_MiB": read_bytes / MiB, "write_MiB": write_bytes / MiB, "floor_ms": None,
           "floor_max_ms": None, "in_memory_ms": None if in_memory_s is None else in_memory_s * 1e3,
           "bound_ms": None, "step_over_bound": None}
    if disk:
        rd, wr = read_bytes / (disk["read_GBps"] * 1e9), write_bytes / (disk["write_GBps"] * 1e9)
        out.update(floor_ms=(rd + wr) * 1e3, floor_max_ms=max(rd, wr) * 1e3)
        bound = max(rd + wr, in_memory_s or 0.0)
        if in_memory_s is not None and bound > 0:
            out.update(bound_ms=bound * 1e3, step_over_bound=step_s / bound)
    return out
