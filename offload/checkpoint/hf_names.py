"""The checkpoint names of a Hugging Face model: transformers' conversion mapping reversed,
unit by unit, for `engine.save_pretrained`.

transformers 5 renames (and for some architectures merges or splits) weights on load: its
*conversion mapping* turns GPT-NeoX's `embed_out` into `lm_head`, Mixtral's per-expert
`w1/w2/w3` into fused `gate_up_proj / down_proj`, ViT's and Llava's names into new ones. Its
own `save_pretrained` reverses the mapping over the whole state dict
(`transformers.core_model_loading.revert_weight_conversion`), so the files keep the
checkpoint format every reader knows. offload writes unit by unit and never holds the
whole state dict, so the reversal runs once per group of tensors that arrive together (a
unit's parameters; the buffers), after checking, on meta tensors, that group by group it
gives exactly what the whole-state-dict reversal gives: same names, same shapes. A mapping
whose conversion needs tensors of two units (none in transformers' mappings today) cannot
be reversed that way: the model's in-memory names are written then, with a warning.

[Note: reversal memory] A group's values are held until its last tensor arrives: one
unit's parameters in the saved dtype, on rank 0 (the writer), as transformers holds one
shard's.

transformers is imported only for a model that is a `transformers.PreTrainedModel`, which
means it is imported already.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Callable, Hashable, Iterator, Optional

import torch

logger = logging.getLogger("offload")

__all__ = ["NameReversal"]

Revert = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


def _reverter(module: Any) -> Optional[Revert]:
    """transformers' reversal bound to `module`, or None (not a transformers model, or a
    transformers without conversion mappings)."""
    if "transformers" not in sys.modules:
        return None
    import transformers

    if not isinstance(module, transformers.PreTrainedModel):
        return None
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return None
    return lambda sd: dict(revert_weight_conversion(module, dict(sd)))


Signature = list[tuple[str, tuple[int, ...], torch.dtype]]


def _signature(sd: dict[str, torch.Tensor]) -> Signature:
    return [(k, tuple(v.shape), v.dtype) for k, v in sd.items()]


class NameReversal:
    """The reversal for one save: `plan` (the names and shapes to write, group by group)
    and `add` (a tensor in, the finished group's tensors under their checkpoint names out)."""

    def __init__(self, revert: Revert, groups: dict[Hashable, dict[str, torch.Tensor]],
                 plan: dict[Hashable, Signature]) -> None:
        self.revert = revert
        self.plan = plan
        """group -> [(checkpoint name, shape, dtype)] in the order the reversal gives them."""
        self.group_of = {key: g for g, sd in groups.items() for key in sd}
        self.expected = {g: set(sd) for g, sd in groups.items()}
        self.pending: dict[Hashable, dict[str, torch.Tensor]] = {}

    @classmethod
    def of(cls, module: Any, groups: dict[Hashable, dict[str, torch.Tensor]]) -> Optional["NameReversal"]:
        """For `module`'s save of `groups` (group -> {name: meta tensor of the shape and
        dtype written}): None when nothing is renamed (or it cannot be reversed group by
        group: then with a warning)."""
        revert = _reverter(module)
        if revert is None:
            return None
        whole_in = {k: v for sd in groups.values() for k, v in sd.items()}
        whole = revert(whole_in)
        if _signature(whole) == _signature(whole_in):
            return None  # nothing renamed: the names are the checkpoint's already
        plan = {g: _signature(revert(sd)) for g, sd in groups.items()}
        by_group = sorted(str(item) for items in plan.values() for item in items)
        if by_group != sorted(str(item) for item in _signature(whole)):
            logger.warning(
                "save_pretrained: %s's conversion mapping cannot be reversed one unit at a time "
                "(a conversion joins tensors of two units), so its weights are written under the "
                "names the model holds in memory, which transformers 5 loads but other readers may "
                "not", type(module).__name__)
            return None
        return cls(revert, groups, plan)

    def add(self, key: str, value: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """Take `key`'s value (kept: a copy the caller no longer writes); when it completes
        its group, yield the group's tensors under their checkpoint names."""
        g = self.group_of[key]
        pending = self.pending.setdefault(g, {})
        pending[key] = value
        if set(pending) != self.expected[g]:
            return
        del self.pending[g]
        out = self.revert(pending)
        if _signature(out) != self.plan[g]:
            raise RuntimeError(f"save_pretrained: transformers' reversal of {sorted(pending)[:3]}... "
                               f"gave {_signature(out)[:3]}..., not the {self.plan[g][:3]}... planned "
                               "from meta tensors")
        yield from out.items()
