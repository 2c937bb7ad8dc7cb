"""The type checker over offload/ (issue #32): `python -m mypy` (mypy.ini) passes.

mypy was picked over pyright because it installs from PyPI as a Python package (pyright
needs Node.js, which a fresh CI machine with only Python lacks) and reads torch's inline
types as they are. `check_untyped_defs` makes it look inside every function, so an attribute
read on an object of a known type that lacks it fails — the class of bug that silently
broke the exit hook (`getattr(engine, "prefetcher", None)` after the attribute moved): the
negative control below writes that read against the exit path's `Drains` Protocol and
asserts mypy rejects it.
"""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def mypy(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mypy", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


def test_mypy_passes_over_offload():
    out = mypy()
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]


def test_mypy_rejects_an_attribute_the_type_lacks(tmp_path):
    snippet = (
        "from offload.runtime.lifecycle import Drains\n"
        "def at_exit(engine: Drains) -> None:\n"
        "    engine.drain()\n"
        "    engine.prefetcher.drop()\n"  # the attribute that moved: must be an error
    )
    probe = tmp_path / "exit_probe.py"
    probe.write_text(snippet)
    out = mypy(str(probe))
    assert out.returncode == 1 and '"Drains" has no attribute "prefetcher"' in out.stdout, out.stdout + out.stderr
