"""Which ZeRO stage to run: the planner's placements at stages 3, 2 and 1, and the stage
it recommends with its reason.

    python -m offload.plan --params 7e9 --gpus 8 --gpu-mem 80GiB --cpu-mem 1TiB --stages
    compare_stages(7e9, machine=Machine(...))

Each stage is planned as `offload.plan.planner.plan` plans the config's own (the engine's
accounting: `rank_bytes(stage=...)`), with the placements the engine runs at that stage
(stages 1 and 2 keep parameters whole on the compute device, so a parameter tier on NVMe is
not one of them). The recommendation:

- On GPUs with more than one rank, stage 2 (ZeRO-Offload's layout: parameters whole and
  resident on the GPU, gradients reduce-scattered, optimizer state partitioned and tiered)
  when its fastest placement fits and moves no more bytes through the disk than stage 3's:
  it skips the all-gather of every unit in forward and again in backward (2 x the parameter
  bytes per step over the interconnect, and their latency) for Psi x dtype bytes of GPU
  memory per rank. Stage 1 is never preferred to stage 2: the same step, with full-size
  gradients all-reduced (twice a reduce-scatter's traffic) and held.
- Otherwise stage 3: on the CPU, or with one rank, the stages run the same step (every unit
  is aliased to its shard, nothing is gathered), and stage 3 holds the least; and when
  stage 2's whole parameters do not fit, stage 3 is what does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal, Optional

from offload.config import load_config
from offload.plan.machine import Machine, format_size
from offload.plan.planner import PLACEMENTS, Plan, plan
from offload.plan.table import choice_text
from offload.storage.tier_kind import TierKind

__all__ = ["StageChoice", "compare_stages", "STAGES"]

STAGES: tuple[Literal[1, 2, 3], ...] = (3, 2, 1)
"""The stages compared, in the order they are shown."""


@dataclass(frozen=True)
class StageChoice:
    plans: dict[int, Plan]
    """Per stage, the planner's plan at that stage."""
    recommended: Optional[int]
    reason: str

    @property
    def plan(self) -> Optional[Plan]:
        return None if self.recommended is None else self.plans[self.recommended]

    def config_snippet(self) -> dict[str, Any]:
        if self.plan is None:
            return {}
        return {"zero_stage": self.recommended, **self.plan.config_snippet()}

    def to_dict(self) -> dict[str, Any]:
        return {"stages": {str(s): p.to_dict() for s, p in self.plans.items()},
                "recommended_stage": self.recommended, "reason": self.reason,
                "config": self.config_snippet()}

    def __str__(self) -> str:
        any_plan = next(iter(self.plans.values()))
        m = any_plan.machine
        gpu = "GPU" if m.gpus_per_node else "device"
        head = ["stage", "fastest placement that fits", f"{gpu}/rank", "host/node", "nvme/node",
                "disk/step"]
        rows = []
        for stage, p in self.plans.items():
            e = p.recommended
            if e is None:
                rows.append([str(stage), "none fits", "", "", "", ""])
                continue
            host = e.per_node.host_total + (0 if m.gpus_per_node else e.per_node.device)
            rows.append([str(stage), f"params {e.param_tier}, optimizer {e.optimizer_tier}",
                         format_size(_device(e)), format_size(host),
                         format_size(e.per_node.nvme), format_size(e.disk_bytes_per_step)])
        return choice_text(f"ZeRO stages for {any_plan.params:,} parameters on {m.describe()}", head, rows,
                           None if self.recommended is None else f"stage {self.recommended}", "stage",
                           self.reason, self.config_snippet())


def compare_stages(model_or_params: Any, *, machine: Optional[Machine] = None, config: Any = None,
                   **kw: Any) -> StageChoice:
    """`plan` at every stage of `STAGES` (keyword arguments as `plan`'s), and the stage to run
    (see the module docstring)."""
    cfg = load_config(config)
    plans: dict[int, Plan] = {}
    for stage in STAGES:
        placements = PLACEMENTS if stage == 3 else tuple(p for p in PLACEMENTS if not TierKind.of(p[0]).spec.on_disk)
        plans[stage] = plan(model_or_params, machine=machine, config=replace(cfg, zero_stage=stage),
                            placements=placements, **kw)
    m = plans[3].machine
    fits = {s: p.recommended for s, p in plans.items() if p.recommended is not None}
    if not fits:
        return StageChoice(plans, None, plans[3].reason)
    if not m.gpus_per_node or m.world_size == 1:
        where = "compute is on the CPU" if not m.gpus_per_node else "one rank"
        if 3 in fits:
            return StageChoice(plans, 3, f"{where}: every stage runs the same step (each unit is "
                               "its own shard, nothing is gathered) and stage 3 holds the least")
    three = fits.get(3)
    for stage in (2, 1):
        e = fits.get(stage)
        if e is None or (three is not None and e.disk_bytes_per_step > three.disk_bytes_per_step):
            continue
        why = (f"parameters stay whole on the {'GPU' if m.gpus_per_node else 'device'} "
               f"({format_size(_device(e))} per rank with params {e.param_tier}, optimizer "
               f"{e.optimizer_tier}): no all-gather of each unit in forward and again in backward")
        if stage == 1:
            why += "; stage 2 does not fit (stage 1 all-reduces and holds full gradients)"
        elif three is not None:
            why += (f"; stage 3 would need {format_size(_device(three))} per rank, and moves "
                    "the same disk bytes")
        return StageChoice(plans, stage, why)
    # Stage 2 or 1 fitting returned above unless stage 3 fits too (and moves fewer disk bytes).
    assert three is not None, fits
    reason = "stage 3 is the only stage that fits"
    if 2 in fits:
        reason = (f"stage 2 fits only with more disk traffic ({format_size(fits[2].disk_bytes_per_step)} "
                  f"per step vs {format_size(three.disk_bytes_per_step)}): the disk is the slower link")
    return StageChoice(plans, 3, reason + f"; {plans[3].reason}")


def _device(e: Any) -> int:
    """Compute-device bytes per rank: between steps, plus the working set of forward/backward."""
    return e.per_rank.device + e.working_device_bytes
