"""`soma plan`'s arithmetic: what a campaign will cost before it runs, from its config and a measured
calibration (seconds per packed update, validation, checkpoint and start-up, timed on the real model and
shards: pipelines/plan.py). Pure functions, no Ray, no clocks, so the model can be tested and argued with.

The model follows the worker's own rules: an actor holds num_gpus from its start-up on; its G packed
experts share each update's wall time evenly; the worker checks before every chunk whether the next one
fits its cap (the first chunk is one update, measured); the driver runs floor(K / num_gpus) actors at once
and hands the next unit to the first free slot. On a CPU host the logical GPUs share the cores: when the
actors running at once ask for more threads than there are cores, each runs that much slower.
Not modelled: failures and preemptions (wasted = 0), the budget pool's grants, queueing for new nodes.
"""

from __future__ import annotations

import math
from typing import Callable

from soma_cluster.budget import BudgetBook
from soma_cluster.config import CampaignConfig
from soma_cluster.jobs import Category, JobState
from soma_cluster.prices import usd_per_hour

SCHEMA = 1


def _events(updates: int, every: int) -> int:
    """Validations or checkpoints in `updates` updates: every `every`-th step and the last."""
    return updates // every + (1 if updates % every else 0)


def stop_step(target: int, chunk: int, cost: Callable[[int], float], per_update_s: float, cap_s: float | None) -> int:
    """The step an expert reaches: the worker stops before a chunk that would take it past `cap_s` GPU-seconds
    (`cost(step)`: its GPU-seconds at that step; it predicts a chunk from its measured seconds per update)."""
    if cap_s is None:
        return target
    step, todo = 0, 1  # the first chunk is one update (measured before promising more)
    while step < target:
        todo = min(todo, target - step)
        if cost(step) + (todo * per_update_s if step > 0 else 0.0) > cap_s:
            return step
        step, todo = step + todo, chunk
    return step


def _list_schedule(durations: list[float], slots: int) -> float:
    """Wall time of jobs handed in order to the first free of `slots` workers."""
    free = [0.0] * max(1, slots)
    for d in durations:
        i = min(range(len(free)), key=free.__getitem__)
        free[i] += d
    return max(free) if durations else 0.0


def predict(cfg: CampaignConfig, cal: dict, gpus: float, cores: int, spent: dict[str, float], seed_done: bool) -> dict:
    """The plan (schema 1, docs/json.md): GPU-hours by category, wall seconds on `gpus` GPUs, each
    expert's predicted end and step, and the worst-case budget overrun. `spent`: GPU-seconds already in the
    ledger by category (preprocessing, and the seed if it is trained)."""
    r = cfg.resources
    g = min(r.experts_per_actor, cfg.n_experts)
    slots = max(1, math.floor(gpus / r.num_gpus + 1e-9))
    units = math.ceil(cfg.n_experts / g)
    cpu = cal["device"] == "cpu"
    contention = max(1.0, min(slots, units) * cfg.train.threads / cores) if cpu else 1.0
    t = cfg.train
    # one expert's share of its actor, in GPU-seconds
    fixed = (
        (cal["startup_s"] + cal["load_s"]) * contention * r.num_gpus / g
    )  # actors start together: imports contend too
    per_update = cal["packed_update_s"] * contention * r.num_gpus / g
    # each member's validation and checkpoint run one after another in the actor, its time split among members:
    # per member and event, one validation's (or checkpoint's) wall time
    val, ckpt = cal["val_s"] * contention * r.num_gpus, cal["checkpoint_s"] * r.num_gpus

    def cost(step: int) -> float:
        return fixed + step * per_update + _events(step, t.val_every) * val + _events(step, t.checkpoint_every) * ckpt

    book = BudgetBook(cfg.budget)
    seed_s = spent.get(Category.SEED, 0.0) if seed_done else _seed_s(cfg, cal)
    cap = book.expert_s
    if book.campaign_s is not None:
        share = (book.campaign_s - spent.get(Category.PREPROCESSING, 0.0) - seed_s) / cfg.n_experts
        cap = share if cap is None else min(cap, share)
    price = usd_per_hour(cfg.prices, cal["device"])  # USD per GPU-hour on the calibrated device (None: unpriced)
    if price:  # dollar caps at that price, as the scheduler converts them
        if cfg.budget.expert_usd is not None:
            cap = min(cap if cap is not None else math.inf, cfg.budget.expert_usd / price * 3600.0)
        if cfg.budget.campaign_usd is not None:
            left = cfg.budget.campaign_usd / price * 3600.0 - spent.get(Category.PREPROCESSING, 0.0) - seed_s
            cap = min(cap if cap is not None else math.inf, left / cfg.n_experts)
    experts = []
    for e in range(cfg.n_experts):
        step = stop_step(t.updates, t.chunk_updates, cost, per_update, cap)
        s = cost(step)
        end = JobState.FINISHED if step >= t.updates else JobState.BUDGET_EXHAUSTED
        experts.append({"expert": e, "end": end, "step": step, "target": t.updates, "gpu_hours": s / 3600.0})
    # an actor lasts as long as its longest member (GPU-seconds / num_gpus * G = wall seconds)
    unit_walls = [
        max(x["gpu_hours"] for x in experts[i : i + g]) * 3600.0 / r.num_gpus * g for i in range(0, cfg.n_experts, g)
    ]
    if r.reuse_actors:  # one start-up per slot, not per unit
        saved = cal["startup_s"]
        unit_walls = [w - (saved if i >= slots else 0.0) for i, w in enumerate(unit_walls)]
    experts_wall = _list_schedule(unit_walls, slots)
    expert_s = (
        sum(x["gpu_hours"] for x in experts) * 3600.0
        - (units - min(units, slots)) * cal["startup_s"] * r.num_gpus * r.reuse_actors
    )
    seed_wall = 0.0 if seed_done else seed_s / r.num_gpus
    per, total = book.worst_overrun_s(r.num_gpus, cal.get("poll_s", 0.5), min(slots, units))
    hours = {
        Category.PREPROCESSING: spent.get(Category.PREPROCESSING, 0.0) / 3600.0,
        Category.SEED: seed_s / 3600.0,
        Category.EXPERT_TRAINING: expert_s / 3600.0,
        Category.WASTED: 0.0,
        Category.PREEMPTED: 0.0,
    }
    return {
        "schema": SCHEMA,
        "gpus": gpus,
        "slots": slots,
        "actors": units,
        "experts_per_actor": g,
        "cores": cores,
        "cpu_contention": contention,
        "seed_trained": seed_done,
        "gpu_hours": {**hours, "training_total": hours[Category.SEED] + hours[Category.EXPERT_TRAINING]},
        "usd_per_gpu_hour": price,
        "usd": None if price is None else {k: v * price for k, v in hours.items()},
        "wall_seconds": {"seed": seed_wall, "experts": experts_wall, "total": seed_wall + experts_wall},
        "budget": {
            "expert_gpu_hours": cfg.budget.expert_gpu_hours,
            "campaign_gpu_hours": cfg.budget.campaign_gpu_hours,
            "expert_usd": cfg.budget.expert_usd,
            "campaign_usd": cfg.budget.campaign_usd,
            "effective_expert_cap_gpu_hours": None if cap is None else cap / 3600.0,
            "experts_stopped": sum(x["end"] == JobState.BUDGET_EXHAUSTED for x in experts),
            "worst_overrun_gpu_seconds": {"per_expert": per, "campaign": total} if cap is not None else None,
        },
        "experts": experts,
        "calibration": cal,
        "not_modelled": [
            "failures and preemptions (wasted = 0)",
            "budget pool grants",
            "time queued for new nodes",
            "evaluation",
        ],
    }


def _seed_s(cfg: CampaignConfig, cal: dict) -> float:
    """The seed stage's GPU-seconds: one actor, one job, seed_stage.updates updates."""
    n = cfg.seed_stage.updates
    t = cfg.train
    wall = (
        cal["startup_s"]
        + cal["seed_load_s"]
        + n * cal["seed_update_s"]
        + _events(n, t.val_every) * cal["val_s"]
        + _events(n, t.checkpoint_every) * cal["checkpoint_s"]
    )
    return wall * cfg.resources.num_gpus
