"""What each attempt cost, written to the ledger as it is reported, and how an attempt that ended without
finishing is settled. No Ray here.

Accounting of an attempt that ends without finishing (a failure, a preemption, a lost driver): the checkpoint it
leaves says exactly how much of its work is kept (the worker writes its own usage into every checkpoint), so
training is corrected to that amount and the rest is filed as `wasted` (or `preempted`). Per expert, training
forwards then equal a fault-free run's, whatever the kill moment.

The live sums (`Books.totals`) are the ledger's own `Totals`, kept in step with every record written, so the
budget decisions read the same numbers a replay of the ledger gives.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, fields
from typing import Callable

from soma_cluster.budget import StartCost
from soma_cluster.jobs import AttemptCause, Category, Job
from soma_cluster.ledger import Ledger
from soma_cluster.messages import Usage
from soma_cluster.storage import Store

SETUP_SEQ = 0  # the ledger `seq` of an attempt's start-up; its heartbeats count up from 1
SETTLED_SEQ = -1  # a settlement against the latest checkpoint
RESETTLED_SEQ = -2  # a settlement made again against the checkpoint the next attempt really resumed from
FORKED_SEQ = -3  # a warm fork's record of what its parent spent on an expert (attempt -1: pipelines/fork.py)
FORKED_UNPRICED_SEQ = -4  # the same, of what the parent's records hold without a price
NOTHING = Usage()


@dataclass
class Account:
    """One job's side of an attempt."""

    job: Job
    attempt: int
    cause: AttemptCause
    started: bool = False  # its actor reported in (it held the GPU share)
    setup: Usage = Usage()  # its share of the actor's start-up
    reported: Usage = Usage()  # everything it reported in this attempt, start-up included
    device: str | None = None
    cap_s: float | None = None  # GPU-seconds it may hold, on its own cumulative clock, for this chunk
    seq: int = 0
    step: int = 0
    improving: bool = True
    ended: bool = False


@dataclass(frozen=True, kw_only=True)
class Settlement:
    """How an attempt that ended without finishing was settled, kept until its job's next attempt reports in:
    that attempt says which checkpoint it really resumed from, which may be newer than the one the settlement
    read (a worker declared lost that was still running, on a partitioned node or between Ray's kill and the
    process's end, and wrote one more) or older (a checkpoint that did not verify)."""

    attempt: int
    setup: Usage  # the attempt's start-up share (not part of its kept work)
    training: Usage  # what it reported as useful work
    kept: Usage  # what the settlement took its checkpoint to keep
    unreported: Usage  # the driver's estimate of what it held after its last report
    lost_to: Category  # ledger category of the lost part: wasted or preempted
    device: str | None = None

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(d: dict) -> "Settlement":
        return Settlement(
            attempt=d["attempt"],
            **{k: Usage(**d[k]) for k in ("setup", "training", "kept", "unreported")},
            lost_to=Category(d["lost_to"]),
            device=d.get("device"),
        )


def _clamp(u: Usage) -> Usage:
    return Usage(*(max(0, getattr(u, f.name)) for f in fields(u)))


def settle(training: Usage, kept: Usage, unreported: Usage = NOTHING) -> tuple[Usage, Usage]:
    """An attempt ended without finishing: it reported `training` as useful work, its latest checkpoint
    keeps `kept` of the attempt's work, and `unreported` is the driver's estimate of what it held since its
    last report. Returns (the correction to training, what was lost). The correction is negative when work
    after the checkpoint is lost, positive when it checkpointed after its last heartbeat (kept, never
    reported); training plus the correction is exactly `kept`."""
    return kept - training, _clamp(training + unreported - kept)


class Books:
    """The campaign's ledger as the scheduler writes it: every record, the live totals, the least measured start
    cost, and each job's lost attempt until its next attempt says which checkpoint it resumed from."""

    def __init__(
        self,
        store: Store,
        latest: Callable[[Job], dict | None],
        price: Callable[[str | None], float | None] = lambda device: None,
    ):
        self.ledger = Ledger(store)
        self.price = price  # USD per GPU-hour on a device now (soma_cluster/prices.py), kept with each record
        self.latest = latest  # the latest checkpoint's metadata of a job (None if it has none)
        self.at_start = self.ledger.totals()  # what the ledger held when this driver began
        self.totals = copy.deepcopy(self.at_start)  # kept in step with every record written
        self.start_cost = StartCost(self.at_start.least_startup)  # least measured, for launch refusals
        self.settled: dict[Job, Settlement] = {}  # a job's lost attempt, until its next attempt reports in

    @property
    def spent_total(self) -> float:
        """GPU-seconds of the whole campaign so far, every category."""
        return sum(self.totals.gpu_seconds.values())

    def spent(self, job: Job) -> float:
        """GPU-seconds billed to the job: an expert's own spend, the seed's category."""
        if job.expert is None:
            return self.totals.gpu_seconds.get(Category.SEED, 0.0)
        return self.totals.per_expert_gpu_seconds.get(job.expert, 0.0)

    def record(self, category: Category, u: Usage, c: Account, seq: int, note: str = "") -> None:
        self.ledger.record(
            category=category,
            gpu_seconds=u.gpu_seconds,
            wall_seconds=u.wall_seconds,
            expert=c.job.expert,
            attempt=c.attempt,
            seq=seq,
            forwards=u.forwards,
            tokens=u.tokens,
            step=c.step,
            note=note,
            device=c.device,
            usd_per_hour=(usd := self.price(c.device)),
        )
        self.totals.add(category, u, expert=c.job.expert, seq=seq, device=c.device, usd_per_hour=usd)

    def startup(self, c: Account, usage: Usage, note: str) -> None:
        """An attempt's start-up: billed to the loss that caused it, or to its job's own work."""
        self.record(c.cause.startup_category or c.job.category, usage, c, SETUP_SEQ, note)
        self.start_cost.observe_startup(usage.gpu_seconds)

    def kept(self, c: Account) -> Usage:
        """Of this attempt's work (start-up excluded), what its job's latest checkpoint keeps."""
        meta = self.latest(c.job) if c.started else None
        if not meta or meta.get("attempt") != c.attempt or "usage" not in meta:
            return Usage()
        return Usage(**meta["usage"]) - c.setup

    def settle(self, c: Account, s: Settlement, why: str) -> None:
        """Training is corrected to what the checkpoint keeps, the rest of what the attempt held is lost."""
        fix, gone = settle(s.training, s.kept, s.unreported)
        if not fix.is_zero:
            self.record(c.job.category, fix, c, SETTLED_SEQ, f"settled against the latest checkpoint: {why}")
        if not gone.is_zero:
            self.record(s.lost_to, gone, c, SETTLED_SEQ, f"lost after checkpoint: {why}")
        self.settled[c.job] = s

    def resettle(self, job: Job, step: int, kept_by: int | None, kept: Usage | None) -> None:
        """The job's new attempt resumed from a checkpoint of its lost attempt other than the one that attempt was
        settled against: settle it again against the one really kept, and book the difference."""
        s = self.settled.pop(job, None)
        if s is None or kept_by != s.attempt or kept is None or kept - s.setup == s.kept:
            return
        (fix0, gone0), (fix1, gone1) = (
            settle(s.training, s.kept, s.unreported),
            settle(s.training, kept - s.setup, s.unreported),
        )
        c = Account(job, s.attempt, AttemptCause.RESUMED, started=True, setup=s.setup, device=s.device, step=step)
        note = "settled again: the next attempt resumed from a checkpoint the attempt wrote after it was declared lost"
        if not (fix1 - fix0).is_zero:
            self.record(job.category, fix1 - fix0, c, RESETTLED_SEQ, note)
        if not (gone1 - gone0).is_zero:
            self.record(s.lost_to, gone1 - gone0, c, RESETTLED_SEQ, note)
