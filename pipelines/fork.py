"""`soma fork PARENT CHILD`: a new campaign that shares a prepared and seeded parent's data and seed model.

A baseline or control must start from the same router, shards, test windows and seed model as the run
it is compared with: same architecture, starts, data and probes (docs/results.md). A fork copies those
(checksummed files, byte for byte) and the parent's seed history and ledger records, so the child's
accounting includes the seed it started from, then binds the child to its own config: the parent's
with only training-side sections changed (train, spsa, eggroll, bptt, budget, retry, resources, eval).
`fork.json`, written last, marks a complete fork; an interrupted fork is simply run again.

A warm fork (`--warm`) also copies each expert's latest checkpoint, so its experts train on from where the parent's
stopped (a longer schedule, or a second recipe from there), and one ledger record per expert and category of what
the parent spent on them, so the child's GPU-hours count the training it continues.
"""

from __future__ import annotations

import json
import os

from pipelines.campaign_lease import holding
from pipelines.common import claim_campaign, console, load_config, open_store
from soma_cluster.accounting import FORKED_SEQ, FORKED_UNPRICED_SEQ
from soma_cluster.checkpoint import latest_meta
from soma_cluster.config import CampaignConfig, merge_trees, parse_overrides, validated
from soma_cluster.errors import SomaError
from soma_cluster.events import LOG as EVENTS
from soma_cluster.events import emit, require_seed
from soma_cluster.jobs import EXPERT_SPEND, SEED_JOB, Category, Event, expert_jobs
from soma_cluster.ledger import LOG as LEDGER
from soma_cluster.ledger import Ledger
from soma_cluster.messages import Usage
from soma_cluster.storage import Store, canonical_json, sha256
from soma_cluster.trackpoints import absolute_url

SHARED = ("router", "shards", "test", "seed")
# what defines the data and the seed model: a fork may not change it
FIXED = ("n_experts", "seed", "corpus", "router", "shards", "model", "seed_stage")
MARKER = "fork.json"


def fork_config(parent: CampaignConfig, child: CampaignConfig) -> None:
    """Refuse a child config that changes what the copied data and seed model were made with."""
    a, b = parent.model_dump(mode="json"), child.model_dump(mode="json")
    changed = [k for k in FIXED if a[k] != b[k]]
    if changed:
        raise SomaError(
            f"a fork shares its parent's data and seed model, so it cannot change {', '.join(changed)}; "
            f"change only {', '.join(k for k in a if k not in FIXED and k not in ('name', 'preset'))}"
        )


def check_fork(parent: Store, child: Store, cfg: CampaignConfig, warm: bool) -> CampaignConfig:
    """What a fork of `parent` into `child` with `cfg` refuses, by reading only (before the child's lease is taken): a
    parent with no seed, a change to what the shared data was made with, a warm fork that changes the method, a
    child that holds another campaign (or a started one). Returns the parent's config."""
    pcfg = load_config(parent)
    require_seed(parent)
    fork_config(pcfg, cfg)
    if warm and pcfg.train.method != cfg.train.method:
        raise SomaError(
            f"a warm fork trains on from {parent.url}'s checkpoints, written by train.method={pcfg.train.method}; "
            f"keep it, or fork without --warm to start {cfg.train.method} from the seed"
        )
    if claim_campaign(child, cfg, write=False) and child.exists(MARKER):
        return pcfg
    forked = any(ev["event"] == Event.FORKED for ev in child.read_log(EVENTS))
    if not forked and (child.exists(EVENTS) or child.exists(LEDGER)):
        raise SomaError(f"{child.url} holds a started campaign, not an interrupted fork; use a new campaign URL")
    return pcfg


@holding("soma fork", "child")
def fork(parent: Store, child: Store, cfg: CampaignConfig, warm: bool = False) -> dict:
    """Make `child` a campaign that starts where `parent`'s experts start (`warm`: where they stopped, from their
    latest checkpoints). Idempotent for the same config."""
    pcfg = check_fork(parent, child, cfg, warm)
    if child.exists(MARKER):
        console.print(f"{child.url} is already a fork of {parent.url}; skipping")
        return child.read_json(MARKER)
    logged = [ev for ev in child.read_log(EVENTS) if ev["event"] == Event.FORKED]
    claim_campaign(child, cfg)
    files = [p for d in SHARED for p in parent.walk(d)]
    warm_files = _latest_checkpoints(parent, pcfg) if warm else {}
    if not logged:  # files first, then the logs, then the marker: a rerun picks up where it stopped
        for rel in files:
            child.write_bytes(rel, parent.read_bytes(rel))
        for rel, data in warm_files.items():
            child.write_bytes(rel, data)
        _copy_seed_logs(parent, child, pcfg, len(files) + len(warm_files))
        if warm:
            spend = _copy_expert_spend(parent, child)
            _say_warm(parent, child, cfg, warm_files, spend)
    summary = {"parent": parent.url, "parent_digest": pcfg.digest(), "files": len(files) + len(warm_files)}
    summary["parent_url"] = absolute_url(parent.url)  # as typed, `parent` names nothing from another directory
    if warm:
        summary["warm_experts"] = len(warm_files) // 3
    child.write_json(MARKER, summary)
    warmth = f", {len(warm_files) // 3} experts' latest checkpoints and the records of what they cost" if warm else ""
    console.print(
        f"forked {parent.url} -> {child.url}: {len(files)} files (router, shards, test windows, seed) and "
        f"the records of its preprocessing and seed{warmth}"
    )
    return summary


def fork_command(parent_url: str, child_url: str, sets: list[str], warm: bool) -> dict:
    """`soma fork PARENT CAMPAIGN --set ...`: the child is checked (outside its parent, writable) and its config is
    the parent's with `sets` over it, before anything is copied."""
    parent, child = open_store(parent_url), open_store(child_url)
    if parent.local and child.local:
        a, b = os.path.realpath(parent.root), os.path.realpath(child.root)
        if b == a or b.startswith(a + os.sep) or a.startswith(b + os.sep):
            raise SomaError(
                f"soma fork {parent_url} {child_url}: the new campaign must lie outside its parent (and hold no "
                "part of it); pass a new directory beside it"
            )
    tree = merge_trees(load_config(parent).model_dump(mode="json"), parse_overrides(sets))
    cfg = validated(tree, "fork overrides")
    check_fork(parent, child, cfg, warm)
    child.check_writable()
    return fork(parent, child, cfg, warm)


def _latest_checkpoints(parent: Store, pcfg: CampaignConfig) -> dict[str, bytes]:
    """Each expert's latest checkpoint (tensors, metadata, latest.json) as the child gets it: the metadata names no
    attempt of the child's (`attempt` null, `forked_from` the parent), so the child's own first attempt is never
    settled against the parent's usage."""
    out = {}
    for job in expert_jobs(pcfg.n_experts):
        meta = latest_meta(parent, job.model_dir)
        if meta is None:
            continue  # never trained: the child starts it from the seed
        name = parent.read_json(f"{job.model_dir}/latest.json")["name"]
        body = {k: v for k, v in meta.items() if k != "checksum"}
        body.update(attempt=None, forked_from=parent.url)
        body["checksum"] = sha256(canonical_json(body))
        out[f"{job.model_dir}/{name}.safetensors"] = parent.read_bytes(f"{job.model_dir}/{name}.safetensors")
        out[f"{job.model_dir}/{name}.json"] = json.dumps(body, indent=1, sort_keys=True).encode()
        out[f"{job.model_dir}/latest.json"] = parent.read_bytes(f"{job.model_dir}/latest.json")
    return out


def _say_warm(
    parent: Store, child: Store, cfg: CampaignConfig, files: dict[str, bytes], spend: dict[tuple[int, str], Usage]
) -> None:
    """Each warm expert's step as an event of its own (status shows where it starts), and a warning for those whose
    spend already reaches the child's cap (they would end budget_exhausted at once)."""
    for rel in files:
        if rel.endswith("/latest.json"):
            name, step = rel.split("/")[1], json.loads(files[rel])["step"]
            emit(child, Event.FORKED, name, step=step, parent=parent.url)
    cap = cfg.budget.expert_gpu_hours
    if cap is None:
        return
    per = {}
    for (expert, _), u in spend.items():
        per[expert] = per.get(expert, 0.0) + u.gpu_seconds
    over = sorted(e for e, s in per.items() if s >= cap * 3600.0)
    if over:
        console.print(
            f"warning: {len(over)} expert(s) have spent budget.expert_gpu_hours={cap} already in the parent "
            f"({', '.join(f'expert-{e:04d}' for e in over[:4])}{', ...' if len(over) > 4 else ''}): they end "
            f"budget_exhausted at once; raise it (soma set {child.url} budget.expert_gpu_hours=...)",
            markup=False,
            soft_wrap=True,
        )


def _copy_expert_spend(parent: Store, child: Store) -> dict[tuple[int, str], Usage]:
    """What the parent spent on each expert, by category, as one record per expert and category (attempt -1,
    FORKED_SEQ) of what was priced, at the price that makes its dollars the parent's (the records' own prices,
    averaged by their GPU-seconds), and one (FORKED_UNPRICED_SEQ) of what was written without a price: the child's
    GPU-hours and dollars include the training its experts continue from, what had no price stays unpriced, and
    its own attempts' records never collide with the parent's ids."""
    spend: dict[tuple[int, str], Usage] = {}
    parts: dict[tuple[int, str, bool], tuple[Usage, float]] = {}  # (expert, category, priced) -> (usage, dollars)
    for rec in Ledger(parent).records():
        if rec["expert"] is not None and rec["category"] in EXPERT_SPEND:
            u, price = Usage.from_record(rec), rec.get("usd_per_hour")
            key = (rec["expert"], rec["category"])
            spend[key] = spend.get(key, Usage()) + u
            had, usd = parts.get((*key, price is not None), (Usage(), 0.0))
            parts[(*key, price is not None)] = (had + u, usd + (u.gpu_seconds / 3600.0 * price if price else 0.0))
    ledger = Ledger(child)
    for (expert, category, priced), (u, usd) in sorted(parts.items()):
        ledger.record(
            category=category,
            gpu_seconds=u.gpu_seconds,
            wall_seconds=u.wall_seconds,
            forwards=u.forwards,
            tokens=u.tokens,
            expert=expert,
            attempt=-1,
            seq=FORKED_SEQ if priced else FORKED_UNPRICED_SEQ,
            note=f"spent in {parent.url} on the checkpoint this warm fork continues from",
            usd_per_hour=(usd / u.gpu_seconds * 3600.0 if u.gpu_seconds else 0.0) if priced else None,
        )
    return spend


def _copy_seed_logs(parent: Store, child: Store, pcfg: CampaignConfig, n_files: int) -> None:
    """The seed's events (so the child knows its seed is trained) and the preprocessing and seed ledger records
    (so the child's GPU-hours include the seed it starts from), verbatim, then a `forked` event."""
    seed_events = [ev for ev in parent.read_log(EVENTS) if ev["job"] == SEED_JOB.name]
    ledger = [r for r in parent.read_log(LEDGER) if r["category"] in (Category.PREPROCESSING, Category.SEED)]
    with child.batch():
        for ev in seed_events:
            child.append(EVENTS, {k: v for k, v in ev.items() if k != "checksum"})
        for rec in ledger:
            child.append(LEDGER, {k: v for k, v in rec.items() if k != "checksum"})
        emit(child, Event.FORKED, "campaign", parent=parent.url, files=n_files, parent_digest=pcfg.digest())
