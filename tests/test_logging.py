"""What a run tells its user: the initialize line and the step report (offload's logger),
the monitors (CSV, TensorBoard, W&B offline) and DeepSpeed's keys for them
(offload/runtime/report.py, offload/runtime/monitors.py, docs/engine.md "Logging and
monitors").

Every number in a report is compared with what the engine says itself
(`get_global_grad_norm()`, `get_lr()`, `memory_bytes()`, `step_stats()`) or with the losses
the test computed; the negative controls are a run nobody listens to (no record, no loss
read) and rank 1, which says nothing by default.
"""

from __future__ import annotations

import csv
import glob
import importlib.util
import io
import logging
import math
import os
import warnings

import pytest
import torch

import offload
from offload.config import DeepSpeedConfigWarning, load_config
from offload.sizes import format_bytes
from tests.conftest import TinyGPT, gpt_batches, run_distributed

REPORT_LOGGER = "offload.runtime.report"


def _train(config: dict, steps: int, accumulation: int = 1, *, after_step=None):
    """Train the tiny GPT for `steps` optimizer steps; returns the engine (open) and the
    losses of each step's micro-batches."""
    torch.manual_seed(0)
    config = {"gradient_accumulation_steps": accumulation, **config}
    engine = offload.initialize(TinyGPT(), config)
    losses: list[list[float]] = []
    batches = gpt_batches(steps * accumulation)
    for s in range(steps):
        losses.append([])
        for x, y in batches[s * accumulation:(s + 1) * accumulation]:
            loss = engine(x, y)
            losses[-1].append(float(loss.detach()))
            engine.backward(loss)
            engine.step()
        if after_step is not None:
            after_step(engine)
    return engine, losses


def _reports(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == REPORT_LOGGER and hasattr(r, "step_report")]


# -- logging -----------------------------------------------------------------------------------

def test_initialize_logs_one_line_saying_what_was_built(caplog):
    caplog.set_level(logging.INFO, logger="offload")
    config = {"precision": {"dtype": "bf16"}, "prefetch": {"prefetch_bytes": 3 << 20, "keep_bytes": 0}}
    engine, _ = _train(config, steps=0)
    with engine:
        lines = [r.getMessage() for r in caplog.records
                 if r.name == REPORT_LOGGER and r.getMessage().startswith("initialized")]
        assert len(lines) == 1
        line = lines[0]
        memory = engine.memory_bytes()
        params = sum(p.numel() for p in engine.module.parameters())
        assert f"{len(engine.units)} units" in line and "27.84K parameters" in line
        assert params == 27_840  # the tiny GPT: what the line's count must be
        assert "world size 1" in line and "compute bfloat16 on cpu" in line
        assert "parameters on cpu, optimizer state (fp32 master, fp32 moments) on cpu" in line
        assert f"host {format_bytes(memory['host'])}" in line and "nvme 0 bytes" in line
        assert "prefetch 3.00 MiB ahead, keep 0 bytes" in line
        assert "optimizer updates during backward" in line


def _keep_at_ws2(rank: int, world_size: int, keep_bytes: int) -> tuple[int, int]:
    torch.manual_seed(0)
    engine = offload.initialize(TinyGPT(), {"precision": {"dtype": "bf16"}, "prefetch": {"keep_bytes": keep_bytes}})
    with engine:
        model_bytes = sum(0 if u.aliased else u.layout.padded_numel * 2 for u in engine.units)
        return engine.gather.schedule.keep_bytes, model_bytes


def test_a_keep_budget_past_the_model_is_bounded_by_what_the_model_has(caplog):
    # DeepSpeed's stage3_max_reuse_distance: 1e9 is 1e9 elements = 3.73 GiB of fp32: on a
    # 28K-parameter model it was reported (and budgeted for reused full buffers) as 3.73 GiB.
    configured = 4 * 10**9
    for keep, model_bytes in run_distributed(_keep_at_ws2, 2, configured):
        assert 0 < model_bytes < 1 << 20 and keep == model_bytes  # each rank's gathered units, in all
    assert run_distributed(_keep_at_ws2, 2, 1024) == [(1024, model_bytes)] * 2  # within the model: as configured
    # At world size 1 on the CPU every unit is its own full buffer (aliased): nothing is kept,
    # and the initialize line says the configured budget was cut.
    caplog.set_level(logging.INFO, logger="offload")
    engine, _ = _train({"precision": {"dtype": "bf16"}, "prefetch": {"keep_bytes": configured}}, steps=0)
    with engine:
        assert engine.gather.schedule.keep_bytes == 0
        line = next(r.getMessage() for r in caplog.records
                    if r.name == REPORT_LOGGER and r.getMessage().startswith("initialized"))
        assert f"keep 0 bytes (bounded by the model's gathered bytes; configured {format_bytes(configured)})" in line


def test_initialize_line_says_why_the_optimizer_runs_at_the_step(caplog):
    caplog.set_level(logging.INFO, logger="offload")
    engine, _ = _train({"gradient_clipping": 1.0}, steps=0)
    with engine:
        assert any("optimizer step in engine.step() (gradient_clipping needs the global norm"
                   in r.getMessage() for r in caplog.records)


def test_step_report_numbers_are_the_engines(caplog):
    caplog.set_level(logging.INFO, logger="offload")
    seen = []  # what the engine says after each step: norm, lr, memory, step time

    def after_step(engine):
        seen.append((engine.get_global_grad_norm(), engine.get_lr()[0], engine.memory_bytes(),
                     engine.step_stats()))

    config = {"logging": {"steps_per_print": 2, "tokens_per_step": 2 * 8 * 16},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10,
                                                           "warmup_type": "linear"}}}
    engine, losses = _train(config, steps=4, accumulation=2, after_step=after_step)
    with engine:
        reports = _reports(caplog)
        assert [r.step_report["step"] for r in reports] == [2, 4]  # every steps_per_print steps
        for rec in reports:
            r, n = rec.step_report, rec.step_report["step"]
            norm, lr, memory, stats = seen[n - 1]
            step_losses = losses[n - 1]
            assert r["loss"] == pytest.approx(sum(step_losses) / 2, rel=1e-6)  # mean of the micro-batches
            assert r["grad_norm"] == norm and r["lr"] == lr and r["memory"] == memory
            assert r["loss_scale"] == 1.0 and r["global_steps"] == n
            # Step time: the mean of the engine's measure over the two steps since the last report.
            mean_step_s = (seen[n - 2][3]["step_s"] + stats["step_s"]) / 2
            assert r["step_time_s"] == pytest.approx(mean_step_s, rel=1e-9)
            assert r["tokens_per_s"] == pytest.approx(256 / mean_step_s, rel=1e-9)
            assert 0.0 <= r["stall_fraction"] <= 1.0
            text = rec.getMessage()
            assert text.startswith(f"step {n} | loss {r['loss']:.5g} | lr {lr:.3e} | grad norm {norm:.4g}")
            assert f"{r['tokens_per_s']:,.0f} tokens/s" in text
            assert f"memory device {format_bytes(memory['device'])}, host {format_bytes(memory['host'])}" in text
            assert "fetch wait" not in text  # the breakdown is wall_clock_breakdown's
        assert seen[0][1] != seen[3][1]  # the schedule moved the lr: the report followed it
        assert engine.reporter.last == reports[-1].step_report


def test_wall_clock_breakdown_adds_the_stall_parts(caplog):
    caplog.set_level(logging.INFO, logger="offload")
    engine, _ = _train({"logging": {"steps_per_print": 1, "wall_clock_breakdown": True}}, steps=1)
    with engine:
        (rec,) = _reports(caplog)
        stats = engine.step_stats()
        assert rec.step_report["collective_s"] == stats["collective_s"]
        assert rec.step_report["optimizer_s"] == stats["optimizer_s"]
        assert f"collectives {stats['collective_s']:.3f} s, optimizer {stats['optimizer_s']:.3f} s" in rec.getMessage()


def test_nothing_is_computed_when_nobody_listens(caplog, monkeypatch):
    read = []
    original = torch.Tensor.__float__
    monkeypatch.setattr(torch.Tensor, "__float__", lambda t: read.append(1) or original(t))
    config = {"logging": {"steps_per_print": 1}, "nonfinite_loss": "off"}
    counts = []
    for level in (logging.WARNING, logging.INFO):  # nobody listens to INFO; then someone does
        caplog.set_level(level, logger="offload")
        read.clear()
        engine, _ = _train(config, steps=2)
        engine.close()
        counts.append(len(read))
        assert (engine.reporter.last is None) == (level == logging.WARNING)
    # The reporter read the two micro-batches' losses only when the report had a listener.
    assert counts[1] - counts[0] == 2
    assert len(_reports(caplog)) == 2


def test_import_configures_no_handler_and_enable_logging_adds_one():
    lib = logging.getLogger("offload")
    root_handlers = list(logging.getLogger().handlers)
    assert not [h for h in lib.handlers if h.get_name() == "offload.enable_logging"]
    stream = io.StringIO()
    level = lib.level
    try:
        handler = offload.enable_logging(stream=stream)
        assert offload.enable_logging(stream=stream) is handler  # once, however often called
        logging.getLogger(REPORT_LOGGER).info("hello")
        assert "offload.runtime.report INFO: hello" in stream.getvalue()
        assert logging.getLogger().handlers == root_handlers  # the root logger is the user's
    finally:
        lib.removeHandler(handler)
        lib.setLevel(level)


def _ranks_speak(rank: int, world_size: int) -> list[list[str]]:
    out = []
    for all_ranks in (False, True):
        stream = io.StringIO()
        handler = logging.StreamHandler(stream)
        logger = logging.getLogger("offload")
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        try:
            torch.manual_seed(0)
            config = {"logging": {"steps_per_print": 1, "all_ranks": all_ranks}}
            with offload.initialize(TinyGPT(), config) as engine:
                x, y = gpt_batches(1)[0]
                engine.backward(engine(x, y))
                engine.step()
        finally:
            logger.removeHandler(handler)
        out.append(stream.getvalue().splitlines())
    return out


def test_rank_0_logs_by_default_every_rank_with_all_ranks():
    (r0_default, r0_all), (r1_default, r1_all) = run_distributed(_ranks_speak, 2)
    assert len(r0_default) == 2
    assert r0_default[0].startswith("initialized: ") and r0_default[1].startswith("step 1 | loss ")
    assert "world size 2" in r0_default[0]
    assert r1_default == []  # the negative control: rank 1 says nothing by default
    assert r1_all[0].startswith("initialized [rank 1]") and r1_all[1].startswith("step 1 [rank 1]")
    assert r0_all[1].startswith("step 1 [rank 0]")


# -- monitors ----------------------------------------------------------------------------------

def _monitored(tmp_path, **blocks):
    return {"logging": {"steps_per_print": 0, "tokens_per_step": 128},
            "monitors": {name: {"enabled": True, "output_path": str(tmp_path), "job_name": "job",
                                **extra} for name, extra in blocks.items()}}


def _after_each_step(seen):
    return lambda e: seen.append((e.get_global_grad_norm(), e.get_lr()[0], e.memory_bytes()))


def test_csv_monitor_writes_a_row_per_step_read_back(tmp_path):
    seen = []
    engine, losses = _train(_monitored(tmp_path, csv={}), steps=3, after_step=_after_each_step(seen))
    engine.close()
    with open(tmp_path / "job" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [1, 2, 3]  # every step (monitors.steps_per_write 1)
    for row, step_losses, (norm, lr, memory) in zip(rows, losses, seen):
        assert float(row["train/loss"]) == pytest.approx(step_losses[0], rel=1e-6)
        assert float(row["train/grad_norm"]) == norm and float(row["train/lr"]) == lr
        assert {tier: int(row[f"memory/{tier}_bytes"]) for tier in memory} == memory
        assert float(row["train/tokens_per_s"]) == pytest.approx(128 / float(row["train/step_time_s"]))
        assert "time/collective_s" not in row  # no wall_clock_breakdown


def test_a_failing_monitor_warns_once_and_training_goes_on(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="offload")

    def break_it(engine):
        if engine.global_steps == 1:
            engine.reporter.monitors[0]._file.close()  # the next write raises

    engine, _ = _train(_monitored(tmp_path, csv={}), steps=3, after_step=break_it)
    with engine:
        assert engine.global_steps == 3 and engine.reporter.monitors == []
        warned = [r for r in caplog.records if "monitor csv failed" in r.getMessage()]
        assert len(warned) == 1


def test_tensorboard_events_read_back_with_tensorboards_reader(tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard monitor needs pip install 'offload[monitors]'")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    seen = []
    config = _monitored(tmp_path, tensorboard={})
    config["logging"]["wall_clock_breakdown"] = True
    engine, losses = _train(config, steps=3, after_step=_after_each_step(seen))
    engine.close()
    events = EventAccumulator(str(tmp_path / "job"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert {"train/loss", "train/lr", "train/grad_norm", "train/loss_scale", "train/step_time_s",
            "train/tokens_per_s", "train/stall_fraction", "memory/host_bytes",
            "time/collective_s"} <= set(tags)
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3]
    # TensorBoard stores float32: compare at its precision.
    assert [e.value for e in loss] == pytest.approx([l[0] for l in losses], rel=1e-6)
    assert [e.value for e in events.Scalars("train/grad_norm")] == pytest.approx([s[0] for s in seen], rel=1e-6)
    assert [e.value for e in events.Scalars("memory/host_bytes")] == pytest.approx(
        [s[2]["host"] for s in seen], rel=1e-6)


def test_wandb_offline_run_is_written(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="the wandb monitor needs pip install 'offload[monitors]'")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    config = _monitored(tmp_path, wandb={"project": "offload-test"})
    del config["monitors"]["wandb"]["job_name"]
    engine, _ = _train(config, steps=2)
    engine.close()
    runs = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(runs) == 1 and os.path.getsize(runs[0]) > 0


def test_a_missing_monitor_library_is_an_error_at_initialize_naming_the_extra(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ImportError, match=r"monitors\.tensorboard\.enabled .* 'tensorboard' package is "
                                          r"not installed; pip install 'offload\[monitors\]'"):
        offload.initialize(TinyGPT(), _monitored(tmp_path, tensorboard={}))


# -- DeepSpeed's keys --------------------------------------------------------------------------

def test_deepspeed_logging_and_monitor_keys_translate(tmp_path):
    ds = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
          "steps_per_print": 5, "wall_clock_breakdown": True,
          "tensorboard": {"enabled": True, "output_path": str(tmp_path), "job_name": "tb"},
          "csv_monitor": {"enabled": True, "output_path": "", "job_name": "c"},
          "wandb": {"enabled": False, "team": "t", "group": "g", "project": "p"},
          "flops_profiler": {"enabled": True}, "comms_logger": {"enabled": True}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = load_config(ds, world_size=1)
    (report,) = [str(w.message) for w in caught if issubclass(w.category, DeepSpeedConfigWarning)]
    assert config.logging.steps_per_print == 5 and config.logging.wall_clock_breakdown
    assert config.monitors.tensorboard.enabled and config.monitors.tensorboard.job_name == "tb"
    assert config.monitors.csv.output_path == "runs" and config.monitors.csv.job_name == "c"
    assert (config.monitors.wandb.team, config.monitors.wandb.group, config.monitors.wandb.project) == ("t", "g", "p")
    # Only the keys still not honoured are named, each with its reason.
    assert config.ignored_keys == ("comms_logger", "flops_profiler")
    assert "flops_profiler: offload has no FLOPs profiler" in report and "steps_per_print" not in report
    assert math.isclose(config.logging.steps_per_print, 5)


def test_deepspeed_monitor_block_with_an_unknown_key_is_an_error():
    ds = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
          "csv_monitor": {"enabled": True, "outputpath": "x"}}
    with pytest.raises(ValueError, match=r"csv_monitor\.outputpath is not a DeepSpeed key .*did you mean 'output_path'"):
        load_config(ds, world_size=1)


def test_offload_config_sections_round_trip_and_check_ranges():
    config = load_config({"logging": {"steps_per_print": 0, "tokens_per_step": 4096},
                          "monitors": {"csv": {"enabled": True}, "steps_per_write": 10}})
    assert load_config(config.to_dict()) == config
    with pytest.raises(ValueError, match="logging.steps_per_print = -1"):
        load_config({"logging": {"steps_per_print": -1}})
    with pytest.raises(ValueError, match="monitors.steps_per_write = 0"):
        load_config({"monitors": {"steps_per_write": 0}})
    with pytest.raises(ValueError, match="monitors.tensorboard.output_path"):
        load_config({"monitors": {"tensorboard": {"output_path": " "}}})


def test_deepspeed_steps_per_print_prints_without_logging_configured(tmp_path):
    """DeepSpeed prints its step line by itself; a DeepSpeed config's steps_per_print printed
    nothing until the user configured logging (issue #36). offload's own config stays quiet
    as a library should (the second run)."""
    import subprocess
    import sys

    script = tmp_path / "run.py"
    script.write_text(
        "import sys, warnings, torch, offload\n"
        "from tests.conftest import TinyGPT, gpt_batches\n"
        "warnings.simplefilter('ignore')\n"
        "ds = {'train_micro_batch_size_per_gpu': 1, 'steps_per_print': 1, 'zero_optimization': {'stage': 3},\n"
        "      'optimizer': {'type': 'AdamW', 'params': {'lr': 1e-3}}}\n"
        "cfg = ds if sys.argv[1] == 'deepspeed' else {'optimizer': {'lr': 1e-3}, 'logging': {'steps_per_print': 1}}\n"
        "engine = offload.initialize(TinyGPT(n_layer=1), cfg)\n"
        "for x, y in gpt_batches(2):\n"
        "    engine.backward(engine(x, y)); engine.step()\n"
        "engine.close()\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(k, None)
    ds = subprocess.run([sys.executable, str(script), "deepspeed"], capture_output=True, text=True, env=env,
                        cwd=root, timeout=240)
    assert ds.returncode == 0, ds.stderr
    assert "offload.runtime.report INFO: step 1 | loss" in ds.stderr and "INFO: step 2 | loss" in ds.stderr, ds.stderr
    ours = subprocess.run([sys.executable, str(script), "offload"], capture_output=True, text=True, env=env,
                          cwd=root, timeout=240)
    assert ours.returncode == 0 and "step 1" not in ours.stderr, ours.stderr
