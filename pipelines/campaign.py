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
from soma_cluster.ledger import Ledger
from soma_cluster.shards import expert_name
from soma_cluster.storage import Store
from workers import start_worker

POLL_S = 0.5


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
    reported_gpu_s: float = 0.0
    reported_wall_s: float = 0.0
    reported_forwards: int = 0
    reported_tokens: int = 0
    seq: int = 0
    step: int = 0


class Driver:
    def __init__(self, store: Store, cfg: CampaignConfig, jobs: list[Job], show_progress: bool = True):
        self.store, self.cfg, self.jobs, self.show = store, cfg, jobs, show_progress
        self.ledger = Ledger(store)
        self.live: dict[str, Attempt] = {}
        self.retry_at: dict[str, float] = {}
        self.outcome: dict[str, str] = {}

    # -- budgets --------------------------------------------------------------------------------------
    def _spent(self) -> tuple[dict[int, float], float]:
        t = self.ledger.totals()
        return dict(t.per_expert_gpu_seconds), sum(t.gpu_seconds.values())

    def _budget_left(self, job: Job) -> float | None:
        """GPU-seconds this job may still spend (expert cap and campaign cap), or None if unlimited."""
        per_expert, total = self._spent()
        caps = []
        if self.cfg.budget.expert_gpu_hours is not None and job.role == "expert":
            caps.append(self.cfg.budget.expert_gpu_hours * 3600 - per_expert.get(job.expert, 0.0))
        if self.cfg.budget.campaign_gpu_hours is not None:
            live = sum(a.reported_gpu_s for a in self.live.values())
            caps.append(self.cfg.budget.campaign_gpu_hours * 3600 - total - live)
        return min(caps) if caps else None

    # -- launching ------------------------------------------------------------------------------------
    def _slots(self) -> int:
        gpus = ray.cluster_resources().get("GPU", 0.0)
        return max(1, int(math.floor(gpus / self.cfg.resources.num_gpus + 1e-9)))

    def _launch(self, job: Job, attempt: int) -> None:
        left = self._budget_left(job)
        if left is not None and left <= 0:
            self._finish(job, "budget_exhausted", note="no budget left to launch")
            return
        r = self.cfg.resources
        actor = start_worker(self.store.url, self.store.storage_options, job.role, job.expert, attempt, r.num_gpus, r.num_cpus)
        a = Attempt(job, attempt, actor)
        a.ref = actor.setup.remote()
        self.live[job.name] = a
        emit(self.store, "launched", job.name, attempt=attempt, num_gpus=r.num_gpus)

    def _next_chunk(self, a: Attempt) -> None:
        a.phase = "chunk"
        a.ref = a.actor.run_chunk.remote(self.cfg.train.chunk_updates, self._attempt_budget(a))
        a.last_beat = time.monotonic()

    def _attempt_budget(self, a: Attempt) -> float | None:
        left = self._budget_left(a.job)
        return None if left is None else left + a.reported_gpu_s   # the worker compares its own cumulative clock

    # -- outcomes -------------------------------------------------------------------------------------
    def _account(self, a: Attempt, hb: dict) -> None:
        a.seq += 1
        self.ledger.record(a.job.category, hb["gpu_seconds"] - a.reported_gpu_s, hb["wall_seconds"] - a.reported_wall_s,
                           expert=a.job.expert if a.job.role == "expert" else None, attempt=a.attempt, seq=a.seq,
                           forwards=hb["forwards"] - a.reported_forwards, tokens=hb["tokens"] - a.reported_tokens, step=hb["step"])
        a.reported_gpu_s, a.reported_wall_s = hb["gpu_seconds"], hb["wall_seconds"]
        a.reported_forwards, a.reported_tokens = hb["forwards"], hb["tokens"]

    def _on_heartbeat(self, a: Attempt, hb: dict) -> None:
        self._account(a, hb)
        a.step, a.last_beat = hb["step"], time.monotonic()
        emit(self.store, "heartbeat", a.job.name, attempt=a.attempt, step=hb["step"], loss=hb["loss"], val=hb["val"],
             gpu_seconds=hb["gpu_seconds"], eps=hb["eps"], lr=hb["lr"])
        if hb["checkpoint"]:
            emit(self.store, "checkpointed", a.job.name, attempt=a.attempt, step=hb["step"], checkpoint=hb["checkpoint"])
        if hb["done"]:
            self._stop(a)
            self._finish(a.job, hb["reason"], step=hb["step"], val=hb["best_val"])
        else:
            self._next_chunk(a)

    def _stop(self, a: Attempt) -> None:
        self.live.pop(a.job.name, None)
        ray.kill(a.actor, no_restart=True)

    def _finish(self, job: Job, reason: str, **fields) -> None:
        self.outcome[job.name] = reason
        emit(self.store, reason, job.name, **fields)

    def _on_failure(self, a: Attempt, reason: str) -> None:
        """Record what was lost, then retry from the latest checkpoint with backoff, or give up."""
        self._stop(a)
        lost = max(0.0, time.monotonic() - a.last_beat) * self.cfg.resources.num_gpus
        self.ledger.record("wasted", lost, lost / self.cfg.resources.num_gpus, expert=a.job.expert if a.job.role == "expert" else None,
                           attempt=a.attempt, seq=a.seq + 1, step=a.step, note=f"unreported time before failure: {reason}")
        emit(self.store, "failed", a.job.name, attempt=a.attempt, step=a.step, reason=reason)
        if a.attempt >= self.cfg.retry.max_retries:
            self._finish(a.job, "failed_permanently", step=a.step, reason=reason)
            return
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
                 device=result["device"], pid=result["pid"])
            a.step = result["step"]
            self._next_chunk(a)
        else:
            self._on_heartbeat(a, result)

    def _check_hangs(self) -> None:
        now = time.monotonic()
        for a in list(self.live.values()):
            if a.phase == "chunk" and now - a.last_beat > self.cfg.retry.heartbeat_timeout_s:
                self._on_failure(a, f"hang: no heartbeat for {now - a.last_beat:.0f} s")

    # -- main loop ------------------------------------------------------------------------------------
    def run(self) -> dict[str, str]:
        past = history(self.store)
        queue = []
        for job in self.jobs:
            h = past.get(job.name)
            if h and h.terminal:
                self.outcome[job.name] = h.state
            else:
                queue.append((job, h.attempts if h else 0))
        done_before = len(self.outcome)
        if done_before:
            console.print(f"{done_before} job(s) already ended in this campaign; not retraining them")
        by_name = {j.name: j for j in self.jobs}
        attempts = {job.name: n for job, n in queue}
        pending = [job for job, _ in queue]
        with progress(self.show) as bar:
            tasks = {j.name: bar.add_task(j.name, total=self.cfg.seed_stage.updates if j.role == "seed" else self.cfg.train.updates)
                     for j in pending} if len(pending) <= 16 else {}
            overall = bar.add_task("all jobs (updates)", total=sum(self.cfg.seed_stage.updates if j.role == "seed" else self.cfg.train.updates for j in pending)) if len(pending) > 1 else None
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
                    ready, _ = ray.wait(refs, num_returns=1, timeout=POLL_S)
                    for ref in ready:
                        self._collect(ref)
                else:
                    time.sleep(min(POLL_S, max(0.0, min(self.retry_at.values(), default=now) - now)))
                self._check_hangs()
                steps = {a.job.name: a.step for a in self.live.values()}
                for name, task in tasks.items():
                    if name in steps:
                        bar.update(task, completed=steps[name])
                    elif self.outcome.get(name) == "finished":
                        bar.update(task, completed=bar.tasks[task].total)
                if overall is not None:
                    bar.update(overall, completed=sum(steps.values()) + sum(bar.tasks[t].total for n, t in tasks.items() if self.outcome.get(n) == "finished"))
        return self.outcome


def expert_jobs(cfg: CampaignConfig) -> list[Job]:
    return [Job("expert", e) for e in range(cfg.n_experts)]


def launch(store: Store, cfg: CampaignConfig, show_progress: bool = True) -> dict[str, str]:
    """Train every expert not yet ended (this is also `soma resume`). Needs a finished seed."""
    from pipelines.seed import require_seed

    require_seed(store)
    r = cfg.resources
    console.print(f"launching {cfg.n_experts} experts: {r.num_gpus} GPU + {r.num_cpus} CPU each, {cfg.train.updates} updates, "
                  f"heartbeat every {cfg.train.chunk_updates} updates, up to {cfg.retry.max_retries} retries")
    outcome = Driver(store, cfg, expert_jobs(cfg), show_progress).run()
    counts = {k: list(outcome.values()).count(k) for k in sorted(set(outcome.values()))}
    console.print(f"experts ended: {counts}")
    return outcome
