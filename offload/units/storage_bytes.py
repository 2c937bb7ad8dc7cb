"""Freeing and re-allocating a tensor's bytes in place ([Note: freeing by storage resize] in
offload/units/shard.py): the tensor objects, and every view of them, stay valid."""

from __future__ import annotations

import torch

__all__ = ["free_storage", "alloc_storage"]


def free_storage(t: torch.Tensor) -> None:
    storage = t.untyped_storage()
    if storage.nbytes() != 0:
        storage.resize_(0)


def alloc_storage(t: torch.Tensor) -> None:
    storage = t.untyped_storage()
    need = t.numel() * t.element_size()
    if storage.nbytes() != need:
        storage.resize_(need)
