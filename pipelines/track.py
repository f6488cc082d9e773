"""`soma track CAMPAIGN`: backfill the campaign's trackers from its record (events, ledger, config, eval/).

The same Feed the driver runs live makes the points; each tracker is read back in full first (every step of
every series, the tags, the parameters, the artifacts' digests), and only what it lacks is sent: a gap left by
a tracker that was down is filled, and running the command twice sends nothing the second time. Synchronous:
no driver is training (the command holds the campaign's lease).
"""

from __future__ import annotations

import time

from pipelines.tracking import (
    BACKOFF_S,
    BATCH_POINTS,
    GAPS,
    Tracker,
    campaign_key,
    eval_points,
    make_sinks,
    record_of,
    require_packages,
)
from soma_cluster.config import CampaignConfig
from soma_cluster.errors import SomaError
from soma_cluster.events import history
from soma_cluster.jobs import SEED_JOB, JobState, expert_jobs
from soma_cluster.storage import Store
from soma_cluster.trackpoints import (
    Backend,
    Metric,
    Point,
    Stage,
    Target,
    resolve_target,
    settled,
)

BACKFILL_TIMEOUT_S = 60.0  # one call to a tracker during a backfill, at most


def stage_states(store: Store, cfg: CampaignConfig) -> dict[Stage, str]:
    """Each stage's state as the record tells it (no driver runs: a stage begun and not ended was stopped)."""
    hist = history(store)
    out: dict[Stage, str] = {}
    if store.exists("shards/manifest.json"):
        out[Stage.PREPARE] = "finished"
    if SEED_JOB.name in hist:
        out[Stage.SEED] = "finished" if hist[SEED_JOB.name].state == JobState.FINISHED else "stopped"
    experts = [hist.get(j.name) for j in expert_jobs(cfg.n_experts)]
    if any(experts):
        out[Stage.LAUNCH] = "finished" if all(h is not None and h.terminal for h in experts) else "stopped"
    if store.exists("eval/metrics.json"):
        out[Stage.EVAL] = "finished"
    return out


def backfill_target(
    store: Store, cfg: CampaignConfig, backends: list[str] | None = None
) -> tuple[CampaignConfig, Target]:
    """`soma track`'s trackers, checked before it takes the lease: named, resolvable, installed. The config the
    backfill runs with (patient: no driver waits on it), and where it goes."""
    # no driver waits on a backfill: each call may take BACKFILL_TIMEOUT_S (a loaded server), each batch is retried
    patient = {"timeout_s": max(cfg.tracking.timeout_s, BACKFILL_TIMEOUT_S)}
    patient |= {"backends": backends} if backends else {}
    cfg = cfg.model_copy(update={"tracking": cfg.tracking.model_copy(update=patient)})
    target = resolve_target(cfg, store.root if store.local else None, url=store.url)
    if not target.backends:
        raise SomaError(
            f"{store.url} names no tracker (tracking.backends, SOMA_TRACKING_BACKENDS); name the ones to fill, e.g. "
            f"soma track {store.url} --backend mlflow (with MLFLOW_TRACKING_URI set)"
        )
    require_packages(target.backends)
    return cfg, target


def backfill(store: Store, cfg: CampaignConfig, backends: list[str] | None = None) -> dict:
    """Send each tracker what it lacks of the record; returns, per backend, what was sent."""
    cfg, target = backfill_target(store, cfg, backends)
    key = campaign_key(store, cfg)
    tracker = Tracker(store, cfg, key, [])
    events, ledger = record_of(store)
    points = tracker.prologue(events, ledger)
    for s, v in stage_states(store, cfg).items():  # in stage order: the last one's status is the campaign run's
        points += tracker.feed.stage(s, v)
    # no driver runs (the command holds the lease): a job started and not ended was stopped with its driver
    points += tracker.feed.interrupted()
    if store.exists("eval/metrics.json"):
        points += eval_points(store, tracker.feed, store.read_json("eval/metrics.json"))
    points = settled(points)
    report = {"schema": 1, "campaign": store.url, "key": key, "backends": {}}
    for sink in make_sinks(target, key, store, cfg, full=True):
        report["backends"][sink.name] = _fill(sink, points, target, store, cfg.tracking.retries)
    return report


def _fill(sink, points: list[Point], target, store: Store, retries: int) -> dict:
    """Send the sink what it lacks; a failure is tried again `retries` times (what the tracker holds read again
    each time), then ends the command with one line."""
    where = target.mlflow_uri if sink.name == Backend.MLFLOW else target.tensorboard_dir
    t0 = time.monotonic()
    sent: list[Point] | None = None  # what the tracker lacked when first read: all of it is held once this returns
    replaced: list[str] = []
    try:
        for attempt in range(retries + 1):
            try:
                fresh = sink.open().admit(points)
                sent = fresh if sent is None else sent  # a retry sends the rest of what a failed attempt left
                for i in range(0, len(fresh), BATCH_POINTS):
                    sink.write(fresh[i : i + BATCH_POINTS])
                replaced = sink.finish()
                break
            except Exception as exc:
                if attempt < retries:
                    time.sleep(BACKOFF_S * 2**attempt)
                    continue
                first = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
                raise SomaError(
                    f"{sink.name} at {where} failed during the backfill ({first}); start or fix the tracker, then "
                    f"run soma track {store.url} again (it sends only what is missing)"
                ) from None
    finally:
        sink.close()
    sent = sent or []
    metrics = [p for p in sent if isinstance(p, Metric)]
    if sent:
        store.append(GAPS, {"t": time.time(), "backend": sink.name, "filled": len(sent)})
    return {
        "where": where,
        "points": len(sent),
        "metrics": len(metrics),
        "runs": sorted({p.run for p in metrics}),
        "replaced": replaced,
        "seconds": round(time.monotonic() - t0, 3),
    }
