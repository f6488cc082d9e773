"""A campaign's training curve: the routed ensemble's test loss at its kept checkpoints, with the compute
spent to reach each one (seed included), so runs can be compared at matched GPU-hours or matched forwards.

x-axes come from what was measured: forward passes from the checkpoints' own counters (the seed's plus
every expert's), aggregate GPU-seconds from the ledger (preprocessing and seed records, plus expert
training and wasted records up to that step). y is the paper's evaluation protocol with its document
bootstrap interval, on the campaign's test windows.
"""

from __future__ import annotations

import numpy as np

from pipelines.evaluate import Ensemble, _summary
from soma_cluster.checkpoint import checkpoint_steps
from soma_cluster.config import CampaignConfig
from soma_cluster.ensemble import bootstrap_weights, load_windows, require_checkpoint
from soma_cluster.jobs import EXPERT_SPEND, SEED_JOB, Category, Job, expert_name
from soma_cluster.ledger import Ledger
from soma_cluster.router import load_router
from soma_cluster.storage import Store
from soma_cluster.trainer import pick_device

ALWAYS = (Category.PREPROCESSING, Category.SEED)  # spent before any expert step


def _evenly(steps: list[int], k: int) -> list[int]:
    """At most k of the steps, evenly spaced, the last always kept."""
    if len(steps) <= k:
        return steps
    idx = np.linspace(0, len(steps) - 1, k).round().astype(int)
    return sorted({steps[i] for i in idx})


def curve(store: Store, cfg: CampaignConfig, max_points: int = 12) -> list[dict]:
    """[{step, forwards, gpu_hours, nats_per_byte, ci95}], the first point being the seed model (step 0)."""
    device = pick_device()
    kept = {e: checkpoint_steps(store, Job(e).model_dir) for e in range(cfg.n_experts)}
    steps = _evenly(sorted({s for v in kept.values() for s in v if s > 0}), max_points)
    win = load_windows(store, cfg.eval_windows())
    w = bootstrap_weights(win.docs, cfg.eval.bootstrap, cfg.seed)
    ctx = cfg.eval.context_bytes
    router = load_router(store)
    records = Ledger(store).records()
    base_s = sum(r["gpu_seconds"] for r in records if r["category"] in ALWAYS)
    seed = require_checkpoint(store, SEED_JOB.model_dir, "the seed model")
    seed_fw = seed.meta["state"]["forwards"]
    first = Ensemble.load(store, cfg, router=router)
    points = [
        {"step": 0, "forwards": seed_fw, "gpu_hours": base_s / 3600, **_summary(first.seed_nats(win, ctx, device), w)}
    ]
    for s in steps:
        # each expert at its latest checkpoint not after s (experts that stopped early stay where they stopped)
        cks = {
            e: require_checkpoint(
                store, Job(e).model_dir, expert_name(e), f"step-{max(x for x in kept[e] if x <= s):06d}"
            )
            for e in range(cfg.n_experts)
            if any(x <= s for x in kept[e])
        }
        if len(cks) < cfg.n_experts:
            continue
        ens = Ensemble(cfg, router, cks, seed.tensors)
        res = ens.run(win, ctx, device)
        spent = base_s + sum(
            r["gpu_seconds"]
            for r in records
            if r["category"] in EXPERT_SPEND and r["step"] is not None and r["step"] <= s
        )
        points.append(
            {
                "step": s,
                "forwards": seed_fw + sum(ck.meta["state"]["forwards"] for ck in cks.values()),
                "gpu_hours": spent / 3600,
                **_summary(res.nats, w),
            }
        )
    return points
