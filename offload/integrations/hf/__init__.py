"""Hugging Face integration (the `hf` extra: transformers, accelerate, peft).

- `OffloadTrainer` (trainer.py): `transformers.Trainer` with the engine underneath; a
  Trainer script switches by changing the class name and passing `offload_config=`.
  `OffloadTrainerMixin` does the same for a Trainer subclass (TRL's `SFTTrainer`, ...).
- `from_pretrained` (pretrained.py): a Hugging Face checkpoint directory loaded straight into
  the engine's shards by the next `offload.initialize` (or `OffloadTrainer`).
- `resolve_auto` (auto.py): a DeepSpeed config's `"auto"` values filled from
  `TrainingArguments` by transformers' rules.

Importing this package imports nothing of transformers: `resolve_auto` reads the arguments
by attribute, and the other two are loaded when first used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from offload.integrations.hf.auto import resolve_auto

__all__ = ["OffloadTrainer", "OffloadTrainerMixin", "from_pretrained", "resolve_auto"]

_LAZY = {
    "OffloadTrainer": "offload.integrations.hf.trainer",
    "OffloadTrainerMixin": "offload.integrations.hf.trainer",
    "from_pretrained": "offload.integrations.hf.pretrained",
}

if TYPE_CHECKING:  # pragma: no cover
    from offload.integrations.hf.pretrained import from_pretrained
    from offload.integrations.hf.trainer import OffloadTrainer, OffloadTrainerMixin


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'offload.integrations.hf' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
