"""A small discrete-event schedule: tasks on resources, in issue order.

Each task runs on one resource for a fixed time, after the tasks it depends on have ended.
A resource runs its tasks one at a time in the order they were issued (a CUDA stream, the
AIO queue as the engine fills it, the optimizer's threads): a task starts when its resource
is free *and* its dependencies are done, and a later-issued task never overtakes an earlier
one on the same resource. That is how the engine's streams and queues behave, and it makes
the schedule a single pass over the list.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Task", "Schedule", "EventSchedule"]


@dataclass(frozen=True)
class Task:
    name: str
    resource: str
    seconds: float
    after: tuple[int, ...] = ()
    """Indices of earlier tasks that must end first."""


@dataclass
class Schedule:
    starts: list[float] = field(default_factory=list)
    ends: list[float] = field(default_factory=list)
    busy_s: dict[str, float] = field(default_factory=dict)
    """Per resource, the time it ran tasks."""

    @property
    def makespan_s(self) -> float:
        return max(self.ends, default=0.0)

    def binding(self) -> str:
        """The resource busy the longest: what bounds the step when it is busy most of it."""
        return max(self.busy_s, key=lambda r: self.busy_s[r]) if self.busy_s else "nothing"


class EventSchedule:
    """Tasks added in issue order (`add` returns the task's index for later `after=`);
    `run()` places them."""

    def __init__(self) -> None:
        self.tasks: list[Task] = []

    def add(self, name: str, resource: str, seconds: float, after: tuple[int, ...] = ()) -> int:
        if seconds < 0:
            raise ValueError(f"task {name!r}: negative duration {seconds}")
        bad = [a for a in after if not 0 <= a < len(self.tasks)]
        if bad:
            raise ValueError(f"task {name!r} depends on tasks not yet issued: {bad}")
        self.tasks.append(Task(name, resource, seconds, tuple(after)))
        return len(self.tasks) - 1

    def run(self) -> Schedule:
        s = Schedule()
        free: dict[str, float] = {}
        for t in self.tasks:
            start = max([free.get(t.resource, 0.0)] + [s.ends[a] for a in t.after])
            s.starts.append(start)
            s.ends.append(start + t.seconds)
            free[t.resource] = start + t.seconds
            s.busy_s[t.resource] = s.busy_s.get(t.resource, 0.0) + t.seconds
        return s
