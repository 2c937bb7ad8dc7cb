"""`tools/gpu_check.sh --dry-run`: the GPU machine's one command runs every phase here, on the
CPU at tiny sizes, so a GPU window is never spent finding out that the script is broken."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(tmp_path, *args: str) -> tuple[int, str, dict]:
    env = {**os.environ, "PYTHON": sys.executable, "TMPDIR": str(tmp_path)}
    env.pop("OUT", None)
    out = tmp_path / "out"
    p = subprocess.run([os.path.join(ROOT, "tools", "gpu_check.sh"), "--dry-run", "--out", str(out), *args],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    with open(out / "gpu_check.json") as f:
        return p.returncode, p.stdout + p.stderr, json.load(f)


def test_dry_run_runs_every_phase(tmp_path):
    rc, text, res = _run(tmp_path)
    assert rc == 0, text[-4000:]
    phases = res["phases"]
    assert list(phases) == ["build", "env", "cuda_tests", "races", "practicality", "scale", "sanitizer"]
    assert all(p["ok"] for p in phases.values()), phases
    # the cuda tests were collected (and skipped here), not silently absent
    assert phases["cuda_tests"]["skipped"] >= 10 and phases["races"]["skipped"] >= 3
    rows = phases["practicality"]["data"]["contenders"]
    for name in ("torch", "offload_device_cpu", "offload_cpu_cpu", "offload_nvme_cpu", "offload_device_cpu_worker_on",
                 "offload_device_cpu_worker_off", "torch_gas4", "offload_device_cpu_worker_on_gas4"):
        assert rows[name]["step_ms"] > 0, name
    # 4 micro-batches per step are measured against plain PyTorch with as many
    assert rows["offload_device_cpu_worker_on_gas4"]["gas"] == rows["torch_gas4"]["gas"] == 4
    assert rows["offload_device_cpu_worker_on_gas4"]["practicality"] > 0
    for name in ("offload_device_cpu", "offload_cpu_cpu", "offload_nvme_cpu"):
        assert 0 < rows[name]["practicality"], name
        assert isinstance(rows[name]["planner"], dict), rows[name]["planner"]
        assert "stall_pct" in rows[name]
    scale = phases["scale"]["data"]["contenders"]
    assert scale["model_tflops"] > 0 and 0 < scale["of_matmul"]
    assert "practicality" in res["table"] and "FAILED" not in res["table"]
    assert (tmp_path / "out" / "gpu_check.log").stat().st_size > 0


def test_a_failing_phase_fails_the_run(tmp_path):
    """Negative control: a contender that cannot be built fails its phase and the exit code."""
    rc, text, res = _run(tmp_path, "--phases", "practicality", "--tiers", "disk/cpu")
    assert rc == 1, text[-2000:]
    assert not res["phases"]["practicality"]["ok"]
    assert "offload_disk_cpu" in res["phases"]["practicality"]["data"]["failed"]
    assert "FAILED" in res["table"]
