"""A memory cgroup for one child process: v2's `memory.max` where the machine's v2 hierarchy
has the memory controller, v1's `memory.limit_in_bytes` otherwise (tools/load_under_limit.py
uses it; root only: `CgroupUnavailable` says why not)."""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import time
from typing import Optional

__all__ = ["CgroupUnavailable", "MemoryCgroup", "read_text"]


class CgroupUnavailable(RuntimeError):
    """No memory cgroup can be made here (not root, no memory controller); says why."""


def _mounts() -> list[tuple[str, str, str, str]]:
    """(mount point, the hierarchy's directory mounted there, fstype, super options) of every
    cgroup mount."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fstype, _, opts = right.split()[:3]
            if fstype in ("cgroup", "cgroup2"):
                fields = left.split()
                out.append((fields[4], fields[3], fstype, opts))
    return out


def _own_dir(mount_point: str, mount_root: str, version: int) -> Optional[str]:
    """This process's cgroup directory under a mount of the v2 hierarchy, or of v1's memory
    hierarchy (None when the mount does not show it)."""
    with open("/proc/self/cgroup") as f:
        for line in f:
            hid, controllers, path = line.rstrip("\n").split(":", 2)
            if (version == 2 and hid == "0") or (version == 1 and "memory" in controllers.split(",")):
                rel = os.path.relpath(path, mount_root)
                return None if rel.startswith("..") else os.path.normpath(os.path.join(mount_point, rel))
    return None


class MemoryCgroup:
    """A fresh memory cgroup with a limit, for one child process; `remove()` deletes it.

    v2 where the machine's v2 hierarchy has the memory controller (memory.max, memory.peak,
    memory.events' oom_kill), else v1 (memory.limit_in_bytes, memory.max_usage_in_bytes,
    memory.oom_control's oom_kill). It is made below this process's own cgroup where that
    can hold it, so the limits above still apply; in v2 a cgroup holding processes cannot
    give its children controllers, and then it is made below the hierarchy's root. Swap is
    limited too where the kernel accounts it (memory.swap.max / memsw), so the limit is on
    memory, not memory plus swap. v1 counts page cache in its usage (reclaimed at the limit);
    anonymous memory above the limit is an OOM kill in both."""

    def __init__(self, name: str) -> None:
        if os.geteuid() != 0:
            raise CgroupUnavailable("making a memory cgroup needs root (this process runs as uid "
                                    f"{os.geteuid()})")
        errors = []
        self.version, self.path = 0, ""
        mounts = _mounts()
        for point, root, fstype, opts in mounts:  # v2 first: where it has the memory controller
            if fstype != "cgroup2":
                continue
            if "memory" not in _read(os.path.join(point, "cgroup.controllers"), "").split():
                errors.append(f"{point} (v2) has no memory controller")
                continue
            for parent in dict.fromkeys(p for p in (_own_dir(point, root, 2), point) if p):
                try:
                    if "memory" not in _read(os.path.join(parent, "cgroup.subtree_control"), "").split():
                        _write(os.path.join(parent, "cgroup.subtree_control"), "+memory")
                    self._make(os.path.join(parent, name), 2)
                    return
                except OSError as exc:
                    errors.append(f"{parent} (v2): {exc}")
        for point, root, fstype, opts in mounts:
            if fstype != "cgroup" or "memory" not in opts.split(","):
                continue
            for parent in dict.fromkeys(p for p in (_own_dir(point, root, 1), point) if p):
                try:
                    self._make(os.path.join(parent, name), 1)
                    return
                except OSError as exc:
                    errors.append(f"{parent} (v1): {exc}")
        raise CgroupUnavailable("no memory cgroup could be made: " + ("; ".join(errors) or
                                "neither a cgroup v2 memory controller nor a v1 memory hierarchy is mounted"))

    def _make(self, path: str, version: int) -> None:
        os.mkdir(path)
        self.path, self.version = path, version
        self._files = ({"limit": "memory.max", "peak": "memory.peak", "swap": "memory.swap.max"}
                       if version == 2 else
                       {"limit": "memory.limit_in_bytes", "peak": "memory.max_usage_in_bytes",
                        "swap": "memory.memsw.limit_in_bytes"})

    def set_limit(self, limit_bytes: int) -> None:
        """The most memory the cgroup's processes may use (v1: usage includes page cache)."""
        limit = os.path.join(self.path, self._files["limit"])
        swap = os.path.join(self.path, self._files["swap"])
        if self.version == 2:
            _write(limit, str(limit_bytes))
            if os.path.exists(swap):
                _write(swap, "0")
            return
        # v1: memsw (memory + swap) must stay >= the memory limit; raising, set it first
        if os.path.exists(swap) and int(_read(swap, "0")) < limit_bytes:
            _write(swap, str(limit_bytes))
        _write(limit, str(limit_bytes))
        if os.path.exists(swap):
            with contextlib.suppress(OSError):
                _write(swap, str(limit_bytes))

    def limit_bytes(self) -> int:
        text = _read(os.path.join(self.path, self._files["limit"]), "max")
        return sys.maxsize if text == "max" else int(text)

    def peak_bytes(self) -> Optional[int]:
        """The cgroup's peak usage since it was made (None where the kernel has no such file:
        v2's memory.peak is Linux 5.19+)."""
        text = _read(os.path.join(self.path, self._files["peak"]), "")
        return int(text) if text else None

    def oom_kills(self) -> int:
        """Processes of this cgroup the kernel's OOM killer killed."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        for line in _read(os.path.join(self.path, name), "").splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def command(self, argv: list[str]) -> list[str]:
        """`argv` run inside the cgroup from its first instruction: `sh` joins it, then execs
        (same pid, and VmHWM starts again at the exec)."""
        procs = os.path.join(self.path, "cgroup.procs")
        return ["sh", "-c", f'echo $$ > "{procs}" && exec "$@"', "sh", *argv]

    def remove(self) -> None:
        """Delete the cgroup (its processes must have exited; retried briefly while the
        kernel lets them go)."""
        if not self.path:
            return
        for _ in range(50):
            try:
                os.rmdir(self.path)
                self.path = ""
                return
            except FileNotFoundError:
                self.path = ""
                return
            except OSError as exc:
                if exc.errno != errno.EBUSY:
                    raise
                time.sleep(0.1)
        raise OSError(errno.EBUSY, f"cgroup {self.path} still has processes; remove it with rmdir")


def _read(path: str, default: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return default


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


read_text = _read
