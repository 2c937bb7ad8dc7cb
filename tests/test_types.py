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


# [Note: mypy beside the suite] Over offload/ and the torch it reads, mypy without its cache
# (a fresh clone: CI) is one process on one core for ~30 s, while most of the suite leaves
# the second of two cores idle. So when this test is collected, tests/conftest.py starts
# mypy at the end of collection, and the test collects its result: the same command, the
# same check, run beside the other tests instead of in series with them.
_BACKGROUND: dict[str, subprocess.Popen] = {}


def start_in_background() -> None:
    if "mypy" not in _BACKGROUND:
        _BACKGROUND["mypy"] = subprocess.Popen([sys.executable, "-m", "mypy"], cwd=ROOT, text=True,
                                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _whole_package() -> subprocess.CompletedProcess:
    """The run over offload/: the one started beside the suite, else one now."""
    proc = _BACKGROUND.pop("mypy", None)
    if proc is None:
        return mypy()
    try:
        out, err = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        proc.kill()  # ours: started by start_in_background
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_mypy_passes_over_offload():
    out = _whole_package()
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]


def test_mypy_rejects_an_attribute_the_type_lacks(tmp_path):
    if "mypy" in _BACKGROUND:  # one mypy at a time over the cache
        _whole_package()
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
