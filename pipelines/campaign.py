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
from soma_cluster.checkpoint import checkpoint_state
from workers import actor_name, model_dir, start_worker

POLL_S = 0.5
FLUSH_S = 0.25          # group commit: held log records are made durable at least this often
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
class Account:
    """One job's side of an attempt: what its heartbeats reported, and where its last checkpoint was."""
    job: Job
    attempt: int
    reported: dict = field(default_factory=lambda: {"gpu_seconds": 0.0, "wall_seconds": 0.0, "forwards": 0, "tokens": 0})
    cap_s: float | None = None       # GPU-seconds it may hold (its budget when the chunk was sent)
    ckpt_gpu_s: float = 0.0          # GPU-seconds held at its last checkpoint in this attempt
    ckpt_forwards: int = 0           # forwards done in this attempt up to that checkpoint
    seq: int = 0
    step: int = 0
    improving: bool = True
    ended: bool = False
    start_forwards: int | None = None  # the model's forward count when this attempt loaded it (None: not started)


@dataclass
class Attempt:
    """One actor: a single job, or G experts packed on the expert axis (resources.experts_per_actor)."""
    unit: str
    accounts: dict[str, Account]     # job name -> account
    actor: object
    ref: object = None
    phase: str = "setup"             # "setup" until the actor reports in, then "chunk"
    last_beat: float = field(default_factory=time.monotonic)
    launched: float = field(default_factory=time.monotonic)
    reused: bool = False

    def live(self) -> list[Account]:
        return [c for c in self.accounts.values() if not c.ended]


def unit_name(jobs: list[Job]) -> str:
    return jobs[0].name if len(jobs) == 1 else f"{jobs[0].name}+{len(jobs) - 1}"


def also_ready(first: list, rest: list) -> list:
    """`first` (what a blocking ray.wait returned) and, if it holds one, every ref of `rest` ready now (no waiting)."""
    return first + (ray.wait(rest, num_returns=len(rest), timeout=0)[0] if first and rest else [])


class Driver:
    """Runs jobs to an end state; every transition goes to events.jsonl, every GPU-second to the ledger."""

    def __init__(self, store: Store, cfg: CampaignConfig, jobs: list[Job], show_progress: bool = True, actor_factory=start_worker):
        self.store, self.cfg, self.jobs, self.show = store, cfg, jobs, show_progress
        self.start_actor = actor_factory
        self.ledger = Ledger(store)
        self.book = BudgetBook(cfg.budget)
        self.live: dict[str, Attempt] = {}             # unit name -> the actor's attempt
        self.running: dict[str, Attempt] = {}          # job name -> the attempt training it
        self.retry_at: dict[str, float] = {}
        self.attempts: dict[str, int] = {}             # job name -> its current (or next) attempt number
        self.outcome: dict[str, str] = {}
        self.bad_input: dict[str, str] = {}            # job name -> the error that ended it (no retry could help)
        self.pending: list[Job] = []                   # jobs not yet launched, in order
        self.campaign_id = cfg.digest()[:8]
        self._gpus, self._gpus_at = 0.0, -math.inf         # cluster GPUs, and when they were last read
        totals = self.ledger.totals()
        self.spent = dict(totals.per_expert_gpu_seconds)    # running totals, kept in step with every record written
        self.spent_total = sum(totals.gpu_seconds.values())

    def _pack(self, jobs: list[Job]) -> int:
        return 1 if any(j.role == "seed" for j in jobs) else self.cfg.resources.experts_per_actor

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
        share = max(1, len(self.running) + (0 if job.name in self.running else 1))
        return self.book.left(expert, self.spent.get(expert, 0.0) if expert is not None else 0.0, self.spent_total, share)

    def _reclassify_lost(self, c: Account, lost_s: float, lost_forwards: int, why: str) -> None:
        """Work after the attempt's last checkpoint is lost: move its GPU-seconds and forwards from
        training to wasted (fixed record ids, so doing it twice counts once)."""
        if lost_s > 0 or lost_forwards > 0:
            note = f"lost after checkpoint: {why}"
            self._record(c.job.category, -lost_s, 0.0, c.job, c.attempt, -1, forwards=-lost_forwards, step=c.step, note=note)
            self._record("wasted", lost_s, 0.0, c.job, c.attempt, -1, forwards=lost_forwards, step=c.step, note=note)

    # -- launching ------------------------------------------------------------------------------------
    def _slots(self) -> int:
        # cluster_resources() is a GCS round trip (~1-8 ms): re-read it every SLOTS_REFRESH_S, not every loop
        now = time.monotonic()
        if now - self._gpus_at > SLOTS_REFRESH_S:
            self._gpus, self._gpus_at = ray.cluster_resources().get("GPU", 0.0), now
        return max(1, int(math.floor(self._gpus / self.cfg.resources.num_gpus + 1e-9)))

    def _launch(self, jobs: list[Job], actor=None) -> bool:
        """One actor for these jobs (one, or up to experts_per_actor packed), or `actor` (an idle one, reused)
        given them; none the budget cannot cover. False when none was left to launch."""
        for job in [j for j in jobs if (left := self._budget_left(j)) is not None and left <= 0]:
            self._finish(job, "budget_exhausted", note="budget cannot cover a launch")
            jobs.remove(job)
        if not jobs:
            return False
        r, unit = self.cfg.resources, unit_name(jobs)
        attempts = [self.attempts[j.name] for j in jobs]
        experts = jobs[0].expert if len(jobs) == 1 else [j.expert for j in jobs]
        tried = attempts[0] if len(jobs) == 1 else attempts
        reused = actor is not None
        if reused:
            ref = actor.setup.remote(experts, tried)
        else:
            actor = self.start_actor(self.store.url, self.store.storage_options, jobs[0].role, experts, tried, r.num_gpus,
                                     r.num_cpus, name=actor_name(self.campaign_id, unit, attempts[0]), placement=r.placement)
            ref = actor.setup.remote()
        a = Attempt(unit, {j.name: Account(j, n) for j, n in zip(jobs, attempts)}, actor, ref, reused=reused)
        self.live[unit] = a
        for j, n in zip(jobs, attempts):
            self.running[j.name] = a
            emit(self.store, "launched", j.name, attempt=n, num_gpus=r.num_gpus / len(jobs), actor=unit, reused=reused)
        return True

    def _take(self) -> list[Job]:
        """The next pending jobs for one actor: up to experts_per_actor experts, or the seed alone."""
        g = self._pack(self.pending[:1])
        return [self.pending.pop(0) for _ in range(min(g, len(self.pending)))]

    def _reuse(self, a: Attempt) -> bool:
        """resources.reuse_actors: an actor whose experts all ended cleanly takes the next pending ones."""
        if not self.cfg.resources.reuse_actors or not self.pending or self.pending[0].role != "expert":
            return False
        self.live.pop(a.unit, None)
        while self.pending:
            if self._launch(self._take(), actor=a.actor):
                return True
        ray.kill(a.actor, no_restart=True)      # everything left was out of budget
        return True

    def _next_chunk(self, a: Attempt) -> None:
        a.phase = "chunk"
        caps = {}
        for c in a.live():
            left = self._budget_left(c.job)
            c.cap_s = None if left is None else left + c.reported["gpu_seconds"]   # the worker compares its own cumulative clock
            caps[c.job.expert] = c.cap_s
        a.ref = a.actor.run_chunk.remote(self.cfg.train.chunk_updates, caps)
        a.last_beat = time.monotonic()

    # -- outcomes -------------------------------------------------------------------------------------
    def _on_heartbeat(self, a: Attempt, c: Account, hb: dict) -> None:
        c.seq += 1
        delta = {k: hb[k] - c.reported[k] for k in c.reported}
        self._record(c.job.category, delta["gpu_seconds"], delta["wall_seconds"], c.job, c.attempt, c.seq,
                     forwards=delta["forwards"], tokens=delta["tokens"], step=hb["step"])
        c.reported = {k: hb[k] for k in c.reported}
        if hb["val"] is not None:
            c.improving = hb["best_val"] is not None and hb["val"] <= hb["best_val"]
        c.step = hb["step"]
        c.ckpt_gpu_s, c.ckpt_forwards = hb["checkpoint_gpu_seconds"], hb["checkpoint_forwards"]
        emit(self.store, "heartbeat", c.job.name, attempt=c.attempt, step=hb["step"], loss=hb["loss"], val=hb["val"],
             gpu_seconds=hb["gpu_seconds"], eps=hb["eps"], lr=hb["lr"])
        if hb["checkpoint"]:
            emit(self.store, "checkpointed", c.job.name, attempt=c.attempt, step=hb["checkpoint_step"], checkpoint=hb["checkpoint"])
        if hb.get("failed"):                 # this one failed inside a pack; the others keep training
            self._end_account(c)
            self._fail(c, hb["reason"])
        elif hb["done"]:
            self._end_account(c)
            self._finish(c.job, hb["reason"], step=hb["step"], val=hb["best_val"])

    def _end_account(self, c: Account) -> None:
        c.ended = True
        self.running.pop(c.job.name, None)

    def _stop(self, a: Attempt) -> None:
        self.live.pop(a.unit, None)
        for c in a.accounts.values():
            if self.running.get(c.job.name) is a:
                self.running.pop(c.job.name)
        ray.kill(a.actor, no_restart=True)

    def _finish(self, job: Job, end: str, **fields) -> None:
        self.outcome[job.name] = end
        emit(self.store, end, job.name, **fields)
        if job.role == "expert" and end != "finished":
            self._release(job)

    def _release(self, job: Job) -> None:
        """An expert that converged or ended for good returns its unspent budget to the pool."""
        candidates = {c.job.expert: c.improving for c in (self.running[n].accounts[n] for n in self.running) if c.job.role == "expert"}
        candidates |= {j.expert: True for j in self.jobs if j.role == "expert" and j.name not in self.outcome and j.name not in self.running}
        for expert, s in self.book.release(job.expert, self.spent.get(job.expert, 0.0), candidates).items():
            emit(self.store, "budget_granted", expert_name(expert), gpu_seconds=s, source=job.name)

    def _on_failure(self, a: Attempt, reason: str, no_retry: tuple[str, ...] = (), end: str = "budget_exhausted") -> None:
        """The actor is gone (or is killed now): each job it was training records what was lost and is
        retried from its latest checkpoint, except those in `no_retry`, which end as `end` (hard-stopped
        past their budget, or bad input that no retry can fix)."""
        live = a.live()
        self._stop(a)
        share = self.cfg.resources.num_gpus / max(1, len(live))
        unreported = max(0.0, time.monotonic() - a.last_beat)
        for c in live:
            c.ended = True
            self._record("wasted", unreported * share, unreported * share / self.cfg.resources.num_gpus, c.job, c.attempt, c.seq + 1,
                         step=c.step, note=f"unreported time before failure: {reason}")
            mine = reason if len(live) == 1 or c.job.name in no_retry else f"{reason} (in pack {a.unit})"
            self._fail(c, mine, retry=c.job.name not in no_retry, end=end)

    def _fail(self, c: Account, reason: str, retry: bool = True, end: str = "budget_exhausted") -> None:
        lost_s, lost_forwards = c.reported["gpu_seconds"] - c.ckpt_gpu_s, c.reported["forwards"] - c.ckpt_forwards
        latest = checkpoint_state(self.store, model_dir(c.job.role, c.job.expert)) if c.start_forwards is not None else None
        if latest is not None and latest["step"] > c.step:
            # it checkpointed after its last heartbeat: all it reported is kept, and so is work it never reported
            kept = latest["forwards"] - c.start_forwards - c.reported["forwards"]
            lost_s, lost_forwards = 0.0, 0
            self._record(c.job.category, 0.0, 0.0, c.job, c.attempt, c.seq + 2, forwards=kept, step=latest["step"],
                         note="checkpointed after the last heartbeat (its seconds are in 'unreported')")
        self._reclassify_lost(c, lost_s, lost_forwards, reason)
        emit(self.store, "failed", c.job.name, attempt=c.attempt, step=c.step, reason=reason)
        if not retry:
            if end == "failed_permanently":
                self.bad_input[c.job.name] = reason
            self._finish(c.job, end, step=c.step, reason=reason)
        elif c.attempt >= self.cfg.retry.max_retries:
            self._finish(c.job, "failed_permanently", step=c.step, reason=reason)
        else:
            delay = self.cfg.retry.backoff_s * 2 ** c.attempt
            self.retry_at[c.job.name] = time.monotonic() + delay
            emit(self.store, "retry_scheduled", c.job.name, attempt=c.attempt + 1, delay_s=delay)

    def _collect(self, a: Attempt, result=None) -> None:
        try:
            result = ray.get(a.ref, timeout=60) if result is None else result
        except RayActorError as exc:
            self._on_failure(a, f"actor_died: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            return
        except RayTaskError as exc:
            cause = exc.cause if getattr(exc, "cause", None) is not None else exc
            why = f"exception: {type(cause).__name__}: {str(cause).splitlines()[0][:300]}"
            if isinstance(cause, SomaError):        # bad input (a corrupt shard or checkpoint): no retry can fix it
                self._on_failure(a, why, no_retry=tuple(c.job.name for c in a.live()), end="failed_permanently")
            else:
                self._on_failure(a, why)
            return
        except GetTimeoutError:
            self._on_failure(a, "hang: result not retrievable")
            return
        by_expert = {c.job.expert: c for c in a.accounts.values()}
        if a.phase == "setup":
            # the GPU is held from the launch, but the worker's clock starts only once its process runs Python:
            # the difference (process start, imports) is the jobs' too
            gap = 0.0 if a.reused else max(0.0, time.monotonic() - a.launched - result["wall_seconds"]) / len(result["experts"])
            for e, info in result["experts"].items():
                c = by_expert[e]
                emit(self.store, "started", c.job.name, attempt=c.attempt, step=info["step"], resumed=info["resumed"],
                     device=result["device"], pid=result["pid"], node=result.get("node"), actor=a.unit)
                c.step, c.start_forwards = info["step"], info["forwards"]
                if gap > 0:
                    self._record(c.job.category, gap * self.cfg.resources.num_gpus, gap, c.job, c.attempt, 0, step=c.step,
                                 note="actor start before the worker's clock")
        else:
            for e, hb in result["experts"].items():
                self._on_heartbeat(a, by_expert[e], hb)
            a.last_beat = time.monotonic()
        if a.live():
            self._next_chunk(a)
        elif not self._reuse(a):
            self._stop(a)

    def _watchdog(self) -> None:
        """Hangs (no heartbeat in time) are failures; an actor past a job's cap plus the grace is hard-stopped."""
        now = time.monotonic()
        for a in list(self.live.values()):
            if a.phase != "chunk":
                continue
            silent = now - a.last_beat
            live = a.live()
            held = silent * self.cfg.resources.num_gpus / max(1, len(live))
            over = tuple(c.job.name for c in live
                         if c.cap_s is not None and c.reported["gpu_seconds"] + held > c.cap_s + self.cfg.budget.grace_gpu_seconds)
            if silent > self.cfg.retry.heartbeat_timeout_s:
                self._on_failure(a, f"hang: no heartbeat for {silent:.0f} s")
            elif over:
                self._on_failure(a, "budget_exhausted: hard stop past the grace", no_retry=over)

    # -- resume ---------------------------------------------------------------------------------------
    def _restore(self) -> list[Job]:
        """Rebuild from the campaign directory: ended jobs stay ended, grants are replayed, and work an
        interrupted attempt did after its last checkpoint is reclassified as wasted (idempotently)."""
        past = history(self.store)
        for h in past.values():
            for ev in h.events:
                if ev["event"] == "budget_granted":
                    e = int(h.job.split("-")[1])
                    self.book.granted[e] = self.book.granted.get(e, 0.0) + ev["gpu_seconds"]
        pending, records = [], None
        for job in self.jobs:
            h = past.get(job.name)
            if h and h.terminal:
                self.outcome[job.name] = h.state
                continue
            pending.append(job)
            self.attempts[job.name] = h.attempts if h else 0
            if h and h.attempts and not any(ev["event"] == "failed" and ev.get("attempt") == h.attempts - 1 for ev in h.events):
                records = self.ledger.records() if records is None else records     # read once, not once per job
                self._reclassify_interrupted(job, h, records)
        return pending

    def _reclassify_interrupted(self, job: Job, h, records: list[dict]) -> None:
        last = h.attempts - 1
        ckpt = max((ev["step"] for ev in h.events if ev["event"] == "checkpointed" and ev.get("attempt") == last), default=-1)
        latest = checkpoint_state(self.store, model_dir(job.role, job.expert))
        if latest is not None:            # a checkpoint written after the last event the driver wrote
            ckpt = max(ckpt, latest["step"])
        expert = job.expert if job.role == "expert" else None
        lost = [r for r in records if r["category"] == job.category and r["attempt"] == last and r["seq"] > 0
                and r["expert"] == expert and r["step"] is not None and r["step"] > ckpt]
        self._reclassify_lost(Account(job, last, step=h.step), sum(r["gpu_seconds"] for r in lost),
                              sum(r["forwards"] for r in lost), "driver lost")

    # -- main loop ------------------------------------------------------------------------------------
    def _fill_slots(self, by_name: dict[str, Job]) -> None:
        """Start actors while slots are free: due retries first, then pending jobs, up to G per actor."""
        while len(self.live) < self._slots():
            now = time.monotonic()
            due = sorted(n for n, at in self.retry_at.items() if at <= now)
            if due:
                group = due[: self._pack([by_name[n] for n in due[:1]])]
                for n in group:
                    del self.retry_at[n]
                    self.attempts[n] += 1
                    emit(self.store, "retried", n, attempt=self.attempts[n])
                self._launch([by_name[n] for n in group])
            elif self.pending:
                self._launch(self._take())
            else:
                return

    def run(self) -> dict[str, str]:
        self.pending = pending = self._restore()
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
            # group commit: the records of every result in FLUSH_S go out in one durable write per log, written
            # by a background thread so the loop never waits on the disk or the object store
            with self.store.batch(background=True):
                flushed = time.monotonic()
                while pending or self.live or self.retry_at:
                    self._sweep(by_name)
                    if time.monotonic() - flushed >= FLUSH_S:
                        self.store.flush(wait=False)
                        flushed = time.monotonic()
                    if self.show:
                        self._show(bar, overall, tasks, targets)
        return self.outcome

    def _sweep(self, by_name: dict[str, Job]) -> None:
        self._fill_slots(by_name)
        owner = {a.ref: a for a in self.live.values()}
        if owner:
            ready = self._wait(list(owner))
            try:                      # one call for every ready result; on any error, each on its own
                results = ray.get(ready, timeout=60)
            except (RayActorError, RayTaskError, GetTimeoutError):
                results = [None] * len(ready)
            for ref, result in zip(ready, results):
                self._collect(owner[ref], result)
        else:
            now = time.monotonic()
            time.sleep(min(POLL_S, max(0.0, min(self.retry_at.values(), default=now) - now)))
        self._watchdog()

    def _wait(self, refs: list) -> list:
        """Block until a result is ready (at most POLL_S), then take every other one that is ready too."""
        return also_ready(*self._block(refs))

    @staticmethod
    def _block(refs: list) -> tuple[list, list]:
        """The loop's only blocking call: (the first ready ref or none within POLL_S, the others)."""
        return ray.wait(refs, num_returns=1, timeout=POLL_S)

    def _show(self, bar, overall, tasks, targets) -> None:
        steps = {n: (t if self.outcome.get(n) == "finished" else 0) for n, t in targets.items()}
        steps |= {n: a.accounts[n].step for n, a in self.running.items()}
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
    driver = Driver(store, cfg, expert_jobs(cfg), show_progress)
    outcome = driver.run()
    counts = {k: list(outcome.values()).count(k) for k in sorted(set(outcome.values()))}
    console.print(f"experts ended: {counts}")
    if driver.bad_input:
        job, why = next(iter(driver.bad_input.items()))
        more = f" (and {len(driver.bad_input) - 1} more jobs)" if len(driver.bad_input) > 1 else ""
        raise SomaError(f"{job} stopped on bad input{more}: {why.removeprefix('exception: ')}")
    return outcome
