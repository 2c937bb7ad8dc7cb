"""Activation checkpoints kept in host memory (ZeRO-R's CPU checkpointing).

    from offload.checkpointing import checkpoint
    x = checkpoint(block, x)          # torch.utils.checkpoint.checkpoint, plus:

With `cpu_offload` (config `activation_checkpointing.cpu_offload`, DeepSpeed's
`activation_checkpointing.cpu_checkpointing`: in force while that engine's forward runs; or
`configure(cpu_offload=True)` / DeepSpeed's `checkpointing.configure`, process-wide), a checkpointed region's tensor inputs - the
only activations a checkpointed model keeps between its forward and its backward - are
copied to pinned host memory during the forward, and the device copies are let go. In
backward, just before the region is recomputed, they are copied back; and while it is
recomputed, the inputs of the region that backward reaches next are already on their way
back on a side stream. So on a GPU the device holds no checkpointed activation between
forward and backward: for a transformer of L checkpointed layers that is L x (micro-batch x
sequence x hidden x bytes) of device memory, the rest of the activations being recomputed
anyway. The cost is one device-to-host and one host-to-device copy of those bytes per step,
overlapped with compute.

[Note: activation regions] The region runs its forward on the original device inputs
(nothing is copied back for it), the autograd graph and the gradients are torch's own
non-reentrant checkpoint's: only what is *kept* changes. torch's checkpoint keeps the
inputs it is called with for the recomputation, so it is called with the host copies, and
the function it recomputes (`_Region.run`) brings them back to the device first. Values
are the same bits, so the recomputation, the gradients and the trained weights equal
torch's checkpoint exactly (tests/test_activations.py).

On the CPU there is nothing to offload to: the region still takes the same path (a host
copy, brought back before recompute), which is what the CPU tests check; it saves nothing
there and costs a copy, so leave `cpu_offload` off for CPU training.

DeepSpeed's `partition_activations` splits checkpoints across *model-parallel* ranks;
offload has data parallelism only (each rank's activations are its own micro-batch's), so
there is nothing to partition: the config translation says so.
"""

from __future__ import annotations

import contextvars
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.utils.checkpoint as torch_checkpoint

from offload.devices import StreamPurpose, side_stream

__all__ = ["checkpoint", "configure", "is_configured", "reset", "ActivationSettings", "enter_engine", "leave_engine",
           "in_force"]


@dataclass(frozen=True)
class ActivationSettings:
    cpu_offload: bool = False
    """Keep checkpointed regions' inputs in (pinned) host memory between forward and recompute."""


_SETTINGS: Optional[ActivationSettings] = None
"""Set by `configure` (the user's, or DeepSpeed's `checkpointing.configure`): process-wide,
as DeepSpeed's is."""

_ENGINE_SETTINGS: contextvars.ContextVar[Optional[ActivationSettings]] = contextvars.ContextVar(
    "offload_engine_activation_settings", default=None)
"""The settings of the engine whose forward is running (its config's
`activation_checkpointing`): they win over `configure`'s while it runs, and only then, so one
engine's config never changes another model's checkpoints."""

_PENDING: list["weakref.ReferenceType[_Region]"] = []
"""Regions whose inputs are on the host, in forward order: backward recomputes them in
reverse, so while one is brought back the one before it is prefetched."""


def configure(settings: Any = None, *, cpu_offload: Optional[bool] = None) -> None:
    """Set the defaults of `checkpoint`: from an `ActivationCheckpointingConfig` (or any
    object with `cpu_offload`), and/or the keyword."""
    global _SETTINGS
    value = bool(getattr(settings, "cpu_offload", False)) if settings is not None else False
    if cpu_offload is not None:
        value = bool(cpu_offload)
    _SETTINGS = ActivationSettings(cpu_offload=value)


def enter_engine(settings: Optional[ActivationSettings]) -> contextvars.Token:
    """An engine's forward begins: its settings (None: `configure`'s) are in force."""
    return _ENGINE_SETTINGS.set(settings)


def leave_engine(token: contextvars.Token) -> None:
    _ENGINE_SETTINGS.reset(token)


def in_force() -> ActivationSettings:
    """The settings `checkpoint` uses now: the running engine's, else `configure`'s, else the
    defaults."""
    return _ENGINE_SETTINGS.get() or _SETTINGS or ActivationSettings()


def is_configured() -> bool:
    return _SETTINGS is not None


def reset() -> None:
    """Back to the defaults (no CPU offload); drop the regions waiting for backward."""
    global _SETTINGS
    _SETTINGS = None
    _PENDING.clear()


def checkpoint(function: Callable[..., Any], *args: Any, cpu_offload: Optional[bool] = None,
               use_reentrant: bool = False, **kwargs: Any) -> Any:
    """`torch.utils.checkpoint.checkpoint(function, *args, **kwargs)` (non-reentrant); with
    `cpu_offload` (default: `configure`'s) its tensor inputs wait for the recomputation in
    host memory (module docstring)."""
    offload = in_force().cpu_offload if cpu_offload is None else cpu_offload
    if use_reentrant:
        if offload:
            raise ValueError("checkpoint(cpu_offload=True) needs the non-reentrant checkpoint; "
                             "drop use_reentrant=True")
        return torch_checkpoint.checkpoint(function, *args, use_reentrant=True, **kwargs)
    if not offload or not torch.is_grad_enabled() or not any(isinstance(a, torch.Tensor) for a in args):
        return torch_checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)
    region = _Region(function, args, preserve_rng=kwargs.get("preserve_rng_state", True))
    return torch_checkpoint.checkpoint(region.run, *region.host_args, use_reentrant=False, **kwargs)


class _Region:
    """One checkpointed call: its inputs' host copies and the way back ([Note: activation
    regions])."""

    def __init__(self, function: Callable[..., Any], args: tuple, preserve_rng: bool = True) -> None:
        self.function = function
        self.preserve_rng = preserve_rng
        """torch's `preserve_rng_state`: the recompute draws the forward's random numbers."""
        self.rng_state: Optional[torch.Tensor] = None
        """CUDA: the device generator's state when the forward ran."""
        self.device_args: Optional[list[Any]] = list(args)
        """The original inputs, for the forward only; dropped once it ran."""
        self.devices = [a.device if isinstance(a, torch.Tensor) else None for a in args]
        cuda = [a.device for a in args if isinstance(a, torch.Tensor) and a.is_cuda]
        self.device: Optional[torch.device] = cuda[0] if cuda else None
        self.stream: Any = None
        if self.device is not None:
            self.stream = _side_stream(self.device)
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # inputs computed
        self.host_args = tuple(self._to_host(a) for a in args)
        self.copied: Any = None
        """CUDA: the event after the device-to-host copies."""
        if self.stream is not None:
            self.copied = torch.cuda.Event()
            self.copied.record(self.stream)
        self.back: Optional[list[Any]] = None
        """CUDA: the inputs prefetched back to the device (`prefetch`), until used."""
        self.back_ready: Any = None
        _PENDING.append(weakref.ref(self))

    def _to_host(self, a: Any) -> Any:
        if not isinstance(a, torch.Tensor):
            return a
        if not a.is_cuda:  # the CPU: the same path, nothing saved ([Note: activation regions])
            return a.detach().clone().requires_grad_(a.requires_grad)
        host = torch.empty(a.shape, dtype=a.dtype, pin_memory=True)
        with torch.cuda.stream(self.stream):
            host.copy_(a.detach(), non_blocking=True)
        a.record_stream(self.stream)  # the device copy lives until the copy has read it
        return host.requires_grad_(a.requires_grad)

    def run(self, *host_args: Any) -> Any:
        if self.device_args is not None:  # the forward: the original inputs
            args, self.device_args = self.device_args, None
            if self.device is not None and self.preserve_rng:
                self.rng_state = torch.cuda.get_rng_state(self.device)
            return self.function(*args)
        args = self._bring_back(host_args)
        _prefetch_next_recompute(self)
        if self.rng_state is None:
            return self.function(*args)
        # [Note: the GPU's RNG in a region] torch's checkpoint stashes the RNG state of the
        # devices its inputs are on, and it sees only their host copies: the CUDA generator is
        # the region's to restore, or dropout draws new masks in the recompute (issue #30, F3).
        assert self.device is not None  # a CUDA RNG state is kept only with a device
        with torch.random.fork_rng(devices=[self.device]):
            torch.cuda.set_rng_state(self.rng_state, self.device)
            return self.function(*args)

    def _copy_back(self, host_args: tuple) -> list[Any]:
        out = []
        for h, dev in zip(host_args, self.devices):
            if isinstance(h, torch.Tensor):
                t = h.detach()
                if dev is not None and dev.type == "cuda":
                    t = t.to(dev, non_blocking=True)
                out.append(t.requires_grad_(h.requires_grad))
            else:
                out.append(h)
        return out

    def _bring_back(self, host_args: tuple) -> list[Any]:
        if self.back is not None:  # prefetched while the region after it recomputed
            torch.cuda.current_stream(self.device).wait_event(self.back_ready)
            args, self.back = self.back, None
            return args
        if self.copied is not None:
            self.copied.synchronize()  # the host copies are complete
        return self._copy_back(host_args)

    def prefetch(self) -> None:
        """Start bringing the inputs back on the side stream (CUDA; nothing on the CPU)."""
        if self.stream is None or self.back is not None or self.device_args is not None:
            return
        main = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(self.copied)
            self.back = self._copy_back(self.host_args)
            for t in self.back:
                if isinstance(t, torch.Tensor) and t.is_cuda:
                    t.record_stream(main)  # used on the main stream by the recompute
            self.back_ready = torch.cuda.Event()
            self.back_ready.record(self.stream)


def _prefetch_next_recompute(current: _Region) -> None:
    """`current` is being recomputed: backward recomputes the region before it (in forward
    order) next, so that one's inputs start coming back now."""
    while _PENDING:
        region = _PENDING[-1]()
        if region is None or region is current:
            _PENDING.pop()
            continue
        region.prefetch()
        return


def _side_stream(device: torch.device) -> Any:
    return side_stream(device, StreamPurpose.ACTIVATIONS)
