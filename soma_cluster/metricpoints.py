"""What the campaign's Prometheus metrics are and the values a status snapshot gives them (no Ray here: the
exporter, workers/metrics_holder.py, sets Ray's gauges from these points).

Labels are chosen to survive Prometheus's own target labels and to tell campaigns apart:
- `campaign` is the campaign's URL (its directory or s3:// prefix): two campaigns of one preset, or of one
  config, are two series. `campaign_name` (the config's name) and `campaign_id` (its digest's first 8 hex
  digits) come along for reading.
- a job is `soma_job` (expert-0003, seed), never `job`: Prometheus sets `job` on every target (the scrape job),
  and a metric's own `job` label would arrive renamed to `exported_job`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from soma_cluster.jobs import CATEGORIES, STATES

PREFIX = "soma_"
CAMPAIGN_KEYS = ("campaign", "campaign_name", "campaign_id")
JOB_KEY = "soma_job"


class Kind(StrEnum):
    GAUGE = "gauge"
    COUNTER = "counter"


class Metric(StrEnum):
    JOBS = "jobs"
    GPU_HOURS = "gpu_hours"
    ETA = "eta_seconds"
    BUDGET_LEFT = "budget_left_gpu_hours"
    VAL_LOSS = "expert_val_loss"
    HEARTBEAT_LAG = "heartbeat_lag_seconds"
    STEP = "job_step"
    UPDATES = "updates_total"
    DRIVER_UP = "driver_up"
    ENDED = "campaign_ended"
    USD = "cost_usd"
    UNPRICED = "unpriced_gpu_hours"
    BUDGET = "budget"


@dataclass(frozen=True)
class Definition:
    description: str
    keys: tuple[str, ...] = ()  # label keys besides CAMPAIGN_KEYS
    kind: Kind = Kind.GAUGE


DEFINITIONS: dict[Metric, Definition] = {
    Metric.JOBS: Definition("jobs of the campaign by state", ("state",)),
    Metric.GPU_HOURS: Definition("GPU-hours spent, by ledger category", ("category",)),
    Metric.ETA: Definition("estimated seconds to the campaign's end (0 once it ended; -1: not known yet)"),
    Metric.BUDGET_LEFT: Definition("GPU-hours a job may still spend (-1: no budget)", (JOB_KEY,)),
    Metric.VAL_LOSS: Definition("latest expert-validation loss, nats/byte", (JOB_KEY,)),
    Metric.HEARTBEAT_LAG: Definition("seconds since a running job's last heartbeat (0: not running)", (JOB_KEY,)),
    Metric.STEP: Definition("a job's update count", (JOB_KEY,)),
    Metric.UPDATES: Definition("updates trained by every job (each job's highest step, summed)", (), Kind.COUNTER),
    Metric.DRIVER_UP: Definition("1 while a driver publishes the campaign's status, 0 once none has for a while"),
    Metric.ENDED: Definition("1 once a driver wrote the campaign's final status (every job ended)"),
    Metric.USD: Definition(
        "US dollars spent, by ledger category, at each record's price (priced campaigns)", ("category",)
    ),
    Metric.UNPRICED: Definition("GPU-hours of ledger records written without a price (priced campaigns)"),
    Metric.BUDGET: Definition("the campaign's caps in force, by cap (GPU-hours or USD; -1: none)", ("cap",)),
}


@dataclass(frozen=True)
class Point:
    metric: Metric
    value: float
    labels: tuple[tuple[str, str], ...] = ()  # besides the campaign's


@dataclass(frozen=True)
class Reading:
    """One snapshot's values."""

    points: tuple[Point, ...]
    ended: bool


def new_updates(reading: Reading, seen: dict[str, float]) -> float:
    """Updates trained since the steps in `seen` (each job's highest step so far, updated here): the exporter's
    count for the updates counter. A job seen for the first time counts from 0; a retry that goes back to an
    earlier checkpoint counts again only past the highest step seen."""
    new = 0.0
    for p in reading.points:
        if p.metric is Metric.STEP:
            job = dict(p.labels)[JOB_KEY]
            if p.value > seen.get(job, 0.0):
                new += p.value - seen.get(job, 0.0)
                seen[job] = p.value
    return new


def campaign_labels(url: str, name: str, campaign_id: str) -> dict[str, str]:
    """Label values in ASCII (Ray's metrics agent takes no other): a non-ASCII or non-UTF-8 path or name escaped as
    \\xNN / \\uNNNN, so the series still tells campaigns apart."""
    return dict(zip(CAMPAIGN_KEYS, (_ascii(url), _ascii(name), campaign_id), strict=True))


def _ascii(text: str) -> str:
    raw = text.encode("utf-8", "surrogateescape")  # a POSIX name's undecodable bytes come back as they were
    return raw.decode("ascii", "backslashreplace")


def reading(snap: dict) -> Reading:
    """The points of a status snapshot (soma_cluster/snapshot.py's schema)."""
    ended = bool(snap["final"])
    points = [Point(Metric.JOBS, snap["counts"].get(s, 0), (("state", s),)) for s in STATES]
    points += [Point(Metric.GPU_HOURS, snap["gpu_hours"].get(c, 0.0), (("category", c),)) for c in CATEGORIES]
    eta = 0.0 if ended else (-1.0 if snap["eta_s"] is None else float(snap["eta_s"]))
    points.append(Point(Metric.ETA, eta))
    for row in snap["jobs"]:
        job = ((JOB_KEY, row["job"]),)
        left = row["budget_left_gpu_hours"]
        points.append(Point(Metric.BUDGET_LEFT, -1.0 if left is None else left, job))
        if row["val"] is not None:
            points.append(Point(Metric.VAL_LOSS, row["val"], job))
        points.append(Point(Metric.HEARTBEAT_LAG, row["heartbeat_age_s"] or 0.0, job))
        points.append(Point(Metric.STEP, row["step"], job))
    points.append(Point(Metric.ENDED, 1.0 if ended else 0.0))
    if snap.get("usd"):
        points += [Point(Metric.USD, snap["usd"].get(c, 0.0), (("category", c),)) for c in CATEGORIES]
    if snap.get("unpriced_gpu_hours") is not None:  # a priced campaign's GPU-hours of records without a price
        points.append(Point(Metric.UNPRICED, snap["unpriced_gpu_hours"]))
    for cap, value in (snap.get("budget") or {}).items():
        points.append(Point(Metric.BUDGET, -1.0 if value is None else float(value), (("cap", cap),)))
    return Reading(tuple(points), ended)
