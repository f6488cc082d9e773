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
from dataclasses import dataclass, field, replace
from typing import Callable

from soma_cluster.accounting import NOTHING, Account, Books, Settlement
from soma_cluster.avoidance import Avoidance
from soma_cluster.budget import BudgetBook
from soma_cluster.config import CampaignConfig
from soma_cluster.events import EXTENDED, JobHistory, emit
from soma_cluster.failures import error_cause
from soma_cluster.jobs import (
    TERMINAL,
    AttemptCause,
    Category,
    Cause,
    Event,
    Job,
    JobState,
    JobStatus,
    JobView,
    LossKind,
    LostAs,
    StopReason,
    advance,
)
from soma_cluster.messages import ChunkReport, Heartbeat, Incarnation, SetupReport, Usage
from soma_cluster.prices import usd_per_hour
from soma_cluster.restore import restore
from soma_cluster.retries import InfraStop, Retries
from soma_cluster.storage import Store

POLL_S = 0.5  # the driver's loop waits at most this long for a result, so hangs and budgets are checked this often


def unit_name(jobs: list[Job]) -> str:
    return jobs[0].name if len(jobs) == 1 else f"{jobs[0].name}+{len(jobs) - 1}"


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
    phase: JobState = JobState.QUEUED  # queued: asked of Ray, not reported in; running: reporting
    last_beat: float = 0.0
    process: Incarnation | None = None
    leaving: bool = False  # preempted: the actor checkpoints and exits, it takes no more jobs
    avoid: frozenset[str] = frozenset()  # nodes its actor should rather not be placed on (soma_cluster/avoidance.py)

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
    targets: dict[int | None, int] = field(default_factory=dict)  # each job's update target now (it may grow)


@dataclass(frozen=True)
class Stop:
    unit: Unit


Action = Start | Reuse | Chunk | Stop


@dataclass(frozen=True)
class Lost:
    """Why an actor's attempt ended without a clean report. The reason its events give is `what: detail`."""

    what: LostAs  # the reason's first word (a plain string of one is taken as its LostAs)
    detail: str  # what failed, in the words of the error or the driver
    cause: Cause | None = None  # recorded in the `failed` event; an INFRA loss always has one
    traceback: str | None = None
    node: str | None = None  # the Ray node it was lost on, where known (its error says; else its setup report)

    def __post_init__(self) -> None:
        object.__setattr__(self, "what", LostAs(self.what))

    @property
    def reason(self) -> str:
        return f"{self.what}: {self.detail}"

    @property
    def kind(self) -> LossKind:
        """What the loss means for its job (its own failure unless the cause says otherwise)."""
        return LossKind.FAILURE if self.cause is None else self.cause.kind


@dataclass
class Scheduler:
    store: Store
    cfg: CampaignConfig
    jobs: list[Job]
    clock: Callable[[], float] = time.monotonic
    rng: random.Random = field(default_factory=random.Random)
    # the latest checkpoint's metadata of a job (None if it has none): what a lost attempt kept
    latest: Callable[[Job], dict | None] = lambda job: None
    # handed every event record written (the experiment tracker's feed: it must only enqueue, never block)
    observe: Callable[[dict], None] | None = None

    def __post_init__(self) -> None:
        self.book = BudgetBook(self.cfg.budget)
        # the ledger, its live totals, the settlements; each record at the price in force (revisions included)
        self.books = Books(self.store, self.latest, lambda device: usd_per_hour(self.cfg.prices, device))
        self.retries = Retries(self.cfg.retry, self.clock, self.rng)
        self.avoid = Avoidance(self.clock)  # nodes that could not reach the store, for a while
        self.units: dict[int, Unit] = {}
        self.room = 0  # actors the GPUs present hold, as of the last requests (on_gpu)
        self.open: dict[Job, Unit] = {}  # job -> the unit training it (queued or running)
        self.pending: deque[Job] = deque()  # jobs waiting for an actor, in order
        self.next_attempt: dict[Job, int] = {}
        self.cause: dict[Job, AttemptCause] = {}  # why a job's next attempt exists
        self.killed: dict[Job, Incarnation] = {}  # the process of a job's last attempt, killed by the driver
        self.state: dict[Job, JobState] = dict.fromkeys(self.jobs, JobState.PENDING)  # by the state machine
        self.outcome: dict[Job, JobState] = {}  # the jobs that ended, and how
        self.bad_input: dict[Job, Lost] = {}
        self.seen: dict[Job, JobView] = {j: JobView() for j in self.jobs}  # what `soma status` shows of each job
        self._ids = itertools.count()

    @property
    def spent_total(self) -> float:
        """GPU-seconds of the whole campaign so far, every category."""
        return self.books.spent_total

    @property
    def stopped(self) -> InfraStop | None:
        """Set once: the campaign stops for its environment."""
        return self.retries.stopped

    @property
    def finished(self) -> bool:
        return not (self.pending or self.units or self.retries.at)

    def left(self, job: Job, share: int | None = None) -> float | None:
        """GPU-seconds the job may still spend, the tighter of its GPU-hour and dollar caps; the campaign's remainder
        is shared among the open jobs (`share`: among that many)."""
        if share is None:
            share = max(1, len(self.open) + (0 if job in self.open else 1))
        spent = self.books.totals.per_expert_gpu_seconds.get(job.expert, 0.0) if job.expert is not None else 0.0
        totals = self.books.totals
        caps = [
            self.book.left(job.expert, spent, self.spent_total, share),
            self.book.left_usd(
                totals.per_expert_usd.get(job.expert, 0.0) if job.expert is not None else 0.0,
                sum(totals.usd.values()),
                usd_per_hour(self.cfg.prices, self.open[job].accounts[job].device if job in self.open else None),
                share,
            ),
        ]
        caps = [c for c in caps if c is not None]
        return min(caps) if caps else None

    def status(self, job: Job, on_gpu: set[int] | None = None) -> JobStatus:
        """What `soma status` shows of the job now (soma_cluster/snapshot.py); `on_gpu`: self.on_gpu(), where the
        caller asks for many jobs at once."""
        state = self.state.get(job, JobState.PENDING)
        unit = self.open.get(job)
        running = unit is not None and unit.phase == JobState.RUNNING
        return JobStatus(
            state=state,
            view=self.seen.get(job, JobView()),
            spent_s=self.books.spent(job),
            left_s=None if state in TERMINAL else self.left(job),
            retries=self.retries.failures.get(job, 0),
            beat_age_s=self.clock() - unit.last_beat if running else None,
            starting=unit is not None and not running and unit.id in (self.on_gpu() if on_gpu is None else on_gpu),
        )

    def on_gpu(self) -> set[int]:
        """The units whose actor holds its GPU share now, as far as the driver can tell: running ones; starting ones
        (granted at the request, reused, or placed: on_placed); and, while the GPUs present (`room` at the last
        requests) have shares that those do not hold, the oldest still waiting in Ray's queue. Ray places its queue
        as shares free, and a placed actor's process starts (1 to 20 s on a loaded host) before its first
        instruction can tell the driver; without this, 0 to 3 of 4 GPUs' experts counted as running."""
        known = {u.id for u in self.units.values() if u.phase == JobState.RUNNING or u.held_since is not None}
        waiting = sorted(uid for uid in self.units if uid not in known)
        return known | set(waiting[: max(0, self.room - len(known))])

    def revise(self, cfg: CampaignConfig, reopen: list[Job]) -> None:
        """A config revision in force from now on (soma set): the budgets, retries and concurrency of every decision
        after this one, caps included, which reach each worker with its next chunk. Budget granted from the pool
        stays granted. The ended jobs in `reopen` are pending again, from their latest checkpoint."""
        self.cfg = cfg
        granted = self.book.granted
        self.book = BudgetBook(cfg.budget, granted=granted)
        self.retries.cfg = cfg.retry
        for job in reopen:
            was = self.outcome.pop(job, None)
            self._event(Event.REOPENED, job, step=self.seen[job].step, was=was, reason=EXTENDED)
            self.cause[job] = AttemptCause.EXTENDED
            self.pending.append(job)

    def restore(self, past: dict[str, JobHistory]) -> None:
        """Rebuild from the campaign directory after a driver loss (soma_cluster/restore.py)."""
        was = restore(self.jobs, self.books, past)
        for e, s in was.granted:
            self.book.granted[e] = self.book.granted.get(e, 0.0) + s
        self.seen.update(was.seen)
        self.state.update(was.state)
        self.outcome.update(was.outcome)
        self.pending.extend(was.pending)
        self.next_attempt.update(was.next_attempt)
        self.retries.failures.update(was.failures)
        self.cause.update(was.cause)

    def _event(self, event: Event, job: Job, **fields) -> None:
        """Write the event, and move the job by the state machine."""
        rec = emit(self.store, event, job.name, **fields)
        if self.observe is not None:
            self.observe(rec)
        self.state[job] = advance(self.state.get(job, JobState.PENDING), event, fields.get("cause"))

    # -- starting actors ------------------------------------------------------------------------------
    def _pack(self, first: Job) -> int:
        return 1 if first.expert is None else self.cfg.resources.experts_per_actor

    def _take(self) -> list[Job]:
        g = self._pack(self.pending[0])
        return [self.pending.popleft() for _ in range(min(g, len(self.pending)))]

    def requests(self, capacity: float, room: int = 0) -> list[Action]:
        """Actors to ask Ray for now: due retries first, then pending jobs (up to experts_per_actor per actor),
        while fewer than `capacity` actors are queued or running. The first `room` of those fit in the GPUs
        present (Ray grants them at once); the others wait in Ray's queue, where an autoscaler sees them.
        Once the campaign is `stopped`: none, and every actor still queued or running is stopped."""
        if self.stopped is not None:
            return self._halt()
        self.room = room
        out: list[Action] = []
        while len(self.units) < capacity:
            group = self.retries.due(self._pack) or (self._take() if self.pending else [])
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
            self._finish(job, JobState.BUDGET_EXHAUSTED, note=why)
            jobs = [j for j in jobs if j != job]
        if not jobs:
            return None
        accounts = {}
        for job in jobs:
            n = self.next_attempt.get(job, 0)
            self.next_attempt[job] = n + 1
            accounts[job] = Account(job, n, self.cause.get(job, AttemptCause.NEW))
        previous = tuple(self.killed.pop(j) for j in jobs if j in self.killed)
        unit = Unit(next(self._ids), accounts, self.clock(), reused_from, previous)
        unit.held_since = unit.requested if reused_from is not None else None  # an idle actor holds its share already
        if reused_from is None:  # a new actor: placed by Ray, which can keep it off a node that failed the store
            unit.avoid = self.avoid.nodes()
        self.units[unit.id] = unit
        for c in accounts.values():
            self.open[c.job] = unit
            if c.cause == AttemptCause.RETRY:
                self._event(Event.RETRIED, c.job, attempt=c.attempt)
            self._event(
                Event.QUEUED,
                c.job,
                attempt=c.attempt,
                num_gpus=self.cfg.resources.num_gpus / len(jobs),
                actor=unit.name,
                reused=reused_from is not None,
                cause=c.cause,
                **({"avoid": sorted(unit.avoid)} if unit.avoid else {}),
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
        alone = self.left(job, share=1)
        need = self.books.start_cost.need_s(min(self.cfg.train.chunk_updates, self.cfg.train.updates))
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
            # the worker compares its own cumulative clock, start-up included: the cap is set on that clock once
            c.cap_s = None if left is None else left + c.reported.gpu_seconds
            caps[c.job.expert] = c.cap_s
        unit.last_beat = self.clock()
        targets = {c.job.expert: self.target(c.job) for c in unit.live()}
        return Chunk(unit, self.cfg.train.chunk_updates, caps, targets)

    def target(self, job: Job) -> int:
        """The updates a job trains to under the config in force (train.updates may grow: soma set)."""
        return self.cfg.seed_stage.updates if job.expert is None else self.cfg.train.updates

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
        unit.phase, unit.process, unit.last_beat = JobState.RUNNING, report.process, self.clock()
        self.avoid.reached(report.process.node)  # its set-up read the store from there
        for expert, start in report.experts.items():
            c = unit.accounts[Job(expert)]
            c.started, c.step, c.setup, c.reported, c.device = True, start.step, start.usage, start.usage, report.device
            view = self.seen.setdefault(c.job, JobView())
            view.step, view.node, view.device = start.step, report.node_ip or report.process.node, report.device
            self._event(
                Event.LAUNCHED,
                c.job,
                t=report.held_from,
                attempt=c.attempt,
                actor=unit.name,
                reused=unit.reused_from is not None,
                num_gpus=self.cfg.resources.num_gpus / len(unit.accounts),
                device=report.device,
            )
            self._event(
                Event.STARTED,
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
            after = "" if c.cause == AttemptCause.NEW else f" (after {c.cause})"
            self.books.startup(c, start.usage, "start-up: process, imports, data and model" + after)
            self.books.resettle(c.job, start.step, start.kept_by, start.kept)
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
        view.step, view.loss = hb.step, hb.loss
        if hb.val is not None:
            view.val = hb.val
        self.books.record(c.job.category, hb.usage - c.reported, c, c.seq)
        self.books.start_cost.observe_updates(hb.usage.gpu_seconds - c.reported.gpu_seconds, hb.updates)
        c.reported = hb.usage
        if hb.val is not None:
            c.improving = hb.best_val is not None and hb.val <= hb.best_val
        self._event(
            Event.HEARTBEAT,
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
            self._event(Event.CHECKPOINTED, c.job, attempt=c.attempt, step=hb.checkpoint_step, checkpoint=hb.checkpoint)
            self.retries.recovered(c.job)
            self.avoid.reached(unit.process.node if unit.process is not None else None)
        if not hb.done:
            return
        self._end(c)
        if hb.failed:
            self._lose(c, Lost(LostAs.EXCEPTION, hb.error, error_cause(hb.error)))
        elif hb.reason == StopReason.PREEMPTED:
            unit.leaving = True
            self._lose(c, Lost(LostAs.PREEMPTED, "the worker got SIGTERM and checkpointed", Cause.PREEMPTED))
        else:
            self._finish(c.job, JobState(hb.reason), attempt=c.attempt, step=hb.step, val=hb.best_val)

    def on_lost(self, uid: int, lost: Lost, stop: tuple[Job, ...] = ()) -> list[Action]:
        """The unit's actor is gone (or must be killed now): each job it was training settles what was lost
        and is retried from its latest checkpoint; jobs in `stop` end budget_exhausted instead (hard-stopped
        past their budget). A queued unit held nothing, so there is nothing to settle."""
        unit = self.units.pop(uid)
        live = unit.live()
        node = lost.node or (unit.process.node if unit.process is not None else None)
        # a node that could not reach the store is avoided for a while, and named in the `failed` event
        lost = replace(lost, node=node if self.avoid.lost(node, lost.cause) else None)
        share = self.cfg.resources.num_gpus / max(1, len(live))
        held = max(0.0, self.clock() - unit.last_beat) if unit.phase == JobState.RUNNING else 0.0
        unreported = Usage(held * share, held * share / self.cfg.resources.num_gpus)
        for c in live:
            self._end(c)
            mine = lost if len(live) == 1 else replace(lost, detail=f"{lost.detail} (in pack {unit.name})")
            self._lose(c, mine, unreported, JobState.BUDGET_EXHAUSTED if c.job in stop else None)
            if unit.process is not None and lost.kind != LossKind.PREEMPTED:
                self.killed[c.job] = unit.process
        return [Stop(unit)]

    def _end(self, c: Account) -> None:
        c.ended = True
        self.open.pop(c.job, None)

    # -- ends -----------------------------------------------------------------------------------------
    def _lose(self, c: Account, lost: Lost, unreported: Usage = NOTHING, end: JobState | None = None) -> None:
        """Settle an attempt that ended without finishing, then retry, reschedule or end its job."""
        settled = {}
        if c.started:
            lost_to = Category.PREEMPTED if lost.kind == LossKind.PREEMPTED else Category.WASTED
            s = Settlement(
                attempt=c.attempt,
                setup=c.setup,
                training=c.reported - c.setup,
                kept=self.books.kept(c),
                unreported=unreported,
                lost_to=lost_to,
                device=c.device,
            )
            self.books.settle(c, s, lost.reason)
            settled = {"settled": s.to_json()}
        if lost.kind == LossKind.PREEMPTED:
            self._event(Event.PREEMPTED, c.job, attempt=c.attempt, step=c.step, reason=lost.reason, **settled)
            self.cause[c.job] = AttemptCause.PREEMPTED
            self.pending.appendleft(c.job)  # not a failure: no retry spent, no backoff
            return
        infra = lost.kind == LossKind.INFRA and end is None
        retry_left = infra or self.retries.count(c.job)
        self.seen.setdefault(c.job, JobView()).last_error = lost.reason
        self._event(
            Event.FAILED,
            c.job,
            attempt=c.attempt,
            step=c.step,
            reason=lost.reason,
            **settled,
            **({"cause": lost.cause} if lost.cause else {}),
            **({"counted": False} if infra else {}),
            **({"node": lost.node} if lost.node else {}),
            **({"traceback": lost.traceback} if lost.traceback else {}),
        )
        if infra:
            self._wait_out(c.job, lost)
        elif end is not None or lost.kind == LossKind.BAD_INPUT:
            if lost.kind == LossKind.BAD_INPUT:
                self.bad_input[c.job] = lost
            self._finish(c.job, end or JobState.FAILED_PERMANENTLY, attempt=c.attempt, step=c.step, reason=lost.reason)
        elif not retry_left:
            self._finish(c.job, JobState.FAILED_PERMANENTLY, attempt=c.attempt, step=c.step, reason=lost.reason)
        else:
            delay = self.retries.back_off(c.job)
            self.cause[c.job] = AttemptCause.RETRY
            self._event(Event.RETRY_SCHEDULED, c.job, attempt=self.next_attempt[c.job], delay_s=delay)

    def _wait_out(self, job: Job, lost: Lost) -> None:
        """An infrastructure failure: retried after a backoff, uncounted, until the campaign stops for it
        (soma_cluster/retries.py); then the job waits as its next attempt's cause says, for `soma resume`."""
        cause = lost.cause or Cause.NODE_LOST
        waited = self.retries.wait_out(job, cause, lost.detail if lost.what == cause else lost.reason)
        if waited is None:  # it stays where its `failed` event left it (retrying) until `soma resume`
            return
        delay, waited_s = waited
        self.cause[job] = AttemptCause.RETRY
        self._event(
            Event.RETRY_SCHEDULED,
            job,
            attempt=self.next_attempt[job],
            delay_s=delay,
            cause=lost.cause,
            counted=False,
            waited_s=waited_s,
        )

    def _halt(self) -> list[Action]:
        """The campaign stops for its environment: every attempt still open ends as preempted (settled against its
        checkpoint, first in line at `soma resume`, no retry spent), nothing more is started."""
        out: list[Action] = []
        why = f"the campaign stopped for its environment ({self.stopped.cause})"
        for unit in list(self.units.values()):
            out += self.on_lost(unit.id, Lost(LostAs.STOPPED, why, Cause.PREEMPTED))
        self.pending.clear()
        self.retries.at.clear()
        return out

    def _finish(self, job: Job, end: JobState, **fields) -> None:
        self.outcome[job] = end
        self._event(Event(end), job, **fields)
        if job.expert is not None and end != JobState.FINISHED:
            self._release(job)

    def _release(self, job: Job) -> None:
        """An expert that ended early returns its unspent budget to the pool (budget.pool_policy)."""
        candidates = {
            u.accounts[j].job.expert: u.accounts[j].improving for j, u in self.open.items() if j.expert is not None
        }
        candidates |= {
            j.expert: True for j in self.jobs if j.expert is not None and j not in self.outcome and j not in self.open
        }
        spent = self.books.totals.per_expert_gpu_seconds.get(job.expert, 0.0)
        for expert, s in self.book.release(job.expert, spent, candidates).items():
            self._event(Event.BUDGET_GRANTED, Job(expert), expert=expert, gpu_seconds=s, source=job.name)

    # -- hangs and budgets ----------------------------------------------------------------------------
    def watchdog(self) -> list[Action]:
        """A running actor silent past retry.heartbeat_timeout_s has hung; one past a job's cap plus the grace
        is hard-stopped, in its start-up too; a queued one whose jobs the budget can no longer cover is cancelled."""
        now, out = self.clock(), []
        for unit in list(self.units.values()):
            if unit.phase == JobState.QUEUED:
                if self.book.budgeted and all(
                    (left := self.left(c.job)) is not None and left <= 0 for c in unit.live()
                ):
                    out += self._cancel(unit)
                elif self.book.budgeted and unit.held_since is not None:
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
                out += self.on_lost(unit.id, Lost(LostAs.HANG, f"no heartbeat for {silent:.0f} s", Cause.HANG))
            elif over:
                out += self.on_lost(unit.id, Lost(LostAs.BUDGET_EXHAUSTED, "hard stop past the grace"), stop=over)
        return out

    def on_placed(self, uid: int, held_for_s: float) -> None:
        """Ray placed a unit that waited in its queue: its actor has held its GPU share for held_for_s seconds
        (its own clock), so from now on its start-up counts against its budget."""
        unit = self.units.get(uid)
        if unit is not None and unit.phase == JobState.QUEUED and unit.held_since is None:
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
            self.books.startup(c, usage, "start-up, hard-stopped by the driver before it reported (the driver's clock)")
        why = f"hard stop past the grace during start-up ({held:.1f} s held)"
        return self.on_lost(unit.id, Lost(LostAs.BUDGET_EXHAUSTED, why), stop=over)

    def _cancel(self, unit: Unit) -> list[Action]:
        """A queued actor whose jobs the budget can no longer cover is withdrawn before it holds a GPU."""
        self.units.pop(unit.id)
        for c in unit.live():
            self._end(c)
            self._finish(c.job, JobState.BUDGET_EXHAUSTED, note="cancelled while queued: the budget cannot cover it")
        return [Stop(unit)]
