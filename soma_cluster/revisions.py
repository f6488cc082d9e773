"""Config revisions: a campaign's settings changed after soma prepare (`soma set`), as numbered immutable files.

    <campaign>/campaign.yaml              revision 0, written once by soma prepare
    <campaign>/config/rev-000001.json     {"rev": 1, "set": {"budget.campaign_gpu_hours": 2.0}, "was": {...},
                                           "by": "alice@host", "pid": 123, "at": 1796525741.1, "digest": "..."}

The config in force is campaign.yaml with every revision applied in order; its digest (`digest` of the newest
revision) is what a result made under it names. A revision is written with a create-only write (If-None-Match on
S3, a lock on a filesystem), so two operators never write the same number: the second takes the next one, checked
again against the config the first made. Nothing is ever rewritten: what changed, when and by whom stays.

Which settings may change, and why (`rule`):
- FIXED: what the data, the router, the seed model and every checkpoint were made with (n_experts, seed, corpus,
  router, shards, model, seed_stage, train.method, prepare) and the campaign's identity (name, preset). Changing them
  makes another campaign: soma prepare (or soma fork, for training-side settings) makes it.
- LIVE: budgets (GPU-hours and dollars), prices, retries, concurrency and train.updates (which may only grow): a
  running driver applies them within a heartbeat (pipelines/campaign.py), the next chunk of every expert obeys them.
- AT_START: every other training-side setting (spsa, eggroll, bptt, the rest of train, resources, eval, tracking):
  a driver reads them when it starts, so they are refused while one runs and applied by the next soma resume.
"""

from __future__ import annotations

import getpass
import math
import os
import re
import socket
import time
from dataclasses import dataclass
from enum import Enum
from typing import Any

from soma_cluster import schema
from soma_cluster.campaignfile import load_campaign_config
from soma_cluster.config import CampaignConfig, merge_trees, parse_overrides, validated
from soma_cluster.errors import ChecksumError, SomaError
from soma_cluster.jobs import SEED_JOB, Event, JobState
from soma_cluster.storage import Store, VersionConflict, canonical_json, parse_checked_json, sha256

DIR = "config"
_NAME = re.compile(r"rev-(\d{6})\.json")
WRITE_TRIES = 20  # revisions taken by others at once before giving up


class Rule(str, Enum):
    FIXED = "fixed"
    LIVE = "live"
    AT_START = "at_start"


FIXED_SECTIONS = ("n_experts", "seed", "corpus", "router", "shards", "model", "seed_stage", "prepare", "name", "preset")
LIVE_KEYS = (
    "budget.expert_gpu_hours",
    "budget.campaign_gpu_hours",
    "budget.expert_usd",
    "budget.campaign_usd",
    "budget.grace_gpu_seconds",
    "prices.gpu",
    "prices.accelerator",
    "prices.spot",
    "prices.cpu_hour",
    "budget.pool_policy",
    "retry.max_retries",
    "retry.backoff_s",
    "retry.backoff_max_s",
    "retry.heartbeat_timeout_s",
    "retry.infra_wait_s",
    "resources.max_pending",
    "resources.max_actors",
    "train.updates",
)


def rule(key: str) -> Rule:
    if key.split(".")[0] in FIXED_SECTIONS or key == "train.method":
        return Rule.FIXED
    return Rule.LIVE if key in LIVE_KEYS else Rule.AT_START


@dataclass(frozen=True)
class Revision:
    rev: int
    set: dict[str, Any]  # dotted key -> new value
    was: dict[str, Any]  # dotted key -> the value it replaced
    by: str
    pid: int
    at: float  # Unix seconds, the writer's clock (a record, never compared across hosts)
    digest: str  # the digest of the config in force from this revision on

    def as_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("rev", "set", "was", "by", "pid", "at", "digest")}

    def line(self) -> str:
        return ", ".join(f"{k}: {_v(self.was.get(k))} -> {_v(v)}" for k, v in self.set.items())


def _v(value: Any) -> str:
    return "unset" if value is None else str(value)


def flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"budget": {"campaign_gpu_hours": 2}} -> {"budget.campaign_gpu_hours": 2}."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v and schema.field_at(CampaignConfig, f"{prefix}{k}") is None:
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def value_at(cfg: CampaignConfig, key: str) -> Any:
    node: Any = cfg.model_dump(mode="json")
    for part in key.split("."):
        node = node[part]
    return node


def revisions(store: Store) -> list[Revision]:
    """Every revision of the campaign, in order; a damaged one is an error naming it (nothing is skipped)."""
    out = []
    for name in sorted(n for n in store.listdir(DIR) if _NAME.fullmatch(n)):
        rel = f"{DIR}/{name}"
        try:
            doc = parse_checked_json(store.read_bytes(rel), f"{store.url}/{rel}")
        except ChecksumError:
            raise ChecksumError(
                f"{store.url}/{rel} is damaged (it fails its checksum): restore it from a backup; it cannot be "
                "deleted, since the revisions after it, and the config in force, build on it"
            ) from None
        out.append(Revision(**{k: doc[k] for k in ("rev", "set", "was", "by", "pid", "at", "digest")}))
    for i, r in enumerate(out, start=1):
        if r.rev != i:
            raise SomaError(f"{store.url}/{DIR}: revision {i} is missing (found {r.rev}); restore it from a backup")
    return out


def apply(base: CampaignConfig, revs: list[Revision], origin: str = "config revisions") -> CampaignConfig:
    """campaign.yaml's config with `revs` applied in order."""
    tree = base.model_dump(mode="json")
    for r in revs:
        tree = merge_trees(tree, parse_overrides([f"{k}={_yaml(v)}" for k, v in r.set.items()]))
    return validated(tree, origin) if revs else base


def _yaml(value: Any) -> str:
    import json

    return "null" if value is None else json.dumps(value)


def in_force(store: Store, base: CampaignConfig) -> tuple[CampaignConfig, list[Revision]]:
    revs = revisions(store)
    return apply(base, revs, f"{store.url}/{DIR}"), revs


def check(
    current: CampaignConfig, items: list[str], driver_running: bool, origin: str = "soma set"
) -> tuple[dict[str, Any], CampaignConfig]:
    """The changes `items` (key=value, as --set) make to the config in force, checked: (flat changes, new config).
    Every refusal names the setting, why, and what to do instead."""
    if not items:
        raise SomaError("no change given; pass KEY=VALUE, e.g. budget.campaign_gpu_hours=2.0")
    changes = flat(parse_overrides(items))
    for key, value in changes.items():
        section = CampaignConfig.model_fields.get(key)
        if section is not None and schema.field_at(CampaignConfig, key) is None and rule(key) != Rule.FIXED:
            example = next(iter(section.annotation.model_fields))
            raise SomaError(f"{key} is a section, not a setting; set its fields, e.g. {key}.{example}=VALUE")
        if value is None and _empty(items, key):
            raise SomaError(f"{key}= has no value; pass one (null unsets a setting that may be unset)")
        if schema.field_at(CampaignConfig, key) is None and rule(key) != Rule.FIXED:
            guess = schema.nearest(CampaignConfig, key)
            raise SomaError(
                f"{key} is not a setting; {f'did you mean {guess}? ' if guess else ''}docs/config.md lists them"
            )
        if rule(key) == Rule.FIXED:
            raise SomaError(
                f"{key} cannot change: the campaign's data, router, seed model and checkpoints were made with it; "
                "prepare a new campaign for it (soma prepare NEW --set ...), or soma fork NEW for training-side "
                "settings"
            )
        if rule(key) == Rule.AT_START and driver_running:
            raise SomaError(
                f"{key} is read when a driver starts, and one is running now: stop it (Ctrl-C or SIGTERM; it keeps "
                f"its work), then soma set and soma resume; live settings are {', '.join(LIVE_KEYS)}"
            )
        if isinstance(value, float) and not math.isfinite(value):
            raise SomaError(f"{key}={value}: pass a finite number")
    new = validated(merge_trees(current.model_dump(mode="json"), parse_overrides(items)), origin)
    if new.train.updates < current.train.updates:
        raise SomaError(
            f"train.updates can only grow ({current.train.updates} -> {new.train.updates} given): experts past the "
            "new target have trained already; to stop them sooner, lower budget.expert_gpu_hours"
        )
    same = [k for k in changes if value_at(new, k) == value_at(current, k)]
    if len(same) == len(changes):
        raise SomaError(f"{', '.join(same)} already {'is' if len(same) == 1 else 'are'} as given; nothing to change")
    return {k: value_at(new, k) for k in changes if k not in same}, new


def _empty(items: list[str], key: str) -> bool:
    """Whether `key` was given as `key=` with nothing after it (YAML would read null: an unset budget, unasked)."""
    return any(i.split("=", 1)[0].strip() == key and not i.split("=", 1)[1].strip() for i in items if "=" in i)


def record(store: Store, base: CampaignConfig, items: list[str], driver_running: bool) -> Revision:
    """Write the next revision (create-only); if another operator took that number meanwhile, check the change
    again against the config their revision made and take the next number."""
    who = f"{_user()}@{socket.gethostname()}"
    for _ in range(WRITE_TRIES):
        current, revs = in_force(store, base)
        changes, new = check(current, items, driver_running)
        rev = Revision(
            rev=len(revs) + 1,
            set=changes,
            was={k: value_at(current, k) for k in changes},
            by=who,
            pid=os.getpid(),
            at=time.time(),
            digest=new.digest(),
        )
        body = rev.as_json()
        body["checksum"] = sha256(canonical_json(body))
        try:
            store.write_if(f"{DIR}/rev-{rev.rev:06d}.json", canonical_json(body), None)
        except VersionConflict:
            continue
        return rev
    raise SomaError(f"{store.url}: {WRITE_TRIES} revisions were written by others while this one tried; try again")


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return f"uid{os.getuid()}"


def _cap(hours: float | None) -> float:
    return math.inf if hours is None else hours


def grew(was: CampaignConfig, now: CampaignConfig) -> bool:
    """Whether `now` gives experts more to train than `was`: more updates, or a larger budget (unset: unlimited)."""
    caps = ("expert_gpu_hours", "campaign_gpu_hours", "expert_usd", "campaign_usd")
    return now.train.updates > was.train.updates or any(
        _cap(getattr(now.budget, k)) > _cap(getattr(was.budget, k)) for k in caps
    )


def to_reopen(ended: dict[str, tuple[JobState, int]], was: CampaignConfig, now: CampaignConfig) -> list[str]:
    """Ended jobs (name -> (end state, step)) that the change from `was` to `now` lets train on, from their latest
    checkpoint: finished experts below the new train.updates, and budget-stopped jobs (the seed too) below their
    target when a budget or train.updates grew (the scheduler ends them again, at once, if the new budget still cannot
    cover a start). Converged and failed experts are not reopened: more budget does not change why they ended."""
    out = []
    for name, (state, step) in sorted(ended.items()):
        target = now.seed_stage.updates if name == SEED_JOB.name else now.train.updates
        if step >= target:
            continue
        if state == JobState.FINISHED or (state == JobState.BUDGET_EXHAUSTED and grew(was, now)):
            out.append(name)
    return out


def applied(events: list[dict]) -> int:
    """The newest revision a driver has applied, from the campaign's events (0: none)."""
    return max((int(ev["rev"]) for ev in events if ev["event"] == Event.CONFIG_REVISED), default=0)


def config_in_force(store: Store) -> CampaignConfig:
    """The config a campaign runs under now: campaign.yaml and every revision (see the module docstring)."""
    return in_force(store, load_campaign_config(store))[0]
