"""Swap bytes per step (issue #34): `initialize`'s one-time estimate of the terabytes a node
writes per 1,000 steps, and the step report's measured swap bytes per step
(offload/runtime/swap_traffic.py).

The estimate is arithmetic over the engine's own layout; the measure is the NVMe tiers' I/O
counters. Both must agree to the byte, on every rank: every step rewrites exactly the
trainable units' parameter shards (their optimized prefix) and optimizer states that are
on disk. The node's figure is this rank's times LOCAL_WORLD_SIZE, an estimate (the other
ranks' shards differ only by padding).
"""

from __future__ import annotations

import io
import logging

import pytest
import torch

import offload
from offload.config import Config, OffloadConfig, OptimizerConfig
from offload.config.monitor_sections import LoggingConfig
from offload.runtime.swap_traffic import STEPS, TB, WearEstimate
from tests.conftest import TinyGPT, gpt_batches, run_distributed

STEPS_RUN = 4


def _config(path, param_tier="nvme", optimizer_tier="nvme", **offload_kw) -> Config:
    uses = "nvme" in (param_tier, optimizer_tier)
    return Config(compute_device="cpu", optimizer=OptimizerConfig(lr=2e-3),
                  logging=LoggingConfig(steps_per_print=2),
                  offload=OffloadConfig(param_tier=param_tier, optimizer_tier=optimizer_tier,
                                        nvme_path=str(path) if uses else None, **offload_kw))


def _model(freeze: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    m = TinyGPT(n_layer=3)
    if freeze:  # a frozen unit (block 0) and a half-frozen one (block 1): written never / whole
        for mod in (m.blocks[0], m.blocks[1].qkv):
            mod.requires_grad_(False)
    return m


def _train(engine, rank: int = 0, world_size: int = 1) -> list[int]:
    """Bytes written by each step, measured."""
    written, before = [], engine.io_stats()["bytes_written"]
    for x, y in gpt_batches(STEPS_RUN):
        b = x.shape[0] // world_size
        engine.backward(engine(x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b]))
        engine.step()
        now = engine.io_stats()["bytes_written"]
        written.append(int(now - before))
        before = now
    return written


def _wear_record(caplog) -> dict:
    records = [r for r in caplog.records if hasattr(r, "swap_wear")]
    assert len(records) == 1, [r.getMessage() for r in caplog.records]
    assert "TB per 1,000 optimizer steps on this node" in records[0].getMessage()
    assert "rated endurance" in records[0].getMessage()
    return records[0].swap_wear


def test_initialize_logs_tb_per_1000_steps_from_the_engines_own_bytes_on_disk(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="offload")
    engine = offload.initialize(_model(), _config(tmp_path))
    try:
        wear = _wear_record(caplog)
        # The engine's own numbers: every unit trainable, every unit on its NVMe tier, so a
        # step rewrites both swap files whole.
        on_disk = engine.param_tier.bytes_on_disk() + engine.optimizer_states.bytes_on_disk()
        assert wear["rank_bytes_per_step"] == on_disk
        assert wear["node_ranks"] == 1
        assert wear["node_tb_per_1000_steps"] == on_disk * STEPS / TB
        measured = _train(engine)
        assert measured == [on_disk] * STEPS_RUN, measured  # exact at world size 1
        report = engine.reporter.last
        assert report is not None and report["step"] == STEPS_RUN
        assert report["swap_written_bytes"] == on_disk
        assert report["node_swap_written_bytes"] == on_disk
        assert report["swap_read_bytes"] > 0
        line = [r.getMessage() for r in caplog.records if hasattr(r, "step_report")][-1]
        assert "swap written 704.00 KiB/step" in line, line
        assert "/step, read " in line, line
    finally:
        engine.close()


@pytest.mark.parametrize("param_tier,optimizer_tier,freeze,budget", [
    ("nvme", "cpu", True, None),      # frozen units' shards are never written
    ("cpu", "nvme", True, None),      # a frozen unit has no optimizer state to write
    ("nvme", "nvme", False, 100_000),  # units kept in RAM by the budget write nothing
])
def test_the_estimate_is_the_bytes_each_step_writes(tmp_path, caplog, param_tier, optimizer_tier, freeze, budget):
    caplog.set_level(logging.INFO, logger="offload")
    engine = offload.initialize(_model(freeze), _config(tmp_path, param_tier, optimizer_tier,
                                                        ram_budget_bytes=budget))
    try:
        if budget:
            assert engine.placement.mixed, engine.placement.describe()  # the case is the one meant
        wear = _wear_record(caplog)
        measured = _train(engine)
        assert measured == [wear["rank_bytes_per_step"]] * STEPS_RUN, (measured, wear)
        if freeze and param_tier == "nvme":  # a frozen suffix on disk is never rewritten: the case bites
            on_disk = engine.param_tier.bytes_on_disk() + engine.optimizer_states.bytes_on_disk()
            assert wear["rank_bytes_per_step"] < on_disk, (wear, on_disk)
    finally:
        engine.close()


def test_without_an_nvme_tier_no_estimate_and_no_swap_in_the_report(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="offload")
    engine = offload.initialize(_model(), _config(tmp_path, "cpu", "cpu"))
    try:
        _train(engine)
        assert engine.reporter.wear is None
        assert not [r for r in caplog.records if hasattr(r, "swap_wear")]
        assert engine.reporter.last is not None and "swap_written_bytes" not in engine.reporter.last
        assert "swap" not in [r.getMessage() for r in caplog.records if hasattr(r, "step_report")][-1]
    finally:
        engine.close()


def test_the_node_figure_is_the_ranks_figure_times_the_ranks_on_the_node():
    wear = WearEstimate(rank_bytes_per_step=3 * 10**9, node_ranks=8)
    assert wear.node_bytes_per_step == 24 * 10**9
    assert wear.node_tb_per_1000_steps == pytest.approx(24.0)
    assert "~24 TB per 1,000 optimizer steps" in wear.line() and "x 8 ranks on this node" in wear.line()


def _two_ranks(rank: int, world_size: int, path: str) -> tuple[dict, list[int], dict]:
    offload.enable_logging(stream=io.StringIO())  # an INFO listener: the step report is due
    engine = offload.initialize(_model(), _config(path))
    try:
        assert engine.reporter.wear is not None
        wear = engine.reporter.wear.as_dict()
        measured = _train(engine, rank, world_size)
        last = engine.reporter.last
        return wear, measured, dict(last) if last is not None else {}
    finally:
        engine.close()


def test_two_ranks_each_estimate_is_what_its_steps_write(tmp_path):
    results = run_distributed(_two_ranks, 2, str(tmp_path))
    for rank, (wear, measured, last) in enumerate(results):
        assert wear["node_ranks"] == 2  # both ranks on this node share its disk
        assert wear["node_bytes_per_step"] == 2 * wear["rank_bytes_per_step"]
        for step_bytes in measured:
            assert step_bytes == wear["rank_bytes_per_step"], (rank, measured, wear)
        if rank == 0:
            assert last["swap_written_bytes"] == pytest.approx(measured[-1])
            assert last["node_swap_written_bytes"] == 2 * last["swap_written_bytes"]
