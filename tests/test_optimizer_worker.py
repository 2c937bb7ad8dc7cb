"""The optimizer worker (issue #30, F7): updates during backward on a thread of their own.

What must hold, on the CPU here and on a GPU (the cuda tests):
- bit-identical to the updates on autograd's thread (`prefetch.optimizer_worker: off`), for
  every parameter tier in memory, stages 3 and 2, fp32 and bf16, world sizes 1 and 2;
- the updates really run on the worker's thread;
- whatever reads what an update touches waits for it: `engine.step()`, the next forward
  (also one before `step()`), `full_state_dict`, checkpoints;
- an update that fails on the worker fails the engine as it would on autograd's thread.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

import offload
from offload.config import Config, OffloadConfig, OptimizerConfig, PrecisionConfig, PrefetchConfig
from offload.devices import side_stream
from offload.engine import EngineState
from offload.runtime.optimizer_worker import OptimizerWorker, WorkerState
from offload.runtime.optimizer_step import uses_worker
from tests.conftest import TinyGPT, gpt_batches, run_distributed


def cfg(worker: str, param_tier: str = "cpu", dtype: str = "fp32", stage: int = 3,
        device: str = "cpu") -> Config:
    return Config(compute_device=device, zero_stage=stage,
                  optimizer=OptimizerConfig(lr=1e-2, weight_decay=0.01),
                  precision=PrecisionConfig(dtype=dtype),
                  offload=OffloadConfig(param_tier=param_tier),
                  prefetch=PrefetchConfig(optimizer_worker=worker),
                  nonfinite_loss="off")  # the worker runs the updates during backward: guard off


def train(config: Config, steps: int = 3, rank: int = 0, world_size: int = 1, spy: bool = False):
    torch.manual_seed(0)
    engine = offload.initialize(TinyGPT(n_layer=3), config)
    threads: set[int] = set()
    if spy:
        inner = engine.optimizer.update_unit

        def update_unit(index, grad_scale):
            threads.add(threading.get_ident())
            return inner(index, grad_scale)

        engine.optimizer.update_unit = update_unit
    for x, y in gpt_batches(steps):
        n = x.shape[0] // world_size
        engine.backward(engine(x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]))
        engine.step()
    stats = engine.step_stats()
    sd = engine.full_state_dict(rank0_only=False)
    engine.close()
    return sd, stats, threads


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


# -- the worker itself -------------------------------------------------------------------------


def test_worker_runs_jobs_in_order_and_hands_back_the_first_error():
    w = OptimizerWorker()
    seen = []
    for i in range(5):
        w.submit(lambda i=i: (time.sleep(0.002 * (5 - i)), seen.append(i)))
    assert w.settle() is None and seen == [0, 1, 2, 3, 4] and w.state is WorkerState.IDLE

    def boom():
        raise OSError(5, "injected")

    w.submit(boom)
    w.submit(lambda: seen.append("after"))  # dropped: the step is already part-applied
    err = w.settle()
    assert isinstance(err, OSError) and "after" not in seen
    assert w.settle() is None  # handed over once
    w.submit(lambda: seen.append("next"))
    assert w.settle() is None and seen[-1] == "next"
    w.close()
    w.close()
    assert w.state is WorkerState.CLOSED
    with pytest.raises(RuntimeError, match="closed"):
        w.submit(lambda: None)


def test_auto_is_on_for_cuda_without_nvme_only():
    def c(choice):
        return dataclasses.replace(cfg("off"), prefetch=PrefetchConfig(optimizer_worker=choice))

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert uses_worker(c("auto"), cuda, nvme=False)
    assert not uses_worker(c("auto"), cuda, nvme=True)
    assert not uses_worker(c("auto"), cpu, nvme=False)
    assert uses_worker(c("on"), cpu, nvme=False) and not uses_worker(c("off"), cuda, nvme=False)


def test_a_bad_value_is_refused_at_the_door():
    with pytest.raises(Exception, match="optimizer_worker"):
        Config.from_dict({"prefetch": {"optimizer_worker": "yes"}})


# -- the engine with the worker on the CPU ---------------------------------------------------------


@pytest.mark.parametrize("param_tier,dtype,stage", [("cpu", "fp32", 3), ("device", "bf16", 3),
                                                    ("cpu", "bf16", 2), ("device", "fp32", 3)])
def test_bit_identical_to_updates_on_autograds_thread(param_tier, dtype, stage):
    off, stats_off, _ = train(cfg("off", param_tier, dtype, stage))
    on, stats_on, threads = train(cfg("on", param_tier, dtype, stage), spy=True)
    assert_same(on, off)
    # the updates ran during backward, on the worker's thread, not on this one
    assert stats_on["optimizer_in_backward_units"] == stats_off["optimizer_in_backward_units"] > 0
    assert threads and threading.get_ident() not in threads
    assert stats_on["optimizer_wait_s"] >= 0 and stats_off["optimizer_wait_s"] == 0


def _ws2(rank: int, world_size: int, worker: str):
    sd, _, _ = train(cfg(worker), rank=rank, world_size=world_size)
    return {k: v.clone() for k, v in sd.items()}


def test_bit_identical_at_world_size_2():
    on = run_distributed(_ws2, 2, "on")
    off = run_distributed(_ws2, 2, "off")
    for r in range(2):
        assert_same(on[r], off[r])


def test_a_forward_before_step_sees_the_updated_parameters():
    """The next forward waits for the worker, as it would have found the updates done on
    autograd's thread: the loss of a second forward before `step()` is the same."""
    losses = {}
    for worker in ("off", "on"):
        torch.manual_seed(0)
        engine = offload.initialize(TinyGPT(n_layer=3), cfg(worker))
        (x, y), (x2, y2) = gpt_batches(2)
        engine.backward(engine(x, y))
        with torch.no_grad():
            losses[worker] = engine(x2, y2).item()
        engine.step()
        engine.close()
    assert losses["on"] == losses["off"]


def test_a_failed_update_on_the_worker_fails_the_engine():
    torch.manual_seed(0)
    engine = offload.initialize(TinyGPT(n_layer=3), cfg("on"))
    inner = engine.optimizer.update_unit
    calls = []

    def update_unit(index, grad_scale):
        calls.append(index)
        if len(calls) == 2:
            raise OSError(5, "injected write error")
        return inner(index, grad_scale)

    engine.optimizer.update_unit = update_unit
    x, y = gpt_batches(1)[0]
    engine.backward(engine(x, y))  # the error is on the worker: backward itself returns
    with pytest.raises(RuntimeError, match="failed part-way") as info:
        engine.step()
    assert isinstance(info.value.__cause__, OSError)
    assert engine.state is EngineState.FAILED
    engine.close()


def test_checkpoints_wait_for_the_worker(tmp_path):
    """A checkpoint saved right after backward (before step) holds the updated state: the
    same bytes as with the updates on autograd's thread."""
    sds = {}
    for worker in ("off", "on"):
        torch.manual_seed(0)
        engine = offload.initialize(TinyGPT(n_layer=3), cfg(worker))
        x, y = gpt_batches(1)[0]
        engine.backward(engine(x, y))
        engine.step()
        engine.backward(engine(x, y))
        sds[worker] = engine.full_state_dict()  # before step(): waits for the updates
        engine.step()
        path = engine.save_checkpoint(str(tmp_path / worker))
        engine.close()
        torch.manual_seed(1)
        fresh = offload.initialize(TinyGPT(n_layer=3), cfg(worker))
        fresh.load_checkpoint(str(tmp_path / worker))
        sds[worker + "_loaded"] = fresh.full_state_dict()
        fresh.close()
        assert path
    assert_same(sds["on"], sds["off"])
    assert_same(sds["on_loaded"], sds["off_loaded"])


# -- CUDA -------------------------------------------------------------------------------------------


def _slow_side_streams(monkeypatch) -> None:
    """Hold back the gradient copies down and the parameter uploads on their streams."""
    import offload.units.grad_reduce as grad_reduce

    orig = grad_reduce._copy_down

    def slow_copy_down(src, dst):
        with torch.cuda.stream(side_stream(src.device, "d2h")):
            torch.cuda._sleep(2_000_000)
        return orig(src, dst)

    monkeypatch.setattr(grad_reduce, "_copy_down", slow_copy_down)


@pytest.mark.cuda
@pytest.mark.parametrize("param_tier", ["cpu", "device"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_cuda_worker_is_bit_identical_with_slowed_copies(param_tier, dtype, monkeypatch):
    off, _, _ = train(cfg("off", param_tier, dtype, device="cuda"))
    _slow_side_streams(monkeypatch)
    on, stats, threads = train(cfg("auto", param_tier, dtype, device="cuda"), spy=True)
    assert_same(on, off)
    assert threads and threading.get_ident() not in threads
    assert stats["optimizer_in_backward_units"] > 0
