"""Prefetch scheduling, kept units, the optimizer in backward, and the timeline (issue 7).

Correctness first: with prefetch on, every parameter tier x optimizer tier trains to the
same parameters as plain torch.optim.AdamW (fp32, within the per-tensor bound measured
against a float64 run: tests/parity.py) and bit-identically to the same engine
with prefetch, keeping and the optimizer in backward all off: scheduling moves bytes
earlier, it never changes the arithmetic (the same kernel runs on the same inputs, only at
another moment). Both with updates during backward (no clipping, one micro-batch) and
deferred to step() (clipping and accumulation), at world sizes 1 and 2, and with a model
whose unit order changes between steps. Then what the schedule does: reads start before
the previous unit's compute ends (from the timeline), kept units are not fetched again,
the trace follows order changes, and the stats and Chrome trace are what they claim.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import warnings
from typing import Any, Optional

import pytest
import torch
from torch import nn

import offload
from offload.config import Config, OffloadConfig, OptimizerConfig, PrecisionConfig, PrefetchConfig, TimelineConfig
from offload.runtime.schedule import Schedule
from tests.conftest import TinyGPT, gpt_batches, lm_loss, run_distributed
from tests.parity import Fp32Bound, plain_loop
from tests.test_engine import LR, WD

STEPS = 20
TIERS = [(p, o) for p in ("device", "cpu", "nvme") for o in ("cpu", "nvme")]
ON = PrefetchConfig()
OFF = PrefetchConfig(prefetch_bytes=0, keep_bytes=0, optimizer_in_backward=False)
# (gradient accumulation, clipping): the first lets every unit update during backward, the
# second defers the update to step() (the global norm is known only at the end).
MODES = {"in_backward": (1, 0.0), "deferred": (2, 0.05)}


class RoutedGPT(TinyGPT):
    """TinyGPT whose blocks run in `self.route` order (set before each step): the unit
    order changes between steps, and a block left out gets no gradient that step."""

    def __init__(self) -> None:
        super().__init__(n_layer=3)
        self.route: list[int] = [0, 1, 2]

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for i in self.route:
            x = self.blocks[i](x)
        logits = self.lm_head(self.ln_f(x))
        return lm_loss(logits, targets)


ROUTES = [[0, 1, 2], [0, 1, 2], [0, 1, 2], [2, 1, 0], [2, 1, 0], [0, 2], [0, 1, 2]]


def route_of(step: int) -> list[int]:
    return ROUTES[step % len(ROUTES)]


def build(model: str) -> nn.Module:
    torch.manual_seed(0)
    return RoutedGPT() if model == "routed" else TinyGPT(n_layer=3)


def config(
    path: Any = None, param_tier: str = "cpu", optimizer_tier: str = "cpu", *,
    mode: str = "in_backward", prefetch: PrefetchConfig = ON, dtype: str = "fp32",
    budget: int = 1 << 30, timeline: Optional[TimelineConfig] = None,
) -> Config:
    gas, clip = MODES[mode]
    uses = "nvme" in (param_tier, optimizer_tier)
    return Config(
        compute_device="cpu",
        optimizer=OptimizerConfig(lr=LR, weight_decay=WD),
        precision=PrecisionConfig(dtype=dtype),
        gradient_accumulation_steps=gas,
        gradient_clipping=clip,
        offload=OffloadConfig(
            param_tier=param_tier, optimizer_tier=optimizer_tier,
            nvme_path=str(path) if uses else None, pinned_budget_bytes=budget,
        ),
        prefetch=prefetch,
        timeline=timeline or TimelineConfig(),
        nonfinite_loss="off",  # the updates in backward are what "in_backward" tests: guard off
    )


def train(model: str, cfg: Config, rank: int = 0, world_size: int = 1, steps: int = STEPS):
    """The engine's loop; returns (full_state_dict, [step_stats per step], engine facts)."""
    m = build(model)
    engine = offload.initialize(m, cfg)
    stats = []
    try:
        for i, (x, y) in enumerate(gpt_batches(steps)):
            if model == "routed":
                m.route = route_of(i // cfg.gradient_accumulation_steps)
            n = x.shape[0] // world_size
            engine.backward(engine(x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]))
            engine.step()
            if engine.micro_steps % cfg.gradient_accumulation_steps == 0:  # a step completed
                stats.append(engine.step_stats())
        facts = {
            "retraces": engine.gather.schedule.retraces,
            "peak_pinned": engine.nvme.staging.pool.peak_bytes_in_use if engine.nvme else 0,
            "full_bytes": list(engine.gather.schedule.full_bytes),
        }
        sd = engine.full_state_dict()
    finally:
        engine.close()
    return sd, stats, facts


@functools.lru_cache(maxsize=None)
def reference(model: str, mode: str, steps: int = STEPS) -> Fp32Bound:
    """The measured fp32 bound of plain torch.optim.AdamW on the same model and batches."""
    gas, clip = MODES[mode]

    def route(m: nn.Module, i: int) -> None:
        if model == "routed":
            m.route = route_of(i // gas)

    return Fp32Bound.measure(lambda **o: plain_loop(
        lambda: build(model), gpt_batches(steps), lr=LR, weight_decay=WD, gas=gas, clip=clip,
        before_forward=route, **o,
    ))


# -- parity ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def scheduled_off():
    """The all-in-memory engine with every scheduling feature off, per (model, mode)."""
    return {
        (model, mode): train(model, config(mode=mode, prefetch=OFF))[0]
        for model in ("gpt", "routed") for mode in MODES
    }


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("param_tier,optimizer_tier", TIERS)
def test_every_tier_with_prefetch_matches_adamw(param_tier, optimizer_tier, mode, scheduled_off, tmp_path):
    sd, stats, _ = train("gpt", config(tmp_path, param_tier, optimizer_tier, mode=mode))
    base = scheduled_off[("gpt", mode)]
    for k, v in base.items():
        assert torch.equal(sd[k], v), k
    reference("gpt", mode).check(sd, f"prefetch, params {param_tier} optimizer {optimizer_tier}, {mode}")
    last = stats[-1]
    if mode == "in_backward":
        # every unit (the root included) updated while backward ran
        assert last["optimizer_in_backward_units"] == 4
    else:
        assert last["optimizer_in_backward_units"] == 0
    if param_tier == "nvme":
        # after the tracing step, every block's fetch was issued ahead of its use; only the
        # root's, at the start of each micro-batch, has nothing before it
        gas = MODES[mode][0]
        assert last["prefetched"] >= 3 * gas and last["on_demand"] <= gas, last


@pytest.mark.parametrize("mode", list(MODES))
def test_order_changing_model_retraces_and_stays_exact(mode, scheduled_off, tmp_path):
    sd, stats, facts = train("routed", config(tmp_path, "nvme", "nvme", mode=mode))
    for k, v in scheduled_off[("routed", mode)].items():
        assert torch.equal(sd[k], v), k
    reference("routed", mode).check(sd, f"prefetch, routed model, {mode}")
    # the route changes at steps 3, 5, 6 (and back at 7 ...): each change leaves the trace
    assert facts["retraces"] >= 3
    assert any(s["off_trace"] for s in stats)
    assert not all(s["off_trace"] for s in stats)


def test_budget_of_one_unit_still_exact(tmp_path, scheduled_off):
    """Prefetched shards and states compete for a pinned pool that holds one unit's working
    set: prefetches are dropped for buffers needed now, never deadlock, never exceed it."""
    m = build("gpt")
    probe = offload.initialize(m, config(tmp_path, "nvme", "nvme"))
    need = max(
        lay.nbytes + (-(-st.unit.layout.shard_numel * 4 // 4096) * 4096)
        for lay, st in zip(probe.optimizer_states.layouts, probe.states)
    )
    probe.close()
    sd, stats, facts = train("gpt", config(tmp_path, "nvme", "nvme", budget=need))
    for k, v in scheduled_off[("gpt", "in_backward")].items():
        assert torch.equal(sd[k], v), k
    assert 0 < facts["peak_pinned"] <= need


WS2_STEPS = 10


def _ws2(rank: int, world_size: int, path: str) -> dict[str, Any]:
    out = {}
    for mode in MODES:
        for p, o in (("nvme", "nvme"), ("cpu", "cpu"), ("device", "nvme")):
            sd, stats, _ = train("gpt", config(path, p, o, mode=mode), rank, world_size, WS2_STEPS)
            out[(p, o, mode)] = (sd, stats[-1])
        out[("off", mode)] = train("gpt", config(mode=mode, prefetch=OFF), rank, world_size, WS2_STEPS)[0]
    sd, stats, facts = train("routed", config(path, "nvme", "nvme"), rank, world_size, WS2_STEPS)
    out["routed"] = (sd, facts["retraces"])
    return out


def _ws2_overlap(rank: int, world_size: int, path: str) -> list[tuple[str, str, float, float]]:
    cfg = config(path, "nvme", "nvme", timeline=TimelineConfig(enabled=True))
    m = build("gpt")
    engine = offload.initialize(m, cfg)
    for x, y in gpt_batches(3):
        n = x.shape[0] // world_size
        engine.backward(engine(x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]))
        engine.step()
    spans = [(s.cat, s.name, s.start, s.end, s.track) for s in engine.timeline.last.spans]
    engine.close()
    return spans


def test_gradient_reduce_overlaps_the_backward_of_the_unit_before(tmp_path):
    """World size 2: unit k's reduce-scatter is issued when its backward ends and completes
    only after unit k-1's backward began (gloo runs it meanwhile); the update follows. And
    the all-gather of the next unit is issued before the current unit's forward compute
    ends (the last stage of the chain, ahead of use)."""
    for spans in run_distributed(_ws2_overlap, 2, str(tmp_path)):
        by = {(c, n): (a, b) for c, n, a, b, _ in spans}
        ahead = {n: (a, b) for c, n, a, b, track in spans if c == "gather" and track == "comm"}
        for k, nxt in (("blocks.0", "blocks.1"), ("blocks.1", "blocks.2")):
            fwd_end = by[("compute", f"fwd {k}")][1]
            assert ahead[f"gather {nxt}"][0] < fwd_end, (nxt, ahead[f"gather {nxt}"], fwd_end)
        for k, prev in (("blocks.2", "blocks.1"), ("blocks.1", "blocks.0")):
            issued, done = by[("reduce", f"reduce {k}")]
            bwd_prev_start = by[("compute", f"bwd {prev}")][0]
            assert issued < bwd_prev_start < done, (k, issued, bwd_prev_start, done)
            assert by[("optimizer", f"adam {k}")][0] >= done


def test_world_size_2_with_prefetch_matches_adamw(tmp_path, scheduled_off):
    r0, r1 = run_distributed(_ws2, 2, str(tmp_path))
    for mode in MODES:
        off = r0[("off", mode)]
        reference("gpt", mode, WS2_STEPS).check(off, f"ws2 prefetch off, {mode}")
        for key in (("nvme", "nvme", mode), ("cpu", "cpu", mode), ("device", "nvme", mode)):
            sd, last = r0[key]
            assert r1[key][0] == {}  # full_state_dict lands on rank 0
            for k, v in off.items():
                assert torch.equal(sd[k], v), (key, k)
            assert last["optimizer_in_backward_units"] == (4 if mode == "in_backward" else 0), key
            if key[0] == "nvme":
                assert last["prefetched"] >= 3, (key, last)
    sd, retraces = r0["routed"]
    assert retraces >= 2 and r1["routed"][1] == retraces  # route changes at steps 3, 5, 6
    reference("routed", "in_backward", WS2_STEPS).check(sd, "ws2 routed model")


# -- what the schedule does --------------------------------------------------------------------


def test_reads_start_before_the_previous_unit_finishes_computing(tmp_path):
    """From the timeline: in a step that follows the trace, unit k+1's shard read was
    submitted before unit k's forward compute ended (prefetch ran ahead), and the Chrome
    trace on disk holds those spans."""
    trace_path = tmp_path / "trace.json"
    cfg = config(tmp_path, "nvme", "nvme", timeline=TimelineConfig(enabled=True, path=str(trace_path)),
                 prefetch=PrefetchConfig(keep_bytes=0))
    m = build("gpt")
    engine = offload.initialize(m, cfg)
    for x, y in gpt_batches(3):
        engine.backward(engine(x, y))
        engine.step()
    step = engine.timeline.last
    engine.close()
    spans = {(s.cat, s.name): s for s in step.spans}
    names = [u for u in ("blocks.0", "blocks.1", "blocks.2")]
    ran_ahead = 0
    for a, b in zip(names, names[1:]):
        fwd_a = spans[("compute", f"fwd {a}")]
        read_b = [s for s in step.spans if s.cat == "read" and s.name == f"read {b}"]
        assert read_b, f"no read of {b} recorded"
        first = min(read_b, key=lambda s: s.start)
        assert first.args["ahead"], f"{b} was fetched on demand"
        assert first.start < fwd_a.end, (b, first.start, fwd_a.end)
        ran_ahead += 1
    assert ran_ahead == 2
    data = json.loads(trace_path.read_text())
    events = [e for e in data["traceEvents"] if e.get("ph") == "X"]
    cats = {e["cat"] for e in events}
    assert {"read", "gather", "compute", "reduce", "optimizer"} <= cats, cats
    assert all(e["dur"] >= 0 for e in events)
    stats = [e for e in data["traceEvents"] if e.get("ph") == "i"]
    assert stats and "stall_s" in stats[-1]["args"]


def test_kept_units_are_not_fetched_again_in_backward(tmp_path):
    """With keep_bytes for every block, the blocks stay gathered from their forward to their
    backward: per step, the root and 3 blocks are fetched once each (7 without keeping)."""
    fetched = {}
    for keep in (0, 1 << 30):
        _, stats, _ = train("gpt", config(tmp_path, "nvme", "cpu", prefetch=PrefetchConfig(keep_bytes=keep)), steps=4)
        last = stats[-1]
        fetched[keep] = last["prefetched"] + last["on_demand"]
    assert fetched == {0: 7, 1 << 30: 4}


def test_the_next_unit_is_fetched_ahead_even_when_larger_than_the_budget():
    """F8: a unit larger than prefetch_bytes (a 7B-class layer against the 256 MiB default)
    is still fetched one ahead; the budget limits what comes after it."""
    s = Schedule([0, 400, 400, 100], prefetch_bytes=256, keep_bytes=0, pinned=[0])
    s.begin("train")
    for u in range(4):
        s.use(u, "f")
    s.end()  # the trace is recorded; the next iteration follows it
    s.begin("train")
    assert s.use(0, "f") and s.ahead() == [1]  # 400 > 256, but the next one
    assert s.use(1, "f") and s.ahead() == [2]  # and only it
    assert s.use(2, "f") and s.ahead() == [3]
    s.end()
    off = Schedule([0, 400], prefetch_bytes=0, keep_bytes=0, pinned=[0])
    off.begin("train")
    off.use(0, "f")
    off.use(1, "f")
    off.end()
    off.begin("train")
    off.use(0, "f")
    assert off.ahead() == []  # 0 still means on demand


def test_keep_budget_keeps_only_the_last_blocks():
    """Pure schedule logic: the trace's last forward units whose bytes fit keep_bytes."""
    s = Schedule([0, 100, 100, 100], prefetch_bytes=150, keep_bytes=200, pinned=[0])
    trace = [(0, "f"), (1, "f"), (2, "f"), (3, "f"), (3, "b"), (2, "b"), (1, "b")]
    s.begin("train")
    for u, ph in trace:
        s.use(u, ph)
    assert s.end()
    s.begin("train")
    assert s.use(0, "f") and s.ahead() == [1]  # 150 bytes: one unit of 100
    assert s.keep_after_forward(3) and s.keep_after_forward(2) and not s.keep_after_forward(1)
    assert s.use(1, "f") and s.next_uses("b", 2) == [3, 2]
    assert not s.use(3, "f")  # off trace: skipped unit 2
    assert s.ahead() == [] and not s.keep_after_forward(3)
    s.use(3, "b")
    assert s.end() and s.retraces == 1  # the new order is the trace now
    s.begin("eval")  # another kind of iteration has its own (no) trace
    assert not s.use(0, "f")
    s.end()
    s.begin("train")
    assert s.use(0, "f") and s.use(1, "f") and s.use(3, "f")


def test_stall_and_overlap_stats_are_consistent(tmp_path):
    _, stats, _ = train("gpt", config(tmp_path, "nvme", "nvme"), steps=4)
    for s in stats:
        assert s["step_s"] > 0
        parts = s["io_wait_s"] + s["copy_wait_s"] + s["collective_s"]
        assert math.isclose(s["stall_s"], parts, rel_tol=1e-9, abs_tol=1e-12)
        # the breakdowns are parts of the I/O wait (no CUDA copies here)
        assert s["copy_wait_s"] == 0.0
        # (each measured around its own waits: clock reads apart by microseconds)
        assert s["fetch_wait_s"] + s["optimizer_io_s"] <= s["io_wait_s"] + 5e-4
        assert 0 <= s["stall_fraction"] < 1
        assert 0 < s["optimizer_s"] < s["step_s"]


def test_timeline_off_records_no_spans_but_stats(tmp_path):
    m = build("gpt")
    engine = offload.initialize(m, config(tmp_path, "nvme", "nvme"))
    assert engine.step_stats() is None
    for x, y in gpt_batches(2):
        engine.backward(engine(x, y))
        engine.step()
    assert engine.timeline.last.spans == []
    assert engine.timeline.chrome_trace() == {"traceEvents": [], "displayTimeUnit": "ms"}
    assert engine.step_stats()["step"] == 1
    engine.close()


def test_changing_the_lr_between_backward_and_step_warns():
    m = build("gpt")
    engine = offload.initialize(m, config())
    x, y = gpt_batches(1)[0]
    engine.backward(engine(x, y))
    engine.optimizer.param_groups[0]["lr"] = LR / 2
    with pytest.warns(RuntimeWarning, match="changed between engine.backward"):
        engine.step()
    engine.backward(engine(x, y))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # unchanged now: no warning
        engine.step()
    engine.close()


def test_gradient_shards_are_transient_when_every_update_runs_in_backward(tmp_path):
    """A CPU run that updates every unit during backward holds no fp32 gradient shard
    between steps (4 bytes per parameter less host memory); with clipping it must keep them
    (the norm needs all), and both train the same as before (parity tests above)."""
    held = {}
    for mode in MODES:
        m = build("gpt")
        engine = offload.initialize(m, config(tmp_path, "cpu", "nvme", mode=mode))
        for x, y in gpt_batches(2):
            engine.backward(engine(x, y))
            engine.step()
        held[mode] = sum(st.grad.untyped_storage().nbytes() for st in engine.states)
        shard_bytes = sum(st.grad.numel() * 4 for st in engine.states)
        engine.close()
    assert held["in_backward"] == 0
    assert held["deferred"] == shard_bytes > 0


# -- CUDA (skipped without a GPU) ----------------------------------------------------------------


def train_gpt(cfg: Config, steps: int) -> tuple[dict, Any]:
    """The tests' GPT trained `steps` steps under `cfg`: (full state dict, last step_stats)."""
    engine = offload.initialize(build("gpt"), cfg)
    for x, y in gpt_batches(steps):
        engine.backward(engine(x, y))
        engine.step()
    stats = engine.step_stats()
    sd = engine.full_state_dict()
    engine.close()
    return sd, stats


@pytest.mark.cuda
@pytest.mark.parametrize("param_tier,optimizer_tier", [("cpu", "cpu"), ("nvme", "nvme"), ("device", "nvme")])
@pytest.mark.parametrize("mode", list(MODES))
def test_cuda_prefetch_is_bit_identical_to_on_demand(param_tier, optimizer_tier, mode, tmp_path):
    """On a GPU the host tier's shards are copied up on a side stream ahead of use and the
    NVMe reads land in pinned buffers: the same GPU run with every scheduling feature off
    must give the same bits (same kernels, same inputs), and prefetch must have run."""

    def run(prefetch: PrefetchConfig):
        cfg = config(tmp_path, param_tier, optimizer_tier, mode=mode, prefetch=prefetch)
        return train_gpt(dataclasses.replace(cfg, compute_device="cuda"), steps=6)

    on, stats = run(ON)
    off, _ = run(OFF)
    for k, v in off.items():
        assert torch.equal(on[k], v), k
    if param_tier in ("cpu", "nvme"):
        assert stats["prefetched"] >= 3, stats
