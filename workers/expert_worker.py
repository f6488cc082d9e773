"""ExpertWorker: a Ray actor that trains ONE model (the seed, or one expert on its own shard).

It never talks to another actor. The driver calls `setup()` once, then `run_chunk()` repeatedly;
each call returns a heartbeat (step, losses, GPU-seconds held so far). Checkpoints go straight to
the campaign directory. The GPU-second clock starts the moment the actor exists, i.e. holds its GPU.
"""
from __future__ import annotations

import os
import tempfile
import time

import ray
import torch

from soma_cluster.checkpoint import has_checkpoint, load_checkpoint, save_checkpoint
from soma_cluster.config import CampaignConfig, load_campaign_config
from soma_cluster.model import init_body, init_head
from soma_cluster.shards import Shard, expert_name, open_shard
from soma_cluster.spsa import derive_seed
from soma_cluster.storage import Store
from soma_cluster.trainer import Trainer, TrainState, pick_device

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
    return TrainState.fresh(seed.body, seed.head, cfg.model.head == "own", cfg.spsa.eps, cfg.spsa.lr)


class ExpertWorker:
    def __init__(self, campaign_url: str, storage_options: dict, role: str, expert: int, attempt: int, num_gpus: float):
        self.t0 = time.monotonic()
        self.store = Store(campaign_url, storage_options)
        self.role, self.expert, self.attempt, self.num_gpus = role, expert, attempt, num_gpus
        self.dir = model_dir(role, expert)
        self.trainer: Trainer | None = None
        self.sec_per_update: float | None = None

    def pid(self) -> int:
        return os.getpid()

    def gpu_seconds(self) -> float:
        return (time.monotonic() - self.t0) * self.num_gpus

    def setup(self) -> dict:
        self.cfg = cfg = load_campaign_config(self.store)
        device = pick_device()
        if device.type == "cpu":
            torch.set_num_threads(cfg.train.threads)
        cache = os.path.join(tempfile.gettempdir(), "soma-cache", cfg.digest())
        shard = union_shard(self.store, cfg.n_experts, cache) if self.role == "seed" else open_shard(self.store, self.expert, cache)
        resumed = has_checkpoint(self.store, self.dir)
        state = load_checkpoint(self.store, self.dir).state(device) if resumed else start_state(self.store, cfg, self.role, device)
        self.target = cfg.seed_stage.updates if self.role == "seed" else cfg.train.updates
        seed_expert = -1 if self.role == "seed" else self.expert
        self.trainer = Trainer(cfg.model, cfg.spsa, shard, state, cfg.seed, seed_expert, device, cfg.train.val_batches * cfg.spsa.batch)
        self.start_forwards, self.start_tokens = state.forwards, state.tokens
        self.last_ckpt_step = state.step if resumed else -1
        self.last_ckpt_gpu_s = 0.0                              # GPU-seconds held when that checkpoint was written
        self.last_ckpt_forwards = 0
        return {"step": state.step, "target": self.target, "resumed": resumed, "device": str(device), "pid": os.getpid(),
                "node": ray.get_runtime_context().get_node_id() if ray.is_initialized() else None,
                "gpu_seconds": self.gpu_seconds(), "n_train": shard.n_train}

    def _checkpoint(self) -> str:
        st = self.trainer.state
        self.last_ckpt_step, self.last_ckpt_gpu_s = st.step, self.gpu_seconds()
        self.last_ckpt_forwards = st.forwards - self.start_forwards
        return save_checkpoint(self.store, self.dir, st, {"role": self.role, "expert": self.expert, "attempt": self.attempt,
                                                          "config_digest": self.cfg.digest()})

    def run_chunk(self, max_updates: int, budget_left_s: float | None = None) -> dict:
        """Up to max_updates updates; stops early (with a checkpoint) if the next chunk would overrun the budget."""
        tr, cfg = self.trainer, self.cfg
        st = tr.state
        todo = min(max_updates, self.target - st.step)
        if self.sec_per_update is None:
            todo = min(todo, 1)                              # measure one update before promising a chunk
        reason, ckpt, losses, val = None, None, [], None
        if budget_left_s is not None and self.sec_per_update is not None:
            if self.gpu_seconds() + todo * self.sec_per_update * self.num_gpus > budget_left_s:
                reason, todo = "budget_exhausted", 0
        t_start = time.monotonic()
        for _ in range(todo):
            stats = tr.update()
            losses.append(stats.loss)
            if st.step % cfg.train.val_every == 0 or st.step == self.target:
                val = tr.validate()
                tr.observe_val(val, cfg.train.val_every)
                st.history.append({"step": st.step, "train": sum(losses[-cfg.train.val_every:]) / len(losses[-cfg.train.val_every:]), "val": val})
            if st.step % cfg.train.checkpoint_every == 0 or st.step == self.target:
                ckpt = self._checkpoint()
        if todo:
            per = (time.monotonic() - t_start) / todo
            self.sec_per_update = per if self.sec_per_update is None else 0.5 * (self.sec_per_update + per)
        sched = st.schedule
        if reason is None and sched.lr <= cfg.spsa.floor and sched.since_best >= cfg.spsa.patience:
            reason = "converged"                               # at the floor and still not improving
        if reason and self.last_ckpt_step != st.step:     # a clean stop always leaves a checkpoint
            ckpt = self._checkpoint()
        done = st.step >= self.target or reason is not None
        held = time.monotonic() - self.t0                     # one clock read for wall and GPU-seconds
        return {"step": st.step, "target": self.target, "updates": todo, "loss": sum(losses) / len(losses) if losses else None,
                "val": val, "best_val": st.schedule.best_val if st.schedule.best_val != float("inf") else None,
                "eps": st.schedule.eps, "lr": st.schedule.lr, "checkpoint": ckpt, "done": done,
                "reason": reason or ("finished" if done else None), "gpu_seconds": held * self.num_gpus,
                "wall_seconds": held, "forwards": st.forwards - self.start_forwards,
                "tokens": st.tokens - self.start_tokens, "sec_per_update": self.sec_per_update,
                "checkpoint_step": self.last_ckpt_step, "checkpoint_gpu_seconds": self.last_ckpt_gpu_s,
                "checkpoint_forwards": self.last_ckpt_forwards}
