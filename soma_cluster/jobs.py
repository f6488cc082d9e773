"""The vocabulary of a job's life, named once: what a job is, the states it goes through, the events the
campaign writes about it, the ledger categories its GPU-seconds fall in, why an attempt of it was lost and why
a worker stopped training it. No Ray, no storage here.

Every name is a `StrEnum` whose value is the string the campaign directory has always held (events.jsonl,
ledger/ledger.jsonl, status.json), so a campaign written before these types existed loads unchanged.

One state machine (`advance`) says where a job stands after each event: the scheduler applies it as it writes
each event, and `soma status` folds a job's events log through it when no driver is running.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Category(StrEnum):
    """A ledger category: GPU-seconds of different kinds stay apart (soma_cluster/ledger.py)."""

    PREPROCESSING = "preprocessing"
    SEED = "seed"
    EXPERT_TRAINING = "expert_training"
    WASTED = "wasted"  # work lost to failures, and the start-up of the retries they cause
    PREEMPTED = "preempted"  # the same for preemptions: no fault of the campaign
    EVALUATION = "evaluation"


CATEGORIES = tuple(Category)
# what counts against an expert's own budget: all GPU time spent on it, whatever became of the work
EXPERT_SPEND = (Category.EXPERT_TRAINING, Category.WASTED, Category.PREEMPTED)


class Event(StrEnum):
    """The `event` of a record in events.jsonl (soma_cluster/events.py)."""

    QUEUED = "queued"  # an attempt was asked of Ray
    LAUNCHED = "launched"  # its process holds its GPU share
    STARTED = "started"  # it loaded its job
    HEARTBEAT = "heartbeat"
    CHECKPOINTED = "checkpointed"
    BUDGET_GRANTED = "budget_granted"  # an expert got budget from the pool
    RETRIED = "retried"  # a failed job's retry is being queued
    RETRY_SCHEDULED = "retry_scheduled"  # a failed job waits out its backoff
    FAILED = "failed"  # an attempt was lost
    PREEMPTED = "preempted"  # an attempt was lost to a preemption (not a failure)
    FINISHED = "finished"
    CONVERGED = "converged"
    BUDGET_EXHAUSTED = "budget_exhausted"
    FAILED_PERMANENTLY = "failed_permanently"
    REOPENED = "reopened"  # an ended job is pending again (pipelines/reopen.py)
    FORKED = "forked"  # the campaign was forked from a parent (job "campaign")
    CONFIG_REVISED = "config_revised"  # a driver applied a config revision (job "campaign"; soma_cluster/revisions.py)


class JobState(StrEnum):
    """Where a job stands (status.json's `state`)."""

    PENDING = "pending"  # no driver has asked Ray for it yet
    QUEUED = "queued"  # asked of Ray, waiting for a GPU share
    RUNNING = "running"
    RETRYING = "retrying"  # failed: waiting out its backoff, or queued again
    PREEMPTED = "preempted"  # its node was reclaimed: rescheduled without spending a retry
    INTERRUPTED = "interrupted"  # in flight when its driver stopped (a signal): nothing runs it until `soma resume`
    FINISHED = "finished"
    CONVERGED = "converged"
    BUDGET_EXHAUSTED = "budget_exhausted"
    FAILED_PERMANENTLY = "failed_permanently"


TERMINAL = (JobState.FINISHED, JobState.CONVERGED, JobState.BUDGET_EXHAUSTED, JobState.FAILED_PERMANENTLY)
STATES = tuple(JobState)
IN_FLIGHT = (JobState.QUEUED, JobState.RUNNING, JobState.RETRYING, JobState.PREEMPTED)
# events that report progress or bookkeeping without changing where a job stands
PROGRESS = (Event.HEARTBEAT, Event.CHECKPOINTED, Event.BUDGET_GRANTED)
ENDS = tuple(Event(s) for s in TERMINAL)  # the events that end a job
ATTEMPT_ENDS = (Event.FAILED, Event.PREEMPTED) + ENDS
ENDED_WITH_CHECKPOINT = (Event.FINISHED, Event.CONVERGED)  # a job that ended so wrote its final checkpoint


class AttemptCause(StrEnum):
    """Why an attempt exists (the `cause` of its `queued` event), and so where its actor's start-up is billed: a
    job's first start is part of its cost; a start that only happens because an earlier attempt was lost is that
    loss's cost."""

    NEW = "new"
    RETRY = "retry"  # after a failure
    RESUMED = "resumed"  # after its driver was lost, or its checkpoint
    PREEMPTED = "preempted"  # after a preemption
    EXTENDED = "extended"  # an ended job given more to train (soma set, soma resume --retrain), from a checkpoint

    @property
    def startup_category(self) -> Category | None:
        """The ledger category of its start-up; None: the job's own (its useful work's category): a first start,
        or one to train further after an extension, which no loss caused."""
        own = (AttemptCause.NEW, AttemptCause.EXTENDED)
        return None if self in own else {AttemptCause.PREEMPTED: Category.PREEMPTED}.get(self, Category.WASTED)

    @property
    def waiting(self) -> JobState:
        """Where a job stands while this attempt waits to be asked of Ray: a retry or a preempted job's next
        attempt says so (in Ray's queue too), any other is pending."""
        return _WAITING.get(self, JobState.PENDING)


_WAITING = {AttemptCause.RETRY: JobState.RETRYING, AttemptCause.PREEMPTED: JobState.PREEMPTED}


class LossKind(StrEnum):
    """What a lost attempt means for its job (its Cause says whose failure it was)."""

    FAILURE = "failure"  # the expert's own: retried with backoff, counted against retry.max_retries
    BAD_INPUT = "bad_input"  # no retry can fix it: the job ends failed_permanently at once
    PREEMPTED = "preempted"  # not a failure: rescheduled first, nothing counted
    INFRA = "infra"  # the infrastructure's: retried with backoff, uncounted, for retry.infra_wait_s


class Cause(StrEnum):
    """Why an attempt was lost (the `cause` field of its `failed` event; soma_cluster/failures.py tells them)."""

    # the expert's own: counted against retry.max_retries
    EXCEPTION = "exception"  # its code raised
    NON_FINITE = "non_finite_loss"
    CRASH = "crash"  # its process died, its node did not (SIGKILL, kernel OOM kill, segfault)
    HANG = "hang"  # no heartbeat within retry.heartbeat_timeout_s
    BAD_INPUT = "bad_input"  # corrupt shard or checkpoint, no CUDA device: ends the job at once
    # the infrastructure's: waited out for at most retry.infra_wait_s, never counted
    DISK_FULL = "disk_full"
    NO_INODES = "no_inodes"  # ENOSPC on a filesystem with bytes free: its file count is at its limit
    READ_ONLY = "read_only"
    PERMISSION = "permission"
    STORAGE_UNREACHABLE = "storage_unreachable"
    NODE_LOST = "node_lost"
    OUT_OF_MEMORY = "out_of_memory"
    # no one's failure: its node was reclaimed or drained, or the campaign stopped for its environment
    PREEMPTED = "preempted"

    @property
    def infra(self) -> bool:
        return self in INFRA

    @property
    def kind(self) -> LossKind:
        if self is Cause.PREEMPTED:
            return LossKind.PREEMPTED
        if self is Cause.BAD_INPUT:
            return LossKind.BAD_INPUT
        return LossKind.INFRA if self.infra else LossKind.FAILURE


INFRA = frozenset(
    {
        Cause.DISK_FULL,
        Cause.NO_INODES,
        Cause.READ_ONLY,
        Cause.PERMISSION,
        Cause.STORAGE_UNREACHABLE,
        Cause.NODE_LOST,
        Cause.OUT_OF_MEMORY,
    }
)


class StopReason(StrEnum):
    """Why a worker stopped training a job cleanly (a heartbeat's `reason`). A job that fails alone inside its pack
    has no StopReason: its heartbeat carries the error instead (Heartbeat.error, Heartbeat.failed)."""

    FINISHED = "finished"
    CONVERGED = "converged"
    BUDGET_EXHAUSTED = "budget_exhausted"
    PREEMPTED = "preempted"


class LostAs(StrEnum):
    """How an actor's attempt was lost, as the driver saw it: the first word of its reason (`what: detail` in its
    events; schedule.Lost). An infrastructure's loss is named by its Cause."""

    EXCEPTION = "exception"  # the worker's code raised
    ACTOR_DIED = "actor_died"  # its process died, its node did not
    HANG = "hang"  # no heartbeat, or its result not retrievable
    STOPPED = "stopped"  # the campaign stopped for its environment
    PREEMPTED = "preempted"  # its node was drained or reclaimed
    BUDGET_EXHAUSTED = "budget_exhausted"  # the driver's hard stop past the grace
    DISK_FULL = "disk_full"
    NO_INODES = "no_inodes"
    READ_ONLY = "read_only"
    PERMISSION = "permission"
    STORAGE_UNREACHABLE = "storage_unreachable"
    NODE_LOST = "node_lost"
    OUT_OF_MEMORY = "out_of_memory"


# -- the state machine -----------------------------------------------------------------------------------------
_AFTER = {
    Event.LAUNCHED: JobState.RUNNING,
    Event.STARTED: JobState.RUNNING,
    Event.RETRIED: JobState.RETRYING,
    Event.RETRY_SCHEDULED: JobState.RETRYING,
    Event.FAILED: JobState.RETRYING,  # a failed attempt is retried, unless an end follows it
    Event.PREEMPTED: JobState.PREEMPTED,
    Event.REOPENED: JobState.PENDING,
    **{e: JobState(e) for e in ENDS},
}


def advance(state: JobState, event: str, cause: str | None = None) -> JobState:
    """Where a job stands after `event`; `cause`: a `queued` event's AttemptCause (a retry queued again is still
    retrying). Events that change nothing (progress, bookkeeping, unknown ones) leave it where it was."""
    if event == Event.QUEUED:
        return _WAITING.get(cause, JobState.QUEUED)
    return _AFTER.get(event, state)


def replay(events: list[dict]) -> JobState:
    """Where a job stands after its events, in log order (the state machine folded over them)."""
    state = JobState.PENDING
    for ev in events:
        state = advance(state, ev["event"], ev.get("cause"))
    return state


# -- what a job is ---------------------------------------------------------------------------------------------
def expert_name(expert: int) -> str:
    return f"expert-{int(expert):04d}"


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
    def category(self) -> Category:
        """Ledger category of its useful work."""
        return Category.SEED if self.expert is None else Category.EXPERT_TRAINING

    @property
    def model_dir(self) -> str:
        return "seed" if self.expert is None else f"experts/{self.name}"


SEED_JOB = Job(None)


def expert_jobs(n_experts: int) -> list[Job]:
    """The campaign's experts (its n_experts), in order."""
    return [Job(e) for e in range(n_experts)]


@dataclass
class JobView:
    """What the driver last heard of a job, for `soma status` (not used in any decision)."""

    step: int = 0
    val: float | None = None  # latest expert-validation loss, nats/byte
    node: str | None = None
    device: str | None = None
    last_error: str | None = None
    loss: float | None = None  # latest training loss (its last chunk's mean), nats/byte


@dataclass(frozen=True, kw_only=True)
class JobStatus:
    """One job as `soma status` shows it: from a running scheduler, or from the events log and ledger."""

    state: JobState
    view: JobView
    spent_s: float  # GPU-seconds billed to it
    left_s: float | None = None  # GPU-seconds it may still spend (None: no budget, or it ended)
    retries: int = 0  # failures counted against retry.max_retries
    beat_age_s: float | None = None  # seconds since a running job's last report
    starting: bool = False  # queued, but its actor holds its GPU share and is starting up (it takes a GPU)
