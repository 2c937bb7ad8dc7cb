"""A process's claim on one rank's swap files under `<nvme_path>/offload-swap/`.

[Note: one claim per process, one name per engine] The lock `rank{R}.lock` (an exclusive
`flock`, [Note: stale swap files] in offload/storage/swap.py) says which *process* uses rank
R's swap files there; it is held once per process, however many engines of the process use
the path (a notebook cell run again beside the first engine, a policy and its frozen
reference in RLHF, models trained in turn). `claim_rank` hands each `SwapDirectory` a share
of that claim and a number of its own, `engine`; its files are named by it
(`rank{R}.{tier}.swap` for the first engine, `rank{R}.{tier}.e{N}.swap` for the N-th beside
it), so each engine deletes only its own files at `close()`. The claim's first share
deletes what a dead process left (its lock was free); the last share to go removes the lock.
Another process on the same path and rank still finds the lock held: a clear error, as two
processes sharing swap files would corrupt each other.
"""

from __future__ import annotations

import fcntl
import os
import socket
import threading
import time
from typing import Optional

__all__ = ["RankClaim", "claim_rank", "claims_alive", "rank_of", "same_file", "try_lock"]

LOCK_WAIT_S = 2.0
"""How long a claim waits for its rank's lock before calling the holder a live run (another
rank may hold it for a moment while it deletes stale files)."""


def rank_of(name: str) -> Optional[int]:
    """R of a swap file name `rank{R}.{tier}[.e{N}].swap`, else None."""
    if not (name.startswith("rank") and name.endswith(".swap")):
        return None
    head = name[4:].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def same_file(fd: int, path: str, dir_fd: Optional[int] = None) -> bool:
    """Whether `path` (relative to `dir_fd` when given) is still the file open at `fd`."""
    try:
        st = os.stat(path, dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    fst = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


def try_lock(lock_path: str) -> Optional[int]:
    """An fd holding a rank's lock file exclusively (created if missing: its run is gone),
    or None when a live run holds it."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    if not same_file(fd, lock_path):  # replaced meanwhile: its new owner is alive
        os.close(fd)
        return None
    return fd


def read_quietly(fd: int) -> str:
    try:
        return os.pread(fd, 256, 0).decode(errors="replace").strip()
    except OSError:
        return ""


class RankClaim:
    """This process's lock on one rank's swap files in one directory, shared by its engines."""

    def __init__(self, path: str, rank: int) -> None:
        self.path = path
        self.rank = rank
        self.lock_path = os.path.join(path, f"rank{rank}.lock")
        self.fd = _lock(path, self.lock_path, rank)
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"pid={os.getpid()} host={socket.gethostname()} "
                           f"since={time.strftime('%Y-%m-%dT%H:%M:%S')}\n".encode(), 0)
        self.engines: set[int] = set()
        """The numbers of the shares held now."""
        self.fresh = True
        """No share was handed out yet: the first deletes what a dead process left."""

    def share(self) -> int:
        """A number no live share of this claim has (the lowest free: 0 for the first)."""
        n = 0
        while n in self.engines:
            n += 1
        self.engines.add(n)
        return n

    def unshare(self, engine: int) -> list[tuple[str, OSError]]:
        """Give share `engine` back; the last one removes the lock (the failures to delete
        it, as (path, error))."""
        with _CLAIMS_LOCK:
            self.engines.discard(engine)
            if self.engines:
                return []
            if _CLAIMS.get((self.path, self.rank)) is self:
                del _CLAIMS[(self.path, self.rank)]
        failed: list[tuple[str, OSError]] = []
        try:
            if same_file(self.fd, self.lock_path):  # not a newer claim's lock (ours was deleted)
                os.unlink(self.lock_path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            failed.append((self.lock_path, exc))
        os.close(self.fd)  # closing the fd drops the flock
        return failed


_CLAIMS: dict[tuple[str, int], RankClaim] = {}
_CLAIMS_LOCK = threading.Lock()


def claim_rank(path: str, rank: int) -> tuple[RankClaim, int, bool]:
    """This process's claim on rank `rank`'s files in swap directory `path` (made on first
    use: raises when another live process holds it), a share of it, and whether the share
    is the claim's first (the caller deletes the rank's stale files then)."""
    with _CLAIMS_LOCK:
        claim = _CLAIMS.get((path, rank))
        if claim is None:
            claim = _CLAIMS[(path, rank)] = RankClaim(path, rank)
        first, claim.fresh = claim.fresh, False
        return claim, claim.share(), first


def claims_alive(path: str) -> int:
    """How many engines of this process hold swap files in swap directory `path`."""
    with _CLAIMS_LOCK:
        return sum(len(c.engines) for (p, _), c in _CLAIMS.items() if p == path)


def _lock(path: str, lock_path: str, rank: int) -> int:
    """Open and lock the rank's lock file; its descriptor.

    A lock on a file that is no longer at `lock_path` (unlinked by a clean close or by
    another rank's stale-file cleanup between our open and our flock) is worthless: drop it
    and open again. Another rank may hold our lock for a moment while it deletes the files
    our crashed predecessor left; a live run holds it for its whole life, so only after
    LOCK_WAIT_S is the holder called a live run."""
    deadline = time.monotonic() + LOCK_WAIT_S
    for _ in range(1000):
        os.makedirs(path, exist_ok=True)
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except FileNotFoundError:
            continue  # another rank's close() removed the (empty) directory just now
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if time.monotonic() < deadline:
                os.close(fd)
                time.sleep(0.02)
                continue
            owner = read_quietly(fd)
            os.close(fd)
            raise RuntimeError(
                f"swap directory {path} (rank {rank}) is in use by another live run "
                f"({owner or 'owner unknown'}); give each run its own nvme_path"
            ) from None
        if same_file(fd, lock_path):
            return fd
        os.close(fd)
    raise RuntimeError(f"could not lock {lock_path}: it keeps being replaced")
