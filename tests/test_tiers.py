"""The tier interface: allocate, fetch, store, view, free, and the bytes it reports."""

from __future__ import annotations

import pytest
import torch

from offload.storage.tier_kind import TierKind, make_param_tier
from offload.storage.tiers import DeviceTier, HostTier


@pytest.mark.parametrize("make", [lambda: DeviceTier(torch.device("cpu")), lambda: HostTier(pin_memory=True)])
def test_roundtrip_and_accounting(make):
    tier = make()
    shard = tier.allocate("u0", 100, torch.bfloat16)
    assert torch.count_nonzero(shard) == 0  # zero-filled
    src = torch.arange(100, dtype=torch.bfloat16)
    tier.store("u0", src)
    out = torch.empty(100, dtype=torch.bfloat16)
    tier.fetch("u0", out)
    assert torch.equal(out, src)
    assert torch.equal(tier.view("u0"), src)
    assert tier.bytes_allocated() == 200
    tier.allocate("u1", 10, torch.float32)
    assert tier.bytes_allocated() == 240
    tier.free("u0")
    assert tier.bytes_allocated() == 40
    assert "u0" not in tier and "u1" in tier


def test_mismatched_buffer_is_a_clear_error():
    tier = HostTier(pin_memory=False)
    tier.allocate("u", 8, torch.float32)
    with pytest.raises(ValueError, match="8 x torch.float32"):
        tier.fetch("u", torch.empty(9))
    with pytest.raises(ValueError, match="must match"):
        tier.store("u", torch.empty(8, dtype=torch.bfloat16))
    with pytest.raises(KeyError, match="already allocated"):
        tier.allocate("u", 8, torch.float32)


def test_adopt_shares_bytes_and_counts_once():
    tier = HostTier(pin_memory=False)
    master = torch.zeros(16)
    tier.adopt("u", master)
    master.fill_(3.0)
    assert torch.equal(tier.view("u"), master)
    assert tier.bytes_allocated() == 64
    with pytest.raises(ValueError, match="contiguous"):
        tier.adopt("v", torch.zeros(4, 4).t())


def test_host_tier_does_not_pin_without_cuda():
    assert HostTier(pin_memory=True).pin_memory == torch.cuda.is_available()


def test_param_tier_choice():
    cpu = torch.device("cpu")
    assert make_param_tier("device", cpu, True).kind == "device"
    assert make_param_tier("cpu", cpu, True).kind == "host"
    with pytest.raises(ValueError, match="needs the rank's NVMe context"):
        make_param_tier("nvme", cpu, True)
    with pytest.raises(ValueError, match="offload.param_tier='disk'; allowed: 'device', 'cpu', 'nvme'"):
        make_param_tier("disk", cpu, True)


def test_each_tier_kind_is_one_spec_and_its_factory_builds_its_class():
    """Issue #32: placement, the builder, the planner and compat read the kind's spec instead
    of matching "device"/"cpu"/"nvme" in each file."""
    cpu = torch.device("cpu")
    assert [k.value for k in TierKind] == ["device", "cpu", "nvme"]  # the config's names
    assert [k.spec.on_disk for k in TierKind] == [False, False, True]
    assert [k.spec.addressable for k in TierKind] == [True, True, False]
    assert TierKind.NVME.spec.ram_kind is TierKind.CPU and TierKind.CPU.spec.ram_kind is TierKind.CPU
    for kind in (TierKind.DEVICE, TierKind.CPU):
        tier = make_param_tier(kind, cpu, False)
        assert tier.addressable == kind.spec.addressable and tier.kind == kind.spec.bucket


@pytest.mark.cuda
def test_host_tier_is_pinned_and_copies_to_gpu():
    tier = HostTier(pin_memory=True)
    shard = tier.allocate("u", 1 << 20, torch.bfloat16)
    assert shard.is_pinned()
    shard.copy_(torch.randn(1 << 20).bfloat16())
    out = torch.empty(1 << 20, dtype=torch.bfloat16, device="cuda")
    tier.fetch("u", out)
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), shard)
    dev = DeviceTier(torch.device("cuda"))
    dev.allocate("u", 1 << 20, torch.bfloat16)
    dev.store("u", shard)
    assert torch.equal(dev.view("u").cpu(), shard)


def test_nvme_tier_roundtrip_direct_and_staged(tmp_path):
    from offload.storage.io import aligned_empty
    from offload.storage.nvme import NVMeContext

    ctx = NVMeContext(str(tmp_path), 0, budget_bytes=1 << 20, block_size=1 << 16, queue_depth=4, threads=1)
    try:
        tier = make_param_tier("nvme", torch.device("cpu"), False, nvme=ctx,
                               shards=[("u0", 4096, torch.bfloat16), ("u1", 2048, torch.float32)])
        assert tier.kind == "nvme" and tier.view("u0") is None
        assert tier.bytes_allocated() == 8192 + 8192
        tier.allocate("u0", 4096, torch.bfloat16)  # reserved at construction: a check only
        with pytest.raises(ValueError, match="reserved as"):
            tier.allocate("u0", 10, torch.bfloat16)
        with pytest.raises(KeyError, match="not reserved"):
            tier.fetch("nope", torch.empty(1))
        direct = aligned_empty(8192, torch.float32)[:2048]  # page-aligned: no staging copy
        direct.copy_(torch.arange(2048.0))
        tier.store("u1", direct).wait()
        staged = torch.arange(4096.0).bfloat16()[1:].clone()  # not page-aligned
        staged = torch.cat([staged, staged[:1]])
        tier.store("u0", staged)
        out = torch.empty(4096, dtype=torch.bfloat16)
        tier.fetch("u0", out).wait()
        assert torch.equal(out, staged)
        out1 = aligned_empty(8192, torch.float32)
        tier.fetch("u1", out1).wait()
        assert torch.equal(out1, direct)
        assert ctx.staging.pool.bytes_in_use == 0 or len(ctx.staging) > 0
    finally:
        ctx.close()


def test_in_memory_tiers_are_addressable_and_fetch_nothing_ahead():
    for tier in (DeviceTier(torch.device("cpu")), HostTier(pin_memory=False)):
        tier.allocate("u", 8, torch.float32)
        assert tier.addressable and tier.fetch_ahead("u") is None and tier.take_held("u") is None
        tier.keep_after_store(["u"])
        tier.store("u", torch.ones(8))
        assert tier.take_held("u") is None
        assert [b for b, _ in tier.memory_tensors()] == [tier.kind] and tier.bytes_on_disk() == 0


def test_staging_revokes_leases_for_a_buffer_needed_now():
    from offload.storage.nvme import LeaseState, Staging

    staging = Staging(8192, pin=False)
    leases = [staging.lease(4096), staging.lease(4096)]
    assert all(lease.state is LeaseState.HELD for lease in leases)
    assert staging.lease(4096) is None  # never waits, never revokes another lease
    # The pool is full, no write in flight: the newest lease goes (its bytes are needed
    # last), only as many as the buffer needs; the older one keeps its bytes.
    buf = staging.acquire(4096)
    assert leases[1].state is LeaseState.REVOKED and leases[1].claim() is None
    assert leases[0].state is LeaseState.HELD and staging.stats.bytes_dropped == 4096
    other = staging.acquire(4096)  # and then the next newest
    assert leases[0].state is LeaseState.REVOKED and staging.stats.bytes_dropped == 8192
    staging.release(other)
    leases[0].release()  # a holder giving back a revoked lease is harmless
    kept = staging.lease(4096)
    mine = kept.claim()  # claimed: an ordinary buffer, no longer revocable
    assert mine is not None and kept.state is LeaseState.RELEASED
    with pytest.raises(RuntimeError, match="pinned_budget_bytes"):
        staging.acquire(4096)
    staging.release(mine)
    staging.release(buf)


def test_nvme_store_revokes_reads_ahead_and_keeps_a_copy_when_asked(tmp_path):
    from offload.storage.nvme import NVMeContext

    ctx = NVMeContext(str(tmp_path), 0, budget_bytes=1 << 20, block_size=1 << 16, queue_depth=4, threads=1)
    try:
        tier = make_param_tier("nvme", torch.device("cpu"), False, nvme=ctx,
                               shards=[("u0", 2048, torch.bfloat16)])
        assert not tier.addressable and tier.bytes_on_disk() == 4096
        first = torch.arange(2048.0).bfloat16()
        tier.store("u0", first)
        ahead = tier.fetch_ahead("u0")
        assert ahead.live() and torch.equal(ahead.wait(), first)
        second = first + 1
        tier.store("u0", second)  # the bytes read ahead are stale now
        assert not ahead.live()
        ahead.release()
        tier.keep_after_store(["u0"])
        third = first + 2
        tier.store("u0", third)
        held = tier.take_held("u0")
        assert held is not None and held.fresh and held.done() and torch.equal(held.wait(), third)
        assert tier.take_held("u0") is None  # handed out once
        tier.store("u0", first)
        assert not held.live()  # a new store drops the copy of the old bytes
        kept = tier.fetch_ahead("u0")  # the copy of this store, as a completed fetch
        assert kept.fresh and kept.claim() and torch.equal(kept.wait(), first)
        kept.release()
        tier.keep_after_store([])
        tier.store("u0", second)
        assert tier.take_held("u0") is None
        assert ctx.staging.revoke_leases() is False  # nothing left lent
    finally:
        ctx.close()
