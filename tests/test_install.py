"""The two installs: a training install without the test tools and the comparison peers
(requirements/cpu-train.txt), and the suite's (requirements/cpu.txt, what CI installs),
each resolved through pyproject's extras; and offload itself never imports a peer.

A negative control runs a training file that names the peers' extra through the same check.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEERS_AND_TOOLS = {"deepspeed", "mypy", "hypothesis", "pytest"}


def extras() -> dict[str, list[str]]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["optional-dependencies"]


def package_name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower()


def installed_by(requirements: str) -> tuple[set[str], set[str]]:
    """(the extras named by the file's `-e .[...]` / `.[...]` lines, the packages they add)."""
    named: set[str] = set()
    for line in requirements.splitlines():
        m = re.match(r"^(?:-e\s+)?\.\[([^\]]*)\]\s*$", line.strip())
        if m:
            named |= {e.strip() for e in m.group(1).split(",") if e.strip()}
    table = extras()
    unknown = named - table.keys()
    assert not unknown, f"extras not in pyproject.toml: {sorted(unknown)}"
    return named, {package_name(r) for e in named for r in table[e]}


def test_the_training_install_has_no_peers_and_no_test_tools():
    named, packages = installed_by((ROOT / "requirements/cpu-train.txt").read_text())
    assert "hf" in named
    assert not packages & PEERS_AND_TOOLS, sorted(packages & PEERS_AND_TOOLS)


def test_the_suite_install_has_every_peer_the_tests_compare_with():
    named, packages = installed_by((ROOT / "requirements/cpu.txt").read_text())
    assert {"test", "hf", "peers", "bench"} <= named
    assert PEERS_AND_TOOLS | {"transformers", "matplotlib", "pytest-random-order"} <= packages


def test_both_installs_pin_the_same_torch():
    pins = [re.findall(r"^torch==\S+$", (ROOT / f"requirements/{name}").read_text(), re.M)
            for name in ("cpu.txt", "cpu-train.txt")]
    assert pins[0] == pins[1] and len(pins[0]) == 1, pins


def test_a_training_file_naming_the_peers_is_caught(tmp_path):
    # Negative control: the check above sees a peer brought in by an extra.
    _, packages = installed_by("torch==2.13.0\n-e .[hf,peers]\n")
    assert "deepspeed" in packages & PEERS_AND_TOOLS


def test_the_docs_name_both_installs_and_what_the_aio_peer_needs():
    readme = (ROOT / "README.md").read_text()
    install = (ROOT / "docs/install.md").read_text()
    for text in (readme, install):
        assert "pip install -r requirements/cpu-train.txt" in text
        assert "pip install -r requirements/cpu.txt" in text
    assert "libaio-dev" in install


def test_importing_offload_imports_no_peer():
    # A fresh interpreter (the suite's own process may have imported DeepSpeed already).
    code = ("import importlib.util, sys, offload, offload.compat.deepspeed, offload.integrations.hf\n"
            "if importlib.util.find_spec('transformers'): import offload.integrations.hf.trainer\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('deepspeed', 'mypy', 'hypothesis'))\n"
            "print(bad); sys.exit(1 if bad else 0)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
