"""`offload.init(config)`: build a model directly into its shards.

(The module is `meta_init`, not `init`, so that importing it never shadows the
`offload.init` context in the package namespace.)

    with offload.init(config):
        model = GPT(cfg)                          # parameters on the meta device
    engine = offload.initialize(model, config)    # materialised unit by unit into shards

The replay and its guarantees are in `offload.units.materialize`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import torch
from torch import nn

import offload.units.materialize as _materialize

__all__ = ["init"]


class init(contextlib.AbstractContextManager):
    """Context: modules built inside are created on the meta device (torch's own
    `torch.device("meta")` mode; nothing is patched), to be materialised into their shards
    by the next `offload.initialize` — see `offload.units.materialize` for what equals a plain
    construction. `init_fn(module)` runs after each module's `reset_parameters()`."""

    def __init__(self, config: Any = None, init_fn: Optional[Callable[[nn.Module], None]] = None):
        if config is not None:
            from offload.config import load_config

            config = load_config(config)  # config errors surface here, at the door
        self.config = config
        self.init_fn = init_fn
        self._device_ctx: Optional[torch.device] = None

    def __enter__(self) -> "init":
        self._device_ctx = torch.device("meta")
        self._device_ctx.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._device_ctx is not None
        self._device_ctx.__exit__(*exc)
        self._device_ctx = None
        _materialize.set_pending_init_fn(self.init_fn)
