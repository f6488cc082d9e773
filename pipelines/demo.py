"""`soma demo`: a whole campaign in one command, prepare -> seed -> launch -> eval, under one lease."""

from __future__ import annotations

import textwrap

from pipelines.campaign import launch
from pipelines.campaign_lease import hold
from pipelines.common import claim_campaign
from pipelines.evaluate import evaluate
from pipelines.prepare import check_prepare, prepare
from pipelines.rayaddress import Address
from pipelines.raysession import ray_session
from pipelines.seed import train_seed
from soma_cluster.config import CampaignConfig
from soma_cluster.storage import Store

BASELINES = (
    ("seed", "seed model (N = 1)"),
    ("uniform_mixture", "uniform mixture"),
    ("best_single", "best single expert"),
)


def summary_lines(m: dict, seconds: float) -> list[str]:
    """What `soma demo` prints (stdout, 80 columns): the routed ensemble's test loss, then each baseline it must beat
    with the paired difference on the same windows (report.md has the rest), and whether routing beat them."""
    b = m["baselines"]
    on = "" if b.get("all_windows", True) else f" (baselines on {b['expert_windows'] // m['n_experts']} windows)"
    lines = [
        f"demo finished in {seconds:.0f} s: routed ensemble {m['ensemble']['nats_per_byte']:.4f} nats/byte",
        f"(top-{m['top_k']} of {m['n_experts']} experts, {m['windows']} test windows){on}; routed minus each, paired:",
    ]
    for key, name in BASELINES:
        d = b[key]["ensemble_minus_this"]
        lo, hi = d["ci95"]
        lines.append(f"  {name:<19} {b[key]['nats_per_byte']:.4f}   {d['nats_per_byte']:+.4f} [{lo:+.4f}, {hi:+.4f}]")
    lines.append(f"  {'uniform over bytes':<19} {m['uniform']['nats_per_byte']:.4f}")
    tied = [name for key, name in BASELINES if b[key]["ensemble_minus_this"]["ci95"][1] >= 0]
    if tied:
        text = f"not beaten (95% interval not below 0): {', '.join(tied)}; report.md says more"
        lines += textwrap.wrap(text, width=80, subsequent_indent="  ")
    return lines


def demo(store: Store, cfg: CampaignConfig, addr: Address, take_over: bool) -> dict:
    """Every stage of a campaign on `cfg`, on the Ray at `addr` (a local one when none); the evaluation's metrics."""
    claim_campaign(store, cfg, write=False)  # another campaign's (or anyone's) directory: before the lease
    check_prepare(store, cfg)
    with hold(store, "soma demo", take_over):
        prepare(store, cfg, addr.text or None)
        with ray_session(cfg, addr):
            train_seed(store, cfg)
            launch(store, cfg)
        return evaluate(store, cfg)
