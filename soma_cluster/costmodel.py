"""`soma plan`'s arithmetic: what a campaign will cost before it runs, from its config and a measured
calibration (seconds per packed update, validation, checkpoint and start-up, timed on the real model and
shards: pipelines/plan.py). Pure functions, no Ray, no clocks, so the model can be tested and argued with.

The model follows the worker's and the driver's own rules: an actor holds num_gpus from when Ray places it; its G
packed experts share each update's wall time evenly; the worker checks before every chunk whether the next one
fits its cap (the first chunk is one update, measured); the driver runs floor(K / num_gpus) actors at once (at most
resources.max_actors) and hands the next unit to the first free slot. On a CPU host the logical GPUs share the
cores: the calibration times that many actors at once (its concurrent probe, at Ray's workers' niceness), and
without a probe each runs slower by threads over cores.

GPU-hours are what the ledger will bill, which is not all the time a slot is held (actor_starts): an actor that
waited in Ray's queue (every actor past the first wave, by default) is billed from its first instruction, so its
process start and imports (calibration `startup_s`) are in the wall time but on no one's bill; `unbilled_gpu_hours`
says how much. Counting them, as this model did until 2026-12, put a campaign of 256 experts of 60 updates at
1.2555 GPU-hours against the ledger's 0.6913. Given the times a recorded run took (times_of_run), the model bills
within 1% of its ledger and predicts its wall time within 2%, at N = 4 and N = 256 (tests/test_eta.py).
Not modelled: failures and preemptions (wasted = 0), the budget pool's grants, queueing for new nodes, a machine
whose speed changes after the calibration (on a shared CPU host, several times within minutes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from soma_cluster.budget import BudgetBook
from soma_cluster.config import CampaignConfig, ResourcesConfig, TrainConfig
from soma_cluster.jobs import TERMINAL, Category, JobState
from soma_cluster.prices import usd_per_hour

SCHEMA = 1
PLAN = "plan/plan.json"  # where `soma plan` writes it, in the campaign
GRANTED, QUEUED, REUSED = "granted", "queued", "reused"  # how an actor begins (actor_starts)
NOT_MODELLED = [
    "failures and preemptions (wasted = 0)",
    "budget pool grants",
    "time queued for new nodes",
    "evaluation",
]


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


@dataclass(frozen=True)
class ActorTimes:
    """One actor's wall seconds on the calibrated device, CPU contention included."""

    boot_s: float  # a new process importing the worker, once Ray has placed the actor
    load_s: float  # loading its members' shards and models (the worker's set-up)
    update_s: float  # one packed update of its members
    val_s: float  # one member's validation (members validate one after another)
    checkpoint_s: float  # one member's checkpoint (I/O: no contention)

    def run_s(self, step: int, g: int, t: TrainConfig) -> float:
        """The actor's wall seconds from its set-up to a member's `step`, its G members' validations and
        checkpoints included."""
        return (
            step * self.update_s
            + _events(step, t.val_every) * self.val_s * g
            + _events(step, t.checkpoint_every) * self.checkpoint_s * g
        )


def actor_times(cal: dict, actors: int, threads: int, cores: int) -> tuple[ActorTimes, float]:
    """An actor's times when `actors` run at once, and the slow-down on the calibration's own times. On a GPU, none:
    each actor has its own. On a CPU host they share the cores: as measured by the concurrent probe (pipelines/
    plan.py: that many actors at once at Ray's workers' niceness, under whatever else the host runs), rescaled
    to `actors` by threads over cores where the plan asks for another count; without a probe, by threads over
    cores alone (the actors start together: their imports contend too)."""
    if cal["device"] != "cpu":
        return ActorTimes(
            cal["startup_s"], cal["load_s"], cal["packed_update_s"], cal["val_s"], cal["checkpoint_s"]
        ), 1.0
    model = lambda n: max(1.0, n * threads / cores)  # noqa: E731
    probe = cal.get("concurrent")
    if not probe:
        c = model(actors)
        return ActorTimes(
            *(cal[k] * c for k in ("startup_s", "load_s", "packed_update_s", "val_s")), cal["checkpoint_s"]
        ), c
    k = model(actors) / model(probe["actors"])
    c = probe["update_s"] / cal["packed_update_s"] * k
    return ActorTimes(
        probe["boot_s"] * k, probe["load_s"] * k, probe["update_s"] * k, cal["val_s"] * c, cal["checkpoint_s"]
    ), c


def actor_starts(r: ResourcesConfig, slots: int, units: int) -> list[str]:
    """How each actor, in start order, begins (pipelines/campaign.py asks Ray for them): GRANTED, Ray had room and
    gave its share at once, so its process start and imports are on the worker's clock (held_from in
    workers/expert_worker.py); QUEUED, it waited in Ray's queue for a slot to free and its clock starts at its first
    instruction, after them; REUSED, an idle actor takes it (resources.reuse_actors): no new process."""
    extra = r.max_pending if r.max_pending is not None else (0 if r.reuse_actors else math.inf)
    capacity = min(slots + extra, r.max_actors or math.inf)  # actors asked of Ray at once
    first = int(min(slots, units, capacity))
    later = REUSED if r.reuse_actors else GRANTED if capacity <= slots else QUEUED
    return [GRANTED] * first + [later] * (units - first)


def actors_at_once(cfg: CampaignConfig, gpus: float) -> int:
    """Actors that run at once on `gpus` GPUs: floor(gpus / num_gpus), at most resources.max_actors and N's units."""
    r = cfg.resources
    slots = max(1, math.floor(gpus / r.num_gpus + 1e-9))
    return int(min(slots, r.max_actors or math.inf, math.ceil(cfg.n_experts / min(r.experts_per_actor, cfg.n_experts))))


def predict(cfg: CampaignConfig, cal: dict, gpus: float, cores: int, spent: dict[str, float], seed_done: bool) -> dict:
    """The plan (schema 1, docs/json.md): GPU-hours by category (what the ledger will bill), wall seconds on `gpus`
    GPUs, each expert's predicted end and step, and the worst-case budget overrun. `spent`: GPU-seconds already in
    the ledger by category (preprocessing, and the seed if it is trained)."""
    r, t = cfg.resources, cfg.train
    g = min(r.experts_per_actor, cfg.n_experts)
    slots = max(1, math.floor(gpus / r.num_gpus + 1e-9))
    units = math.ceil(cfg.n_experts / g)
    lanes = int(min(slots, r.max_actors or math.inf))  # actors running at once
    times, c = actor_times(cal, min(lanes, units), t.threads, cores)
    starts = actor_starts(r, slots, units)
    share = r.num_gpus / g  # a member's GPU-seconds per wall second: the actor's held time is split evenly
    seed_s = spent.get(Category.SEED, 0.0) if seed_done else _seed_s(cfg, cal)
    cap = _cap_s(cfg, cal, spent, seed_s)
    experts = []
    for e in range(cfg.n_experts):
        billed = times.load_s + (times.boot_s if starts[e // g] == GRANTED else 0.0)  # its start-up on its clock

        def cost(step: int, billed: float = billed) -> float:
            return (billed + times.run_s(step, g, t)) * share

        step = stop_step(t.updates, t.chunk_updates, cost, times.update_s * share, cap)
        end = JobState.FINISHED if step >= t.updates else JobState.BUDGET_EXHAUSTED
        experts.append({"expert": e, "end": end, "step": step, "target": t.updates, "gpu_hours": cost(step) / 3600.0})
    walls = [  # an actor's: a new process's boot (billed or not), its set-up, then its longest member
        (0.0 if starts[u] == REUSED else times.boot_s)
        + times.load_s
        + max(times.run_s(x["step"], g, t) for x in experts[u * g : (u + 1) * g])
        for u in range(units)
    ]
    wall = {"seed": 0.0 if seed_done else seed_s / r.num_gpus, "experts": _list_schedule(walls, lanes)}
    hours = {
        Category.PREPROCESSING: spent.get(Category.PREPROCESSING, 0.0) / 3600.0,
        Category.SEED: seed_s / 3600.0,
        Category.EXPERT_TRAINING: sum(x["gpu_hours"] for x in experts),
        Category.WASTED: 0.0,
        Category.PREEMPTED: 0.0,
    }
    price = usd_per_hour(cfg.prices, cal["device"])  # USD per GPU-hour on the calibrated device (None: unpriced)
    per, total = BudgetBook(cfg.budget).worst_overrun_s(r.num_gpus, cal.get("poll_s", 0.5), min(lanes, units))
    return {
        "schema": SCHEMA,
        "gpus": gpus,
        "slots": lanes,
        "actors": units,
        "experts_per_actor": g,
        "cores": cores,
        "cpu_contention": c,
        "seed_trained": seed_done,
        "gpu_hours": {**hours, "training_total": hours[Category.SEED] + hours[Category.EXPERT_TRAINING]},
        # GPU shares held by queued actors while their process started and imported: on no one's bill
        "unbilled_gpu_hours": starts.count(QUEUED) * times.boot_s * r.num_gpus / 3600.0,
        "actor_starts": {k: starts.count(k) for k in (GRANTED, QUEUED, REUSED)},
        "usd_per_gpu_hour": price,
        "usd": None if price is None else {k: v * price for k, v in hours.items()},
        "wall_seconds": {**wall, "total": wall["seed"] + wall["experts"]},
        "actor": _actor_prior(cfg, cal, times, g),
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
        "not_modelled": NOT_MODELLED,
    }


def _cap_s(cfg: CampaignConfig, cal: dict, spent: dict[str, float], seed_s: float) -> float | None:
    """The GPU-seconds one expert may spend: the tightest of its own cap and its share of the campaign's, in
    GPU-hours and, where the calibrated device is priced, in dollars at that price (as the scheduler converts)."""
    book = BudgetBook(cfg.budget)
    cap = book.expert_s
    if book.campaign_s is not None:
        share = (book.campaign_s - spent.get(Category.PREPROCESSING, 0.0) - seed_s) / cfg.n_experts
        cap = share if cap is None else min(cap, share)
    price = usd_per_hour(cfg.prices, cal["device"])
    if price:
        if cfg.budget.expert_usd is not None:
            cap = min(cap if cap is not None else math.inf, cfg.budget.expert_usd / price * 3600.0)
        if cfg.budget.campaign_usd is not None:
            left = cfg.budget.campaign_usd / price * 3600.0 - spent.get(Category.PREPROCESSING, 0.0) - seed_s
            cap = min(cap if cap is not None else math.inf, left / cfg.n_experts)
    return cap


def _actor_prior(cfg: CampaignConfig, cal: dict, times: ActorTimes, g: int) -> dict:
    """What the ETA (soma_cluster/eta.py) assumes until it has measured, per stage: wall seconds from a free slot
    to a job's first heartbeat (on a new actor, on a reused one; the first update included) and per update after
    it (validations and checkpoints spread over the updates)."""
    t, n = cfg.train, max(1, cfg.seed_stage.updates)
    seed_events = _events(n, t.val_every) * cal["val_s"] + _events(n, t.checkpoint_every) * cal["checkpoint_s"]
    return {
        "experts": {
            "startup_s": times.boot_s + times.load_s + times.update_s,
            "reused_s": times.load_s + times.update_s,
            "update_s": times.run_s(t.updates, g, t) / max(1, t.updates),
        },
        "seed": {
            "startup_s": cal["startup_s"] + cal["seed_load_s"] + cal["seed_update_s"],
            "update_s": cal["seed_update_s"] + seed_events / n,
        },
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


def times_of_run(rows: list[dict], actors: int, per_actor: int = 1) -> dict:
    """What a run's events (soma_cluster/eta.py trace_rows, `launched` kept) say an actor's times were, in the shape
    of the calibration's concurrent probe, so that predict() can be checked against the ledger apart from how well
    the calibration foresaw the machine (`actors` at once, `per_actor` experts each). Of the jobs that ran one
    attempt: load_s, from an actor's first instruction (`launched`) to its set-up reported (`started`), among those
    started after the first wave (all, if none); boot_s, from a slot freed (a job's end, paired in order) to the
    next queued actor's first instruction, or, where none waited in Ray's queue (reused actors, N within the lanes),
    the first wave's start-up (`queued` to `started`) less load_s; update_s, from `started` to the job's end over
    the updates it made."""
    ends = sorted(r["t"] for r in rows if r["event"] in (*TERMINAL, "failed"))
    seen: dict[str, dict[str, dict]] = {}
    for r in rows:
        seen.setdefault(r["job"], {}).setdefault(r["event"], r)
    once = [  # one attempt each: a retried job's first events are of another attempt than its end
        (f, next(f[e] for e in TERMINAL if e in f))
        for f in seen.values()
        if {"queued", "launched", "started"} <= set(f) and "failed" not in f and any(e in f for e in TERMINAL)
    ]
    once.sort(key=lambda fe: fe[0]["launched"]["t"])
    first, later = once[: actors * per_actor], once[actors * per_actor :]
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
    load = mean([f["started"]["t"] - f["launched"]["t"] for f, _ in later or once])
    boots = [  # an actor that waited in Ray's queue: its first instruction came after it was asked for, and a free
        f["launched"]["t"] - free
        for (f, _), free in zip(later, ends, strict=False)
        if f["launched"]["t"] > f["queued"]["t"] + 1e-6 and f["launched"]["t"] >= free
    ]
    boot = mean(boots) if boots else max(0.0, mean([f["started"]["t"] - f["queued"]["t"] for f, _ in first]) - load)
    made = [(end["t"] - f["started"]["t"], end["step"] - f["started"]["step"]) for f, end in once]
    return {
        "actors": actors,
        "niceness": None,
        "boot_s": boot,
        "load_s": load,
        "update_s": sum(s for s, _ in made) / max(1, sum(n for _, n in made)),
    }
