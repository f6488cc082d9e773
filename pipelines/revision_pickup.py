"""Config revisions (`soma set`, soma_cluster/revisions.py) taken up by drivers: at start, those no driver applied
yet; while a driver runs, each new one within REVISION_POLL_S.

The ended experts a revision lets train on are reopened first (`reopened`, reason `extended`), then the revision is
logged as applied (`config_revised`, job "campaign", with what changed, by whom and when). Both are the lease
holder's writes, fenced like all of its writes: a driver that lost the campaign applies nothing. A driver lost in
between applies the revision again at the next start, and reopens only what is still ended: nothing is lost and
nothing is applied twice.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from pipelines.common import out
from pipelines.status import lease_view
from soma_cluster.campaignfile import load_campaign_config
from soma_cluster.config import CampaignConfig
from soma_cluster.diskerrors import storage_error
from soma_cluster.errors import SomaError, StorageUnreachable
from soma_cluster.events import EXTENDED, LOG, emit, history
from soma_cluster.jobs import Event
from soma_cluster.revisions import DIR, Revision, applied, apply, in_force, revisions, to_reopen
from soma_cluster.revisions import check as check_change
from soma_cluster.revisions import record as record_revision
from soma_cluster.schedule import POLL_S
from soma_cluster.storage import Store

REVISION_POLL_S = 1.0  # how often a running driver lists the campaign's revisions (one LIST on S3)
# A revision is applied at the driver's first look for revisions after it is written: looks are REVISION_POLL_S
# apart and fall between two turns of its loop, each of which waits at most POLL_S for a result; the `config_revised`
# event is then made durable at once. So APPLY_BOUND_S of the loop's time; a loaded host stretches the loop's turns.
APPLY_BOUND_S = REVISION_POLL_S + POLL_S


def log_applied(store: Store, revs: list[Revision], observe: Callable[[dict], None] | None = None) -> None:
    for r in revs:
        rec = emit(store, Event.CONFIG_REVISED, "campaign", rev=r.rev, set=r.set, was=r.was, by=r.by, at=r.at)
        if observe is not None:
            observe(rec)


def take_up(store: Store, cfg: CampaignConfig, say: Callable[[str], None]) -> list[Revision]:
    """At a driver's start: the revisions written since a driver last applied one (`cfg` is the config in force with
    all of them): reopen the ended experts they let train on, then log them applied."""
    revs, names = pending(store, cfg)
    if not revs:
        return []
    past = history(store)
    for name in names:
        emit(store, Event.REOPENED, name, step=past[name].step, was=past[name].state, reason=EXTENDED)
    log_applied(store, revs)
    for r in revs:
        say(f"config revision {r.rev} ({r.by}): {r.line()}")
    if names:
        say(f"{len(names)} ended expert(s) train on from their latest checkpoint: {_names(names)}")
    return revs


def pending(store: Store, cfg: CampaignConfig) -> tuple[list[Revision], list[str]]:
    """The revisions no driver applied yet, and the ended experts that `cfg` (the config in force with them, or with a
    revision still to be recorded) lets train on, against the config the last driver applied. Reads only."""
    done = applied(store.read_log(LOG))
    revs = revisions(store)
    was = apply(load_campaign_config(store), revs[:done])
    return revs[done:], to_reopen(ended_jobs(history(store)), was, cfg)


def ended_jobs(past: dict) -> dict:
    """The jobs that ended, from their histories: name -> (end state, step), as to_reopen takes them."""
    return {n: (h.state, h.step) for n, h in past.items() if h.terminal and n != "campaign"}


def _names(names: list[str]) -> str:
    return ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")


class LiveRevisions:
    """A running driver's view of the campaign's revisions: poll() returns the config in force and the revisions
    written since the last call (None: none new, or polled too recently)."""

    def __init__(self, store: Store, clock: Callable[[], float] = time.monotonic):
        self.store, self.clock = store, clock
        self.seen = len(revisions(store))
        self.polled = -math.inf

    def poll(self) -> tuple[CampaignConfig, list[Revision]] | None:
        """A store that does not answer now (an outage the workers wait out) is asked again at the next poll: looking
        for revisions never stops or slows training."""
        now = self.clock()
        if now - self.polled < REVISION_POLL_S:
            return None
        self.polled = now
        try:
            revs = revisions(self.store)
        except (OSError, StorageUnreachable):
            return None
        if len(revs) <= self.seen:
            return None
        new = revs[self.seen :]
        self.seen = len(revs)
        return apply(load_campaign_config(self.store), revs), new


def reopened_names(ended: dict, was: CampaignConfig, now: CampaignConfig) -> list[str]:
    """to_reopen over a scheduler's ended jobs: {Job: (state, step)} -> the names to reopen."""
    return to_reopen({j.name: v for j, v in ended.items()}, was, now)


WAIT_POLL_S = 0.2


def set_config(store: Store, items: list[str], wait_s: float | None = None) -> dict:
    """`soma set`: record a revision of the campaign's config; with a driver running and `wait_s`, wait (at most that
    long) for it to log the revision applied. Returns what happened, for the command's line or --json."""
    base = load_campaign_config(store)
    lease = lease_view(store) or {}
    running = bool(lease.get("held"))
    t0 = time.monotonic()
    check_change(in_force(store, base)[0], items, running)  # a change refused: before anything is written
    store.check_writable()  # a full or read-only store is refused before a lock or a directory is made
    try:
        rev = record_revision(store, base, items, running)
    except OSError as exc:  # a full or read-only campaign store: one line naming where the revision goes
        err = storage_error(exc, store.full(DIR))
        if err is None:
            raise
        raise err from None
    revs = revisions(store)[: rev.rev]  # what this revision changed, against the ones before it (others may follow)
    was, now = apply(base, revs[:-1]), apply(base, revs)
    result = {
        "schema": 1,
        "campaign": store.url,
        "revision": rev.as_json(),
        "driver": f"{lease['command']} (pid {lease['pid']} on {lease['host']})" if running else None,
        "lease_generation": lease.get("generation"),
        "reopens": to_reopen(ended_jobs(history(store)), was, now),
        "applied": None,
        "applied_after_s": None,
    }
    if running and wait_s:
        while time.monotonic() - t0 < wait_s:
            if applied(store.read_log(LOG)) >= rev.rev:
                result["applied"], result["applied_after_s"] = True, time.monotonic() - t0
                break
            time.sleep(WAIT_POLL_S)
        else:
            result["applied"] = False
    return result


def say_applied(store: Store, r: dict, wait_s: float | None) -> None:
    """`soma set`'s lines on stdout: the revision, and who applies it when (set_config's result `r`); a driver that
    did not apply it within --wait is an error."""
    rev = r["revision"]
    out.print(f"revision {rev['rev']} of {store.url}: {changed(rev)} (by {rev['by']})", markup=False)
    n = len(r["reopens"])
    trains = f"; {n} ended expert(s) will train on from their latest checkpoint" if n else ""
    if r["driver"] is None:
        out.print(f"no driver holds the campaign: soma resume {store.url} applies it{trains}", markup=False)
    elif r["applied"]:
        out.print(f"applied by {r['driver']} after {r['applied_after_s']:.1f} s{trains}", markup=False)
    elif r["applied"] is False:
        raise SomaError(
            f"{r['driver']} did not apply revision {rev['rev']} within --wait {wait_s:g} s; it is recorded, and the "
            f"driver (or the next soma resume {store.url}) applies it"
        )
    else:
        out.print(
            f"{r['driver']} applies it at its next look, within {APPLY_BOUND_S:g} s of its loop's time (longer on a "
            f"loaded host; --wait S waits for it), or, if it ends first, soma resume does{trains}",
            markup=False,
        )


def changed(rev: dict) -> str:
    return ", ".join(f"{k} {rev['was'].get(k)} -> {v}" for k, v in rev["set"].items())
