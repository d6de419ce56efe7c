"""The capacity search: the highest arrival rate a server sustains within a latency target.

Each step measures one rate (a full open-loop run, minutes on a GPU), so the number of steps is bounded: double
from the start rate until a rate fails (or halve until one passes), then bisect between the best passing and the
lowest failing rate until the steps run out or the two are within `tolerance` of each other.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Capacity:
    best: float | None  # the highest passing rate measured; None if none passed
    failed_at: float | None  # the lowest failing rate measured above it; None if none failed
    steps: list[tuple[float, bool]] = field(default_factory=list)  # (rate, passed) in the order measured


def search(passes: Callable[[float], bool], start: float, max_steps: int = 8, tolerance: float = 0.05) -> Capacity:
    """Search with `passes(rate)` (one measurement per call) in at most `max_steps` calls."""
    if start <= 0 or max_steps < 1:
        raise ValueError(f"need a positive start rate and at least one step, got {start}, {max_steps}")
    result = Capacity(None, None)

    def measure(rate: float) -> bool:
        ok = passes(rate)
        result.steps.append((rate, ok))
        if ok:
            result.best = rate if result.best is None else max(result.best, rate)
        else:
            result.failed_at = rate if result.failed_at is None else min(result.failed_at, rate)
        return ok

    rate = start
    going_up = measure(rate)
    while len(result.steps) < max_steps and (result.best is None or result.failed_at is None):
        rate = rate * 2 if going_up else rate / 2
        measure(rate)
    while (len(result.steps) < max_steps and result.best is not None and result.failed_at is not None
           and result.failed_at > result.best * (1 + tolerance)):
        measure((result.best + result.failed_at) / 2)
    return result
