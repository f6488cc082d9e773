"""A new driver picks up a campaign whose driver was lost: the scheduler's state rebuilt from the campaign
directory alone (events log, ledger, checkpoints). No Ray here.

Ended jobs stay ended, budget grants are replayed, failures counted, and an attempt the lost driver left running
is settled against its job's latest checkpoint, as a lost attempt would have been (soma_cluster/accounting.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from soma_cluster.accounting import SETUP_SEQ, Account, Books, Settlement
from soma_cluster.events import EXTENDED, RETRAIN, JobHistory
from soma_cluster.jobs import AttemptCause, Category, Event, Job, JobState, JobView
from soma_cluster.messages import Usage


@dataclass
class Restored:
    """What the jobs' histories say, for a new Scheduler to take up (Scheduler.restore): each field is the
    Scheduler's own of that name, holding only the jobs the histories speak of."""

    granted: list[tuple[int | None, float]] = field(default_factory=list)  # (expert, GPU-s) from the pool, in order
    seen: dict[Job, JobView] = field(default_factory=dict)
    state: dict[Job, JobState] = field(default_factory=dict)  # by the same state machine the scheduler runs
    outcome: dict[Job, JobState] = field(default_factory=dict)
    pending: list[Job] = field(default_factory=list)
    next_attempt: dict[Job, int] = field(default_factory=dict)
    failures: dict[Job, int] = field(default_factory=dict)
    cause: dict[Job, AttemptCause] = field(default_factory=dict)


def restore(jobs: list[Job], books: Books, past: dict[str, JobHistory]) -> Restored:
    """The state of a new scheduler of `jobs`, from the jobs' histories. An attempt the lost driver left running
    is settled in `books` (the new scheduler's), as the scheduler settles a lost one."""
    out = Restored()
    by_name = {j.name: j for j in jobs}
    for h in past.values():
        for ev in h.events:
            if ev["event"] == Event.BUDGET_GRANTED and h.job in by_name:
                out.granted.append((by_name[h.job].expert, ev["gpu_seconds"]))
    records = None
    for job in jobs:
        h = past.get(job.name)
        if h:
            out.seen[job] = h.view()
            out.state[job] = h.state  # where its events left it
        if h and h.terminal:
            out.outcome[job] = h.state
            continue
        out.pending.append(job)
        if not h or not h.attempts:
            continue
        out.next_attempt[job], out.failures[job] = h.attempts, h.failures
        out.cause[job] = cause_after(h)
        last = h.attempts - 1
        if h.held(last) and h.ended(last) is None:
            records = books.ledger.records() if records is None else records  # read once, not once per job
            _settle_interrupted(books, job, last, records)
        else:
            # its last attempt that held a GPU ended lost and the next has not reported in: finish that on setup
            ends = [ev for ev in h.events if ev["event"] in (Event.FAILED, Event.PREEMPTED) and "settled" in ev]
            if ends and ends[-1]["attempt"] == max(a for a in range(h.attempts) if h.held(a)):
                books.settled[job] = Settlement.from_json(ends[-1]["settled"])
    return out


def cause_after(h: JobHistory) -> AttemptCause:
    """Why the job's next attempt exists, from how its latest attempt that held a GPU ended (or an extension that
    reopened it since: soma set)."""
    for ev in reversed(h.events):  # reopened to train on, and no attempt has held a GPU since
        if ev["event"] == Event.LAUNCHED:
            break
        if ev["event"] == Event.REOPENED and ev.get("reason") in (EXTENDED, RETRAIN):
            return AttemptCause.EXTENDED
    after = {Event.FAILED: AttemptCause.RETRY, Event.PREEMPTED: AttemptCause.PREEMPTED, None: AttemptCause.RESUMED}
    for attempt in range(h.attempts - 1, -1, -1):
        if h.held(attempt):
            return after.get(h.ended(attempt), AttemptCause.RETRY)
    return AttemptCause.NEW


def _settle_interrupted(books: Books, job: Job, attempt: int, records: list[dict]) -> None:
    """The lost driver left `attempt` running: settle what it reported against the latest checkpoint."""
    # the seed's records share expert None and attempt 0 with preprocessing's and evaluation's: its own
    # categories tell them apart
    own = (job.category, Category.WASTED, Category.PREEMPTED)
    mine = [r for r in records if r["expert"] == job.expert and r["attempt"] == attempt and r["category"] in own]
    setup = sum((Usage.from_record(r) for r in mine if r["seq"] == SETUP_SEQ), Usage())
    training = sum((Usage.from_record(r) for r in mine if r["seq"] > 0 and r["category"] == job.category), Usage())
    device = next((r.get("device") for r in mine if r.get("device")), None)
    if any(r["seq"] < 0 for r in mine):  # settled by an earlier resume (that driver was lost too)
        fixes = sum((Usage.from_record(r) for r in mine if r["seq"] < 0 and r["category"] == job.category), Usage())
        books.settled[job] = Settlement(
            attempt=attempt,
            setup=setup,
            training=training,
            kept=training + fixes,
            unreported=Usage(),
            lost_to=Category.WASTED,
            device=device,
        )
        return
    c = Account(
        job,
        attempt,
        AttemptCause.RESUMED,
        started=True,
        setup=setup,
        reported=setup + training,
        device=device,
        step=max((r["step"] for r in mine if r["step"] is not None), default=0),
    )
    s = Settlement(
        attempt=attempt,
        setup=setup,
        training=training,
        kept=books.kept(c),
        unreported=Usage(),
        lost_to=Category.WASTED,
        device=device,
    )
    books.settle(c, s, "driver lost")
