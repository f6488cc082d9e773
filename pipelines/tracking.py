"""The driver's experiment tracking (docs/tracking.md): each tracker (a sink: MLflow, TensorBoard) is fed from a
bounded queue by a thread of its own, so a tracker that is down or slow never slows or fails training.

The driver turns each record it writes into points (soma_cluster/trackpoints.py's Feed, microseconds) and only
enqueues them. A sink's thread sends them in batches; a batch that fails is tried `tracking.retries` more times
with backoff, then dropped, and a queue past `tracking.queue_points` drops what arrives: both are counted, and
at the end the gap is written to the campaign (tracking/gaps.jsonl) and printed. The campaign's own records
stay the source of truth: `soma track CAMPAIGN` (backfill) runs the same Feed over them and sends what a
tracker lacks.
"""

from __future__ import annotations

import copy
import importlib.util
import sys
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from pipelines.common import console
from soma_cluster.campaignfile import CONFIG_FILE
from soma_cluster.config import CampaignConfig, recorded_versions, versions
from soma_cluster.errors import SomaError
from soma_cluster.events import LOG as EVENTS
from soma_cluster.ledger import Ledger
from soma_cluster.storage import Store
from soma_cluster.trackpoints import (
    PARENT,
    PIP_HINT,
    TAG,
    Artifact,
    Backend,
    Feed,
    Fork,
    Gap,
    Marks,
    Point,
    Source,
    Stage,
    Tag,
    Target,
    campaign_points,
    dir_name,
    job_params,
    merged,
    resolve_target,
    settled,
)

KEY_FILE = "tracking/key.json"  # the campaign's identity in its trackers: found again by it on resume
GAPS = "tracking/gaps.jsonl"  # what a tracker missed, per driver: the record `soma track` reads as done by it
SINK_POLL_S = 0.2  # a sink's thread looks for points this often (no wake-up per point: enqueueing stays cheap)
BATCH_POINTS = 2000  # points per send
BACKOFF_S = 0.5  # first retry's wait, doubled each retry
COOLDOWN_S = 2.0  # after a batch failed every try: the queue fills meanwhile (bounded) instead of being drained;
COOLDOWN_MAX_S = 30.0  # doubled after each such batch up to this, back to COOLDOWN_S after a batch gets through
MODULES = {Backend.MLFLOW: "mlflow", Backend.TENSORBOARD: "tensorboard"}


class Sink(Protocol):
    name: str

    def load(self) -> None:
        """Import the tracker's library, in the driver's thread before its loop: an import (seconds of CPU under
        the interpreter lock) in the sink's thread would compete with the loop it must never slow."""

    def open(self) -> Marks:
        """Find or make the campaign's runs; what they already hold."""

    def write(self, points: list[Point]) -> None:
        """Send the points (raise on failure)."""

    def finish(self) -> list[str]:
        """A backfill's last step, after its writes (raise on failure): what the sink still holds back is made
        final. Returns the tracker's files it replaced (TensorBoard: a run with points below a tag's last step is
        rewritten in step order); none elsewhere."""

    def close(self) -> None: ...


def require_packages(backends: tuple[Backend, ...]) -> None:
    missing = [MODULES[b] for b in backends if importlib.util.find_spec(MODULES[b]) is None]
    if missing:
        raise SomaError(
            f"tracking.backends names {', '.join(missing)} but the package is not installed; {PIP_HINT} "
            f"(or remove it from tracking.backends)"
        )


def check_tracking(store: Store, cfg: CampaignConfig) -> None:
    """Refuse (SomaError) a tracking config that cannot work here, before a command writes anything."""
    require_packages(resolve_target(cfg, store.root if store.local else None, url=store.url).backends)


def campaign_key(store: Store, cfg: CampaignConfig) -> str:
    """The campaign's identity in its trackers (its config id and a random part: two directories with one config
    are two campaigns), written once into the campaign (by the holder of its lease) so any later driver or `soma track`
    finds the same runs."""
    if store.exists(KEY_FILE):
        return store.read_json(KEY_FILE)["key"]
    key = f"{cfg.digest()[:8]}-{uuid.uuid4().hex[:8]}"
    store.write_json(KEY_FILE, {"key": key})  # by the lease's holder: no other command writes it meanwhile
    return key


def make_sinks(target: Target, key: str, store: Store, cfg: CampaignConfig, full: bool = False) -> list[Sink]:
    """The campaign's sinks; its runs are named after its directory (`runs/c1`: `c1`, `c1/expert-0003`)."""
    out: list[Sink] = []
    label, fork = dir_name(store.url), fork_of(store)
    for b in target.backends:
        if b == Backend.MLFLOW:
            from pipelines.tracking_mlflow import MlflowSink

            timeout = cfg.tracking.timeout_s
            fork_key = fork.key if fork else None
            out.append(MlflowSink(target.mlflow_uri, target.experiment, key, label, timeout, full, fork_key))
        else:
            from pipelines.tracking_tb import TensorBoardSink

            out.append(TensorBoardSink(target.tensorboard_dir, key, label, full))
    return out


FORK_MARKER = "fork.json"  # pipelines/fork.py's


def fork_of(store: Store) -> Fork | None:
    """Where a forked campaign came from: its parent's URL (absolute where fork.json says it) and the key the
    parent is tracked under, if it has one and can be read now (else the run links by URL only)."""
    try:
        if not store.exists(FORK_MARKER):
            return None
        doc = store.read_json(FORK_MARKER)
    except Exception:  # a view: a fork marker that cannot be read leaves the run unlinked
        return None
    url = doc.get("parent_url") or doc["parent"]
    try:
        parent = Store(url, storage_options=store.storage_options)
        key = parent.read_json(KEY_FILE)["key"] if parent.exists(KEY_FILE) else None
    except Exception:
        key = None
    return Fork(url, key)


def shard_counts(store: Store) -> dict | None:
    """shards/manifest.json's per-expert row counts (a job's run parameters), if the campaign is prepared."""
    try:
        m = store.read_json("shards/manifest.json") if store.exists("shards/manifest.json") else None
    except Exception:  # a view: parameters without the counts
        return None
    return {k: m.get(k) for k in ("train_rows", "val_rows")} if m else None


@dataclass
class Outcome:
    """One sink's account at its close: points sent, and the gap (points it never got)."""

    backend: str
    sent: int
    gap: Gap
    error: str | None  # the last failure's text, if any


class SinkThread:
    """One sink, its bounded queue and its thread.

    A tracker that keeps failing costs the driver's process little: after a batch fails every try the thread
    waits (COOLDOWN_S, doubled after each failed batch up to COOLDOWN_MAX_S) while the queue fills up to its
    bound and then drops, counted. Closing wakes it at once; a batch that then fails every try ends the drain, and
    what is left is counted as missed at once, not after tracking.drain_s spent on a tracker that just refused."""

    def __init__(
        self, sink: Sink, cap: int, retries: int, cooldown_s: float = COOLDOWN_S, cooldown_max_s: float = COOLDOWN_MAX_S
    ):
        self.sink, self.cap, self.retries = sink, cap, retries
        self.cooldown_s, self.cooldown_max_s = cooldown_s, max(cooldown_s, cooldown_max_s)
        self.cooldown = cooldown_s  # the next wait after a failed batch
        self.queue: deque[list[Point]] = deque()
        self.size = 0  # points queued
        self.lock = threading.Lock()  # the queue and the gap: the driver's thread and this one both add to the gap
        self.gap, self.sent, self.error = Gap(), 0, None
        self.marks: Marks | None = None
        self.prologue: list[Point] = []
        self.inflight: list[Point] = []  # the batch taken to be sent (set under the lock as it leaves the queue)
        self._closing = self._abandon = False
        self._wake = threading.Event()  # set by closing(): ends a poll or a cool-down at once
        self._thread = threading.Thread(target=self._run, name=f"soma-track-{sink.name}", daemon=True)

    def start(self, prologue: list[Point]) -> None:
        """`prologue`: the points of the records written before this driver (not held against the bound)."""
        self.prologue = prologue
        self._thread.start()

    def put(self, points: list[Point]) -> None:
        """Never blocks: past the bound the points are dropped and counted."""
        with self.lock:
            if self.size + len(points) > self.cap:
                self.gap.add(points)
                return
            self.queue.append(points)
            self.size += len(points)

    def _take(self) -> list[Point]:
        out: list[Point] = []
        with self.lock:
            while self.queue and len(out) < BATCH_POINTS:
                batch = self.queue.popleft()
                self.size -= len(batch)
                out += batch
            self.inflight = out
        return out

    def _miss(self, points: list[Point]) -> None:
        with self.lock:
            if not self._abandon:  # once abandoned, close() has counted the batch in flight
                self.gap.add(points)
            self.inflight = []

    def _run(self) -> None:
        while not self._abandon:
            with self.lock:  # a close() that gives up takes the rest of the prologue under the same lock
                batch, self.prologue = self.prologue[:BATCH_POINTS], self.prologue[BATCH_POINTS:]
                self.inflight = batch
            if not batch:
                break
            if not self._send(batch):
                return self._give_up()
        while not self._abandon:
            batch = self._take()
            if batch:
                if not self._send(batch):
                    return self._give_up()
                time.sleep(0)  # hand the interpreter lock back to the driver's loop between batches
            elif self._closing:
                return
            else:
                self._wake.wait(SINK_POLL_S)

    def _give_up(self, abandon: bool = False) -> None:
        """What is queued is missed, now: closing, and the tracker failed a batch every try (not worth the drain's
        time), or the drain's time is up (then also the batch in flight, whose fate is unknown: counted as missed,
        and the backfill, which reads what the tracker holds first, sends it only if it is not there)."""
        with self.lock:
            self._abandon = self._abandon or abandon
            left = [p for batch in self.queue for p in batch]
            self.queue.clear()
            self.size = 0
            self.gap.add(self.prologue + left + (self.inflight if abandon else []))
            self.prologue, self.inflight = [], []

    def _send(self, points: list[Point]) -> bool:
        """Admit (what the tracker lacks), then write with bounded retries; a batch that fails them is dropped.
        False when the thread is to give up: the batch failed every try, all of them made while closing (a batch
        that failed before closing began leaves the next one its try: the tracker may be back)."""
        closing = self._closing
        for attempt in range(self.retries + 1):
            if self._abandon:
                return False  # counted by close()
            try:
                if self.marks is None:
                    self.marks = self.sink.open()
                fresh = self.marks.admit(points)
                if fresh:
                    self.sink.write(fresh)
                with self.lock:
                    self.sent += len(fresh)
                    self.inflight = []
                self.cooldown = self.cooldown_s
                return True
            except Exception as exc:  # a tracker's failure never reaches the driver
                self.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
                self.marks = None  # read again from the tracker: what it holds after the failure
                if attempt < self.retries:
                    time.sleep(BACKOFF_S * 2**attempt)
        self._miss(points)
        if not self._closing:
            self._wake.wait(self.cooldown)
            self.cooldown = min(self.cooldown * 2, self.cooldown_max_s)
        return not closing

    def closing(self) -> None:
        """From now on the thread ends once its queue is empty (or once the tracker fails a batch every try)."""
        self._closing = True
        self._wake.set()

    def close(self, wait_s: float) -> Outcome:
        """Send what is queued, waiting at most `wait_s`; what is left then is counted as missed."""
        self.closing()
        if self._thread.is_alive():
            self._thread.join(wait_s)
        if self._thread.is_alive():
            self._give_up(abandon=True)  # the thread, still in a call to the tracker, adds nothing to the gap now
        with self.lock:
            gap = copy.deepcopy(self.gap)
        try:
            self.sink.close()
        except Exception:  # a tracker's failure never reaches the driver
            pass
        return Outcome(self.sink.name, self.sent, gap, self.error)


class Tracker:
    """The campaign's trackers for one command (a stage): `on_event` / `on_ledger` take the records the driver
    writes; `close()` reports and records what each tracker missed."""

    def __init__(self, store: Store, cfg: CampaignConfig, key: str, sinks: list[Sink]):
        self.store, self.cfg, self.key = store, cfg, key
        self.feed = Feed(params=job_params(cfg, shard_counts(store)))
        self.threads = [SinkThread(s, cfg.tracking.queue_points, cfg.tracking.retries) for s in sinks]

    @staticmethod
    def open(store: Store, cfg: CampaignConfig, experiment: str | None = None) -> Tracker | None:
        """The campaign's trackers (None when no backend is named, in the config or SOMA_TRACKING_BACKENDS). A
        backend whose package is missing, or a target that cannot be resolved, is bad input (SomaError)."""
        target = resolve_target(cfg, store.root if store.local else None, experiment=experiment, url=store.url)
        if not target.backends:
            return None
        require_packages(target.backends)
        key = campaign_key(store, cfg)
        return Tracker(store, cfg, key, make_sinks(target, key, store, cfg))

    def start(self, events: list[dict] | None = None, ledger: list[dict] | None = None, extra=None) -> None:
        """Start the threads, first sending the points of the campaign's records so far (what a tracker lacks of
        them: a resumed driver continues its runs; the parameters and tags of the campaign). `extra(feed)`: more
        points, made once the records are replayed."""
        points = self.prologue(events or [], ledger or [])
        points += extra(self.feed) if extra is not None else []
        for t in self.threads:
            t.sink.load()
            t.start(points)

    def prologue(self, events: list[dict], ledger: list[dict]) -> list[Point]:
        text = self.store.read_bytes(CONFIG_FILE).decode() if self.store.exists(CONFIG_FILE) else ""
        url = self.store.root if self.store.local else self.store.url
        points = campaign_points(self.cfg, self.key, url, recorded_versions(text) or versions(), fork_of(self.store))
        for source, rec in merged(events, ledger):
            points += self.feed.on_record(source, rec)
        return settled(points)

    def on_event(self, rec: dict) -> None:
        points = self.feed.on_record(Source.EVENTS, rec)
        if points:
            self.put(points)

    def on_ledger(self, rec: dict) -> None:
        self.feed.on_record(Source.LEDGER, rec)

    def put(self, points: list[Point]) -> None:
        for t in self.threads:
            t.put(points)

    def stage(self, stage: Stage, state: str) -> None:
        """A stage's tag and the campaign run's status (soma_cluster/trackpoints.py's Feed.stage)."""
        self.put(self.feed.stage(stage, state))

    def close(self, record: bool = True) -> list[Outcome]:
        """Drain (bounded by tracking.drain_s in all), then print each tracker's gap and (`record`: not for a
        driver fenced off its campaign) write it to the campaign."""
        deadline = time.monotonic() + self.cfg.tracking.drain_s
        for t in self.threads:  # every sink drains at once: a tracker that is down does not eat another's time
            t.closing()
        outcomes = [t.close(max(0.0, deadline - time.monotonic())) for t in self.threads]
        for o in outcomes:
            if o.gap.dropped:
                why = f"; last error: {o.error}" if o.error else ""
                console.print(f"warning: {o.gap.line(o.backend, self.store.url)}{why}", markup=False, soft_wrap=True)
                if record:
                    self._record_gap(o)
        return outcomes

    def _record_gap(self, o: Outcome) -> None:
        try:
            self.store.append(
                GAPS, {"t": time.time(), "backend": o.backend, "dropped": o.gap.dropped, "runs": o.gap.runs}
            )
        except Exception as exc:  # the gap is also on stderr; the record is a convenience
            print(f"warning: could not record the tracking gap in {self.store.url}/{GAPS}: {exc}", file=sys.stderr)


def record_of(store: Store) -> tuple[list[dict], list[dict]]:
    """The campaign's events and ledger records, as written."""
    return list(store.read_log(EVENTS)), Ledger(store).records()


EVAL_ARTIFACTS = ("eval/report.md", "eval/curves.png", "eval/metrics.json")


def eval_points(store: Store, feed: Feed, metrics: dict) -> list[Point]:
    """`soma eval`'s numbers (at the evaluation's count in the ledger) and its files as artifacts."""
    t = time.time()
    files = [Artifact(name.split("/", 1)[1], store.read_bytes(name)) for name in EVAL_ARTIFACTS if store.exists(name)]
    return feed.evaluation(metrics, t) + files


def track_stage(
    store: Store,
    cfg: CampaignConfig,
    stage: Stage,
    state: str,
    metrics: dict | None = None,
    tags: dict[str, str] | None = None,
    experiment: str | None = None,
) -> None:
    """A stage outside the driver loop (prepare, eval): its tag, `soma eval`'s `metrics` and files, `tags` for the
    parent run, through a short-lived Tracker (the record replayed first: the parent run exists, holds the
    campaign's parameters, and what a tracker missed of the record is sent)."""
    tracker = Tracker.open(store, cfg, experiment)
    if tracker is None:
        return
    events, ledger = record_of(store)

    def extra(feed: Feed) -> list[Point]:
        out: list[Point] = feed.stage(stage, state)
        out += [Tag(PARENT, TAG + k, v) for k, v in (tags or {}).items()]
        return out + (eval_points(store, feed, metrics) if metrics is not None else [])

    tracker.start(events, ledger, extra)
    tracker.close()
