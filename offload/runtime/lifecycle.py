"""An engine's life around the user's model: its state, the hooks that must not keep it
alive, the exit hook for engines never closed, and what a closed engine leaves behind.

Kept apart from `offload.engine` so that the engine's training path stays one file's
concern; nothing here imports the engine (it holds engines only weakly, as objects).
"""

from __future__ import annotations

import enum
import logging
import weakref
from typing import Any, Callable, Protocol

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from offload.devices import same_device

logger = logging.getLogger("offload.engine")

__all__ = ["EngineState"]


# [Note: weak hooks] Hooks live on the user's model, which usually outlives the engine
# (a notebook re-runs `engine = offload.initialize(model, ...)`, a script drops the engine
# without close()). A hook holding the engine's bound method would keep the engine, its
# swap files and its lock alive for as long as the model lives. So hooks hold the engine
# weakly, and a finalizer removes them when the engine is collected.


class Drains(Protocol):
    """An engine, as the exit path sees it."""

    def drain(self) -> None:
        """Finish every collective the engine issued asynchronously (a collective: every
        rank's engine calls it at the same point)."""


LIVE_ENGINES: "weakref.WeakSet[Any]" = weakref.WeakSet()
"""Engines not yet closed (`zero.GatheredParameters` and `safe_get_full_grad` find the
owner of a parameter among them)."""


def drain_at_exit(engine: Drains) -> weakref.finalize:
    """A script that ends without engine.close(): the interpreter's exit calls
    `engine.drain()` before it tears down ([Note: collective tensors at exit]). The returned
    finalizer holds the engine weakly (a dropped engine is collected as before); `close()`
    detaches it."""
    ref = weakref.ref(engine)

    def at_exit() -> None:
        live = ref()
        if live is None:
            return
        try:
            live.drain()
        except Exception:  # noqa: BLE001 - exiting anyway; a failed wait must not mask the exit
            pass

    return weakref.finalize(engine, at_exit)  # atexit=True: run at exit while the engine lives


class Holds(Protocol):
    """An engine, as a re-run `initialize` of its model sees it."""

    module: nn.Module

    def full_state_dict(self, rank0_only: bool = True) -> dict[str, Any]:
        ...

    def close(self) -> None:
        ...


def take_over(model: nn.Module) -> bool:
    """`initialize(model, ...)` while a live engine of this process holds `model` (a notebook
    cell run again): that engine hands the model back with its trained fp32 weights and
    closes (its swap files go, its lock is released), and the new engine builds from them.
    Every rank re-runs `initialize`, so the gather in `full_state_dict` is matched. Returns
    whether an engine was taken over. Needs the model's fp32 weights in host memory once."""
    held: list[Holds] = [e for e in list(LIVE_ENGINES) if e.module is model]  # built engines only
    if not held:
        return False
    engine = held[0]
    weights = engine.full_state_dict(rank0_only=False)
    engine.close()
    with torch.no_grad():
        for name, p in model.named_parameters(remove_duplicate=False):
            p.data = weights[name]  # fp32, real memory (an NVMe tier's close left none); tied: once each
    logger.warning("offload.initialize: this model was held by a live engine of this process; that "
                   "engine was closed and its weights taken over (close() an engine you are done with)")
    return True


class EngineState(enum.Enum):
    """Whether the engine's parameters, gradients and optimizer state are consistent."""

    READY = "ready"
    """Consistent: train, save, load, close."""
    FAILED = "failed"
    """An optimizer step (or a backward that ran updates) failed part-way: some units were
    updated and others not. Only `load_checkpoint` (which restores a consistent state) and
    `close` are allowed; the error that caused it belongs to the step that raised it."""


def bind(fn: Callable[..., Any], unit: Any) -> Callable[..., Any]:  # unit: whatever fn takes (generic)
    method = weakref.WeakMethod(fn)

    def hook(*args: Any) -> Any:
        bound = method()
        return None if bound is None else bound(unit, *args)

    return hook


def bind0(fn: Callable[[Any], None], unit: Any) -> Callable[[], None]:
    method = weakref.WeakMethod(fn)

    def callback() -> None:
        bound = method()
        if bound is not None:
            bound(unit)

    return callback


_CLOSED_MODEL_FIX = (
    "take the weights before close() with sd = engine.full_state_dict(), then "
    "model.to_empty(device='cpu'); model.load_state_dict(sd) (tied weights stay tied), or "
    "build the model again"
)


def released_parameters(model: nn.Module) -> list[str]:
    """Parameters whose memory an engine released (numel > 0, storage of 0 bytes)."""
    return [n for n, p in model.named_parameters()
            if p.device.type != "meta" and p.numel() and p.untyped_storage().nbytes() == 0]


def check_weights_present(model: nn.Module) -> None:
    empty = released_parameters(model)
    if empty:
        raise ValueError(
            f"the model's parameters {empty[:3]}{' ...' if len(empty) > 3 else ''} hold no data: "
            f"an offload engine that kept them on NVMe was closed; {_CLOSED_MODEL_FIX}"
        )


def forward_of_a_closed_model(module: nn.Module, args: Any) -> None:
    if any(e.module is module for e in list(LIVE_ENGINES)):
        return  # a new engine holds the model now (`take_over`): its units are its own
    empty = released_parameters(module)
    if empty:
        raise RuntimeError(
            f"this model's parameters ({empty[0]}, ...) belong to an offload engine that was "
            f"closed, which kept the weights on NVMe: the model has none now; {_CLOSED_MODEL_FIX}"
        )


def remove_hooks(handles: list[Any]) -> None:
    for h in handles:
        h.remove()
    handles.clear()


def cast_inputs(args: Any, kwargs: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """The model's inputs on the compute device, floating-point ones in the compute dtype
    (the root unit's pre-forward); the same objects when nothing needed moving."""
    flat, spec = tree_flatten((args, kwargs))
    changed = False
    for i, t in enumerate(flat):
        if isinstance(t, torch.Tensor):
            want = dtype if t.is_floating_point() else t.dtype
            if not same_device(t.device, device) or t.dtype != want:
                flat[i] = t.to(device=device, dtype=want)
                changed = True
    return tree_unflatten(flat, spec) if changed else (args, kwargs)
