"""Swap files on NVMe: where each shard's bytes sit on disk, and who owns the files.

One rank's engine owns one swap file per tier (`rank{R}.{tier}.swap`) under
`<nvme_path>/offload-swap/`, preallocated at its full size so a full disk is found at
`initialize`, not mid-step. Every slot starts at a 4 KiB-aligned offset and spans whole
4 KiB pages, so each slot moves with one large O_DIRECT request on the fast path.

[Note: stale swap files] A run that crashed leaves its swap files behind. Each process holds
an exclusive `flock` on `rank{R}.lock` for as long as one of its engines has rank R's swap
directory open ([Note: one claim per process, one name per engine] in
offload/storage/swap_claim.py: engines of one process share it, each with files of its
own); the kernel drops the lock when the process dies however it dies. On open, a lock we
can take means any swap file of the rank there is stale: it is deleted and recreated, never
read (its bytes could be a half-written step). A lock we cannot take means another live
process is using the directory: that is an error, since two runs sharing swap files would
corrupt each other. In addition, a slot that was never written in this run refuses to be
read (`SwapFile.check_readable`).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import signal
import tempfile
import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Optional, Sequence

# One alignment rule for the whole project: offload.sizes' (O_DIRECT's 4 KiB).
from offload.sizes import ALIGNMENT as PAGE_BYTES
from offload.sizes import align_up, format_bytes
from offload.storage.mounts import filesystem_type, mount_of  # filesystem_type: documented here too
from offload.storage.swap_claim import RankClaim, claim_rank, rank_of, same_file, try_lock

if TYPE_CHECKING:  # annotations only: this module runs without the native I/O engine
    import torch

    from offload.storage.io import AIOHandle, IORequest

logger = logging.getLogger(__name__)

SWAP_SUBDIR = "offload-swap"


@dataclass(frozen=True)
class Slot:
    """A byte range of a swap file that holds one shard: `nbytes` used of `capacity`."""

    offset: int
    """Byte offset in the swap file; a multiple of PAGE_BYTES."""
    nbytes: int
    """Bytes of payload."""
    capacity: int
    """Bytes reserved: nbytes rounded up to whole pages."""


def plan_slots(sizes: Sequence[int], alignment: int = PAGE_BYTES) -> tuple[list[Slot], int]:
    """Lay out shards back to back at aligned offsets; returns the slots and the file size."""
    slots: list[Slot] = []
    offset = 0
    for nbytes in sizes:
        capacity = align_up(nbytes, alignment)
        slots.append(Slot(offset=offset, nbytes=nbytes, capacity=capacity))
        offset += capacity
    return slots, offset


def check_free_space(path: str, needed_bytes: int, what: str, reclaimable_bytes: int = 0) -> None:
    """Raise OSError(ENOSPC) naming the numbers when `path`'s filesystem cannot hold
    `needed_bytes`, counting `reclaimable_bytes` (stale swap files that opening the swap
    directory deletes) as free."""
    free = shutil.disk_usage(path).free
    if needed_bytes > free + reclaimable_bytes:
        stale = (f" (plus {format_bytes(reclaimable_bytes)} of stale swap files that will be "
                 "removed)" if reclaimable_bytes else "")
        raise OSError(
            errno.ENOSPC,
            f"not enough free space for {what}: it needs {format_bytes(needed_bytes)} "
            f"({needed_bytes} bytes) but {path} has {format_bytes(free)} free{stale}; free space "
            f"there or point nvme_path at a larger disk",
            path,
        )


def stale_swap_bytes(nvme_path: str) -> int:
    """Bytes of swap files under `nvme_path` that runs which are no longer alive left behind
    (their rank's lock is free): the next `SwapDirectory` opened there deletes them, so a
    free-space check may count them as free ([Note: stale swap files]). Other ranks open and
    close the directory meanwhile (a clean close removes it once empty): names are read
    through one descriptor of it, and whatever is gone when looked at frees nothing."""
    directory = os.path.join(nvme_path, SWAP_SUBDIR)
    try:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return 0
    try:
        return _stale_bytes_in(dir_fd)
    finally:
        os.close(dir_fd)


def _stale_bytes_in(dir_fd: int) -> int:
    by_rank: dict[int, list[str]] = {}
    for name in os.listdir(dir_fd):  # empty once the directory is removed
        rank = rank_of(name)
        if rank is not None:
            by_rank.setdefault(rank, []).append(name)
    total = 0
    for rank, names in by_rank.items():
        try:
            fd = os.open(f"rank{rank}.lock", os.O_RDONLY | os.O_CLOEXEC, dir_fd=dir_fd)
        except FileNotFoundError:
            fd = None  # no lock: no run holds these files
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # only to look: released below
                if not same_file(fd, f"rank{rank}.lock", dir_fd):
                    continue  # closed meanwhile, perhaps opened again: not known stale
            except BlockingIOError:
                continue  # a live run's files
            finally:
                os.close(fd)
        for name in names:
            try:
                total += os.stat(name, dir_fd=dir_fd).st_blocks * 512  # what deleting it frees
            except FileNotFoundError:
                pass
    return total


MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs", "devtmpfs", "hugetlbfs"})
"""Filesystems whose files are pages of host memory, not blocks on a disk."""


class MemoryBackedSwapWarning(RuntimeWarning):
    """The swap directory is on a RAM-backed filesystem: the "NVMe" tiers take host memory."""


def memory_backed(path: str, key: str = "offload.nvme_path") -> Optional[str]:
    """What to tell a user whose swap directory `path` is on tmpfs or another RAM-backed
    filesystem (whose "disk" is the host memory the NVMe tiers exist to spare), in one line;
    None for a directory on a disk."""
    fstype = filesystem_type(path)
    if fstype not in MEMORY_FILESYSTEMS:
        return None
    return (f"{key} {path!r} is on a {fstype} filesystem, which keeps its files in host memory: "
            "the NVMe tiers' swap files would take RAM, not disk; point it at a directory on a "
            "local NVMe disk (or use the cpu tiers, which need no files)")


def warn_if_memory_backed(path: str, key: str = "offload.nvme_path") -> bool:
    """A `MemoryBackedSwapWarning` with `memory_backed`'s line; returns whether it warned."""
    message = memory_backed(path, key)
    if message is not None:
        warnings.warn(MemoryBackedSwapWarning(message), stacklevel=3)
    return message is not None


def check_swap_dir(path: str, key: str = "offload.nvme_path") -> None:
    """Check at the door that `path` is an existing directory we can create files in."""
    if not path:
        raise ValueError(f"{key} is not set; point it at a directory on a local NVMe disk")
    if not os.path.exists(path):
        raise FileNotFoundError(
            errno.ENOENT,
            f"{key} {path!r} does not exist; create it (mkdir -p) or point {key} at an "
            f"existing directory on a local NVMe disk",
            path,
        )
    if not os.path.isdir(path):
        raise NotADirectoryError(errno.ENOTDIR, f"{key} {path!r} is not a directory", path)
    # Try it for real: root passes permission-bit checks, and os.access cannot see every
    # reason a create fails (read-only mounts, quotas, ACLs, full inode tables).
    try:
        fd, probe = tempfile.mkstemp(prefix=".offload-probe-", dir=path)
    except OSError as exc:
        raise type(exc)(
            exc.errno,
            f"{key} {path!r} is not writable ({_errno_name(exc)}: "
            f"{exc.strerror}); point {key} at a directory on a local disk you can write",
            path,
        ) from exc
    os.close(fd)
    os.unlink(probe)


def _errno_name(exc: OSError) -> str:
    """'EACCES' for `exc.errno`, or the number itself when it has no name."""
    if exc.errno is None:
        return "None"
    return errno.errorcode.get(exc.errno, str(exc.errno))


def make_swap_dir(path: str, key: str = "offload.nvme_path") -> None:
    """Create `path` (with its parents) if missing, then `check_swap_dir` it: for scripts
    that take a swap directory on the command line. A directory that cannot be created is an
    OSError naming `key`, the path and the fix, as `check_swap_dir`'s are."""
    if path and not os.path.exists(path):
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.exists(parent):  # (a file there: makedirs' ENOTDIR below says so)
            raise FileNotFoundError(
                errno.ENOENT, f"{key} {path!r} does not exist, and neither does its parent "
                f"{parent!r} (a mistyped mount point, or a disk not mounted?): offload creates the "
                f"last directory of {key}, as DeepSpeed does, not a whole path; create it (mkdir -p) "
                "or point it at a directory on a mounted local NVMe disk", path)
        try:
            os.makedirs(path, exist_ok=True)
            mount, fstype = mount_of(path)
            where = (f"on the root filesystem ({fstype}, mounted at /): if {parent!r} was meant to be "
                     "a mounted disk, it is not mounted" if mount == "/" else
                     f"on the {fstype} filesystem mounted at {mount}")
            logger.warning("created %s %s (it did not exist) %s", key, path, where)
        except OSError as exc:
            raise type(exc)(
                exc.errno,
                f"{key} {path!r} cannot be created ({_errno_name(exc)}: "
                f"{exc.strerror}); point {key} at a directory on a local disk you can write",
                path,
            ) from exc
    check_swap_dir(path, key)


class SwapDirectory:
    """One engine's swap files for one rank under `<nvme_path>/offload-swap/`, under its
    process's claim on the rank (`engine`: its number among the process's engines there).

    Open it, create the tier files, `close()` at a clean exit (deletes its own files). See
    [Note: stale swap files] above for what happens to files a crashed run left.
    """

    closed: bool = True
    """Whether the directory is released (or was never claimed: an `__init__` that failed
    leaves nothing for `__del__` to close)."""

    def __init__(self, nvme_path: str, rank: int) -> None:
        check_swap_dir(nvme_path)
        if int(os.environ.get("LOCAL_RANK", rank)) == 0:  # once a node, not once a rank
            warn_if_memory_backed(nvme_path)
        self.rank = rank
        # Absolute: a chdir during the run must not send close() to another directory.
        self.path = os.path.join(os.path.abspath(nvme_path), SWAP_SUBDIR)
        # [Note: one claim per process, one name per engine] in offload/storage/swap_claim.py
        self._claim: RankClaim
        self._claim, self.engine, first = claim_rank(self.path, rank)
        try:
            self._remove_stale_files(own_rank=first)
        except BaseException:
            self._claim.unshare(self.engine)
            raise
        self.files: dict[str, "SwapFile"] = {}
        self.closed = False
        _OPEN_DIRS.add(self)
        _install_signal_cleanup()  # [Note: cleanup on signals]

    def _remove_stale_files(self, own_rank: bool) -> None:
        """Delete the swap files of runs that are gone: this rank's (`own_rank`: under the
        claim this process just made; a later engine of the process leaves its siblings'
        files alone), and every other rank's whose lock is free (held while deleting, so
        that rank's next run cannot create its files in between) - a crash at world size 2
        followed by a run at world size 1 would otherwise leave rank 1's files forever."""
        by_rank: dict[int, list[str]] = {}
        for name in os.listdir(self.path):
            rank = rank_of(name)
            if rank is not None and (rank != self.rank or own_rank):
                by_rank.setdefault(rank, []).append(name)
        for rank, names in sorted(by_rank.items()):
            fd = None
            if rank != self.rank:
                fd = try_lock(os.path.join(self.path, f"rank{rank}.lock"))
                if fd is None:
                    continue  # a live run's files
            try:
                for name in names:
                    stale = os.path.join(self.path, name)
                    logger.warning("removing stale swap file %s left by a run that did not exit cleanly", stale)
                    try:
                        os.unlink(stale)
                    except FileNotFoundError:
                        pass
                if fd is not None:  # the dead rank's lock file too (its next run re-creates it)
                    os.unlink(os.path.join(self.path, f"rank{rank}.lock"))
            finally:
                if fd is not None:
                    os.close(fd)

    def create(self, tier: str, sizes: Sequence[int]) -> "SwapFile":
        """Create and preallocate the tier's swap file with one slot per size."""
        if tier in self.files:
            raise ValueError(f"swap file for tier {tier!r} already exists")
        slots, total = plan_slots(sizes)
        own = f".e{self.engine}" if self.engine else ""  # the engine's own name beside others
        path = os.path.join(self.path, f"rank{self.rank}.{tier}{own}.swap")
        swap = SwapFile(path, slots, total)
        self.files[tier] = swap
        return swap

    def discard(self) -> None:
        """Delete this rank's swap files and lock now, without waiting for anything (the
        process is about to die of a signal: [Note: cleanup on signals])."""
        if self.closed:
            return
        for swap in list(self.files.values()):
            try:
                swap.delete()
            except OSError:
                pass
        self.close()

    def close(self) -> None:
        """Delete this rank's swap files and release the lock (idempotent). The lock is
        released even when a file cannot be deleted (that is raised afterwards, naming it):
        a later run in this process or another must not find the directory still held."""
        if self.closed:
            return
        self.closed = True
        _OPEN_DIRS.discard(self)
        failed: list[tuple[str, OSError]] = []
        for swap in self.files.values():
            try:
                swap.delete()
            except OSError as exc:
                failed.append((swap.path, exc))
        self.files.clear()
        failed += self._claim.unshare(self.engine)  # the last engine of the process: the lock
        try:
            os.rmdir(self.path)  # only if no other rank's files remain
        except OSError:
            pass
        if failed:
            path, first = failed[0]
            raise OSError(
                first.errno,
                f"could not delete {', '.join(p for p, _ in failed)} ({first.strerror}); the lock "
                "is released and the next run on this nvme_path deletes them, or delete them "
                "by hand",
                path,
            )

    def __enter__(self) -> "SwapDirectory":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not self.closed:
            self.close()


# [Note: cleanup on signals] SIGTERM (what torchrun sends the surviving ranks when one
# fails, and what schedulers send at a time limit) and SIGHUP (a closed terminal) kill a
# process without running `close()`, finalizers or atexit hooks: its swap files (often the
# size of the model's training state) and its lock would stay on the disk. While a swap
# directory is open we install a handler for each signal whose disposition is the default
# (termination): it deletes the open directories' files and locks, then restores the
# default and re-sends the signal, so the process still dies of it (its exit status and a
# launcher's view are unchanged). A handler the user installed, or SIG_IGN, is left alone:
# then cleaning up is theirs (call engine.close()). SIGKILL cannot be caught; the next run
# deletes what it left ([Note: stale swap files]).
_OPEN_DIRS: "weakref.WeakSet[SwapDirectory]" = weakref.WeakSet()
_CLEANUP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
_installed: dict[int, signal.Handlers] = {}


def swap_held(path: str) -> tuple[int, int]:
    """How many open swap directories (engines, one rank each) this process has in swap
    directory `path` (`SwapDirectory.path`), and the bytes of their swap files together."""
    dirs = [d for d in list(_OPEN_DIRS) if d.path == path and not d.closed]
    return len(dirs), sum(f.total_bytes for d in dirs for f in d.files.values())


def _cleanup_and_die(signum: int, frame: object) -> None:
    for d in list(_OPEN_DIRS):
        d.discard()
    for sig, previous in _installed.items():
        signal.signal(sig, previous)
    _installed.clear()
    os.kill(os.getpid(), signum)


def _install_signal_cleanup() -> None:
    if _installed or threading.current_thread() is not threading.main_thread():
        return  # installed already; or not allowed outside the main thread
    for sig in _CLEANUP_SIGNALS:
        if signal.getsignal(sig) is signal.SIG_DFL:
            signal.signal(sig, _cleanup_and_die)
            _installed[sig] = signal.SIG_DFL


class SwapFile:
    """A preallocated file of aligned slots, with a record of which slots hold data.

    [Note: held swap file] The file is held open for the swap file's life and every request
    opens it through that descriptor (/proc/self/fd/N), never by its path: if another program
    deletes or replaces the path mid-run (a tmp cleaner, a user), offload keeps reading and
    writing its own inode, so nothing is lost or read back as zeros (a request by path with
    O_CREAT would write a fresh sparse file, whose unwritten slots read as zeros). The first
    request after such a change logs a warning naming the file; the disk space stays in use
    until `close()`. `delete()` unlinks the path only while it is still this file.
    """

    _PROC_FD = "/proc/self/fd"

    def __init__(self, path: str, slots: list[Slot], total_bytes: int) -> None:
        self.path = path
        self.slots = slots
        self.total_bytes = total_bytes
        check_free_space(os.path.dirname(path), total_bytes, f"swap file {os.path.basename(path)}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            if total_bytes:
                os.posix_fallocate(fd, 0, total_bytes)
        except OSError as exc:
            os.close(fd)
            os.unlink(path)
            raise OSError(
                exc.errno,
                f"could not preallocate {format_bytes(total_bytes)} for swap file {path}: "
                f"{exc.strerror}; free space on that disk or point nvme_path elsewhere",
                path,
            ) from exc
        self._fd: Optional[int] = fd
        st = os.fstat(fd)
        self._identity = (st.st_dev, st.st_ino)
        self._io_path = f"{self._PROC_FD}/{fd}" if os.path.isdir(self._PROC_FD) else path
        self._vanished_warned = False
        self._written = [False] * len(slots)
        self._failed: dict[int, BaseException] = {}
        """Slots whose last write failed, with the error (for the message of a later read)."""

    # -- I/O through the held descriptor -------------------------------------------------

    def read(self, aio: AIOHandle, buf: torch.Tensor, offset: int) -> IORequest:
        """Submit a read of `buf.nbytes` bytes at `offset` (an `IORequest`)."""
        return aio.pread(buf, self._opened(), offset, name=self.path)

    def write(self, aio: AIOHandle, buf: torch.Tensor, offset: int) -> IORequest:
        """Submit a write of `buf` at `offset` (an `IORequest`)."""
        return aio.pwrite(buf, self._opened(), offset, name=self.path)

    def _opened(self) -> str:
        if self._fd is None:
            raise RuntimeError(f"swap file {self.path} is closed (the engine was closed)")
        if not self._vanished_warned and not self.present():
            self._vanished_warned = True
            logger.warning(
                "swap file %s was deleted or replaced by another program during the run; "
                "offload keeps using its own open copy (nothing is lost; its disk space is "
                "freed at close). Keep other programs out of nvme_path.", self.path,
            )
        return self._io_path

    def present(self) -> bool:
        """Whether `path` still names this file (not deleted, not replaced)."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return False
        return (st.st_dev, st.st_ino) == self._identity

    # -- which slots hold data -----------------------------------------------------------

    def mark_written(self, index: int, written: bool = True) -> None:
        """Record that slot `index` holds data of this run (False: it no longer does, e.g.
        its shard was freed)."""
        self._written[index] = bool(written)
        self._failed.pop(index, None)

    def mark_failed(self, index: int, error: BaseException) -> None:
        """Record that the last write of slot `index` failed: its bytes are undefined until
        it is written again."""
        self._written[index] = False
        self._failed[index] = error

    def is_written(self, index: int) -> bool:
        return self._written[index]

    def write_failure(self) -> Optional[BaseException]:
        """The error of a slot whose last write failed (its data is lost), or None."""
        return next(iter(self._failed.values()), None)

    def check_readable(self, index: int) -> Slot:
        """The slot to read; raises if nothing valid was written there in this run."""
        if not self._written[index]:
            failed = self._failed.get(index)
            if failed is not None:
                raise RuntimeError(
                    f"slot {index} of {self.path} holds no valid data: its last write failed "
                    f"({type(failed).__name__}: {failed}); restore the state with "
                    "engine.load_checkpoint"
                )
            raise RuntimeError(
                f"slot {index} of {self.path} was never written in this run; refusing to read "
                f"stale or uninitialised bytes"
            )
        return self.slots[index]

    def delete(self) -> None:
        """Unlink the path (if it still names this file) and close the descriptor (which
        frees the space of a file another program deleted)."""
        try:
            if self.present():
                try:
                    os.unlink(self.path)
                except FileNotFoundError:
                    pass
        finally:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def swap_bytes_needed(size_lists: Iterable[Sequence[int]]) -> int:
    """Total bytes the swap files for these per-tier slot sizes will occupy."""
    return sum(plan_slots(sizes)[1] for sizes in size_lists)
