"""ExpertWorker: a Ray actor that trains ONE model (the seed, or one expert on its own shard), or G
small experts packed on the engine's expert axis, each on its own shard.

It never talks to another actor. The driver calls `setup()` once, then `run_chunk()` repeatedly;
each call returns one heartbeat per expert (step, losses, GPU-seconds held so far). Checkpoints go
straight to the campaign directory. The GPU-second clock starts the moment the actor exists, i.e.
holds its GPU.
"""
from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass

import ray
import torch

from soma_cluster.checkpoint import has_checkpoint, load_checkpoint, save_checkpoint
from soma_cluster.config import CampaignConfig, load_campaign_config
from soma_cluster.model import init_body, init_head
from soma_cluster.shards import Shard, expert_name, open_shard
from soma_cluster.spsa import derive_seed
from soma_cluster.storage import Store
from soma_cluster.trainer import Method, NonFiniteLoss, Trainer, TrainState, pick_device, update_experts

SEED_DIR = "seed"


def model_dir(role: str, expert: int) -> str:
    return SEED_DIR if role == "seed" else f"experts/{expert_name(expert)}"


def union_shard(store: Store, n_experts: int, cache: str) -> Shard:
    """All experts' data as one shard: the seed model (N = 1) trains on the whole corpus."""
    parts = [open_shard(store, e, cache) for e in range(n_experts)]
    return Shard(-1, parts[0].seq_bytes, [a for p in parts for a in p.train], [a for p in parts for a in p.val])


def start_state(store: Store, cfg: CampaignConfig, role: str, device: torch.device) -> TrainState:
    """A fresh seed model, or an expert starting from the seed (body and head; the head trains only if 'own')."""
    if role == "seed":
        gen = torch.Generator().manual_seed(derive_seed(cfg.seed, "seed-init"))
        body, head = init_body(cfg.model, gen), init_head(cfg.model, gen)
        return TrainState.fresh(body.to(device), head.to(device), True, cfg.seed_stage.eps, cfg.seed_stage.lr)
    seed = load_checkpoint(store, SEED_DIR).state(device)
    method = cfg.train.method
    eps = cfg.eggroll.sigma if method == "eggroll" else cfg.spsa.eps      # the perturbation scale the schedule halves
    lr = cfg.bptt.lr if method == "bptt" else cfg.spsa.lr
    return TrainState.fresh(seed.body, seed.head, cfg.model.head == "own", eps, lr)


def training_method(cfg: CampaignConfig, role: str) -> Method:
    """The seed stage is always SPSA with the delta-rule decoder; experts train by train.method."""
    return Method(cfg.train.method if role == "expert" else "spsa", cfg.eggroll, cfg.bptt)


@dataclass
class Member:
    """One expert inside an actor: its trainer, where it checkpoints, and what it has reported."""
    expert: int
    attempt: int
    dir: str
    trainer: Trainer
    target: int
    resumed: bool
    start_forwards: int
    start_tokens: int
    last_ckpt_step: int
    last_ckpt_held: float = 0.0       # wall seconds attributed to it when that checkpoint was written
    last_ckpt_forwards: int = 0
    reason: str | None = None         # set once it stops: finished, converged, budget_exhausted, or a failure
    failed: bool = False
    told: bool = False                # its last heartbeat (done) has gone to the driver


class ExpertWorker:
    """Trains one expert, or G small experts packed on the expert axis (`resources.experts_per_actor`).

    Packed experts share the actor's forward passes but nothing else: each has its own shard, probes,
    optimizer, schedule, budget and checkpoints, and stops on its own. The actor's held time is split
    evenly among the experts it is training at each moment, so their GPU-seconds add up to the actor's."""

    def __init__(self, campaign_url: str, storage_options: dict, role: str, experts: int | list[int],
                 attempts: int | list[int], num_gpus: float):
        self.t0 = self._tick_at = time.monotonic()
        self.store = Store(campaign_url, storage_options)
        self.experts = [experts] if isinstance(experts, int) else list(experts)
        self.attempts = [attempts] * len(self.experts) if isinstance(attempts, int) else list(attempts)
        self.role, self.num_gpus = role, num_gpus
        self.held = dict.fromkeys(self.experts, 0.0)     # wall seconds attributed to each expert
        self.members: dict[int, Member] = {}
        self.sec_per_update: float | None = None        # one packed update of every live member

    def pid(self) -> int:
        return os.getpid()

    def _live(self) -> list[Member]:
        return [m for m in self.members.values() if m.reason is None]

    def _tick(self) -> None:
        """Attribute the time since the last tick to the experts whose last heartbeat is still to come (all
        of them during setup), so the experts' seconds add up to the actor's: nothing is lost or counted twice."""
        now = time.monotonic()
        live = [m.expert for m in self.members.values() if not m.told] if self.members else self.experts
        for e in live:
            self.held[e] += (now - self._tick_at) / len(live)
        self._tick_at = now

    def setup(self, experts: int | list[int] | None = None, attempts: int | list[int] | None = None) -> dict:
        """Load the experts (their checkpoints or the seed). With `experts`, an actor whose experts have all
        ended takes new ones (resources.reuse_actors): the time since its last heartbeat goes to them."""
        if experts is not None:
            if any(not m.told for m in self.members.values()):
                raise RuntimeError("setup(experts=...) while experts are still training in this actor")
            self.experts = [experts] if isinstance(experts, int) else list(experts)
            self.attempts = [attempts] * len(self.experts) if isinstance(attempts, int) else list(attempts)
            self.held |= dict.fromkeys(self.experts, 0.0)
            self.members, self.sec_per_update = {}, None
        self.cfg = cfg = load_campaign_config(self.store)
        device = pick_device()
        if device.type == "cpu":
            torch.set_num_threads(cfg.train.threads)
        cache = os.path.join(tempfile.gettempdir(), "soma-cache", cfg.digest())
        for expert, attempt in zip(self.experts, self.attempts):
            self.members[expert] = self._member(cfg, expert, attempt, device, cache)
        self._tick()
        return {"device": str(device), "pid": os.getpid(), "wall_seconds": time.monotonic() - self.t0,
                "node": ray.get_runtime_context().get_node_id() if ray.is_initialized() else None,
                "experts": {m.expert: {"step": m.trainer.state.step, "target": m.target, "resumed": m.resumed,
                                       "forwards": m.start_forwards, "n_train": m.trainer.shard.n_train}
                            for m in self.members.values()}}

    def _member(self, cfg: CampaignConfig, expert: int, attempt: int, device: torch.device, cache: str) -> Member:
        directory = model_dir(self.role, expert)
        shard = union_shard(self.store, cfg.n_experts, cache) if self.role == "seed" else open_shard(self.store, expert, cache)
        resumed = has_checkpoint(self.store, directory)
        state = load_checkpoint(self.store, directory).state(device) if resumed else start_state(self.store, cfg, self.role, device)
        target = cfg.seed_stage.updates if self.role == "seed" else cfg.train.updates
        trainer = Trainer(cfg.model, cfg.spsa, shard, state, cfg.seed, expert, device, cfg.train.val_batches * cfg.spsa.batch,
                          training_method(cfg, self.role))
        return Member(expert, attempt, directory, trainer, target, resumed, state.forwards, state.tokens,
                      state.step if resumed else -1)

    def _checkpoint(self, m: Member) -> str:
        st = m.trainer.state
        self._tick()
        m.last_ckpt_step, m.last_ckpt_held = st.step, self.held[m.expert]
        m.last_ckpt_forwards = st.forwards - m.start_forwards
        return save_checkpoint(self.store, m.dir, st, {"role": self.role, "expert": m.expert, "attempt": m.attempt,
                                                       "config_digest": self.cfg.digest()})

    def _update(self, members: list[Member]) -> list[tuple[Member, float]]:
        """One packed update -> (member, loss); an expert whose loss goes non-finite is dropped (it fails
        alone, its state untouched since its last checkpoint is what a retry starts from) and the rest redone."""
        while members:
            try:
                return [(m, s.loss) for m, s in zip(members, update_experts([m.trainer for m in members]))]
            except NonFiniteLoss as exc:
                for i in exc.experts:
                    members[i].reason, members[i].failed = f"exception: NonFiniteLoss: {exc}", True
                members = [m for m in members if not m.failed]
        return []

    def run_chunk(self, max_updates: int, caps: dict[int, float | None] | float | None = None) -> dict:
        """Up to max_updates updates of every live member; a member stops early (with a checkpoint) if the
        next chunk would overrun its budget (`caps`: GPU-seconds per expert, its own cumulative clock)."""
        caps = caps if isinstance(caps, dict) else dict.fromkeys(self.members, caps)
        todo = min(max_updates, max((m.target - m.trainer.state.step for m in self._live()), default=0))
        if self.sec_per_update is None:
            todo = min(todo, 1)                              # measure one update before promising a chunk
        self._tick()
        live = self._live()
        for m in live:
            cap = caps.get(m.expert)
            need = min(todo, m.target - m.trainer.state.step) * (self.sec_per_update or 0.0) / len(live)
            if cap is not None and self.sec_per_update is not None and (self.held[m.expert] + need) * self.num_gpus > cap:
                m.reason = "budget_exhausted"
        losses = {m.expert: [] for m in self.members.values()}
        val, ckpt = {}, {}
        t_start, done_updates = time.monotonic(), 0
        for _ in range(todo):
            batch = [m for m in self._live() if m.trainer.state.step < m.target]
            if not batch:
                break
            for m, loss in self._update(batch):
                losses[m.expert].append(loss)
                self._after_update(m, losses[m.expert], val, ckpt)
            done_updates += 1
        if done_updates:
            per = (time.monotonic() - t_start) / done_updates
            self.sec_per_update = per if self.sec_per_update is None else 0.5 * (self.sec_per_update + per)
        for m in self.members.values():
            self._maybe_stop(m, ckpt)
        self._tick()
        beats = {e: self._beat(m, losses[e], val.get(e), ckpt.get(e)) for e, m in self.members.items() if not m.told}
        for m in self.members.values():
            m.told = m.reason is not None
        return {"experts": beats, "wall_seconds": time.monotonic() - self.t0}

    def _after_update(self, m: Member, losses: list, val: dict, ckpt: dict) -> None:
        cfg, tr = self.cfg, m.trainer
        st = tr.state
        if st.step % cfg.train.val_every == 0 or st.step == m.target:
            val[m.expert] = tr.validate()
            tr.observe_val(val[m.expert], cfg.train.val_every)
            recent = losses[-cfg.train.val_every:]
            st.history.append({"step": st.step, "train": sum(recent) / len(recent), "val": val[m.expert]})
        if st.step % cfg.train.checkpoint_every == 0 or st.step == m.target:
            ckpt[m.expert] = self._checkpoint(m)

    def _maybe_stop(self, m: Member, ckpt: dict) -> None:
        """At its target, at the lr floor and still not improving, or out of budget: stop with a checkpoint."""
        if m.failed:
            return
        st, cfg = m.trainer.state, self.cfg
        if m.reason is None and st.step >= m.target:
            m.reason = "finished"
        if m.reason is None and st.schedule.lr <= cfg.spsa.floor and st.schedule.since_best >= cfg.spsa.patience:
            m.reason = "converged"
        if m.reason and m.last_ckpt_step != st.step:          # a clean stop always leaves a checkpoint
            ckpt[m.expert] = self._checkpoint(m)

    def _beat(self, m: Member, losses: list, val: float | None, ckpt: str | None) -> dict:
        st = m.trainer.state
        sched = st.schedule
        return {"step": st.step, "target": m.target, "updates": len(losses), "loss": sum(losses) / len(losses) if losses else None,
                "val": val, "best_val": sched.best_val if sched.best_val != float("inf") else None,
                "eps": sched.eps, "lr": sched.lr, "checkpoint": ckpt, "done": m.reason is not None,
                "reason": m.reason, "failed": m.failed,
                "gpu_seconds": self.held[m.expert] * self.num_gpus, "wall_seconds": self.held[m.expert],
                "forwards": st.forwards - m.start_forwards, "tokens": st.tokens - m.start_tokens,
                "sec_per_update": self.sec_per_update, "checkpoint_step": m.last_ckpt_step,
                "checkpoint_gpu_seconds": m.last_ckpt_held * self.num_gpus, "checkpoint_forwards": m.last_ckpt_forwards}
