"""Which mount holds a path, and of what filesystem (from /proc/self/mountinfo): the swap
directory's checks say where a swap file would land (offload/storage/swap.py)."""

from __future__ import annotations

import os
from typing import Optional

__all__ = ["filesystem_type", "mount_of"]


def filesystem_type(path: str) -> Optional[str]:
    """The type (`ext4`, `tmpfs`, ...) of the mount holding `path`, from /proc/self/mountinfo
    (the longest mount point that contains the resolved path); None where it cannot be read."""
    return mount_of(path)[1]


def mount_of(path: str) -> tuple[Optional[str], Optional[str]]:
    """(mount point, filesystem type) of the mount holding `path` ((None, None) where
    /proc/self/mountinfo cannot be read)."""
    real = os.path.realpath(path)
    best: tuple[int, Optional[str], Optional[str]] = (-1, None, None)
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                if " - " not in line or len(fields) < 5:
                    continue
                # Mount points escape spaces and the like as octal (\040).
                mount = fields[4].encode().decode("unicode_escape")
                fstype = line.split(" - ", 1)[1].split()[0]
                inside = real == mount or real.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) > best[0]:
                    best = (len(mount), mount, fstype)
    except OSError:
        return None, None
    return best[1], best[2]
