"""The mean per optimizer step of monotone counters (bytes written, bytes sent), since the
previous reading: what the step report's measured figures are (offload/runtime/swap_traffic.py,
offload/runtime/collective_traffic.py)."""

from __future__ import annotations

from typing import Callable

__all__ = ["StepDeltas"]


class StepDeltas:
    """`per_step(n)`: how much each counter `read()` returns grew per optimizer step since the
    previous call (the first: since construction), `n` being the steps taken so far."""

    def __init__(self, read: Callable[[], tuple[int, ...]]) -> None:
        self._read = read
        self._at = (0, *read())

    def per_step(self, n: int) -> tuple[float, ...]:
        now = self._read()
        steps = max(1, n - self._at[0])
        out = tuple((c - before) / steps for c, before in zip(now, self._at[1:]))
        self._at = (n, *now)
        return out
