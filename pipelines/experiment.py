"""`soma experiment NAME DIR`: one of the paper's comparisons, run through the campaign machinery.

Every arm is an ordinary campaign under DIR/s<seed>/<arm>/: prepared (or forked from the arm it must share
data and a seed model with), seeded and launched by the same Driver, actors, ledger and checkpoints as any
campaign, then evaluated with the paper's protocol, its training curve included. DIR/results.json holds
what was measured; DIR/report.md and DIR/*.png are rendered from it (pipelines.report). Running the same
command again resumes: finished stages are skipped, unfinished experts continue from their checkpoints.
"""

from __future__ import annotations

import os
import time

import torch

from pipelines.campaign import launch
from pipelines.common import console, contents, open_store
from pipelines.ensemblecurve import curve
from pipelines.evaluate import evaluate
from pipelines.fork import fork
from pipelines.prepare import prepare
from pipelines.raysession import ray_session
from pipelines.seed import train_seed
from soma_cluster.config import CampaignConfig, parse_overrides
from soma_cluster.errors import SomaError
from soma_cluster.events import history
from soma_cluster.experimentspecs import ExperimentSpec, arm_configs, load_spec
from soma_cluster.jobs import Category, Job, JobState, expert_name
from soma_cluster.ledger import Ledger
from soma_cluster.model import Layout, campaign_param_count
from soma_cluster.recipes import job_trainer, start_state
from soma_cluster.shards import open_shard
from soma_cluster.storage import Store
from soma_cluster.targets import occupied
from soma_cluster.trainer import pick_device
from soma_cluster.variance import model_ratio, separable_ratio

MARKER = "experiment.json"


def _claim(root: Store, spec: ExperimentSpec, scale: str, sets: list[str]) -> None:
    """Bind DIR to this experiment, scale and overrides; refuse another experiment's directory or a foreign one."""
    want = {"experiment": spec.name, "scale": scale, "overrides": sorted(sets)}
    if root.exists(MARKER):
        have = root.read_json(MARKER)
        if {k: have.get(k) for k in want} != want:
            raise SomaError(
                f"{root.url} holds experiment {have.get('experiment')} (scale {have.get('scale')}, overrides "
                f"{have.get('overrides')}); use a new directory for {spec.name} at scale {scale} "
                f"(soma experiment {spec.name} NEW_DIR), or continue that one "
                f"(soma experiment {have.get('experiment')} {root.url})"
            )
        root.check_writable()
        return
    if names := contents(root):
        raise occupied(root.url, names, MARKER)
    root.check_writable()  # after the reading checks above (its probe write changes the directory), before Ray
    root.write_json(MARKER, want)


def _start(arm, stores: dict[str, Store], cfgs: dict[str, CampaignConfig], show_progress: bool) -> None:
    """Data and a seed model for the arm: its own (prepare + seed) or its parent arm's (fork)."""
    store, cfg = stores[arm.name], cfgs[arm.name]
    if arm.fork:
        fork(stores[arm.fork], store, cfg)
    else:
        prepare(store, cfg)
        train_seed(store, cfg, show_progress)


def _tracked_as(cfg: CampaignConfig, spec: ExperimentSpec) -> CampaignConfig:
    """Every arm in one tracker experiment (soma-NAME, unless the config or MLFLOW_EXPERIMENT_NAME names one), so
    the baselines compare side by side there."""
    if cfg.tracking.experiment is not None or os.environ.get("MLFLOW_EXPERIMENT_NAME"):
        return cfg
    return cfg.model_copy(update={"tracking": cfg.tracking.model_copy(update={"experiment": f"soma-{spec.name}"})})


def _same_windows(a: Store, b: Store) -> bool:
    return a.read_json("test/manifest.json")["sha256"] == b.read_json("test/manifest.json")["sha256"]


def _arm_result(
    spec: ExperimentSpec, arm, store: Store, cfg: CampaignConfig, ref: tuple[Store, CampaignConfig] | None
) -> dict:
    """Final metrics (paired against the reference arm on the same windows), curve and compute of one arm."""
    compare = ref if ref is not None and _same_windows(store, ref[0]) else None
    tags = {"experiment": spec.name, "arm": arm.name, "seed": str(cfg.seed)}
    metrics = evaluate(store, cfg, compare, track_tags=tags)
    totals = Ledger(store).totals()
    hist = history(store)
    experts = [hist.get(expert_name(e)) for e in range(cfg.n_experts)]
    pts = curve(store, cfg, spec.curve_points)
    return {
        "label": arm.label,
        "fork": arm.fork,
        "n_experts": cfg.n_experts,
        "d": cfg.model.d,
        "head": cfg.model.head,
        "method": cfg.train.method,
        "objective": cfg.spsa.objective,
        "parameters": campaign_param_count(cfg.model, cfg.n_experts),
        "body_parameters": Layout(cfg.model).size,
        "budget_gpu_hours": cfg.budget.campaign_gpu_hours,
        "outcomes": [h.state if h else JobState.PENDING for h in experts],
        "updates": [h.step if h else 0 for h in experts],
        # compute, kept apart: GPU-hours of training (seed included, evaluation not), wall time, forwards
        "gpu_hours": sum(v for k, v in totals.gpu_seconds.items() if k != Category.EVALUATION) / 3600,
        "gpu_hours_by_category": {k: v / 3600 for k, v in totals.gpu_seconds.items()},
        "gpu_hours_unit": totals.unit,
        "wall_seconds_by_category": dict(totals.wall_seconds),
        "forwards": pts[-1]["forwards"] if pts else 0,
        "forwards_by_category": dict(totals.forwards),
        "ensemble": metrics["ensemble"],
        "seed": metrics["seed"],
        "vs_reference": metrics["compare"]["this_minus_other"] if compare else None,
        "byte_tokens_per_second": metrics["byte_tokens_per_second"],
        "routing_time_share": metrics["routing_time_share"],
        "windows": metrics["windows"],
        "documents": metrics["documents"],
        "curve": pts,
        "campaign": store.url,
    }


@torch.no_grad()
def _model_variance(store: Store, cfg: CampaignConfig, draws: int, seed: int) -> dict:
    """Independent vs summed SPSA variance on the arm's real experts, each starting from the seed model on one
    batch of its own shard (the state SOMA's expert stage starts from)."""
    device = pick_device()
    trainers = [
        job_trainer(
            cfg, Job(e), open_shard(store, e), start_state(store, cfg, Job(e), device), device, val_rows=cfg.spsa.batch
        )
        for e in range(cfg.n_experts)
    ]
    batches = [t.batch(0) for t in trainers]
    x, y = torch.stack([b[0] for b in batches]), torch.stack([b[1] for b in batches])
    bodies = torch.stack([t.state.body for t in trainers])
    heads = torch.stack([t.state.head for t in trainers])
    t0 = time.monotonic()
    r = model_ratio(
        cfg.model, bodies, heads, x, y, trainers[0].gain_mask, cfg.spsa.eps, draws, cfg.spsa.pert_chunk, seed
    )
    return {
        **r.as_dict(),
        "campaign": store.url,
        "batch": list(x.shape),
        "eps": cfg.spsa.eps,
        "seconds": time.monotonic() - t0,
    }


def _variance(spec: ExperimentSpec, stores: dict[str, Store], cfgs: dict[str, CampaignConfig], seed: int) -> dict:
    v = spec.variance
    t0 = time.monotonic()
    fixed = [
        separable_ratio(v.params, n, v.draws, probe, seed).as_dict()
        for probe in ("rademacher", "ternary")
        for n in v.blocks
    ]
    out = {"fixed": fixed, "fixed_seconds": time.monotonic() - t0}
    if v.model_arm:
        out["model"] = _model_variance(stores[v.model_arm], cfgs[v.model_arm], v.model_draws, seed)
    return out


def run_experiment(
    name: str,
    url: str,
    scale: str = "small",
    sets: list[str] | None = None,
    address: str | None = None,
    show_progress: bool = True,
) -> dict:
    spec = load_spec(name)
    sets = list(sets or [])
    user = parse_overrides(sets)
    root = open_store(url)
    seeds = spec.seeds_at(scale)
    cfgs_by_seed = {s: arm_configs(spec, scale, s, user) for s in seeds}  # every config valid before anything runs
    cfgs_by_seed = {s: {a: _tracked_as(c, spec) for a, c in cfgs.items()} for s, cfgs in cfgs_by_seed.items()}
    _claim(root, spec, scale, sets)
    t0 = time.monotonic()
    results: dict = {
        "experiment": spec.name,
        "title": spec.title,
        "question": spec.question,
        "kind": spec.kind,
        "scale": scale,
        "overrides": sets,
        "reference": spec.reference,
        "seeds": {},
        "expect": [e.model_dump() for e in spec.expect],
    }
    first = next(iter(cfgs_by_seed[seeds[0]].values()))
    with ray_session(first, address):
        for s in seeds:
            cfgs = cfgs_by_seed[s]
            stores = {a: open_store(f"{root.url}/s{s}/{a}") for a in cfgs}
            console.print(f"[bold]{spec.name} seed {s}[/bold]: arms {', '.join(cfgs)}")
            for arm in spec.ordered_arms():
                _start(arm, stores, cfgs, show_progress)
            if spec.kind == "variance":
                results["seeds"][str(s)] = _variance(spec, stores, cfgs, s)
                continue
            for arm in spec.ordered_arms():
                console.print(f"[bold]{spec.name} seed {s}[/bold]: training arm {arm.name}")
                launch(stores[arm.name], cfgs[arm.name], show_progress)
            ref = (stores[spec.reference], cfgs[spec.reference]) if spec.reference else None
            results["seeds"][str(s)] = {
                arm.name: _arm_result(
                    spec, arm, stores[arm.name], cfgs[arm.name], None if arm.name == spec.reference else ref
                )
                for arm in spec.ordered_arms()
            }
    results["wall_seconds"] = time.monotonic() - t0
    root.write_json("results.json", results)
    from pipelines.report import write_report

    write_report(root, results)
    return results
