"""The campaign's ETA, a stated estimator (docs/cli.md): no Ray, no clock of its own (times come with the records).

Speed, per job: its seconds per update are an exponentially weighted mean over the chunks it completed. Each
heartbeat after the first of an attempt gives one sample, (t - t_prev) / (step - step_prev), weighted by the time
it spans, w = 1 - exp(-span / TAU_S), starting from the mean of the other jobs' (the first job's: its first
sample). The first heartbeat of an attempt gives none: its span holds the actor's start-up, data loading and
queueing, which are no measure of training speed; and a new job's next chunks, slowed by what is left of its
warm-up (17.6 s for a 5 s chunk in the trace tests/test_eta.py replays), only move the mean it starts from.

Time left: every job keeps its speed (a job with no sample yet: the mean of the others'), the running ones go on,
and each job still waiting takes the first slot that frees (at most `slots` at once, the GPUs' actors); the ETA
is when the last one ends. So the tail (fewer jobs left than slots, one far behind) and the hand-over between a
job that ends and the next that starts are counted as they will run.

What it replaced, a trailing-window rate (every job's updates over the last 60 s, the driver's start-up and the
queue's hand-overs included), swung: 20:44, 8:06, 5:28, 4:59, 5:04 in five minutes of a BPTT run.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

TAU_S = 120.0  # the weighted mean's time constant: a change in speed shows in the ETA within a few minutes


@dataclass
class Eta:
    tau_s: float = TAU_S
    spu: dict[str, float] = field(default_factory=dict)  # job -> seconds per update (weighted mean)
    _last: dict[str, tuple[int, float, int]] = field(default_factory=dict)  # job -> (attempt, t, step) last seen

    def beat(self, job: str, attempt: int, t: float, step: int) -> None:
        """A heartbeat of `job`'s attempt at wall time `t` (s) that reached `step`."""
        prev = self._last.get(job)
        self._last[job] = (attempt, t, step)
        if prev is None or prev[0] != attempt or step <= prev[2] or t <= prev[1]:
            return  # an attempt's first chunk (start-up inside), a restart from a checkpoint, or a clock step back
        span = t - prev[1]
        sample = span / (step - prev[2])
        old = self.spu.get(job, self._mean())  # a job new to the estimate starts from the others' speed
        self.spu[job] = sample if old is None else old + (1.0 - math.exp(-span / self.tau_s)) * (sample - old)

    def _mean(self) -> float | None:
        return sum(self.spu.values()) / len(self.spu) if self.spu else None

    def seconds_left(self, left: Mapping[str, int], running: set[str], slots: int) -> float | None:
        """Seconds until the last of the jobs in `left` (job -> updates to go, in the order they will start) ends,
        the `running` ones first, at most max(slots, running) at once; 0 with nothing left, None before any job
        has a speed."""
        todo = {j: n for j, n in left.items() if n > 0}
        if not todo:
            return 0.0
        if not self.spu:
            return None
        mean = self._mean()
        on = [j for j in todo if j in running]
        free = [n * self.spu.get(j, mean) for j, n in todo.items() if j in running]  # when each slot frees, s
        free += [0.0] * max(0, max(1, slots) - len(on))
        heapq.heapify(free)
        for j, n in todo.items():
            if j not in running:
                heapq.heappush(free, heapq.heappop(free) + n * self.spu.get(j, mean))
        return max(free)
