"""The folders of offload/ are its layers: imports run downward only, without circles or
cross-file private names (tools/import_graph.py), and each layer imports without loading
any layer above it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import import_graph  # noqa: E402


def test_imports_run_downward_without_circles_or_private_names():
    mods = import_graph.scan()
    assert len(mods) > 40, sorted(mods)  # the scan found the package
    bad = import_graph.violations(mods)
    assert not bad, "\n".join(bad)


def test_the_check_catches_an_upward_import_a_circle_and_a_private_name(tmp_path):
    # Negative control: a small tree with each fault, scanned by the same code.
    pkg = tmp_path / "offload"
    for d in ("storage", "runtime"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "storage" / "a.py").write_text("def f():\n    from offload.runtime.b import g\n")
    (pkg / "runtime" / "b.py").write_text("from offload.runtime.c import _hidden\n")
    (pkg / "runtime" / "c.py").write_text("import offload.runtime.b\n_hidden = 1\n")
    bad = import_graph.violations(import_graph.scan(str(tmp_path)))
    text = "\n".join(bad)
    assert "a layer above it" in text and "offload.storage.a" in text, text
    assert "import circle" in text and "offload.runtime.b" in text, text
    assert "private name '_hidden'" in text, text


def test_no_file_in_offload_is_over_600_lines():
    mods = import_graph.scan()
    big = {m.name: m.lines for m in mods.values() if m.lines > 600}
    assert not big, f"split these by job (docs/architecture.md): {big}"


_PROBE = """
import importlib, json, sys
sys.path.insert(0, {tools!r})
import import_graph
layer = {layer}
mods = sorted(n for n in import_graph.scan() if import_graph.layer_of(n) == layer)
for n in mods:
    if n != "offload":
        importlib.import_module(n)
loaded = [m for m in sys.modules if m.startswith("offload.")]
above = sorted(m for m in loaded if (import_graph.layer_of(m) or 0) > layer)
print(json.dumps({{"modules": mods, "above": above}}))
"""


@pytest.mark.parametrize("layer", [name for name, _ in import_graph.LAYERS if name not in ("api", "compat", "integrations")])
def test_each_layer_imports_without_the_layers_above(layer):
    index = [name for name, _ in import_graph.LAYERS].index(layer)
    code = _PROBE.format(tools=os.path.join(ROOT, "tools"), layer=index)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["modules"] or layer == "integrations"
    assert not out["above"], f"importing the {layer} layer loaded {out['above']}"
