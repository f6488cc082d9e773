"""ExpertWorker: a Ray actor that trains ONE model (the seed, or one expert on its own shard), or G
small experts packed on the engine's expert axis, each on its own shard.

It never talks to another actor. The driver calls `setup()` once, then `run_chunk()` repeatedly; each
call returns a typed report (soma_cluster/messages.py) with one heartbeat per job. Checkpoints go
straight to the campaign directory, each carrying the attempt's usage up to it (what a lost attempt
keeps). The GPU-second clock starts when the actor began holding its GPU share (`held_from`): never while
it waited in Ray's queue.

What a job trains from (its shard, starting state, method and trainer) is soma_cluster.recipes', shared with
`soma plan` and the experiments; this module holds the actor only.

SIGTERM (a spot notice, a node drain, a KubeRay scale-down) is a preemption, not a failure: the worker
finishes the update in flight, checkpoints every job it trains, reports `preempted` and exits; if it
has not left within retry.preemption_grace_s of the signal, it exits anyway.
"""

from __future__ import annotations

import logging
import os
import signal
import tempfile
import threading
import time
from dataclasses import asdict, dataclass

import psutil
import ray
import torch

from soma_cluster.campaignfile import load_campaign_config
from soma_cluster.checkpoint import has_checkpoint, load_checkpoint, save_checkpoint
from soma_cluster.config import CampaignConfig
from soma_cluster.errors import DeviceError, StorageUnreachable
from soma_cluster.failures import raised_on
from soma_cluster.jobs import Job, StopReason
from soma_cluster.lease import WorkerFence
from soma_cluster.messages import ChunkReport, ExpertStart, Heartbeat, Incarnation, SetupReport, Usage
from soma_cluster.recipes import job_shard, job_trainer, start_state
from soma_cluster.revisions import in_force
from soma_cluster.storage import Store
from soma_cluster.trainer import NonFiniteLoss, Trainer, pick_device, update_experts

log = logging.getLogger(__name__)
# tests only: seconds every setup() sleeps first, a slow start-up (a loaded host, an image pull, a cold S3 read)
SETUP_DELAY_ENV = "SOMA_TEST_SETUP_DELAY_S"
# tests only: set (to anything) in a node's environment, every setup() there fails as if the store were unreachable
UNREACHABLE_ENV = "SOMA_TEST_STORE_UNREACHABLE"


def held_from(requested_at: float | None, granted: bool, now: float) -> float:
    """When an actor began holding its GPU share (wall clock). Asked for while the GPUs present had room
    (`granted`), Ray gave it the share at once: from the request (its process start is the job's cost).
    Asked for beyond them, it waited in Ray's queue (for a GPU to free, or for the autoscaler's node),
    which is no one's cost: from now, its first instruction. Ray may have started its process ahead of
    the grant, so the process's own start says nothing; its start-up after the grant (~1-3 s) goes
    uncharged, the price of never charging the wait."""
    return min(requested_at, now) if requested_at is not None and granted else now


def alive(p: Incarnation) -> bool:
    """Whether that process still exists (a pid reused by another process does not count)."""
    try:
        proc = psutil.Process(p.pid)
        return abs(proc.create_time() - p.created) < 0.5 and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class Preemption:
    """SIGTERM sets `requested`; the training loop leaves at the next update boundary. A timer makes the
    process exit `grace_s` after the signal whatever it is doing, so the notice's deadline is kept."""

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.requested: float | None = None
        # only in an actor's own process (Ray runs its methods on the main thread), never in a driver or a test
        if ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:
            signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        if self.requested is None:
            self.requested = time.monotonic()
            timer = threading.Timer(self.grace_s, os._exit, args=(128 + signal.SIGTERM,))
            timer.daemon = True
            timer.start()


@dataclass(kw_only=True)
class Member:
    """One job inside an actor: its trainer, where it checkpoints, and what it has reported."""

    job: Job
    attempt: int
    trainer: Trainer
    target: int
    resumed: bool
    start_step: int
    start_forwards: int
    start_tokens: int
    last_ckpt_step: int
    kept_by: int | None = None  # resumed: the attempt that wrote the loaded checkpoint, and its usage then
    kept: Usage | None = None
    reason: StopReason | None = None  # set once it stops cleanly: finished, converged, budget_exhausted, preempted
    error: str | None = None  # set once it fails alone inside its pack: the error it raised (`Type: message`)
    told: bool = False  # its last heartbeat (done) has gone to the driver

    @property
    def failed(self) -> bool:
        return self.error is not None

    @property
    def done(self) -> bool:
        """It stopped, cleanly or by failing: it trains no more."""
        return self.reason is not None or self.failed


class ExpertWorker:
    """Trains one job, or G small experts packed on the expert axis (`resources.experts_per_actor`).

    Packed experts share the actor's forward passes but nothing else: each has its own shard, probes,
    optimizer, schedule, budget and checkpoints, and stops on its own. The actor's held time is split
    evenly among the jobs it is training at each moment, so their GPU-seconds add up to the actor's."""

    def __init__(
        self,
        *,
        campaign_url: str,
        storage_options: dict,
        experts: list[int | None],
        attempts: list[int],
        num_gpus: float,
        requested_at: float | None = None,
        granted: bool = False,
        previous: tuple[Incarnation, ...] = (),
        lease_generation: int | None = None,
    ):
        now_wall, now = time.time(), time.monotonic()
        self.held_from = held_from(requested_at, granted, now_wall)
        self.t0 = self._tick_at = now - (now_wall - self.held_from)
        self.process = Incarnation(
            ray.get_runtime_context().get_node_id() if ray.is_initialized() else None,
            os.getpid(),
            psutil.Process().create_time(),
        )
        self.store = Store(campaign_url, storage_options)
        if lease_generation is not None:  # a checkpoint of a driver that lost the campaign is never written
            self.store.fence = WorkerFence(self.store, lease_generation)
        self.jobs, self.attempts, self.previous = [Job(e) for e in experts], list(attempts), tuple(previous)
        self.num_gpus = num_gpus
        self.held = dict.fromkeys(self.jobs, 0.0)  # wall seconds attributed to each job
        self.members: dict[Job, Member] = {}
        self.sec_per_update: float | None = None  # one packed update of every live member
        self.preemption = Preemption(20.0)

    def pid(self) -> int:
        return os.getpid()

    def holding(self) -> float:
        """When this actor began holding its GPU share (wall clock): the driver asks an actor that waited in Ray's
        queue, so that its start-up counts against its budget from then (Ray runs this before `setup`)."""
        return self.held_from

    def _live(self) -> list[Member]:
        return [m for m in self.members.values() if not m.done]

    def _tick(self) -> None:
        """Attribute the time since the last tick to the jobs whose last heartbeat is still to come (all of
        them during setup), so the jobs' seconds add up to the actor's: nothing is lost or counted twice."""
        now = time.monotonic()
        live = [m.job for m in self.members.values() if not m.told] if self.members else self.jobs
        for job in live:
            self.held[job] += (now - self._tick_at) / len(live)
        self._tick_at = now

    def _usage(self, m: Member) -> Usage:
        st = m.trainer.state
        return Usage(
            self.held[m.job] * self.num_gpus,
            self.held[m.job],
            st.forwards - m.start_forwards,
            st.tokens - m.start_tokens,
        )

    def setup(self, experts: list[int | None] | None = None, attempts: list[int] | None = None) -> SetupReport:
        """Load the jobs (their checkpoints, or the seed). With `experts`, an actor whose jobs have all ended
        takes new ones (resources.reuse_actors): the time since its last heartbeat goes to them. An error says which
        node raised it (the driver has not heard from this actor yet)."""
        try:
            return self._setup(experts, attempts)
        except Exception as exc:
            raised_on(exc, self.process.node)
            raise

    def _setup(self, experts: list[int | None] | None, attempts: list[int] | None) -> SetupReport:
        held_from = self.held_from
        time.sleep(float(os.environ.get(SETUP_DELAY_ENV, "0") or 0))
        if os.environ.get(UNREACHABLE_ENV):
            raise StorageUnreachable(f"storage {self.store.url}: read campaign.yaml failed ({UNREACHABLE_ENV} is set)")
        if experts is not None:
            if any(not m.told for m in self.members.values()):
                raise RuntimeError("setup(experts=...) while jobs are still training in this actor")
            self.jobs, self.attempts, self.previous = [Job(e) for e in experts], list(attempts), ()
            self.held |= dict.fromkeys(self.jobs, 0.0)
            self.members, self.sec_per_update = {}, None
            held_from = time.time() - (time.monotonic() - self._tick_at)
        base = load_campaign_config(self.store)
        self.cfg = cfg = in_force(self.store, base)[0]  # with its revisions (soma set): train.updates may have grown
        self.preemption.grace_s = cfg.retry.preemption_grace_s
        waited = self._outlive(cfg.retry.kill_wait_s)
        device = self._device(cfg)
        cache = os.path.join(tempfile.gettempdir(), "soma-cache", base.digest())  # the shards: revisions keep them
        for job, attempt in zip(self.jobs, self.attempts, strict=True):
            self.members[job] = self._member(cfg, job, attempt, device, cache)
        self._tick()
        starts = {
            m.job.expert: ExpertStart(
                step=m.start_step,
                target=m.target,
                resumed=m.resumed,
                forwards=m.start_forwards,
                n_train=m.trainer.shard.n_train,
                usage=self._usage(m),
                kept_by=m.kept_by,
                kept=m.kept,
            )
            for m in self.members.values()
        }
        node_ip = ray.util.get_node_ip_address() if ray.is_initialized() else None
        return SetupReport(device.type, node_ip, self.process, held_from, waited, starts)

    def _outlive(self, bound_s: float) -> float:
        """Wait (at most bound_s) for earlier processes of these jobs on this node, killed by the driver, to be
        gone: Ray hands their GPU share on before a stopped process is reaped, and two processes must not
        hold one device's memory at once."""
        t = time.monotonic()
        for p in [p for p in self.previous if p.node == self.process.node]:
            while alive(p) and time.monotonic() - t < bound_s:
                time.sleep(0.05)
            if alive(p):
                log.warning("pid %d (an earlier attempt) still exists after %.0f s; starting anyway", p.pid, bound_s)
        return time.monotonic() - t

    def _device(self, cfg: CampaignConfig) -> torch.device:
        device = pick_device()
        if device.type == "cpu":
            if self.num_gpus > 0 and not cfg.resources.allow_cpu:
                node = ray.util.get_node_ip_address() if ray.is_initialized() else "this machine"
                raise DeviceError(
                    f"node {node} (Ray node {str(self.process.node)[:12]}) gave this actor {self.num_gpus} GPU but "
                    f"torch finds no CUDA device (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); "
                    f"fix that node's GPU driver or image, or set resources.allow_cpu=true to train on CPU"
                )
            torch.set_num_threads(cfg.train.threads)
        return device

    def _member(self, cfg: CampaignConfig, job: Job, attempt: int, device: torch.device, cache: str) -> Member:
        shard = job_shard(self.store, cfg, job, cache)
        resumed = has_checkpoint(self.store, job.model_dir)
        ckpt = load_checkpoint(self.store, job.model_dir) if resumed else None
        state = ckpt.state(device) if ckpt else start_state(self.store, cfg, job, device)
        kept = ckpt.meta.get("usage") if ckpt else None
        target = cfg.seed_stage.updates if job.expert is None else cfg.train.updates
        trainer = job_trainer(cfg, job, shard, state, device)
        return Member(
            job=job,
            attempt=attempt,
            trainer=trainer,
            target=target,
            resumed=resumed,
            start_step=state.step,
            start_forwards=state.forwards,
            start_tokens=state.tokens,
            last_ckpt_step=state.step if resumed else -1,
            kept_by=ckpt.meta.get("attempt") if kept else None,
            kept=Usage(**kept) if kept else None,
        )

    def _checkpoint(self, m: Member) -> str:
        self._tick()
        m.last_ckpt_step = m.trainer.state.step
        return save_checkpoint(
            self.store,
            m.job.model_dir,
            m.trainer.state,
            {
                "role": m.job.role,
                "expert": m.job.expert,
                "attempt": m.attempt,
                "config_digest": self.cfg.digest(),
                "usage": asdict(self._usage(m)),
            },
        )

    def _update(self, members: list[Member]) -> list[tuple[Member, float]]:
        """One packed update -> (member, loss); an expert whose loss goes non-finite is dropped (it fails
        alone, its state untouched since its last checkpoint is what a retry starts from) and the rest redone."""
        while members:
            try:
                return [(m, s.loss) for m, s in zip(members, update_experts([m.trainer for m in members]), strict=True)]
            except NonFiniteLoss as exc:
                for i in exc.experts:
                    members[i].error = f"NonFiniteLoss: {exc}"  # the error it raised
                members = [m for m in members if not m.failed]
        return []

    def _stop_over_budget(self, todo: int, caps: dict) -> None:
        """A member whose next chunk would overrun its cap (GPU-seconds on its own cumulative clock) stops now; so
        does one already past it (a start-up that cost more than was left), before any update is measured."""
        live = self._live()
        for m in live:
            cap = caps.get(m.job.expert)
            need = min(todo, m.target - m.trainer.state.step) * (self.sec_per_update or 0.0) / len(live)
            if cap is not None and (self.held[m.job] + need) * self.num_gpus > cap:
                m.reason = StopReason.BUDGET_EXHAUSTED

    def run_chunk(
        self,
        max_updates: int,
        caps: dict[int | None, float | None] | None = None,
        targets: dict[int | None, int] | None = None,
    ) -> ChunkReport:
        """Up to max_updates updates of every live member, fewer if a preemption notice arrives. `targets`: each
        member's update target now (train.updates grown by soma set while it trains); a target only grows."""
        for m in self._live():
            m.target = max(m.target, (targets or {}).get(m.job.expert, m.target))
        caps = caps or {}
        todo = min(max_updates, max((m.target - m.trainer.state.step for m in self._live()), default=0))
        if self.sec_per_update is None:
            todo = min(todo, 1)  # measure one update before promising a chunk
        self._tick()
        self._stop_over_budget(todo, caps)
        losses = {m.job: [] for m in self.members.values()}
        val, ckpt = {}, {}
        t_start, done_updates = time.monotonic(), 0
        for _ in range(todo):
            batch = [m for m in self._live() if m.trainer.state.step < m.target]
            if not batch or self.preemption.requested:
                break
            for m, loss in self._update(batch):
                losses[m.job].append(loss)
                self._after_update(m, losses[m.job], val, ckpt)
            done_updates += 1
        if done_updates:
            per = (time.monotonic() - t_start) / done_updates
            self.sec_per_update = per if self.sec_per_update is None else 0.5 * (self.sec_per_update + per)
        for m in self.members.values():
            self._maybe_stop(m, ckpt)
        self._tick()
        beats = {
            m.job.expert: self._beat(m, losses[m.job], val.get(m.job), ckpt.get(m.job))
            for m in self.members.values()
            if not m.told
        }
        for m in self.members.values():
            m.told = m.done
        return ChunkReport(beats, time.monotonic() - self.t0)

    def _after_update(self, m: Member, losses: list, val: dict, ckpt: dict) -> None:
        cfg, tr = self.cfg, m.trainer
        st = tr.state
        on_grid = st.step % cfg.train.val_every == 0
        if on_grid or st.step == m.target:
            val[m.job] = tr.validate()
        if on_grid:  # only the grid's validations feed the lr/eps rule: a target off the grid (train.updates grown
            # later by soma set) changes nothing, so an extended expert trains as one given the total from the start
            tr.observe_val(val[m.job], cfg.train.val_every)
            recent = losses[-cfg.train.val_every :]
            st.history.append({"step": st.step, "train": sum(recent) / len(recent), "val": val[m.job]})
        if st.step % cfg.train.checkpoint_every == 0 or st.step == m.target:
            ckpt[m.job] = self._checkpoint(m)

    def _maybe_stop(self, m: Member, ckpt: dict) -> None:
        """At its target, at the lr floor and still not improving, out of budget, or preempted: stop with a
        checkpoint of the work since the last one."""
        if m.failed:
            return
        st, cfg = m.trainer.state, self.cfg
        if m.reason is None and st.step >= m.target:
            m.reason = StopReason.FINISHED
        if m.reason is None and st.schedule.lr <= cfg.spsa.floor and st.schedule.since_best >= cfg.spsa.patience:
            m.reason = StopReason.CONVERGED
        if m.reason is None and self.preemption.requested:
            m.reason = StopReason.PREEMPTED
        moved = m.last_ckpt_step != st.step and (m.reason != StopReason.PREEMPTED or st.step > m.start_step)
        if m.reason and moved:  # a clean stop always leaves a checkpoint; a preempted one, of any new work
            ckpt[m.job] = self._checkpoint(m)

    def _beat(self, m: Member, losses: list, val: float | None, ckpt: str | None) -> Heartbeat:
        st = m.trainer.state
        sched = st.schedule
        return Heartbeat(
            step=st.step,
            target=m.target,
            updates=len(losses),
            loss=sum(losses) / len(losses) if losses else None,
            val=val,
            best_val=sched.best_val if sched.best_val != float("inf") else None,
            eps=sched.eps,
            lr=sched.lr,
            checkpoint=ckpt,
            checkpoint_step=m.last_ckpt_step,
            usage=self._usage(m),
            sec_per_update=self.sec_per_update,
            reason=m.reason,
            error=m.error,
        )
