"""Full buffers reuse page-aligned host memory instead of the CPU allocator's fresh pages
([Note: reused full buffers] in offload/units/full_buffers.py), and NVMe shards are read
straight into them (`FetchMode.DIRECT`); the control is the same run through the CPU
allocator and pooled staging buffers (`FetchMode.READ`)."""

from __future__ import annotations

import os

import pytest
import torch

import offload
import offload.units.shard as shard_mod
from offload.units.full_buffers import CAN_POINT, FullBuffers
from tests.conftest import TinyGPT, gpt_batches

pytestmark = pytest.mark.skipif(not CAN_POINT, reason="this torch cannot point a storage at "
                                "memory it does not own (torch < 2.3): units allocate as before")


def test_buffers_are_reused_within_the_budget_and_page_aligned():
    pool = FullBuffers(budget_bytes=3 * 4096 * 4)
    a, b = torch.empty(4096, dtype=torch.float32), torch.empty(4096, dtype=torch.float32)
    for t in (a, b):
        t.untyped_storage().resize_(0)
    ba = pool.point(a)
    assert a.data_ptr() == ba.data_ptr() and a.data_ptr() % 4096 == 0
    a.fill_(3.0)  # the bytes are usable through the tensor
    assert float(ba.view(torch.float32)[7]) == 3.0
    pool.unpoint(a, ba)
    assert a.untyped_storage().nbytes() == 0 and pool.kept_bytes == ba.numel()
    bb = pool.point(b)  # the same memory, handed to the next tensor
    assert bb.data_ptr() == ba.data_ptr() and pool.taken == 1
    pool.unpoint(b, bb)
    big = torch.empty(4 * 4096, dtype=torch.float32)
    big.untyped_storage().resize_(0)
    bbig = pool.point(big)  # too large for the kept buffer: a new one
    assert bbig.data_ptr() != bb.data_ptr() and pool.taken == 1
    pool.unpoint(big, bbig)  # over the budget: freed, not kept
    assert pool.kept_bytes == bb.numel()


def make_config(path):
    os.makedirs(path, exist_ok=True)
    return {"compute_device": "cpu", "precision": {"dtype": "fp32"}, "gradient_clipping": 0.0,
            "offload": {"param_tier": "nvme", "optimizer_tier": "cpu", "nvme_path": str(path),
                        "pinned_budget_bytes": 1 << 24}}


def train(path, counts=None):
    torch.manual_seed(0)
    engine = offload.initialize(TinyGPT(n_layer=2), make_config(path))
    pool = next((u._buffers for u in engine.units if u._buffers is not None), None)
    for x, y in gpt_batches(4):
        engine.backward(engine(x, y))
        engine.step()
        if counts is not None:
            counts.append((pool.made, pool.taken))
    return engine


def test_nvme_units_reuse_their_full_buffers_with_the_same_results(tmp_path, monkeypatch):
    counts = []
    engine = train(tmp_path / "a", counts)
    pools = {id(u._buffers): u._buffers for u in engine.units if u._buffers is not None}
    assert len(pools) == 1, "every non-aliased unit draws on one FullBuffers"
    # and the shards are read straight into them, ahead of use (no pooled buffer, no copy)
    from offload.runtime.prefetch import FetchMode
    assert set(engine.gather.prefetcher.modes) == {FetchMode.DIRECT}
    # From the second step on (the first is traced, then prefetch reads ahead) no buffer is
    # new: every gather reuses one
    made, taken = zip(*counts)
    assert made[0] > 0 and len(set(made[1:])) == 1, counts
    assert taken[-1] > taken[1], counts
    got = engine.full_state_dict()
    engine.close()
    # Control: the same run with the CPU allocator (no pointing) gives the same bits.
    monkeypatch.setattr(shard_mod, "CAN_POINT", False)
    plain = train(tmp_path / "b")
    assert all(u._buffers is None for u in plain.units)
    want = plain.full_state_dict()
    plain.close()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_publish_copies_low_precision_shards_in_reused_full_buffers(tmp_path, monkeypatch):
    """[Note: publish copies from reused buffers] in offload/units/shard.py: `initialize`
    writes each unit's bf16 shard to NVMe from a full buffer taken and given back at once (a
    few buffers for all units, not a fresh allocation per unit); training from there gives
    the same bits as the control through the CPU allocator."""
    def run(path):
        torch.manual_seed(0)
        config = make_config(path)
        config["precision"]["dtype"] = "bf16"
        engine = offload.initialize(TinyGPT(n_layer=6), config)
        pool = next((u._buffers for u in engine.units if u._buffers is not None), None)
        published = (pool.made, pool.taken, pool.kept_bytes) if pool is not None else None
        for x, y in gpt_batches(3):
            engine.backward(engine(x, y))
            engine.step()
        got = engine.full_state_dict()
        engine.close()
        return published, len(engine.units), got

    (made, taken, kept), n_units, got = run(tmp_path / "a")
    # before any forward, only publish used the pool: every unit's copy came from it, and
    # all but the first of each size were reused
    assert n_units >= 7 and made >= 1 and made + taken == n_units and taken >= n_units - 2, (made, taken)
    assert kept > 0  # given back, kept for the first gathers
    monkeypatch.setattr(shard_mod, "CAN_POINT", False)
    published, _, want = run(tmp_path / "b")
    assert published is None  # the control: the CPU allocator's copies
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
