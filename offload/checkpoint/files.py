"""The checkpoint directory on disk: tags, the `latest` pointer, durable renames.

    save_dir/
      latest                      the tag of the newest complete checkpoint (one line)
      global_step100/             one complete checkpoint (a "tag")
        manifest.json             written last, by rank 0
        rank00000.shards          rank 0's optimizer state, unit by unit
        rank00000.state           rank 0's small state (torch.save bytes)
        ...
      .tmp-global_step200-<hex>/  a save in progress, or one killed part way

[Note: crash safety]
A checkpoint becomes visible only when complete. Every rank writes into a temporary
directory and fsyncs its files; rank 0 then writes and fsyncs the manifest, fsyncs the
directory, renames it to its tag and fsyncs the parent, and only then replaces `latest`
(temporary file, fsync, rename, fsync the parent). A process killed at any point leaves
either the old `latest` (pointing at the previous, complete checkpoint) or the new one
(pointing at a complete, renamed directory). A killed save leaves a `.tmp-*` directory,
which loading never looks at and the next save removes. Re-saving an existing tag swaps the
directories atomically (renameat2 RENAME_EXCHANGE) where the kernel offers it.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import time
import uuid
from typing import Optional

class CheckpointCorruptError(OSError):
    """A checkpoint file is torn, truncated or corrupt (checksum or size mismatch, a damaged
    manifest or `latest`)."""


LATEST = "latest"
MANIFEST = "manifest.json"
TMP_PREFIX = ".tmp-"
_TRASH_PREFIX = ".old-"


def shard_file(rank: int) -> str:
    return f"rank{rank:05d}.shards"


def state_file(rank: int) -> str:
    return f"rank{rank:05d}.state"


def check_tag(tag: str) -> str:
    if not isinstance(tag, str) or not tag:
        raise ValueError(f"checkpoint tag must be a non-empty string, got {tag!r}")
    if "/" in tag or "\0" in tag or tag.startswith(".") or tag == LATEST:
        raise ValueError(
            f"checkpoint tag {tag!r} is not usable as a directory name (no '/', no leading "
            f"'.', not {LATEST!r}); use e.g. 'global_step1000'"
        )
    return tag


def list_tags(directory: str) -> list[str]:
    """Complete checkpoints in `directory` (sub-directories holding a manifest), sorted."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(
        n for n in names
        if not n.startswith(".") and os.path.isfile(os.path.join(directory, n, MANIFEST))
    )


def resolve_tag(load_dir: str, tag: Optional[str]) -> str:
    """The checkpoint directory to load: `tag`, or the one `latest` names. Errors list the
    tags present so the caller can pick one."""
    if not os.path.isdir(load_dir):
        what = "is not a directory" if os.path.exists(load_dir) else "does not exist"
        raise FileNotFoundError(
            errno.ENOENT, f"checkpoint directory {load_dir!r} {what}; pass the save_dir that "
            "save_checkpoint wrote to", load_dir,
        )
    present = list_tags(load_dir)
    if tag is None:
        latest = os.path.join(load_dir, LATEST)
        try:
            with open(latest, "rb") as f:
                raw = f.read()
            tag = raw.decode().strip()
            if not tag or "\n" in tag:
                raise ValueError("no tag" if not tag else "several lines")
            check_tag(tag)
            if not os.path.isfile(os.path.join(load_dir, tag, MANIFEST)):
                raise ValueError(f"it names {tag!r}, which is no complete checkpoint here")
        except (UnicodeDecodeError, ValueError) as exc:
            why = "it is not text" if isinstance(exc, UnicodeDecodeError) else str(exc)
            raise CheckpointCorruptError(
                errno.EIO, f"{latest!r} is damaged ({why}; it holds {raw[:80]!r}): pass one of the "
                f"tags present as tag=...: {present or 'none'}", latest,
            ) from None
        except FileNotFoundError:
            if present:
                raise FileNotFoundError(
                    errno.ENOENT, f"{load_dir!r} has no {LATEST!r} file; pass one of the tags "
                    f"present: {present}", latest,
                ) from None
            raise FileNotFoundError(
                errno.ENOENT, f"no checkpoint in {load_dir!r} (no {LATEST!r} file and no tag "
                "directories with a manifest)", latest,
            ) from None
    check_tag(tag)
    path = os.path.join(load_dir, tag)
    if not os.path.isdir(path):
        raise FileNotFoundError(
            errno.ENOENT, f"checkpoint tag {tag!r} not found in {load_dir!r}; tags present: "
            f"{present or 'none'}", path,
        )
    return path


# -- durability -------------------------------------------------------------------------------


def fsync_path(path: str) -> None:
    """fsync a file or a directory by name (a directory's fsync makes its entries durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_durably(path: str, data: bytes) -> None:
    """Write `data` to `path` (created or truncated) and fsync it."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def replace_file_durably(path: str, data: bytes) -> None:
    """Atomically make `path` hold `data`: temporary sibling, fsync, rename, fsync parent."""
    parent = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(parent, f".{os.path.basename(path)}.{uuid.uuid4().hex}")
    try:
        write_file_durably(tmp, data)
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    fsync_path(parent)


def new_temp_dir(save_dir: str, tag: str) -> str:
    path = os.path.join(save_dir, f"{TMP_PREFIX}{tag}-{uuid.uuid4().hex[:12]}")
    # No fsync of save_dir here: the directory only matters once renamed, and the rename
    # is followed by an fsync of save_dir (publish_dir).
    os.mkdir(path)
    return path


def remove_stale(save_dir: str, keep: Optional[str] = None) -> list[str]:
    """Remove temporary directories left by killed saves (all `.tmp-*` and `.old-*` but
    `keep`). Call only while no other save into `save_dir` runs."""
    removed = []
    for name in os.listdir(save_dir):
        if name.startswith((TMP_PREFIX, _TRASH_PREFIX)) and name != keep:
            path = os.path.join(save_dir, name)
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(name)
    return removed


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_libc = None


def _renameat2():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return getattr(_libc, "renameat2", None)


def publish_dir(tmp: str, final: str) -> None:
    """Make directory `tmp` visible as `final`, durably. An existing `final` is replaced
    atomically (exchanged, then removed) where renameat2(RENAME_EXCHANGE) exists; otherwise
    it is moved aside first (a crash in between leaves it under `.old-*`, not lost)."""
    parent = os.path.dirname(os.path.abspath(final))
    if not os.path.exists(final):
        os.rename(tmp, final)
    else:
        fn = _renameat2()
        done = False
        if fn is not None:
            rc = fn(_AT_FDCWD, os.fsencode(tmp), _AT_FDCWD, os.fsencode(final), _RENAME_EXCHANGE)
            if rc == 0:
                done = True
            else:
                err = ctypes.get_errno()
                if err not in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                    raise OSError(err, f"renameat2({tmp!r}, {final!r}): {os.strerror(err)}", final)
        if done:
            fsync_path(parent)
            shutil.rmtree(tmp, ignore_errors=True)  # now holds the old checkpoint
            return
        trash = os.path.join(parent, f"{_TRASH_PREFIX}{os.path.basename(final)}-{uuid.uuid4().hex[:12]}")
        os.rename(final, trash)
        os.rename(tmp, final)
        fsync_path(parent)
        shutil.rmtree(trash, ignore_errors=True)
        return
    fsync_path(parent)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


# -- a test hook ------------------------------------------------------------------------------

_PAUSE_AT = "OFFLOAD_CHECKPOINT_TEST_PAUSE_AT"
_PAUSE_FILE = "OFFLOAD_CHECKPOINT_TEST_PAUSE_FILE"
IO_DELAY_ENV = "OFFLOAD_CHECKPOINT_TEST_IO_DELAY_S"


def test_pause(stage: str) -> None:
    """Testing aid for kill -9 tests (tests/test_checkpoint.py): when the environment names
    this stage ('shards': after the first unit is submitted; 'rename': before the temporary
    directory is renamed; 'latest': after the rename, before `latest` moves), touch the
    marker file and sleep until killed. Unset in production: a dictionary lookup."""
    if os.environ.get(_PAUSE_AT) != stage:
        return
    marker = os.environ.get(_PAUSE_FILE)
    if marker:
        with open(marker, "w") as f:
            f.write(stage)
    while True:
        time.sleep(3600)


def io_delay_s() -> float:
    """Per-block delay for AIOHandle(inject_delay_s=...) in tests that kill a slow save."""
    return float(os.environ.get(IO_DELAY_ENV, "0") or 0)
