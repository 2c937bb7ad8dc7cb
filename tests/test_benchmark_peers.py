"""The benchmark suite and its peers' builds ([Note: peer builds] in benchmarks/peer_ops.py):
an op that is not built is announced before it builds, or (under --quick) its peer is
skipped with the reason; a build lock without a built op drops the peer instead of hanging
on it, and the runner clears such locks in its own extensions folder under --out; a timeout
kills the benchmark and what it started; report.md and suite.json are written after each
benchmark; bench_train's rows are reported as its console prints them (a step table, a
disk-floor table), without columns no row fills.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import benchmarks.__main__ as runner
from benchmarks import _report, peer_ops
from tests.scripts import run_python

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def ext_dir(tmp_path, monkeypatch):
    root = tmp_path / "torch_extensions"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(root))
    monkeypatch.delenv(peer_ops.SKIP_ENV, raising=False)
    monkeypatch.setattr(peer_ops, "_prebuilt", lambda name: False)
    return root


def test_an_op_not_built_is_announced_before_it_builds(ext_dir, capsys):
    assert peer_ops.prepare("cpu_adam") is None
    said = capsys.readouterr().out
    assert "building DeepSpeed's CPU Adam op into" in said and "first run only, several minutes" in said
    assert str(ext_dir / "cpu_adam") in said


def test_under_quick_an_op_not_built_skips_its_peer_with_the_reason(ext_dir, monkeypatch, capsys):
    monkeypatch.setenv(peer_ops.SKIP_ENV, "skip")
    why = peer_ops.prepare("cpu_adam")
    assert why and "not built yet" in why and "skipped under --quick" in why and "--build-peers" in why
    assert capsys.readouterr().out == ""  # nothing announced: nothing is built


def test_a_built_op_is_used_as_it_is(ext_dir, monkeypatch, capsys):
    monkeypatch.setenv(peer_ops.SKIP_ENV, "skip")
    (ext_dir / "cpu_adam").mkdir(parents=True)
    (ext_dir / "cpu_adam" / "cpu_adam.so").write_bytes(b"")
    assert peer_ops.prepare("cpu_adam") is None and capsys.readouterr().out == ""
    # negative control: another op in the same folder is still not built
    assert peer_ops.prepare("cpu_lion") is not None


def test_a_peer_not_ready_is_reported_by_its_reason_alone():
    from benchmarks._common import peer_reason

    assert peer_reason(peer_ops.PeerNotReady("DeepSpeed's CPU Adam op not built yet")) == (
        "DeepSpeed's CPU Adam op not built yet")
    assert peer_reason(RuntimeError("boom")) == "RuntimeError: boom"  # others keep their type


def test_a_build_lock_drops_the_peer_naming_the_lock_instead_of_waiting_on_it(ext_dir):
    lock = ext_dir / "cpu_adam" / "lock"
    lock.parent.mkdir(parents=True)
    lock.write_text("")
    why = peer_ops.prepare("cpu_adam")
    assert why and str(lock) in why and "delete it" in why
    assert peer_ops.stale_locks(ext_dir) == [lock]


def test_the_default_extensions_folder_is_torchs(monkeypatch):
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    from torch.utils.cpp_extension import get_default_build_root

    assert str(peer_ops.extensions_root()).startswith(get_default_build_root())


def _suite(out: Path, *args: str, timeout_s: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TORCH_EXTENSIONS_DIR", None)
    return run_python(["-m", "benchmarks", "--out", str(out), *args], cwd=str(ROOT), timeout=timeout_s, env=env)


@pytest.mark.skipif(sys.modules.get("deepspeed") is None and
                    __import__("importlib").util.find_spec("deepspeed") is None, reason="deepspeed not installed")
def test_quick_skips_deepspeed_until_built_under_out_and_clears_a_stale_lock(tmp_path):
    # A fresh --out: DeepSpeed's CPU Adam is not built in its private folder, so --quick
    # skips it with the reason (no build, no wait); a lock a killed run left there is removed
    # first. The runner points TORCH_EXTENSIONS_DIR under --out (nothing built elsewhere).
    out = tmp_path / "out"
    lock = out / "torch_extensions" / "cpu_adam" / "lock"
    lock.parent.mkdir(parents=True)
    lock.write_text("")
    t0 = time.perf_counter()
    done = _suite(out, "--quick", "--only", "bench_adam", "--extra", "--sizes", "1", "--threads", "1",
                  "--repeats", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"removing a stale build lock {lock}" in done.stdout and not lock.exists()
    report = (out / "report.md").read_text()
    assert "DeepSpeedCPUAdam" in report and "not built yet" in report and "skipped under --quick" in report
    assert not list((out / "torch_extensions").rglob("*.so"))  # nothing was built
    assert time.perf_counter() - t0 < 200


def test_a_timeout_kills_the_benchmark_and_what_it_started(tmp_path):
    # The benchmark starts a child (as a peer's build starts its compiler) and hangs.
    pid_file = tmp_path / "child.pid"
    code = ("import subprocess, sys, time\n"
            f"c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
            f"open({str(pid_file)!r}, 'w').write(str(c.pid))\n"
            "time.sleep(120)\n")
    t0 = time.perf_counter()
    log, rc = runner._run([sys.executable, "-c", code], ROOT, 3.0, "hang", dict(os.environ))
    assert rc is None and "killed after 3 s" in log and time.perf_counter() - t0 < 60
    child = int(pid_file.read_text())
    for _ in range(50):  # reaped by init once killed
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(child, 9)  # ours: started by the command above
        pytest.fail(f"the benchmark's child {child} outlived the timeout")


def test_report_and_suite_json_are_written_after_each_benchmark(tmp_path, monkeypatch):
    # The second benchmark is killed mid-run (the whole suite is, as a user's Ctrl-C): what
    # the first one measured is already in report.md and suite.json.
    out = tmp_path / "out"
    calls = []

    def fake_run(cmd, cwd, timeout_s, name, env):
        calls.append(name)
        if name == "bench_adam":
            assert (out / "report.md").is_file()  # bench_io's report is there before bench_adam runs
            raise KeyboardInterrupt
        json_path = Path(cmd[cmd.index("--json") + 1])
        json_path.write_text(json.dumps({"rows": [{"case": "1M", "offload GB/s": 1.5}]}))
        return "ok\n", 0

    monkeypatch.setattr(runner, "_run", fake_run)
    with pytest.raises(KeyboardInterrupt):
        runner.main(["--out", str(out), "--quick", "--only", "bench_io", "bench_adam", "bench_train"])
    assert calls == ["bench_io", "bench_adam"]
    report = (out / "report.md").read_text()
    assert "## bench_io" in report and "| 1M | 1.5 |" in report
    assert "Not run yet: bench_adam, bench_train" in report
    suite = json.loads((out / "suite.json").read_text())
    assert list(suite["results"]) == ["bench_io"] and suite["pending"] == ["bench_adam", "bench_train"]
    assert not list(out.glob(".*.tmp"))


def test_the_quick_timeout_fits_quicks_promise():
    # --quick is documented at a few minutes in all; a benchmark's limit is minutes, not ten.
    assert runner.TIMEOUT_QUICK_S <= 300 < runner.TIMEOUT_FULL_S


def test_bench_train_is_reported_as_its_console_prints_it(tmp_path):
    nvme_cols = ["contender", "step_ms", "io_source", "read_MiB", "floor_ms"]
    step_cols = ["contender", "step_ms", "host_MiB", "stall_ms", "vs_engine", "vs_deepspeed"]
    rows = [{"contender": "engine", "step_ms": 10.0, "host_MiB": 5.0, "stall_ms": None, "vs_engine": 1.0,
             "vs_deepspeed": float("nan"), "io_source": None, "read_MiB": None, "floor_ms": None},
            {"contender": "engine_nvme_all", "step_ms": 30.0, "host_MiB": 1.0, "stall_ms": None, "vs_engine": 0.33,
             "vs_deepspeed": float("nan"), "io_source": "io_stats", "read_MiB": 12.0, "floor_ms": 20.0}]
    result = {"rows": rows, "peers_missing": {"deepspeed": "deepspeed not installed (pip install deepspeed)"},
              "ratio_peers": {"vs_engine": "engine", "vs_deepspeed": "deepspeed"},
              "tables": [{"title": "Training step", "columns": step_cols},
                         {"title": "The step at the disk's speed", "columns": nvme_cols, "rows_with": "io_source"}]}
    text, _ = _report.render({"quick": True, "results": {"bench_train": result}, "failures": {}}, tmp_path)
    headers = [line for line in text.splitlines() if line.startswith("| contender")]
    # the step table without the columns no row fills (stall_ms, vs_deepspeed: its peer did not run)
    assert headers == ["| contender | step_ms | host_MiB | vs_engine |",
                       "| contender | step_ms | io_source | read_MiB | floor_ms |"], text
    floor = text[text.index("**The step at the disk's speed**"):]
    assert "| engine_nvme_all |" in floor and "| engine |" not in floor  # only the rows with NVMe traffic
    assert text.count("deepspeed not installed") == 1
    # negative control: without "tables", one table of every column, as before
    del result["tables"]
    text, _ = _report.render({"quick": True, "results": {"bench_train": result}, "failures": {}}, tmp_path)
    assert len([line for line in text.splitlines() if line.startswith("| contender")]) == 1
    assert "| floor_ms |" in text and "| stall_ms |" in text
