"""The driver's Ray loop: it starts and kills actors, waits for their results and hands them to the
Scheduler (soma_cluster/schedule.py), which makes every decision and writes every transition. Nothing
here decides; everything here touches Ray.

Demand the autoscaler can see: besides the actors the cluster's GPUs hold now, the driver keeps up to
resources.max_pending more asked of Ray (all remaining jobs by default). They wait in Ray's queue,
where the cluster launcher's or KubeRay's autoscaler sees them and adds nodes; they cost nothing until
Ray places them (an actor's clock starts when its process holds its GPU share), and they disappear with
the driver, so a lost driver leaves no standing demand behind.
"""

from __future__ import annotations

import math
import re
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import replace
from typing import Iterator

import ray
from ray.exceptions import (
    ActorUnavailableError,
    GetTimeoutError,
    NodeDiedError,
    OutOfMemoryError,
    RayActorError,
    RayTaskError,
)
from rich.table import Table

from pipelines.campaign_lease import held, hold, holding, refuse_held
from pipelines.common import console, fit_info, frozen_heap, info_room, load_config, open_store, progress
from pipelines.metrics import CampaignMetrics
from pipelines.rayaddress import ray_address
from pipelines.raysession import ray_session
from pipelines.reopen import check_retrain, reopen_failed, reopen_retrain, reopen_unverified
from pipelines.revision_pickup import LiveRevisions, log_applied, pending, reopened_names, take_up
from pipelines.stopping import STOP, Stopped
from pipelines.tracking import Tracker
from soma_cluster.budget import BudgetBook
from soma_cluster.campaignfile import CONFIG_FILE, load_campaign_config
from soma_cluster.checkpoint import latest_meta, training_bytes
from soma_cluster.config import CampaignConfig
from soma_cluster.costmodel import PLAN
from soma_cluster.errors import JobsFailed, SomaError, StoppedByEnvironment, StorageUnreachable
from soma_cluster.eta import Eta, Prior
from soma_cluster.events import history, require_seed
from soma_cluster.failures import (
    WORDS,
    actor_death_cause,
    exception_cause,
    node_of,
    select_failed,
    stop_line,
    waiting,
)
from soma_cluster.jobcurves import write_curves
from soma_cluster.jobs import (
    SEED_JOB,
    TERMINAL,
    Cause,
    Job,
    JobState,
    LostAs,
    expert_jobs,
    expert_name,
)
from soma_cluster.lease import LeaseLost
from soma_cluster.ledger import Ledger
from soma_cluster.messages import SetupReport
from soma_cluster.revisions import check as check_revision
from soma_cluster.revisions import record as record_revision
from soma_cluster.schedule import POLL_S, Action, Chunk, Lost, Reuse, Scheduler, Start, Stop
from soma_cluster.snapshot import (
    SNAPSHOT,
    build,
    fmt_duration,
    history_rows,
    loss_text,
    newest_losses,
    scheduler_rows,
    summary_line,
)
from soma_cluster.statusview import experts_text, ranges_within
from soma_cluster.storage import Store
from soma_cluster.trackpoints import Stage
from workers import actor_name, start_worker

FLUSH_S = 0.25  # group commit: held log records are made durable at least this often
SLOTS_REFRESH_S = 5.0  # how stale the cluster's GPU count may be (nodes join and leave over minutes)
QUEUED_POLL_S = 0.2  # how soon an actor Ray has just placed is seen (its setup report), while others run
TRACEBACK_CHARS = 4000  # of a worker's traceback, kept in its `failed` event
STATUS_S = 5.0  # status.json (and the metrics) are rewritten this often: one small PUT, never a log re-read
LOG_EVERY_S = 30.0  # without a progress bar, one summary line this often (a log collector's view)
ANSI = re.compile(r"\x1b\[[0-9;]*m")  # Ray colours the task name in an error's text
# what a ray.get of an actor's call raises when the actor is gone (RayTaskError: its code raised)
LOST_ERRORS = (RayActorError, RayTaskError, GetTimeoutError, OutOfMemoryError, NodeDiedError)
NODE_CHECK_S = 1.0  # an actor died on a node Ray still calls alive: how long to watch whether the node follows it


def eta_prior(store: Store, stage: str) -> Prior | None:
    """What the plan (plan/plan.json, if one was made) predicts of one actor of `stage`: the ETA's prior."""
    try:
        return Prior.of_plan(store.read_json(PLAN), stage) if store.exists(PLAN) else None
    except (SomaError, OSError, ValueError, KeyError, TypeError) as exc:  # a view's input: never a reason to stop
        print(f"warning: {store.url}/{PLAN} not used for the ETA: {exc}", file=sys.stderr, flush=True)
        return None


def also_ready(first: list, rest: list) -> list:
    """`first` (what a blocking ray.wait returned) and, if it holds one, every ref of `rest` ready now (no waiting)."""
    return first + (ray.wait(rest, num_returns=len(rest), timeout=0)[0] if first and rest else [])


def lost_actor(exc: RayActorError | OutOfMemoryError | NodeDiedError) -> Lost:
    """An actor that died: a node the autoscaler drained for preemption is not a failure; a dead node, an unreachable
    actor or Ray's memory monitor is the infrastructure's (soma_cluster/failures.py); a process that died on a live
    node (SIGKILL, the kernel's OOM killer, a crash) is the expert's."""
    first = str(exc).splitlines()[0][:200] if str(exc) else ""
    if getattr(exc, "preempted", False):
        return Lost(LostAs.PREEMPTED, f"node drained: {type(exc).__name__}: {first}", Cause.PREEMPTED)
    if isinstance(exc, OutOfMemoryError):
        cause = Cause.OUT_OF_MEMORY
    elif isinstance(exc, (NodeDiedError, ActorUnavailableError)):
        cause = Cause.NODE_LOST
    else:
        cause = actor_death_cause(str(exc))
    what = LostAs(cause) if cause.infra else LostAs.ACTOR_DIED  # the expert's crash reads as it always did
    return Lost(what, f"{type(exc).__name__}: {first}", cause)


def node_died(node_id: str, wait_s: float = NODE_CHECK_S) -> bool:
    """Whether Ray's GCS marks the node dead within `wait_s`. A node's death can reach the driver first as its
    workers' deaths (the raylet stops them as it goes): an actor death that says nothing of its node is checked
    here before it is taken for the expert's own crash. A node the GCS declares dead later than that (a cluster's
    health checks can take longer) is counted as a crash, as it was before."""
    deadline = time.monotonic() + wait_s
    while True:
        state = {n["NodeID"]: n["Alive"] for n in ray.nodes()}
        if not state.get(node_id, True):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def lost_task(exc: RayTaskError) -> Lost:
    """An exception in the worker: the infrastructure's (disk full, read-only, permission, storage unreachable) is
    waited out; bad input (a SomaError: a corrupt shard or checkpoint, no CUDA device) ends the job; anything else
    is retried. The traceback goes to the `failed` event and, for the expert's own, to the driver's log."""
    cause = exc.cause if getattr(exc, "cause", None) is not None else exc
    raised = Lost(
        LostAs.EXCEPTION,
        f"{type(cause).__name__}: {str(cause).splitlines()[0][:300] if str(cause) else ''}",
        node=node_of(cause),
    )
    kind = exception_cause(cause)
    trace = ANSI.sub("", str(exc))[-TRACEBACK_CHARS:]
    if kind.infra:
        print(
            f"warning: {WORDS[kind]} in a worker, waited out (retry.infra_wait_s): {raised.reason}",
            file=sys.stderr,
            flush=True,
        )
        return Lost(LostAs(kind), raised.reason, kind, trace, raised.node)
    if kind == Cause.BAD_INPUT:
        return replace(raised, cause=kind, traceback=trace)  # bad input ends the job: its event keeps the why
    print(f"Traceback (most recent call last), in the worker: {raised.reason}\n{trace}", file=sys.stderr, flush=True)
    return replace(raised, cause=kind, traceback=trace)


class SnapshotWriter:
    """Writes status.json from a thread of its own, latest snapshot wins: the loop never waits on the store
    (an S3 outage is retried for up to SOMA_S3_TIMEOUT_S), and a slow write is overtaken, not queued."""

    def __init__(self, store: Store):
        self.store, self._next, self._cv, self._closed = store, None, threading.Condition(), False
        self._thread = threading.Thread(target=self._run, name="soma-status", daemon=True)
        self._thread.start()

    def submit(self, snap: dict) -> None:
        with self._cv:
            self._next = snap
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._next is None and not self._closed:
                    self._cv.wait()
                snap, self._next = self._next, None
                if snap is None:
                    return
            try:
                self.store.write_json(SNAPSHOT, snap)
            except Exception as exc:  # the status view never stops a campaign
                print(f"warning: could not write {self.store.url}/{SNAPSHOT}: {exc}", file=sys.stderr, flush=True)

    def close(self, timeout_s: float = 30.0) -> None:
        """Write what was submitted last, then stop."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout_s)


class Driver:
    """Runs jobs to an end state on Ray; `run()` returns job name -> how it ended."""

    def __init__(
        self,
        store: Store,
        cfg: CampaignConfig,
        jobs: list[Job],
        show_progress: bool = True,
        actor_factory=start_worker,
        log_every_s: float = LOG_EVERY_S,
    ):
        self.store, self.cfg, self.jobs = store, cfg, jobs
        self.show = show_progress and console.is_terminal  # a bar only where a person watches; else summary lines
        self.log_every_s = log_every_s
        self.start_actor = actor_factory
        # an attempt lost to a store outage is settled against its checkpoint, read once the store answers again
        self.sched = Scheduler(
            store,
            cfg,
            jobs,
            latest=lambda job: waiting(
                lambda: latest_meta(store, job.model_dir), cfg.retry.infra_wait_s, f"reading {job.model_dir}"
            ),
        )
        self.actors: dict[int, object] = {}  # unit id -> its actor handle
        self.inflight: dict[int, object] = {}  # unit id -> the one call it is running (setup or a chunk)
        self.placing: dict[int, object] = {}  # unit id -> its `holding` call, for actors asked of Ray's queue
        self._placing_polled = -math.inf
        # what the campaign was prepared with names it (actors, metrics): a revision (soma set) does not rename it
        self.campaign_id = (load_campaign_config(store) if store.exists(CONFIG_FILE) else cfg).digest()[:8]
        self._gpus, self._gpus_at = 0.0, -math.inf  # cluster GPUs, and when they were last read
        self._queued_polled = -math.inf
        self.metrics = CampaignMetrics(store.url, cfg.name, self.campaign_id)
        self.others: dict[str, dict] = {}  # status rows of the campaign's jobs this driver does not run
        self.started_at: float | None = None
        self._reported = self._logged = -math.inf
        self._writer: SnapshotWriter | None = None
        self.eta = Eta()  # the ETA's estimator (soma_cluster/eta.py), fed the heartbeats as they are written
        self._eta_s: float | None = None  # the last snapshot's, for the progress bar
        self._experts: dict | None = None  # the last snapshot's experts (statusview.experts_view), for the bar
        self.sched.observe = self._observe
        self.lease = held(store.url)  # the campaign's lease, whose generation fences the workers
        self.stopped: str | None = None  # why this driver stopped before its jobs ended (a signal, lease lost)
        self.tracker: Tracker | None = None  # the experiment trackers it feeds (pipelines/tracking.py), if any
        self.revising: LiveRevisions | None = None  # config revisions (soma set) written while it runs

    @property
    def outcome(self) -> dict[str, JobState]:
        return {job.name: end for job, end in self.sched.outcome.items()}

    @property
    def bad_input(self) -> dict[str, str]:
        """job name -> the reason its attempt's `failed` event gives."""
        return {job.name: lost.reason for job, lost in self.sched.bad_input.items()}

    # -- capacity ---------------------------------------------------------------------------------------
    def _slots(self) -> int:
        """Actors the cluster's GPUs hold now (0 on a cluster that has yet to add its first GPU node)."""
        # cluster_resources() is a GCS round trip (~1-8 ms): re-read it every SLOTS_REFRESH_S, not every loop
        now = time.monotonic()
        if now - self._gpus_at > SLOTS_REFRESH_S:
            self._gpus, self._gpus_at = ray.cluster_resources().get("GPU", 0.0), now
        return int(math.floor(self._gpus / self.cfg.resources.num_gpus + 1e-9))

    def _capacity(self) -> float:
        """Actors to keep queued or running: what the GPUs present hold (at least one), plus the demand shown to an
        autoscaler (resources.max_pending; all remaining jobs by default), at most resources.max_actors."""
        r = self.cfg.resources
        extra = r.max_pending if r.max_pending is not None else (0 if r.reuse_actors else math.inf)
        return min(max(1, self._slots()) + extra, r.max_actors or math.inf)

    # -- carrying out the scheduler's actions ---------------------------------------------------------
    def _apply(self, actions: list[Action]) -> None:
        for a in actions:
            uid = a.unit.id
            if isinstance(a, Start):
                self.actors[uid] = self._start(a)
                # asked beyond the GPUs present, it waits in Ray's queue: once placed, its start-up clock runs (a
                # budget counts it) and it holds a GPU (status counts it as running, `starting`, not queued)
                if a.unit.held_since is None:
                    self.placing[uid] = self.actors[uid].holding.remote()
                self.inflight[uid] = self.actors[uid].setup.remote()
            elif isinstance(a, Reuse):
                self.actors[uid] = self.actors.pop(a.actor_of)
                self.inflight[uid] = self.actors[uid].setup.remote(
                    [j.expert for j in a.unit.jobs], [c.attempt for c in a.unit.accounts.values()]
                )
            elif isinstance(a, Chunk):
                self.inflight[uid] = self.actors[uid].run_chunk.remote(a.updates, a.caps, a.targets)
            elif isinstance(a, Stop):
                self.inflight.pop(uid, None)
                self.placing.pop(uid, None)
                actor = self.actors.pop(uid, None)
                if actor is not None:
                    ray.kill(actor, no_restart=True)

    def _start(self, a: Start):
        r, unit = self.cfg.resources, a.unit
        attempts = [c.attempt for c in unit.accounts.values()]
        return self.start_actor(
            campaign_url=self.store.url,
            storage_options=self.store.storage_options,
            experts=[j.expert for j in unit.jobs],
            attempts=attempts,
            num_gpus=r.num_gpus,
            num_cpus=r.num_cpus,
            name=actor_name(self.campaign_id, unit.name, attempts[0]),
            placement=r.placement,
            requested_at=time.time(),
            granted=unit.granted,
            previous=unit.previous,
            lease_generation=self.lease.generation if self.lease else None,
            avoid_nodes=unit.avoid,
        )

    def _placed(self) -> None:
        """Actors that waited in Ray's queue and now hold their GPU share: the scheduler learns since when (the
        worker's own clock start), so their start-up counts against their budget and the status counts them as
        starting. Polled every QUEUED_POLL_S."""
        now = time.monotonic()
        if not self.placing or now - self._placing_polled < QUEUED_POLL_S:
            return
        self._placing_polled = now
        refs = list(self.placing.values())
        ready = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0])
        for uid, ref in [(u, r) for u, r in self.placing.items() if r in ready]:
            del self.placing[uid]
            try:
                held_from = ray.get(ref, timeout=60)
            except (RayActorError, RayTaskError, GetTimeoutError):
                continue  # its setup call reports the loss
            self.sched.on_placed(uid, time.time() - held_from)

    def _collect(self, uid: int, ref, result=None) -> list[Action]:
        if result is None:
            try:
                result = ray.get(ref, timeout=60)
            except (RayActorError, OutOfMemoryError, NodeDiedError) as exc:
                return self.sched.on_lost(uid, self._lost_actor(uid, exc))
            except RayTaskError as exc:
                if isinstance(getattr(exc, "cause", None), LeaseLost) and self.lease is not None:
                    # the worker found the lease changed: the driver's own compare-and-swap decides (LeaseLost here
                    # too); if the driver still holds it, the worker is retried like any loss, never as bad input
                    self.lease.check(now=True)
                    return self.sched.on_lost(uid, Lost(LostAs.EXCEPTION, str(exc.cause), Cause.EXCEPTION))
                return self.sched.on_lost(uid, lost_task(exc))
            except GetTimeoutError:
                return self.sched.on_lost(uid, Lost(LostAs.HANG, "result not retrievable", Cause.HANG))
        if isinstance(result, SetupReport):
            return self.sched.on_setup(uid, result)
        return self.sched.on_chunk(uid, result)

    def _lost_actor(self, uid: int, exc: RayActorError | OutOfMemoryError | NodeDiedError) -> Lost:
        """lost_actor, with a crash on a node that turns out to be dead taken for the node's loss."""
        lost, process = lost_actor(exc), self.sched.units[uid].process
        if lost.cause == Cause.CRASH and process is not None and process.node and node_died(process.node):
            return Lost(LostAs.NODE_LOST, f"its node {process.node[:12]} died: {lost.reason}", Cause.NODE_LOST)
        return lost

    # -- main loop ------------------------------------------------------------------------------------
    def run(self) -> dict[str, str]:
        hist = history(self.store)
        self.tracker = self._open_tracker(hist)  # before restore: the events it writes are tracked too
        try:
            return self._run(hist)
        finally:
            if self.tracker is not None:  # bounded by tracking.drain_s; a fenced driver writes no gap record
                self.tracker.stage(self._stage, "finished" if self.sched.finished and not self.stopped else "stopped")
                self.tracker.close(record=self.stopped != "lease lost")

    def _open_tracker(self, hist: dict) -> Tracker | None:
        """The campaign's experiment trackers (tracking.backends), fed from the records this driver writes: the
        scheduler's events and ledger records are handed to it as written (it only enqueues)."""
        tracker = Tracker.open(self.store, self.cfg)
        if tracker is None:
            return None
        tracker.start([ev for h in hist.values() for ev in h.events], Ledger(self.store).records())
        self.sched.books.ledger.observe = tracker.on_ledger
        tracker.stage(self._stage, "running")
        return tracker

    @property
    def _stage(self) -> Stage:
        return Stage.SEED if self.jobs == [SEED_JOB] else Stage.LAUNCH

    def _run(self, hist: dict) -> dict[str, str]:
        self.sched.restore(hist)
        self.revising = LiveRevisions(self.store)
        mine = set(self.jobs)
        self._learn_eta(hist, mine)
        self.others = history_rows(
            self.cfg,
            hist,
            self.sched.books.at_start,
            [j for j in [SEED_JOB] + expert_jobs(self.cfg.n_experts) if j not in mine],
        )
        self.started_at = time.time()
        self._writer = SnapshotWriter(self.store)
        if self.sched.outcome:
            console.print(f"{len(self.sched.outcome)} job(s) already ended in this campaign; not retraining them")
        # at most as many at once as the GPUs hold and as there are jobs left to run
        concurrent = max(1, min(self._slots(), len(self.sched.pending)))
        per, total = self.sched.book.worst_overrun_s(self.cfg.resources.num_gpus, POLL_S, concurrent)
        if self.sched.book.budgeted:
            console.print(
                f"budget: a worker stops before a chunk it cannot afford; any expert past its cap, start-up included, "
                f"is hard-stopped within {per:.1f} GPU-s per expert, {total:.1f} for the campaign (grace "
                f"{self.cfg.budget.grace_gpu_seconds} GPU-s + one {POLL_S} s poll, {concurrent} concurrent)"
            )
        targets = {
            j.name: self.cfg.seed_stage.updates if j.expert is None else self.cfg.train.updates
            for j in self.sched.pending
        }
        with progress(self.show, fit=True) as bar:
            what = "seed" if self._stage is Stage.SEED else "experts"  # the seed is never among the experts
            overall = bar.add_task(what, total=sum(targets.values()), info="")
            tasks = {n: bar.add_task(n, total=t, info="") for n, t in targets.items()} if len(targets) <= 16 else {}
            # group commit: the records of every result in FLUSH_S go out in one durable write per log, written
            # by a background thread so the loop never waits on the disk or the object store
            # a SIGINT/SIGTERM only sets STOP.requested here: the loop ends between two results, with the state whole
            wait_s = self.cfg.retry.infra_wait_s  # the log writer waits out its disk or store this long
            self.store.outage_wait = None  # the preparations are over (`preparing`): from here the loop's own waits
            with (
                STOP.cooperative(),
                self.store.batch(background=True, retry=lambda write, what: waiting(write, wait_s, what)),
                frozen_heap(),
            ):
                flushed = time.monotonic()
                try:
                    while not self.sched.finished and STOP.requested is None:
                        self._sweep()
                        if time.monotonic() - flushed >= FLUSH_S:
                            self.store.flush(wait=False)
                            flushed = time.monotonic()
                        if self.show:
                            self._show(bar, overall, tasks, targets)
                        self._report()
                except LeaseLost:
                    self.stopped = "lease lost"
                    raise
                finally:
                    for actor in self.actors.values():  # on an error in the loop, leave no actor behind
                        ray.kill(actor, no_restart=True)
                    if STOP.requested is not None and self.stopped is None:
                        self.stopped = Stopped(STOP.requested).name
                    if self.stopped == "lease lost":  # a fenced driver writes nothing more
                        self._writer.close()
                    else:
                        self._last_report()
                        self._last_show(bar, overall, tasks, targets)
        self._write_curves()
        if self.sched.book.expert_s is not None:
            self._say_overruns()
        return self.outcome

    def _learn_eta(self, hist: dict, mine: set[Job]) -> None:
        """The ETA starts from what earlier drivers of these jobs measured (a resume), else from the plan's
        prediction (plan/plan.json, if one was made), else from nothing (no ETA until the first samples)."""
        self.eta.prior = eta_prior(self.store, "seed" if self.jobs == [SEED_JOB] else "experts")
        names = {j.name for j in mine}
        for ev in sorted((e for h in hist.values() if h.job in names for e in h.events), key=lambda e: e["t"]):
            self.eta.record(ev)
        self.eta.restart()

    def _last_report(self) -> None:
        """The driver's last snapshot (final only if every job ended), written before the driver returns or raises;
        a failure here is logged, never raised over the loop's own error."""
        try:
            self._report(final=True)
        except Exception as exc:
            console.print(f"warning: could not make the last status snapshot: {exc}", markup=False)
        self._writer.close()

    def _last_show(self, bar, overall, tasks, targets) -> None:
        """The bar's last state, from the last snapshot (the counts at the end, not 5 s before it); a view, so a
        failure here is logged, never raised over the loop's own error."""
        if not self.show:
            return
        try:
            self._show(bar, overall, tasks, targets)
        except Exception as exc:
            console.print(f"warning: could not update the progress bar: {exc}", markup=False)

    def _write_curves(self) -> None:
        """curves/<job>.csv for this driver's jobs, from the events log (complete across retries and resumes)."""
        try:
            write_curves(self.store, history(self.store), [j.name for j in self.jobs])
        except Exception as exc:  # a curve is a view: never a reason for a campaign to fail
            console.print(f"warning: could not write the training curves: {exc}", markup=False)

    def snapshot(self, final: bool = False) -> dict:
        """The campaign's status now (soma_cluster/snapshot.py): every job of the campaign, seed first."""
        rows = {**self.others, **scheduler_rows(self.sched)}
        order = [j.name for j in [SEED_JOB] + expert_jobs(self.cfg.n_experts)]
        return build(
            cfg=self.cfg,
            url=self.store.url,
            rows={n: rows[n] for n in order if n in rows},
            by_category_s=self.sched.books.totals.gpu_seconds,
            devices=self.sched.books.totals.devices,
            started_at=self.started_at,
            rate=None,
            estimate=self._eta_of,
            final=final,
            source="driver",
            running={j.name for j in self.jobs},
            driver=self._driver_info(final),
            usd=self.sched.books.totals.usd if self.sched.books.totals.usd_priced else None,
            unpriced_s=self.sched.books.totals.unpriced_gpu_seconds,
        )

    def _driver_info(self, final: bool) -> dict:
        """Who writes this snapshot, and whether it is running, ended (its jobs all ended) or stopped before they did
        (then its in-flight jobs show as `interrupted`, not `running`: nothing runs them until the next resume)."""
        holder = self.lease.record.holder if self.lease and self.lease.record else None
        state = "stopped" if self.stopped else "ended" if final else "running"
        return {
            "state": state,
            "stopped_by": self.stopped,
            "host": holder.host if holder else None,
            "pid": holder.pid if holder else None,
            "lease_generation": self.lease.generation if self.lease else None,
        }

    def _observe(self, rec: dict) -> None:
        """Each event the scheduler writes feeds the ETA, and goes to the trackers, if any."""
        self.eta.record(rec)
        if self.tracker is not None:
            self.tracker.on_event(rec)

    def _eta_of(self, rows: list[dict]) -> float | None:
        """Seconds until this driver's unended jobs (`rows`, in the order they start) end, each after a start-up and
        its updates (those its budget left affords), in as many lanes as the GPUs hold (resources.max_actors for
        those not yet asked of Ray) (soma_cluster/eta.py)."""
        left = {r["job"]: r["target"] - r["step"] for r in rows if r["state"] not in TERMINAL}
        running = {r["job"] for r in rows if r["state"] == JobState.RUNNING}
        r = self.cfg.resources
        per = 1 if self.jobs == [SEED_JOB] else r.experts_per_actor
        caps = {row["job"]: row["budget_left_gpu_hours"] for row in rows}  # GPU-hours, None: no cap
        caps_s = {j: None if h is None else h * 3600.0 for j, h in caps.items()}
        lanes, most = max(1, self._slots()) * per, None if r.max_actors is None else r.max_actors * per
        reuse = r.reuse_actors and self.jobs != [SEED_JOB]
        return self.eta.seconds_left(left, running, lanes, time.time(), caps_s, r.num_gpus / per, most, reuse)

    def _report(self, final: bool = False) -> None:
        """Every STATUS_S (and at the end): status.json, the metrics and, without a bar, a summary line."""
        now = time.monotonic()
        if not final and now - self._reported < STATUS_S:
            return
        self._reported = now
        snap = self.snapshot(final=final and self.sched.finished)
        self._eta_s = 0.0 if snap["final"] else snap["eta_s"]
        self._experts = snap["experts"]
        self._writer.submit(snap)
        self.metrics.update(snap)
        if final:
            self.metrics.flush()
        if not self.show and (final or now - self._logged >= self.log_every_s):
            self._logged = now
            console.print(summary_line(snap), soft_wrap=True, markup=False)

    def _say_overruns(self) -> None:
        """Measured against bound, for the experts a per-expert cap stopped."""
        stopped = {
            j.expert
            for j, end in self.sched.outcome.items()
            if end == JobState.BUDGET_EXHAUSTED and j.expert is not None
        }
        totals = self.sched.books.totals
        over = self.sched.book.overruns(totals.per_expert_gpu_seconds, totals.per_expert_largest)
        over = {e: o for e, o in over.items() if e in stopped}
        if over:
            e, worst = max(over.items(), key=lambda kv: kv[1].gpu_s)
            per, _ = self.sched.book.worst_overrun_s(self.cfg.resources.num_gpus, POLL_S, 1)
            if worst.gpu_s <= 0:
                console.print(
                    f"budget: {len(over)} expert(s) stopped by their cap, none past it (closest "
                    f"{worst.gpu_s:+.2f} GPU-s, {expert_name(e)})"
                )
                return
            console.print(
                f"budget: {len(over)} expert(s) stopped by their cap; largest overrun {worst.gpu_s:+.2f} GPU-s "
                f"({expert_name(e)}; hard-stop bound {per:.2f}); {sum(o.gpu_s > per for o in over.values())} past it"
            )

    def _revise(self) -> None:
        """A revision written while this driver runs (soma set): in force from this poll on. Caps reach every
        worker with its next chunk (a lowered one stops it there, budget_exhausted, with a checkpoint), targets too;
        ended experts it lets train on are pending again."""
        found = self.revising.poll() if self.revising is not None else None
        if found is None:
            return
        new, revs = found
        ended = {j: (end, self.sched.seen[j].step) for j, end in self.sched.outcome.items()}
        names = set(reopened_names(ended, self.cfg, new))
        self.sched.revise(new, [j for j in self.sched.outcome if j.name in names])
        self.cfg = new
        log_applied(self.store, revs, self.sched.observe)
        self.store.flush(wait=False)  # `soma set --wait` reads it: durable now, not at the next group commit
        for r in revs:
            console.print(f"config revision {r.rev} applied ({r.by}): {r.line()}", markup=False)
        if names:
            console.print(f"{len(names)} ended expert(s) train on: {', '.join(sorted(names)[:8])}", markup=False)

    def _sweep(self) -> None:
        self._revise()
        self._apply(self.sched.requests(self._capacity(), self._slots()))
        if self.inflight:
            owner = {ref: uid for uid, ref in self.inflight.items()}
            ready = self._ready()
            try:  # one call for every ready result; on any error, each on its own
                results = ray.get(ready, timeout=60)
            except LOST_ERRORS:
                results = [None] * len(ready)
            for ref, result in zip(ready, results, strict=True):
                uid = owner[ref]
                if self.inflight.get(uid) is ref:  # not stopped meanwhile
                    del self.inflight[uid]
                    self.placing.pop(uid, None)
                    self._apply(self._collect(uid, ref, result))
        else:
            now = time.monotonic()
            time.sleep(min(POLL_S, max(0.0, min(self.sched.retries.at.values(), default=now) - now)))
        self._placed()
        self._apply(self.sched.watchdog())

    def _ready(self) -> list:
        """Results to handle now. The blocking wait covers running actors only: queued ones (up to every remaining
        job, waiting for a GPU or a node) report once, when Ray places them, and are polled without blocking at
        most every QUEUED_POLL_S, so the loop's cost per heartbeat does not grow with the queue."""
        running, queued = [], []
        for uid, ref in self.inflight.items():
            (running if self.sched.units[uid].phase == JobState.RUNNING else queued).append(ref)
        if not running:
            return self._wait(queued)
        ready = self._wait(running)
        now = time.monotonic()
        if queued and now - self._queued_polled >= QUEUED_POLL_S:
            self._queued_polled = now
            ready += ray.wait(queued, num_returns=len(queued), timeout=0)[0]
        return ready

    def _wait(self, refs: list) -> list:
        """Block until a result is ready (at most POLL_S), then take every other one that is ready too."""
        return also_ready(*self._block(refs))

    @staticmethod
    def _block(refs: list) -> tuple[list, list]:
        """The loop's only blocking call: (the first ready ref or none within POLL_S, the others)."""
        return ray.wait(refs, num_returns=1, timeout=POLL_S)

    def _show(self, bar, overall, tasks, targets) -> None:
        steps = {n: (t if self.outcome.get(n) == JobState.FINISHED else 0) for n, t in targets.items()}
        steps |= {job.name: unit.accounts[job].step for job, unit in self.sched.open.items()}
        views = {job.name: view for job, view in self.sched.seen.items()}
        rows = [{"loss": v.loss, "val": v.val} for v in views.values()]
        room = info_room(console.width, [t.description for t in bar.tasks], sum(targets.values()))
        for name, task in tasks.items():  # a job's losses where they fit (they go before the bar wraps)
            view = views.get(name)
            info = loss_text(view.loss, view.val) if view is not None and view.loss is not None else ""
            bar.update(task, completed=steps.get(name, 0), info=fit_info([info], room))
        eta = f"ETA {'-' if self._eta_s is None else fmt_duration(self._eta_s)}"
        losses = loss_text(*newest_losses(rows))
        if self._stage is Stage.SEED or self._experts is None:
            said = [f"{eta}  {losses}", eta]
        else:
            v = self._experts
            brief = f"{v['counts'].get(JobState.RUNNING, 0) + v['starting']} running, {v['ended']}/{v['n']} ended"
            said = [f"{experts_text(v)}, {eta}  {losses}", f"{brief}, {eta}  {losses}", f"{brief}, {eta}", eta]
        bar.update(overall, completed=sum(steps.values()), info=fit_info(said, room))


@holding("soma launch")
def launch(
    store: Store,
    cfg: CampaignConfig,
    show_progress: bool = True,
    log_every_s: float = LOG_EVERY_S,
    retry_failed: list[str] | None = None,
    retrain: list[str] | None = None,
    from_step: int | None = None,
) -> dict[str, str]:
    """Train every expert not yet ended (this is also `soma resume`). Needs a finished seed. With `retry_failed`
    (`soma resume --retry-failed`), the experts that failed permanently (all of them for [], else the named ones)
    are reopened first; with `retrain` (`--retrain`), the named ones train again from the seed or `from_step`.
    Raises SomaError on bad input, StoppedByEnvironment when the infrastructure stayed broken past
    retry.infra_wait_s, and JobsFailed when experts failed permanently."""
    require_seed(store)
    if retry_failed is not None:
        reopen_failed(store, expert_jobs(cfg.n_experts), retry_failed)
    if retrain:
        reopen_retrain(store, expert_jobs(cfg.n_experts), retrain, from_step)
    # an expert is finished only while its last checkpoint verifies
    reopen_unverified(store, expert_jobs(cfg.n_experts))
    take_up(store, cfg, lambda line: console.print(line, markup=False))  # revisions written while no driver ran
    refuse_spent(store, cfg)  # checked before the lease too (check_launch): here against what the reopens wrote
    r = cfg.resources
    console.print(
        f"launching {cfg.n_experts} experts: {r.num_gpus} GPU + {r.num_cpus} CPU each, {cfg.train.updates} updates, "
        f"heartbeat every {cfg.train.chunk_updates} updates, up to {cfg.retry.max_retries} retries"
    )
    driver = Driver(store, cfg, expert_jobs(cfg.n_experts), show_progress, log_every_s=log_every_s)
    outcome = run_driver(driver)
    console.print(ended_line(outcome), markup=False)
    console.print(ended_table(outcome, {j.name: v for j, v in driver.sched.seen.items()}))
    raise_failures(driver, "experts")
    return outcome


def refuse_spent(store: Store, cfg: CampaignConfig, reopening: frozenset[str] = frozenset()) -> None:
    """The scheduler's own arithmetic (GPU-seconds), asked before Ray starts: a campaign whose budget is spent while
    experts would train (not ended, or `reopening`) is refused, not launched."""
    spent_s = sum(Ledger(store).totals().gpu_seconds.values())
    left_s = BudgetBook(cfg.budget).left(None, 0.0, spent_s)
    hist = history(store)
    unended = [j for j in expert_jobs(cfg.n_experts) if not (j.name in hist and hist[j.name].terminal)]
    if left_s is not None and left_s <= 0 and (unended or reopening):
        raise SomaError(
            f"campaign budget budget.campaign_gpu_hours={cfg.budget.campaign_gpu_hours} is already spent "
            f"({spent_s / 3600.0:.4f} GPU-hours in the ledger); start a new campaign with a larger budget"
        )


def check_launch(
    store: Store,
    cfg: CampaignConfig,
    retry_failed: list[str] | None,
    retrain: list[str],
    from_step: int | None,
    sets: list[str],
) -> None:
    """Everything `soma launch` and `soma resume` refuse, checked by reading only, before the lease is taken: a seed
    not trained, experts named that are not there (or did not fail, for --retry-failed), a --from-step without its
    checkpoints, a revision refused, and a budget that the revision leaves spent while experts would train."""
    after = check_revision(cfg, sets, driver_running=False, origin="--set")[1] if sets else cfg  # arguments first
    require_seed(store)
    names = [j.name for j in expert_jobs(cfg.n_experts)]
    reopening = set(check_retrain(store, expert_jobs(cfg.n_experts), retrain, from_step) if retrain else [])
    if retry_failed is not None:  # one named that did not fail is bad input
        reopening |= set(select_failed({n: h.state for n, h in history(store).items()}, names, retry_failed))
    refuse_spent(store, after, frozenset(reopening | set(pending(store, after)[1])))


def launch_command(
    campaign: str,
    address: str | None,
    show_progress: bool,
    log_every_s: float,
    command: str,
    take_over: bool,
    retry_failed: list[str] | None = None,
    retrain: list[str] | None = None,
    from_step: int | None = None,
    sets: list[str] | None = None,
) -> None:
    """`soma launch` and `soma resume`: every refusal of check_launch (the seed, the experts named, --from-step, the
    revision, the budget) and the Ray address come before the lease is taken; the place and its room (hold) before
    Ray starts or any expert is queued. Then the revision is recorded, as soma set would write it, and the campaign
    runs. Once the store has answered (campaign.yaml read), an outage of it is waited out (`preparing`); a store
    that never answers is reported as before, after SOMA_S3_TIMEOUT_S (exit 2: a wrong endpoint looks the same)."""
    store = open_store(campaign)
    cfg = load_config(store)
    with preparing(store, cfg.retry.infra_wait_s):
        refuse_held(store, command, take_over)  # another driver's work first: it may be why the seed is missing
        addr = ray_address(address)  # the command's own arguments before the campaign's state
        check_launch(store, cfg, retry_failed, list(retrain or []), from_step, list(sets or []))
        with hold(store, command, take_over, training_bytes(cfg, cfg.n_experts)):
            if sets:
                rev = record_revision(store, load_campaign_config(store), list(sets), driver_running=False)
                print(f"revision {rev.rev}: {rev.line()}", file=sys.stderr)
                cfg = load_config(store)
            with ray_session(cfg, addr):
                launch(store, cfg, show_progress, log_every_s, retry_failed, retrain, from_step)


PREPARATION_WAITS = frozenset({Cause.STORAGE_UNREACHABLE})  # what a launch's preparations wait out


class OutageWait:
    """Store.outage_wait for a launch's preparations: each storage call that finds the store unreachable past its own
    retries (SOMA_S3_TIMEOUT_S) is tried again for up to retry.infra_wait_s, by the loop's own mechanism
    (failures.waiting). Only an unreachable store is waited out: a missing bucket, denied access or a bad URL fail
    at once, as bad input. Once a call has waited the whole bound, the command is stopping: later calls (the
    lease's release on the way out) try once, so the stop is not delayed by a second wait."""

    def __init__(self, wait_s: float):
        self.wait_s = wait_s
        self.gave_up: StorageUnreachable | None = None  # the first call that waited the whole bound in vain
        self.waited_s = 0.0  # and how long it waited

    def __call__(self, call, what: str):
        if self.gave_up is not None:
            return call()
        t0 = time.monotonic()
        try:
            return waiting(call, self.wait_s, what, PREPARATION_WAITS)
        except StorageUnreachable as exc:
            if self.gave_up is None:
                self.gave_up, self.waited_s = exc, time.monotonic() - t0
            raise


@contextmanager
def preparing(store: Store, wait_s: float) -> Iterator[None]:
    """A launch's preparations (what it reads and writes before its driver's loop runs: the lease, the sweeps,
    reopened experts, revisions, the ledger's totals, the history) wait out an unreachable store for up to `wait_s`
    (retry.infra_wait_s), as the loop's writes do; past that, StoppedByEnvironment (exit 4) naming the store, to be
    followed by `soma resume` once it is back. The loop ends the waiting when it begins (Driver._run)."""
    wait = OutageWait(wait_s)
    store.outage_wait = wait
    try:
        yield
    except StorageUnreachable:
        if wait.gave_up is None:  # not the preparations' (a store never reached, or after the loop): as it was
            raise
        first = str(wait.gave_up).splitlines()[0].split("; ")[0][:200]  # the line's fix follows: not the error's hint
        why = f"the driver's own storage call failed before its loop ran: {first}"
        raise StoppedByEnvironment(
            stop_line(Cause.STORAGE_UNREACHABLE, why, "the launch's preparations", wait.waited_s, wait_s, store.url)
        ) from None
    finally:
        store.outage_wait = None


def ended_line(outcome: dict[str, str]) -> str:
    """How the experts ended, as a sentence: '4 experts ended: 3 finished, 1 budget_exhausted (expert-0002).'; past
    four of a kind, their numbers as runs ('(experts 3, 17, 40-44)', what soma status --expert takes)."""
    counts = {k: sorted(n for n, v in outcome.items() if v == k) for k in sorted(set(outcome.values()))}
    parts = [
        f"{len(names)} {state}" + (f" ({_which(names, 40, 'experts ')})" if state != JobState.FINISHED else "")
        for state, names in counts.items()
    ]
    return f"{len(outcome)} expert(s) ended: {', '.join(parts) or 'none'}."


def _which(names: list[str], room: int, prefix: str = "") -> str:
    """Experts by name where they fit in `room` columns (up to four), else `prefix` and their numbers as runs, cut to
    the room."""
    if len(names) <= 4 and len(", ".join(names)) <= room:
        return ", ".join(names)
    numbers = [int(n.rsplit("-", 1)[1]) for n in names if n.startswith("expert-")]
    return prefix + ranges_within(numbers, max(1, room - len(prefix)))


ENDED_COLUMNS = ("ended", "experts", "train", "expert-val", "steps", "which")


def ended_table(outcome: dict[str, str], views: dict, width: int | None = None) -> Table:
    """The experts by end state: how many, which, their newest training and expert-validation loss (mean, nats/byte),
    and the steps they reached; `views`: job name -> its JobView. At `width` columns (default: the console's) `which`
    takes what the others leave, so the table never wraps, whatever N is."""
    rows = []
    for state in sorted(set(outcome.values()), key=lambda s: (s != JobState.FINISHED, s)):
        names = sorted(n for n, v in outcome.items() if v == state)
        seen = [views[n] for n in names if n in views]
        loss, val = newest_losses([{"loss": v.loss, "val": v.val} for v in seen])
        steps = sorted(v.step for v in seen)
        span = "-" if not steps else str(steps[0]) if steps[0] == steps[-1] else f"{steps[0]}-{steps[-1]}"
        rows.append([state, str(len(names)), _nats(loss), _nats(val), span, names])
    need = {c: max([len(c)] + [len(r[i]) for r in rows]) for i, c in enumerate(ENDED_COLUMNS[:-1])}
    cols = list(ENDED_COLUMNS[:-1])
    while True:  # 2: the gap before a column
        room = (console.width if width is None else width) - sum(need[c] + 2 for c in cols)
        if room >= MIN_WHICH or not set(cols) & set(NARROW_DROPS):
            break
        cols.remove(next(c for c in NARROW_DROPS if c in cols))
    table = Table(box=None, pad_edge=False, show_edge=False)
    for col in cols + ["which"]:
        table.add_column(col, justify="left" if col in ("ended", "which") else "right", no_wrap=True)
    for *cells, names in rows:
        table.add_row(*[c for c, col in zip(cells, ENDED_COLUMNS, strict=False) if col in cols], _which(names, room))
    return table


MIN_WHICH = 16  # columns `which` needs to name a run of experts and how many more; below it, NARROW_DROPS go
NARROW_DROPS = ("train", "steps", "expert-val")  # the columns a narrow terminal loses first, in this order


def _nats(v: float | None) -> str:
    return "-" if v is None else f"{v:.4f}"


def run_driver(driver: Driver) -> dict[str, str]:
    """driver.run(); the driver's own writes to the campaign failing for its environment (disk full, read-only,
    storage unreachable past its retries) stop the campaign as the workers' would (exit 4). The records it could not
    write are lost as a crashed driver's are: `soma resume` settles those attempts against their checkpoints."""
    try:
        return driver.run()
    except (OSError, StorageUnreachable) as exc:
        cause = exception_cause(exc)
        if not cause.infra:
            raise
        first = str(exc).splitlines()[0].split("; ")[0][:200]  # the fix follows in the line: not the error's own hint
        why = f"the driver's own storage call failed: {type(exc).__name__}: {first}"
        bound = driver.cfg.retry.infra_wait_s  # its log writer waited that long (soma_cluster/storage.py)
        raise StoppedByEnvironment(stop_line(cause, why, "the driver", bound, bound, driver.store.url)) from None


def raise_failures(driver: Driver, what: str) -> None:
    """A campaign stopped by its environment ends with StoppedByEnvironment (exit 4, whatever else happened: `soma
    resume` after the fix goes on); bad input with SomaError (exit 2); jobs that spent their retries with JobsFailed
    (exit 3)."""
    stop = driver.sched.stopped
    if stop is not None:
        raise StoppedByEnvironment(stop.line(driver.cfg.retry.infra_wait_s, driver.store.url))
    url = driver.store.url
    again = (
        f"soma seed {url} --retry-failed"
        if [j.name for j in driver.jobs] == ["seed"]
        else f"soma resume {url} --retry-failed"
    )
    if driver.bad_input:
        job, lost = next(iter(driver.sched.bad_input.items()))
        more = f" (and {len(driver.bad_input) - 1} more jobs)" if len(driver.bad_input) > 1 else ""
        raise SomaError(f"{job.name} stopped on bad input{more}: {lost.detail} (or fix it in place, then {again})")
    failed = sorted(n for n, end in driver.outcome.items() if end == JobState.FAILED_PERMANENTLY)
    if failed:
        hist = history(driver.store)
        first = hist[failed[0]].last_error if failed[0] in hist else None
        raise JobsFailed(
            f"{len(failed)} {what} failed permanently after {driver.cfg.retry.max_retries} retries "
            f"({', '.join(failed[:4])}{', ...' if len(failed) > 4 else ''}); {failed[0]}: {first}; "
            f"see soma status {url} and its events.jsonl; once the cause is fixed, {again} reopens them"
        )
