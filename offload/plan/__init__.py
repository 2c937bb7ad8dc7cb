"""The memory planner: where a model's training state should live on a machine
(docs/plan.md). `python -m offload.plan --help` for the command line.

machine.py: the machine and its reserves; tier_bytes.py: bytes per tier for one placement, by
the engine's rules; planner.py: every placement, the plan, `placement='auto'`; stages.py:
the plan at ZeRO stages 3, 2 and 1 and the stage to run; sharding.py: full sharding, hpZ and
HSDP on several nodes and the mode to run; cli.py: the command line."""

from offload.plan.machine import Machine, machine_from_system, make_machine
from offload.plan.planner import Plan, plan, resolve_placement
from offload.plan.sharding import ShardingChoice, compare_sharding
from offload.plan.stages import StageChoice, compare_stages
from offload.sizes import parse_bytes, parse_count  # re-exported: older callers import them here

__all__ = ["Machine", "Plan", "ShardingChoice", "StageChoice", "compare_sharding", "compare_stages", "plan", "make_machine", "machine_from_system", "resolve_placement",
           "parse_bytes", "parse_count"]
