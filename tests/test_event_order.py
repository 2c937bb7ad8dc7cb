"""The GPU step overlaps: the engine's GPU path, driven on the CPU through a recording device
runtime (tests/stream_recorder.py: fake streams on a virtual clock, side-stream copies really
deferred with random delays), trains the tiny GPT for 3 steps, and the record must show

1. autograd's thread never blocks between the first and the last unit's backward;
2. the upload of unit k waits only on what was recorded at or before unit k's reduce;
3. an update overlaps a later unit's backward;
4. step n+1's first forward is launched before step n's last update ends.

Each has a negative control that puts the wait back and fails. The weights stay bit-identical
to the serial path (worker off, torch on the CPU as it is) with the delays injected, and a
missing wait (the worker not waiting for its gradient's copy) is caught by that comparison.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import pytest
import torch

import offload
from offload.config import Config, OffloadConfig, OptimizerConfig, PrecisionConfig, PrefetchConfig
from offload.device_runtime import using
from offload.optim.grad_shard import GradShard
from offload.optim.sharded import ShardedOptimizer
from offload.runtime.optimizer_step import StepPolicy
from tests.conftest import TinyGPT, gpt_batches, run_distributed
from tests.stream_recorder import Recorder

STEPS = 3


def cfg(worker: str = "on", dtype: str = "bf16", param_tier: str = "device") -> Config:
    return Config(compute_device="cpu", zero_stage=3,
                  optimizer=OptimizerConfig(lr=1e-2, weight_decay=0.01),
                  precision=PrecisionConfig(dtype=dtype),
                  offload=OffloadConfig(param_tier=param_tier),
                  prefetch=PrefetchConfig(optimizer_worker=worker),
                  nonfinite_loss="off")  # updates during backward (the worker's work)


def _kernels(engine: Any, rec: Recorder) -> None:
    """Each unit's forward and backward as a compute kernel on the recorder's stream."""
    for unit in engine.sharded_state.units:
        module = engine.module if unit.index == 0 else engine.module.get_submodule(unit.name)

        def pre(_m: Any, _a: Any, i: int = unit.index) -> None:
            rec.kernel(f"fwd {i}")

        def post(_m: Any, _a: Any, out: Any, i: int = unit.index) -> None:
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(lambda g: rec.kernel(f"bwd {i}"))

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)


def train(config: Config, rec: Optional[Recorder], steps: int = STEPS, rank: int = 0,
          world_size: int = 1) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    ctx = using(rec) if rec is not None else _null()
    with ctx:
        engine = offload.initialize(TinyGPT(n_layer=3), config)
        if rec is not None:
            _kernels(engine, rec)
        for n, (x, y) in enumerate(gpt_batches(steps)):
            if rec is not None:
                rec.mark(f"step {n}")
            n_ = x.shape[0] // world_size
            engine.backward(engine(x[rank * n_:(rank + 1) * n_], y[rank * n_:(rank + 1) * n_]))
            engine.step()
        if rec is not None:
            rec.mark("end")
        sd = {k: v.clone() for k, v in engine.full_state_dict(rank0_only=False).items()}
        engine.close()
    if rec is not None:
        rec.close()
    return sd


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: Any) -> None:
        return None


def recorded(config: Optional[Config] = None, **kw: Any) -> Recorder:
    rec = Recorder(**kw)
    train(config or cfg(), rec)
    return rec


# -- the four properties, each a function of the record ----------------------------------------


def _steps(rec: Recorder) -> list[tuple[int, int]]:
    seqs = [s for s, what, _ in rec.marks]
    return list(zip(seqs, seqs[1:]))


def _in(lo: int, hi: int, seq: int) -> bool:
    return lo < seq < hi


def launch_thread_blocks(rec: Recorder) -> list[str]:
    """Host waits or CPU work on the main (autograd's) thread between a step's first and last
    unit's backward (its first backward kernel and its last reduce)."""
    bad = []
    for lo, hi in _steps(rec):
        bwd = [o.seq for o in rec.kernels("bwd") if _in(lo, hi, o.seq)]
        d2h = [o.seq for o in rec.ops if o.label.startswith("d2h") and _in(lo, hi, o.seq)]
        end = max(d2h) if d2h else hi  # no copy down recorded: the whole step
        first = min(bwd)
        bad += [f"{w.what} at {w.seq}" for w in rec.host_waits if w.thread == "main" and first < w.seq < end]
        bad += [f"{w.label} at {w.seq}" for w in rec.host_work_spans if w.thread == "main" and first < w.seq < end]
    return bad


def uploads_waiting_late(rec: Recorder) -> list[str]:
    """Uploads of unit k that wait on something recorded after unit k's reduce."""
    bad, seen = [], 0
    for lo, hi in _steps(rec):
        # the uploads of updates during backward (the worker's); at step() they follow all compute
        for up in [o for o in rec.ops if o.label.startswith("upload") and _in(lo, hi, o.seq) and o.thread != "main"]:
            seen += 1
            k = up.label.split()[1]
            reduce = [o for o in rec.ops if o.label == f"d2h {k}" and _in(lo, hi, o.seq)]
            limit = reduce[0].seq if reduce else lo
            late = [w for w in up.waits if w.seq > limit]
            bad += [f"{up.label} waits on {w.label or w.stream} ({w.seq} > {limit})" for w in late]
    assert seen >= 3 * (STEPS - 1), f"only {seen} uploads recorded"
    return bad


def updates_overlapping_backward(rec: Recorder) -> int:
    """Updates whose virtual span overlaps a later unit's backward kernel."""
    n = 0
    for lo, hi in _steps(rec):
        bwd = [o for o in rec.kernels("bwd") if _in(lo, hi, o.seq)]
        for w in rec.host_work_spans:
            if not (w.label.startswith("adam") and _in(lo, hi, w.seq)):
                continue
            k = w.label.split()[1]
            reduce = [o.seq for o in rec.ops if o.label == f"d2h {k}" and _in(lo, hi, o.seq)]
            # a unit whose backward was launched after unit k's reduce (whenever the worker ran)
            n += any(reduce and b.seq > reduce[0] and b.start < w.end and w.start < b.end for b in bwd)
    return n


def next_forward_waits_for_last_update(rec: Recorder) -> list[str]:
    """Steps whose next forward is launched only after the step's last update ended."""
    bad = []
    spans = _steps(rec)
    for (lo, hi), (lo2, hi2) in zip(spans, spans[1:]):
        ends = [w.end for w in rec.host_work_spans if w.label.startswith("adam") and _in(lo, hi, w.seq)]
        fwd = [o for o in rec.kernels("fwd") if _in(lo2, hi2, o.seq)]
        if ends and fwd and fwd[0].issued >= max(ends):
            bad.append(f"step {lo}: forward launched at {fwd[0].issued:.2f}, last update ended {max(ends):.2f}")
    return bad


# -- the tests ------------------------------------------------------------------------------------


def test_autograds_thread_never_blocks_during_backward():
    assert launch_thread_blocks(recorded()) == []


def test_negative_control_updates_on_autograds_thread_block_it():
    bad = launch_thread_blocks(recorded(cfg(worker="off")))
    assert any(b.startswith("adam") for b in bad) and any(b.startswith("event d2h") for b in bad), bad


def test_upload_of_unit_k_waits_only_on_unit_ks_reduce():
    assert uploads_waiting_late(recorded(worker_delay=0.05)) == []


def test_negative_control_upload_after_all_compute_waits_late(monkeypatch):
    inner = ShardedOptimizer._upload

    def upload_after_everything(self, t, unit, src, device, after):
        return inner(self, t, unit, src, device, None)  # wait_stream(current): the old wait

    monkeypatch.setattr(ShardedOptimizer, "_upload", upload_after_everything)
    bad = uploads_waiting_late(recorded(worker_delay=0.3, jitter=False))
    assert bad, "the upload waiting on all compute went unnoticed"


def _uploads_at_step_after_an_eval_forward() -> tuple[list, int]:
    """The first step updates at step(); the user runs a forward between backward and step."""
    rec = Recorder(delay=0.005)
    with using(rec):
        torch.manual_seed(0)
        engine = offload.initialize(TinyGPT(n_layer=3), cfg())
        _kernels(engine, rec)
        (x, y), = gpt_batches(1)
        engine.backward(engine(x, y))
        with torch.no_grad():
            engine(x, y)
        last_fwd = max(o.seq for o in rec.kernels("fwd"))
        engine.step()
        engine.close()
    rec.close()
    return [o for o in rec.ops if o.label.startswith("upload")], last_fwd


def test_an_upload_at_step_waits_for_the_users_work_since_backward():
    uploads, last_fwd = _uploads_at_step_after_an_eval_forward()
    assert len(uploads) >= 3 and all(any(w.seq >= last_fwd for w in up.waits) for up in uploads)


def test_negative_control_an_upload_at_step_after_its_gradient_only_is_caught(monkeypatch):
    inner = GradShard.wait_arrived
    monkeypatch.setattr(GradShard, "wait_arrived", lambda self, keep_event=True: inner(self))
    uploads, last_fwd = _uploads_at_step_after_an_eval_forward()
    assert uploads and not all(any(w.seq >= last_fwd for w in up.waits) for up in uploads)


def test_an_update_overlaps_a_later_units_backward():
    # The first step updates at step() (the update mode is learned: docs/prefetch.md).
    assert updates_overlapping_backward(recorded()) >= STEPS - 1


def test_negative_control_serial_updates_overlap_nothing():
    assert updates_overlapping_backward(recorded(cfg(worker="off"))) == 0


def device_syncs_in_step(rec: Recorder) -> list[str]:
    """Host waits for the whole compute stream on the main thread."""
    return [f"{w.what} at {w.seq}" for w in rec.host_waits if w.thread == "main" and w.what == "stream compute"]


def test_step_does_not_synchronize_the_device_when_the_updates_ran_in_backward():
    rec = recorded()
    first = _steps(rec)[1][0]  # the first step updates at step(): its host shards need the sync
    assert [w for w in device_syncs_in_step(rec) if int(w.split()[-1]) > first] == []


def test_negative_control_a_device_sync_in_step_is_seen(monkeypatch):
    monkeypatch.setattr(StepPolicy, "updates_at_step", lambda self: True)
    assert len(device_syncs_in_step(recorded())) == STEPS


# -- exactness with delays -----------------------------------------------------------------------


def _same(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


@pytest.mark.parametrize("dtype,tier", [("bf16", "device"), ("fp32", "device"), ("bf16", "cpu")])
def test_bit_identical_to_the_serial_path_with_random_delays(dtype, tier):
    serial = train(cfg(worker="off", dtype=dtype, param_tier=tier), None)
    for seed in (1, 2):
        rec = Recorder(delay=0.01, worker_delay=0.01, seed=seed)
        assert _same(train(cfg(worker="on", dtype=dtype, param_tier=tier), rec), serial) == []
    rec = Recorder(delay=0.01, seed=3)  # the serial path on the recorder: the same too
    assert _same(train(cfg(worker="off", dtype=dtype, param_tier=tier), rec), serial) == []


def _ws2(rank: int, world_size: int, recorded_run: bool) -> dict:
    rec = Recorder(delay=0.01, worker_delay=0.01, seed=rank) if recorded_run else None
    sd = train(cfg(worker="on" if recorded_run else "off"), rec, rank=rank, world_size=world_size)
    assert rec is None or any(o.label.startswith("d2h") for o in rec.ops)  # the GPU path ran
    return sd


def test_bit_identical_at_world_size_2():
    on = run_distributed(_ws2, 2, True)
    off = run_distributed(_ws2, 2, False)
    for r in range(2):
        assert _same(on[r], off[r]) == []


def _ws2_blocks(rank: int, world_size: int, flags_at_once: bool) -> list[str]:
    if flags_at_once:  # the ranks' agreement on a unit read back on autograd's thread
        import offload.runtime.optimizer_step as step_module
        from offload.units.collectives import all_reduce_host

        def at_once(t, op, pg, device):
            out = all_reduce_host(t, op, pg, device)
            return lambda: out

        step_module.all_reduce_host_later = at_once
    rec = Recorder(delay=0.005, seed=rank)
    train(cfg(), rec, rank=rank, world_size=world_size)
    return launch_thread_blocks(rec)


def test_at_world_size_2_autograds_thread_never_blocks_during_backward():
    assert run_distributed(_ws2_blocks, 2, False) == [[], []]


def test_negative_control_the_ranks_agreement_read_at_once_blocks_it():
    out = run_distributed(_ws2_blocks, 2, True)
    assert all(any("blocking copy" in b for b in r) for r in out), out


def test_negative_control_a_worker_that_does_not_wait_for_its_gradient_differs(monkeypatch):
    serial = train(cfg(worker="off"), None)

    def no_wait(self: GradShard, keep_event: bool = True) -> None:
        self.arrived, self.ready = self.ready, None  # forgets to wait for the copy down

    monkeypatch.setattr(GradShard, "wait_arrived", no_wait)
    rec = Recorder(delay=0.3, jitter=False)  # every copy down lands well after the update read it
    assert _same(train(cfg(worker="on"), rec), serial), "the missing wait went unnoticed"
