"""The memory planner: where a model's training state should live on a machine
(docs/plan.md). `python -m offload.plan --help` for the command line."""

from offload.plan.planner import (
    Machine,
    Plan,
    machine_from_system,
    make_machine,
    parse_bytes,
    parse_count,
    plan,
    resolve_placement,
)

__all__ = ["Machine", "Plan", "plan", "make_machine", "machine_from_system", "resolve_placement",
           "parse_bytes", "parse_count"]
