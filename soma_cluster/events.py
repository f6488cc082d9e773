"""The campaign's state transitions, written to `<campaign>/events.jsonl` as they happen.

Driver state is never only in memory: `soma resume` and `soma status` rebuild it from this log.
An attempt is one actor's try at a job: `queued` (asked of Ray), `launched` (its process holds its GPU
share; the event's time is that moment), `started`, heartbeats and checkpoints, then one end:
`failed`, `preempted`, or the job's end (`finished`, `converged`, `budget_exhausted`,
`failed_permanently`).

A `failed` event with `counted: false` was the infrastructure's failure (soma_cluster/failures.py): it is a lost
attempt like any other, but not one of the job's retries. A `reopened` event makes an ended job pending again:
after its checkpoint was lost (the attempt's end is void: it is settled again against the one kept), or, with
reason `retry_failed` (`soma resume --retry-failed`), a job that failed permanently gets its retries back.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from soma_cluster.errors import SomaError
from soma_cluster.jobs import ATTEMPT_ENDS, PROGRESS, SEED_JOB, TERMINAL, Event, JobState, JobView, advance
from soma_cluster.storage import Store

LOG = "events.jsonl"
RETRY_FAILED = "retry_failed"  # the reason of a `reopened` event written by --retry-failed
EXTENDED = "extended"  # the reason of a `reopened` event written because a config revision let the job train on
RETRAIN = "retrain"  # the reason of a `reopened` event written by soma resume --retrain
TRAIN_ON = (RETRY_FAILED, EXTENDED, RETRAIN)  # reopened to train more, not because a checkpoint was lost


def emit(store: Store, event: Event, job: str, **fields) -> dict:
    """Append the event; returns its record (what an observer, e.g. the experiment tracker, is handed)."""
    rec = {"event": event, "job": job, "t": time.time(), **fields}
    store.append(LOG, rec)
    return rec


@dataclass
class JobHistory:
    job: str
    state: JobState = JobState.PENDING  # where the job stands: the state machine (soma_cluster/jobs.py) folded
    # over its events, as the scheduler and `soma status` see it
    last_event: str | None = None  # the last event that was not progress (an Event's value; None: none yet)
    attempts: int = 0  # attempts begun (queued or launched), i.e. the next attempt's number
    failures: int = 0  # failed attempts counted against max_retries since the job was last given its
    # retries back (preemptions, driver losses, the infrastructure's failures are not)
    step: int = 0
    val: float | None = None
    loss: float | None = None  # the latest heartbeat's training loss
    last_error: str | None = None
    events: list[dict] = field(default_factory=list)

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    def view(self) -> JobView:
        """Its status view rebuilt from its events (after a driver loss, or for a campaign without status.json)."""
        started = [ev for ev in self.events if ev["event"] == Event.STARTED]
        last = started[-1] if started else {}
        return JobView(
            self.step,
            self.val,
            last.get("node_ip") or last.get("node"),
            last.get("device"),
            self.last_error,
            self.loss,
        )

    def of_attempt(self, attempt: int) -> list[dict]:
        return [ev for ev in self.events if ev.get("attempt") == attempt]

    def ended(self, attempt: int) -> str | None:
        """How `attempt` ended (failed, preempted, or a terminal state), or None if the log never says or a
        later `reopened` voided its end (its last checkpoint was lost: as if interrupted at the one kept). A job
        reopened to train on (--retry-failed, or an extension: soma set) keeps its attempts' ends."""
        end = None
        for ev in self.events:
            if ev["event"] == Event.REOPENED and ev.get("reason") not in TRAIN_ON:
                end = None
            elif ev.get("attempt") == attempt and ev["event"] in ATTEMPT_ENDS:
                end = ev["event"]
        return end

    def held(self, attempt: int) -> bool:
        """Whether `attempt`'s actor ever held its GPU (queued attempts that never started did not)."""
        return any(ev["event"] in (Event.LAUNCHED, Event.STARTED) for ev in self.of_attempt(attempt))


def history(store: Store) -> dict[str, JobHistory]:
    out: dict[str, JobHistory] = {}
    for ev in store.read_log(LOG):
        h = out.setdefault(ev["job"], JobHistory(ev["job"]))
        h.events.append(ev)
        if ev["event"] in (Event.QUEUED, Event.LAUNCHED) and ev.get("attempt") is not None:
            h.attempts = max(h.attempts, ev["attempt"] + 1)
        h.state = advance(h.state, ev["event"], ev.get("cause"))
        if ev["event"] not in PROGRESS:
            h.last_event = ev["event"]
        h.step = ev.get("step", h.step) or h.step
        if ev.get("val") is not None:
            h.val = ev["val"]
        if ev["event"] == Event.HEARTBEAT and ev.get("loss") is not None:
            h.loss = ev["loss"]
        if ev["event"] == Event.FAILED:
            h.failures += 1 if ev.get("counted", True) else 0
            h.last_error = ev.get("reason")
        if ev["event"] == Event.REOPENED and ev.get("reason") in (RETRY_FAILED, RETRAIN):
            h.failures = 0
    return out


def seed_done(store: Store) -> bool:
    h = history(store).get(SEED_JOB.name)
    return bool(h and h.state == JobState.FINISHED)


def require_seed(store: Store) -> None:
    if not seed_done(store):
        raise SomaError(f"{store.url} has no finished seed model; run soma seed {store.url} first")
