"""`soma plan CAMPAIGN`: measure, then predict (soma_cluster/costmodel.py), before any GPU-hour is spent.

The calibration times the real model on the real shards in this process, on this machine's device (CUDA
when present): the packed update of resources.experts_per_actor experts (after one warm-up update), one
validation, one checkpoint written to a scratch directory, loading shards and models, and an actor's
start-up (a fresh Python importing the worker, as Ray's worker process does). It is written to
plan/calibration.json and reused by later plans (--recalibrate measures again); the plan goes to
plan/plan.json, which `soma status` compares with the ledger once the campaign has ended.

On a cluster (`--address`, or RAY_ADDRESS) the calibration runs as a Ray task holding one expert actor's
resources (resources.num_gpus, num_cpus), so it times the device the experts will train on, not the
machine `soma plan` runs on (a KubeRay head has no GPU); an autoscaling cluster adds a node for it. It
records the node and its cores, and a calibration is reused only where it was measured (a cluster's
for cluster plans, this machine's for local ones).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import torch

from soma_cluster.checkpoint import has_checkpoint, save_checkpoint, training_bytes
from soma_cluster.config import CampaignConfig
from soma_cluster.costmodel import PLAN, actors_at_once, predict
from soma_cluster.errors import DeviceError, SomaError
from soma_cluster.events import seed_done
from soma_cluster.jobs import SEED_JOB, Job, JobState
from soma_cluster.ledger import Ledger
from soma_cluster.recipes import expert_start, job_shard, job_trainer, start_state
from soma_cluster.schedule import POLL_S
from soma_cluster.storage import Store
from soma_cluster.trainer import Trainer, TrainState, pick_device, update_experts

CALIBRATION = "plan/calibration.json"


def _state(store: Store, cfg: CampaignConfig, job: Job, device: torch.device) -> TrainState:
    """What the worker starts from (soma_cluster.recipes.start_state); an expert planned before the seed is
    trained starts from a fresh seed-shaped model instead (the same shapes, so the same timings)."""
    if job.expert is None or has_checkpoint(store, SEED_JOB.model_dir):
        return start_state(store, cfg, job, device)
    fresh = start_state(store, cfg, SEED_JOB, device)
    return expert_start(cfg, fresh.body, fresh.head)


def _trainer(store: Store, cfg: CampaignConfig, job: Job, device: torch.device, cache: str) -> Trainer:
    shard = job_shard(store, cfg, job, cache)
    return job_trainer(cfg, job, shard, _state(store, cfg, job, device), device)


def _timed(fn, repeat: int = 1, min_s: float = 0.0, most: int = 50) -> tuple[float, int]:
    """Mean seconds per call over at least `repeat` calls and at least `min_s` seconds (at most `most` calls)."""
    t, n = time.perf_counter(), 0
    while n < repeat or (time.perf_counter() - t < min_s and n < most):
        fn()
        n += 1
    return (time.perf_counter() - t) / n, n


def startup_seconds() -> float:
    """A fresh interpreter importing the worker (torch, Ray, soma_cluster): the bulk of an actor's start-up."""
    t = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", "import workers.expert_worker"],
        check=True,
        capture_output=True,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    return time.perf_counter() - t


WORKER_NICENESS = 15  # Ray starts its worker processes, the actors, at this niceness (the raylet's worker_niceness)
PROBE_WAIT_S = 600.0  # a probe that has not answered by then is stopped, and the plan does without it
PROBE_MARK = "soma-probe: "  # a probe's answers on its stdout begin so
# a probe's program: at the workers' niceness from its first statement, as Ray starts them
PROBE = f"import os; os.setpriority(os.PRIO_PROCESS, 0, {WORKER_NICENESS}); from pipelines.plan import probe; probe()"


def probe() -> None:
    """One of the concurrent probes (a process running PROBE): what an actor does, timed. Its task comes as a JSON
    line on stdin; it imports the worker (boot_s, since the parent spawned it), loads its experts (load_s) and makes
    one update, says so on stdout, waits for a line on stdin (all probes then run at once), times packed updates for
    min_s and answers (update_s)."""
    task = json.loads(sys.stdin.readline())
    import workers.expert_worker  # noqa: F401  what an actor's process imports before its first instruction

    boot = time.time() - task["spawned"]
    cfg = CampaignConfig.model_validate(task["config"])
    store, device = Store(task["url"], task["storage_options"]), torch.device("cpu")
    torch.set_num_threads(cfg.train.threads)
    with store.scratch() as scratch:
        t = time.perf_counter()
        trainers = [_trainer(store, cfg, Job(e), device, os.path.join(scratch, "cache")) for e in task["experts"]]
        load = time.perf_counter() - t
        update_experts(trainers)  # warm-up
        print(PROBE_MARK + json.dumps({"boot_s": boot, "load_s": load}), flush=True)
        sys.stdin.readline()
        per, n = _timed(lambda: update_experts(trainers), 3, task["min_s"])
    print(PROBE_MARK + json.dumps({"update_s": per, "updates": n}), flush=True)


def _answer(proc: subprocess.Popen) -> dict:
    """A probe's next answer (its line marked PROBE_MARK: anything else a library prints is skipped); ValueError if
    it ended without one."""
    for line in proc.stdout:
        if line.startswith(PROBE_MARK):
            return json.loads(line[len(PROBE_MARK) :])
    raise ValueError(f"probe pid {proc.pid} ended without answering (exit {proc.wait()})")


def concurrent(store: Store, cfg: CampaignConfig, actors: int, min_s: float) -> dict | None:
    """`actors` probes at once, at the workers' niceness: the boot, load and packed update an actor sees beside
    the others on this CPU host (they share its cores, and under other work at niceness 0 get what it leaves);
    None, with a warning, if a probe fails."""
    g = min(cfg.resources.experts_per_actor, cfg.n_experts)
    task = {"url": store.url, "storage_options": store.storage_options, "config": cfg.model_dump(mode="json")}
    procs, logs = [], []
    timer = threading.Timer(PROBE_WAIT_S, lambda: [p.kill() for p in procs])
    timer.daemon = True
    try:
        for i in range(actors):
            logs.append(tempfile.TemporaryFile("w+"))  # noqa: SIM115  its stderr (a pipe left unread could stop it)
            spawned = time.time()
            proc = subprocess.Popen(
                [sys.executable, "-c", PROBE],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=logs[-1],
                text=True,
                cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
            )
            procs.append(proc)
            experts = [(i * g + k) % cfg.n_experts for k in range(g)]
            proc.stdin.write(json.dumps({**task, "spawned": spawned, "experts": experts, "min_s": min_s}) + "\n")
            proc.stdin.flush()
        timer.start()
        ready = [_answer(p) for p in procs]
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        done = [_answer(p) for p in procs]
    except (OSError, ValueError) as exc:
        last = ""
        for log in logs:
            log.seek(0)
            lines = log.read().strip().splitlines()
            last = lines[-1][:300] if lines else last  # the error a probe raised, its traceback's last line
        print(
            f"warning: the concurrent probe failed ({exc}; {last}); the plan scales by threads and cores",
            file=sys.stderr,
        )
        return None
    finally:
        timer.cancel()
        for p in procs:
            p.kill()
            p.wait()
        for log in logs:
            log.close()
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {
        "actors": actors,
        "niceness": WORKER_NICENESS,
        "boot_s": mean([r["boot_s"] for r in ready]),
        "load_s": mean([r["load_s"] for r in ready]),
        "update_s": mean([r["update_s"] for r in done]),
    }


def calibrate(
    store: Store, cfg: CampaignConfig, updates: int = 3, min_s: float = 3.0, actors: int | None = None
) -> dict:
    device = pick_device()
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(cfg.train.threads)  # as the worker runs
    try:
        g = min(cfg.resources.experts_per_actor, cfg.n_experts)
        with store.scratch() as scratch:  # on the campaign's own disk (the checkpoint timed is written there)
            cache = os.path.join(scratch, "cache")
            t = time.perf_counter()
            trainers = [_trainer(store, cfg, Job(e), device, cache) for e in range(g)]
            load_s = time.perf_counter() - t  # the actor loads its G members one after another
            update_experts(trainers)  # warm-up (allocations, kernels)
            packed, timed = _timed(lambda: update_experts(trainers), updates, min_s)
            val, _ = _timed(trainers[0].validate)
            ckpt, _ = _timed(lambda: save_checkpoint(Store(os.path.join(scratch, "ck")), "x", trainers[0].state))
            seed = {}
            if not seed_done(store):
                t = time.perf_counter()
                st = _trainer(store, cfg, SEED_JOB, device, cache)
                seed["seed_load_s"] = time.perf_counter() - t
                st.update()
                seed["seed_update_s"], _ = _timed(st.update, updates, min_s)
        # on a CPU host, the actors that run at once, measured together (not on a cluster's GPU: each has its own)
        together = concurrent(store, cfg, actors, min_s) if actors and device.type == "cpu" else None
        return {
            "concurrent": together,
            "device": device.type,
            "threads": cfg.train.threads if device.type == "cpu" else None,
            "experts_per_actor": g,
            "updates_timed": timed,
            "packed_update_s": packed,
            "val_s": val,
            "checkpoint_s": ckpt,
            "load_s": load_s,
            "startup_s": startup_seconds(),
            "poll_s": POLL_S,
            "measured_at": time.time(),
            "config_digest": cfg.digest(),
            "seed_load_s": seed.get("seed_load_s", 0.0),
            "seed_update_s": seed.get("seed_update_s", packed),
        }
    finally:
        torch.set_num_threads(threads)


def _calibrate_task(url: str, storage_options: dict, cfg: CampaignConfig) -> dict:
    """The calibration inside a Ray worker that holds one expert actor's resources; refuses a GPU share
    without a CUDA device as the expert worker does."""
    import ray

    node = ray.util.get_node_ip_address()
    if pick_device().type == "cpu" and cfg.resources.num_gpus > 0 and not cfg.resources.allow_cpu:
        raise DeviceError(
            f"node {node} gave the calibration {cfg.resources.num_gpus:g} GPU but torch finds no CUDA device "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); fix that node's GPU driver or "
            f"image, or set resources.allow_cpu=true to train on CPU"
        )
    return {
        **calibrate(Store(url, storage_options), cfg),
        "where": "cluster",
        "node": node,
        "cores": os.cpu_count() or 1,
    }


def calibrate_on_cluster(store: Store, cfg: CampaignConfig, wait_s: float) -> dict:
    """Run the calibration on a worker of the connected Ray cluster, waiting up to wait_s for one to hold
    an actor's resources (time for the autoscaler to add a node)."""
    import ray

    r = cfg.resources
    ref = (
        ray.remote(_calibrate_task)
        .options(num_gpus=r.num_gpus, num_cpus=r.num_cpus, max_retries=0)
        .remote(store.url, store.storage_options, cfg)
    )
    ready, _ = ray.wait([ref], timeout=wait_s)
    if not ready:
        ray.cancel(ref, force=True)
        raise SomaError(
            f"no Ray worker could hold an expert actor's resources (num_gpus={r.num_gpus:g}, num_cpus={r.num_cpus:g}) "
            f"within --wait {wait_s:g} s to time the calibration; check that the cluster can add such a node "
            f"(ray status), or wait longer with --wait"
        )
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as exc:
        if isinstance(exc.cause, SomaError):
            raise exc.cause from None
        raise


def plan(
    store: Store,
    cfg: CampaignConfig,
    gpus: float | None,
    recalibrate: bool = False,
    cores: int | None = None,
    cluster_wait_s: float | None = None,
) -> dict:
    """cluster_wait_s: calibrate on the connected Ray cluster (waiting up to that long for a worker), else here."""
    if not store.exists("shards/manifest.json"):
        raise SomaError(
            f"{store.url} is not prepared; run soma prepare {store.url} first (the plan times the real shards)"
        )
    where = "local" if cluster_wait_s is None else "cluster"
    if gpus is None:
        gpus = float(cfg.resources.local_gpus)
    cal = None if recalibrate or not store.exists(CALIBRATION) else store.read_json(CALIBRATION)
    if (
        cal is None
        or cal.get("config_digest") != cfg.digest()
        or cal.get("where", "local") != where
        or (not seed_done(store) and "seed_update_s" not in cal)
    ):
        if cluster_wait_s is None:
            cal = calibrate(store, cfg, actors=actors_at_once(cfg, gpus))
        else:
            cal = calibrate_on_cluster(store, cfg, cluster_wait_s)
        cal.setdefault("where", "local")
        store.write_json(CALIBRATION, cal)
    cal.pop("checksum", None)
    totals = Ledger(store).totals()
    p = predict(
        cfg, cal, gpus, cores or cal.get("cores") or os.cpu_count() or 1, dict(totals.gpu_seconds), seed_done(store)
    )
    p["campaign"], p["made_at"] = store.url, time.time()
    store.write_json(PLAN, p)
    return p


def plan_for(
    store: Store,
    cfg: CampaignConfig,
    gpus: float | None,
    recalibrate: bool,
    address: str | None,
    wait_s: float,
    wait_given: bool,
) -> dict:
    """`soma plan`: on the Ray cluster at `address` (else RAY_ADDRESS), for its GPUs now unless `gpus` says how many
    the campaign will run on, calibrating on a worker that holds an actor's resources within `wait_s`; without a
    cluster, here, for `gpus` (default resources.local_gpus). `wait_given`: --wait was typed, which needs a cluster."""
    from pipelines.rayaddress import ray_address

    if gpus is not None and gpus < cfg.resources.num_gpus:
        raise SomaError(
            f"--gpus {gpus:g} cannot hold one actor of resources.num_gpus={cfg.resources.num_gpus}; pass at least that"
        )
    addr = ray_address(address)  # form, then a bounded probe
    if not addr.remote:
        if wait_given:
            raise SomaError(
                f"--wait {wait_s:g} has no effect without a Ray cluster (it waits for a worker of one to time the "
                "calibration); pass --address HOST:PORT (or set RAY_ADDRESS), or leave out --wait"
            )
        store.check_writable(training_bytes(cfg, 1))  # plan/ is written; the calibration writes a checkpoint
        return plan(store, cfg, gpus, recalibrate)
    import ray

    from pipelines.raysession import ray_session

    with ray_session(cfg, addr):
        planned = gpus if gpus is not None else float(ray.cluster_resources().get("GPU", 0.0))
        if planned < cfg.resources.num_gpus:
            raise SomaError(
                f"the cluster at {addr.text} has {planned:g} GPUs now (an autoscaling one may start with none); "
                f"pass --gpus K, the GPUs the campaign will run on"
            )
        store.check_writable(training_bytes(cfg, 1))
        return plan(store, cfg, planned, recalibrate, cluster_wait_s=wait_s)


def render(p: dict, unit: str) -> str:
    """The plan as lines of text (stdout)."""
    c, h, w, b = p["calibration"], p["gpu_hours"], p["wall_seconds"], p["budget"]
    lines = [
        f"plan for {p['campaign']} on {p['gpus']:g} GPUs: {p['slots']} actors at once, {p['actors']} actors of "
        f"{p['experts_per_actor']} expert(s)"
        + (f", {p['cpu_contention']:.2f}x CPU contention ({p['cores']} cores)" if p["cpu_contention"] > 1 else ""),
        f"calibration ({c['device']}{' on ' + c['node'] if c.get('node') else ''}, {c['updates_timed']} timed "
        f"updates): packed update {c['packed_update_s']:.4f} s, "
        f"validation {c['val_s']:.4f} s, checkpoint {c['checkpoint_s']:.4f} s, load {c['load_s']:.2f} s, "
        f"actor start-up {c['startup_s']:.2f} s",
        f"{unit}: seed {h['seed']:.4f}{' (spent)' if p['seed_trained'] else ''}, "
        f"expert training {h['expert_training']:.4f}, "
        f"seed + experts {h['training_total']:.4f} (preprocessing spent {h['preprocessing']:.4f}; wasted and preempted "
        f"not predicted)",
        f"wall time: seed {w['seed']:.0f} s, experts {w['experts']:.0f} s, total {w['total']:.0f} s",
    ]
    starts = p.get("actor_starts") or {}
    if starts.get("queued"):
        lines.append(
            f"actors: {starts['granted']} start at once, {starts['queued']} wait in Ray's queue for a free slot (their "
            f"process start and imports, {p['unbilled_gpu_hours']:.4f} {unit}, hold a GPU share on no one's bill)"
        )
    if p.get("usd"):
        d = p["usd"]
        lines.append(
            f"in dollars at ${p['usd_per_gpu_hour']:,.2f} per GPU-hour: seed ${d['seed']:,.2f}, expert training "
            f"${d['expert_training']:,.2f}, seed + experts ${d['seed'] + d['expert_training']:,.2f}"
        )
    stopped = [x for x in p["experts"] if x["end"] == JobState.BUDGET_EXHAUSTED]
    if b["effective_expert_cap_gpu_hours"] is None:
        lines.append("budget: none set; every expert trains to its target")
    else:
        steps = sorted({x["step"] for x in stopped})
        lines.append(
            f"budget: {b['effective_expert_cap_gpu_hours']:.4f} {unit} per expert; "
            + (
                f"{len(stopped)} of {len(p['experts'])} experts stop early, at step {', '.join(map(str, steps))} of "
                f"{p['experts'][0]['target']}"
                if stopped
                else "every expert reaches its target"
            )
        )
        o = b["worst_overrun_gpu_seconds"]
        lines.append(
            f"worst-case overrun: {o['per_expert']:.1f} GPU-s per expert, {o['campaign']:.1f} GPU-s for the campaign"
        )
    lines.append(f"not modelled: {', '.join(p['not_modelled'])}")
    return "\n".join(lines)
