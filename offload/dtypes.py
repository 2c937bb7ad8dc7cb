"""The dtypes offload knows, one table each way.

Config names ('fp32', 'bf16', 'fp16') map to torch dtypes through `DTYPES`; checkpoint
manifests store torch's own names ('float32', 'bfloat16', ...) and read them back through
`from_name`.
"""

from __future__ import annotations

import torch

__all__ = ["DTYPES", "MOMENT_DTYPES", "from_name", "name_of"]

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""Compute dtypes by config name (`precision.dtype`)."""

MOMENT_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""Adam moment dtypes by config name (`optimizer.moments_dtype`)."""

_BY_NAME: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int64,
              torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
}


def name_of(dtype: torch.dtype) -> str:
    """torch's name of `dtype` without the 'torch.' prefix ('bfloat16')."""
    return str(dtype).removeprefix("torch.")


def from_name(name: str) -> torch.dtype:
    """The dtype `name_of` named."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown dtype name {name!r}; known: {', '.join(_BY_NAME)}") from None

