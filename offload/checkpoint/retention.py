"""Keeping the last N checkpoints of a save directory (`--keep-last N`, HF's `save_total_limit`).

`prune(save_dir, keep_last)` removes the oldest complete checkpoints beyond the newest
`keep_last`, after a save: a checkpoint is removed only once a newer one is complete (its
directory renamed into place with its manifest, and `latest` moved to it), and the one
`latest` names is never removed, so a crash at any point leaves at least one complete
checkpoint `load_checkpoint` can resume from. Call it on one process per directory (rank 0
for a shared directory; each node's local rank 0 for node-local ones).
"""

from __future__ import annotations

import os
import shutil
from typing import Optional

from offload.checkpoint import files

__all__ = ["prune", "latest_tag", "checkpoint_bytes"]


def latest_tag(save_dir: str) -> Optional[str]:
    """The tag `save_dir/latest` names, or None (no complete checkpoint yet)."""
    try:
        with open(os.path.join(save_dir, files.LATEST)) as f:
            return f.read().strip() or None
    except FileNotFoundError:
        return None


def checkpoint_bytes(path: str) -> int:
    """The bytes a checkpoint directory holds on disk (its files' sizes)."""
    total = 0
    for root, _, names in os.walk(path):
        for n in names:
            try:
                total += os.path.getsize(os.path.join(root, n))
            except OSError:
                pass  # a file removed meanwhile
    return total


def prune(save_dir: str, keep_last: int) -> list[str]:
    """Remove the complete checkpoints of `save_dir` older than its newest `keep_last`
    (never the one `latest` names); returns the tags removed, oldest first."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 (got {keep_last}): the newest checkpoint is always kept")
    tags = files.list_tags(save_dir)  # complete: renamed into place with a manifest

    def saved_at(tag: str) -> float:
        return os.path.getmtime(os.path.join(save_dir, tag, files.MANIFEST))

    newest_first = sorted(tags, key=saved_at, reverse=True)
    keep = set(newest_first[:keep_last])
    latest = latest_tag(save_dir)
    if latest is not None:
        keep.add(latest)
    removed = [t for t in reversed(newest_first) if t not in keep]
    for tag in removed:
        shutil.rmtree(os.path.join(save_dir, tag))
    return removed
