"""The campaign's state transitions, written to `<campaign>/events.jsonl` as they happen.

Driver state is never only in memory: `soma resume` and `soma status` rebuild it from this log.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from soma_cluster.storage import Store

LOG = "events.jsonl"
TERMINAL = ("finished", "budget_exhausted", "failed_permanently")


def emit(store: Store, event: str, job: str, **fields) -> None:
    store.append(LOG, {"event": event, "job": job, "t": time.time(), **fields})


@dataclass
class JobHistory:
    job: str
    state: str = "pending"          # last event name
    attempts: int = 0               # launched events
    step: int = 0
    val: float | None = None
    last_error: str | None = None
    events: list[dict] = field(default_factory=list)

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL


def history(store: Store) -> dict[str, JobHistory]:
    out: dict[str, JobHistory] = {}
    for ev in store.read_log(LOG):
        h = out.setdefault(ev["job"], JobHistory(ev["job"]))
        h.events.append(ev)
        if ev["event"] == "launched":
            h.attempts += 1
        if ev["event"] != "heartbeat":
            h.state = ev["event"]
        h.step = ev.get("step", h.step) or h.step
        if ev.get("val") is not None:
            h.val = ev["val"]
        if ev["event"] == "failed":
            h.last_error = ev.get("reason")
    return out
