"""What every rank must agree on before an update reads a gradient shard.

Two things, each settled by one small all-reduce of flags on the host:
- which parameters got a gradient (a parameter skipped on one rank but not on another is
  updated everywhere, with the average);
- that every rank reduced the same units, as often. A forward that runs different
  submodules on different ranks (routing by rank or by data, a mixture of experts without
  its block made one unit) issues a reduce-scatter for a unit on one rank while another
  rank issues one for a different unit: the collective library pairs them, shapes
  permitting, and each rank's shard then holds a sum of unrelated gradients. Nothing else
  would notice; the check turns it into an error before any update runs (per unit with the
  update in backward, for the whole step at `engine.step()`), naming the fix.

A count and its negation go through one max: the largest is max(v), the smallest -max(-v).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from offload.optim.sharded import UnitOptimizerState
from offload.units.shard import FlatUnit

__all__ = ["agree_on_unit", "agree_on_step", "RoutedApartError"]

AllReduce = Callable[[torch.Tensor, str], torch.Tensor]
"""`all_reduce_host(tensor, op, pg, device)` bound to the step's group: returns the result."""


class RoutedApartError(RuntimeError):
    """The ranks' backward passes reduced different units: this step's gradients were summed
    across unrelated units and are not to be trusted."""

    def __init__(self, what: str) -> None:
        super().__init__(
            f"{what}: the ranks ran different submodules (a forward that routes by rank or by "
            "data, such as a mixture of experts), so their gradient reduce-scatters were paired "
            "across different units. Make the module that routes one unit, gathered whole on "
            "every rank: list its class in leaf_modules (DeepSpeed: zero_optimization.leaf_module "
            "or deepspeed.utils.set_z3_leaf_modules; the model's own class makes the whole model "
            "one unit), then load a checkpoint: this step's gradients are not to be trusted")


def _name(unit: FlatUnit) -> str:
    return unit.name or "<root>"


def agree_on_unit(st: UnitOptimizerState, rank: int, all_reduce: AllReduce) -> None:
    """Before one unit's update in backward: its parameters that got a gradient on any rank,
    and that every rank is at this unit (raises `RoutedApartError` where not)."""
    take_unit_agreement(st, rank, all_reduce(unit_flags(st), "max"))


def unit_flags(st: UnitOptimizerState) -> torch.Tensor:
    """This rank's side of `agree_on_unit`: the unit's slots that got a gradient here, and
    the unit's index (twice, so one max shows whether every rank named the same unit)."""
    idx = float(st.unit.index)
    return torch.tensor([*(float(h) for h in st.grad_shard.slot_has), idx, -idx], dtype=torch.float32)


def take_unit_agreement(st: UnitOptimizerState, rank: int, flags: torch.Tensor) -> None:
    """`agree_on_unit` once the max of every rank's `unit_flags` is in (`flags`)."""
    if int(flags[-2]) != -int(flags[-1]):
        raise RoutedApartError(f"in this backward, rank {rank} reduced unit {_name(st.unit)} while "
                               "another rank reduced a different one")
    st.grad_shard.agreed([bool(v) for v in flags[:-2].tolist()])


def agree_on_step(states: Sequence[UnitOptimizerState], rank: int, all_reduce: AllReduce) -> None:
    """Before the updates at `engine.step()`: every unit's parameters that got a gradient on
    any rank, and that every rank reduced every unit as often this step."""
    reduces = [float(st.grad_shard.reduces) for st in states]
    flags = torch.tensor(
        [*(float(h) for st in states for h in st.grad_shard.slot_has), *reduces, *(-r for r in reduces)],
        dtype=torch.float32,
    )
    flags = all_reduce(flags, "max")
    n = len(reduces)
    most, least = flags[len(flags) - 2 * n : len(flags) - n].tolist(), (-flags[len(flags) - n :]).tolist()
    apart = [st for st, hi, lo in zip(states, most, least) if hi != lo]
    if apart:
        mine = ", ".join(f"{_name(st.unit)} {st.grad_shard.reduces}" for st in apart)
        raise RoutedApartError(
            f"this step's backward reduced unit(s) {', '.join(_name(st.unit) for st in apart)} a "
            f"different number of times on different ranks (rank {rank}: {mine})")
    i = 0
    for st in states:
        k = len(st.grad_shard.slot_has)
        st.grad_shard.agreed([bool(v) for v in flags[i : i + k].tolist()])
        i += k
