"""Swap-file layout, ownership and the checks made at the door (offload/storage/swap.py)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap

import pytest

from offload.sizes import align_up
from offload.storage.swap import (
    PAGE_BYTES,
    SWAP_SUBDIR,
    SwapDirectory,
    check_free_space,
    check_swap_dir,
    plan_slots,
    stale_swap_bytes,
    swap_bytes_needed,
)
from tests.fsutil import mounted_tmpfs


def test_align_up_rounds_to_whole_pages():
    assert [align_up(n) for n in (0, 1, 4095, 4096, 4097)] == [0, 4096, 4096, 4096, 8192]
    with pytest.raises(ValueError, match="nbytes must be >= 0"):
        align_up(-1)


def test_plan_slots_places_each_shard_at_an_aligned_offset_back_to_back():
    slots, total = plan_slots([10, 4096, 5000, 0])
    assert [s.offset for s in slots] == [0, 4096, 8192, 16384]
    assert [s.capacity for s in slots] == [4096, 4096, 8192, 0]
    assert [s.nbytes for s in slots] == [10, 4096, 5000, 0]
    assert total == 16384
    assert all(s.offset % PAGE_BYTES == 0 for s in slots)
    assert swap_bytes_needed([[10], [4097, 1]]) == 4096 + 8192 + 4096


def test_missing_nvme_path_is_a_clear_error(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="does not exist; create it") as e:
        check_swap_dir(missing)
    assert e.value.filename == missing


def test_nvme_path_that_is_a_file_is_rejected(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(NotADirectoryError, match="is not a directory"):
        check_swap_dir(str(f))


def test_read_only_nvme_path_is_a_clear_error():
    with mounted_tmpfs("1m", read_only=True) as ro:
        with pytest.raises(OSError, match="is not writable \\(EROFS") as e:
            check_swap_dir(ro)
        assert e.value.errno == errno.EROFS
        assert e.value.filename == ro


def test_disk_too_small_names_the_numbers_before_writing_anything():
    with mounted_tmpfs("1m") as small:
        with pytest.raises(OSError, match=r"needs 8\.00 MiB \(8388608 bytes\).*has 1\.00 MiB free") as e:
            check_free_space(small, 8 << 20, "the optimizer swap file")
        assert e.value.errno == errno.ENOSPC
        with SwapDirectory(small, rank=0) as d:
            with pytest.raises(OSError) as e:
                d.create("optim", [4 << 20, 4 << 20])
            assert e.value.errno == errno.ENOSPC
            assert not [n for n in os.listdir(d.path) if n.endswith(".swap")], "no partial swap file left"


def test_swap_files_are_preallocated_and_removed_at_close(tmp_path):
    d = SwapDirectory(str(tmp_path), rank=3)
    f = d.create("param", [100, 5000])
    assert os.path.getsize(f.path) == 4096 + 8192
    assert os.stat(f.path).st_blocks * 512 >= 4096 + 8192, "space is reserved, not sparse"
    d.close()
    assert not os.path.exists(f.path)
    assert not os.path.exists(os.path.join(tmp_path, SWAP_SUBDIR))


def test_unwritten_slot_refuses_to_be_read(tmp_path):
    with SwapDirectory(str(tmp_path), rank=0) as d:
        f = d.create("optim", [4096, 4096])
        with pytest.raises(RuntimeError, match="slot 1 .* was never written in this run"):
            f.check_readable(1)
        f.mark_written(1)
        assert f.check_readable(1).offset == 4096 and f.is_written(1)
        f.mark_written(1, False)  # a failed write: its bytes are undefined again
        with pytest.raises(RuntimeError, match="never written"):
            f.check_readable(1)


_HOLD = textwrap.dedent(
    """
    import os, sys, time
    from offload.storage.swap import SwapDirectory
    d = SwapDirectory(sys.argv[1], rank=0)
    f = d.create("optim", [8192])
    print("ready", flush=True)
    if sys.argv[2] == "crash":
        os._exit(9)          # no cleanup, as after kill -9
    time.sleep(60)
    """
)


def _spawn(tmp_path, mode):
    return subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(tmp_path), mode],
        stdout=subprocess.PIPE,
        text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )


def test_stale_swap_files_of_a_crashed_run_are_removed_not_reused(tmp_path):
    proc = _spawn(tmp_path, "crash")
    assert proc.stdout.readline().strip() == "ready"
    proc.wait(timeout=30)
    stale = os.path.join(tmp_path, SWAP_SUBDIR, "rank0.optim.swap")
    assert os.path.exists(stale), "the crashed run left its file behind"
    with open(stale, "r+b") as fh:
        fh.write(b"garbage from the crashed run")
    with SwapDirectory(str(tmp_path), rank=0) as d:
        assert not os.path.exists(stale), "stale file deleted on open"
        f = d.create("optim", [8192])
        with open(f.path, "rb") as fh:
            assert fh.read(28) == bytes(28), "recreated file holds no old bytes"


def test_a_live_run_holding_the_directory_is_an_error(tmp_path):
    proc = _spawn(tmp_path, "hold")
    try:
        assert proc.stdout.readline().strip() == "ready"
        with pytest.raises(RuntimeError, match=r"in use by another live run \(pid=\d+"):
            SwapDirectory(str(tmp_path), rank=0)
        SwapDirectory(str(tmp_path), rank=1).close()  # other ranks are unaffected
    finally:
        proc.kill()
        proc.wait()


def test_free_space_check_survives_another_rank_opening_and_closing_the_directory(tmp_path):
    """Every rank of a node checks the disk's free space (counting stale swap files) while
    the others open and close their `SwapDirectory` there, and a clean close removes the
    emptied directory: the look must take a directory, lock or file that vanishes mid-way
    as freeing nothing (it raised FileNotFoundError from a world-size-2 NVMe run in CI)."""
    churn = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        from offload.storage.swap import SwapDirectory
        print("ready", flush=True)
        while True:
            with SwapDirectory({str(tmp_path)!r}, rank=1) as d:
                d.create("param", [4096])
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert churn.stdout.readline().strip() == "ready"
        seen = set()
        for _ in range(20000):
            seen.add(stale_swap_bytes(str(tmp_path)))  # a live rank's files: never reclaimable
            assert churn.poll() is None, "the other rank's open/close loop died"
        assert seen == {0}
    finally:
        churn.kill()
        churn.wait()


def test_local_world_size_counts_the_ranks_that_share_this_node(monkeypatch):
    """The NVMe free-space check counts the ranks of this node (torchrun's
    LOCAL_WORLD_SIZE), not every rank of a multi-node job."""
    from offload.units.collectives import ProcessGroupInfo

    pg = ProcessGroupInfo(rank=9, world_size=16, group=None, backend="gloo", started_here=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert pg.local_world_size == 8
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert pg.local_world_size == 16  # a launcher that does not say: one node
