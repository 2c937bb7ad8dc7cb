"""Real small and read-only filesystems for tests (we are root on test machines).

A size-limited tmpfs gives a genuinely full disk (ENOSPC) and a read-only remount a genuine
EROFS; no mocks. Tests that need them skip, with the reason, where mounting is not allowed.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from typing import Iterator

import pytest


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True)


@contextlib.contextmanager
def mounted_tmpfs(size: str = "4m", read_only: bool = False) -> Iterator[str]:
    """A fresh tmpfs of `size` (read-only if asked); unmounted afterwards."""
    path = tempfile.mkdtemp(prefix="offload-mnt-")
    opts = f"size={size}" + (",ro" if read_only else "")
    proc = _run("mount", "-t", "tmpfs", "-o", opts, "tmpfs", path)
    if proc.returncode != 0:
        os.rmdir(path)
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip()}); needs root")
    try:
        yield path
    finally:
        _run("umount", "-l", path)
        os.rmdir(path)
