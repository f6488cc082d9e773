"""The driver's metrics, exported through `ray.util.metrics` so that Ray's Prometheus endpoint (each node's
metrics agent, port `--metrics-export-port`) and the Ray dashboard carry them. They are set from the same
snapshot `soma status` reads (soma_cluster/snapshot.py), so a dashboard and the CLI never disagree.

Every metric is tagged with the campaign's name and the first 8 hex digits of its config digest (two
campaigns of one name on one cluster stay apart). Exporting needs Ray's metrics agent, i.e. `ray[default]`;
without it the values are still set and simply go nowhere.
"""

from __future__ import annotations

import logging

from soma_cluster.jobs import CATEGORIES, STATES

log = logging.getLogger(__name__)

PREFIX = "soma_"


class CampaignMetrics:
    def __init__(self, campaign: str, campaign_id: str):
        self.tags = {"campaign": campaign, "campaign_id": campaign_id}
        self._steps: dict[str, int] = {}
        try:
            from ray.util.metrics import Counter, Gauge

            keys = ("campaign", "campaign_id")
            self.jobs = Gauge(PREFIX + "jobs", "jobs of the campaign by state", tag_keys=keys + ("state",))
            self.gpu_hours = Gauge(
                PREFIX + "gpu_hours", "GPU-hours spent, by ledger category", tag_keys=keys + ("category",)
            )
            self.eta = Gauge(
                PREFIX + "eta_seconds", "estimated seconds to the campaign's end (-1: unknown)", tag_keys=keys
            )
            self.left = Gauge(
                PREFIX + "budget_left_gpu_hours",
                "GPU-hours a job may still spend (-1: no budget)",
                tag_keys=keys + ("job",),
            )
            self.val = Gauge(
                PREFIX + "expert_val_loss", "latest expert-validation loss, nats/byte", tag_keys=keys + ("job",)
            )
            self.lag = Gauge(
                PREFIX + "heartbeat_lag_seconds",
                "seconds since a running job's last heartbeat",
                tag_keys=keys + ("job",),
            )
            self.step = Gauge(PREFIX + "job_step", "a job's update count", tag_keys=keys + ("job",))
            self.updates = Counter(
                PREFIX + "updates_total", "updates trained by every job, counted by this driver", tag_keys=keys
            )
            self.ok = True
        except Exception as exc:  # metrics are never a reason for a campaign to stop
            log.warning("metrics disabled: %s", exc)
            self.ok = False

    def update(self, snap: dict) -> None:
        if not self.ok:
            return
        try:
            self._update(snap)
        except Exception as exc:
            log.warning("metrics update failed (disabled from now on): %s", exc)
            self.ok = False

    def _update(self, snap: dict) -> None:
        t = self.tags
        for state in STATES:
            self.jobs.set(snap["counts"].get(state, 0), {**t, "state": state})
        for cat in CATEGORIES:
            self.gpu_hours.set(snap["gpu_hours"].get(cat, 0.0), {**t, "category": cat})
        self.eta.set(-1.0 if snap["eta_s"] is None else snap["eta_s"], t)
        new = 0
        for row in snap["jobs"]:
            job = {**t, "job": row["job"]}
            left = row["budget_left_gpu_hours"]
            self.left.set(-1.0 if left is None else left, job)
            if row["val"] is not None:
                self.val.set(row["val"], job)
            self.lag.set(row["heartbeat_age_s"] or 0.0, job)
            self.step.set(row["step"], job)
            before = self._steps.get(row["job"])
            if before is not None and row["step"] > before:
                new += row["step"] - before
            self._steps[row["job"]] = row["step"]
        if new:
            self.updates.inc(new, t)
