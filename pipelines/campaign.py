"""The driver: launch one actor per job (the seed, or each expert), watch heartbeats, account
GPU-seconds, retry failures from checkpoints, enforce budgets. Actors own work; the driver owns
decisions, and writes every transition to the campaign directory.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from pipelines.common import console, progress
from pipelines.events import emit, history
from soma_cluster.config import CampaignConfig
from soma_cluster.errors import SomaError
from soma_cluster.ledger import Ledger
from soma_cluster.shards import expert_name
from soma_cluster.budget import BudgetBook
from soma_cluster.storage import Store
from workers import actor_name, start_worker

POLL_S = 0.5
SLOTS_REFRESH_S = 5.0   # how stale the cluster's GPU count may be (nodes join and leave over minutes)


@dataclass(frozen=True)
class Job:
    role: str          # "seed" or "expert"
    expert: int        # -1 for the seed

    @property
    def name(self) -> str:
        return "seed" if self.role == "seed" else expert_name(self.expert)

    @property
    def category(self) -> str:
        return "seed" if self.role == "seed" else "expert_training"


@dataclass
class Attempt:
    job: Job
    attempt: int
    actor: object
    ref: object = None
    phase: str = "setup"             # "setup" until the actor reports in, then "chunk"
    last_beat: float = field(default_factory=time.monotonic)
    cap_s: float | None = None       # GPU-seconds this attempt may hold (its budget when the chunk was sent)
    reported: dict = field(default_factory=lambda: {"gpu_seconds": 0.0, "wall_seconds": 0.0, "forwards": 0, "tokens": 0})
    ckpt_gpu_s: float = 0.0          # GPU-seconds held at this attempt's last checkpoint
    ckpt_forwards: int = 0           # forwards done by this attempt up to that checkpoint
    seq: int = 0
    step: int = 0
    improving: bool = True


class Driver:
    """Runs jobs to an end state; every transition goes to events.jsonl, every GPU-second to the ledger."""

    def __init__(self, store: Store, cfg: CampaignConfig, jobs: list[Job], show_progress: bool = True, actor_factory=start_worker):
        self.store, self.cfg, self.jobs, self.show = store, cfg, jobs, show_progress
        self.start_actor = actor_factory
        self.ledger = Ledger(store)
        self.book = BudgetBook(cfg.budget)
        self.live: dict[str, Attempt] = {}
        self.retry_at: dict[str, float] = {}
        self.outcome: dict[str, str] = {}
        self.campaign_id = cfg.digest()[:8]
        self._gpus, self._gpus_at = 0.0, -math.inf         # cluster GPUs, and when they were last read
        totals = self.ledger.totals()
        self.spent = dict(totals.per_expert_gpu_seconds)    # running totals, kept in step with every record written
        self.spent_total = sum(totals.gpu_seconds.values())

    # -- ledger + budgets ---------------------------------------------------------------------------------
    def _record(self, category: str, gpu_s: float, wall_s: float, job: Job, attempt: int, seq: int, **kw) -> None:
        expert = job.expert if job.role == "expert" else None
        self.ledger.record(category, gpu_s, wall_s, expert=expert, attempt=attempt, seq=seq, **kw)
        if expert is not None and category in ("expert_training", "wasted"):
            self.spent[expert] = self.spent.get(expert, 0.0) + gpu_s
        self.spent_total += gpu_s

    def _budget_left(self, job: Job) -> float | None:
        """GPU-seconds the job may still spend; the campaign's remainder is shared among the live jobs."""
        expert = job.expert if job.role == "expert" else None
        share = max(1, len(self.live) + (0 if job.name in self.live else 1))
        return self.book.left(expert, self.spent.get(expert, 0.0) if expert is not None else 0.0, self.spent_total, share)

    def _reclassify_lost(self, a: Attempt, lost_s: float, lost_forwards: int, why: str) -> None:
        """Work after the attempt's last checkpoint is lost: move its GPU-seconds and forwards from
        training to wasted (fixed record ids, so doing it twice counts once)."""
        if lost_s > 0 or lost_forwards > 0:
            note = f"lost after checkpoint: {why}"
            self._record(a.job.category, -lost_s, 0.0, a.job, a.attempt, -1, forwards=-lost_forwards, step=a.step, note=note)
            self._record("wasted", lost_s, 0.0, a.job, a.attempt, -1, forwards=lost_forwards, step=a.step, note=note)

    # -- launching ------------------------------------------------------------------------------------
    def _slots(self) -> int:
        # cluster_resources() is a GCS round trip (~1-8 ms): re-read it every SLOTS_REFRESH_S, not every loop
        now = time.monotonic()
        if now - self._gpus_at > SLOTS_REFRESH_S:
            self._gpus, self._gpus_at = ray.cluster_resources().get("GPU", 0.0), now
        return max(1, int(math.floor(self._gpus / self.cfg.resources.num_gpus + 1e-9)))

    def _launch(self, job: Job, attempt: int) -> None:
        left = self._budget_left(job)
        if left is not None and left <= 0:
            self._finish(job, "budget_exhausted", note="budget cannot cover a launch")
            return
        r = self.cfg.resources
        actor = self.start_actor(self.store.url, self.store.storage_options, job.role, job.expert, attempt, r.num_gpus, r.num_cpus,
                                 name=actor_name(self.campaign_id, job.name, attempt), placement=r.placement)
        a = Attempt(job, attempt, actor)
        a.ref = actor.setup.remote()
        self.live[job.name] = a
        emit(self.store, "launched", job.name, attempt=attempt, num_gpus=r.num_gpus)

    def _next_chunk(self, a: Attempt) -> None:
        a.phase = "chunk"
        left = self._budget_left(a.job)
        a.cap_s = None if left is None else left + a.reported["gpu_seconds"]   # the worker compares its own cumulative clock
        a.ref = a.actor.run_chunk.remote(self.cfg.train.chunk_updates, a.cap_s)
        a.last_beat = time.monotonic()

    # -- outcomes -------------------------------------------------------------------------------------
    def _on_heartbeat(self, a: Attempt, hb: dict) -> None:
        a.seq += 1
        delta = {k: hb[k] - a.reported[k] for k in a.reported}
        self._record(a.job.category, delta["gpu_seconds"], delta["wall_seconds"], a.job, a.attempt, a.seq,
                     forwards=delta["forwards"], tokens=delta["tokens"], step=hb["step"])
        a.reported = {k: hb[k] for k in a.reported}
        if hb["val"] is not None:
            a.improving = hb["best_val"] is not None and hb["val"] <= hb["best_val"]
        a.step, a.last_beat = hb["step"], time.monotonic()
        a.ckpt_gpu_s, a.ckpt_forwards = hb["checkpoint_gpu_seconds"], hb["checkpoint_forwards"]
        emit(self.store, "heartbeat", a.job.name, attempt=a.attempt, step=hb["step"], loss=hb["loss"], val=hb["val"],
             gpu_seconds=hb["gpu_seconds"], eps=hb["eps"], lr=hb["lr"])
        if hb["checkpoint"]:
            emit(self.store, "checkpointed", a.job.name, attempt=a.attempt, step=hb["checkpoint_step"], checkpoint=hb["checkpoint"])
        if hb["done"]:
            self._stop(a)
            self._finish(a.job, hb["reason"], step=hb["step"], val=hb["best_val"])
        else:
            self._next_chunk(a)

    def _stop(self, a: Attempt) -> None:
        self.live.pop(a.job.name, None)
        ray.kill(a.actor, no_restart=True)

    def _finish(self, job: Job, end: str, **fields) -> None:
        self.outcome[job.name] = end
        emit(self.store, end, job.name, **fields)
        if job.role == "expert" and end != "finished":
            self._release(job)

    def _release(self, job: Job) -> None:
        """An expert that converged or ended for good returns its unspent budget to the pool."""
        candidates = {a.job.expert: a.improving for a in self.live.values() if a.job.role == "expert"}
        candidates |= {j.expert: True for j in self.jobs if j.role == "expert" and j.name not in self.outcome and j.name not in self.live}
        for expert, s in self.book.release(job.expert, self.spent.get(job.expert, 0.0), candidates).items():
            emit(self.store, "budget_granted", expert_name(expert), gpu_seconds=s, source=job.name)

    def _on_failure(self, a: Attempt, reason: str, retry: bool = True) -> None:
        """Record what was lost, then retry from the latest checkpoint with backoff, or give up."""
        self._stop(a)
        unreported = max(0.0, time.monotonic() - a.last_beat) * self.cfg.resources.num_gpus
        self._record("wasted", unreported, unreported / self.cfg.resources.num_gpus, a.job, a.attempt, a.seq + 1,
                     step=a.step, note=f"unreported time before failure: {reason}")
        self._reclassify_lost(a, a.reported["gpu_seconds"] - a.ckpt_gpu_s, a.reported["forwards"] - a.ckpt_forwards, reason)
        emit(self.store, "failed", a.job.name, attempt=a.attempt, step=a.step, reason=reason)
        if not retry:
            self._finish(a.job, "budget_exhausted", step=a.step, reason=reason)
        elif a.attempt >= self.cfg.retry.max_retries:
            self._finish(a.job, "failed_permanently", step=a.step, reason=reason)
        else:
            delay = self.cfg.retry.backoff_s * 2 ** a.attempt
            self.retry_at[a.job.name] = time.monotonic() + delay
            emit(self.store, "retry_scheduled", a.job.name, attempt=a.attempt + 1, delay_s=delay)

    def _collect(self, ref) -> None:
        a = next(x for x in self.live.values() if x.ref == ref)
        try:
            result = ray.get(ref, timeout=60)
        except RayActorError as exc:
            self._on_failure(a, f"actor_died: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            return
        except RayTaskError as exc:
            cause = exc.cause if getattr(exc, "cause", None) is not None else exc
            self._on_failure(a, f"exception: {type(cause).__name__}: {str(cause).splitlines()[0][:200]}")
            return
        except GetTimeoutError:
            self._on_failure(a, "hang: result not retrievable")
            return
        if a.phase == "setup":
            emit(self.store, "started", a.job.name, attempt=a.attempt, step=result["step"], resumed=result["resumed"],
                 device=result["device"], pid=result["pid"], node=result.get("node"))
            a.step = result["step"]
            self._next_chunk(a)
        else:
            self._on_heartbeat(a, result)

    def _watchdog(self) -> None:
        """Hangs (no heartbeat in time) are failures; an actor past its cap plus the grace is hard-stopped."""
        now = time.monotonic()
        for a in list(self.live.values()):
            if a.phase != "chunk":
                continue
            silent = now - a.last_beat
            if silent > self.cfg.retry.heartbeat_timeout_s:
                self._on_failure(a, f"hang: no heartbeat for {silent:.0f} s")
            elif a.cap_s is not None and a.reported["gpu_seconds"] + silent * self.cfg.resources.num_gpus > a.cap_s + self.cfg.budget.grace_gpu_seconds:
                self._on_failure(a, "budget_exhausted: hard stop past the grace", retry=False)

    # -- resume ---------------------------------------------------------------------------------------
    def _restore(self) -> tuple[list[Job], dict[str, int]]:
        """Rebuild from the campaign directory: ended jobs stay ended, grants are replayed, and work an
        interrupted attempt did after its last checkpoint is reclassified as wasted (idempotently)."""
        past = history(self.store)
        for h in past.values():
            for ev in h.events:
                if ev["event"] == "budget_granted":
                    e = int(h.job.split("-")[1])
                    self.book.granted[e] = self.book.granted.get(e, 0.0) + ev["gpu_seconds"]
        pending, attempts = [], {}
        for job in self.jobs:
            h = past.get(job.name)
            if h and h.terminal:
                self.outcome[job.name] = h.state
                continue
            pending.append(job)
            attempts[job.name] = h.attempts if h else 0
            if h and h.attempts and not any(ev["event"] == "failed" and ev.get("attempt") == h.attempts - 1 for ev in h.events):
                self._reclassify_interrupted(job, h)
        return pending, attempts

    def _reclassify_interrupted(self, job: Job, h) -> None:
        last = h.attempts - 1
        ckpt = max((ev["step"] for ev in h.events if ev["event"] == "checkpointed" and ev.get("attempt") == last), default=-1)
        expert = job.expert if job.role == "expert" else None
        lost = [r for r in self.ledger.records() if r["category"] == job.category and r["attempt"] == last and r["seq"] > 0
                and r["expert"] == expert and r["step"] is not None and r["step"] > ckpt]
        self._reclassify_lost(Attempt(job, last, None, step=h.step), sum(r["gpu_seconds"] for r in lost),
                              sum(r["forwards"] for r in lost), "driver lost")

    # -- main loop ------------------------------------------------------------------------------------
    def run(self) -> dict[str, str]:
        pending, attempts = self._restore()
        if self.outcome:
            console.print(f"{len(self.outcome)} job(s) already ended in this campaign; not retraining them")
        per, total = self.book.worst_overrun_s(self.cfg.resources.num_gpus, POLL_S, self._slots())
        if self.book.expert_s is not None or self.book.campaign_s is not None:
            console.print(f"budget: worst-case overrun {per:.1f} GPU-s per expert, {total:.1f} GPU-s for the campaign "
                          f"(grace {self.cfg.budget.grace_gpu_seconds} GPU-s + one {POLL_S} s poll, {self._slots()} concurrent)")
        by_name = {j.name: j for j in self.jobs}
        targets = {j.name: self.cfg.seed_stage.updates if j.role == "seed" else self.cfg.train.updates for j in pending}
        with progress(self.show) as bar:
            overall = bar.add_task("updates, all jobs", total=sum(targets.values()))
            tasks = {n: bar.add_task(n, total=t) for n, t in targets.items()} if len(targets) <= 16 else {}
            while pending or self.live or self.retry_at:
                now = time.monotonic()
                for name, at in list(self.retry_at.items()):
                    if at <= now and len(self.live) < self._slots():
                        del self.retry_at[name]
                        attempts[name] += 1
                        emit(self.store, "retried", name, attempt=attempts[name])
                        self._launch(by_name[name], attempts[name])
                while pending and len(self.live) < self._slots():
                    job = pending.pop(0)
                    self._launch(job, attempts[job.name])
                refs = [a.ref for a in self.live.values()]
                if refs:
                    first, rest = ray.wait(refs, num_returns=1, timeout=POLL_S)   # wake on the first result
                    ready = first + (ray.wait(rest, num_returns=len(rest), timeout=0)[0] if first and rest else [])
                    for ref in ready:
                        self._collect(ref)
                else:
                    time.sleep(min(POLL_S, max(0.0, min(self.retry_at.values(), default=now) - now)))
                self._watchdog()
                self._show(bar, overall, tasks, targets)
        return self.outcome

    def _show(self, bar, overall, tasks, targets) -> None:
        steps = {n: (t if self.outcome.get(n) == "finished" else 0) for n, t in targets.items()}
        steps |= {a.job.name: a.step for a in self.live.values()}
        for name, task in tasks.items():
            bar.update(task, completed=steps.get(name, 0))
        bar.update(overall, completed=sum(steps.values()))


def expert_jobs(cfg: CampaignConfig) -> list[Job]:
    return [Job("expert", e) for e in range(cfg.n_experts)]


def launch(store: Store, cfg: CampaignConfig, show_progress: bool = True) -> dict[str, str]:
    """Train every expert not yet ended (this is also `soma resume`). Needs a finished seed."""
    from pipelines.seed import require_seed

    require_seed(store)
    cap = cfg.budget.campaign_gpu_hours
    spent = Ledger(store).totals().gpu_hours
    hist = history(store)
    unended = [j for j in expert_jobs(cfg) if not (j.name in hist and hist[j.name].terminal)]
    if cap is not None and spent >= cap and unended:
        raise SomaError(f"campaign budget budget.campaign_gpu_hours={cap} is already spent ({spent:.4f} GPU-hours in the ledger); "
                        f"start a new campaign with a larger budget")
    r = cfg.resources
    console.print(f"launching {cfg.n_experts} experts: {r.num_gpus} GPU + {r.num_cpus} CPU each, {cfg.train.updates} updates, "
                  f"heartbeat every {cfg.train.chunk_updates} updates, up to {cfg.retry.max_retries} retries")
    outcome = Driver(store, cfg, expert_jobs(cfg), show_progress).run()
    counts = {k: list(outcome.values()).count(k) for k in sorted(set(outcome.values()))}
    console.print(f"experts ended: {counts}")
    return outcome
