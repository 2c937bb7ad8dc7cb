"""Layout arithmetic of a unit's flat buffer and shards: pure integers, no tensors."""

from __future__ import annotations

import pytest

from offload.units.shard import (
    FROZEN_GROUP,
    PARAM_ALIGN_ELEMS,
    SHARD_ALIGN_ELEMS,
    Segment,
    UpdateRun,
    intersect,
    layout_unit,
    update_runs,
)
from offload.sizes import align_up


def test_align_up():
    assert align_up(0, 16) == 0
    assert align_up(1, 16) == 16
    assert align_up(16, 16) == 16
    assert align_up(17, 16) == 32
    with pytest.raises(ValueError):
        align_up(3, 0)


def test_intersect():
    assert intersect((0, 10), (5, 20)) == (5, 10)
    assert intersect((0, 5), (5, 10)) is None
    assert intersect((3, 4), (0, 100)) == (3, 4)


@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_offsets_are_aligned_disjoint_and_ordered_by_group(world_size):
    params = [("a", (3, 5), 1), ("b", (7,), 0), ("c", (2, 2), FROZEN_GROUP), ("d", (100,), 0)]
    lay = layout_unit(params, world_size)
    assert [s.name for s in lay.slots] == ["b", "d", "a", "c"]  # groups ascending, frozen last
    prev_end = 0
    for s in lay.slots:
        assert s.offset % PARAM_ALIGN_ELEMS == 0
        assert s.offset >= prev_end
        prev_end = s.end
    assert lay.numel == 15 + 7 + 4 + 100
    assert lay.padded_numel == world_size * lay.shard_numel
    assert lay.shard_numel % SHARD_ALIGN_ELEMS == 0
    assert lay.padded_numel >= prev_end
    assert lay.optimized_numel == lay.slots[2].end  # "a" is the last optimized slot


def test_shard_ranges_tile_the_padded_buffer():
    lay = layout_unit([("w", (5000,), 0)], world_size=3)
    ranges = [lay.shard_range(r) for r in range(3)]
    assert ranges[0][0] == 0 and ranges[-1][1] == lay.padded_numel
    for (a, b), (c, d) in zip(ranges, ranges[1:]):
        assert b == c and b - a == d - c == lay.shard_numel
    with pytest.raises(ValueError):
        lay.shard_range(3)


def test_slot_in_shard_covers_every_element_exactly_once():
    params = [(f"p{i}", (n,), 0) for i, n in enumerate([1, 4095, 2049, 33, 6000])]
    for ws in (1, 2, 4):
        lay = layout_unit(params, ws, shard_align=64)
        for s in lay.slots:
            covered = []
            for r in range(ws):
                part = lay.slot_in_shard(s, r)
                if part is None:
                    continue
                p_off, s_off, n = part
                lo, _ = lay.shard_range(r)
                assert lo + s_off == s.offset + p_off  # same flat element
                assert 0 <= s_off and s_off + n <= lay.shard_numel
                covered.extend(range(p_off, p_off + n))
            assert covered == list(range(s.numel))


def test_segments_merge_a_group_and_clip_to_shards():
    params = [("a", (10,), 0), ("b", (10,), 0), ("c", (10,), 1), ("f", (10,), FROZEN_GROUP)]
    lay = layout_unit(params, 2, param_align=16, shard_align=16)
    assert lay.segments() == (Segment(0, 0, 26), Segment(1, 32, 42))
    assert lay.shard_numel == 32  # 58 elements -> 29 per rank -> aligned to 16
    assert lay.shard_segments(0) == (Segment(0, 0, 26),)
    assert lay.shard_segments(1) == (Segment(1, 0, 10),)
    assert lay.shard_optimized_numel(0) == 32
    assert lay.shard_optimized_numel(1) == 10


def test_empty_unit_still_has_one_aligned_shard():
    lay = layout_unit([], 4)
    assert lay.shard_numel == SHARD_ALIGN_ELEMS
    assert lay.optimized_numel == 0 and lay.segments() == ()


def test_update_runs_merge_equal_steps_and_skip_inactive():
    params = [("a", (10,), 0), ("b", (10,), 0), ("c", (10,), 0), ("d", (10,), 1)]
    lay = layout_unit(params, 1, param_align=16, shard_align=16)
    # all active, same step: one run per group, gaps included
    assert update_runs(lay, 0, [True] * 4, [3] * 4) == (UpdateRun(0, 3, 0, 42), UpdateRun(1, 3, 48, 58))
    # "b" got no gradient: it splits group 0 and is not touched
    assert update_runs(lay, 0, [True, False, True, True], [3, 2, 3, 3]) == (
        UpdateRun(0, 3, 0, 10),
        UpdateRun(0, 3, 32, 42),
        UpdateRun(1, 3, 48, 58),
    )
    # different step counts in one group split too
    assert update_runs(lay, 0, [True] * 4, [3, 1, 1, 3]) == (
        UpdateRun(0, 3, 0, 10),
        UpdateRun(0, 1, 16, 42),
        UpdateRun(1, 3, 48, 58),
    )


def test_update_runs_are_shard_local():
    lay = layout_unit([("a", (40,), 0)], 2, param_align=16, shard_align=16)
    assert lay.shard_numel == 32
    assert update_runs(lay, 0, [True], [1]) == (UpdateRun(0, 1, 0, 32),)
    assert update_runs(lay, 1, [True], [1]) == (UpdateRun(0, 1, 0, 8),)
