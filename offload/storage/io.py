"""Host memory and files: asynchronous O_DIRECT reads and writes, and aligned (pinned) buffers.

    from offload.storage.io import AIOHandle, aligned_empty
    h = AIOHandle(block_size=1 << 20, queue_depth=32, threads=2)
    buf = aligned_empty(nbytes, dtype=torch.uint8)   # page-aligned, pinned when CUDA is up
    h.pwrite(buf, path, offset=0).wait()              # any size, any offset
    h.pread(buf, path, offset=0).wait()               # views into larger buffers too

The engine is native (csrc/aio): worker threads, each with its own Linux AIO context, keep up
to ``queue_depth`` blocks of ``block_size`` bytes in flight. This module owns the tensors: it
checks them once, passes their address, and keeps each tensor alive until its request is done.

Fast path: the buffer address, the file offset and the length all multiples of 4096
(``ALIGNMENT``). Then every byte moves by O_DIRECT straight between the file and the buffer.
Otherwise the engine copes (docs/io.md): an equally misaligned buffer and offset still take
the fast path for their whole 4 KiB blocks, a buffer misaligned against the offset goes through
a bounce buffer (one memcpy), and the sub-4 KiB head and tail go through buffered
pread/pwrite of exactly their bytes.
"""

from __future__ import annotations

import errno as _errno
import os
import tempfile
import threading
import time
import warnings
from contextlib import contextmanager
from typing import Iterable, Iterator, Optional, Protocol, Union

import torch

from offload._native import C
from offload.sizes import ALIGNMENT, align_up
from offload.storage.pinned import pinned_empty

__all__ = [
    "AIOHandle",
    "Completion",
    "IORequest",
    "BufferPool",
    "ShortReadError",
    "BufferedIOWarning",
    "aligned_empty",
    "is_fast_path",
    "probe_direct_io",
    "wait_all",
]

# One alignment for the project (offload.sizes.ALIGNMENT): the native engine splits and
# checks requests by its own compiled-in constant, so the two must agree.
if int(C.AIO_ALIGNMENT) != ALIGNMENT:
    raise ImportError(
        f"offload's native I/O engine was built with AIO_ALIGNMENT = {int(C.AIO_ALIGNMENT)} but "
        f"offload.sizes.ALIGNMENT is {ALIGNMENT}; rebuild the extension from this source tree "
        "(pip install -e .)"
    )

HUGE_PAGE_MIN_BYTES: int = 4 << 20
"""Bytes: unpinned ``aligned_empty`` buffers this large ask for transparent huge pages."""

PathLike = Union[str, "os.PathLike[str]"]


class ShortReadError(OSError):
    """A read asked for bytes past the end of the file. ``errno`` is EIO; ``filename`` is set."""


class BufferedIOWarning(RuntimeWarning):
    """The filesystem refused O_DIRECT; the handle fell back to buffered pread/pwrite."""


# --------------------------------------------------------------------------------------------
# Layout arithmetic (pure functions; align_up is offload.sizes')


def is_fast_path(address: int, offset: int, nbytes: int) -> bool:
    """True when a request moves every byte by O_DIRECT from/to the caller's buffer."""
    return address % ALIGNMENT == 0 and offset % ALIGNMENT == 0 and nbytes % ALIGNMENT == 0


# --------------------------------------------------------------------------------------------
# Buffers


def aligned_empty(
    nbytes: int, dtype: torch.dtype = torch.uint8, *, pin: Optional[bool] = None
) -> torch.Tensor:
    """A 1-D CPU tensor of ``nbytes`` bytes whose first byte is 4 KiB (page) aligned.

    ``pin`` (default: whether CUDA is available) allocates page-locked memory so that copies
    to and from the GPU are asynchronous DMA. Unpinned buffers of ``HUGE_PAGE_MIN_BYTES`` or
    more are advised onto transparent huge pages (where the kernel allows it), which makes
    O_DIRECT to and from them faster. The contents are uninitialised.
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int):
        raise TypeError(f"nbytes must be an int, got {type(nbytes).__name__}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    if nbytes % itemsize:
        raise ValueError(
            f"nbytes={nbytes} is not a multiple of the {dtype} element size ({itemsize}); "
            f"ask for {align_up(nbytes, itemsize)}"
        )
    if pin is None:
        pin = torch.cuda.is_available()
    if pin:
        # Page-aligned and locked at exactly its size ([Note: exact pinned memory]).
        raw = pinned_empty(nbytes)
        if raw.data_ptr() % ALIGNMENT == 0:
            return raw.view(dtype)
    # The CPU allocator aligns to 64 bytes only: over-allocate one page and start at the first
    # aligned byte. The slice keeps the whole allocation alive.
    raw = torch.empty(nbytes + ALIGNMENT, dtype=torch.uint8, pin_memory=bool(pin))
    if not pin and nbytes >= HUGE_PAGE_MIN_BYTES:
        # Before the first touch: large buffers on transparent huge pages move faster by
        # O_DIRECT (one segment per 2 MiB; csrc/aio/host_memory.h has the measurements).
        C.advise_huge_pages(raw.data_ptr(), raw.numel())
    skip = (-raw.data_ptr()) % ALIGNMENT
    return raw[skip : skip + nbytes].view(dtype)


class BufferPool:
    """Reusable aligned (pinned when CUDA is up) buffers within a fixed byte budget.

    ``acquire`` hands out a buffer of at least the asked size (capacity rounded up to 4 KiB),
    reusing a released one when one fits, allocating when the budget allows (first freeing
    idle buffers if that makes room), and otherwise blocking until another thread releases
    enough (or ``timeout_s`` passes: TimeoutError). A request larger than the whole budget can
    never be met and raises ValueError at once. Thread-safe.

    The budget counts every byte the pool holds (``bytes_reserved``: in use plus idle), since
    idle pinned memory is still locked. ``bytes_in_use`` counts capacities handed out.
    """

    def __init__(self, budget_bytes: int, *, pin: Optional[bool] = None) -> None:
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int):
            raise TypeError(f"budget_bytes must be an int, got {type(budget_bytes).__name__}")
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be > 0, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.pin = torch.cuda.is_available() if pin is None else bool(pin)
        self._cond = threading.Condition()
        self._idle: list[torch.Tensor] = []  # released buffers (uint8, capacity-sized)
        self._busy: dict[int, torch.Tensor] = {}  # data_ptr -> capacity-sized buffer
        self._reserved = 0
        self._in_use = 0
        self._peak_in_use = 0

    @property
    def bytes_in_use(self) -> int:
        with self._cond:
            return self._in_use

    @property
    def peak_bytes_in_use(self) -> int:
        with self._cond:
            return self._peak_in_use

    @property
    def bytes_reserved(self) -> int:
        with self._cond:
            return self._reserved

    def acquire(
        self, nbytes: int, dtype: torch.dtype = torch.uint8, *, timeout_s: Optional[float] = None
    ) -> torch.Tensor:
        """A 4 KiB-aligned 1-D tensor of ``nbytes`` bytes; give it back with ``release``."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes must be an int >= 0, got {nbytes!r}")
        itemsize = torch.empty((), dtype=dtype).element_size()
        if nbytes % itemsize:
            raise ValueError(f"nbytes={nbytes} is not a multiple of the {dtype} element size")
        capacity = align_up(max(nbytes, 1))
        if capacity > self.budget_bytes:
            raise ValueError(
                f"a {nbytes}-byte buffer ({capacity} bytes aligned) can never fit the pool's "
                f"budget of {self.budget_bytes} bytes; raise the budget or split the request"
            )
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while True:
                buf = self._take(capacity)
                if buf is not None:
                    break
                if deadline is None:
                    self._cond.wait()
                else:
                    left = deadline - time.monotonic()
                    if left <= 0 or not self._cond.wait(left):
                        if self._take_possible(capacity):
                            continue
                        raise TimeoutError(
                            f"no {capacity}-byte buffer within {timeout_s} s: "
                            f"{self._in_use} of {self.budget_bytes} budget bytes are in use; "
                            "release buffers or raise the budget"
                        )
            self._busy[buf.data_ptr()] = buf
            self._in_use += buf.numel()
            self._peak_in_use = max(self._peak_in_use, self._in_use)
        return buf[:nbytes].view(dtype)

    def release(self, buf: torch.Tensor) -> None:
        """Return a buffer from ``acquire``; it must no longer be used (no I/O in flight)."""
        with self._cond:
            base = self._busy.pop(buf.data_ptr(), None)
            if base is None:
                raise ValueError(
                    "release() got a tensor this pool did not hand out (or one already "
                    "released); pass the tensor acquire() returned"
                )
            self._in_use -= base.numel()
            self._idle.append(base)
            self._cond.notify_all()

    @contextmanager
    def borrow(self, nbytes: int, dtype: torch.dtype = torch.uint8) -> Iterator[torch.Tensor]:
        """``with pool.borrow(n) as buf:`` acquire, then release on exit."""
        buf = self.acquire(nbytes, dtype)
        try:
            yield buf
        finally:
            self.release(buf)

    def trim(self) -> int:
        """Free every idle buffer; returns the bytes freed."""
        with self._cond:
            freed = sum(b.numel() for b in self._idle)
            self._idle.clear()
            self._reserved -= freed
            self._cond.notify_all()
            return freed

    # -- under self._cond --
    def _take(self, capacity: int) -> Optional[torch.Tensor]:
        # Reuse the smallest idle buffer that fits, if it wastes at most half of itself.
        fits = [b for b in self._idle if capacity <= b.numel() <= 2 * capacity]
        if fits:
            best = min(fits, key=lambda b: b.numel())
            # By identity: list.remove compares with ==, which on tensors is elementwise.
            del self._idle[next(i for i, b in enumerate(self._idle) if b is best)]
            return best
        if self._reserved + capacity > self.budget_bytes:
            # Free idle buffers, largest first, if that makes room.
            idle_bytes = sum(b.numel() for b in self._idle)
            if self._reserved - idle_bytes + capacity > self.budget_bytes:
                return None
            self._idle.sort(key=lambda b: b.numel())
            while self._reserved + capacity > self.budget_bytes:
                self._reserved -= self._idle.pop().numel()
        buf = aligned_empty(capacity, pin=self.pin)
        self._reserved += capacity
        return buf

    def _take_possible(self, capacity: int) -> bool:
        idle_bytes = sum(b.numel() for b in self._idle)
        return self._reserved - idle_bytes + capacity <= self.budget_bytes

    def __repr__(self) -> str:
        return (
            f"BufferPool(budget_bytes={self.budget_bytes}, in_use={self.bytes_in_use}, "
            f"reserved={self.bytes_reserved}, pin={self.pin})"
        )


# --------------------------------------------------------------------------------------------
# Requests and the handle


class Completion(Protocol):
    """Something to wait on: an `IORequest`, a `Pending` of several (offload/storage/nvme.py),
    what a tier's `fetch` / `store` returns (offload/storage/tiers.py `Handle`)."""

    def done(self) -> bool:
        """Whether it has finished, successfully or not (never blocks)."""

    def wait(self) -> object:
        """Block until it has finished; raise its failure."""


class IORequest:
    """A read or write in flight. ``wait()`` blocks without the GIL and raises its error.

    The request holds its tensor until done, so dropping the request early never frees memory
    the engine still writes to (the handle also keeps it until done) — and not after: a
    finished request kept as a record (a swap slot's last write) must not keep a pooled
    buffer alive once the pool has let it go.
    """

    __slots__ = ("_native", "_buffer", "op", "_name")

    def __init__(self, native: C.AioRequest, buffer: torch.Tensor, op: str,
                 name: Optional[str] = None) -> None:
        self._native = native
        self._buffer: Optional[torch.Tensor] = buffer
        """Kept alive until the request is done (then None)."""
        self.op = op
        """'pread' or 'pwrite'."""
        self._name = name
        """What errors call the file, when the path opened is another name for it (a held
        file's /proc/self/fd/N)."""

    @property
    def path(self) -> str:
        """The file, as errors name it."""
        return self._name or self._native.path

    def _renamed(self, exc: OSError, cls: type) -> OSError:
        """`exc` with the opened path replaced by the file's name."""
        if self._name is None:
            return exc if cls is type(exc) else cls(exc.errno, exc.strerror, exc.filename)
        opened = self._native.path
        text = (exc.strerror or "").replace(opened, self._name)
        return cls(exc.errno, text, self._name)

    @property
    def offset(self) -> int:
        return self._native.offset

    @property
    def nbytes(self) -> int:
        return self._native.nbytes

    @property
    def direct(self) -> bool:
        """True if the file was opened with O_DIRECT; False on the buffered fallback."""
        return self._native.direct

    def done(self) -> bool:
        """True once the request has finished, successfully or not. Never blocks."""
        if self._native.done():
            self._buffer = None
            return True
        return False

    def wait(self, timeout: Optional[float] = None) -> None:
        """Block until done; raise its OSError if it failed, TimeoutError after ``timeout`` s."""
        try:
            done = self._native.wait(-1.0 if timeout is None else max(0.0, timeout))
        except OSError as exc:
            self._buffer = None
            cls = ShortReadError if self._native.short_read else type(exc)
            renamed = self._renamed(exc, cls)
            if renamed is exc:
                raise
            raise renamed from None
        if done:
            self._buffer = None
        if not done:
            raise TimeoutError(
                f"{self.op} of {self.nbytes} bytes at offset {self.offset} of '{self.path}' "
                f"not done after {timeout} s"
            )

    def exception(self) -> Optional[OSError]:
        """The error of a finished request (None if it succeeded or is still running)."""
        if not self.done():
            return None
        try:
            self.wait()
        except OSError as exc:
            return exc
        return None

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return (
            f"<IORequest {self.op} {self.nbytes} B at {self.offset} of {self.path!r} "
            f"{state}{'' if self.direct else ' buffered'}>"
        )


def wait_all(requests: Iterable[IORequest], timeout: Optional[float] = None) -> None:
    """Wait for every request, then raise the first failure (in the given order), if any.

    All requests are waited for before raising, so no buffer is still being read or written
    when the caller handles the error. ``timeout`` bounds the whole wait (TimeoutError).
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    first: Optional[BaseException] = None
    for req in requests:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            req.wait(left)
        except TimeoutError:
            raise
        except OSError as exc:
            if first is None:
                first = exc
    if first is not None:
        raise first


class AIOHandle:
    """Asynchronous reads and writes of CPU tensors from/to files, O_DIRECT where possible.

    Args:
        block_size: bytes per I/O the kernel sees; a multiple of 4096 (1 MiB is a good start).
        queue_depth: blocks each worker keeps in flight.
        threads: worker threads, each with its own kernel AIO context.
        buffered: never use O_DIRECT (go through the page cache). Files on filesystems that
            refuse O_DIRECT (ramfs, some FUSE and network mounts) get buffered I/O anyway,
            with one ``BufferedIOWarning`` per handle.
        inject_delay_s: testing aid: every block waits this long on its worker before it is
            issued, so a test can show that code above reads nothing before waiting (a read
            not waited for sees the old bytes). 0 in production.

    Each request opens its file (writes create it, never truncate it) and closes it when done.
    A request is split into ``block_size`` pieces spread over the workers. Requests from
    several Python threads may be submitted concurrently.
    """

    def __init__(
        self,
        block_size: int = 1 << 20,
        queue_depth: int = 32,
        threads: int = 2,
        *,
        buffered: bool = False,
        inject_delay_s: float = 0.0,
    ) -> None:
        for name, value in (("block_size", block_size), ("queue_depth", queue_depth),
                            ("threads", threads)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if block_size <= 0 or block_size % ALIGNMENT:
            raise ValueError(
                f"block_size must be a positive multiple of {ALIGNMENT} bytes (O_DIRECT), got "
                f"{block_size}; try {max(ALIGNMENT, align_up(block_size))}"
            )
        if not 0.0 <= inject_delay_s <= 60.0:
            raise ValueError(f"inject_delay_s must be in [0, 60] seconds, got {inject_delay_s}")
        self._engine = C.AioEngine(
            block_size, queue_depth, threads, bool(buffered), int(inject_delay_s * 1e6)
        )
        self._buffered = bool(buffered)
        self._lock = threading.Lock()
        self._outstanding: list[IORequest] = []
        self._prune_at = 64
        self._warned = False
        self._closed = False

    block_size = property(lambda self: self._engine.block_size, doc="Bytes per block.")
    queue_depth = property(lambda self: self._engine.queue_depth, doc="Blocks in flight per worker.")
    threads = property(lambda self: self._engine.threads, doc="Worker threads.")
    buffered = property(lambda self: self._engine.buffered, doc="O_DIRECT disabled by the caller.")

    def pread(self, buf: torch.Tensor, path: PathLike, offset: int = 0, *, name: Optional[str] = None) -> IORequest:
        """Start reading ``buf.nbytes`` bytes of ``path`` at ``offset`` into ``buf``.
        ``name``: what errors call the file when ``path`` is another name for it (a held
        descriptor's /proc/self/fd/N)."""
        return self._submit(False, buf, path, offset, name)

    def pwrite(self, buf: torch.Tensor, path: PathLike, offset: int = 0, *, name: Optional[str] = None) -> IORequest:
        """Start writing ``buf``'s bytes to ``path`` at ``offset`` (creating the file)."""
        return self._submit(True, buf, path, offset, name)

    def wait_all(self, requests: Iterable[IORequest], timeout: Optional[float] = None) -> None:
        """See ``offload.storage.io.wait_all``."""
        wait_all(requests, timeout)

    def direct_io(self, path: PathLike) -> bool:
        """Whether this handle reads/writes ``path`` with O_DIRECT.

        ``path`` may be a file or a directory (probed with a temporary file); a path that does
        not exist yet is judged by its directory.
        """
        if self.buffered:
            return False
        return probe_direct_io(path)

    def close(self) -> None:
        """Wait for every request (errors stay with the requests), then stop the workers."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = self._outstanding
            self._outstanding = []
        for req in pending:
            try:
                req.wait()
            except OSError:
                pass
        self._engine.close()

    def __enter__(self) -> "AIOHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return (
            f"AIOHandle(block_size={self.block_size}, queue_depth={self.queue_depth}, "
            f"threads={self.threads}, buffered={self.buffered})"
        )

    # -- internals --
    def _submit(self, write: bool, buf: torch.Tensor, path: PathLike, offset: int,
                name: Optional[str] = None) -> IORequest:
        op = "pwrite" if write else "pread"
        _check_buffer(buf, op)
        path_str = _check_path(path, op)
        if isinstance(offset, bool) or not isinstance(offset, int):
            raise TypeError(f"{op}: offset must be an int, got {type(offset).__name__}")
        if offset < 0:
            raise ValueError(f"{op}: offset must be >= 0, got {offset}")
        if self._closed:
            raise ValueError("this AIOHandle is closed; create a new one")
        native = self._engine.submit(write, buf.data_ptr(), buf.nbytes, path_str, offset)
        req = IORequest(native, buf, op, name)
        if not self._warned and not self._buffered and not native.direct:
            self._warned = True
            warnings.warn(
                BufferedIOWarning(
                    f"'{path_str}' is on a filesystem without O_DIRECT (open() gave EINVAL); "
                    "this handle falls back to buffered pread/pwrite through the page cache "
                    "for such files (slower, and it uses RAM for the page cache). Put the "
                    "offload directory on a local disk filesystem such as ext4 or xfs."
                ),
                stacklevel=3,
            )
        with self._lock:
            self._outstanding.append(req)
            if len(self._outstanding) >= self._prune_at:
                self._outstanding = [r for r in self._outstanding if not r.done()]
                self._prune_at = max(64, 2 * len(self._outstanding))
        return req


def probe_direct_io(path: PathLike) -> bool:
    """Whether the filesystem holding ``path`` (a file, or a directory) accepts O_DIRECT."""
    path = os.fspath(path)
    target = path
    if not os.path.exists(target):
        target = os.path.dirname(os.path.abspath(target))
    if os.path.isdir(target):
        fd, probe = tempfile.mkstemp(prefix=".offload-odirect-", dir=target)
        os.close(fd)
        try:
            return _opens_direct(probe)
        finally:
            os.unlink(probe)
    return _opens_direct(target)


def _opens_direct(path: str) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as exc:
        if exc.errno == _errno.EINVAL:
            return False
        raise
    os.close(fd)
    return True


def _check_buffer(buf: torch.Tensor, op: str) -> None:
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"{op}: buf must be a torch.Tensor, got {type(buf).__name__}")
    if buf.device.type != "cpu":
        raise ValueError(
            f"{op}: buf is on {buf.device}; file I/O needs a CPU tensor (stage it through a "
            "pinned buffer from aligned_empty or a BufferPool)"
        )
    if buf.layout != torch.strided:
        raise ValueError(f"{op}: buf has layout {buf.layout}; pass a dense (strided) tensor")
    if not buf.is_contiguous():
        raise ValueError(
            f"{op}: buf is not contiguous (shape {tuple(buf.shape)}, stride {buf.stride()}); "
            "pass buf.contiguous() or a contiguous view"
        )


def _check_path(path: PathLike, op: str) -> str:
    if isinstance(path, bytes) or not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{op}: path must be a str or os.PathLike, got {type(path).__name__}")
    path_str = os.fspath(path)
    if not isinstance(path_str, str):
        raise TypeError(f"{op}: path must name a str path, got {type(path_str).__name__}")
    if not path_str:
        raise ValueError(f"{op}: path is empty")
    if "\0" in path_str:
        raise ValueError(f"{op}: path contains a NUL byte: {path_str!r}")
    return path_str
