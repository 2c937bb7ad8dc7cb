"""The CPU optimizer's thread budget (offload/optim/threads.py; issue #30, F10): by default
each rank takes the cores of its affinity divided among the node's ranks (torchrun's
LOCAL_WORLD_SIZE), not every core; an explicit `cpu_adam_threads` wins.

What each pins: the rule over LOCAL_WORLD_SIZE and a really narrowed affinity; and, at
world size 2 with LOCAL_WORLD_SIZE=2 on real processes, that every native update of each
rank is called with that count and the initialize line says it.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

import offload
from offload.optim.threads import resolve_threads
from tests.conftest import TinyGPT, gpt_batches, run_distributed


def _cores() -> int:
    return len(os.sched_getaffinity(0))


def test_default_divides_the_affinity_among_the_nodes_ranks(monkeypatch):
    cores = _cores()
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert resolve_threads(0) == cores  # no launcher says: one rank, every core (as before)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert resolve_threads(0) == cores
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert resolve_threads(0) == max(1, cores // 2)
    if cores == 2:
        assert resolve_threads(0) == 1  # this 2-core machine, two ranks: one thread each
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(4 * cores))
    assert resolve_threads(0) == 1  # never 0
    for configured in (1, 3, 64):  # an explicit count is taken as given, whatever the node
        assert resolve_threads(configured) == configured


def test_default_counts_the_cores_of_the_affinity_not_of_the_machine(monkeypatch):
    # A real narrowed affinity (what taskset, a cpuset or torchrun --numa-binding leave),
    # set on this thread only (pid 0 is the calling thread) and restored.
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(before)})
        assert resolve_threads(0) == 1
    finally:
        os.sched_setaffinity(0, before)
    assert resolve_threads(0) == len(before)


def test_bad_local_world_size_or_count_is_refused_by_name(monkeypatch):
    for bad in ("two", "0", "-2"):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", bad)
        with pytest.raises(ValueError, match=f"LOCAL_WORLD_SIZE='{bad}' is not a positive integer"):
            resolve_threads(0)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "two")
    assert resolve_threads(4) == 4  # an explicit count needs no LOCAL_WORLD_SIZE
    with pytest.raises(ValueError, match="cpu_adam_threads=-1 must be >= 0"):
        resolve_threads(-1)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _train_two_ranks(rank: int, world_size: int, configured: int) -> dict:
    from offload.optim import kinds

    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)  # torchrun's: both ranks on this node
    seen: list = []
    kernel = kinds.adam_step_flat

    def recording_kernel(*args, **kwargs):  # the real kernel runs; its thread count is noted
        seen.append(kwargs.get("threads"))
        return kernel(*args, **kwargs)

    kinds.adam_step_flat = recording_kernel
    lines = _Lines()
    logger = logging.getLogger("offload")
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    try:
        torch.manual_seed(0)
        config = {"compute_device": "cpu", "cpu_adam_threads": configured,
                  "logging": {"all_ranks": True, "steps_per_print": 0}}
        with offload.initialize(TinyGPT(), config) as engine:
            for x, y in gpt_batches(2):
                engine.backward(engine(x, y))
                engine.step()
            threads = engine.optimizer.threads
    finally:
        kinds.adam_step_flat = kernel
        logger.removeHandler(lines)
    return {"threads": threads, "seen": sorted(set(seen)), "calls": len(seen),
            "line": next(m for m in lines.lines if m.startswith("initialized"))}


def test_each_of_two_local_ranks_runs_its_optimizer_on_its_share_of_the_cores():
    share = max(1, _cores() // 2)  # 1 on this 2-core machine
    for rank, res in enumerate(run_distributed(_train_two_ranks, 2, 0)):
        assert res["threads"] == share, (rank, res)
        assert res["calls"] > 0 and res["seen"] == [share], (rank, res)  # what the kernel got
        assert f"AdamW on {share} CPU thread" in res["line"], res["line"]
        assert "cpu_adam_threads=0" in res["line"] and f"[rank {rank}]" in res["line"]


def test_an_explicit_cpu_adam_threads_reaches_the_kernel_on_every_rank():
    for rank, res in enumerate(run_distributed(_train_two_ranks, 2, 3)):
        assert res["threads"] == 3 and res["seen"] == [3], (rank, res)
        assert "AdamW on 3 CPU threads" in res["line"] and "cpu_adam_threads=0" not in res["line"]
