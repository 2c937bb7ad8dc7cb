"""The benchmark suite runner (`python -m benchmarks`), end to end on one small benchmark.

What each pins: the runner runs a benchmark as its own process and writes report.md (the
table), suite.json and the PNG plot (or says plots were skipped when matplotlib is missing:
never a crash); a benchmark that fails is reported by name with its reason and the exit
status says so; a plot that cannot be drawn costs the report its picture, not its tables.
Issue #36: every plot's legend lies outside its data, the checkpoint plot draws the copy an
NVMe save is judged against, a peer that did not run is named once per table (not in every
cell), and neither the suite nor bench_train leaves anything in the temp dir.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from benchmarks import _report
from tests.scripts import run_python

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def suite(out, *args: str, timeout_s: float = 120, env=None) -> subprocess.CompletedProcess:
    # a process of its own, forked from the suite's preloaded server (tests/scripts.py)
    return run_python(["-m", "benchmarks", "--out", str(out), *args], cwd=ROOT, timeout=timeout_s,
                      env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def test_suite_runs_bench_io_end_to_end_and_writes_report_json_and_plot(tmp_path):
    # 16 MiB file, two block sizes, one round, no DeepSpeed (its JIT build alone takes
    # seconds): the whole path (subprocess, JSON, report, plot) in a few seconds.
    # TMPDIR is a fresh folder, to see what the run leaves in the temp dir (issue #36).
    tmp_path, tmp = tmp_path / "out", tmp_path / "tmp"
    tmp.mkdir()
    out = suite(tmp_path, "--only", "bench_io", "--extra", "--size", "16M", "--block-sizes",
                "256K,1M", "--threads", "1", "--repeats", "1", "--no-deepspeed", env={"TMPDIR": str(tmp)})
    assert out.returncode == 0, out.stdout + out.stderr
    report = (tmp_path / "report.md").read_text()
    assert "## bench_io" in report and "| case | op | block |" in report, report
    rows = [l for l in report.splitlines() if l.startswith("| ") and (" write |" in l or " read |" in l)]
    assert len(rows) == 4, report  # 2 block sizes x (write, read)
    data = json.loads((tmp_path / "suite.json").read_text())
    assert data["failures"] == {} and len(data["results"]["bench_io"]["rows"]) == 4
    assert data["results"]["bench_io"]["rows"][0]["offload GB/s"] > 0
    # issue 22: the ratio legend, the peers that did not run with why, the load average
    assert "ratios: every 'vs X' column is X's time / ours" in report and ">1 means offload is faster" in report
    assert "Peers missing:" in report and "deepspeed: skipped (--no-deepspeed)" in report
    assert "| nan" not in report and "nanx" not in report and "n/a when X did not run" in report
    # issue #36: each peer that did not run is named once, under the table, not in every cell
    missing = data["results"]["bench_io"]["peers_missing"]
    assert missing and all(report.count(why) == 1 for why in missing.values()), report
    # issue #36: the test file lived under --out (the runner's TMPDIR), and nothing is left
    # in the temp dir nor, besides the results, in --out
    assert data["results"]["bench_io"]["machine"]["disk_path"].startswith(str(tmp_path) + os.sep)
    assert list(tmp.iterdir()) == []
    assert {p.name for p in tmp_path.iterdir()} <= {"bench_io.json", "bench_io.log", "bench_io.png",
                                                     "report.md", "suite.json"}
    load = data["results"]["bench_io"]["_load"]
    assert load["before"]["cores"] >= 1 and len(load["after"]["load_avg"]) == 3
    assert "Load average (1, 5, 15 min)" in report
    assert "[progress] io write 256K/qd32/t1 1/1" in out.stdout  # plain lines: stdout is a pipe
    if HAS_MATPLOTLIB:
        png = tmp_path / "bench_io.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert "](bench_io.png)" in report and list(data["plots"]) == ["bench_io.png"]
    else:
        assert "Plots skipped: matplotlib is not installed" in report


def test_suite_reports_a_failing_benchmark_by_name_and_exits_nonzero(tmp_path):
    out = suite(tmp_path, "--only", "bench_io", "--extra", "--no-such-flag")
    assert out.returncode == 1
    report = (tmp_path / "report.md").read_text()
    assert "## bench_io: failed" in report and "no-such-flag" in report
    assert "bench_io" in json.loads((tmp_path / "suite.json").read_text())["failures"]


def test_suite_rejects_an_unknown_benchmark_name(tmp_path):
    out = suite(tmp_path, "--only", "bench_nothing")
    assert out.returncode == 2 and "no such benchmark: bench_nothing" in out.stderr


ROWS = [{"tier": "cpu", "op": "save", "offload GB/s": 0.5, "disk GB/s": 0.8, "torch GB/s": 0.4},
        {"tier": "cpu", "op": "load", "offload GB/s": 1.1, "disk GB/s": 3.0, "torch GB/s": 0.5}]


def test_report_without_matplotlib_says_plots_were_skipped(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    suite_data = {"quick": True, "results": {"bench_checkpoint": {"rows": ROWS}}, "failures": {}}
    text, plots = _report.render(suite_data, tmp_path)
    assert plots == {} and not list(tmp_path.glob("*.png"))
    assert "Plots skipped: matplotlib is not installed (pip install 'offload[bench]')" in text
    assert "| cpu | load | 1.1 | 3 | 0.5 |" in text  # the table is there all the same


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="matplotlib is not installed (pip install 'offload[bench]')")
def test_report_keeps_its_tables_when_a_plot_fails(tmp_path):
    bad = [{"params_M": 10, "contender": "ours fp32", "Mparam/s": 1.0}]  # no "threads" column
    suite_data = {"quick": True, "results": {"bench_adam": {"rows": bad},
                                             "bench_checkpoint": {"rows": ROWS}}, "failures": {}}
    text, plots = _report.render(suite_data, tmp_path)
    assert "Plot skipped: KeyError" in text and "| 10 | ours fp32 | 1 |" in text
    assert list(plots) == ["bench_checkpoint.png"] and (tmp_path / "bench_checkpoint.png").is_file()


def test_report_warns_when_busy_and_says_why_a_ratio_is_missing(tmp_path):
    from benchmarks._common import busy

    quiet = {"load_avg": [0.4, 0.3, 0.2], "cores": 2}
    loaded = {"load_avg": [1.5, 1.0, 0.5], "cores": 2}
    assert not busy(quiet) and busy(loaded)  # the threshold: 1-min load > 0.5 x cores
    rows = [{"contender": "ours fp32", "ms": 1.0, "vs DeepSpeed": float("nan"), "vs torch fused": 1.2}]
    result = {"rows": rows, "peers_missing": {"DeepSpeedCPUAdam": "deepspeed not installed (pip install deepspeed)"},
              "ratio_peers": {"vs DeepSpeed": "DeepSpeedCPUAdam", "vs torch fused": "torch fused"},
              "_load": {"before": loaded, "after": quiet, "busy_before": True}}
    text, _ = _report.render({"quick": True, "results": {"bench_x": result}, "failures": {}}, tmp_path)
    assert "**Warning: the machine was busy** before bench_x" in text
    assert "| bench_x | 1.50 / 1.00 / 0.50 | 0.40 / 0.30 / 0.20 | yes |" in text
    assert "| ours fp32 | 1 | n/a | 1.2 |" in text
    assert "Peers missing: DeepSpeedCPUAdam: deepspeed not installed" in text
    quiet_result = {**result, "_load": {"before": quiet, "after": quiet, "busy_before": False}}
    text, _ = _report.render({"quick": True, "results": {"bench_x": quiet_result}, "failures": {}}, tmp_path)
    assert "Warning" not in text  # the negative control


def test_report_names_a_peer_that_did_not_run_once_per_table(tmp_path):
    # issue #36: bench_train's table repeated "n/a (deepspeed not installed ...)" in every
    # cell of every column whose peer did not run. Now the cells read "n/a" and one line
    # under the table names each missing peer once, peers with the same reason together.
    ds = "deepspeed not installed (pip install deepspeed)"
    names = ["torch", "engine", "engine_stage2", "engine_nvme_opt", "engine_nvme_all"]
    ratio_peers = {"vs_engine": "engine", "vs_torch": "torch", "vs_fsdp2": "fsdp2", "vs_deepspeed": "deepspeed",
                   "vs_deepspeed_nvme": "deepspeed_nvme", "vs_engine_nvme_all_nopf": "engine_nvme_all_nopf"}
    rows = [{"contender": n, "step_ms": 100.0 + i, "vs_engine": 1.0, "vs_torch": 1.0, "vs_fsdp2": float("nan"),
             "vs_deepspeed": float("nan"), "vs_deepspeed_nvme": float("nan"), "vs_engine_nvme_all_nopf": float("nan")}
            for i, n in enumerate(names)]
    missing = {"fsdp2": "skipped (--no-fsdp2)", "deepspeed": ds, "deepspeed_stage2": ds, "deepspeed_nvme": ds,
               "engine_nvme_all_nopf": "skipped (no --compare-prefetch)"}
    result = {"rows": rows, "peers_missing": missing, "ratio_peers": ratio_peers}
    text, _ = _report.render({"quick": True, "results": {"bench_train": result}, "failures": {}}, tmp_path)
    assert text.count(ds) == 1 and text.count("skipped (--no-fsdp2)") == 1, text
    assert "deepspeed, deepspeed_stage2, deepspeed_nvme: " + ds in text
    table = [line for line in text.splitlines() if line.startswith("| engine_nvme_opt |")]
    assert table == ["| engine_nvme_opt | 103 | 1 | 1 | n/a | n/a | n/a | n/a |"]
    # one line, right under the table: its last row, a blank line, then that line
    lines = text.splitlines()
    under = [i for i, line in enumerate(lines) if line.startswith("Peers missing")]
    assert len(under) == 1 and lines[under[0] - 2].startswith("| engine_nvme_all |") and lines[under[0] - 1] == ""


CKPT_ROWS = ROWS + [
    {"tier": "nvme", "op": "save", "offload GB/s": 0.4, "disk GB/s": 0.8, "copy GB/s": 0.5, "torch GB/s": 0.3},
    {"tier": "nvme", "op": "load", "offload GB/s": 1.0, "disk GB/s": 3.0, "copy GB/s": None, "torch GB/s": 0.5},
]
# One result per plot the report draws, shaped as the benchmarks write them.
PLOTTED = {
    "bench_io": {"rows": [{"case": f"{b}/qd32/t2", "op": op, "block": b, "qd": 32, "threads": 2,
                           "offload GB/s": v, "fio GB/s": v * 0.9, "deepspeed GB/s": v * 0.8}
                          for b, k in (("256K", 0.8), ("1M", 1.0), ("4M", 0.95))
                          for op, v in (("write", 6.0 * k), ("read", 2.8 * k))]},
    "bench_adam": {"rows": [{"params_M": 50, "threads": t, "contender": c, "B/param": b, "Mparam/s": v * t}
                            for t in (1, 2)
                            for c, b, v in (("roofline", 28, 1100), ("ours fp32", 28, 960),
                                            ("ours bf16 moments", 20, 1150), ("torch fused", 28, 1000),
                                            ("DeepSpeedCPUAdam", 28, 1050))]},
    "bench_optimizers": {"rows": [{"params_M": 20, "threads": 2, "contender": c, "B/param": 20, "Mparam/s": v}
                                  for c, v in (("roofline", 1500), ("lion ours fp32", 1400),
                                               ("lion torch foreach", 300), ("adagrad ours fp32", 1350),
                                               ("adagrad torch fused", 900))]},
    "bench_train": {"rows": [{"contender": c, "step_ms": v} for c, v in
                             (("torch", 120.0), ("engine", 130.0), ("engine_nvme_opt", 160.0),
                              ("engine_nvme_all", 190.0))]},
    "bench_checkpoint": {"rows": CKPT_ROWS},
}


def _figures(monkeypatch, tmp_path, results):
    """render() over `results`, keeping each plot's figure open: {benchmark: figure}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made, real_subplots = [], plt.subplots

    def subplots(*args, **kwargs):
        fig, ax = real_subplots(*args, **kwargs)
        made.append(fig)
        return fig, ax

    monkeypatch.setattr(plt, "subplots", subplots)
    monkeypatch.setattr(plt, "close", lambda *args, **kwargs: None)
    text, plots = _report.render({"quick": True, "results": results, "failures": {}}, tmp_path)
    assert "Plot skipped" not in text and list(plots) == [f"{n}.png" for n in results], text
    return dict(zip(results, made))


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="matplotlib is not installed (pip install 'offload[bench]')")
def test_every_plots_legend_lies_outside_its_data(tmp_path, monkeypatch):
    # issue #36: the legends covered lines or bars in three of the five PNGs. Now each sits
    # right of the axes, whole inside the figure (so in the PNG), over no point or bar.
    figs = _figures(monkeypatch, tmp_path, PLOTTED)
    with_legend = set()
    for name, fig in figs.items():
        fig.canvas.draw()
        r = fig.canvas.get_renderer()
        ax = fig.axes[0]
        inside = fig.bbox.frozen()
        title = ax.title.get_window_extent(r)  # narrowed axes must not push the title off the PNG
        assert inside.x0 <= title.x0 and title.x1 <= inside.x1, name
        legend = ax.get_legend()
        if legend is None:
            continue
        with_legend.add(name)
        box = legend.get_window_extent(r)
        assert not box.overlaps(ax.get_window_extent(r)), name  # outside the axes
        assert inside.x0 <= box.x0 and box.x1 <= inside.x1 and inside.y0 <= box.y0 and box.y1 <= inside.y1, name
        for line in ax.get_lines():  # its points and segments, in display coordinates
            pts = line.get_transform().transform(line.get_xydata())
            on = [a + (b - a) * t for a, b in zip(pts[:-1], pts[1:]) for t in np.linspace(0, 1, 50)]
            assert not any(box.contains(x, y) for x, y in [*pts, *on]), (name, line.get_label())
        for patch in ax.patches:
            assert not box.overlaps(patch.get_window_extent(r)), (name, patch)
    assert with_legend == {"bench_io", "bench_adam", "bench_optimizers", "bench_checkpoint"}  # bench_train: none


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="matplotlib is not installed (pip install 'offload[bench]')")
def test_checkpoint_plot_draws_the_copy_an_nvme_save_is_judged_against(tmp_path, monkeypatch):
    # issue #36: bench_checkpoint judges an NVMe-tier save against the disk copy ("vs copy":
    # the swap file read while the checkpoint is written); the plot drew the disk and torch
    # but not that copy. Its bar is drawn where the row has one (the nvme save), and only there.
    ax = _figures(monkeypatch, tmp_path, {"bench_checkpoint": PLOTTED["bench_checkpoint"]})["bench_checkpoint"].axes[0]
    bars = {c.get_label(): [p.get_height() for p in c] for c in ax.containers}
    assert bars["disk copy (nvme save)"] == [0.5]
    assert bars["disk write / read"] == [0.8, 3.0, 0.8, 3.0] and bars["offload"] == [0.5, 1.1, 0.4, 1.0]
    assert "disk copy (nvme save)" in [t.get_text() for t in ax.get_legend().get_texts()]


def test_bench_train_ratio_direction_is_peer_time_over_ours():
    # [Note: ratio direction]: a row twice as fast as the peer reads 2.0, in every benchmark.
    from benchmarks._common import ratio

    ours_s, peer_s = 0.5, 1.0
    assert ratio(peer_s, ours_s) == 2.0  # bench_train: peer's time / ours
    assert ratio(1 / ours_s, 1 / peer_s) == 2.0  # bench_io/adam/checkpoint: our rate / theirs


def test_bench_train_torch_contender_computes_in_the_engines_dtype():
    # issue #30: on a GPU the plain-PyTorch step ran fp32 against the engine's bf16 step.
    # Now it autocasts to --dtype (fp16 with a GradScaler); the CPU keeps fp32 unless bf16.
    from benchmarks.bench_train import torch_precision

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")

    def rule(p):
        return p.device_type, p.dtype, p.grad_scaler

    assert rule(torch_precision("bf16", cuda)) == ("cuda", torch.bfloat16, False)
    assert rule(torch_precision("fp16", cuda)) == ("cuda", torch.float16, True)
    assert rule(torch_precision("fp32", cuda)) == ("cuda", None, False)
    assert rule(torch_precision("bf16", cpu)) == ("cpu", torch.bfloat16, False)
    assert rule(torch_precision("fp16", cpu)) == ("cpu", None, False)  # as before
    assert rule(torch_precision("fp32", cpu)) == ("cpu", None, False)  # the figures in docs/results.md
    assert torch_precision("fp16", cuda).describe() == "float16 autocast on cuda + GradScaler"
    # the forward really runs under it: fp32 weights, bf16 products (and none for fp32)
    lin = torch.nn.Linear(4, 4)
    with torch_precision("bf16", cpu).autocast():
        assert lin(torch.randn(2, 4)).dtype == torch.bfloat16 and lin.weight.dtype == torch.float32
    with torch_precision("fp32", cpu).autocast():
        assert not torch.is_autocast_enabled("cpu") and lin(torch.randn(2, 4)).dtype == torch.float32


def test_suite_runs_bench_optimizers_with_every_native_row_and_its_targets(tmp_path):
    # 50K params, one thread, one round, no DeepSpeed (its JIT builds take a minute): the
    # Lion and Adagrad rows reach the report with their ratios, the peers that did not run
    # say why, and the targets line is printed.
    out = suite(tmp_path, "--only", "bench_optimizers", "--extra", "--sizes", "0.05", "--threads", "1",
                "--repeats", "1", "--no-deepspeed")
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads((tmp_path / "suite.json").read_text())["results"]["bench_optimizers"]
    got = {r["contender"]: r for r in result["rows"]}
    for opt in ("lion", "adagrad"):
        for kind in ("fp32", "bf16 g+out", "bf16 state"):
            row = got[f"{opt} ours {kind}"]
            assert row["Mparam/s"] > 0 and row["vs roofline"] > 0 and row["vs best peer"] > 0
    assert got["lion ours fp32"]["best peer"] == "lion torch foreach"  # DeepSpeed skipped
    assert got["adagrad ours fp32"]["best peer"] in ("adagrad torch foreach", "adagrad torch fused")
    assert result["peers_missing"] == {"DeepSpeedCPULion": "deepspeed: skipped (--no-deepspeed)",
                                       "DeepSpeedCPUAdagrad": "deepspeed: skipped (--no-deepspeed)"}
    assert any("lion" in t and "adagrad" in t and "of roofline" in t for t in result["targets"])
    report = (tmp_path / "report.md").read_text()
    assert "## bench_optimizers" in report and "| lion ours fp32 | 20 |" in report
    if HAS_MATPLOTLIB:
        assert (tmp_path / "bench_optimizers.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _bench_train(tmp_path, name, *args, env=None):
    out = tmp_path / f"{name}.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_train.py"), "--quick", "--no-fsdp2",
           "--no-deepspeed", "--no-lora", "--repeats", "2", "--peak-mb", "64", "--json", str(out), *args]
    # bench_train predicts each contender's step from the machine profile, which it measures and caches
    # when none is cached: the test's own cache folder, never the user's (~/.cache/offload), where a
    # profile measured on a busy test machine would feed the user's later plans and step reports.
    cache = tmp_path / "cache"
    run = run_python(cmd[1:], cwd=ROOT, timeout=300,
                     env={**os.environ, "OMP_NUM_THREADS": "1", "XDG_CACHE_HOME": str(cache), **(env or {})})
    assert run.returncode == 0, run.stdout + run.stderr
    assert "--no-predict" in args or (cache / "offload" / "machine_profile.json").exists()
    return json.loads(out.read_text()), run.stdout


def test_bench_train_reports_the_step_at_the_disks_speed(tmp_path):
    # issue #21: per NVMe row, the bytes read and written per step, the disk's bandwidth
    # measured in the same run, the floor they imply and step / max(floor, in-memory step),
    # every figure recomputable from the others in the JSON.
    data, stdout = _bench_train(tmp_path, "nvme", "--nvme-path", str(tmp_path / "swap"))
    disk = data["disk_peak"]
    assert disk["bytes"] == 64 << 20 and disk["read_GBps"] > 0 and disk["write_GBps"] > 0
    assert disk["overlap"] > 0 and disk["mixed_GBps"] > 0 and isinstance(disk["direct"], bool)
    assert disk["write_fsync_GBps"] > 0 and disk["write_alloc_GBps"] > 0
    assert not list((tmp_path / "swap").glob("peak*.bin"))  # the probe's files are gone
    assert not (tmp_path / "swap").exists()  # issue #36: and the folders the run made, empty
    rows = {r["contender"]: r for r in data["rows"]}
    in_memory = rows["engine"]["step_ms"]
    for name in ("engine_nvme_opt", "engine_nvme_all"):
        r = rows[name]
        assert r["io_source"] == "io_stats" and r["read_MiB"] > 0 and r["write_MiB"] > 0
        assert r["disk_read_GBps"] == disk["read_GBps"] and r["disk_write_GBps"] == disk["write_GBps"]
        rd = r["read_MiB"] * (1 << 20) / (disk["read_GBps"] * 1e9) * 1e3
        wr = r["write_MiB"] * (1 << 20) / (disk["write_GBps"] * 1e9) * 1e3
        assert r["floor_ms"] == pytest.approx(rd + wr, rel=1e-9)
        assert r["floor_max_ms"] == pytest.approx(max(rd, wr), rel=1e-9) and r["floor_max_ms"] < r["floor_ms"]
        assert r["in_memory_ms"] == pytest.approx(in_memory, rel=1e-12)
        assert r["bound_ms"] == pytest.approx(max(rd + wr, in_memory), rel=1e-9)
        assert r["step_over_bound"] == pytest.approx(r["step_ms"] / r["bound_ms"], rel=1e-9)
        # the old column is the sum of the two new ones (both from engine.io_stats())
        assert r["io_MiB_per_step"] == pytest.approx(r["read_MiB"] + r["write_MiB"], rel=1e-9)
    # the optimizer tier on NVMe reads and writes its whole state each step: master + 2 moments
    n_params = data["n_params"]
    assert rows["engine_nvme_opt"]["read_MiB"] * (1 << 20) >= 12 * n_params * 0.99
    for name in ("torch", "engine", "engine_stage2"):  # negative control: no NVMe, no floor
        assert rows[name]["io_source"] is None and rows[name]["floor_ms"] is None
    assert "the step at the disk's speed" in stdout and "step_over_bound" in stdout


def test_bench_train_without_nvme_has_no_disk_probe_and_no_floor(tmp_path):
    data, stdout = _bench_train(tmp_path, "cpu", "--no-nvme")
    assert data["disk_peak"] is None and "step at the disk's speed" not in stdout
    assert all(r["read_MiB"] is None and r["step_over_bound"] is None for r in data["rows"])
    assert {"engine_nvme_opt", "engine_nvme_all"} <= set(data["peers_missing"])


def test_bench_train_leaves_nothing_in_the_temp_dir(tmp_path):
    # issue #36: without --nvme-path it put its swap folders in /tmp/offload-bench-nvme and
    # left them there, empty, with torch's inductor cache folder beside them (made in the temp
    # dir by the first import of torch._dynamo). Now its scratch is one folder in the temp
    # dir, gone at exit: TMPDIR, a fresh folder here, is empty after the run.
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    data, _ = _bench_train(tmp_path, "tmp", env={"TMPDIR": str(tmp)})
    assert {"engine_nvme_opt", "engine_nvme_all"} <= {r["contender"] for r in data["rows"]}  # NVMe ran
    assert data["machine"]["disk_path"].startswith(str(tmp) + os.sep)  # in the temp dir checked
    assert list(tmp.iterdir()) == []


def test_proc_io_counts_odirect_bytes_of_worker_threads(tmp_path):
    # How bench_train counts deepspeed_nvme's bytes (it has no io_stats()): /proc/self/io
    # must see O_DIRECT transfers issued by an I/O library's own threads.
    from benchmarks.disk_floor import proc_io
    from offload.storage.io import AIOHandle, aligned_empty

    if proc_io() is None:
        pytest.skip("/proc/self/io is not readable here")
    nbytes = 16 << 20
    buf = aligned_empty(nbytes)
    buf.fill_(3)
    f = tmp_path / "io.bin"
    with AIOHandle(1 << 20, 8, 2) as h:
        if not h.direct_io(tmp_path):
            pytest.skip(f"{tmp_path} refuses O_DIRECT (tmpfs): no block-layer bytes to count")
        quiet0 = proc_io()
        quiet1 = proc_io()
        a = proc_io()
        h.pwrite(buf, f, 0).wait()
        b = proc_io()
        h.pread(buf, f, 0).wait()
        c = proc_io()
    assert quiet1[0] - quiet0[0] < 1 << 20 and quiet1[1] - quiet0[1] < 1 << 20  # negative control
    assert nbytes <= b[1] - a[1] < 2 * nbytes  # written
    assert nbytes <= c[0] - b[0] < 2 * nbytes  # read


def test_bench_moments_reports_half_the_nvme_bytes_with_8bit_moments(tmp_path):
    """An NVMe-tier step reads and writes master + moments once: 4 + 8, 4 + 4 and 4 + 2.03 B
    per parameter (bias and norm slots pad a little)."""
    from benchmarks.bench_moments import main

    out = main(["--layers", "1", "--d-model", "128", "--vocab", "512", "--batch", "1", "--steps", "2",
                "--nvme-path", str(tmp_path)])
    for moments, want in (("fp32", 12.0), ("bf16", 8.0), ("8bit", 4 + 2 + 8 / 256)):
        assert want <= out[moments]["read"] == out[moments]["written"] < want * 1.1, (moments, out)


def test_the_adam_roofline_is_the_best_loop_and_never_below_a_contender():
    """Issue #35: the limit is the fastest of the roofline loops (each moving Adam's bytes:
    checked here element by element) and of every contender moving the same bytes; a
    contender faster than every loop raises it to its own speed and is named."""
    from benchmarks.bench_adam import huge_empty, roof_of
    from offload._native import C

    names = C.roofline_adam_variants()
    assert names[0] == "plain" and len(names) >= 3
    n, keep = 100_003, []
    for variant in range(len(names)):
        p, g, m, v = (huge_empty(n, torch.float32, keep).copy_(torch.randn(n)) for _ in range(4))
        want = (p + g, m + g, v + g)
        C.roofline_adam(p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), n, 2, variant)
        assert all(torch.equal(a, b) for a, b in zip(want, (p, m, v))), names[variant]
    times = {"roof: plain": 5.0, "roof: prefetch 512": 4.0, "ours fp32": 4.5, "ours bf16 all": 1.0,
             "triad": 0.5}
    assert roof_of(times) == ("prefetch 512", 4.0)  # bf16 rows and the triad move other bytes
    assert roof_of({**times, "torch fused": 3.0}) == ("torch fused", 3.0)


def test_the_per_round_ratio_is_not_fooled_by_the_machines_bandwidth_phases():
    """Five rounds: two on a fast machine, two on a slow one, and one in which the machine
    slowed down between the loop's turn and ours. Within every round but that one, ours runs
    at 0.98 of the best loop. Then the medians pair the loop's fast phase with our slow one,
    and the ratio of medians reads 0.49. The per-round ratio reads 0.98."""
    from benchmarks.bench_adam import BYTES, per_round_vs_limit, roof_of

    fast, slow = 1.0, 2.0
    loop = [fast, fast, fast, slow, slow]
    ours = [t / 0.98 for t in (fast, fast, slow, slow, slow)]  # round 2: the slow phase began
    peer = [t / 0.99 for t in (fast, fast, slow, slow, slow)]
    samples = {"roof: plain": loop, "ours fp32": ours, "torch fused": peer,
               "roofline 8bit": loop, "ours 8bit": [t / 0.5 for t in loop]}
    assert per_round_vs_limit(samples, "ours fp32") == pytest.approx(0.98)
    assert per_round_vs_limit(samples, "ours 8bit") == pytest.approx(0.5 * BYTES["ours 8bit"] / BYTES["roofline 8bit"])
    median = {k: sorted(v)[len(v) // 2] for k, v in samples.items()}
    assert roof_of(median)[1] / median["ours fp32"] == pytest.approx(0.49)
    # a contender faster than every loop in a round is that round's limit
    samples["torch fused"] = [0.5 * t for t in loop]  # twice the loop's speed in each round
    assert per_round_vs_limit(samples, "ours fp32") == pytest.approx(0.49)


def test_adam_node_rate_gives_each_rank_its_share_of_the_cores():
    """Issue #35's node view (benchmarks/bench_adam_node.py): two ranks on this node each run
    their shard with the engine's default budget, the cores divided by LOCAL_WORLD_SIZE."""
    from benchmarks.bench_adam_node import node_rate
    from tests.conftest import forkserver_matches

    assert forkserver_matches(os.environ)  # starts the suite's preloaded server
    cores = len(os.sched_getaffinity(0))
    rate, per_rank = node_rate(200_000, 2, 1, 0, start_method="forkserver")
    assert per_rank == max(1, cores // 2) and rate > 0
    rate, per_rank = node_rate(200_000, 2, 1, cores, start_method="forkserver")
    assert per_rank == cores and rate > 0  # the oversubscribed contender: every core each


def test_ab_builds_alternates_two_builds_and_says_whether_their_bits_agree(tmp_path):
    """benchmarks/ab_builds.py (kernel work): one process per build on the same data; the
    same build twice computes the same bits, a build whose step differs does not."""
    import shutil

    other = tmp_path / "b"
    shutil.copytree(os.path.join(ROOT, "offload"), other / "offload",
                    ignore=shutil.ignore_patterns("__pycache__"))
    path = other / "offload" / "optim" / "adam8bit.py"
    text = path.read_text()
    assert "float(lr)," in text
    path.write_text(text.replace("float(lr),", "float(lr) * 2,", 1))  # B: another step
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for b, same in ((ROOT, True), (str(other), False)):
        run = run_python([os.path.join(ROOT, "benchmarks", "ab_builds.py"), "--a", ROOT, "--b", b,
                          "--params", "0.01", "--rounds", "4", "--warmup", "1"], cwd=ROOT, timeout=120, env=env)
        assert run.returncode == 0, run.stderr[-2000:]
        assert "adam8bit, 0.01M params, 1 thread(s), 3 rounds: A " in run.stdout, run.stdout
        assert run.stdout.rstrip().endswith(f"same bits: {same}"), run.stdout
