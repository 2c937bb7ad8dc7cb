"""The step-time model (offload/plan/step_time.py) pinned on a synthetic machine profile with
hand-computed schedules, and the machine profile's measurement and cache
(offload/plan/profile.py, measure.py)."""

from __future__ import annotations

import json
import logging
import math
import os

import pytest

from offload.plan import step_time
from offload.plan.event_schedule import EventSchedule
from offload.plan.profile import (
    Figure,
    MachineProfile,
    MatmulRate,
    OptimizerRate,
    cached_profile,
    fingerprint,
    load_profile,
    save_profile,
)
from offload.plan.shapes import ModelShape, UnitShape, shape_from_dims, shape_from_hf_config
from offload.plan.step_time import StepSettings, predict_step, update_times


def _fig(v: float, unit: str = "x") -> Figure:
    return Figure(value=v, unit=unit, method="synthetic")


def synthetic_profile(*, opt_rate: float = 1e10, nvme_gbps: float = 1.0, gpu: bool = True) -> MachineProfile:
    """Round rates: GPU bf16 matmul 1e12 FLOP/s, copies 10 GB/s each way, host 10 GB/s,
    NVMe `nvme_gbps` each way, the CPU optimizer `opt_rate` elements/s."""
    return MachineProfile(
        fingerprint="synthetic", hardware="synthetic", measured_at="2026-01-01T00:00:00+00:00",
        cpu_threads=4, host_bandwidth=_fig(10.0, "GB/s"), parallel_op=_fig(1e-5, "s"),
        optimizer=tuple(OptimizerRate(moments=m, threads=4, rate=_fig(opt_rate)) for m in ("fp32", "bf16", "8bit")),
        cpu_matmul=(MatmulRate(device="cpu", dtype="bf16", d_model=256, rate=_fig(1e11)),
                    MatmulRate(device="cpu", dtype="fp32", d_model=256, rate=_fig(1e11))),
        nvme_block_size=1 << 20, nvme_path="/synthetic", nvme_read=_fig(nvme_gbps), nvme_write=_fig(nvme_gbps),
        h2d=_fig(10.0) if gpu else None, d2h=_fig(10.0) if gpu else None,
        gpu_matmul=(MatmulRate(device="cuda", dtype="bf16", d_model=256, rate=_fig(1e12)),) if gpu else (),
        gpu_free_bytes=_fig(80e9) if gpu else None)


def three_units() -> ModelShape:
    """Root 1e6 parameters and 1 GFLOP forward (1 ms at 1e12), two blocks of 2e6 parameters
    and 2 GFLOP (2 ms); no non-matmul traffic, so every time below is hand-computable."""
    units = (UnitShape("root", 1_000_000, 1e9, 0.0, 0.0, 0.0, 256),
             UnitShape("block0", 2_000_000, 2e9, 0.0, 0.0, 0.0, 256),
             UnitShape("block1", 2_000_000, 2e9, 0.0, 0.0, 0.0, 256))
    return ModelShape(units, tokens=1000)


@pytest.fixture
def no_overhead(monkeypatch):
    monkeypatch.setattr(step_time, "UNIT_OVERHEAD_S", 0.0)


def _gpu(pt: str, ot: str) -> StepSettings:
    return StepSettings(param_tier=pt, optimizer_tier=ot, dtype="bf16", on_gpu=True, worker=True,
                        updates_in_backward=True)


def test_compute_bound_three_units_matches_hand_schedule(no_overhead):
    # GPU: fwd 1 + 2 + 2 ms; backward (2x) unit 2 at [5, 9], unit 1 [9, 13], root [13, 15].
    # After the root's backward: its gradient down (1e6 x 4 B at 10 GB/s: 0.4 ms) [15, 15.4],
    # its update (1e6 at 1e10/s: 0.1 ms) [15.4, 15.5], its new bf16 shard up (0.2 ms) [15.5, 15.7].
    pr = predict_step(three_units(), synthetic_profile(opt_rate=1e10), _gpu("device", "cpu"))
    assert pr.step_s == pytest.approx(15.7e-3, rel=1e-9)
    assert pr.binding == "gpu" and pr.busy_s["gpu"] == pytest.approx(15e-3)
    assert pr.forward_s == pytest.approx(5e-3) and pr.backward_s == pytest.approx(15e-3)
    assert pr.tokens_per_s == pytest.approx(1000 / 15.7e-3)


def test_cpu_bound_three_units_matches_hand_schedule(no_overhead):
    # The optimizer at 1e8 elements/s: unit 2's update (20 ms) starts after its gradient is
    # down at 9.8 ms; unit 1's (20 ms) and the root's (10 ms) queue behind it on the worker:
    # 9.8 + 20 + 20 + 10 = 59.8 ms, then the root's new shard up (0.2 ms): 60.0 ms.
    pr = predict_step(three_units(), synthetic_profile(opt_rate=1e8), _gpu("device", "cpu"))
    assert pr.step_s == pytest.approx(60.0e-3, rel=1e-9)
    assert pr.binding == "optimizer" and pr.busy_s["optimizer"] == pytest.approx(50e-3)


def test_disk_bound_three_units_matches_hand_schedule(no_overhead):
    # Optimizer state on NVMe at 1 GB/s: 12 B per element (fp32 master + two fp32 moments),
    # unit 2: 24 ms read, 24 ms write; the root 12 + 12 ms. The NVMe queue runs in issue
    # order: read 2 [5, 29] (issued at unit 2's turn, after forward), write 2 [29.2, 53.2],
    # read 1 [53.2, 77.2], write 1 [77.4, 101.4], read 0 [101.4, 113.4], the root's update
    # [113.4, 113.5], write 0 [113.5, 125.5].
    pr = predict_step(three_units(), synthetic_profile(opt_rate=1e10, nvme_gbps=1.0), _gpu("device", "nvme"))
    assert pr.step_s == pytest.approx(125.5e-3, rel=1e-9)
    assert pr.binding == "nvme" and pr.busy_s["nvme"] == pytest.approx(120e-3)


def test_cpu_run_puts_compute_copies_and_optimizer_on_the_cores(no_overhead):
    # A CPU run at 1e11 FLOP/s: forward 10 + 20 + 20 ms, backward twice that; the gradient
    # copies into the fp32 shard (bf16 2 B read + 4 B written per element at 10 GB/s): 0.6,
    # 1.2, 1.2 ms; updates at step() (the default guard) 0.1 + 0.2 + 0.2 ms: all one resource.
    s = StepSettings(param_tier="cpu", optimizer_tier="cpu", dtype="bf16", on_gpu=False)
    pr = predict_step(three_units(), synthetic_profile(gpu=False), s)
    assert pr.step_s == pytest.approx((50 + 100 + 3.0 + 0.5) * 1e-3, rel=1e-9)
    assert set(pr.busy_s) == {"cpu"}


def test_more_disk_bytes_predict_a_slower_step_and_a_negative_control():
    shape = shape_from_dims(layers=4, d_model=512, heads=8, vocab=8192, seq=256, batch=4)
    prof = synthetic_profile(gpu=False, nvme_gbps=0.05)
    times = {pt_ot: predict_step(shape, prof, StepSettings(param_tier=pt_ot[0], optimizer_tier=pt_ot[1])).step_s
             for pt_ot in (("cpu", "cpu"), ("cpu", "nvme"), ("nvme", "nvme"))}
    assert times[("cpu", "cpu")] < times[("cpu", "nvme")] < times[("nvme", "nvme")]
    # the negative control: a disk 1000x faster hides the NVMe traffic behind compute almost
    # entirely, so the same comparison can fail (the test is not true by construction)
    fast = synthetic_profile(gpu=False, nvme_gbps=50.0)
    t_fast = predict_step(shape, fast, StepSettings(param_tier="cpu", optimizer_tier="nvme")).step_s
    assert t_fast < 1.05 * times[("cpu", "cpu")] < times[("cpu", "nvme")]


def test_event_schedule_keeps_issue_order_per_resource():
    ev = EventSchedule()
    a = ev.add("a", "r", 2.0)
    ev.add("b", "q", 1.0, (a,))
    ev.add("c", "r", 1.0)  # issued after a on r: waits for it even with no dependency
    s = ev.run()
    assert s.starts == [0.0, 2.0, 2.0] and s.makespan_s == 3.0 and s.binding() == "r"
    with pytest.raises(ValueError, match="not yet issued"):
        ev.add("d", "r", 1.0, (7,))


def test_update_times_splits_between_device_and_cpu():
    t = update_times(1_000_000, cpu_elements_per_s=1e8, device_fraction=0.75, device_elements_per_s=1e9,
                     link_bytes_per_s=1e10)
    assert t.cpu_s == pytest.approx(2.5e-3) and t.device_s == pytest.approx(0.75e-3)
    assert t.copy_s == pytest.approx(250_000 * 6 / 1e10)
    assert t.exposed_s == pytest.approx(2.5e-3 + 1.5e-4)
    with pytest.raises(ValueError, match="device_fraction"):
        update_times(10, cpu_elements_per_s=1.0, device_fraction=1.5)


def test_shapes_from_dims_and_hf_config(tmp_path):
    s = shape_from_dims(layers=2, d_model=64, heads=4, vocab=100, seq=16, batch=2, positions=16)
    assert len(s.units) == 3 and s.tokens == 32
    block = 12 * 64 * 64 + 13 * 64  # qkv, proj, fc, out with biases, two norms
    assert s.units[1].params == block and s.units[0].params == 100 * 64 + 16 * 64 + 2 * 64
    assert s.units[1].fwd_flops == 2 * 32 * 12 * 64 * 64 + 2 * 32 * 16 * 64
    with_rc = shape_from_dims(layers=2, d_model=64, heads=4, vocab=100, seq=16, batch=2, recompute=True)
    assert with_rc.activation_elems() < s.activation_elems()
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"num_hidden_layers": 80, "hidden_size": 8192, "num_attention_heads": 64, "num_key_value_heads": 8,
                               "intermediate_size": 28672, "vocab_size": 128256, "tie_word_embeddings": False,
                               "max_position_embeddings": 8192}))
    llama = shape_from_hf_config(str(cfg), seq=4096, batch=1)
    assert len(llama.units) == 81  # 80 blocks, one unit each, and the root
    assert 69e9 < llama.params < 72e9  # Llama-3 70B
    with pytest.raises(ValueError, match="--heads"):
        shape_from_dims(layers=1, d_model=10, heads=3, vocab=10, seq=4, batch=1)


# -- the profile: measured figures in sane ranges, the cache -----------------------------


@pytest.fixture(scope="module")
def quick_profile(tmp_path_factory):
    from offload.plan.measure import measure_profile

    return measure_profile(nvme_path=str(tmp_path_factory.mktemp("nvme")), quick=True)


def test_measured_profile_is_in_sane_ranges(quick_profile):
    p = quick_profile
    # Any machine that runs this suite: memory copies between 0.1 and 1000 GB/s, an Adam
    # update between 1e6 and 1e11 elements/s per kind, a CPU matmul between 1e8 and 1e14
    # FLOP/s, a disk (or the page cache under a tmpfs) between 0.01 and 100 GB/s.
    assert 0.1 < p.host_bandwidth.value < 1000 and p.host_bandwidth.unit == "GB/s"
    assert 1e-8 < p.parallel_op.value < 1.0 and p.parallel_op.unit == "s"  # idle: us; busy: a time slice
    assert {r.moments for r in p.optimizer} == {"fp32", "bf16", "8bit"}
    assert all(1e6 < r.rate.value < 1e11 and r.rate.unit == "elements/s" for r in p.optimizer)
    assert all(1e8 < m.rate.value < 1e14 for m in p.cpu_matmul)
    assert p.nvme_read is not None and p.nvme_write is not None
    assert 0.01 < p.nvme_read.value < 100 and 0.01 < p.nvme_write.value < 100
    assert all(f.method for f in (p.host_bandwidth, p.nvme_read, p.nvme_write))
    import torch

    if not torch.cuda.is_available():
        assert p.h2d is None and p.gpu_free_bytes is None and any("no GPU" in a for a in p.absent)
    again = MachineProfile.from_dict(json.loads(json.dumps(p.to_dict())))
    assert again == p
    assert math.isfinite(p.matmul_rate("cpu", "bf16", 700))


def test_cache_remeasures_on_a_changed_fingerprint_and_a_corrupt_file(tmp_path, monkeypatch, quick_profile, caplog):
    from dataclasses import replace

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []

    def measure():
        calls.append(1)
        return replace(quick_profile, fingerprint=fingerprint(None))

    first = cached_profile(measure)
    assert len(calls) == 1 and os.path.exists(tmp_path / "offload" / "machine_profile.json")
    assert cached_profile(measure) == first and len(calls) == 1  # same machine: the cache
    save_profile(replace(first, fingerprint="another-machine"), str(tmp_path / "offload" / "machine_profile.json"))
    cached_profile(measure)
    assert len(calls) == 2  # another machine's profile: measured again
    (tmp_path / "offload" / "machine_profile.json").write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="offload"):
        again = cached_profile(measure)
    assert len(calls) == 3 and again.fingerprint == fingerprint(None)
    assert "not JSON" in caplog.text and "measuring this machine again" in caplog.text
    with pytest.raises(ValueError, match="not a machine profile"):
        MachineProfile.from_dict({**first.to_dict(), "host_bandwidth": {"value": -1, "unit": "GB/s", "method": "x"}})
    assert load_profile(str(tmp_path / "offload" / "machine_profile.json")).fingerprint == fingerprint(None)


def test_cli_ranks_placements_by_predicted_step(tmp_path, capsys):
    from offload.plan.cli import main

    prof = synthetic_profile(gpu=False, nvme_gbps=0.01)  # a slow disk: NVMe placements lose
    path = tmp_path / "p.json"
    save_profile(prof, str(path))
    rc = main(["--profile", str(path), "--layers", "4", "--d-model", "512", "--heads", "8", "--vocab", "8192",
               "--seq", "256", "--batch", "4", "--gpus", "0", "--cpu-mem", "64GiB", "--nvme-free", "100GiB",
               "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    steps = [p["predicted"]["step_s"] for p in out["placements"]]
    assert steps == sorted(steps)
    assert out["recommended"] == "device/cpu" and out["activation_bytes"] > 0
    # with host memory too small for the in-memory placements, the fastest that fits is on NVMe
    rc = main(["--profile", str(path), "--layers", "4", "--d-model", "512", "--heads", "8", "--vocab", "8192",
               "--seq", "256", "--batch", "4", "--gpus", "0", "--cpu-mem", "350MiB", "--cpu-reserve", "0",
               "--pinned-budget", "64MiB", "--nvme-free", "100GiB", "--json"])
    out = json.loads(capsys.readouterr().out)
    fitting = [p for p in out["placements"] if p["fits"]]
    assert rc == 0 and {p["optimizer_tier"] for p in fitting} == {"nvme"}
    best = min(fitting, key=lambda p: p["predicted"]["step_s"])
    assert out["recommended"] == f"{best['param_tier']}/{best['optimizer_tier']}"
    assert out["placements"][0]["predicted"]["step_s"] < best["predicted"]["step_s"]  # faster, not fitting


def test_step_report_shows_the_predicted_step_beside_the_measured(tmp_path, monkeypatch, caplog):
    """The engine predicts its step from this machine's cached profile and hands the number
    to the step report; without a cached profile of this machine the report has none."""
    from dataclasses import replace

    import torch

    import offload
    from tests.conftest import TinyGPT, gpt_batches

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    caplog.set_level(logging.INFO, logger="offload")
    config = {"logging": {"steps_per_print": 1, "tokens_per_step": 4 * 16}}

    def run() -> list[dict]:
        caplog.clear()
        torch.manual_seed(0)
        with offload.initialize(TinyGPT(), config) as engine:
            for x, y in gpt_batches(2):
                loss = engine(x, y)
                engine.backward(loss)
                engine.step()
        return [r.step_report for r in caplog.records if hasattr(r, "step_report")]

    without = run()  # negative control: no cached profile, no prediction
    assert without and all(r["predicted_step_s"] is None for r in without)
    assert not any("predicted" in r.getMessage() for r in caplog.records if hasattr(r, "step_report"))
    prof = replace(synthetic_profile(gpu=False), fingerprint=fingerprint(None))
    save_profile(prof, str(tmp_path / "offload" / "machine_profile.json"))
    reports = run()
    assert reports and all(r["predicted_step_s"] > 0 for r in reports)
    assert reports[-1]["step_time_s"] > 0
    line = [r.getMessage() for r in caplog.records if hasattr(r, "step_report")][-1]
    assert "(predicted " in line and "bound by CPU" in line, line
