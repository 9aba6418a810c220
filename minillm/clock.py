"""Where the engine's "now" comes from: the wall clock, or a simulated one (chapters 03–04).

Requests in a trace arrive at given times. The real engine waits for them on the wall clock; the
simulator (`minillm.sim`) jumps its clock forward instead, so the same scheduler code serves both.
"""

from __future__ import annotations

import time


class WallClock:
    def now(self) -> float:
        return time.perf_counter()

    def wait_until(self, t: float) -> None:
        delay = t - time.perf_counter()
        if delay > 0:
            time.sleep(delay)

    def advance(self, seconds: float) -> None:
        """Real time advances by itself while the model runs."""


class SimClock:
    def __init__(self, start: float = 0.0) -> None:
        self.t = start

    def now(self) -> float:
        return self.t

    def wait_until(self, t: float) -> None:
        self.t = max(self.t, t)

    def advance(self, seconds: float) -> None:
        self.t += seconds
