"""The driver's side of the campaign's metrics (soma_cluster/metricpoints.py says what they are). They are set
from the same snapshot `soma status` reads, so a dashboard and the CLI never disagree.

On a cluster that outlives the driver (an address was given, or the driver runs as a Ray Job) the values go to
the campaign's holder actor (workers/metrics_holder.py), which keeps them after the driver has gone; on a Ray
this command started itself, the driver exports them in-process (that Ray ends with the command). Exporting
needs Ray's metrics agent, i.e. `ray[default]`; without it the values are still set and go nowhere. Metrics
are never a reason for a campaign to stop: any failure is logged once and they are off from then on.
"""

from __future__ import annotations

import logging

from soma_cluster.metricpoints import campaign_labels, reading

log = logging.getLogger(__name__)


def ray_outlives_driver() -> bool:
    """Whether this process connected to a Ray it did not start (one that goes on after the command)."""
    import ray

    node = getattr(ray._private.worker, "_global_node", None)
    return node is not None and not getattr(node, "head", False)


class CampaignMetrics:
    def __init__(self, url: str, name: str, campaign_id: str):
        self.labels = campaign_labels(url, name, campaign_id)
        self._pending = None  # the holder's last publish call, if still running
        self.ok = True
        try:
            if ray_outlives_driver():
                from workers.metrics_holder import open_holder

                self.holder, self.exporter = open_holder(self.labels), None
            else:
                from workers.metrics_holder import Exporter

                self.holder, self.exporter = None, Exporter(self.labels)
        except Exception as exc:
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
        import ray

        point = reading(snap)
        if self.exporter is not None:
            self.exporter.publish(point)
            return
        if self._pending is not None and not point.ended:
            done, _ = ray.wait([self._pending], timeout=0)
            if not done:  # the holder is behind: this reading is skipped, the next one (5 s on) carries on
                return
        self._pending = self.holder.publish.remote(point)
        if point.ended:
            self.flush()

    def flush(self, timeout_s: float = 10.0) -> None:
        """Wait (bounded) until the holder has the last reading: the driver's final one must not be lost with it."""
        if self.ok and self._pending is not None:
            import ray

            try:
                ray.get(self._pending, timeout=timeout_s)
            except Exception as exc:
                log.warning("the last metrics did not reach their holder: %s", exc)
