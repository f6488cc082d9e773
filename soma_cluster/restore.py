"""A new driver picks up a campaign whose driver was lost: the scheduler's state rebuilt from the campaign
directory alone (events log, ledger, checkpoints). No Ray here.

Ended jobs stay ended, budget grants are replayed, failures counted, and an attempt the lost driver left running
is settled against its job's latest checkpoint, as a lost attempt would have been (soma_cluster/accounting.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from soma_cluster.accounting import SETUP_SEQ, Account, Books, Settlement
from soma_cluster.events import EXTENDED, RETRAIN, JobHistory
from soma_cluster.jobs import AttemptCause, Category, Event, Job
from soma_cluster.messages import Usage

if TYPE_CHECKING:
    from soma_cluster.schedule import Scheduler


def restore(sched: Scheduler, past: dict[str, JobHistory]) -> None:
    """Rebuild `sched` (a new one) from the jobs' histories."""
    by_name = {j.name: j for j in sched.jobs}
    for h in past.values():
        for ev in h.events:
            if ev["event"] == Event.BUDGET_GRANTED and h.job in by_name:
                e = by_name[h.job].expert
                sched.book.granted[e] = sched.book.granted.get(e, 0.0) + ev["gpu_seconds"]
    records = None
    for job in sched.jobs:
        h = past.get(job.name)
        if h:
            sched.seen[job] = h.view()
            sched.state[job] = h.state  # where its events left it, by the same state machine the scheduler runs
        if h and h.terminal:
            sched.outcome[job] = h.state
            continue
        sched.pending.append(job)
        if not h or not h.attempts:
            continue
        sched.next_attempt[job], sched.failures[job] = h.attempts, h.failures
        sched.cause[job] = cause_after(h)
        last = h.attempts - 1
        if h.held(last) and h.ended(last) is None:
            records = sched.books.ledger.records() if records is None else records  # read once, not once per job
            _settle_interrupted(sched.books, job, last, records)
        else:
            # its last attempt that held a GPU ended lost and the next has not reported in: finish that on setup
            ends = [ev for ev in h.events if ev["event"] in (Event.FAILED, Event.PREEMPTED) and "settled" in ev]
            if ends and ends[-1]["attempt"] == max(a for a in range(h.attempts) if h.held(a)):
                sched.books.settled[job] = Settlement.from_json(ends[-1]["settled"])


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
