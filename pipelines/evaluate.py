"""`soma eval`: the routed ensemble, the seed model and each expert on the test windows, with CIs."""

from __future__ import annotations

import json
import math
import os
import socket
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from pipelines.common import console, load_config, open_store, out
from pipelines.expertviews import capped, curves_caption, expert_lines, expert_spread, plot_curves
from pipelines.tracking import check_tracking, track_stage
from soma_cluster import breakdown as bd
from soma_cluster.checkpoint import Checkpoint
from soma_cluster.config import CampaignConfig, CorpusConfig
from soma_cluster.corpus import check_listing, documents
from soma_cluster.ensemble import (
    UNIFORM_NATS,
    Strided,
    Substitute,
    Windows,
    bootstrap_weights,
    ci,
    evaluate_ensemble,
    expert_probs,
    load_documents,
    load_models,
    load_windows,
    require_same_windows,
    strided_windows,
    window_logprobs,
    windows_digest,
)
from soma_cluster.errors import SomaError
from soma_cluster.inference.lm import RoutedLM
from soma_cluster.inference.routing import Routes
from soma_cluster.inference.scoring import RoutedSegment, Rule, Segment, joined, merge_runs, record_line, short_sha
from soma_cluster.jobs import TERMINAL, Category, JobState, expert_name
from soma_cluster.ledger import Ledger
from soma_cluster.model import campaign_param_count
from soma_cluster.prices import usd_per_hour
from soma_cluster.revisions import revisions
from soma_cluster.router import Router, load_router, router_text
from soma_cluster.shards import open_shard
from soma_cluster.snapshot import SNAPSHOT
from soma_cluster.sources import FULL_EXPERTS, TOP_EXPERTS, table_from_json
from soma_cluster.storage import Store, sha256
from soma_cluster.trackpoints import Stage
from soma_cluster.trainer import Trainer, pick_device


def _own_shard_val(store: Store, cfg: CampaignConfig, e: int, ck: Checkpoint, device: torch.device) -> float:
    """The expert's loss on its own shard's expert-validation rows (the rows it validated on in training)."""
    tr = Trainer(
        model=cfg.model,
        spsa=cfg.spsa,
        shard=open_shard(store, e),
        state=ck.state(device),
        seed=cfg.seed,
        expert=e,
        device=device,
        val_rows=cfg.train.val_batches * cfg.spsa.batch,
    )
    return tr.validate()


def _fmt(m: tuple[float, float, float]) -> str:
    return f"{m[0]:.4f} [{m[1]:.4f}, {m[2]:.4f}]"


@dataclass
class Ensemble:
    """A campaign's router, experts and seed model, loaded once; the seed stands in for `substituted` experts."""

    cfg: CampaignConfig
    router: Router
    checkpoints: dict[int, Checkpoint]
    seed: dict[str, torch.Tensor]
    substituted: dict[int, Substitute] = field(default_factory=dict)

    @classmethod
    def load(
        cls, store: Store, cfg: CampaignConfig, step: int | None = None, router: Router | None = None
    ) -> "Ensemble":
        """The latest checkpoints, or those of one step (ensemble.load_models)."""
        models = load_models(store, cfg.n_experts, step)
        return cls(cfg, router or load_router(store), models.checkpoints, models.seed.tensors, models.substituted)

    def run(self, win: Windows, context: int, device: torch.device, routed: tuple | None = None):
        """evaluate_ensemble on the windows: each routed on its first prefix_bytes, or by `routed` (top, weights)."""
        return evaluate_ensemble(
            self.router,
            self.cfg.model,
            self.experts(),
            win,
            context,
            self.cfg.eval.batch,
            device,
            seed=self.seed_unit(),
            routed=routed,
        )

    def experts(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """(body, head) of each expert with a checkpoint."""
        return {e: (ck.tensors["body"], ck.tensors["head"]) for e, ck in self.checkpoints.items()}

    def seed_unit(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.seed["body"], self.seed["head"]

    def lm(self, url: str, device: torch.device) -> RoutedLM:
        """The same weights as a RoutedLM (its forward, routing rule and digest)."""
        return RoutedLM(self.cfg, self.router, self.experts(), self.seed_unit(), self.substituted, url, device)

    def require_all(self, url: str) -> None:
        """`soma eval --require-all`: any substitution is an error, naming the experts and what trains them."""
        if not self.substituted:
            return
        subs = list(self.substituted.values())
        named = ", ".join(f"{expert_name(s.expert)} ({s.end})" for s in subs[:8]) + (", ..." if len(subs) > 8 else "")
        ends = {s.end for s in subs}
        given_up = {JobState.BUDGET_EXHAUSTED, JobState.FAILED_PERMANENTLY}
        fixes = [f"soma resume {url}"] if ends - given_up else []
        fixes += (
            [f"failed_permanently ones: soma resume {url} --retry-failed"]
            if JobState.FAILED_PERMANENTLY in ends
            else []
        )
        fixes += (
            ["budget_exhausted ones: a larger budget.expert_gpu_hours, in a new campaign"]
            if JobState.BUDGET_EXHAUSTED in ends
            else []
        )
        raise SomaError(
            f"{len(subs)} of {self.cfg.n_experts} experts of {url} have no checkpoint and would be evaluated as the "
            f"seed model: {named}; --require-all refuses that: train them first ({'; '.join(fixes)}) "
            f"or leave out --require-all"
        )

    def substitutes(self, routed: dict[int, int]) -> list[dict]:
        """The substituted experts for metrics.json and --json: name, end state, step, reason, windows routed to it."""
        return [
            {
                "expert": expert_name(e),
                "end": s.end,
                "step": s.step,
                "reason": s.reason,
                "routed_windows": routed.get(e, 0),
            }
            for e, s in self.substituted.items()
        ]

    def units(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(body, head) of every expert in order, the seed model's where it stands in for one."""
        seed = (self.seed["body"], self.seed["head"])
        return [
            (ck.tensors["body"], ck.tensors["head"]) if (ck := self.checkpoints.get(e)) else seed
            for e in range(self.cfg.n_experts)
        ]

    def seed_nats(self, win: Windows, context: int, device: torch.device) -> np.ndarray:
        return -window_logprobs(
            self.cfg.model, self.seed["body"], self.seed["head"], win.data, context, self.cfg.eval.batch, device
        )


def in_progress(store: Store, n_experts: int, have) -> dict:
    """Whether the campaign was still being trained when it was evaluated: the experts its status (status.json)
    says have not ended (evaluated at a checkpoint that may not be their last, or as the seed model where they
    have none yet), and the driver holding it now."""
    from pipelines.status import lease_view

    rows = {}
    if store.exists(SNAPSHOT):
        rows = {r["job"]: r for r in store.read_json(SNAPSHOT)["jobs"]}
    lease = lease_view(store) or {}
    if lease.get("held") and lease.get("pid") == os.getpid() and lease.get("host") == socket.gethostname():
        lease = {}  # this process holds it (soma demo evaluates under its own lease): no driver trains meanwhile
    # with a driver at work, its queued and pending experts are in training too; without one, an expert with no
    # checkpoint is a hole the seed stands in for (the report's partial-campaign table), not training
    experts = range(n_experts) if lease.get("held") else have
    return {
        "experts": [
            {"expert": n, "state": r["state"], "step": r["step"], "target": r["target"]}
            for n in map(expert_name, experts)
            if (r := rows.get(n)) is not None and r["state"] not in TERMINAL
        ],
        "driver": f"{lease['command']} (pid {lease['pid']} on {lease['host']})" if lease.get("held") else None,
    }


def _summary(nats: np.ndarray, w: np.ndarray, scored: np.ndarray | None = None) -> dict:
    m = ci(nats, w, scored)
    return {"nats_per_byte": m[0], "ci95": list(m[1:]), "bits_per_byte": m[0] / math.log(2)}


def _paired(a: np.ndarray, b: np.ndarray, w: np.ndarray, scored: np.ndarray | None = None) -> dict:
    """a - b on the same windows, the bootstrap resampling documents for both at once."""
    m = ci(a - b, w, scored)
    return {"nats_per_byte": m[0], "ci95": list(m[1:])}


def explain(
    store: Store,
    ens: Ensemble,
    win: Windows,
    ctx: int,
    device: torch.device,
    nats: np.ndarray,
    seed_nats: np.ndarray,
    routed: dict[int, int],
    w: np.ndarray,
    top: np.ndarray | None = None,
) -> dict:
    """The evaluation's one number taken apart (soma_cluster/breakdown.py): loss per source and per document, the
    baselines and the top-k sensitivity on the same windows (paired with the ensemble), the routing load (judged
    against the test windows' mix of sources where `top`, (n, k) each window's experts, is given), and the
    ledger's elapsed wall time beside its actor-seconds."""
    cfg, router = ens.cfg, ens.router
    docs = load_documents(store)
    k = min(router.cfg.top_k, cfg.n_experts)
    rows = bd.baseline_rows(len(win.data), cfg.n_experts, k)
    t0 = time.perf_counter()
    probs = expert_probs(cfg.model, ens.units(), win.data[rows], ctx, cfg.eval.batch, device)  # (N, m, S)
    emb = router.embed([router_text(bytes(x[: router.cfg.prefix_bytes])) for x in win.data[rows]])
    routes = {j: router.route(emb, j) for j in bd.sensitivity_ks(cfg.n_experts, k)}
    wr, ens_rows = w[:, rows], nats[rows]
    base = bd.baselines(probs, ens_rows, seed_nats[rows], wr, k)
    sens = bd.top_k_sensitivity(probs, routes, ens_rows, wr)
    seconds = time.perf_counter() - t0
    load = bd.routing_load(routed, len(win.data), k, cfg.n_experts)
    mix = source_routing(store, cfg, win, docs, top)
    return {
        "by_source": [
            g.as_dict() for g in bd.by_source(nats, seed_nats, win.docs, {d: s for d, (_, s) in docs.items()}, w)
        ],
        "by_document": [vars(d) for d in bd.by_document(nats, seed_nats, win.docs, docs)],
        "baselines": {
            "windows": len(rows),
            "all_windows": len(rows) == len(win.data),
            "expert_windows": int(cfg.n_experts * len(rows)),
            "seconds": seconds,
            "ensemble": bd.Loss.of(ens_rows, wr).summary(),
            **{b.name: b.as_dict() for b in base},
        },
        "top_k_sensitivity": [t.as_dict() for t in sens],
        "expert_test_nats": {
            expert_name(e): float(-np.log(np.maximum(probs[e], 1e-300)).mean()) for e in range(cfg.n_experts)
        },
        "routing_load": load.as_dict(),
        **mix_metrics(mix, load),
    }


# -- routing by source (soma_cluster/breakdown.py, "the routing load by source") --------------------------------------
def source_routing(
    store: Store, cfg: CampaignConfig, win: Windows, docs: dict[int, tuple[str, str]], top: np.ndarray | None
) -> bd.SourceRouting | None:
    """The test windows' routing by source against the train sequences' source x expert table of
    shards/manifest.json (source_experts; a campaign prepared before it: no table, nothing judged by the mix)."""
    if top is None:
        return None
    rows = store.read_json("shards/manifest.json").get("source_experts")
    train = table_from_json(rows, cfg.n_experts) if rows else None
    sources = [docs.get(int(d), ("", "unknown"))[1] for d in win.docs]
    return bd.routing_by_source(sources, top, cfg.n_experts, train)


def mix_metrics(mix: bd.SourceRouting | None, load: bd.RoutingLoad) -> dict:
    """metrics.json's routing_by_source, and the routing warning: judged against the test windows' mix of sources
    where the training table is there, else by the fair share alone (routing_load)."""
    if mix is None or not mix.trained:
        return {
            "routing_by_source": mix.as_dict() if mix is not None else None,
            "routing_warning": load.warning(expert_name),
            "routing_note": None,
        }
    return {
        "routing_by_source": mix.as_dict(),
        "routing_warning": mix.warning(expert_name),
        "routing_note": mix.note(expert_name),
    }


def mix_verdict(m: dict) -> str | None:
    """The routing-load section's verdict when the load was judged against the mix of sources (None: it was not)."""
    mix = m.get("routing_by_source")
    if not (mix and mix["trained"] and mix["judged"]):
        return None
    if m.get("routing_warning"):
        return f"**Warning: {m['routing_warning']}.** (Judged against the test windows' mix of sources: below.)"
    if m.get("routing_note"):
        return f"Judged against the test windows' mix of sources (below), it does not concentrate: {m['routing_note']}."
    return "Judged against the test windows' mix of sources (below), it does not concentrate."


SHOWN_SOURCE_ROWS = 20  # the report's routing-by-source table lists this many sources, the rest in one row
SHOWN_MIX_EXPERTS = 8  # and this many experts, furthest above what the mix predicts


def source_routing_lines(m: dict) -> str:
    """The report's source x expert routing table of the test windows, and each expert's load against what the mix
    of sources predicts (every row in metrics.json's routing_by_source)."""
    mix = m.get("routing_by_source")
    if not mix:
        return ""
    n, k, total = mix["n_experts"], mix["top_k"], max(mix["windows"], 1)
    full = n <= FULL_EXPERTS
    listed, rest = mix["sources"][:SHOWN_SOURCE_ROWS], mix["sources"][SHOWN_SOURCE_ROWS:]
    if full:
        head = "| source | windows | share | " + " | ".join(expert_name(e) for e in range(n)) + " |"
        rule = "|---|---|---|" + "---|" * n
    else:
        head = f"| source | windows | share | top {TOP_EXPERTS} experts: routed (predicted) |"
        rule = "|---|---|---|---|"
    rows = [head, rule]
    for r in listed:
        cells = _source_cells(r, n, full, mix["trained"])
        rows.append(f"| {_md(r['source'])} | {r['windows']} | {100 * r['windows'] / total:.0f}% | {cells} |")
    if rest:
        n_rest = sum(r["windows"] for r in rest)
        blank = " | ".join([""] * (n if full else 1))
        rows.append(f"| {len(rest):,} more sources | {n_rest} | {100 * n_rest / total:.0f}% | {blank} |")
    recorded = "" if mix["trained"] else " (not recorded by this campaign's prepare: no prediction)"
    which = "Every source" if not rest else f"The {len(listed)} largest of {len(mix['sources']):,} sources"
    return f"""
### Routing by source

The test windows of each source (their held-out documents' sources, `test/documents.json`) and the share of them the
router sent to each expert (each window counts for its top-{k}, so a row sums to {100 * k}%), in parentheses what the
training shards predict: min(1, k x the share of the source's train sequences in that expert's shard, from
`shards/manifest.json`'s `source_experts`){recorded}. {which}; all of them in `metrics.json`'s `routing_by_source`.

{chr(10).join(rows)}
{_mix_load_lines(mix)}"""


def _source_cells(r: dict, n: int, full: bool, trained: bool) -> str:
    routed = {int(e): c for e, c in r["routed"].items()}
    pred = {int(e): p for e, p in r["predicted_share"].items()}

    def cell(e: int) -> str:
        got = f"{100 * routed.get(e, 0) / max(r['windows'], 1):.0f}%"
        return f"{got} ({100 * pred.get(e, 0):.0f}%)" if trained else got

    if full:
        return " | ".join(cell(e) for e in range(n))
    top = sorted(set(routed) | set(pred), key=lambda e: (-routed.get(e, 0), -pred.get(e, 0), e))[:TOP_EXPERTS]
    return ", ".join(f"{expert_name(e)} {cell(e)}" for e in top)


def _mix_load_lines(mix: dict) -> str:
    if not mix["trained"]:
        return ""
    experts = mix["experts"]
    ranked = sorted(experts, key=lambda x: (-x["share"] / max(x["threshold"], 1e-12), x["expert"]))
    rows = "\n".join(
        f"| {expert_name(x['expert'])} | {x['windows']} | {x['share']:.2f} | {x['expected_share']:.2f} | "
        f"{x['threshold']:.2f} |"
        for x in ranked[:SHOWN_MIX_EXPERTS]
    )
    which = "every expert" if len(experts) <= SHOWN_MIX_EXPERTS else f"the {SHOWN_MIX_EXPERTS} of {len(experts)}"
    if not mix["judged"]:
        verdict = f"Not judged: k = N, or k/N x windows is under {bd.LOAD_MIN_FAIR}."
    elif mix["over"]:
        verdict = f"{len(mix['over'])} expert(s) over their mark."
    else:
        verdict = "No expert is over its mark."
    return f"""
Each expert's load against what this mix of sources predicts: {bd.MIX_RULE}. An expert is warned about when its
share of the windows exceeds min(2 f, (1 + f) / 2), f its expected share (at least {bd.LOAD_MIN_FAIR} windows'
worth). {verdict} Furthest above their mark first ({which}):

| expert | windows | share | expected share under the mix | warned above |
|---|---|---|---|---|
{rows}
"""


def _md(text: str) -> str:
    """A label as one Markdown table cell shows it."""
    return text.replace("|", "\\|")


def wall_time(store: Store) -> dict:
    """Per ledger category: the clock time something of it ran (elapsed) beside the sum over its records (actor)."""
    led = Ledger(store)
    return {
        "elapsed_seconds": bd.elapsed_seconds(led.records()),
        "actor_seconds": {c: v for c, v in led.totals().wall_seconds.items() if v},
        "rule": "elapsed: the union of the records' intervals [t - wall_seconds, t]; actor: their sum",
    }


def evaluate(
    store: Store,
    cfg: CampaignConfig,
    compare: tuple[Store, CampaignConfig] | None = None,
    require_all: bool = False,
    track_tags: dict[str, str] | None = None,
) -> dict:
    """The routed ensemble, the seed and each expert on the campaign's test windows; with `compare`,
    another campaign's ensemble on the same windows and the paired difference. Experts without a checkpoint
    are evaluated as the seed model and listed (`require_all`: refused instead, before any work). The numbers and
    the report go to the campaign's trackers, if any, with `track_tags` on its run (`soma experiment`'s arm)."""
    check_tracking(store, cfg)  # refused before the work, not after it
    if compare is not None:
        require_same_windows((store.url, windows_digest(store)), [(compare[0].url, windows_digest(compare[0]))])
    t0 = time.monotonic()
    device = pick_device()
    ens = Ensemble.load(store, cfg)
    other_ens = Ensemble.load(compare[0], compare[1]) if compare is not None else None
    running = in_progress(store, cfg.n_experts, ens.checkpoints)
    if require_all:  # a campaign still training first: its substitutes may be trained by that driver
        refuse_in_progress(store.url, running)
        ens.require_all(store.url)
        if other_ens is not None:
            other_ens.require_all(compare[0].url)
    store.check_writable()  # the report is written at the end: after every refusal above, before the work
    win = load_windows(store, cfg.eval_windows())
    ctx = cfg.eval.context_bytes
    res = ens.run(win, ctx, device)
    t_seed = time.perf_counter()
    seed_nats = ens.seed_nats(win, ctx, device)
    seed_seconds = time.perf_counter() - t_seed
    w = bootstrap_weights(win.docs, cfg.eval.bootstrap, cfg.seed)
    per_expert = {
        expert_name(e): {
            "own_val_nats": _own_shard_val(store, cfg, e, ck, device),
            "step": ck.meta["state"]["step"],
            "routed_windows": res.per_expert_windows[e],
        }
        for e, ck in ens.checkpoints.items()
    }
    total_s = res.route_seconds + res.model_seconds
    metrics = {
        "windows": len(win.data),
        "documents": int(len(np.unique(win.docs))),
        "scored_bytes": int(res.nats.size),
        "ensemble": _summary(res.nats, w),
        "seed": _summary(seed_nats, w),
        "uniform": {"nats_per_byte": UNIFORM_NATS, "bits_per_byte": 8.0},
        "ensemble_minus_seed": _paired(res.nats, seed_nats, w),
        "per_expert": per_expert,
        "substituted": ens.substitutes(res.per_expert_windows),
        "seed_substitute_windows": res.seed_windows,
        "in_progress": running["experts"],
        "driver_running": running["driver"],
        "complete": not (ens.substituted or running["experts"] or running["driver"]),
        "top_k": min(ens.router.cfg.top_k, cfg.n_experts),
        "weighting": ens.router.cfg.weighting,
        "rule": ens.router.cfg.rule,
        "routing_time_share": res.route_seconds / total_s,
        "ensemble_seconds": total_s,
        "seed_seconds": seed_seconds,
        "byte_tokens_per_second": len(win.data) * (win.data.shape[1] - 1) / total_s,
        "parameters": campaign_param_count(cfg.model, cfg.n_experts),
        "device": str(device),
        "config_digest": cfg.digest(),  # the config in force: campaign.yaml and its revisions (soma set)
        "config_revision": len(revisions(store)),
    }
    if compare is not None:
        other_store, other_cfg = compare
        other = other_ens.run(win, ctx, device)
        metrics["compare"] = {
            "campaign": other_store.url,
            "n_experts": other_cfg.n_experts,
            "ensemble": _summary(other.nats, w),
            "this_minus_other": _paired(res.nats, other.nats, w),
            "substituted": other_ens.substitutes(other.per_expert_windows),
        }
    metrics.update(explain(store, ens, win, ctx, device, res.nats, seed_nats, res.per_expert_windows, w, res.top))
    if metrics["routing_warning"]:
        console.print(f"warning: {metrics['routing_warning']}", markup=False, soft_wrap=True)
    _charge(store, cfg, t0, device)
    metrics["ledger"] = Ledger(store).totals().as_dict()
    metrics["wall_time"] = wall_time(store)
    metrics["curves_figure"], metrics["curves_outliers"] = plot_curves(store, cfg)
    metrics["expert_spread"] = expert_spread(metrics)
    store.write_json("eval/metrics.json", metrics)
    store.write_bytes("eval/report.md", report(cfg, metrics).encode())
    track_stage(store, cfg, Stage.EVAL, "finished", metrics=metrics, tags=track_tags)
    return metrics


def _charge(store: Store, cfg: CampaignConfig, t0: float, device: torch.device) -> None:
    wall = time.monotonic() - t0
    on_gpu = device.type == "cuda"
    # each evaluation is its own record (a fixed id would let a second `soma eval` be deduplicated away)
    Ledger(store).record(
        category=Category.EVALUATION,
        gpu_seconds=wall if on_gpu else 0.0,
        wall_seconds=wall,
        seq=time.time_ns(),
        note=f"driver {device}",
        usd_per_hour=usd_per_hour(cfg.prices, "cuda") if on_gpu else None,
    )


def evaluate_text(store: Store, cfg: CampaignConfig, source: str, stride: int, require_all: bool = False) -> dict:
    """Long-document mode on a user's text corpus (dir, .txt, .jsonl, .parquet; local or s3://): strided
    windows (stride 768 as the paper's WikiText-103 evaluation), every byte after a document's first scored
    once; ensemble and seed, paired. Written to eval/text-<sha of the source>.json and .md."""
    t0 = time.monotonic()
    if not 0 < stride <= cfg.eval.window_bytes - 1:
        raise SomaError(
            f"--stride {stride} must be between 1 and {cfg.eval.window_bytes - 1} (the window's predictions)"
        )
    corpus = CorpusConfig(source=source, max_bytes=cfg.corpus.max_bytes, text_field=cfg.corpus.text_field)
    check_listing(corpus)  # a text that is not there: before the checkpoints are read
    device = pick_device()
    ens = Ensemble.load(store, cfg)
    running = in_progress(store, cfg.n_experts, ens.checkpoints)
    if require_all:
        refuse_in_progress(store.url, running)
        ens.require_all(store.url)
    store.check_writable()  # the report is written at the end: after every refusal above, before the work
    ids: list[str] = []  # each document's id, in the order read
    docs = (ids.append(d.doc_id) or d.data for d in documents(corpus))
    st = strided_windows(docs, cfg.eval.window_bytes, stride, cfg.eval_windows())
    lm = ens.lm(store.url, device)
    t_route = time.perf_counter()
    main = lm.routes([bytes(w) for w in st.windows.data])  # each window's first prefix_bytes, as soma eval's
    route_s = time.perf_counter() - t_route
    res = ens.run(st.windows, 0, device, routed=(main.experts, main.weights))
    t_early = time.perf_counter()
    routes = route_causally(lm, st, main, res.nats, ids)
    res.route_seconds, res.model_seconds = (
        res.route_seconds + route_s,
        res.model_seconds + time.perf_counter() - t_early,
    )
    seed_nats = ens.seed_nats(st.windows, 0, device)
    w = bootstrap_weights(st.windows.docs, cfg.eval.bootstrap, cfg.seed)
    total_s = res.route_seconds + res.model_seconds
    name = f"eval/text-{sha256(source.encode())[:12]}"
    m = {
        "source": source,
        "stride": stride,
        "windows": len(st.windows.data),
        "documents": int(len(np.unique(st.windows.docs))),
        "skipped_short_documents": st.skipped,
        "scored_bytes": int(st.scored.sum()),
        "ensemble": _summary(res.nats, w, st.scored),
        "seed": _summary(seed_nats, w, st.scored),
        "ensemble_minus_seed": _paired(res.nats, seed_nats, w, st.scored),
        "substituted": ens.substitutes(res.per_expert_windows),
        "seed_substitute_windows": res.seed_windows,
        "in_progress": running["experts"],
        "driver_running": running["driver"],
        "complete": not (ens.substituted or running["experts"] or running["driver"]),
        "routing_time_share": res.route_seconds / total_s,
        "byte_tokens_per_second": st.windows.data.shape[0] * (st.windows.data.shape[1] - 1) / total_s,
        "device": str(device),
        "routing": {
            **Rule(cfg.eval.window_bytes, stride, lm.rule.prefix_bytes).as_dict(),  # the windows of --stride
            "segments": routes.count(b"\n"),
            "routes_file": f"{name}.routes.jsonl",
            "routes_sha256": sha256(routes),
        },
        "ensemble_digest": lm.digest,
    }
    store.write_bytes(f"{name}.routes.jsonl", routes)
    _charge(store, cfg, t0, device)
    store.write_json(f"{name}.json", m)
    store.write_bytes(f"{name}.md", text_report(cfg, m).encode())
    m["report"] = f"{store.url}/{name}.md"
    return m


def route_causally(lm: RoutedLM, st: Strided, main: Routes, nats: np.ndarray, ids: list[str]) -> bytes:
    """The strided windows' scores made causal, `nats` (n, window - 1) rescored in place where they change: a window
    whose first scored byte comes before the router has read router.prefix_bytes of it (a document's first window:
    bytes 1 .. 255) is read in scoring.Rule's segments, each routed only on bytes before those it scores; its
    predictions from prefix_bytes - 1 on, and every other window, keep the window's own route, `main` (the routes
    that computed `nats`). Returns every segment's record (document id, offsets in it, the bytes its router read,
    experts and weights), one JSON line each, in window order."""
    rule, data = lm.rule, st.windows.data
    firsts = st.scored.argmax(axis=1)
    plan = [(i, seg) for i in range(len(data)) for seg in rule.segments(data.shape[1], int(firsts[i]))]
    early = [r for r, (_, seg) in enumerate(plan) if seg.read < rule.prefix_bytes]
    routed = lm.routing.routes_on([bytes(data[plan[r][0], : plan[r][1].read]) for r in early])
    experts, weights = main.experts[[i for i, _ in plan]], main.weights[[i for i, _ in plan]]
    experts[early], weights[early] = routed.experts, routed.weights
    runs = merge_runs([i for i, _ in plan], [seg for _, seg in plan], experts, weights)
    owner = [plan[a][0] for a, _ in runs]
    segs = [joined([seg for _, seg in plan], a, b) for a, b in runs]
    # a run under the window's own route: the pass that computed `nats` read it so already
    redo = [
        r
        for r, (a, _) in enumerate(runs)
        if not (
            np.array_equal(experts[a], main.experts[owner[r]]) and np.array_equal(weights[a], main.weights[owner[r]])
        )
    ]
    rows = [runs[r][0] for r in redo]
    part = lm.window_nats(
        [bytes(data[owner[r], : segs[r].end]) for r in redo],
        [segs[r].first for r in redo],
        Routes(experts[rows], weights[rows]),
    )
    for r, n in zip(redo, part, strict=True):
        nats[owner[r], segs[r].first : segs[r].end - 1] = n
    lines = []
    for (a, _), i, seg in zip(runs, owner, segs, strict=True):
        at = int(st.starts[i])
        moved = Segment(seg.start + at, seg.end + at, seg.first, seg.read, seg.kind)
        rec = RoutedSegment(
            moved, tuple(experts[a].tolist()), tuple(weights[a].tolist()), short_sha(bytes(data[i, : seg.read]))
        )
        lines.append(record_line({"doc": ids[int(st.windows.docs[i])], **rec.as_dict()}))
    return b"".join(lines)


def text_report(cfg: CampaignConfig, m: dict) -> str:
    return f"""# soma-cluster long-document evaluation: {cfg.name}

Source `{m["source"]}`: {m["windows"]} windows of {cfg.eval.window_bytes} bytes at stride {m["stride"]} from \
{m["documents"]}
documents ({m["skipped_short_documents"]} shorter than a window skipped), {m["scored_bytes"]:,} bytes scored once each.
{progress_lines(m)}{substitution_lines(m)}
| model | nats/byte [95% CI] | bits/byte |
|---|---|---|
| routed ensemble | {_fmt((m["ensemble"]["nats_per_byte"], *m["ensemble"]["ci95"]))} | \
{m["ensemble"]["bits_per_byte"]:.4f} |
| seed model (N = 1) | {_fmt((m["seed"]["nats_per_byte"], *m["seed"]["ci95"]))} | {m["seed"]["bits_per_byte"]:.4f} |

Ensemble minus seed, paired document bootstrap: {m["ensemble_minus_seed"]["nats_per_byte"]:+.4f}
[{m["ensemble_minus_seed"]["ci95"][0]:+.4f}, {m["ensemble_minus_seed"]["ci95"][1]:+.4f}]. Routing is
{100 * m["routing_time_share"]:.1f}% of the ensemble's time; {m["byte_tokens_per_second"]:,.0f} byte-tokens/s on \
{m["device"]}.
"""


SUBSTITUTION_RULE = (
    "the router still sends each window to the same top-k experts with the same weights; a substituted "
    "expert's next-byte probabilities are the seed model's"
)


def refuse_in_progress(url: str, running: dict) -> None:
    """`soma eval --require-all`: experts still training (or interrupted) are not their final models either."""
    if running["experts"] or running["driver"]:
        named = ", ".join(
            f"{x['expert']} ({x['state']}, step {x['step']}/{x['target']})" for x in running["experts"][:8]
        )
        by = f"; {running['driver']} holds it now" if running["driver"] else ""
        raise SomaError(
            f"{url} is still being trained ({named or 'no expert ended yet'}{by}); --require-all refuses an "
            f"evaluation before every expert ended: wait for the driver (soma status {url} --watch) or soma resume "
            f"{url}, or leave out --require-all"
        )


def progress_lines(m: dict) -> str:
    """The report's account of a campaign evaluated while it was still being trained (nothing when it ended)."""
    running, driver = m.get("in_progress") or [], m.get("driver_running")
    if not running and not driver:
        return ""
    lines = [f"| {x['expert']} | {x['state']} | {x['step']} / {x['target']} |" for x in running]
    shown, more = capped(lines, "in_progress")
    rows = "\n".join(shown)
    table = f"\n\n| expert | state (status.json) | step / target |\n|---|---|---|\n{rows}{more}" if running else ""
    return (
        f"\n**Campaign still in training: {len(running)} expert(s) had not ended and are evaluated at their latest "
        f"checkpoint, which may not be their last (or as the seed model, where they have none yet)**"
        + (f"; {driver} held the campaign during this evaluation" if driver else "")
        + f". Evaluate again once every expert ended; `soma eval --require-all` refuses this.{table}\n"
    )


def substitution_lines(m: dict) -> str:
    """The report's account of the experts the seed model stood in for (nothing when none)."""
    subs = m.get("substituted") or []
    if not subs:
        return ""
    shown, more = capped(
        [f"| {s['expert']} | {s['end']} | {s['step']} | {s['reason'] or ''} | {s['routed_windows']} |" for s in subs],
        "substituted",
    )
    rows = "\n".join(shown)
    return (
        f"\n**Partial campaign: {len(subs)} expert(s) have no checkpoint and are evaluated as the seed model** "
        f"({SUBSTITUTION_RULE}; the seed scored {m.get('seed_substitute_windows', 0)} windows in their place). "
        "`soma eval --require-all` refuses this.\n\n"
        f"| expert | end (events.jsonl) | step | why | windows routed to it |\n|---|---|---|---|---|\n{rows}{more}\n"
    )


def _compare_lines(m: dict) -> str:
    if "compare" not in m:
        return ""
    c = m["compare"]
    subs = c.get("substituted") or []
    partial = (
        (
            f" That campaign is partial: the seed model stands in for {', '.join(x['expert'] for x in subs)} "
            f"(no checkpoint)."
        )
        if subs
        else ""
    )
    d = c["this_minus_other"]
    return (
        f"\nCompared on the same windows with `{c['campaign']}` (N = {c['n_experts']}): its ensemble "
        f"{_fmt((c['ensemble']['nats_per_byte'], *c['ensemble']['ci95']))}; this minus that, paired: "
        f"{d['nats_per_byte']:+.4f} [{d['ci95'][0]:+.4f}, {d['ci95'][1]:+.4f}].{partial}\n"
    )


def _ci_cell(v: dict, sign: str = "") -> str:
    return f"{v['nats_per_byte']:{sign}.4f} [{v['ci95'][0]:{sign}.4f}, {v['ci95'][1]:{sign}.4f}]"


def source_lines(m: dict, shown: int = 5) -> str:
    """Loss per source, and the hardest and easiest documents."""
    if not m.get("by_source"):
        return ""
    groups = m["by_source"][:SHOWN_SOURCE_ROWS]  # largest first; every source in metrics.json
    rows = "\n".join(
        f"| {_md(g['source'])} | {g['windows']} | {g['documents']} | {_ci_cell(g['ensemble'])} | "
        f"{_ci_cell(g['seed'])} | {_ci_cell(g['ensemble_minus_seed'], '+')} |"
        for g in groups
    )
    if len(m["by_source"]) > len(groups):
        more = m["by_source"][len(groups) :]
        rows += (
            f"\n| {len(more):,} more sources (`by_source` in `metrics.json`) | {sum(g['windows'] for g in more)} | "
            f"{sum(g['documents'] for g in more)} | | | |"
        )
    docs = m.get("by_document") or []
    picked = docs if len(docs) <= 2 * shown else docs[:shown] + docs[-shown:]
    drows = "\n".join(
        f"| {d['name'] or d['doc']} | {_md(d['source'])} | {d['windows']} | {d['ensemble_nats_per_byte']:.4f} | "
        f"{d['seed_nats_per_byte']:.4f} |"
        for d in picked
    )
    which = "every document" if picked is docs else f"the {shown} hardest and the {shown} easiest of {len(docs)}"
    return f"""
### Loss per source and per document

Each window belongs to the held-out document that owns its first scored byte; a source's interval resamples only its
own documents.

| source | windows | documents | ensemble nats/byte [95% CI] | seed | ensemble minus seed, paired |
|---|---|---|---|---|---|
{rows}

Per document ({which}; all of them in `metrics.json`'s `by_document`), ensemble loss, hardest first:

| document | source | windows | ensemble nats/byte | seed |
|---|---|---|---|---|
{drows}
"""


def baseline_lines(m: dict) -> str:
    """The baselines and the top-k sensitivity, paired with the routed ensemble on the same windows."""
    b = m.get("baselines")
    if not b:
        return ""
    n_exp = len(m.get("expert_test_nats") or {}) or "N"
    where = (
        f"all {b['windows']} windows"
        if b["all_windows"]
        else f"{b['windows']} of the {m['windows']} windows, evenly spaced (every expert on every window costs "
        f"{n_exp} x windows forwards: kept to at most twice the ensemble's own pass, or 4,096 expert-windows)"
    )
    names = {
        "best_single": f"best single expert ({expert_name(b['best_single']['expert'])})",
        "oracle": f"oracle routing, top-{b['oracle']['k']}",
        "uniform_mixture": "uniform mixture over all experts",
        "seed": "seed model (N = 1)",
    }
    rows = "\n".join(
        f"| {label} | {_ci_cell(b[key])} | {_ci_cell(b[key]['ensemble_minus_this'], '+')} |"
        for key, label in names.items()
    )
    sens = "\n".join(
        f"| {t['k']}{' (configured)' if t['k'] == m['top_k'] else ''} | {_ci_cell(t['router'])} | "
        f"{_ci_cell(t['router_minus_ensemble'], '+')} | {_ci_cell(t['oracle'])} |"
        for t in m.get("top_k_sensitivity") or []
    )
    return f"""
### Baselines on the same windows

Every expert scored {where}, in {b["seconds"]:.1f} s; each line is paired with the routed ensemble on those windows
({_ci_cell(b["ensemble"])} there). Best single expert: {bd.BEST_SINGLE_RULE}. Oracle routing: {bd.ORACLE_RULE};
it reads the targets, so it bounds what a better router could do with these experts. Uniform mixture:
{bd.UNIFORM_MIXTURE_RULE}.

| baseline | nats/byte [95% CI] | ensemble minus it, paired (< 0: the ensemble is better) |
|---|---|---|
{rows}

### Sensitivity to top-k

The router's k nearest experts, weighted by its rule ({m["weighting"]}) over those k, from the same per-expert
probabilities; paired against the configured top-{m["top_k"]}; oracle top-k as above.

| k | router top-k nats/byte [95% CI] | minus top-{m["top_k"]}, paired | oracle top-k |
|---|---|---|---|
{sens}
"""


def load_lines(m: dict) -> str:
    load = m.get("routing_load")
    if not load:
        return ""
    loads = sorted(load["per_expert"].items(), key=lambda ec: (-ec[1], int(ec[0])))
    shown = loads if len(loads) <= 16 else loads[:8] + loads[-8:]  # N = 256: the busiest and the idlest eight
    rows = "\n".join(f"| {expert_name(int(e))} | {c} | {c / max(load['windows'], 1):.2f} |" for e, c in shown)
    which = "" if shown is loads else f" (the 8 busiest and the 8 least busy of {len(loads)}; all in `metrics.json`)"
    if mix_verdict(m):
        verdict = mix_verdict(m)
    elif m.get("routing_warning"):
        verdict = f"**Warning: {m['routing_warning']}.**"
    elif not load["judged"]:
        verdict = (
            "Not judged: every window goes to every expert (k = N)"
            if load["top_k"] >= load["n_experts"]
            else f"Not judged: the fair count k/N x windows is under {bd.LOAD_MIN_FAIR} windows"
        )
    else:
        verdict = "The load does not concentrate."
    return f"""
### Routing load

Windows routed to each expert (each window counts for its top-{load["top_k"]}): fair share k/N =
{load["fair_share"]:.2f}; busiest {expert_name(load["busiest"])} at {load["max_share"]:.2f}; normalized entropy of the
load {load["normalized_entropy"]:.2f} (1: even). A warning is given when the busiest share exceeds min(2 k/N,
(1 + k/N) / 2) = {load["threshold"]:.2f}, where k/N x windows is at least {bd.LOAD_MIN_FAIR}. {verdict}
Busiest first{which}:

| expert | windows | share |
|---|---|---|
{rows}
"""


def wall_lines(m: dict) -> str:
    led, wt = m["ledger"], m.get("wall_time")
    actor = ", ".join(f"{k} {v:.1f}" for k, v in led["wall_seconds"].items() if v)
    if not wt:
        return f"Actor-seconds per category (the ledger's records summed): {actor}.\n"
    elapsed = ", ".join(f"{k} {v:.1f}" for k, v in wt["elapsed_seconds"].items())
    return (
        f"Elapsed wall time per category (the clock: the union of the ledger records' intervals): {elapsed}.\n"
        f"Actor-seconds per category (the records summed: N actors side by side count N times): {actor}.\n"
    )


def usd_line(led: dict) -> str:
    """The ledger in dollars, at the price each record was written with (nothing when no record had a price)."""
    if not led.get("usd_total") and not any((led.get("usd") or {}).values()):
        return ""
    parts = ", ".join(f"{k} ${v:,.2f}" for k, v in led["usd"].items() if v)
    unpriced = led.get("unpriced_gpu_hours") or 0.0
    tail = f"; {unpriced:.4f} GPU-hours were written without a price" if unpriced > 0 else ""
    return f"In dollars, at the price each record was written with: ${led['usd_total']:,.2f} ({parts}){tail}.\n"


def report(cfg: CampaignConfig, m: dict) -> str:
    led = m["ledger"]
    return f"""# soma-cluster evaluation: {cfg.name} (preset {cfg.preset})

N = {cfg.n_experts} experts, d = {cfg.model.d}, {m["parameters"]:,} parameters; top-{m["top_k"]} {m["weighting"]} \
routing by the {m.get("rule", "nearest")} rule; config {m.get("config_digest", "?")} (revision \
{m.get("config_revision", 0)});
{m["windows"]} test windows of {cfg.eval.window_bytes} bytes from {m["documents"]} held-out documents, \
{m["scored_bytes"]:,} scored bytes.
{progress_lines(m)}{substitution_lines(m)}
| model | nats/byte [95% CI] | bits/byte |
|---|---|---|
| routed ensemble | {_fmt((m["ensemble"]["nats_per_byte"], *m["ensemble"]["ci95"]))} | \
{m["ensemble"]["bits_per_byte"]:.4f} |
| seed model (N = 1) | {_fmt((m["seed"]["nats_per_byte"], *m["seed"]["ci95"]))} | {m["seed"]["bits_per_byte"]:.4f} |
| uniform over bytes | {m["uniform"]["nats_per_byte"]:.4f} | 8.0000 |

Ensemble minus seed, paired document bootstrap: {m["ensemble_minus_seed"]["nats_per_byte"]:+.4f} nats/byte
[{m["ensemble_minus_seed"]["ci95"][0]:+.4f}, {m["ensemble_minus_seed"]["ci95"][1]:+.4f}].
{_compare_lines(m)}
{expert_lines(m)}{source_lines(m)}{baseline_lines(m)}{load_lines(m)}{source_routing_lines(m)}

{curves_caption(m, cfg.n_experts)}
Inference on {m["device"]}: {m["byte_tokens_per_second"]:,.0f} byte-tokens/s including routing; routing is
{100 * m["routing_time_share"]:.1f}% of the ensemble's time.

Compute (from the ledger): {led["gpu_hours_total"]:.4f} aggregate {led["unit"]}
({", ".join(f"{k} {v:.4f}" for k, v in led["gpu_hours"].items())}); forwards {json.dumps(led["forwards"])}.
{usd_line(led)}
{wall_lines(m)}
SOMA is a zero-order method: it is meant to beat other zero-order training at matched compute, not
backpropagation, which remains far better per GPU-hour (in the paper: 1.05 vs 1.83 nats/byte at 100 GPU-hours).
"""


def evaluate_for(
    store: Store, cfg: CampaignConfig, text: str | None, stride: int, require_all: bool, compare: str | None
) -> dict:
    """`soma eval`: long-document mode on `text`, else the test windows, paired with the campaign at `compare`;
    the document --json prints."""
    if text is not None:
        return {"schema": 1, "mode": "text", **evaluate_text(store, cfg, text, stride, require_all)}
    other = None
    if compare is not None:
        other_store = open_store(compare)
        other = (other_store, load_config(other_store))
    m = evaluate(store, cfg, other, require_all)
    return {"schema": 1, "mode": "windows", "report": f"{store.url}/eval/report.md", **m}


def show_evaluation(store: Store, m: dict, compare: str | None) -> None:
    """`soma eval`'s lines on stdout: what qualifies the numbers (a campaign still in training, the experts the seed
    stood in for), then the numbers and where the report is."""
    say_in_progress(m)
    if m["mode"] == "text":
        say_substituted(m["substituted"])
        out.print(
            f"long-document mode: ensemble {m['ensemble']['nats_per_byte']:.4f} nats/byte, seed "
            f"{m['seed']['nats_per_byte']:.4f} on {m['scored_bytes']:,} bytes; report: {m['report']}"
        )
        return
    say_substituted(m["substituted"], m.get("compare", {}).get("substituted", []), compare)
    if compare is not None:
        d = m["compare"]["this_minus_other"]
        out.print(
            f"this minus {compare}: {d['nats_per_byte']:+.4f} nats/byte [{d['ci95'][0]:+.4f}, {d['ci95'][1]:+.4f}]"
        )
    out.print(
        f"ensemble {m['ensemble']['nats_per_byte']:.4f} nats/byte, seed {m['seed']['nats_per_byte']:.4f}, "
        f"uniform {m['uniform']['nats_per_byte']:.4f}; report: {store.url}/eval/report.md"
    )


def say_in_progress(m: dict) -> None:
    """A campaign evaluated while it trains says so beside the numbers (stdout: it qualifies them)."""
    running, driver = m.get("in_progress") or [], m.get("driver_running")
    if running or driver:
        out.print(
            f"campaign still in training: {len(running)} expert(s) not ended, evaluated at their latest checkpoint "
            "(or as the seed model where they have none)"
            + (f": {', '.join(x['expert'] + ' (' + x['state'] + ')' for x in running[:8])}" if running else "")
            + (f"; {driver} holds it" if driver else ""),
            markup=False,
            soft_wrap=True,
        )


def say_substituted(mine: list[dict], theirs: list[dict] = (), compare: str | None = None) -> None:
    """A partial campaign's result says so beside the numbers (stdout: it qualifies them)."""
    for subs, whose in ((mine, ""), (theirs, f" of {compare}")):
        if subs:
            out.print(
                f"seed model stands in for {len(subs)} expert(s){whose} with no checkpoint: "
                + ", ".join(f"{s['expert']} ({s['end']}, {s['routed_windows']} windows)" for s in subs[:8])
                + (f" and {len(subs) - 8} more (eval/metrics.json's substituted)" if len(subs) > 8 else ""),
                markup=False,
                soft_wrap=True,
            )
