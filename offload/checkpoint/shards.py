"""Shard files: flat tensors written and read in checksummed chunks through `offload.storage.io`.

A shard file is a sequence of tensors, each starting at a 4 KiB-aligned offset and stored
as chunks of `chunk_bytes` (the last one shorter, padded with zeros to 4 KiB on disk). Each
chunk has a CRC-32C (`CHECKSUMS`) of its bytes as written, padding included; the
record of a tensor is a plain dict that goes into the manifest:

    {"unit": 3, "name": "exp_avg", "dtype": "float32", "numel": 1048576,
     "offset": 8388608, "checksum": "crc32c", "checksums": [2779338752, ...]}

[Note: the write pipeline]
`ShardWriter.write` cuts the caller's tensor into chunks and hands each to a write worker
(two threads), which submits it with `AIOHandle.pwrite` and computes its CRC while the
write is in flight (both only read the buffer). A chunk whose bytes are page-aligned in
the caller's tensor (address and length: the NVMe tier's pooled buffers, whose tensors
start on 4 KiB boundaries) is written straight from it, O_DIRECT, with no copy; any other
(host tensors, which the CPU allocator aligns to 64 bytes only, and a record's last chunk
when it must be padded) is first copied by the worker into a page-aligned staging buffer
(`StagingRing`) and zero-padded to 4 KiB. The caller's thread only cuts and submits, so
copies and CRCs of neighbouring chunks run side by side. At most `window` chunks are in
flight: memory is bounded by window * chunk_bytes whatever the model's size. Because
workers read the caller's tensor after `write` returns, the caller registers
`when_written(callback)` after a unit's tensors and releases them in the callback (the
save loop closes its `unit_state` context there); a staging buffer is reused only after
its write and its CRC are done.

[Note: the read pipeline]
`ShardReader` runs a list of `ReadJob`s (a chunk of a saved tensor, and where its elements
go) with `window` reads in flight; a worker thread waits for each read, checks its CRC and
copies the wanted elements into their destination, while the next reads proceed. A chunk
whose CRC does not match raises `CheckpointCorruptError` naming the file and offset: a torn
or flipped byte is never loaded as valid.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional

import torch

from offload.checkpoint.files import CheckpointCorruptError
from offload.config.sections import AIOConfig
from offload.dtypes import from_name, name_of
from offload.sizes import ALIGNMENT, align_up
from offload.storage.io import AIOHandle

DEFAULT_CHUNK_BYTES = 16 << 20
"""Bytes per chunk: large enough that one request keeps the disk's queue full (16 blocks of
1 MiB), small enough that a few in flight stay within a modest staging budget."""

DEFAULT_WINDOW = 8
"""Chunks in flight (write or read) at once: up to 128 MiB of staging with the default
chunk (allocated as used; 8 rather than 4 measured ~5% faster saves and loads)."""

DEFAULT_WORKERS = 2
"""Write workers: each stages a chunk (when it must be copied), submits its write and
checksums it, so staging copies and CRCs of different chunks run side by side, off the
caller's thread."""

STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.uint8)
"""The dtypes a shard file holds: the fp32 master, moments in fp32 or bf16
(`optimizer.moments_dtype`), 8-bit moments' uint8 codes (their scales are fp32); float16 is
accepted too. A record names its dtype as
`offload.dtypes.name_of` does ('bfloat16') and is read back with `from_name`."""


def dtype_name(dtype: torch.dtype) -> str:
    """A record's name for `dtype`; only `STATE_DTYPES` are stored."""
    if dtype not in STATE_DTYPES:
        raise ValueError(f"checkpoints store float32/bfloat16/float16/uint8 state, got {dtype}")
    return name_of(dtype)


# CheckpointCorruptError lives with the directory protocol (files.py: `latest` raises it
# too); this module's import path for it is documented and stays.


HUGE_PAGE_BYTES = 2 << 20
"""Bytes of a transparent huge page on x86-64: the alignment of staging memory (see
`huge_aligned_empty`)."""


def huge_aligned_empty(nbytes: int) -> torch.Tensor:
    """`offload.storage.io.aligned_empty(nbytes)` (uint8, advised onto transparent huge pages when
    large), but starting on a 2 MiB boundary, so every 2 MiB of it can be a huge page.

    Why: `aligned_empty` aligns to 4 KiB, so a 16 MiB buffer spans nine 2 MiB ranges, and
    the partial ones at each end stay on 4 KiB pages; an O_DIRECT block over 4 KiB pages is
    split into more segments than the virtio queue takes in one request. Measured on the
    development VM, 16 MiB chunks read with 8 in flight: 3.1 GB/s into a ring of eight
    separate `aligned_empty` buffers, 4.5 GB/s into eight 2 MiB-aligned slices of one slab
    (and into one large buffer). Costs up to 2 MiB of address space per call.
    """
    from offload.storage.io import aligned_empty

    # Not pinned: these buffers only meet files (O_DIRECT), never the GPU, and page-locked
    # memory gets no huge pages.
    raw = aligned_empty(nbytes + HUGE_PAGE_BYTES, pin=False)
    skip = (-raw.data_ptr()) % HUGE_PAGE_BYTES
    return raw[skip : skip + nbytes]


class StagingRing:
    """`window` page-aligned staging buffers of `capacity` bytes, used in turn.

    The pipelines retire work first in, first out and keep at most `window` items in
    flight, so when item i takes buffer i % window, item i - window (its previous user) has
    been retired. The buffers are 2 MiB-aligned slices of one slab (`huge_aligned_empty`:
    whole huge pages, measured ~45% faster O_DIRECT than separate buffers), allocated on
    first use; its pages are faulted in as used, so a small checkpoint touches only the
    bytes it needs.
    """

    def __init__(self, window: int, capacity: int) -> None:
        self.window = window
        self.capacity = align_up(capacity)
        self._stride = align_up(self.capacity, HUGE_PAGE_BYTES)
        self._slab: Optional[torch.Tensor] = None
        self.next = 0

    def take(self, nbytes: int) -> torch.Tensor:
        if nbytes > self.capacity:
            raise ValueError(f"{nbytes} bytes exceed the staging buffer's {self.capacity}")
        i = self.next % self.window
        self.next += 1
        if self._slab is None:
            self._slab = huge_aligned_empty(self.window * self._stride)
        return self._slab[i * self._stride : i * self._stride + nbytes]

    def free(self) -> None:
        self._slab = None


class CheckpointIO:
    """An AIO handle and a staging ring for one checkpoint's files (`CheckpointStaging`
    keeps one between an engine's checkpoints)."""

    def __init__(self, aio: AIOConfig, delay_s: float, chunk_bytes: int, window: int) -> None:
        self.key = (aio.block_size, aio.queue_depth, aio.threads, delay_s, chunk_bytes, window)
        self.handle = AIOHandle(
            block_size=aio.block_size, queue_depth=aio.queue_depth, threads=aio.threads,
            inject_delay_s=delay_s,
        )
        self.ring = StagingRing(window, chunk_bytes)

    def close(self) -> None:
        self.handle.close()


class CheckpointStaging:
    """The `CheckpointIO` one engine keeps between its checkpoints: made on first use and
    reused (a fresh ring costs a page fault per 4 KiB on its first fill — measured: a save of
    0.19 GB took 0.6 s with fresh buffers, most of it faulting them in — and a fresh handle
    starts and stops its worker threads), made anew when the settings change. The engine
    owns it (`Engine.close` closes it); a save or load without one uses its own for the call."""

    def __init__(self) -> None:
        self._io: Optional[CheckpointIO] = None

    def get(self, aio: AIOConfig, delay_s: float, chunk_bytes: int, window: int) -> CheckpointIO:
        key = (aio.block_size, aio.queue_depth, aio.threads, delay_s, chunk_bytes, window)
        if self._io is None or self._io.key != key:
            self.close()
            self._io = CheckpointIO(aio, delay_s, chunk_bytes, window)
        return self._io

    def close(self) -> None:
        io, self._io = self._io, None
        if io is not None:
            io.close()


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[:] = src for contiguous CPU tensors of equal byte size, as one memmove.

    Not `Tensor.copy_`: that splits a large copy over torch's intra-op threads, and on a
    machine whose other cores are busy (the I/O and checksum threads, other processes) the
    split copy waits for its slowest thread. Measured on the 2-core development VM under
    load: 1.4 GB/s for copy_ with 2 threads, ~9 GB/s for one thread or memmove. ctypes
    releases the GIL around the call.
    """
    n = dst.numel() * dst.element_size()
    assert n == src.numel() * src.element_size() and dst.is_contiguous() and src.is_contiguous()
    if n:
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), n)


def _crc32(buf: torch.Tensor) -> int:
    # zlib releases the GIL for buffers this size, so checksums run beside Python work.
    return zlib.crc32(buf.numpy().data) & 0xFFFFFFFF


def _crc32c(buf: torch.Tensor) -> int:
    from offload._native import C

    return int(C.crc32c(buf.data_ptr(), buf.numel() * buf.element_size(), 0))


CHECKSUMS: dict[str, Callable[[torch.Tensor], int]] = {"crc32c": _crc32c, "crc32": _crc32}
"""Checksum algorithms by the name records carry. New checkpoints use CRC-32C (native,
SSE4.2: csrc/common/checksum.cpp, ~5 GB/s per core against zlib CRC-32's ~3.8); records
that name "crc32" are verified with zlib."""


DEFAULT_CHECKSUM = "crc32c"


class ShardWriter:
    """Writes tensors one after another into one file, chunk by chunk (see the notes)."""

    def __init__(
        self,
        handle: AIOHandle,
        path: str,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        window: int = DEFAULT_WINDOW,
        ring: Optional["StagingRing"] = None,
        workers: int = DEFAULT_WORKERS,
    ) -> None:
        if chunk_bytes <= 0 or chunk_bytes % ALIGNMENT:
            raise ValueError(f"chunk_bytes must be a positive multiple of {ALIGNMENT}, got {chunk_bytes}")
        self.handle = handle
        self.path = path
        self.chunk_bytes = chunk_bytes
        self.window = max(1, int(window))
        self.ring = ring if ring is not None else StagingRing(self.window, chunk_bytes)
        self._own_ring = ring is None
        self.checksum = DEFAULT_CHECKSUM
        self._workers = ThreadPoolExecutor(max(1, int(workers)), thread_name_prefix="ckpt-write")
        self._inflight: collections.deque = collections.deque()
        """Chunks in flight, oldest first, and `when_written` callbacks between them."""
        self._chunks_inflight = 0
        self.offset = 0
        self.records: list[dict[str, Any]] = []
        self.direct_bytes = 0
        """Bytes written straight from callers' tensors (no staging copy), for profiling."""

    def preallocate(self, nbytes: int) -> None:
        """Reserve the file's blocks in one call (the writer knows the total up front):
        otherwise every request that extends the file allocates its own range, one
        `fallocate` each. A full disk fails here, before any byte is written."""
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                reason = os.strerror(exc.errno) if exc.errno is not None else str(exc)
                raise OSError(exc.errno, f"cannot reserve {nbytes} bytes for {self.path!r}: "
                              f"{reason}", self.path) from None
        finally:
            os.close(fd)

    def write(self, unit: int, name: str, tensor: torch.Tensor) -> dict[str, Any]:
        """Queue `tensor` (1-D, host) as the next record. Its bytes are read by the write
        workers after this returns: keep the tensor alive and unchanged until a callback
        registered after it with `when_written` has run (or `finish` has returned)."""
        t = tensor.detach().reshape(-1)
        if t.device.type != "cpu":
            t = t.cpu()
        nbytes = t.numel() * t.element_size()
        raw = t.contiguous().view(torch.uint8) if nbytes else t.new_empty(0, dtype=torch.uint8)
        n_chunks = -(-nbytes // self.chunk_bytes)
        record = {
            "unit": int(unit), "name": name, "dtype": dtype_name(t.dtype),
            "numel": int(t.numel()), "offset": self.offset,
            "checksum": self.checksum, "checksums": [0] * n_chunks,
        }
        for k in range(n_chunks):
            lo = k * self.chunk_bytes
            hi = min(lo + self.chunk_bytes, nbytes)
            src = raw[lo:hi]
            self._make_room()
            if hi - lo == align_up(hi - lo) and src.data_ptr() % ALIGNMENT == 0:
                buf, copy_from = src, None  # O_DIRECT straight from the caller's tensor
                self.direct_bytes += hi - lo
            else:
                buf, copy_from = self.ring.take(align_up(hi - lo)), src
            fut = self._workers.submit(self._put_chunk, buf, copy_from, self.offset + lo)
            self._inflight.append((fut, record, k))
            self._chunks_inflight += 1
        self.offset += align_up(nbytes)
        self.records.append(record)
        return record

    def when_written(self, callback: Callable[[], None]) -> None:
        """Run `callback` (on this thread, from a later `write`, `when_written`, `finish` or
        `abort`) once every chunk queued so far is on disk and checksummed: the point where
        the tensors passed to `write` before it may be released."""
        if not self._inflight:
            callback()
        else:
            self._inflight.append((None, callback, None))

    def settle(self) -> None:
        """Retire everything in flight (running its callbacks); raise the first error."""
        while self._inflight:
            self._retire(self._inflight.popleft())

    def _put_chunk(self, buf: torch.Tensor, copy_from: Optional[torch.Tensor], offset: int):
        """On a write worker: stage (copy + zero padding) if needed, submit the write, and
        checksum the same bytes while it is in flight. Returns (crc, request)."""
        if copy_from is not None:
            n = copy_from.numel()
            copy_bytes(buf[:n], copy_from)
            if buf.numel() > n:
                ctypes.memset(buf.data_ptr() + n, 0, buf.numel() - n)
        req = self.handle.pwrite(buf, self.path, offset)
        try:
            crc = CHECKSUMS[self.checksum](buf)
        except BaseException:
            req.wait()  # never leave a write reading a buffer nobody waits for
            raise
        return crc, req

    def _make_room(self) -> None:
        while self._chunks_inflight >= self.window:
            self._retire(self._inflight.popleft())

    def _retire(self, item: tuple) -> None:
        fut, record, k = item
        if fut is None:  # a when_written callback: everything before it has retired
            record()
            return
        self._chunks_inflight -= 1
        crc, req = fut.result()
        req.wait()
        record["checksums"][k] = crc

    def _drain(self) -> Optional[BaseException]:
        """Retire everything (callbacks run too); returns the first error instead of raising,
        so no buffer is still in use when the caller raises it."""
        first: Optional[BaseException] = None
        while self._inflight:
            item = self._inflight.popleft()
            try:
                self._retire(item)
            except BaseException as exc:  # its write is done or was never submitted
                first = first or exc
        self._workers.shutdown(wait=True)
        if self._own_ring:
            self.ring.free()
        return first

    def finish(self) -> int:
        """Wait for every write, fsync the file; returns its size in bytes."""
        first = self._drain()
        if first is not None:
            raise first
        if not self.offset:
            open(self.path, "ab").close()  # an empty record list still has its file
        from offload.checkpoint.files import fsync_path

        fsync_path(self.path)
        return self.offset

    def abort(self) -> None:
        """Wait for what is in flight and drop it (after an error)."""
        self._drain()


@dataclass
class ReadJob:
    """Read one chunk of a saved tensor and copy its elements [elem_lo, elem_hi) (chunk-local
    element indices) into `dest` (a 1-D tensor of the same dtype, exactly that long)."""

    path: str
    file_offset: int
    nbytes: int
    """Bytes of the chunk that belong to the tensor (the read is rounded up to 4 KiB)."""
    checksum: int
    algorithm: str
    dtype: torch.dtype
    elem_lo: int
    elem_hi: int
    dest: torch.Tensor
    tag: Any = None
    """The caller's: which unit this job completes (see ShardReader.run's on_done)."""
    direct: bool = False
    """Read straight into `dest` (whole chunk, same dtype, page-aligned, 4 KiB multiple):
    no staging copy."""


def chunk_jobs(
    record: dict[str, Any],
    path: str,
    chunk_bytes: int,
    lo: int,
    hi: int,
    dest: torch.Tensor,
    tag: Any = None,
) -> list[ReadJob]:
    """Jobs that put elements [lo, hi) of the tensor `record` describes into `dest`
    (dest.numel() == hi - lo)."""
    dtype = from_name(record["dtype"])
    es = torch.empty((), dtype=dtype).element_size()
    if not 0 <= lo <= hi <= record["numel"]:
        raise ValueError(f"range [{lo}, {hi}) outside the saved tensor of {record['numel']} elements")
    per_chunk = chunk_bytes // es
    total = record["numel"] * es
    jobs: list[ReadJob] = []
    if hi == lo:
        return jobs
    for k in range(lo // per_chunk, (hi - 1) // per_chunk + 1):
        c_lo = k * per_chunk
        a, b = max(lo, c_lo), min(hi, c_lo + per_chunk)
        nbytes = min(chunk_bytes, total - k * chunk_bytes)
        part = dest[a - lo : b - lo]
        jobs.append(ReadJob(
            path=path,
            file_offset=record["offset"] + k * chunk_bytes,
            nbytes=nbytes,
            checksum=record["checksums"][k],
            algorithm=record.get("checksum", "crc32"),
            dtype=dtype,
            elem_lo=a - c_lo,
            elem_hi=b - c_lo,
            dest=part,
            tag=tag,
            direct=(
                a == c_lo and (b - a) * es == nbytes and nbytes % ALIGNMENT == 0
                and part.dtype == dtype and part.is_contiguous()
                and part.data_ptr() % ALIGNMENT == 0
            ),
        ))
    return jobs


def assemble_jobs(
    records: list[tuple[str, dict]], saved_unit: dict[str, Any], name: str, lo: int,
    dest: torch.Tensor, chunk_bytes: int, tag: Any = None, per: int = 1,
) -> list[ReadJob]:
    """Jobs that fill `dest` with the flat elements [lo, lo + dest.numel()) of the saved
    unit's tensor `name` ('master', 'exp_avg', 'exp_avg_sq', 'frozen'), from every saved rank whose
    part of the unit overlaps that range: one rank when the world size is unchanged, any
    number when re-sharding (docs/checkpoint.md, Another world size).

    `records` is `manifest.records_by_rank`'s list, `saved_unit` the manifest's entry for
    the unit. Elements no saved rank holds (the padding of a larger layout, moments past
    the optimized prefix) are zeroed here, as in a fresh engine, since `dest` may start
    uninitialised; the rest arrive when the jobs run (`ShardReader.run`).

    `per`: each element of the tensor stands for `per` flat elements (a per-block scale,
    `offload.storage.state_layout.StateSpec.per`); `lo` is then in flat elements, a multiple
    of `per`, as every shard boundary is."""
    lo //= per
    hi = lo + dest.numel()
    saved_shard = saved_unit["shard_numel"] // per
    jobs: list[ReadJob] = []
    spans = []
    for r, (path, by_key) in enumerate(records):
        record = by_key[(saved_unit["index"], name)]
        start = r * saved_shard
        if name == "frozen":  # a rank's frozen suffix starts where its master ends
            start += min(max(saved_unit["master_end"] - start, 0), saved_shard)
        a, b = max(lo, start), min(hi, start + record["numel"])
        if a < b:
            jobs += chunk_jobs(record, path, chunk_bytes, a - start, b - start, dest[a - lo : b - lo], tag)
            spans.append((a - lo, b - lo))
    pos = 0
    for a, b in sorted(spans) + [(dest.numel(), dest.numel())]:
        if a > pos:
            dest[pos:a].zero_()
        pos = max(pos, b)
    return jobs


class ShardReader:
    """Runs ReadJobs with `window` reads in flight (see [Note: the read pipeline])."""

    def __init__(
        self, handle: AIOHandle, chunk_bytes: int, window: int = DEFAULT_WINDOW,
        ring: Optional["StagingRing"] = None,
    ) -> None:
        self.handle = handle
        self.chunk_bytes = chunk_bytes
        self.window = max(1, int(window))
        self.ring = ring if ring is not None else StagingRing(self.window, chunk_bytes)
        self._own_ring = ring is None

    def run(
        self,
        groups: Iterable[tuple[Any, list[ReadJob]]],
        on_done: Optional[Callable[[Any], None]] = None,
        max_open_groups: int = 2,
    ) -> None:
        """Run every group's jobs. `groups` is consumed lazily, and the next group is taken
        only while fewer than `max_open_groups` groups have jobs in flight, so a generator
        may hand out `max_open_groups` destination buffers in turn. `on_done(tag)` is called
        on this thread, in order, once all of a group's jobs have landed and been verified."""
        inflight: collections.deque = collections.deque()
        workers = ThreadPoolExecutor(2, thread_name_prefix="ckpt-verify")
        first: Optional[BaseException] = None
        open_groups = [0]

        def done(tag: Any) -> None:
            open_groups[0] -= 1
            if on_done is not None:
                on_done(tag)

        def take_groups() -> Iterator[tuple[Any, list[ReadJob]]]:
            it = iter(groups)
            while True:
                while open_groups[0] >= max_open_groups and inflight:
                    self._retire(inflight.popleft(), done)
                try:
                    group = next(it)
                except StopIteration:
                    return
                open_groups[0] += 1
                yield group

        try:
            for tag, jobs in take_groups():
                if not jobs:
                    inflight.append((None, None, None, tag))
                for i, job in enumerate(jobs):
                    while len(inflight) >= self.window:
                        self._retire(inflight.popleft(), done)
                    if job.direct:
                        buf = job.dest.view(torch.uint8)
                    else:
                        buf = self.ring.take(align_up(job.nbytes))
                    req = self.handle.pread(buf, job.path, job.file_offset)
                    fut = workers.submit(_verify_and_copy, job, buf, req)
                    inflight.append((job, buf, fut, tag if i == len(jobs) - 1 else _NOT_LAST))
            while inflight:
                self._retire(inflight.popleft(), done)
        except BaseException as exc:
            first = exc
        finally:
            for job, buf, fut, _ in inflight:  # after an error: let reads land before freeing
                if fut is not None:
                    try:
                        fut.result()
                    except BaseException:
                        pass
            workers.shutdown(wait=True)
            if self._own_ring:
                self.ring.free()
        if first is not None:
            raise first

    def _retire(self, item: tuple, on_done: Optional[Callable[[Any], None]]) -> None:
        job, buf, fut, done_tag = item
        if fut is not None:
            fut.result()
        if done_tag is not _NOT_LAST and on_done is not None:
            on_done(done_tag)


_NOT_LAST = object()


def _verify_and_copy(job: ReadJob, buf: torch.Tensor, req: Any) -> None:
    from offload.storage.io import ShortReadError

    try:
        req.wait()
    except ShortReadError as exc:
        raise CheckpointCorruptError(
            exc.errno, f"checkpoint file {job.path!r} is truncated: it ends before byte "
            f"{job.file_offset + buf.numel()} ({exc}); the checkpoint is torn, load another "
            "tag", job.path,
        ) from None
    got = CHECKSUMS[job.algorithm](buf)
    if got != job.checksum:
        raise CheckpointCorruptError(
            5, f"checkpoint file {job.path!r} is corrupt: checksum mismatch in the chunk at "
            f"byte offset {job.file_offset} ({job.nbytes} bytes; {job.algorithm} {got:#010x}, "
            f"manifest says {job.checksum:#010x}); do not load it, use another tag", job.path,
        )
    if job.direct:
        return  # the bytes are already in place
    if job.elem_hi > job.elem_lo:
        es = torch.empty((), dtype=job.dtype).element_size()  # the saved dtype
        src = buf[job.elem_lo * es : job.elem_hi * es].view(job.dtype)
        if job.dest.dtype == job.dtype and job.dest.is_contiguous():
            copy_bytes(job.dest, src)
        else:  # e.g. bf16 moments saved, fp32 moments loaded
            job.dest.copy_(src)
