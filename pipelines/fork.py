"""`soma fork PARENT CHILD`: a new campaign that shares a prepared and seeded parent's data and seed model.

A baseline or control must start from the same router, shards, test windows and seed model as the run
it is compared with: same architecture, starts, data and probes (docs/results.md). A fork copies those
(checksummed files, byte for byte) and the parent's seed history and ledger records, so the child's
accounting includes the seed it started from, then binds the child to its own config: the parent's
with only training-side sections changed (train, spsa, eggroll, bptt, budget, retry, resources, eval).
`fork.json`, written last, marks a complete fork; an interrupted fork is simply run again.
"""

from __future__ import annotations

from pipelines.campaign_lease import holding
from pipelines.common import claim_campaign, console, load_config
from soma_cluster.config import CampaignConfig
from soma_cluster.errors import SomaError
from soma_cluster.events import LOG as EVENTS
from soma_cluster.events import emit, require_seed
from soma_cluster.jobs import SEED_JOB, Category, Event
from soma_cluster.ledger import LOG as LEDGER
from soma_cluster.storage import Store

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


@holding("soma fork", "child")
def fork(parent: Store, child: Store, cfg: CampaignConfig) -> dict:
    """Make `child` a campaign that starts where `parent`'s experts start. Idempotent for the same config."""
    pcfg = load_config(parent)
    require_seed(parent)
    fork_config(pcfg, cfg)
    if claim_campaign(child, cfg, write=False) and child.exists(MARKER):
        console.print(f"{child.url} is already a fork of {parent.url}; skipping")
        return child.read_json(MARKER)
    logged = [ev for ev in child.read_log(EVENTS) if ev["event"] == Event.FORKED]
    if not logged and (child.exists(EVENTS) or child.exists(LEDGER)):
        raise SomaError(f"{child.url} holds a started campaign, not an interrupted fork; use a new campaign URL")
    claim_campaign(child, cfg)
    files = [p for d in SHARED for p in parent.walk(d)]
    if not logged:  # files first, then the logs, then the marker: a rerun picks up where it stopped
        for rel in files:
            child.write_bytes(rel, parent.read_bytes(rel))
        _copy_seed_logs(parent, child, pcfg, len(files))
    summary = {"parent": parent.url, "parent_digest": pcfg.digest(), "files": len(files)}
    child.write_json(MARKER, summary)
    console.print(
        f"forked {parent.url} -> {child.url}: {len(files)} files (router, shards, test windows, seed) and "
        f"the records of its preprocessing and seed"
    )
    return summary


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
