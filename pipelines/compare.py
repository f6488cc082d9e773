"""`soma compare C1 C2 ...`: several campaigns' routed ensembles on one set of test windows, each paired with a
baseline campaign (the sweep view, without a sweep engine). Reads the campaigns; writes nothing."""

from __future__ import annotations

import time

from pipelines.common import console
from pipelines.evaluate import Ensemble, _summary
from soma_cluster.breakdown import compare_rows
from soma_cluster.config import CampaignConfig
from soma_cluster.ensemble import bootstrap_weights, load_windows, require_same_windows, windows_digest
from soma_cluster.storage import Store
from soma_cluster.trainer import pick_device


def compare(campaigns: list[tuple[Store, CampaignConfig]], baseline: int) -> dict:
    """Every campaign is checked (same windows as the baseline, a seed model at least) before any is evaluated. The
    windows, their number, the scored context and the bootstrap are the baseline's eval settings."""
    base_store, base_cfg = campaigns[baseline]
    require_same_windows(
        (base_store.url, windows_digest(base_store)), [(s.url, windows_digest(s)) for s, _ in campaigns]
    )
    ensembles = [Ensemble.load(s, c) for s, c in campaigns]
    device = pick_device()
    win = load_windows(base_store, base_cfg.eval_windows())
    ctx = base_cfg.eval.context_bytes
    w = bootstrap_weights(win.docs, base_cfg.eval.bootstrap, base_cfg.seed)
    results = []
    for (store, _), ens in zip(campaigns, ensembles, strict=True):
        t0 = time.perf_counter()
        results.append(ens.run(win, ctx, device))
        console.print(f"{store.url}: evaluated in {time.perf_counter() - t0:.1f} s", markup=False)
    rows = compare_rows([s.url for s, _ in campaigns], [r.nats for r in results], w, baseline)
    return {
        "baseline": base_store.url,
        "windows": len(win.data),
        "documents": int(len(set(win.docs.tolist()))),
        "scored_bytes": int(results[0].nats.size),
        "device": str(device),
        "campaigns": [
            {
                "campaign": row.campaign,
                "n_experts": cfg.n_experts,
                "method": cfg.train.method,
                "top_k": min(ens.router.cfg.top_k, cfg.n_experts),
                "ensemble": _summary(res.nats, w),
                "minus_baseline": row.minus_baseline.as_dict() if row.minus_baseline else None,
                "substituted": ens.substitutes(res.per_expert_windows),
            }
            for row, (_, cfg), ens, res in zip(rows, campaigns, ensembles, results, strict=True)
        ],
    }


def table(m: dict) -> str:
    """The comparison as a Markdown table (stdout)."""

    def cell(v: dict, sign: str = "") -> str:
        return f"{v['nats_per_byte']:{sign}.4f} [{v['ci95'][0]:{sign}.4f}, {v['ci95'][1]:{sign}.4f}]"

    lines = [
        f"{m['windows']} test windows from {m['documents']} documents, {m['scored_bytes']:,} scored bytes; paired "
        f"document bootstrap against {m['baseline']} (< 0: better than it).",
        "",
        "| campaign | N | method | top-k | nats/byte [95% CI] | minus baseline, paired [95% CI] | substituted |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in m["campaigns"]:
        diff = "baseline" if c["minus_baseline"] is None else cell(c["minus_baseline"], "+")
        lines.append(
            f"| {c['campaign']} | {c['n_experts']} | {c['method']} | {c['top_k']} | {cell(c['ensemble'])} | {diff} | "
            f"{len(c['substituted'])} |"
        )
    return "\n".join(lines)
