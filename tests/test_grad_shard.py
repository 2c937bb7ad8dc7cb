"""The gradient shard alone (offload/optim/grad_shard.py): every transition of `GradState`,
the memory of a transient shard, the scratch that shards borrow, and the snapshot an aborted
pass restores; no engine, no process group."""

from __future__ import annotations

import pytest
import torch

from offload.optim.grad_shard import GradScratch, GradShard, GradState
from offload.units.full_buffers import CAN_POINT
from offload.units.layout import layout_unit

# Two parameters whose aligned slots leave a gap between them (5 elements, then 3).
LAYOUT = layout_unit([("a", (5,), 0), ("b", (3,), 0)], world_size=1)
N = LAYOUT.shard_numel


def _shard(released: bool) -> GradShard:
    return GradShard(torch.empty(N, dtype=torch.float32), len(LAYOUT.slots), released=released)


def _memory(s: GradShard) -> int:
    return s.tensor.untyped_storage().nbytes()


def test_a_transient_shard_walks_released_empty_summed_consumed_released():
    s = _shard(released=True)
    assert s.state is GradState.RELEASED and _memory(s) == 0 and not s.has_gradient
    s.tensor.untyped_storage().resize_(N * 4)
    s.tensor.fill_(7.0)  # what fresh memory may hold
    s.tensor.untyped_storage().resize_(0)
    s.acquire(LAYOUT, rank=0, whole=False)
    assert s.state is GradState.EMPTY and _memory(s) == N * 4
    gap = slice(LAYOUT.slots[0].end, LAYOUT.slots[1].offset)
    assert gap.stop > gap.start and torch.all(s.tensor[gap] == 0), "the gap a reduce never writes reads 0"
    s.reduced([True, False], averaged_later=False)
    assert s.state is GradState.SUMMED and s.has_gradient and s.reduces == 1 and s.slot_has == [True, False]
    s.reduced([False, True], averaged_later=False)
    assert s.reduces == 2 and s.slot_has == [True, True], "a later reduce adds to what the window has"
    s.release()
    assert s.state is GradState.CONSUMED and _memory(s) == 0
    assert s.has_gradient, "a consumed gradient is refused to readers, never answered as none"
    s.clear()
    assert s.state is GradState.RELEASED and s.reduces == 0 and s.slot_has == [False, False]


def test_a_held_shard_clears_to_empty_and_keeps_its_memory():
    s = _shard(released=False)
    s.acquire(LAYOUT, rank=0, whole=False)  # holds memory already: nothing to do
    assert s.state is GradState.EMPTY and _memory(s) == N * 4
    s.reduced([True, True], averaged_later=True)
    assert s.state is GradState.UNAVERAGED and s.unaveraged
    s.averaged()
    assert s.state is GradState.SUMMED and not s.unaveraged
    s.clear()
    assert s.state is GradState.EMPTY and _memory(s) == N * 4 and not s.has_gradient


@pytest.mark.parametrize("state", [GradState.RELEASED, GradState.CONSUMED])
def test_a_reduce_into_a_shard_without_memory_is_refused(state):
    s = _shard(released=True)
    if state is GradState.CONSUMED:
        s.acquire(LAYOUT, 0, whole=True)
        s.reduced([True, True], averaged_later=False)
        s.release()
    assert s.state is state
    with pytest.raises(AssertionError, match=f"a reduce into a {state.value} gradient shard"):
        s.reduced([True, True], averaged_later=False)


def test_an_aborted_pass_restores_a_shard_that_held_nothing():
    s = _shard(released=True)
    before = s.snapshot()
    s.acquire(LAYOUT, 0, whole=True)
    s.reduced([True, False], averaged_later=False)
    s.restore(before)
    assert s.state is GradState.EMPTY and s.reduces == 0 and s.slot_has == [False, False]
    assert _memory(s) == N * 4, "memory the pass acquired stays: the next reduce overwrites it"
    s.reduced([False, True], averaged_later=False)
    s.release()  # the pass ran its update, then died
    s.restore(before)
    assert s.state is GradState.RELEASED and _memory(s) == 0
    held = s
    held.acquire(LAYOUT, 0, whole=True)
    held.reduced([True, True], averaged_later=False)
    with pytest.raises(AssertionError, match="no exact way back"):
        held.restore(held.snapshot())


def test_the_copy_down_event_is_waited_once():
    s = _shard(released=False)
    s.arriving(None)
    s.wait_arrived()
    assert s.ready is None
    if torch.cuda.is_available():
        e = torch.cuda.Event()
        e.record()
        s.arriving(e)
        assert s.ready is e
        s.wait_arrived()
        assert s.ready is None


@pytest.mark.skipif(not CAN_POINT, reason="this torch cannot point a storage at borrowed memory")
def test_the_scratch_lends_to_one_shard_at_a_time_and_takes_it_back():
    a, b = _shard(released=True), _shard(released=True)
    scratch = GradScratch([a, b], enabled=True)
    a.acquire(LAYOUT, 0, whole=False, scratch=scratch)
    assert scratch.holder is a and a.tensor.data_ptr() == scratch.buf.data_ptr()
    b.acquire(LAYOUT, 0, whole=False, scratch=scratch)  # taken: fresh memory
    assert scratch.holder is a and b.tensor.data_ptr() != scratch.buf.data_ptr() and _memory(b) == N * 4
    a.tensor.fill_(3.0)
    a.reduced([True, True], averaged_later=False)
    a.release()
    assert scratch.holder is None and _memory(a) == 0 and a.state is GradState.CONSUMED
    b.release()
    b.clear()
    b.acquire(LAYOUT, 0, whole=False, scratch=scratch)  # free again: b borrows it
    assert scratch.holder is b and b.tensor.data_ptr() == scratch.buf.data_ptr()
    gap = slice(LAYOUT.slots[0].end, LAYOUT.slots[1].offset)
    assert torch.all(b.tensor[gap] == 0), "a's values in the scratch do not show through the gaps"
    with pytest.raises(AssertionError, match="did not borrow"):
        scratch.take_back(a)


def test_a_disabled_scratch_lends_nothing():
    a = _shard(released=True)
    scratch = GradScratch([a], enabled=False)
    a.acquire(LAYOUT, 0, whole=False, scratch=scratch)
    assert scratch.holder is None and scratch.buf is None and _memory(a) == N * 4
