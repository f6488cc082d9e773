"""`soma eval`: the routed ensemble, the seed model and each expert on the test windows, with CIs."""
from __future__ import annotations

import json
import math
import time

import numpy as np
import torch

from pipelines.common import console
from soma_cluster.checkpoint import Checkpoint, has_checkpoint, load_checkpoint
from soma_cluster.config import CampaignConfig
from soma_cluster.ensemble import UNIFORM_NATS, bootstrap_weights, ci, evaluate_ensemble, load_windows, window_logprobs
from soma_cluster.errors import SomaError
from soma_cluster.ledger import Ledger
from soma_cluster.model import campaign_param_count
from soma_cluster.router import load_router
from soma_cluster.shards import expert_name, open_shard
from soma_cluster.storage import Store
from soma_cluster.trainer import Trainer, pick_device
from workers.expert_worker import SEED_DIR, model_dir


def _load(store: Store, directory: str, what: str) -> Checkpoint:
    if not has_checkpoint(store, directory):
        raise SomaError(f"{what} has no checkpoint under {store.url}/{directory}; run soma launch (or soma resume) first")
    return load_checkpoint(store, directory)


def _own_shard_val(store: Store, cfg: CampaignConfig, e: int, ck: Checkpoint, device: torch.device) -> float:
    """The expert's loss on its own shard's expert-validation rows (the rows it validated on in training)."""
    tr = Trainer(cfg.model, cfg.spsa, open_shard(store, e), ck.state(device), cfg.seed, e, device, cfg.train.val_batches * cfg.spsa.batch)
    return tr.validate()


def _fmt(m: tuple[float, float, float]) -> str:
    return f"{m[0]:.4f} [{m[1]:.4f}, {m[2]:.4f}]"


def evaluate(store: Store, cfg: CampaignConfig) -> dict:
    t0 = time.monotonic()
    device = pick_device()
    router = load_router(store)
    win = load_windows(store, cfg.eval.max_windows)
    cks = {e: _load(store, model_dir("expert", e), expert_name(e)) for e in range(cfg.n_experts)}
    experts = {e: (ck.tensors["body"], ck.tensors["head"]) for e, ck in cks.items()}
    seed = _load(store, SEED_DIR, "the seed model").tensors
    seed_body, seed_head = seed["body"], seed["head"]
    ctx, batch = cfg.eval.context_bytes, cfg.eval.batch

    ens = evaluate_ensemble(router, cfg.model, experts, win, ctx, batch, device)
    t_seed = time.perf_counter()
    seed_nats = -window_logprobs(cfg.model, seed_body, seed_head, win.data, ctx, batch, device)
    seed_seconds = time.perf_counter() - t_seed
    w = bootstrap_weights(win.docs, cfg.eval.bootstrap, cfg.seed)
    ens_m, seed_m = ci(ens.nats, w), ci(seed_nats, w)
    diff = ens.nats.sum(1) - seed_nats.sum(1)
    boots = (w @ diff) / (w @ np.full(len(diff), ens.nats.shape[1], dtype=np.float64))
    per_expert = {expert_name(e): {"own_val_nats": _own_shard_val(store, cfg, e, cks[e], device),
                                   "step": cks[e].meta["state"]["step"], "routed_windows": ens.per_expert_windows[e]}
                  for e in range(cfg.n_experts)}
    scored = ens.nats.size
    total_s = ens.route_seconds + ens.model_seconds
    metrics = {
        "windows": len(win.data), "documents": int(len(np.unique(win.docs))), "scored_bytes": int(scored),
        "ensemble": {"nats_per_byte": ens_m[0], "ci95": ens_m[1:], "bits_per_byte": ens_m[0] / math.log(2)},
        "seed": {"nats_per_byte": seed_m[0], "ci95": seed_m[1:], "bits_per_byte": seed_m[0] / math.log(2)},
        "uniform": {"nats_per_byte": UNIFORM_NATS, "bits_per_byte": 8.0},
        "ensemble_minus_seed": {"nats_per_byte": float(diff.sum() / scored), "ci95": [float(np.percentile(boots, 2.5)), float(np.percentile(boots, 97.5))]},
        "per_expert": per_expert, "top_k": min(router.cfg.top_k, cfg.n_experts), "weighting": router.cfg.weighting,
        "routing_time_share": ens.route_seconds / total_s, "ensemble_seconds": total_s, "seed_seconds": seed_seconds,
        "byte_tokens_per_second": len(win.data) * (win.data.shape[1] - 1) / total_s,
        "parameters": campaign_param_count(cfg.model, cfg.n_experts), "device": str(device),
    }
    wall = time.monotonic() - t0
    Ledger(store).record("evaluation", wall if device.type == "cuda" else 0.0, wall, note=f"driver {device}")
    metrics["ledger"] = Ledger(store).totals().as_dict()
    store.write_json("eval/metrics.json", metrics)
    store.write_bytes("eval/report.md", report(cfg, metrics).encode())
    return metrics


def report(cfg: CampaignConfig, m: dict) -> str:
    led = m["ledger"]
    rows = "\n".join(f"| {name} | {v['step']} | {v['own_val_nats']:.4f} | {v['routed_windows']} |" for name, v in m["per_expert"].items())
    return f"""# soma-cluster evaluation: {cfg.name} (preset {cfg.preset})

N = {cfg.n_experts} experts, d = {cfg.model.d}, {m['parameters']:,} parameters; top-{m['top_k']} {m['weighting']} routing;
{m['windows']} test windows of {cfg.eval.window_bytes} bytes from {m['documents']} held-out documents, {m['scored_bytes']:,} scored bytes.

| model | nats/byte [95% CI] | bits/byte |
|---|---|---|
| routed ensemble | {_fmt((m['ensemble']['nats_per_byte'], *m['ensemble']['ci95']))} | {m['ensemble']['bits_per_byte']:.4f} |
| seed model (N = 1) | {_fmt((m['seed']['nats_per_byte'], *m['seed']['ci95']))} | {m['seed']['bits_per_byte']:.4f} |
| uniform over bytes | {m['uniform']['nats_per_byte']:.4f} | 8.0000 |

Ensemble minus seed, paired document bootstrap: {m['ensemble_minus_seed']['nats_per_byte']:+.4f} nats/byte
[{m['ensemble_minus_seed']['ci95'][0]:+.4f}, {m['ensemble_minus_seed']['ci95'][1]:+.4f}].

| expert | updates | own-shard val nats/byte | windows routed to it |
|---|---|---|---|
{rows}

Inference on {m['device']}: {m['byte_tokens_per_second']:,.0f} byte-tokens/s including routing; routing is
{100 * m['routing_time_share']:.1f}% of the ensemble's time.

Compute (from the ledger): {led['gpu_hours_total']:.4f} aggregate GPU-hours
({', '.join(f"{k} {v:.4f}" for k, v in led['gpu_hours'].items())}); forwards {json.dumps(led['forwards'])}.
Wall seconds per category: {', '.join(f"{k} {v:.1f}" for k, v in led['wall_seconds'].items())}.

SOMA is a zero-order method: it is meant to beat other zero-order training at matched compute, not
backpropagation, which remains far better per GPU-hour (SPEC section 8).
"""
