"""When a lost job is tried again: exponential backoff with jitter for the expert's own failures (counted against
retry.max_retries), and for the infrastructure's (uncounted) until retry.infra_wait_s says the campaign must
stop for its environment. Pure bookkeeping on the scheduler's clock; no Ray, no events (the scheduler writes them).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable

from soma_cluster.config import RetryConfig
from soma_cluster.failures import stop_line
from soma_cluster.jobs import Cause, Job


@dataclass(frozen=True)
class InfraStop:
    """The campaign stopped because a job's infrastructure failures outlasted retry.infra_wait_s."""

    cause: Cause
    reason: str  # what failed (the error, without the cause's name)
    job: str
    waited_s: float

    def line(self, bound_s: float, url: str) -> str:
        return stop_line(self.cause, self.reason, f"{self.job}'s retries", self.waited_s, bound_s, url)


def backoff_s(base: float, cap: float, failures: int, rng: random.Random) -> float:
    """The wait before the retry after `failures` failures: exponential, capped, with equal jitter (half
    fixed, half random), so experts that failed together (a lost node) do not come back in lockstep."""
    delay = min(cap, base * 2 ** max(0, failures - 1))
    return delay * (0.5 + 0.5 * rng.random())


@dataclass
class Retries:
    cfg: RetryConfig
    clock: Callable[[], float]
    rng: random.Random
    at: dict[Job, float] = field(default_factory=dict)  # a job waiting out its backoff -> when it is due
    failures: dict[Job, int] = field(default_factory=dict)  # counted against retry.max_retries
    infra_since: dict[Job, float] = field(default_factory=dict)  # its first infra failure since its last checkpoint
    infra_tries: dict[Job, int] = field(default_factory=dict)  # and how many followed it (the backoff's exponent)
    stopped: InfraStop | None = None  # set once: the campaign stops for its environment

    def due(self, pack: Callable[[Job], int]) -> list[Job]:
        """The jobs whose backoff is over, in job order, as many as one actor takes (`pack` of the first)."""
        now = self.clock()
        due = sorted(j for j, at in self.at.items() if at <= now)
        group = due[: pack(due[0])] if due else []
        for job in group:
            del self.at[job]
        return group

    def count(self, job: Job) -> bool:
        """The job's own failure: counted; whether it still has a retry left."""
        self.failures[job] = self.failures.get(job, 0) + 1
        return self.failures[job] <= self.cfg.max_retries

    def back_off(self, job: Job) -> float:
        """Schedule the job's retry after its counted failures; the wait, seconds."""
        delay = backoff_s(self.cfg.backoff_s, self.cfg.backoff_max_s, self.failures[job], self.rng)
        self.at[job] = self.clock() + delay
        return delay

    def wait_out(self, job: Job, cause: Cause, detail: str) -> tuple[float, float] | None:
        """An infrastructure failure: retry the job after a backoff, spending none of its retries, until the condition
        has lasted retry.infra_wait_s since the job's first such failure after its last checkpoint; a failure past that
        stops the campaign (None). The last backoff is cut to the bound, so the stop comes within the bound plus one
        try. Returns (the wait, how long the condition has lasted), seconds."""
        now, r = self.clock(), self.cfg
        since = self.infra_since.setdefault(job, now)
        if now - since >= r.infra_wait_s:
            if self.stopped is None:
                self.stopped = InfraStop(cause, detail, job.name, now - since)
            return None
        self.infra_tries[job] = self.infra_tries.get(job, 0) + 1
        delay = min(
            backoff_s(r.backoff_s, r.backoff_max_s, self.infra_tries[job], self.rng), since + r.infra_wait_s - now
        )
        self.at[job] = now + delay
        return delay, now - since

    def recovered(self, job: Job) -> None:
        """The job wrote a checkpoint: whatever infrastructure failed it before is working again."""
        self.infra_since.pop(job, None)
        self.infra_tries.pop(job, None)
