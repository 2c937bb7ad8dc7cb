"""offload: train models far larger than GPU memory on one node.

ZeRO-3 partitioning with parameter and optimizer shards paged between the compute device,
pinned CPU memory and NVMe. The user's surface is small:

    import offload
    engine = offload.initialize(model, config)
    loss = engine(batch); engine.backward(loss); engine.step()
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["Config", "initialize", "init", "Engine", "enable_logging", "__version__"]

# Lazy attributes: `import offload` stays cheap (no torch.distributed, no native load)
# until the user reaches for the engine.
_LAZY = {
    "Config": ("offload.config", "Config"),
    "initialize": ("offload.engine", "initialize"),
    "Engine": ("offload.engine", "Engine"),
    "init": ("offload.meta_init", "init"),
    # Show offload's INFO records (the initialize line, the step report): docs/engine.md.
    "enable_logging": ("offload.runtime.report", "enable_logging"),
}

if TYPE_CHECKING:  # pragma: no cover
    from offload.config import Config
    from offload.engine import Engine, initialize
    from offload.meta_init import init
    from offload.runtime.report import enable_logging


def __getattr__(name: str) -> Any:
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'offload' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value
