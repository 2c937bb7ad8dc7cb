"""torch's `get_model_state_dict(engine.module)` through the sharded state dict.

[Note: torch's state-dict helpers on the engine's module]
`torch.distributed.checkpoint.state_dict.get_model_state_dict(model)` calls
`model.state_dict()` and, for FSDP2 models, gets DTensors back: each rank's shard. On the
engine's module, `state_dict()` serves full tensors, because that is what a user, Hugging Face
or a plain `torch.save` expects of `module.state_dict()` (offload/runtime/gathered.py). Through
torch's helper, that would put the whole model on every rank (issue #34: "no rank ever holds the
full model for these paths"). So while torch's helper is the caller, the engine's module answers
as an FSDP2 module does: with `engine.sharded_state_dict()`, the Shard(0) DTensors of
offload/checkpoint/sharded_dict.py, and no unit is gathered for the traversal.
`StateDictOptions(full_state_dict=True, cpu_offload=True)` then works as it does for FSDP2:
torch gathers one DTensor at a time and keeps the full tensors on rank 0 only.

How the caller is known: torch's `_get_model_state_dict` calls `model.state_dict()` directly,
so its frame is the caller of the root module's `state_dict`. The root's pre-hook looks a few
frames up for that function's code object. Nothing is imported to check, and a torch that
renamed the function gets the full tensors, as before, not an error. `set_model_state_dict`
with DTensors is refused on every rank with the way to load them
(`sharded_dict.refuse_dtensor_load`).
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Optional

from torch import nn

from offload.checkpoint import sharded_dict
from offload.runtime.gathered import Gathering
from offload.runtime.health import Health
from offload.runtime.view import ShardedState

__all__ = ["TorchStateDictRoute", "called_by_torch_get_model_state_dict"]

_FRAMES_UP = 8
"""How far up the root's state_dict pre-hook looks for torch's helper (hook, Module.state_dict,
the helper: 3 today)."""


def called_by_torch_get_model_state_dict() -> bool:
    """Whether torch's `get_model_state_dict` is on the stack just above (see the note)."""
    helper = getattr(sys.modules.get("torch.distributed.checkpoint.state_dict"), "_get_model_state_dict", None)
    code = getattr(helper, "__code__", None)
    if code is None:
        return False
    frame: Optional[Any] = sys._getframe(1)
    for _ in range(_FRAMES_UP):
        if frame is None:
            return False
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


class TorchStateDictRoute:
    """The root module's hooks for torch's state-dict helpers: state_dict's, which answer
    `get_model_state_dict` with the sharded dict, and a load pre-hook that refuses DTensors
    (`sharded_dict.refuse_dtensor_load`, for `set_model_state_dict`). Registered before the
    gathering's own hooks, so that they run first, and then `attach`ed to the gathering and
    the engine's health once those exist."""

    def __init__(self, model: nn.Module, sharded: ShardedState, hooks: list[Any]) -> None:
        self.sharded = sharded
        self.gathering: Optional[Gathering] = None
        self.health: Optional[Health] = None
        self.active = False
        """A traversal for torch's helper is running (from the root's pre-hook to its post-hook)."""
        hooks.append(model.register_load_state_dict_pre_hook(sharded_dict.refuse_dtensor_load))
        hooks.append(model.register_state_dict_pre_hook(functools.partial(TorchStateDictRoute._pre, self)))
        # a partial, not a bound method: torch marks its post-hooks with an attribute
        hooks.append(model.register_state_dict_post_hook(functools.partial(TorchStateDictRoute._post, self)))

    def attach(self, gathering: Gathering, health: Health) -> None:
        self.gathering, self.health = gathering, health

    def _pre(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if self.gathering is None:
            return
        if self.active:  # an earlier traversal raised before the root's post-hook: undo it
            self.active = False
            self.gathering.gathers_for_state_dict = True
        if keep_vars or not called_by_torch_get_model_state_dict():
            return
        self.active = True
        self.gathering.gathers_for_state_dict = False  # the traversal's detached views are replaced

    def _post(self, module: nn.Module, state_dict: Any, prefix: str, local_metadata: Any) -> None:
        if not self.active:
            return
        self.active = False
        assert self.gathering is not None and self.health is not None
        self.gathering.gathers_for_state_dict = True
        self.health.settle("torch's get_model_state_dict")
        sharded = sharded_dict.model_state_dict(self.sharded)
        for key in [k for k in state_dict if k.startswith(prefix)]:
            del state_dict[key]
        for key, value in sharded.items():
            state_dict[prefix + key] = value
