"""Where a unit's optimizer update runs: during backward, or at `engine.step()`.

An update during backward overlaps the CPU optimizer with the rest of backward, but only a
step whose whole gradient nobody needs first, and whose window nobody looks into between
backward and `step()`, can take it without anyone seeing a difference. Two kinds of input
decide it:
- the configuration and the step's state, fixed before the pass starts (`Eligibility`):
  clipping, fp16 loss scaling, the non-finite guard, a non-finite loss already seen this
  window, the accumulation boundary;
- the user's pattern, learned from the boundary micro-batches seen so far (`Pattern`): how
  many backward passes each ran, and whether anything read or changed the gradients or the
  weights between backward and `step()` (`engine.full_grad`, DeepSpeed's
  `safe_get_full_grad` / `safe_get_full_fp32_param` and their setters, `engine.clip_grad_norm_`).

[Note: the update mode is learned]
The first boundary micro-batch that runs a backward updates at `step()` (`Pattern.LEARNING`),
so whatever the user does between its backward and `step()` sees what plain PyTorch would
show: the gradients there, the weights not yet updated. From what it saw the pattern moves
on, and only `Pattern.ONE_PASS` lets a later step update during backward. Several passes
(`SEVERAL_PASSES`) or a look into the window (`OBSERVED`) are absorbing: a loop that did
either once is taken to do it again (a gradient logged every 100 steps is still logged),
and those steps update at `step()`, exactly as plain PyTorch, for the cost of the overlap.
A pattern that changes after a step's updates already ran in backward cannot be undone
for that step (the updates took the gradients they had): the step policy raises there,
saying what to set, and the pattern records the change, so from the next step on the
updates run at `step()`.

Transient gradient shards (a CPU run whose plan holds no gradient memory:
`offload.optim.sharded.transient_grad_shards`) have no learning step: holding a step's
gradients would take 4 bytes per parameter the plan left out, so they update in backward
from the first step, and a look into the window is refused with what to set.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["Pattern", "Site", "Eligibility", "learn", "observed", "site_of_updates", "second_pass_message"]


class Pattern(enum.Enum):
    """What the user's boundary micro-batches have been seen to do."""

    LEARNING = "learning"
    """No boundary micro-batch with a backward pass yet: its updates run at `step()`, so a
    look into the window sees plain PyTorch's state."""
    ONE_PASS = "one_pass"
    """Every boundary micro-batch so far ran one backward pass and nothing looked into the
    window: the next one's updates may run during its backward."""
    SEVERAL_PASSES = "several_passes"
    """A boundary micro-batch ran more than one backward pass (DeepSpeed's multi-backward):
    the passes accumulate, the updates run at `step()`. Absorbing."""
    OBSERVED = "observed"
    """Something read or changed gradients or weights between a backward and `step()`, or
    clipped them itself: the updates run at `step()`. Absorbing."""


class Site(enum.Enum):
    """Where this pass's updates run."""

    IN_BACKWARD = "in_backward"
    AT_STEP = "at_step"


@dataclass(frozen=True)
class Eligibility:
    """What the config and the step's state allow, before the user's pattern is asked."""

    enabled: bool
    """`prefetch.optimizer_in_backward`."""
    whole_gradient_first: bool
    """Something needs the whole gradient before any update: clipping, the fp16 overflow
    check or loss scale, the non-finite guard, a non-finite loss seen this window."""
    at_boundary: bool
    """This pass ends the accumulation window."""
    first_pass: bool
    """It is the window's first pass at the boundary (a later one adds to what it left)."""


def site_of_updates(e: Eligibility, pattern: Pattern, transient: bool) -> Site:
    """The one decision: this pass's updates run during backward only where the config
    allows it and the user's pattern shows nothing that could tell the difference."""
    if not (e.enabled and not e.whole_gradient_first and e.at_boundary and e.first_pass):
        return Site.AT_STEP
    if transient or pattern is Pattern.ONE_PASS:
        return Site.IN_BACKWARD
    return Site.AT_STEP


def learn(pattern: Pattern, passes: int) -> Pattern:
    """The pattern after a boundary micro-batch that ran `passes` backward passes (0: none
    ran, nothing learned)."""
    if pattern in (Pattern.SEVERAL_PASSES, Pattern.OBSERVED) or passes == 0:
        return pattern
    return Pattern.SEVERAL_PASSES if passes > 1 else Pattern.ONE_PASS


def observed(pattern: Pattern) -> Pattern:
    """The pattern after a look into the window (a read, a write, a clip)."""
    return Pattern.OBSERVED


def second_pass_message(transient: bool, step_index: int) -> str:
    """The error for a backward pass begun after this step's updates ran during an earlier one."""
    if transient:
        why = ("this run updates during the first backward of every step: it keeps each "
               "gradient shard only from its reduce to its update (a CPU run, "
               "gradient_accumulation_steps 1, no clipping: transient gradient shards), so "
               "it cannot hold a step's gradients for a later backward")
    else:
        why = ("every step so far ran one backward, so this step's updates ran during its "
               "first; from the next step on, the engine accumulates several backward "
               "passes and updates at engine.step()")
    return (
        f"a second engine.backward() before engine.step() at optimizer step "
        f"{step_index}, after the first one already ran this step's optimizer updates "
        f"during backward (prefetch.optimizer_in_backward): {why}. The weights hold the "
        "first backward's update; this backward was refused and added no gradient. Call "
        "engine.set_gradient_accumulation_boundary(False) before every engine.backward() of "
        "a step but the last, and set_gradient_accumulation_boundary(True) (or None) before "
        "the last (DeepSpeed's way: they accumulate, the last one updates), or set "
        "prefetch.optimizer_in_backward=false; call engine.step() to finish this step"
    )
