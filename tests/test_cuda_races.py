"""The GPU path right by construction (issue #30): races, devices, RNG.

- Delay injection: every side-stream copy (a host shard copied up ahead of use, an
  activation copied to the host) is held back by `torch.cuda._sleep` queued on its stream
  first. A missing wait between the side stream and the compute stream then reads bytes that
  are not there yet; with the waits right, the trained bits are unchanged. (The probe
  `tools/gpu_check.sh` runs as its `races` phase, and under TORCH_CUDA_SANITIZER.)
- `compute_device: auto` names the GPU with its index, so device-tier units alias their
  shard (F2): no copy per use, no second full buffer.
- Dropout inside a region whose inputs are offloaded to the host recomputes the same masks
  (F3): gradients equal torch's own checkpoint's.

The CPU tests check the device logic that does not need a GPU.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import offload
import offload.checkpointing as ckpt
from offload.config import Config, OffloadConfig, PrefetchConfig
from offload.devices import canonical, same_device
from offload.units.collectives import resolve_device
from tests.conftest import gpt_batches
from tests.test_prefetch import build, config, train_gpt

SLEEP_CYCLES = 5_000_000
"""About 3 ms at the H100's clock: far longer than any copy of the tiny model's shards."""


# -- CPU: the device helpers ---------------------------------------------------------------------


def test_same_device_fills_the_index():
    assert same_device("cpu", torch.device("cpu"))
    assert not same_device("cpu", "meta")
    assert same_device(torch.device("cuda", 1), "cuda:1")
    assert not same_device("cuda:0", "cuda:1")
    assert canonical("cpu") == torch.device("cpu")


def test_auto_resolves_to_an_indexed_gpu(monkeypatch):
    """'auto' goes through the 'cuda' branch (the current device's index), so that
    `shard.device == device` holds for a shard allocated there (F2). The CUDA calls are
    stood in for: this machine has no GPU (the cuda test below runs the real one)."""
    assert resolve_device("auto") == torch.device("cpu") or torch.cuda.is_available()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert resolve_device("auto") == torch.device("cuda", 3)
    assert resolve_device("cuda") == torch.device("cuda", 3)
    assert same_device("cuda", "cuda:3") and not same_device("cuda", "cuda:0")


# -- CUDA ----------------------------------------------------------------------------------------


def _slow_streams(monkeypatch) -> None:
    """Queue a long sleep on each side stream before its copy is queued."""
    from offload.runtime import activations, prefetch

    orig_copy = prefetch._CudaCopy.__init__

    def slow_copy(self, unit, stream):
        with torch.cuda.stream(stream):
            torch.cuda._sleep(SLEEP_CYCLES)
        orig_copy(self, unit, stream)

    monkeypatch.setattr(prefetch._CudaCopy, "__init__", slow_copy)
    orig_stream = activations._side_stream

    def slow_stream(device):
        s = orig_stream(device)
        with torch.cuda.stream(s):
            torch.cuda._sleep(SLEEP_CYCLES)
        return s

    monkeypatch.setattr(activations, "_side_stream", slow_stream)


def _train(cfg: Config, steps: int = 4):
    return train_gpt(cfg, steps)


@pytest.mark.cuda
@pytest.mark.parametrize("param_tier,optimizer_tier", [("cpu", "cpu"), ("nvme", "nvme")])
def test_slowed_side_stream_copies_keep_the_bits(param_tier, optimizer_tier, tmp_path, monkeypatch):
    cfg = dataclasses.replace(config(tmp_path, param_tier, optimizer_tier, prefetch=PrefetchConfig()),
                              compute_device="cuda")
    ref, _ = _train(cfg)
    _slow_streams(monkeypatch)
    slow, stats = _train(cfg)
    assert stats["prefetched"] >= 1, stats  # the slowed path ran
    for k, v in ref.items():
        assert torch.equal(slow[k], v), k


@pytest.mark.cuda
def test_an_nvme_shards_copy_up_does_not_wait_for_the_compute_stream(tmp_path, monkeypatch):
    """F8: an NVMe shard read into a pinned pooled buffer is copied into its unit's slot by
    work queued on the compute stream, and the buffer goes back to the pool on an event
    behind that copy: the CPU does not wait for the GPU to drain (it did: a blocking copy per
    unit). With a long sleep queued on the compute stream before every gather, the stream is
    still busy when each gather returns, and with a small pool (buffers reused at once: a
    buffer given back before its copy ran would be overwritten by the next read) the trained
    bits are unchanged."""
    from offload.runtime.gather import Gatherer

    cfg = dataclasses.replace(config(tmp_path, "nvme", "cpu", prefetch=PrefetchConfig(), budget=1 << 19),
                              compute_device="cuda")
    ref, _ = _train(cfg)
    busy: list[bool] = []
    orig = Gatherer._gather

    def held_back_gather(self, unit):
        copies = not unit.is_gathered and not unit.gathering
        torch.cuda._sleep(20 * SLEEP_CYCLES)  # ~60 ms of queued compute-stream work
        orig(self, unit)
        if copies:
            busy.append(not torch.cuda.current_stream(unit.device).query())

    monkeypatch.setattr(Gatherer, "_gather", held_back_gather)
    slow, _ = _train(cfg)
    assert busy and all(busy), busy  # no gather drained the stream
    for k, v in ref.items():
        assert torch.equal(slow[k], v), k


@pytest.mark.cuda
def test_compute_device_auto_aliases_device_tier_units(tmp_path):
    cfg = Config(compute_device="auto", offload=OffloadConfig(param_tier="device"), precision={"dtype": "bf16"})
    engine = offload.initialize(build("gpt"), cfg)
    assert engine.device.index is not None
    assert all(u.aliased for u in engine.units), [u.aliased for u in engine.units]
    x, y = gpt_batches(1)[0]
    engine.backward(engine(x, y))
    engine.step()
    shard_bytes = sum(u.layout.shard_numel * 2 for u in engine.units)
    assert engine.memory_bytes()["device"] <= shard_bytes * 1.01 + (1 << 20)
    engine.close()


class DropoutBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.drop(torch.nn.functional.gelu(self.fc1(x))))


@pytest.mark.cuda
def test_dropout_masks_survive_activation_offload(monkeypatch):
    """The recomputation under CPU-offloaded inputs draws the same dropout masks as the
    forward (the CUDA RNG state is stashed with the region): gradients equal torch's own
    checkpoint's, bit for bit, with the side stream's copies slowed down."""
    dev = torch.device("cuda")
    torch.manual_seed(0)
    blocks = nn.ModuleList(DropoutBlock(64) for _ in range(3)).to(dev)
    x0 = torch.randn(4, 32, 64, device=dev)

    def run(cpu_offload: bool):
        ckpt.reset()
        blocks.zero_grad(set_to_none=True)
        torch.cuda.manual_seed(1234)
        h = x0.clone().requires_grad_(True)
        for b in blocks:
            if cpu_offload:
                h = ckpt.checkpoint(b, h, cpu_offload=True)
            else:
                h = torch.utils.checkpoint.checkpoint(b, h, use_reentrant=False)
        h.square().mean().backward()
        return {n: p.grad.clone() for n, p in blocks.named_parameters()}

    g_torch = run(False)
    _slow_streams(monkeypatch)  # and the host copies held back on their stream
    g_off = run(True)
    ckpt.reset()
    for k in g_torch:
        assert torch.equal(g_off[k], g_torch[k]), k


def test_a_unit_being_gathered_is_never_fetched_again():
    """F1: after its forward, the schedule asks for the units ahead, and one of them may
    have its all-gather in flight already (issued under the previous unit's compute); a
    second fetch would copy into the buffer the gather reads (CUDA: and free it). The
    prefetcher starts fetches for sharded units only."""
    from offload.runtime.prefetch import Prefetcher
    from offload.runtime.timeline import Timeline
    from offload.units.shard import UnitState

    class Tier:
        addressable = False
        device = torch.device("cpu")
        fetched: list = []

        def fetch_ahead(self, key, block):
            self.fetched.append(key)
            return None  # no buffer free now

        def keep_after_store(self, keys):
            pass

    class Unit:
        reads_into_full = False

        def __init__(self, index, state):
            self.index, self.key, self.state = index, index, state
            self.tier, self.device = Tier(), torch.device("cpu")

        @property
        def is_sharded(self):
            return self.state is UnitState.SHARDED

        @property
        def is_gathered(self):
            return self.state is UnitState.GATHERED

    units = [Unit(0, UnitState.GATHERING), Unit(1, UnitState.GATHERED), Unit(2, UnitState.SHARDED)]
    pf = Prefetcher(units, Tier(), Timeline(False))
    assert not pf.start(0) and not pf.start(1)
    assert Tier.fetched == []
    pf.start_in_order([0, 1, 2])
    assert Tier.fetched == [2]  # the sharded one only


@pytest.mark.cuda
def test_pinned_buffers_lock_exactly_their_size():
    """F5: a long-lived pinned buffer holds its size in locked memory, not the next power
    of two (torch's pinned allocator: 768 MiB + a page would take 1 GiB), and gives it back
    when its last view goes."""
    import gc

    from offload.storage.pinned import pinned_empty

    def rss() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

    n = 3 * 2**28 + 4096
    slack = 64 << 20
    gc.collect()
    before = rss()
    t = pinned_empty(n, torch.float32)
    grown = rss() - before
    assert t.is_pinned() and t.data_ptr() % 4096 == 0 and t.numel() * 4 == n
    assert n - slack <= grown <= n + slack, (grown, n)
    assert not t[:: 1 << 18].any()  # zero-filled
    d = torch.randn(n // 4, device="cuda")
    t.copy_(d, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(t[:1000], d[:1000].cpu())
    view = t[10:20]
    del t, d
    gc.collect()
    assert rss() - before >= n - slack  # a view keeps the buffer
    del view
    gc.collect()
    assert rss() - before <= slack, rss() - before
