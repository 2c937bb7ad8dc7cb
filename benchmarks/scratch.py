"""The folders a benchmark makes for its scratch files, and their removal when it ends.

bench_train left its swap folders behind in the system temp dir (empty: an engine removes
its swap files on close, not the folder it was given), and torch's inductor cache folder
beside them (issue #36). A `Scratch` remembers each folder it made and removes them at
`close()`:

- `default()`: a fresh folder in the temp dir (`$TMPDIR`, which `python -m benchmarks`
  points under its `--out`) for a benchmark's files when the user named no directory.
  Nothing but the benchmark writes there, so it goes with everything in it.
- `makedirs(path)`: the folders missing on the way to a directory the user named. These go
  only when empty: a file of the user's, or a `--json` written there, is never deleted.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Optional

__all__ = ["Scratch"]


class Scratch:
    """Folders made for one benchmark run; `close()` removes them (idempotent)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._own: Optional[str] = None
        self._made: list[str] = []  # parents before children

    def default(self) -> str:
        """This run's own folder in the temp dir, made on first use."""
        if self._own is None:
            self._own = tempfile.mkdtemp(prefix=self.prefix)
        return self._own

    def makedirs(self, path: str) -> str:
        """`os.makedirs(path, exist_ok=True)`, remembering each folder it created."""
        missing = []
        p = os.path.abspath(path)
        while not os.path.isdir(p):
            missing.append(p)
            p = os.path.dirname(p)
        os.makedirs(path, exist_ok=True)
        self._made += reversed(missing)
        return path

    def close(self) -> None:
        for p in reversed(self._made):  # children first, so a parent can empty
            try:
                os.rmdir(p)
            except OSError:
                pass  # not empty (the user's files, or a peer's left on purpose) or already gone
        self._made.clear()
        if self._own is not None:
            shutil.rmtree(self._own, ignore_errors=True)
            self._own = None
