"""The driver's loop without Ray: real ExpertWorker objects in this process carry out a real Scheduler's
actions, one call at a time, on a fake clock. Tests use it to kill attempts at exact moments (after a
call ran but before its report arrived, or before it ran) and to lose the driver, with no timing luck."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from soma_cluster.checkpoint import latest_meta
from soma_cluster.events import history
from soma_cluster.jobs import Job
from soma_cluster.messages import SetupReport
from soma_cluster.schedule import Chunk, Lost, Reuse, Scheduler, Start, Stop
from workers.expert_worker import ExpertWorker

KILLED = Lost("actor_died", "killed by the test")


@dataclass
class Clock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Attempt:
    """What one attempt of one job really did, seen from outside the scheduler."""

    start_forwards: int | None = None  # the model's forward count when it loaded (None: it never loaded)
    reported: int = 0  # forwards its last delivered report said it had done


@dataclass
class InProcess:
    store: object
    cfg: object
    jobs: list[Job]
    clock: Clock = field(default_factory=Clock)
    attempts: dict[tuple[Job, int], Attempt] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.driver_lost()

    def driver_lost(self) -> None:
        """A new driver: a new scheduler restored from the campaign directory; every actor died with the old one."""
        self.sched = Scheduler(
            self.store, self.cfg, self.jobs, clock=self.clock, latest=lambda job: latest_meta(self.store, job.model_dir)
        )
        self.sched.restore(history(self.store))
        self.workers: dict[int, ExpertWorker] = {}
        self.calls: dict[int, tuple] = {}  # unit id -> the call it is to run next

    def apply(self, actions) -> None:
        for a in actions:
            uid, unit = a.unit.id, a.unit
            if isinstance(a, Start):
                experts, attempts = [j.expert for j in unit.jobs], [c.attempt for c in unit.accounts.values()]
                self.workers[uid] = ExpertWorker(
                    campaign_url=self.store.url,
                    storage_options={},
                    experts=experts,
                    attempts=attempts,
                    num_gpus=self.cfg.resources.num_gpus,
                    requested_at=time.time(),
                )
                self.calls[uid] = ("setup",)
            elif isinstance(a, Reuse):
                self.workers[uid] = self.workers.pop(a.actor_of)
                self.calls[uid] = ("setup", [j.expert for j in unit.jobs], [c.attempt for c in unit.accounts.values()])
            elif isinstance(a, Chunk):
                self.calls[uid] = ("chunk", a.updates, a.caps)
            elif isinstance(a, Stop):
                self.workers.pop(uid, None)
                self.calls.pop(uid, None)

    def next_call(self) -> int | None:
        """Start what the scheduler wants started; the unit whose call runs next (lowest id), or None when idle."""
        self.apply(self.sched.requests(float("inf"), 10**6))
        if not self.calls and self.sched.retries.at:
            self.clock.now = max(self.clock.now, min(self.sched.retries.at.values()))  # sleep until the next retry
            self.apply(self.sched.requests(float("inf"), 10**6))
        return min(self.calls) if self.calls else None

    def run_call(self, uid: int):
        """Run the unit's call; the report, not yet delivered."""
        call = self.calls.pop(uid)
        worker = self.workers[uid]
        if call[0] == "setup":
            return worker.setup(*call[1:])
        return worker.run_chunk(*call[1:])

    def deliver(self, uid: int, report) -> None:
        unit = self.sched.units[uid]
        for job, c in unit.accounts.items():
            a = self.attempts.setdefault((job, c.attempt), Attempt())
            if isinstance(report, SetupReport):
                a.start_forwards = report.experts[job.expert].forwards
            elif job.expert in report.experts:
                a.reported = report.experts[job.expert].usage.forwards
        self.clock.now += 0.01
        handler = self.sched.on_setup if isinstance(report, SetupReport) else self.sched.on_chunk
        self.apply(handler(uid, report))

    def kill(self, uid: int, lost: Lost = KILLED) -> None:
        self.apply(self.sched.on_lost(uid, lost))

    def zombie(self, uid: int) -> None:
        """The driver declares the unit lost before its call ran, but the process lives on and runs the call
        (a partitioned node, or the moment between Ray's kill and the process's end); its report never arrives."""
        worker, call = self.workers[uid], self.calls[uid]
        self.kill(uid)
        if call[0] == "chunk":
            worker.run_chunk(*call[1:])

    def run(self, max_calls: int = 10_000) -> dict[Job, str]:
        for _ in range(max_calls):  # bounded
            uid = self.next_call()
            if uid is None:
                return self.sched.outcome
            self.deliver(uid, self.run_call(uid))
        raise AssertionError("campaign did not end")
