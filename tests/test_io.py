"""offload.storage.io: the async O_DIRECT engine, aligned buffers and the buffer pool.

Everything here touches real files: pytest's tmp_path (ext4 on this machine, O_DIRECT),
and, where a test needs a filesystem with a property (full, read-only, failing, without
O_DIRECT), one mounted for the test (root only; skipped with the reason otherwise).
Expected bytes are checked with plain os.pread, independent of the engine.
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from offload.sizes import ALIGNMENT, align_up
from offload.storage.io import (
    AIOHandle,
    BufferedIOWarning,
    BufferPool,
    ShortReadError,
    aligned_empty,
    is_fast_path,
    wait_all,
)

# A stalled engine shows up as a wait that never returns: fail the test instead of hanging CI.
pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20


# ---------------------------------------------------------------------------------------------
# helpers


def random_bytes(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def buffer_at(n: int, misalign: int) -> torch.Tensor:
    """An n-byte uint8 view whose address is `misalign` bytes past a 4 KiB boundary."""
    base = aligned_empty(n + ALIGNMENT)
    return base[misalign : misalign + n]


def file_bytes(path, offset: int, n: int) -> torch.Tensor:
    with open(path, "rb") as f:
        data = os.pread(f.fileno(), n, offset)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def run(cmd: list[str]) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


@contextmanager
def mounted(kind: str, where: Path, *options: str):
    """Mount a filesystem for one test, or skip with the reason."""
    if os.geteuid() != 0:
        pytest.skip("mounting a test filesystem needs root")
    where.mkdir(parents=True, exist_ok=True)
    cmd = ["mount", "-t", kind]
    if options:
        cmd += ["-o", ",".join(options)]
    r = subprocess.run(cmd + [kind, str(where)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount {kind} here: {r.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def run_python(code: str) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter that imports offload from this checkout."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
        timeout=120,
    )


@pytest.fixture
def handle():
    h = AIOHandle(block_size=64 * 1024, queue_depth=8, threads=2)
    yield h
    h.close()


# ---------------------------------------------------------------------------------------------
# layout arithmetic and buffers


def test_align_up_and_fast_path_rules():
    assert [align_up(n) for n in (0, 1, 4095, 4096, 4097)] == [0, 4096, 4096, 4096, 8192]
    assert align_up(10, 8) == 16
    assert is_fast_path(8192, 4096, 4096)
    assert not is_fast_path(8192 + 1, 4096, 4096)
    assert not is_fast_path(8192, 4096 + 512, 4096)
    assert not is_fast_path(8192, 4096, 4096 + 1)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("nbytes", [0, 8, 4096, 12345 * 8, 3 * MiB])
def test_aligned_empty_is_page_aligned_cpu_and_sized(nbytes, dtype):
    t = aligned_empty(nbytes, dtype=dtype)
    assert t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous()
    assert t.numel() * t.element_size() == nbytes
    assert t.data_ptr() % ALIGNMENT == 0
    t.fill_(1)  # the memory is really there


def _vm_flags(address: int) -> list[str]:
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    return []


def test_large_aligned_empty_asks_for_huge_pages():
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read()
    except OSError:
        pytest.skip("this kernel has no transparent huge pages")
    if "[never]" in mode:
        pytest.skip("transparent huge pages are disabled here ([never])")
    big = aligned_empty(16 * MiB, pin=False)
    assert "hg" in _vm_flags(big.data_ptr())  # MADV_HUGEPAGE applied to its mapping
    big.fill_(1)


def test_aligned_empty_rejects_bad_sizes():
    with pytest.raises(ValueError, match="multiple of"):
        aligned_empty(6, dtype=torch.float32)
    with pytest.raises(ValueError, match=">= 0"):
        aligned_empty(-1)
    with pytest.raises(TypeError):
        aligned_empty(4096.0)


@pytest.mark.cuda
def test_aligned_empty_is_pinned_when_cuda_is_up():
    t = aligned_empty(5 * MiB, dtype=torch.float16)
    assert t.is_pinned() and t.data_ptr() % ALIGNMENT == 0
    gpu = torch.randn(t.numel(), device="cuda", dtype=torch.float16)
    t.copy_(gpu, non_blocking=True)
    torch.cuda.synchronize()
    torch.testing.assert_close(t.cuda(), gpu, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# round trips


SIZES = [1, 100, 4095, 4096, 4097, 8191, 65536 + 7, MiB, MiB + 1, 3 * MiB + 4095]
OFFSETS = [0, 1, 4095, 4096, 12345, MiB]


@pytest.mark.parametrize("size", SIZES)
def test_round_trip_sizes_and_offsets(tmp_path, handle, size):
    # Every offset, with a buffer that is aligned, misaligned like the offset (fast path for
    # the core), and misaligned against it (bounce buffers).
    for i, offset in enumerate(OFFSETS):
        for misalign in sorted({0, offset % ALIGNMENT, 1}):
            path = tmp_path / f"f_{offset}_{misalign}"
            src = buffer_at(size, misalign)
            src.copy_(random_bytes(size, seed=size + i + misalign))
            req = handle.pwrite(src, path, offset=offset)
            req.wait()
            assert req.direct
            # A new file ends exactly at offset + size (not rounded to 4 KiB), zeros before.
            assert os.path.getsize(path) == offset + size
            assert torch.equal(file_bytes(path, offset, size), src)
            assert not file_bytes(path, 0, offset).any()
            dst = buffer_at(size, (misalign + 7) % ALIGNMENT if misalign else 0)
            dst.zero_()
            handle.pread(dst, path, offset=offset).wait()
            assert torch.equal(dst, src)


def test_round_trip_hundreds_of_megabytes(tmp_path):
    n = 256 * MiB
    src = aligned_empty(n)
    src.copy_(random_bytes(n, seed=1))
    dst = aligned_empty(n)
    with AIOHandle(block_size=MiB, queue_depth=32, threads=2) as h:
        h.pwrite(src, tmp_path / "big", offset=0).wait()
        h.pread(dst, tmp_path / "big", offset=0).wait()
        assert torch.equal(dst, src)
        # Unaligned offset and length, into a view of a larger buffer of another dtype.
        m = 24 * MiB + 3
        h.pread(dst[5 : 5 + m], tmp_path / "big", offset=4099).wait()
        assert torch.equal(dst[5 : 5 + m], src[4099 : 4099 + m])
    assert os.path.getsize(tmp_path / "big") == n


def test_views_of_other_dtypes_round_trip(tmp_path, handle):
    big = aligned_empty(4 * MiB, dtype=torch.float32)
    big.copy_(torch.randn(big.numel(), generator=torch.Generator().manual_seed(3)))
    view = big[1000:300000]  # float32 view: 4000 bytes past a page boundary
    handle.pwrite(view, tmp_path / "v", offset=8).wait()
    out = torch.zeros(300000 - 1000, dtype=torch.float32)
    handle.pread(out, tmp_path / "v", offset=8).wait()
    torch.testing.assert_close(out, view, rtol=0, atol=0)  # bytes, so exactly equal


def test_write_never_truncates_or_touches_other_bytes(tmp_path, handle):
    path = tmp_path / "keep"
    base = random_bytes(3 * MiB, seed=4)
    path.write_bytes(base.numpy().tobytes())
    patch = random_bytes(5000, seed=5)
    handle.pwrite(patch.clone(), path, offset=MiB + 17).wait()
    expect = base.clone()
    expect[MiB + 17 : MiB + 17 + 5000] = patch
    assert os.path.getsize(path) == 3 * MiB
    assert torch.equal(file_bytes(path, 0, 3 * MiB), expect)


def test_a_finished_request_lets_go_of_its_buffer(tmp_path, handle):
    """A request kept as a record after it finished (a swap slot's last write) must not keep
    its buffer alive: a buffer pool that drops the buffer must get the memory back."""
    import gc
    import weakref

    path = str(tmp_path / "f")
    for via in ("wait", "done"):
        buf = aligned_empty(1 << 20)
        buf.fill_(7)
        ref = weakref.ref(buf)
        req = handle.pwrite(buf, path)
        del buf
        assert ref() is not None  # in flight (or not yet observed done): held
        if via == "wait":
            req.wait()
        else:
            while not req.done():
                time.sleep(0.001)
        gc.collect()
        assert ref() is None, f"the request still holds its buffer after {via}()"
        req.wait()  # still answers


def test_zero_byte_requests_complete(tmp_path, handle):
    empty = torch.empty(0, dtype=torch.uint8)
    handle.pwrite(empty, tmp_path / "z", offset=4096).wait()
    assert os.path.getsize(tmp_path / "z") == 0  # created, not extended
    handle.pread(empty, tmp_path / "z", offset=0).wait()


# ---------------------------------------------------------------------------------------------
# concurrency


def test_neighbouring_unaligned_writes_sharing_blocks_all_land(tmp_path):
    # 600 requests tile one file with odd lengths, so most 4 KiB blocks are shared by two or
    # three requests in flight at the same time. A read-modify-write of shared blocks would
    # lose bytes here; every byte must land.
    rng = random.Random(7)
    cuts = sorted(rng.sample(range(1, 6 * MiB), 599))
    bounds = [0, *cuts, 6 * MiB]
    data = random_bytes(6 * MiB, seed=8)
    path = tmp_path / "tiles"
    with AIOHandle(block_size=16 * 1024, queue_depth=16, threads=3) as h:
        order = list(range(len(bounds) - 1))
        rng.shuffle(order)
        reqs = [h.pwrite(data[bounds[i] : bounds[i + 1]], path, offset=bounds[i]) for i in order]
        wait_all(reqs)
    assert os.path.getsize(path) == 6 * MiB
    assert torch.equal(file_bytes(path, 0, 6 * MiB), data)


def test_many_concurrent_requests_over_several_files(tmp_path):
    rng = random.Random(9)
    files = [tmp_path / f"multi{i}" for i in range(6)]
    plan = []  # (path, offset, tensor)
    for fi, path in enumerate(files):
        offset = rng.randrange(0, 3 * ALIGNMENT)
        for j in range(12):
            n = rng.choice([ALIGNMENT, 3 * ALIGNMENT + 11, 200_000, MiB])
            plan.append((path, offset, random_bytes(n, seed=100 * fi + j)))
            offset += n
    with AIOHandle(block_size=128 * 1024, queue_depth=16, threads=2) as h:
        wait_all([h.pwrite(t, p, offset=o) for p, o, t in plan])
        outs = [torch.empty_like(t) for _, _, t in plan]
        reqs = [h.pread(out, p, offset=o) for out, (p, o, _) in zip(outs, plan)]
        wait_all(reqs, timeout=60)
    for out, (p, o, t) in zip(outs, plan):
        assert torch.equal(out, t)
        assert torch.equal(file_bytes(p, o, t.numel()), t)


def test_interleaved_reads_and_writes_on_one_file(tmp_path, handle):
    path = tmp_path / "mixed"
    slabs = [random_bytes(256 * 1024 + 100 * i, seed=20 + i) for i in range(8)]
    offsets = [sum(s.numel() for s in slabs[:i]) for i in range(8)]
    handle.pwrite(slabs[0], path, offset=0).wait()
    outs = []
    reqs = []
    for i in range(1, 8):
        # Write slab i while reading back every slab written (and waited for) before it.
        reqs.append(handle.pwrite(slabs[i], path, offset=offsets[i]))
        for k in range(i):
            out = torch.empty_like(slabs[k])
            outs.append((k, out))
            reqs.append(handle.pread(out, path, offset=offsets[k]))
        reqs[-i - 1].wait()  # slab i is durable before the next round reads it
    wait_all(reqs)
    for k, out in outs:
        assert torch.equal(out, slabs[k])


def test_requests_from_several_python_threads(tmp_path, handle):
    errors = []

    def worker(t: int) -> None:
        try:
            for j in range(10):
                src = random_bytes(50_000 + j, seed=t * 100 + j)
                p = tmp_path / f"thr{t}"
                handle.pwrite(src, p, offset=j * 60_000).wait()
                dst = torch.empty_like(src)
                handle.pread(dst, p, offset=j * 60_000).wait()
                assert torch.equal(dst, src)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors


def test_mixed_small_requests_never_stall(tmp_path):
    # A shallow queue fed a mix of O_DIRECT blocks, buffered edges (which take no queue slot)
    # and requests that fail at once or are skipped: every one must complete. (A worker that
    # slept with pieces still queued once stalled exactly this mix.)
    rng = random.Random(15)
    path = tmp_path / "mix"
    path.write_bytes(bytes(2 * MiB))
    with AIOHandle(block_size=8192, queue_depth=2, threads=2) as h:
        reqs = []
        for i in range(400):
            kind = rng.randrange(4)
            if kind == 0:
                reqs.append((True, h.pwrite(aligned_empty(3 * 8192), path, offset=8192 * rng.randrange(200))))
            elif kind == 1:
                reqs.append((True, h.pread(torch.empty(rng.randrange(1, 3000), dtype=torch.uint8),
                                           path, offset=rng.randrange(MiB))))
            elif kind == 2:
                reqs.append((False, h.pread(aligned_empty(64 * 1024), tmp_path / "absent")))
            else:  # fails on its first O_DIRECT block past the end; the rest are skipped
                reqs.append((False, h.pread(aligned_empty(64 * 1024), path, offset=2 * MiB - 8192)))
        for ok, req in reqs:
            if ok:
                req.wait(timeout=30)
            else:
                with pytest.raises(OSError):
                    req.wait(timeout=30)


def test_wait_times_out_then_completes(tmp_path):
    # One worker, one 4 KiB block in flight at a time: 64 MiB is 16384 sequential I/Os, far
    # more than a zero-second wait.
    src = aligned_empty(64 * MiB)
    src.fill_(3)
    with AIOHandle(block_size=4096, queue_depth=1, threads=1) as h:
        req = h.pwrite(src, tmp_path / "slow")
        with pytest.raises(TimeoutError, match="not done"):
            req.wait(timeout=0)
        req.wait()
        assert req.done()


def test_injected_delay_holds_every_block_until_waited(tmp_path):
    # The testing aid for the layers above: nothing lands before its delay, all after wait().
    path = tmp_path / "delayed"
    data = random_bytes(3 * 4096 + 5, seed=16)
    path.write_bytes(data.numpy().tobytes())
    with AIOHandle(block_size=MiB, queue_depth=4, threads=1, inject_delay_s=0.5) as h:
        out = torch.zeros_like(data)
        req = h.pread(out, path, offset=0)
        assert not req.done() and not out.any()  # a read not waited for sees the old bytes
        req.wait()
        assert torch.equal(out, data)
    with pytest.raises(ValueError, match="inject_delay_s"):
        AIOHandle(inject_delay_s=-1)


def test_dropped_request_keeps_its_buffer_alive(tmp_path):
    h = AIOHandle(block_size=4096, queue_depth=2, threads=1)
    h.pwrite(random_bytes(8 * MiB), tmp_path / "dropped")  # neither kept nor waited for
    import gc

    gc.collect()
    h.close()  # drains; the tensor lived until then
    assert os.path.getsize(tmp_path / "dropped") == 8 * MiB
    assert torch.equal(file_bytes(tmp_path / "dropped", 0, 8 * MiB), random_bytes(8 * MiB))


# ---------------------------------------------------------------------------------------------
# errors, each triggered for real


def assert_names_request(exc: OSError, path, offset: int, nbytes: int) -> None:
    assert exc.filename == str(path)
    msg = str(exc)
    assert str(path) in msg and f"offset {offset}" in msg and f"{nbytes} bytes" in msg


def test_missing_file_raises_file_not_found(tmp_path, handle):
    path = tmp_path / "nope"
    req = handle.pread(aligned_empty(8192), path, offset=4096)
    with pytest.raises(FileNotFoundError) as ei:
        req.wait()
    assert ei.value.errno == errno.ENOENT
    assert_names_request(ei.value, path, 4096, 8192)
    assert "ENOENT" in str(ei.value)


@pytest.mark.parametrize(
    "file_size,offset,nbytes",
    [(5000, 0, 8192),  # unaligned tail past EOF (buffered edge)
     (3 * 4096, 0, 4 * 4096),  # aligned: the O_DIRECT block past EOF
     (3 * 4096, 5 * 4096, 4096),  # starts past EOF
     (MiB + 100, 1000, MiB)],  # unaligned start, ends past EOF in the tail
)
def test_short_read_raises_with_path_offset_and_file_size(tmp_path, handle, file_size, offset, nbytes):
    path = tmp_path / "short"
    path.write_bytes(b"x" * file_size)
    req = handle.pread(aligned_empty(nbytes), path, offset=offset)
    with pytest.raises(ShortReadError) as ei:
        req.wait()
    exc = ei.value
    assert isinstance(exc, OSError) and exc.errno == errno.EIO
    assert_names_request(exc, path, offset, nbytes)
    assert f"ends at byte {file_size}" in str(exc)
    with pytest.raises(ShortReadError):
        req.wait()  # a failed request keeps failing; it never hangs
    assert isinstance(req.exception(), ShortReadError)


def test_disk_full_raises_enospc(tmp_path):
    with mounted("tmpfs", tmp_path / "small", "size=2m") as mnt:
        with AIOHandle(block_size=256 * 1024, queue_depth=8, threads=2) as h:
            # A new file: the preallocation finds the disk full before writing.
            req = h.pwrite(aligned_empty(8 * MiB), mnt / "full", offset=0)
            with pytest.raises(OSError) as ei:
                req.wait()
            assert ei.value.errno == errno.ENOSPC
            assert_names_request(ei.value, mnt / "full", 0, 8 * MiB)
            # A sparse file already that large: the O_DIRECT writes themselves hit ENOSPC.
            os.truncate(mnt / "full", 8 * MiB)
            req = h.pwrite(aligned_empty(8 * MiB), mnt / "full", offset=0)
            with pytest.raises(OSError) as ei:
                req.wait()
            assert ei.value.errno == errno.ENOSPC
            assert "No space left on device" in str(ei.value)


def test_file_too_large_raises_efbig():
    # RLIMIT_FSIZE in a child process (Python ignores SIGXFSZ, so the write fails with EFBIG).
    d = tempfile.mkdtemp(prefix="offload-efbig-", dir="/tmp")
    try:
        r = run_python(f"""
            import errno, os, resource, torch
            from offload.storage.io import AIOHandle, aligned_empty
            path = {d!r} + "/big"
            with open(path, "wb") as f:
                f.truncate(4 << 20)  # already 4 MiB: no preallocation, the writes hit the limit
            resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
            with AIOHandle(block_size=256 * 1024, queue_depth=4, threads=2) as h:
                for offset in (0, 4 << 20):  # over the limit inside and past the end
                    try:
                        h.pwrite(aligned_empty(2 << 20), path, offset=offset).wait()
                    except OSError as exc:
                        assert exc.errno == errno.EFBIG, exc
                        assert exc.filename == path and "offset %d" % offset in str(exc), exc
                        print("EFBIG", offset)
                    else:
                        raise SystemExit("no error")
        """)
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == ["EFBIG", "0", "EFBIG", str(4 << 20)]
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_permission_denied_raises_eacces():
    # Root bypasses permission bits, so the check runs as `nobody` in a child process.
    if os.geteuid() != 0:
        pytest.skip("needs root to switch to the nobody user")
    import pwd

    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no 'nobody' user")
    d = tempfile.mkdtemp(prefix="offload-eacces-", dir="/tmp")
    try:
        os.chmod(d, 0o755)
        ro = os.path.join(d, "readonly")
        os.mkdir(ro, 0o555)
        secret = os.path.join(d, "secret")
        with open(secret, "wb") as f:
            f.write(b"s" * 8192)
        os.chmod(secret, 0o600)
        r = run_python(f"""
            import errno, os
            from offload.storage.io import AIOHandle, aligned_empty
            os.setgid({nobody.pw_gid}); os.setuid({nobody.pw_uid})  # after the imports
            with AIOHandle() as h:
                for op, path in (("pwrite", {ro!r} + "/f"), ("pread", {secret!r})):
                    try:
                        getattr(h, op)(aligned_empty(4096), path, offset=4096).wait()
                    except PermissionError as exc:
                        assert exc.errno == errno.EACCES and exc.filename == path, exc
                        assert "offset 4096" in str(exc) and "4096 bytes" in str(exc), exc
                        print(op, "EACCES")
                    else:
                        raise SystemExit(op + ": no error")
        """)
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == ["pwrite", "EACCES", "pread", "EACCES"]
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_read_only_filesystem_raises_erofs(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(b"a" * 4096)
    if os.geteuid() != 0:
        pytest.skip("a read-only bind mount needs root")
    ro = tmp_path / "ro"
    ro.mkdir()
    r = subprocess.run(["mount", "--bind", "-o", "ro", str(src), str(ro)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot bind-mount read-only here: {r.stderr.strip()}")
    try:
        with AIOHandle() as h:
            with pytest.raises(OSError) as ei:
                h.pwrite(aligned_empty(4096), ro / "f").wait()
            assert ei.value.errno == errno.EROFS
            assert "read-only" in str(ei.value)
            out = aligned_empty(4096)
            h.pread(out, ro / "f").wait()  # reading is fine
            assert bytes(out.numpy()) == b"a" * 4096
    finally:
        subprocess.run(["umount", "-l", str(ro)], capture_output=True)


@contextmanager
def failing_disk(tmp_path: Path):
    """An ext4 filesystem whose loop device is shrunk under it: blocks past the new end give
    real EIO from the block layer ("attempt to access beyond end of device")."""
    if os.geteuid() != 0:
        pytest.skip("a loop device needs root")
    img = tmp_path / "disk.img"
    mnt = tmp_path / "disk"
    mnt.mkdir()
    with open(img, "wb") as f:
        f.truncate(64 * MiB)
    r = subprocess.run(["mkfs.ext4", "-q", "-F", str(img)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"mkfs.ext4 failed: {r.stderr.strip()}")
    r = subprocess.run(["losetup", "-f", "--show", str(img)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"no loop device: {r.stderr.strip()}")
    loop = r.stdout.strip()
    try:
        r = subprocess.run(["mount", "-o", "errors=continue", loop, str(mnt)], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount the loop device: {r.stderr.strip()}")
        try:
            data = mnt / "data"
            with open(data, "wb") as f:
                f.write(os.urandom(40 * MiB))
                f.flush()
                os.fsync(f.fileno())
            os.truncate(img, 8 * MiB)
            run(["losetup", "-c", loop])
            yield data
        finally:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
    finally:
        subprocess.run(["losetup", "-d", loop], capture_output=True)


def test_device_error_raises_eio(tmp_path):
    with failing_disk(tmp_path) as data:
        with AIOHandle(block_size=MiB, queue_depth=8, threads=2) as h:
            for op in ("pread", "pwrite"):
                req = getattr(h, op)(aligned_empty(4 * MiB), data, offset=32 * MiB)
                with pytest.raises(OSError) as ei:
                    req.wait()
                assert ei.value.errno == errno.EIO and not isinstance(ei.value, ShortReadError)
                assert_names_request(ei.value, data, 32 * MiB, 4 * MiB)
                assert "Input/output error" in str(ei.value)


def test_failing_requests_do_not_disturb_good_ones_in_flight(tmp_path):
    good = tmp_path / "good"
    data = random_bytes(8 * MiB, seed=11)
    bad_path = tmp_path / "missing"
    short = tmp_path / "short"
    short.write_bytes(b"y" * 10_000)
    with mounted("tmpfs", tmp_path / "tiny", "size=1m") as tiny, \
            AIOHandle(block_size=64 * 1024, queue_depth=8, threads=2) as h:
        reqs, bad = [], []
        for i in range(8):
            chunk = data[i * MiB : (i + 1) * MiB]
            reqs.append(h.pwrite(chunk, good, offset=i * MiB))
            bad.append(h.pread(aligned_empty(MiB), bad_path))
            bad.append(h.pread(aligned_empty(MiB), short, offset=i))
            bad.append(h.pwrite(aligned_empty(2 * MiB), tiny / f"full{i}"))
        wait_all(reqs, timeout=60)
        out = torch.empty_like(data)
        reads = [h.pread(out[i * MiB : (i + 1) * MiB], good, offset=i * MiB) for i in range(8)]
        for b in bad:
            with pytest.raises(OSError):
                b.wait(timeout=60)
        wait_all(reads, timeout=60)
        assert torch.equal(out, data)
        with pytest.raises(FileNotFoundError):  # wait_all reports the first failure
            wait_all(bad, timeout=60)


# ---------------------------------------------------------------------------------------------
# filesystems without O_DIRECT, and the buffered option


def test_filesystem_without_o_direct_falls_back_with_one_warning(tmp_path):
    # ramfs has no O_DIRECT (open gives EINVAL). /dev/shm (tmpfs) accepts O_DIRECT on recent
    # kernels (6.6+), so it is no longer the example the issue names.
    with mounted("ramfs", tmp_path / "ramfs") as mnt:
        with AIOHandle(block_size=64 * 1024, queue_depth=4, threads=2) as h:
            assert not h.direct_io(mnt) and not h.direct_io(mnt / "new")
            assert h.direct_io(tmp_path)
            src = random_bytes(MiB + 333, seed=12)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                req = h.pwrite(src, mnt / "f", offset=99)
                req.wait()
                h.pwrite(src, mnt / "g").wait()
            assert [w.category for w in caught] == [BufferedIOWarning]  # once per handle
            assert str(mnt / "f") in str(caught[0].message)
            assert not req.direct
            assert os.path.getsize(mnt / "f") == 99 + src.numel()
            dst = torch.empty_like(src)
            r = h.pread(dst, mnt / "f", offset=99)
            r.wait()
            assert not r.direct and torch.equal(dst, src)
            with pytest.raises(ShortReadError):
                h.pread(aligned_empty(MiB), mnt / "f", offset=MiB).wait()


def test_buffered_option_skips_o_direct(tmp_path):
    with AIOHandle(block_size=64 * 1024, queue_depth=4, threads=2, buffered=True) as h:
        assert h.buffered and not h.direct_io(tmp_path)
        src = random_bytes(300_001, seed=13)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # chosen by the caller: no warning
            req = h.pwrite(src, tmp_path / "b", offset=5)
            req.wait()
        assert not req.direct
        dst = torch.empty_like(src)
        h.pread(dst, tmp_path / "b", offset=5).wait()
        assert torch.equal(dst, src)


# ---------------------------------------------------------------------------------------------
# argument checks


def test_bad_arguments_raise_clear_errors(tmp_path, handle):
    p = tmp_path / "args"
    with pytest.raises(TypeError, match="torch.Tensor"):
        handle.pwrite(b"bytes", p)
    with pytest.raises(ValueError, match="not contiguous"):
        handle.pwrite(torch.zeros(64, 64, dtype=torch.uint8).t(), p)
    with pytest.raises(ValueError, match="offset must be >= 0"):
        handle.pwrite(torch.zeros(8, dtype=torch.uint8), p, offset=-1)
    with pytest.raises(TypeError, match="offset must be an int"):
        handle.pwrite(torch.zeros(8, dtype=torch.uint8), p, offset=1.5)
    with pytest.raises(TypeError, match="path"):
        handle.pwrite(torch.zeros(8, dtype=torch.uint8), 3)
    with pytest.raises(ValueError, match="path is empty"):
        handle.pread(torch.zeros(8, dtype=torch.uint8), "")
    with pytest.raises(ValueError, match="layout"):
        handle.pwrite(torch.zeros(8).to_sparse(), p)
    with pytest.raises(ValueError, match="multiple of 4096"):
        AIOHandle(block_size=1000)
    with pytest.raises(ValueError, match="queue_depth"):
        AIOHandle(queue_depth=0)
    with pytest.raises(ValueError, match="threads"):
        AIOHandle(threads=0)
    h = AIOHandle()
    h.close()
    with pytest.raises(ValueError, match="closed"):
        h.pwrite(torch.zeros(8, dtype=torch.uint8), p)


@pytest.mark.cuda
def test_gpu_tensor_is_refused_with_advice(tmp_path, handle):
    with pytest.raises(ValueError, match="CPU tensor"):
        handle.pwrite(torch.zeros(8, device="cuda"), tmp_path / "gpu")


# ---------------------------------------------------------------------------------------------
# the buffer pool


def test_pool_reuses_buffers_and_tracks_bytes():
    pool = BufferPool(1 * MiB, pin=False)
    a = pool.acquire(100_000)
    assert a.numel() == 100_000 and a.data_ptr() % ALIGNMENT == 0
    assert pool.bytes_in_use == align_up(100_000)
    b = pool.acquire(200_000, dtype=torch.float32)
    assert b.dtype == torch.float32 and b.numel() == 50_000
    peak = pool.bytes_in_use
    pool.release(a)
    c = pool.acquire(90_000)  # fits a's idle buffer: reused, no new memory
    assert c.data_ptr() == a.data_ptr()
    assert pool.bytes_reserved == peak
    pool.release(b)
    pool.release(c)
    assert pool.bytes_in_use == 0 and pool.peak_bytes_in_use == peak
    with pytest.raises(ValueError, match="did not hand out"):
        pool.release(c)
    with pytest.raises(ValueError, match="did not hand out"):
        pool.release(torch.zeros(4))


def test_pool_refuses_what_can_never_fit_and_frees_idle_for_new_sizes():
    pool = BufferPool(MiB, pin=False)
    with pytest.raises(ValueError, match="can never fit"):
        pool.acquire(MiB + 1)
    x = pool.acquire(600_000)
    pool.release(x)
    y = pool.acquire(900_000)  # needs the idle 600 KB freed first to stay in budget
    assert pool.bytes_reserved <= MiB
    pool.release(y)


def test_pool_picks_the_fitting_idle_buffer_among_several():
    # The fitting buffer is not the first idle one: taking it out of the idle list must go
    # by identity (list.remove compares tensors elementwise and raised here).
    pool = BufferPool(MiB, pin=False)
    small, big = pool.acquire(40960), pool.acquire(163840)
    pool.release(small)
    pool.release(big)
    again = pool.acquire(163840)
    assert again.data_ptr() == big.data_ptr() and pool.bytes_reserved == 40960 + 163840


def test_pool_blocks_until_release_and_times_out():
    pool = BufferPool(MiB, pin=False)
    held = pool.acquire(MiB)
    with pytest.raises(TimeoutError, match="in use"):
        pool.acquire(4096, timeout_s=0.05)
    got = []
    t = threading.Thread(target=lambda: got.append(pool.acquire(512 * 1024)))
    t.start()
    time.sleep(0.1)
    assert not got  # blocked: the budget is spent
    pool.release(held)
    t.join(timeout=10)
    assert got and got[0].numel() == 512 * 1024
    assert got[0].data_ptr() == held.data_ptr()  # the released buffer, reused
    assert pool.bytes_in_use == MiB and pool.peak_bytes_in_use == MiB  # capacities count
    pool.release(got[0])
    with pool.borrow(4096) as buf:  # the idle 1 MiB is freed to make room within budget
        assert buf.numel() == 4096 and pool.bytes_reserved == 4096
    assert pool.trim() == 4096
    assert pool.bytes_reserved == 0


@pytest.mark.cuda
def test_pool_buffers_are_pinned_when_cuda_is_up():
    pool = BufferPool(8 * MiB)
    assert pool.pin
    with pool.borrow(3 * MiB + 1) as buf:
        assert buf.is_pinned() and buf.data_ptr() % ALIGNMENT == 0


def test_pool_buffers_feed_the_engine(tmp_path, handle):
    pool = BufferPool(4 * MiB, pin=False)
    with pool.borrow(3 * MiB) as buf:
        buf.copy_(random_bytes(3 * MiB, seed=14))
        handle.pwrite(buf, tmp_path / "pooled").wait()
        assert is_fast_path(buf.data_ptr(), 0, buf.numel())
        expect = buf.clone()
    with pool.borrow(3 * MiB) as buf:
        buf.zero_()
        handle.pread(buf, tmp_path / "pooled").wait()
        assert torch.equal(buf, expect)


_READ_ONLY_SCRIPT = r"""
import errno, mmap, os, sys, warnings, torch
from offload.storage.io import AIOHandle
src, ro = sys.argv[1], sys.argv[2]
m = mmap.mmap(os.open(ro, os.O_RDONLY), 1 << 16, prot=mmap.PROT_READ)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # torch warns that the buffer is not writable
    t = torch.frombuffer(m, dtype=torch.uint8)
h = AIOHandle()
for off, n in ((0, 4096), (1, 100), (4096, 8192), (5, 9000)):  # direct, bounced, mixed
    try:
        h.pread(t[off:off + n], src, off).wait()
        print("no error", off, n)
    except OSError as exc:
        print("errno", exc.errno, off, n)
"""


def test_a_read_into_read_only_memory_is_efault_on_every_path(tmp_path):
    """A tensor over a read-only mapping: the kernel's own reads say EFAULT, and so must the
    bounce buffer's copy for unaligned edges (it used to crash the process with SIGSEGV).
    Run in a child process, so a regression fails this test, not the whole suite."""
    src, ro = tmp_path / "src", tmp_path / "ro"
    src.write_bytes(os.urandom(1 << 16))
    ro.write_bytes(b"\0" * (1 << 16))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", _READ_ONLY_SCRIPT, str(src), str(ro)], capture_output=True,
                          text=True, timeout=60, cwd=root, env={**os.environ, "PYTHONPATH": root})
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    lines = proc.stdout.split("\n")
    assert [l.split()[1] for l in lines if l] == [str(errno.EFAULT)] * 4, proc.stdout
