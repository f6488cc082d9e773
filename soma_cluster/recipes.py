"""What a job trains from: its shard, its starting state, its training method and its trainer. The expert worker
that trains a job, `soma plan` that times it and the experiments that measure it all build it here, so they
cannot drift apart. No Ray: this runs in the driver's process as well as in an actor's.
"""

from __future__ import annotations

import torch

from soma_cluster.checkpoint import load_checkpoint
from soma_cluster.config import CampaignConfig
from soma_cluster.jobs import SEED_JOB, Job
from soma_cluster.methods import SEED_METHOD, TrainingMethod, method_named
from soma_cluster.model import init_body, init_head
from soma_cluster.shards import Shard, open_shard
from soma_cluster.spsa import derive_seed
from soma_cluster.storage import Store
from soma_cluster.trainer import Trainer, TrainState

SEED_STREAM = -1  # the seed model's RNG stream id (probes, data order), as it has always been


def union_shard(store: Store, n_experts: int, cache: str) -> Shard:
    """All experts' data as one shard: the seed model (N = 1) trains on the whole corpus."""
    parts = [open_shard(store, e, cache) for e in range(n_experts)]
    return Shard(-1, parts[0].seq_bytes, [a for p in parts for a in p.train], [a for p in parts for a in p.val])


def job_shard(store: Store, cfg: CampaignConfig, job: Job, cache: str) -> Shard:
    """The seed's union of every shard, or an expert's own shard."""
    return union_shard(store, cfg.n_experts, cache) if job.expert is None else open_shard(store, job.expert, cache)


def training_method(cfg: CampaignConfig, job: Job) -> TrainingMethod:
    """The seed stage is always SPSA with the delta-rule decoder; experts train by train.method."""
    return method_named(SEED_METHOD if job.expert is None else cfg.train.method)


def start_state(store: Store, cfg: CampaignConfig, job: Job, device: torch.device) -> TrainState:
    """A fresh seed model, or an expert starting from the seed (body and head; the head trains only if 'own')."""
    if job.expert is None:
        gen = torch.Generator().manual_seed(derive_seed(cfg.seed, "seed-init"))
        body, head = init_body(cfg.model, gen), init_head(cfg.model, gen)
        return TrainState.fresh(body.to(device), head.to(device), True, cfg.seed_stage.eps, cfg.seed_stage.lr)
    seed = load_checkpoint(store, SEED_JOB.model_dir).state(device)
    return expert_start(cfg, seed.body, seed.head)


def expert_start(cfg: CampaignConfig, body: torch.Tensor, head: torch.Tensor) -> TrainState:
    """An expert's fresh state from a starting body and head, with its method's perturbation scale and lr."""
    eps, lr = method_named(cfg.train.method).schedule_start(cfg)
    return TrainState.fresh(body, head, cfg.model.head == "own", eps, lr)


def job_trainer(
    cfg: CampaignConfig,
    job: Job,
    shard: Shard,
    state: TrainState,
    device: torch.device,
    val_rows: int | None = None,
) -> Trainer:
    """The job's trainer on its RNG streams, by its training method; it validates on train.val_batches batches
    unless `val_rows` says otherwise."""
    return Trainer(
        model=cfg.model,
        spsa=cfg.spsa,
        shard=shard,
        state=state,
        seed=cfg.seed,
        expert=SEED_STREAM if job.expert is None else job.expert,
        device=device,
        val_rows=cfg.train.val_batches * cfg.spsa.batch if val_rows is None else val_rows,
        estimator=training_method(cfg, job).estimator(cfg),
    )
