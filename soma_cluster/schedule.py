"""The campaign's decisions, as plain code: which jobs get an actor and when, what each may still spend,
when a failed one is retried, and what a lost attempt cost. No Ray here.

The driver's Ray loop (pipelines/campaign.py) feeds the Scheduler what actors report (typed messages,
soma_cluster/messages.py) and carries out what it returns: start an actor, hand an idle one new jobs,
send a chunk, stop one. Every transition is written to the campaign here (events and ledger), so state
is never only in memory and `restore` rebuilds it after a driver loss.

Accounting of an attempt that ends without finishing (a failure, a preemption, a lost driver): the
checkpoint it leaves says exactly how much of its work is kept (the worker writes its own usage into
every checkpoint), so training is corrected to that amount and the rest is filed as `wasted` (or
`preempted`). Per expert, training forwards then equal a fault-free run's, whatever the kill moment.
"""

from __future__ import annotations

import itertools
import random
import time
from collections import deque
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from typing import Callable

from soma_cluster.budget import BudgetBook, StartCost
from soma_cluster.config import CampaignConfig
from soma_cluster.events import JobHistory, emit
from soma_cluster.failures import Cause, stop_line
from soma_cluster.ledger import EXPERT_SPEND, Ledger
from soma_cluster.messages import ChunkReport, Heartbeat, Incarnation, SetupReport, Usage
from soma_cluster.shards import expert_name
from soma_cluster.storage import Store

POLL_S = 0.5  # the driver's loop waits at most this long for a result, so hangs and budgets are checked this often


@dataclass(frozen=True, order=True)
class Job:
    """The seed model (expert None, N = 1 on the whole corpus) or one expert."""

    expert: int | None = None

    @property
    def role(self) -> str:
        return "seed" if self.expert is None else "expert"

    @property
    def name(self) -> str:
        return "seed" if self.expert is None else expert_name(self.expert)

    @property
    def category(self) -> str:
        """Ledger category of its useful work."""
        return "seed" if self.expert is None else "expert_training"

    @property
    def model_dir(self) -> str:
        return "seed" if self.expert is None else f"experts/{self.name}"


SEED_JOB = Job(None)


def expert_jobs(cfg: CampaignConfig) -> list[Job]:
    return [Job(e) for e in range(cfg.n_experts)]


def unit_name(jobs: list[Job]) -> str:
    return jobs[0].name if len(jobs) == 1 else f"{jobs[0].name}+{len(jobs) - 1}"


# Why an attempt exists, and so where its actor's start-up is billed: a job's first start is part of its
# cost; a start that only happens because an earlier attempt was lost is that loss's cost.
CAUSES = {"new": None, "retry": "wasted", "resumed": "wasted", "preempted": "preempted"}


@dataclass
class Account:
    """One job's side of an attempt."""

    job: Job
    attempt: int
    cause: str  # key of CAUSES
    started: bool = False  # its actor reported in (it held the GPU share)
    setup: Usage = Usage()  # its share of the actor's start-up
    reported: Usage = Usage()  # everything it reported in this attempt, start-up included
    device: str | None = None
    cap_s: float | None = None  # GPU-seconds it may hold, on its own cumulative clock, for this chunk
    seq: int = 0
    step: int = 0
    improving: bool = True
    ended: bool = False


@dataclass
class Unit:
    """One actor's attempt: a single job, or G experts packed on the expert axis (resources.experts_per_actor)."""

    id: int
    accounts: dict[Job, Account]
    requested: float  # scheduler clock when it was asked of Ray
    reused_from: int | None = None  # the unit whose idle actor takes these jobs (resources.reuse_actors)
    previous: tuple[Incarnation, ...] = ()  # killed processes of these jobs that a retry must outlive
    granted: bool = False  # the GPUs present had room for it when asked: Ray grants its share at once
    # scheduler clock when its actor began holding its GPU share (where the worker's own clock starts): the
    # request when granted or reused, else when Ray placed it (on_placed); None while that is unknown
    held_since: float | None = None
    phase: str = "queued"  # queued: asked of Ray, not reported in; running: reporting
    last_beat: float = 0.0
    process: Incarnation | None = None
    leaving: bool = False  # preempted: the actor checkpoints and exits, it takes no more jobs

    @property
    def name(self) -> str:
        return unit_name(list(self.accounts))

    @property
    def jobs(self) -> list[Job]:
        return list(self.accounts)

    def live(self) -> list[Account]:
        return [c for c in self.accounts.values() if not c.ended]


@dataclass(frozen=True)
class Start:
    unit: Unit


@dataclass(frozen=True)
class Reuse:
    unit: Unit
    actor_of: int  # the finished unit whose actor now trains `unit`


@dataclass(frozen=True)
class Chunk:
    unit: Unit
    updates: int
    caps: dict[int | None, float | None]


@dataclass(frozen=True)
class Stop:
    unit: Unit


Action = Start | Reuse | Chunk | Stop


@dataclass(frozen=True)
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
    lost_to: str  # ledger category of the lost part: wasted or preempted
    device: str | None = None

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(d: dict) -> "Settlement":
        return Settlement(
            d["attempt"],
            *(Usage(**d[k]) for k in ("setup", "training", "kept", "unreported")),
            d["lost_to"],
            d.get("device"),
        )


class LossKind(StrEnum):
    """What a lost attempt means for its job (soma_cluster/failures.py says whose failure it was)."""

    FAILURE = "failure"  # the expert's own: retried with backoff, counted against retry.max_retries
    BAD_INPUT = "bad_input"  # no retry can fix it: the job ends failed_permanently at once
    PREEMPTED = "preempted"  # not a failure: rescheduled first, nothing counted
    INFRA = "infra"  # the infrastructure's: retried with backoff, uncounted, for retry.infra_wait_s


@dataclass(frozen=True)
class Lost:
    """Why an actor's attempt ended without a clean report."""

    reason: str
    kind: LossKind = LossKind.FAILURE
    traceback: str | None = None
    cause: Cause | None = None  # recorded in the `failed` event; an INFRA loss always has one


@dataclass(frozen=True)
class InfraStop:
    """The campaign stopped because a job's infrastructure failures outlasted retry.infra_wait_s."""

    cause: Cause
    reason: str
    job: str
    waited_s: float

    def line(self, bound_s: float, url: str) -> str:
        return stop_line(self.cause, self.reason, f"{self.job}'s retries", self.waited_s, bound_s, url)


def _clamp(u: Usage) -> Usage:
    return Usage(*(max(0, getattr(u, f.name)) for f in fields(u)))


def settle(training: Usage, kept: Usage, unreported: Usage = Usage()) -> tuple[Usage, Usage]:
    """An attempt ended without finishing: it reported `training` as useful work, its latest checkpoint
    keeps `kept` of the attempt's work, and `unreported` is the driver's estimate of what it held since its
    last report. Returns (the correction to training, what was lost). The correction is negative when work
    after the checkpoint is lost, positive when it checkpointed after its last heartbeat (kept, never
    reported); training plus the correction is exactly `kept`."""
    return kept - training, _clamp(training + unreported - kept)


def backoff_s(base: float, cap: float, failures: int, rng: random.Random) -> float:
    """The wait before the retry after `failures` failures: exponential, capped, with equal jitter (half
    fixed, half random), so experts that failed together (a lost node) do not come back in lockstep."""
    delay = min(cap, base * 2 ** max(0, failures - 1))
    return delay * (0.5 + 0.5 * rng.random())


@dataclass
class JobView:
    """What the driver last heard of a job, for `soma status` (not used in any decision)."""

    step: int = 0
    val: float | None = None  # latest expert-validation loss, nats/byte
    node: str | None = None
    device: str | None = None
    last_error: str | None = None


@dataclass
class Scheduler:
    store: Store
    cfg: CampaignConfig
    jobs: list[Job]
    clock: Callable[[], float] = time.monotonic
    rng: random.Random = field(default_factory=random.Random)
    # the latest checkpoint's metadata of a job (None if it has none): what a lost attempt kept
    latest: Callable[[Job], dict | None] = lambda job: None

    def __post_init__(self) -> None:
        self.ledger = Ledger(self.store)
        self.book = BudgetBook(self.cfg.budget)
        self.units: dict[int, Unit] = {}
        self.open: dict[Job, Unit] = {}  # job -> the unit training it (queued or running)
        self.pending: deque[Job] = deque()  # jobs waiting for an actor, in order
        self.retry_at: dict[Job, float] = {}
        self.next_attempt: dict[Job, int] = {}
        self.cause: dict[Job, str] = {}
        self.failures: dict[Job, int] = {}
        self.killed: dict[Job, Incarnation] = {}  # the process of a job's last attempt, killed by the driver
        self.settled: dict[Job, Settlement] = {}  # a job's lost attempt, until its next attempt reports what it resumed
        self.outcome: dict[Job, str] = {}
        self.bad_input: dict[Job, str] = {}
        self.infra_since: dict[Job, float] = {}  # a job's first infrastructure failure since its last checkpoint
        self.infra_tries: dict[Job, int] = {}  # and how many followed it (the backoff's exponent)
        self.stopped: InfraStop | None = None  # set once: the campaign stops for its environment
        self.seen: dict[Job, JobView] = {j: JobView() for j in self.jobs}  # what `soma status` shows of each job
        self._ids = itertools.count()
        totals = self.ledger.totals()
        self.spent = dict(totals.per_expert_gpu_seconds)  # kept in step with every record written
        self.largest = dict(totals.per_expert_largest)  # each expert's largest single record, likewise
        self.by_category = dict(totals.gpu_seconds)  # GPU-seconds per ledger category, likewise
        self.by_device = dict(totals.devices)  # GPU-seconds per device ("cuda", "cpu"), likewise
        self.totals_at_start = totals
        self.start_cost = StartCost(
            totals.least_startup
        )  # least start-up (and update) cost measured, for launch refusals

    @property
    def spent_total(self) -> float:
        """GPU-seconds of the whole campaign so far, every category."""
        return sum(self.by_category.values())

    @property
    def finished(self) -> bool:
        return not (self.pending or self.units or self.retry_at)

    # -- ledger and budgets ---------------------------------------------------------------------------
    def _record(self, category: str, u: Usage, c: Account, seq: int, note: str = "", step: int | None = None) -> None:
        self.ledger.record(
            category,
            u.gpu_seconds,
            u.wall_seconds,
            expert=c.job.expert,
            attempt=c.attempt,
            seq=seq,
            forwards=u.forwards,
            tokens=u.tokens,
            step=c.step if step is None else step,
            note=note,
            device=c.device,
        )
        if c.job.expert is not None and category in EXPERT_SPEND:
            self.spent[c.job.expert] = self.spent.get(c.job.expert, 0.0) + u.gpu_seconds
            self.largest[c.job.expert] = max(self.largest.get(c.job.expert, 0.0), u.gpu_seconds)
        self.by_category[category] = self.by_category.get(category, 0.0) + u.gpu_seconds
        if c.device and u.gpu_seconds:
            self.by_device[c.device] = self.by_device.get(c.device, 0.0) + u.gpu_seconds

    def left(self, job: Job) -> float | None:
        """GPU-seconds the job may still spend; the campaign's remainder is shared among the open jobs."""
        share = max(1, len(self.open) + (0 if job in self.open else 1))
        spent = self.spent.get(job.expert, 0.0) if job.expert is not None else 0.0
        return self.book.left(job.expert, spent, self.spent_total, share)

    def _event(self, event: str, job: Job, **fields) -> None:
        emit(self.store, event, job.name, **fields)

    # -- starting actors ------------------------------------------------------------------------------
    def _pack(self, first: Job) -> int:
        return 1 if first.expert is None else self.cfg.resources.experts_per_actor

    def _take(self) -> list[Job]:
        g = self._pack(self.pending[0])
        return [self.pending.popleft() for _ in range(min(g, len(self.pending)))]

    def _due(self) -> list[Job]:
        now = self.clock()
        due = sorted(j for j, at in self.retry_at.items() if at <= now)
        group = due[: self._pack(due[0])] if due else []
        for job in group:
            del self.retry_at[job]
        return group

    def requests(self, capacity: float, room: int = 0) -> list[Action]:
        """Actors to ask Ray for now: due retries first, then pending jobs (up to experts_per_actor per actor),
        while fewer than `capacity` actors are queued or running. The first `room` of those fit in the GPUs
        present (Ray grants them at once); the others wait in Ray's queue, where an autoscaler sees them.
        Once the campaign is `stopped`: none, and every actor still queued or running is stopped."""
        if self.stopped is not None:
            return self._halt()
        out: list[Action] = []
        while len(self.units) < capacity:
            group = self._due() or (self._take() if self.pending else [])
            if not group:
                break
            granted = len(self.units) < room
            unit = self._open(group)
            if unit is not None:
                unit.granted = granted
                unit.held_since = unit.requested if granted else None
                out.append(Start(unit))
        return out

    def _open(self, jobs: list[Job], reused_from: int | None = None) -> Unit | None:
        """A unit for the jobs the budget can still cover (the others end budget_exhausted); None if none."""
        for job, why in [(j, why) for j in jobs if (why := self._unaffordable(j))]:
            self._finish(job, "budget_exhausted", note=why)
            jobs = [j for j in jobs if j != job]
        if not jobs:
            return None
        accounts = {}
        for job in jobs:
            n = self.next_attempt.get(job, 0)
            self.next_attempt[job] = n + 1
            accounts[job] = Account(job, n, self.cause.get(job, "new"))
        previous = tuple(self.killed.pop(j) for j in jobs if j in self.killed)
        unit = Unit(next(self._ids), accounts, self.clock(), reused_from, previous)
        unit.held_since = unit.requested if reused_from is not None else None  # an idle actor holds its share already
        self.units[unit.id] = unit
        for c in accounts.values():
            self.open[c.job] = unit
            if c.cause == "retry":
                self._event("retried", c.job, attempt=c.attempt)
            self._event(
                "queued",
                c.job,
                attempt=c.attempt,
                num_gpus=self.cfg.resources.num_gpus / len(jobs),
                actor=unit.name,
                reused=reused_from is not None,
                cause=c.cause,
            )
        return unit

    def _unaffordable(self, job: Job) -> str | None:
        """Why the budget cannot cover a launch of the job now, or None. Beyond a budget already spent: one that
        cannot cover even a start-up plus one chunk (the least measured in this campaign) would only burn
        GPU-seconds to stop at its first step, so it is not started. That test takes the job's own cap and the
        campaign's whole remainder, not its share of it (the share grows back as other jobs end)."""
        left = self.left(job)
        if left is None:
            return None
        if left <= 0:
            return "budget cannot cover a launch"
        spent = self.spent.get(job.expert, 0.0) if job.expert is not None else 0.0
        alone = self.book.left(job.expert, spent, self.spent_total)
        need = self.start_cost.need_s(min(self.cfg.train.chunk_updates, self.cfg.train.updates))
        if need is not None and alone is not None and alone < need:
            return (
                f"budget cannot cover a start-up plus one chunk: {alone:.2f} GPU-s left, {need:.2f} needed "
                f"(the least start-up and update cost measured in this campaign)"
            )
        return None

    def _chunk(self, unit: Unit) -> Chunk:
        caps = {}
        for c in unit.live():
            left = self.left(c.job)
            c.cap_s = (
                None if left is None else left + c.reported.gpu_seconds
            )  # the worker compares its own cumulative clock
            caps[c.job.expert] = c.cap_s
        unit.last_beat = self.clock()
        return Chunk(unit, self.cfg.train.chunk_updates, caps)

    def _close(self, unit: Unit) -> list[Action]:
        """Every job of the unit ended: its idle actor takes the next pending experts (resources.reuse_actors)
        or is stopped."""
        self.units.pop(unit.id, None)
        if self.cfg.resources.reuse_actors and not unit.leaving:
            while self.pending and self.pending[0].expert is not None:
                nxt = self._open(self._take(), reused_from=unit.id)
                if nxt is not None:
                    return [Reuse(nxt, unit.id)]
        return [Stop(unit)]

    # -- what actors report ---------------------------------------------------------------------------
    def on_setup(self, uid: int, report: SetupReport) -> list[Action]:
        unit = self.units[uid]
        unit.phase, unit.process, unit.last_beat = "running", report.process, self.clock()
        for expert, start in report.experts.items():
            c = unit.accounts[Job(expert)]
            c.started, c.step, c.setup, c.reported, c.device = True, start.step, start.usage, start.usage, report.device
            view = self.seen.setdefault(c.job, JobView())
            view.step, view.node, view.device = start.step, report.node_ip or report.process.node, report.device
            self._event(
                "launched",
                c.job,
                t=report.held_from,
                attempt=c.attempt,
                actor=unit.name,
                reused=unit.reused_from is not None,
                num_gpus=self.cfg.resources.num_gpus / len(unit.accounts),
                device=report.device,
            )
            self._event(
                "started",
                c.job,
                attempt=c.attempt,
                step=start.step,
                resumed=start.resumed,
                forwards=start.forwards,
                device=report.device,
                pid=report.process.pid,
                node=report.process.node,
                node_ip=report.node_ip,
                actor=unit.name,
                waited_s=report.waited_s,
            )
            note = "start-up: process, imports, data and model" + ("" if c.cause == "new" else f" (after {c.cause})")
            self._record(CAUSES[c.cause] or c.job.category, start.usage, c, 0, note)
            self.start_cost.observe_startup(start.usage.gpu_seconds)
            self._resettle(c.job, start.step, start.kept_by, start.kept)
        return [self._chunk(unit)] if unit.live() else self._close(unit)

    def on_chunk(self, uid: int, report: ChunkReport) -> list[Action]:
        unit = self.units[uid]
        for expert, hb in report.experts.items():
            self._on_heartbeat(unit, unit.accounts[Job(expert)], hb)
        unit.last_beat = self.clock()
        return [self._chunk(unit)] if unit.live() else self._close(unit)

    def _on_heartbeat(self, unit: Unit, c: Account, hb: Heartbeat) -> None:
        c.seq += 1
        c.step = hb.step
        view = self.seen.setdefault(c.job, JobView())
        view.step = hb.step
        if hb.val is not None:
            view.val = hb.val
        self._record(c.job.category, hb.usage - c.reported, c, c.seq)
        self.start_cost.observe_updates(hb.usage.gpu_seconds - c.reported.gpu_seconds, hb.updates)
        c.reported = hb.usage
        if hb.val is not None:
            c.improving = hb.best_val is not None and hb.val <= hb.best_val
        self._event(
            "heartbeat",
            c.job,
            attempt=c.attempt,
            step=hb.step,
            loss=hb.loss,
            val=hb.val,
            gpu_seconds=hb.usage.gpu_seconds,
            eps=hb.eps,
            lr=hb.lr,
        )
        if hb.checkpoint:
            self._event("checkpointed", c.job, attempt=c.attempt, step=hb.checkpoint_step, checkpoint=hb.checkpoint)
            self._recovered(c.job)
        if not hb.done:
            return
        self._end(c)
        if hb.reason == "preempted":
            unit.leaving = True
            self._lose(c, Lost("preempted: the worker got SIGTERM and checkpointed", LossKind.PREEMPTED))
        elif hb.failed:
            self._lose(c, Lost(hb.reason or "failed"))
        else:
            self._finish(c.job, hb.reason, attempt=c.attempt, step=hb.step, val=hb.best_val)

    def on_lost(self, uid: int, lost: Lost, stop: tuple[Job, ...] = ()) -> list[Action]:
        """The unit's actor is gone (or must be killed now): each job it was training settles what was lost
        and is retried from its latest checkpoint; jobs in `stop` end budget_exhausted instead (hard-stopped
        past their budget). A queued unit held nothing, so there is nothing to settle."""
        unit = self.units.pop(uid)
        live = unit.live()
        share = self.cfg.resources.num_gpus / max(1, len(live))
        held = max(0.0, self.clock() - unit.last_beat) if unit.phase == "running" else 0.0
        unreported = Usage(held * share, held * share / self.cfg.resources.num_gpus)
        for c in live:
            self._end(c)
            why = lost.reason if len(live) == 1 else f"{lost.reason} (in pack {unit.name})"
            self._lose(
                c,
                Lost(why, lost.kind, lost.traceback, lost.cause),
                unreported,
                "budget_exhausted" if c.job in stop else None,
            )
            if unit.process is not None and lost.kind != LossKind.PREEMPTED:
                self.killed[c.job] = unit.process
        return [Stop(unit)]

    def _end(self, c: Account) -> None:
        c.ended = True
        self.open.pop(c.job, None)

    # -- ends -----------------------------------------------------------------------------------------
    def _kept(self, c: Account) -> Usage:
        """Of this attempt's work (start-up excluded), what its job's latest checkpoint keeps."""
        meta = self.latest(c.job) if c.started else None
        if not meta or meta.get("attempt") != c.attempt or "usage" not in meta:
            return Usage()
        return Usage(**meta["usage"]) - c.setup

    def _lose(self, c: Account, lost: Lost, unreported: Usage = Usage(), end: str | None = None) -> None:
        """Settle an attempt that ended without finishing, then retry, reschedule or end its job."""
        settled = {}
        if c.started:
            s = Settlement(
                c.attempt,
                c.setup,
                c.reported - c.setup,
                self._kept(c),
                unreported,
                "preempted" if lost.kind == LossKind.PREEMPTED else "wasted",
                c.device,
            )
            self._settle(c, s, lost.reason)
            settled = {"settled": s.to_json()}
        if lost.kind == LossKind.PREEMPTED:
            self._event("preempted", c.job, attempt=c.attempt, step=c.step, reason=lost.reason, **settled)
            self.cause[c.job] = "preempted"
            self.pending.appendleft(c.job)  # not a failure: no retry spent, no backoff
            return
        infra = lost.kind == LossKind.INFRA and end is None
        if not infra:
            self.failures[c.job] = self.failures.get(c.job, 0) + 1
        self.seen.setdefault(c.job, JobView()).last_error = lost.reason
        self._event(
            "failed",
            c.job,
            attempt=c.attempt,
            step=c.step,
            reason=lost.reason,
            **settled,
            **({"cause": lost.cause} if lost.cause else {}),
            **({"counted": False} if infra else {}),
            **({"traceback": lost.traceback} if lost.traceback else {}),
        )
        if infra:
            self._wait_out(c.job, lost)
        elif end is not None or lost.kind == LossKind.BAD_INPUT:
            if lost.kind == LossKind.BAD_INPUT:
                self.bad_input[c.job] = lost.reason
            self._finish(c.job, end or "failed_permanently", attempt=c.attempt, step=c.step, reason=lost.reason)
        elif self.failures[c.job] > self.cfg.retry.max_retries:
            self._finish(c.job, "failed_permanently", attempt=c.attempt, step=c.step, reason=lost.reason)
        else:
            r = self.cfg.retry
            delay = backoff_s(r.backoff_s, r.backoff_max_s, self.failures[c.job], self.rng)
            self.retry_at[c.job] = self.clock() + delay
            self.cause[c.job] = "retry"
            self._event("retry_scheduled", c.job, attempt=self.next_attempt[c.job], delay_s=delay)

    def _wait_out(self, job: Job, lost: Lost) -> None:
        """An infrastructure failure: retry the job after a backoff, spending none of its retries, until the condition
        has lasted retry.infra_wait_s since the job's first such failure after its last checkpoint; a failure past that
        stops the campaign. The last backoff is cut to the bound, so the stop comes within the bound plus one try."""
        now, r = self.clock(), self.cfg.retry
        since = self.infra_since.setdefault(job, now)
        if now - since >= r.infra_wait_s:
            if self.stopped is None:
                self.stopped = InfraStop(lost.cause or Cause.NODE_LOST, lost.reason, job.name, now - since)
            return
        self.infra_tries[job] = self.infra_tries.get(job, 0) + 1
        delay = min(
            backoff_s(r.backoff_s, r.backoff_max_s, self.infra_tries[job], self.rng), since + r.infra_wait_s - now
        )
        self.retry_at[job] = now + delay
        self.cause[job] = "retry"
        self._event(
            "retry_scheduled",
            job,
            attempt=self.next_attempt[job],
            delay_s=delay,
            cause=lost.cause,
            counted=False,
            waited_s=now - since,
        )

    def _recovered(self, job: Job) -> None:
        """The job wrote a checkpoint: whatever infrastructure failed it before is working again."""
        self.infra_since.pop(job, None)
        self.infra_tries.pop(job, None)

    def _halt(self) -> list[Action]:
        """The campaign stops for its environment: every attempt still open ends as preempted (settled against its
        checkpoint, first in line at `soma resume`, no retry spent), nothing more is started."""
        out: list[Action] = []
        why = f"stopped: the campaign stopped for its environment ({self.stopped.cause})"
        for unit in list(self.units.values()):
            out += self.on_lost(unit.id, Lost(why, LossKind.PREEMPTED))
        self.pending.clear()
        self.retry_at.clear()
        return out

    def _settle(self, c: Account, s: Settlement, why: str) -> None:
        """Training is corrected to what the checkpoint keeps, the rest of what the attempt held is lost."""
        fix, gone = settle(s.training, s.kept, s.unreported)
        if not fix.is_zero:
            self._record(c.job.category, fix, c, -1, f"settled against the latest checkpoint: {why}")
        if not gone.is_zero:
            self._record(s.lost_to, gone, c, -1, f"lost after checkpoint: {why}")
        self.settled[c.job] = s

    def _resettle(self, job: Job, step: int, kept_by: int | None, kept: Usage | None) -> None:
        """The job's new attempt resumed from a checkpoint of its lost attempt other than the one that attempt was
        settled against: settle it again against the one really kept, and book the difference."""
        s = self.settled.pop(job, None)
        if s is None or kept_by != s.attempt or kept is None or kept - s.setup == s.kept:
            return
        (fix0, gone0), (fix1, gone1) = (
            settle(s.training, s.kept, s.unreported),
            settle(s.training, kept - s.setup, s.unreported),
        )
        c = Account(job, s.attempt, "resumed", started=True, setup=s.setup, device=s.device, step=step)
        note = "settled again: the next attempt resumed from a checkpoint the attempt wrote after it was declared lost"
        if not (fix1 - fix0).is_zero:
            self._record(job.category, fix1 - fix0, c, -2, note)
        if not (gone1 - gone0).is_zero:
            self._record(s.lost_to, gone1 - gone0, c, -2, note)

    def _finish(self, job: Job, end: str, **fields) -> None:
        self.outcome[job] = end
        self._event(end, job, **fields)
        if job.expert is not None and end != "finished":
            self._release(job)

    def _release(self, job: Job) -> None:
        """An expert that ended early returns its unspent budget to the pool (budget.pool_policy)."""
        candidates = {
            u.accounts[j].job.expert: u.accounts[j].improving for j, u in self.open.items() if j.expert is not None
        }
        candidates |= {
            j.expert: True for j in self.jobs if j.expert is not None and j not in self.outcome and j not in self.open
        }
        for expert, s in self.book.release(job.expert, self.spent.get(job.expert, 0.0), candidates).items():
            emit(self.store, "budget_granted", expert_name(expert), expert=expert, gpu_seconds=s, source=job.name)

    # -- hangs and budgets ----------------------------------------------------------------------------
    def watchdog(self) -> list[Action]:
        """A running actor silent past retry.heartbeat_timeout_s has hung; one past a job's cap plus the grace
        is hard-stopped, in its start-up too; a queued one whose jobs the budget can no longer cover is cancelled."""
        now, out = self.clock(), []
        budgeted = self.book.campaign_s is not None or self.book.expert_s is not None
        for unit in list(self.units.values()):
            if unit.phase == "queued":
                if budgeted and all((left := self.left(c.job)) is not None and left <= 0 for c in unit.live()):
                    out += self._cancel(unit)
                elif budgeted and unit.held_since is not None:
                    out += self._watch_startup(unit, now)
                continue
            silent = now - unit.last_beat
            live = unit.live()
            held = silent * self.cfg.resources.num_gpus / max(1, len(live))
            over = tuple(
                c.job
                for c in live
                if c.cap_s is not None and c.reported.gpu_seconds + held > c.cap_s + self.cfg.budget.grace_gpu_seconds
            )
            if silent > self.cfg.retry.heartbeat_timeout_s:
                out += self.on_lost(unit.id, Lost(f"hang: no heartbeat for {silent:.0f} s"))
            elif over:
                out += self.on_lost(unit.id, Lost("budget_exhausted: hard stop past the grace"), stop=over)
        return out

    def on_placed(self, uid: int, held_for_s: float) -> None:
        """Ray placed a unit that waited in its queue: its actor has held its GPU share for held_for_s seconds
        (its own clock), so from now on its start-up counts against its budget."""
        unit = self.units.get(uid)
        if unit is not None and unit.phase == "queued" and unit.held_since is None:
            unit.held_since = self.clock() - max(0.0, held_for_s)

    def _watch_startup(self, unit: Unit, now: float) -> list[Action]:
        """An actor still starting up holds its GPU share: once that held time passes what a job may still spend
        plus the grace, the actor is hard-stopped as a running one would be, and the start-up it held so far is
        billed as the attempt's start-up (the driver's clock: the worker never reported)."""
        live = unit.live()
        held = (now - unit.held_since) / max(1, len(live))
        grace = self.cfg.budget.grace_gpu_seconds
        over = tuple(
            c.job
            for c in live
            if (left := self.left(c.job)) is not None and held * self.cfg.resources.num_gpus > left + grace
        )
        if not over:
            return []
        usage = Usage(held * self.cfg.resources.num_gpus, held)
        for c in live:
            c.started, c.setup, c.reported = True, usage, usage
            self._record(
                CAUSES[c.cause] or c.job.category,
                usage,
                c,
                0,
                "start-up, hard-stopped by the driver before it reported (the driver's clock)",
            )
            self.start_cost.observe_startup(usage.gpu_seconds)  # a start-up costs at least this
        return self.on_lost(
            unit.id, Lost(f"budget_exhausted: hard stop past the grace during start-up ({held:.1f} s held)"), stop=over
        )

    def _cancel(self, unit: Unit) -> list[Action]:
        """A queued actor whose jobs the budget can no longer cover is withdrawn before it holds a GPU."""
        self.units.pop(unit.id)
        for c in unit.live():
            self._end(c)
            self._finish(c.job, "budget_exhausted", note="cancelled while queued: the budget cannot cover it")
        return [Stop(unit)]

    # -- after a driver loss --------------------------------------------------------------------------
    def restore(self, past: dict[str, JobHistory]) -> None:
        """Rebuild from the campaign directory: ended jobs stay ended, grants are replayed, failures counted,
        and an attempt the lost driver left running is settled against its job's latest checkpoint."""
        by_name = {j.name: j for j in self.jobs}
        for h in past.values():
            for ev in h.events:
                if ev["event"] == "budget_granted" and h.job in by_name:
                    e = by_name[h.job].expert
                    self.book.granted[e] = self.book.granted.get(e, 0.0) + ev["gpu_seconds"]
        records = None
        for job in self.jobs:
            h = past.get(job.name)
            if h:
                self.seen[job] = view_of(h)
            if h and h.terminal:
                self.outcome[job] = h.state
                continue
            self.pending.append(job)
            if not h or not h.attempts:
                continue
            self.next_attempt[job], self.failures[job] = h.attempts, h.failures
            self.cause[job] = self._cause_after(h)
            last = h.attempts - 1
            if h.held(last) and h.ended(last) is None:
                records = self.ledger.records() if records is None else records  # read once, not once per job
                self._settle_interrupted(job, last, records)
            else:
                # its last attempt that held a GPU ended lost and the next has not reported in: finish that on setup
                ends = [ev for ev in h.events if ev["event"] in ("failed", "preempted") and "settled" in ev]
                if ends and ends[-1]["attempt"] == max(a for a in range(h.attempts) if h.held(a)):
                    self.settled[job] = Settlement.from_json(ends[-1]["settled"])

    @staticmethod
    def _cause_after(h: JobHistory) -> str:
        """Why the job's next attempt exists, from how its latest attempt that held a GPU ended."""
        for attempt in range(h.attempts - 1, -1, -1):
            if h.held(attempt):
                return {"failed": "retry", "preempted": "preempted", None: "resumed"}.get(h.ended(attempt), "retry")
        return "new"

    def _settle_interrupted(self, job: Job, attempt: int, records: list[dict]) -> None:
        mine = [r for r in records if r["expert"] == job.expert and r["attempt"] == attempt]
        setup = sum((_usage(r) for r in mine if r["seq"] == 0), Usage())
        training = sum((_usage(r) for r in mine if r["seq"] > 0 and r["category"] == job.category), Usage())
        device = next((r.get("device") for r in mine if r.get("device")), None)
        if any(r["seq"] < 0 for r in mine):  # settled by an earlier resume (that driver was lost too)
            fixes = sum((_usage(r) for r in mine if r["seq"] < 0 and r["category"] == job.category), Usage())
            self.settled[job] = Settlement(attempt, setup, training, training + fixes, Usage(), "wasted", device)
            return
        c = Account(
            job,
            attempt,
            "resumed",
            started=True,
            setup=setup,
            reported=setup + training,
            device=device,
            step=max((r["step"] for r in mine if r["step"] is not None), default=0),
        )
        self._settle(c, Settlement(attempt, setup, training, self._kept(c), Usage(), "wasted", device), "driver lost")


def view_of(h: JobHistory) -> JobView:
    """A job's status view rebuilt from its events (after a driver loss, or for a campaign without status.json)."""
    started = [ev for ev in h.events if ev["event"] == "started"]
    last = started[-1] if started else {}
    return JobView(h.step, h.val, last.get("node_ip") or last.get("node"), last.get("device"), h.last_error)


def _usage(rec: dict) -> Usage:
    return Usage(rec["gpu_seconds"], rec["wall_seconds"], rec["forwards"], rec["tokens"])
