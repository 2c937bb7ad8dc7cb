"""Gradients as a user reads them, and the model changes the layout cannot follow.

A parameter's gradient never stays in `.grad`: each unit's gradients are reduce-scattered
into the rank's fp32 gradient shard (runtime/backward.py) and summed there over the
micro-batches of a step, scaled by the fp16 loss scale and not yet divided by the
accumulation steps. `Gradients` reads them back for a user (`engine.full_grad`), and checks
at each training forward that no parameter was unfrozen after `initialize`.

[Note: requires_grad after initialize]
The layout is fixed at `initialize`: a parameter with `requires_grad=False` then is laid
out with no optimizer group and no moments, and a unit with no trainable parameter has no
gradient shard. Unfreezing it later (`requires_grad_(True)`) would make autograd compute a
gradient that nothing can train, so it is refused at the next training forward, by name.
Freezing after `initialize` needs no refusal: a parameter without a gradient is skipped by
the step (no decay, no moment update, its step count holds), which is what a plain
`torch.optim.AdamW` does with a `.grad` of None, so training follows it exactly.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
from torch import nn

from offload.runtime.optimizer_step import StepPolicy
from offload.units.collectives import ProcessGroupInfo, all_reduce_host
from offload.units.hybrid import average_shard_across_replicas
from offload.units.shard import FROZEN_GROUP, FlatUnit

__all__ = ["Gradients"]


class Gradients:
    """The user's view of one engine's gradient shards (read-only)."""

    def __init__(self, module: nn.Module, units: list[FlatUnit], states: list[Any],
                 policy: StepPolicy, pg: ProcessGroupInfo, device: torch.device) -> None:
        self.module = module
        self.units = units
        self.states = states
        self.policy = policy
        self.pg = pg
        self.device = device
        self._slot_of = {id(p): (u.index, si) for u in units for si, p in enumerate(u.params)}
        """id(parameter view) -> (unit index, slot index)."""
        self._frozen_at_initialize = [
            (u.layout.slots[si].name, p) for u in units for si, p in enumerate(u.params)
            if not p.requires_grad
        ]
        """[Note: requires_grad after initialize]: the parameters to watch."""

    def owns(self, param: Any) -> bool:
        return id(param) in self._slot_of

    # -- clipping and discarding ------------------------------------------------------------

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """`engine.clip_grad_norm_`: clip this step's gradients to global norm `max_norm`
        as `torch.nn.utils.clip_grad_norm_` would on a plain model (coef = max_norm / (norm
        + 1e-6), at most 1), in place of config.gradient_clipping for this step. Call it
        between the backward of an accumulation window's last micro-batch and
        `engine.step()`, on every rank (the norm is one all-reduce; a second call in the
        same step reuses it, and the step reuses it too). Returns the total norm, un-scaled,
        as an fp32 tensor (torch returns one).

        With prefetch.optimizer_in_backward (the default) a step without
        config.gradient_clipping runs its updates during backward, before this can be
        called: it then raises, saying so. Set gradient_clipping=<max_norm> in the config
        to clip every step (those steps update at `engine.step()`), or
        prefetch.optimizer_in_backward=false to clip yourself.

        `torch.nn.utils.clip_grad_norm_(model.parameters(), ...)` cannot work on an engine
        (its gradients are in the shards, not in `.grad`): it raises and points here
        ([Note: clipping refused] in offload/units/parameter.py)."""
        if float(norm_type) != 2.0:
            raise NotImplementedError(
                f"engine.clip_grad_norm_(norm_type={norm_type}): only the 2-norm is supported"
            )
        max_norm = float(max_norm)
        if not max_norm > 0.0:
            raise ValueError(f"engine.clip_grad_norm_(max_norm={max_norm}): max_norm must be > 0")
        return torch.tensor(self.policy.clip_this_step(max_norm), dtype=torch.float32)

    def zero_grad(self) -> None:
        """`engine.zero_grad`: discard the gradients accumulated since the last optimizer
        step, as `optimizer.zero_grad()` does on a plain model: the next micro-batch starts
        the sums again, and the accumulation window keeps counting (its step still divides
        by gradient_accumulation_steps, as a plain loop that divides each loss does). The
        engine clears gradients itself at every step, so loops need not call it;
        `engine.optimizer.zero_grad()` never discards (see `ShardedAdam.zero_grad`)."""
        if self.policy.updated:
            raise RuntimeError(
                "engine.zero_grad(): this step's optimizer updates already ran during backward "
                "(prefetch.optimizer_in_backward, the default), so its gradients cannot be "
                "discarded any more; call engine.step() to finish the step, or set "
                "prefetch.optimizer_in_backward=false to decide after backward"
            )
        self.policy.discard_gradients()

    # -- requires_grad flips ----------------------------------------------------------------

    def check_requires_grad(self) -> None:
        """At a root forward: raise when a parameter frozen at `initialize` now requires
        grad ([Note: requires_grad after initialize]); one attribute read per frozen
        parameter. Not under no_grad (evaluation, generation): no gradient follows."""
        if not torch.is_grad_enabled():
            return
        for name, p in self._frozen_at_initialize:
            if p.requires_grad:
                raise RuntimeError(
                    f"parameter {name!r} had requires_grad=False at offload.initialize and now "
                    "requires grad: the engine laid it out without optimizer state, so it "
                    "cannot be trained. Set requires_grad before offload.initialize (to train "
                    "it only later, keep it trainable and put it in a param group with lr 0 "
                    "until then), or set it back with requires_grad_(False)"
                )

    # -- a full gradient --------------------------------------------------------------------

    def locate(self, param: Union[str, nn.Parameter]) -> tuple[str, int, int]:
        if isinstance(param, str):
            by_name = dict(self.module.named_parameters(remove_duplicate=False))
            if param not in by_name:
                close = [n for n in by_name if param.split(".")[-1] in n][:5]
                raise KeyError(
                    f"the model has no parameter named {param!r}"
                    + (f"; parameters with a similar name: {close}" if close else "")
                )
            name, p = param, by_name[param]
        else:
            name, p = "", param
        where = self._slot_of.get(id(p))
        if where is None:
            raise ValueError(
                f"engine.full_grad: the tensor of shape {tuple(getattr(p, 'shape', ()))} is not a "
                "parameter of this engine's model (pass one of engine.parameters(), or its name)"
            )
        ui, si = where
        return name or self.units[ui].layout.slots[si].name, ui, si

    @torch.no_grad()
    def full_grad(self, param: Union[str, nn.Parameter]) -> Optional[torch.Tensor]:
        """The parameter's full gradient, fp32, un-scaled (loss scale and accumulation), as
        `.grad` would hold it on a plain model trained with the loss divided by the
        accumulation steps; None when no rank computed one since the last step (as
        torch's `.grad` after `zero_grad()`). A collective: every rank calls it, with the
        same parameter, and gets the result on the compute device. The ranks' parts are
        summed into one tensor of the parameter's size (one all-reduce): bounded by the
        parameter, not its unit."""
        name, ui, si = self.locate(param)
        self.policy.observe()  # [Note: the update mode is learned] in offload/runtime/update_mode.py
        st = self.states[ui]
        slot = self.units[ui].layout.slots[si]
        # Decided alike on every rank (the all-reduce below needs them all): a parameter no
        # optimizer group updates keeps no gradient ([Note: frozen parameters cost their
        # shard only] in offload/units/layout.py), and a shard may be empty on one rank.
        if slot.group == FROZEN_GROUP or not st.grad_shard.has_gradient:
            return None  # not kept, or nothing reduced since the step
        if st.grad_shard.consumed:
            raise RuntimeError(
                f"engine.full_grad({name!r}): its gradient shard was consumed by the unit's "
                "optimizer update during backward (prefetch.optimizer_in_backward, the default, "
                "releases each shard after its update on a CPU run whose updates all run in "
                "backward: nonfinite_loss 'off', one micro-batch a step, no clipping). For runs "
                "whose gradients you inspect, keep nonfinite_loss='skip' (the default: the "
                "shards are held and the updates run at engine.step()) or set "
                "prefetch.optimizer_in_backward=false"
            )
        flat = torch.zeros(slot.numel + 1, dtype=torch.float32)
        part = self.units[ui].layout.slot_in_shard(slot, self.pg.rank)
        if part is not None:
            p_off, s_off, n = part
            flat[p_off : p_off + n].copy_(st.grad[s_off : s_off + n])
        flat[-1] = float(st.grad_shard.slot_has[si])  # a local gradient existed (summed: any rank)
        flat = all_reduce_host(flat, "sum", self.pg, self.device)
        if st.grad_shard.unaveraged:  # HSDP inside a window: the mean across replicas, shard untouched
            average_shard_across_replicas(flat, self.units[ui].pg, self.device)
        if flat[-1].item() == 0:
            return None
        policy = self.policy
        unscale = 1.0 / (policy.scaler.scale * policy.gradient_accumulation_steps)
        return (flat[:-1] * unscale).view(slot.shape).to(self.device)
