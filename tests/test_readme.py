"""README's quick start runs as printed: each ```python block of its "Quick start" section,
as a new user pastes it into a file, in its own process on a CPU-only install.

Other sections' python blocks are fragments (a DeepSpeed script's and a Trainer script's
lines, naming the reader's own model and data); the quick start's are whole programs, and
this test is what keeps them so. A negative
control (a block using an undefined name, as the old quick start's `MyTransformer` did)
shows that the harness sees a failing block.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from tests.scripts import run_python

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")


def section(markdown: str, title: str) -> str:
    """The text of the `## title` section, up to the next `## ` heading."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", markdown, re.M | re.S)
    assert match, f"README has no '## {title}' section"
    return match.group(1)


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, re.M | re.S)


def run_block(code: str, cwd, timeout_s: float = 120) -> subprocess.CompletedProcess:
    script = cwd / "block.py"
    script.write_text(code)
    # As a user runs it: `python block.py` in an empty directory, offload importable (the
    # checkout on PYTHONPATH stands in for the install); one thread, as the suite's tests.
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(k, None)
    return run_python([str(script)], timeout=timeout_s, cwd=str(cwd), env=env)  # tests/scripts.py


with open(README) as _f:
    QUICK_START = python_blocks(section(_f.read(), "Quick start"))


def test_quick_start_has_code_blocks():
    assert QUICK_START, "README's Quick start has no ```python block"


@pytest.mark.parametrize("index", range(len(QUICK_START)))
def test_quick_start_block_runs_as_printed(index, tmp_path):
    out = run_block(QUICK_START[index], tmp_path)
    assert out.returncode == 0, (f"README quick start block {index} failed:\n{QUICK_START[index]}"
                                 f"\nstdout:\n{out.stdout}\nstderr:\n{out.stderr}")
    if "full_state_dict" in QUICK_START[index]:
        assert (tmp_path / "model.pt").stat().st_size > 0  # the consolidated weights it saves
    losses = [float(m) for m in re.findall(r"^loss ([0-9.]+)$", out.stdout, re.M)]
    assert all(0 < l < 20 for l in losses), out.stdout


def test_harness_sees_a_failing_block(tmp_path):
    # Negative control: the old quick start's first line, undefined name and all.
    out = run_block("model = MyTransformer()\n", tmp_path, timeout_s=30)
    assert out.returncode != 0 and "NameError" in out.stderr
