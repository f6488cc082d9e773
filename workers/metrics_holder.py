"""The actor that exports a campaign's metrics (soma_cluster/metricpoints.py) through `ray.util.metrics`, so that
each node's Ray metrics agent serves them to Prometheus.

It is a detached actor of its own, not the driver: Ray drops a process's metrics 20-30 s after the process ends,
so gauges set by the driver would vanish exactly when a campaign ends, fails or loses its driver. The holder
keeps the last values for HOLD_S after the last publish (`soma_driver_up` turns 0 after DOWN_S without one, and
`soma_campaign_ended` tells an ended campaign from a lost driver), then removes itself. A new driver of the same
campaign finds it by name and goes on publishing. On a Ray the driver started itself there is nothing to hold:
that Ray ends with the command (pipelines/metrics.py decides).

It lives on the head node, wherever the driver runs: a worker node can be lost (a partition, a spot reclaim) and
the holder (max_restarts=0, its values in memory) would go with it, taking the campaign's last metrics; the head's
loss ends the cluster's GCS, and every detached actor with it, so the head is the one node whose loss costs
nothing more. The special resource `node:__internal_head__` that Ray gives the head (and only the head) pins it
there, as Ray Train pins its own state actor.
"""

from __future__ import annotations

import threading
import time

import ray

from soma_cluster.envvars import value as env_value
from soma_cluster.metricpoints import CAMPAIGN_KEYS, DEFINITIONS, PREFIX, Kind, Metric, Reading, new_updates

HOLD_ENV = "SOMA_METRICS_HOLD_S"
HOLD_S = 900.0  # how long a campaign's last values stay after its last driver published (15 minutes)
DOWN_S = 20.0  # no publish for this long: soma_driver_up is 0 (a driver publishes every 5 s)
NAMESPACE = "soma-metrics"
ON_HEAD = {"node:__internal_head__": 0.001}  # a sliver of the head's own resource: placed on the head, nowhere else


def hold_s() -> float:
    held = env_value(HOLD_ENV)
    return HOLD_S if held is None else held


class Exporter:
    """Ray's metric objects for one campaign, set from readings (in the holder, or in a driver whose Ray ends with
    it)."""

    def __init__(self, labels: dict[str, str]):
        from ray.util.metrics import Counter, Gauge

        self.labels, self.seen = labels, {}
        self.metrics = {
            m: (Counter if d.kind is Kind.COUNTER else Gauge)(
                PREFIX + m.value, d.description, tag_keys=CAMPAIGN_KEYS + d.keys
            )
            for m, d in DEFINITIONS.items()
        }

    def publish(self, reading: Reading) -> None:
        self.refresh(reading, up=True)
        if new := new_updates(reading, self.seen):
            self.metrics[Metric.UPDATES].inc(new, self.labels)

    def refresh(self, reading: Reading | None, up: bool) -> None:
        """Set every gauge again: Ray (2.60, OpenTelemetry) exports a gauge's value only while it is being set,
        so values the holder keeps for a gone driver are set again every second."""
        for p in reading.points if reading is not None else ():
            self.metrics[p.metric].set(p.value, {**self.labels, **dict(p.labels)})
        self.metrics[Metric.DRIVER_UP].set(1.0 if up else 0.0, self.labels)


@ray.remote(num_cpus=0, max_restarts=0, max_concurrency=2)
class MetricsHolder:
    def __init__(self, labels: dict[str, str], hold_for_s: float, down_after_s: float = DOWN_S):
        self.exporter = Exporter(labels)
        self.hold_for_s, self.down_after_s = hold_for_s, down_after_s
        self.last, self.reading = time.monotonic(), None
        self.lock = threading.Lock()
        threading.Thread(target=self._watch, name="soma-metrics-watch", daemon=True).start()

    def publish(self, reading: Reading) -> None:
        with self.lock:
            self.last, self.reading = time.monotonic(), reading
            self.exporter.publish(reading)

    def hold_for(self, seconds: float) -> None:
        """Set how long the values stay after the last publish (a test shortens it)."""
        self.hold_for_s = seconds

    def _watch(self) -> None:
        while True:
            time.sleep(1.0)
            with self.lock:
                idle = time.monotonic() - self.last
                self.exporter.refresh(self.reading, up=idle < self.down_after_s)
            if idle >= self.hold_for_s:
                ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
                return


def holder_name(campaign_url: str) -> str:
    import hashlib

    return "soma-metrics-" + hashlib.sha256(campaign_url.encode()).hexdigest()[:16]


def open_holder(labels: dict[str, str]):
    """The campaign's holder: the running one (a driver before this one made it), else a new one."""
    return MetricsHolder.options(
        name=holder_name(labels["campaign"]),
        namespace=NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        resources=ON_HEAD,
    ).remote(labels, hold_s())
