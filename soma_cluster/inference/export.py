"""`soma export`: the routed ensemble as a self-contained directory that RoutedLM.load reads without the campaign
and without Ray (routing.open_source tells it from a campaign).

    <dir>/soma-export.json     format and version, the campaign's config, each expert's step, the experts the seed
                               stands in for, the dtype, and the sha256 of every other file (checksummed itself)
    <dir>/weights.safetensors  each expert's tensors under their names (soma_cluster/model.py's Layout and
                               tensor_name): expert-0007.blocks.0.lstm.weight_ih (4d, d), ..., expert-0007.ln_f.weight;
                               its head expert-0007.embed.weight (256, e), or one embed.weight when every expert shares
                               it; the seed model's as seed.*. The file's metadata says the model's shape (soma.model)
                               and which experts it holds. Weights only: no Adam moments, no schedule state
    <dir>/router/              the campaign's router files, as they are (router.json, arrays.safetensors,
                               vocabulary.json)
    <dir>/README.md            the model card: Hugging Face metadata (license, library_name, tags, datasets,
                               model-index with the test metrics and the compute), then data by source, recipe, test
                               losses, compute, limits, and how to read the weights without soma

Format 1 (soma-cluster before the tensors had names) held flat vectors: experts.index, experts.body (P, M),
experts.head, seed.body, seed.head. It is still read (read_export), so an export made then loads and serves.

A local export is written into a hidden sibling directory and renamed into place at the end, so a killed export
leaves no directory a reader could take for an export (the next export removes the hidden one of a dead process).
On S3 the files are written first and soma-export.json last: without it there is no export.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import uuid
from dataclasses import dataclass

import torch
import yaml
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from soma_cluster.config import CampaignConfig, versions
from soma_cluster.diskerrors import what_happened
from soma_cluster.ensemble import CampaignModels, Substitute
from soma_cluster.errors import ChecksumError, SomaError
from soma_cluster.jobs import SEED_JOB, Job, expert_name
from soma_cluster.lease import LEASE_FILES
from soma_cluster.ledger import Ledger
from soma_cluster.model import EMBED_TENSOR, LN_EPS, Layout, tensor_name
from soma_cluster.revisions import revisions
from soma_cluster.router import Router, load_router
from soma_cluster.storage import Store, pid_alive, sha256

EXPORT_FILE = "soma-export.json"
FORMAT = "soma-export"
VERSION = 2  # what this code writes and the newest it reads (1: flat vectors, read too)
WEIGHTS = "weights.safetensors"
ROUTER_FILES = ("router/router.json", "router/arrays.safetensors", "router/vocabulary.json")
CARD = "README.md"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
TMP_MARK = ".soma-export-"  # hidden sibling: .<name>.soma-export-<pid>-<hex>
SEED = "seed"  # the seed model's tensors: seed.blocks.0.lstm.weight_ih, ..., seed.embed.weight


def _tensors(cfg: CampaignConfig, models: CampaignModels, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every expert's and the seed's tensors under their public names (module docstring), in `dtype`."""
    layout = Layout(cfg.model)
    present = sorted(models.checkpoints)
    heads = [models.checkpoints[e].tensors["head"] for e in present]
    shared = bool(heads) and all(torch.equal(h, heads[0]) for h in heads)
    out: dict[str, torch.Tensor] = {}
    for e in present:
        out.update({f"{expert_name(e)}.{k}": v for k, v in layout.named(models.checkpoints[e].tensors["body"]).items()})
        if not shared:
            out[f"{expert_name(e)}.{EMBED_TENSOR}"] = models.checkpoints[e].tensors["head"]
    if shared:
        out[EMBED_TENSOR] = heads[0]
    seed = models.seed.tensors
    out.update({f"{SEED}.{k}": v for k, v in layout.named(seed["body"]).items()})
    out[f"{SEED}.{EMBED_TENSOR}"] = seed["head"]
    # copies: views of one vector (and a head shared with the seed's) cannot be saved beside each other
    return {k: v.to(dtype).clone().contiguous() for k, v in out.items()}


def _metadata(cfg: CampaignConfig, models: CampaignModels) -> dict[str, str]:
    """The safetensors header's metadata (text only): enough for a reader outside soma to rebuild the forward."""
    return {
        "format": "pt",
        "soma.export": str(VERSION),
        "soma.model": json.dumps(cfg.model.model_dump(mode="json"), sort_keys=True),
        "soma.experts": ",".join(expert_name(e) for e in sorted(models.checkpoints)),
        "soma.layer_norm_eps": repr(LN_EPS),
    }


def checkpoint_bytes(store: Store, models: CampaignModels) -> int:
    """What the same models take as checkpoints (tensors with Adam moments, and their metadata)."""
    total = 0
    for directory, ck in [(Job(e).model_dir, ck) for e, ck in models.checkpoints.items()] + [
        (SEED_JOB.model_dir, models.seed)
    ]:
        for suffix in (".safetensors", ".json"):
            total += store.fs.size(store.full(f"{directory}/{ck.name}{suffix}"))
    return total


def export(
    src: Store, cfg: CampaignConfig, models: CampaignModels, dest: Store, dtype: str = "float32", license: str = "other"
) -> dict:
    """Write the export of `models` (load_models of `src`) to `dest`, which must not hold anything yet; `license`:
    the model card's (a Hugging Face license identifier; `other` says the training data's terms apply)."""
    if dtype not in DTYPES:
        raise SomaError(f"dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    check_license(license)
    check_target(dest)
    blobs = {WEIGHTS: st_save(_tensors(cfg, models, DTYPES[dtype]), metadata=_metadata(cfg, models))}
    for rel in ROUTER_FILES:
        blobs[rel] = src.read_bytes(rel)
    metrics = src.read_json("eval/metrics.json") if src.exists("eval/metrics.json") else None
    sources = (src.read_json("shards/manifest.json").get("corpus") or {}) if src.exists("shards/manifest.json") else {}
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "written_by": versions(),
        "campaign": {
            "url": os.path.abspath(src.url) if src.local else src.url,
            "name": cfg.name,
            "config_digest": cfg.digest(),
            "config_revision": len(revisions(src)),
        },
        "config": cfg.model_dump(mode="json"),
        "dtype": dtype,
        "steps": {expert_name(e): int(ck.meta["state"]["step"]) for e, ck in sorted(models.checkpoints.items())},
        "seed_step": int(models.seed.meta["state"]["step"]),
        "substituted": [
            {"expert": expert_name(s.expert), "end": s.end, "step": s.step, "reason": s.reason}
            for s in models.substituted.values()
        ],
    }
    totals = Ledger(src).totals()
    card = model_card(cfg, manifest, sources, metrics, {**totals.as_dict(), "usd_priced": totals.usd_priced}, license)
    blobs[CARD] = card.encode("utf-8", "backslashreplace")  # a path that is not UTF-8 shows as \\xNN
    manifest["files"] = {rel: sha256(b) for rel, b in blobs.items()}
    _write(dest, blobs, manifest)
    size = sum(len(b) for b in blobs.values())
    ck_size = checkpoint_bytes(src, models) + sum(len(blobs[r]) for r in ROUTER_FILES)
    return {
        "export": os.path.abspath(dest.url) if dest.local else dest.url,
        "bytes": size,
        "checkpoint_bytes": ck_size,
        "ratio": size / ck_size if ck_size else None,
        "dtype": dtype,
        "experts": len(models.checkpoints),
        "substituted": [s["expert"] for s in manifest["substituted"]],
    }


def check_target(dest: Store) -> None:
    """An export goes to a new (or empty) directory: anything already there is someone's and is never replaced. (What
    an export killed while it wrote into an empty mount point left, its files without a manifest, is replaced.)"""
    if dest.local:
        root = os.path.abspath(dest.root)
        if root == os.path.sep or not dest.url.strip():
            raise SomaError(
                f"{dest.url or repr(dest.url)} is not a directory an export can be (the root, or empty); "
                "pass a new directory to soma export"
            )
        above = next((a for a in _ancestors(root) if os.path.lexists(a) and not os.path.isdir(a)), None)
        if above is not None:
            raise SomaError(
                f"{above} is a file, so {root} cannot be a directory; pass another directory to soma export"
            )
        if os.path.lexists(root) and not os.path.isdir(root):
            raise SomaError(f"{root} is a file; pass a new directory for the export (soma export)")
        names = os.listdir(root) if os.path.isdir(root) else []
    else:
        names = dest.listdir("")
    if lease := sorted(set(names) & set(LEASE_FILES)):
        raise SomaError(
            f"{dest.url} holds a driver's lease ({', '.join(lease)}): another driver holds "
            "or prepares a campaign there; pass a new directory to soma export"
        )
    if names and not set(names) <= UNFINISHED:
        what = "an export" if EXPORT_FILE in names else "files"
        raise SomaError(
            f"{dest.url} already holds {what} ({', '.join(sorted(names)[:3])}); pass a new directory to soma export, "
            "or remove that one first"
        )


def _ancestors(path: str) -> list[str]:
    out = []
    while (up := os.path.dirname(path)) != path:
        out.append(up)
        path = up
    return out


# what an export writes before its manifest: found without one, they are an unfinished export, replaced
UNFINISHED = {WEIGHTS, "router", CARD}


def _write(dest: Store, blobs: dict[str, bytes], manifest: dict) -> None:
    """A local export is staged beside its target and renamed into place; where that cannot be (an empty mount point
    is busy; an object store has no rename), the files go in directly and the manifest last, so a half-written
    export is no export."""
    root = os.path.realpath(os.path.abspath(dest.root)) if dest.local else ""
    if not dest.local or (os.path.isdir(root) and os.path.ismount(root)):
        direct = dest if not dest.local else Store(root)
        for rel, blob in blobs.items():
            direct.write_bytes(rel, blob)
        direct.write_json(EXPORT_FILE, manifest)
        return
    parent, name = os.path.split(root)
    os.makedirs(parent, exist_ok=True)
    sweep_temps(parent)
    tmp = os.path.join(parent, f".{name}{TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        staging = Store(tmp)
        for rel, blob in blobs.items():
            staging.write_bytes(rel, blob)
        staging.write_json(EXPORT_FILE, manifest)
        if os.path.isdir(root) and set(os.listdir(root)) - {EXPORT_FILE} and set(os.listdir(root)) <= UNFINISHED:
            shutil.rmtree(root)  # an unfinished export (no manifest): replaced
        try:
            os.rename(tmp, root)  # onto nothing, or onto an empty directory
        except OSError:
            check_target(dest)  # someone wrote there meanwhile: say so, as for any occupied target
            raise
    except OSError as exc:
        raise SomaError(
            f"cannot write the export to {root}: {what_happened(exc) or exc.strerror or exc}; nothing of it was left "
            "there: free space or fix its permissions, or pass another directory to soma export"
        ) from None
    finally:
        if os.path.lexists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


_STAGING = re.compile(rf"^\..+{re.escape(TMP_MARK)}(\d+)-[0-9a-f]{{8}}$")


def sweep_temps(parent: str) -> list[str]:
    """Remove the hidden staging directories, beside any export target in `parent`, of exports whose process is gone
    (killed mid-export)."""
    removed = []
    for entry in os.listdir(parent):
        m = _STAGING.match(entry)
        if m and not pid_alive(int(m.group(1))):
            shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)
            removed.append(entry)
    return removed


# -- reading ----------------------------------------------------------------------------------------------------
def read_manifest(store: Store) -> dict:
    try:
        manifest = store.read_json(EXPORT_FILE)
    except ChecksumError:
        raise ChecksumError(
            f"{store.url}/{EXPORT_FILE} is damaged (not valid JSON, or edited: it fails its checksum); export again "
            "(soma export CAMPAIGN DIR)"
        ) from None
    version = manifest.get("version")
    if manifest.get("format") != FORMAT or not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise SomaError(f"{store.url}/{EXPORT_FILE} is not a soma export manifest; make one with soma export")
    if version > VERSION:
        raise SomaError(
            f"{store.url} is export format {version}, written by soma-cluster "
            f"{(manifest.get('written_by') or {}).get('soma-cluster', '?')}; this soma-cluster reads format {VERSION} "
            "and older: upgrade soma-cluster, or export again with this one"
        )
    missing = [k for k in ("files", "config", "steps", "substituted", "dtype") if k not in manifest]
    if missing or not isinstance(manifest["files"], dict):
        raise SomaError(f"{store.url}/{EXPORT_FILE} lacks {', '.join(missing) or 'files'}; export again")
    return manifest


def read_blob(store: Store, manifest: dict, rel: str) -> bytes:
    try:
        blob = store.read_bytes(rel)
    except FileNotFoundError:
        raise SomaError(f"{store.url}/{rel} is missing; export again (soma export CAMPAIGN DIR)") from None
    if sha256(blob) != manifest["files"].get(rel):
        raise ChecksumError(
            f"{store.url}/{rel} fails its checksum (truncated or corrupt); export again (soma export CAMPAIGN DIR)"
        )
    return blob


@dataclass
class Exported:
    """What an export holds, checked: the arguments of a RoutedLM (lm.py builds it)."""

    config: CampaignConfig
    router: Router
    experts: dict[int, tuple[torch.Tensor, torch.Tensor]]
    seed: tuple[torch.Tensor, torch.Tensor]
    substituted: dict[int, Substitute]
    steps: dict[int, int]


def export_config(store: Store, manifest: dict) -> CampaignConfig:
    """The campaign config an export was made with, checked by this soma-cluster's schema."""
    try:
        return CampaignConfig.model_validate(manifest["config"])
    except (KeyError, TypeError, ValueError) as exc:
        first = str(exc).splitlines()[1:2] or [str(exc)]
        raise SomaError(
            f"{store.url}/{EXPORT_FILE}: its config does not validate here ({first[0].strip()}); export again"
        ) from None


def read_export(store: Store, manifest: dict | None = None) -> Exported:
    """An export's models, every file checked against its sha256 first (the model card too); `manifest`: its
    read_manifest, when the caller has it."""
    manifest = read_manifest(store) if manifest is None else manifest
    for rel in manifest["files"]:
        if rel != WEIGHTS:  # read (and checked) below; the router's files are read again by load_router
            read_blob(store, manifest, rel)
    cfg = export_config(store, manifest)
    blob = read_blob(store, manifest, WEIGHTS)
    try:
        t = st_load(blob)
    except SafetensorError:
        raise ChecksumError(f"{store.url}/{WEIGHTS} is not a safetensors file; export again") from None
    try:
        index, experts, seed = (_named if manifest["version"] >= 2 else _flat)(t, cfg)
    except (KeyError, IndexError, ValueError) as exc:
        said = (
            f" (it lacks {exc.args[0]})" if isinstance(exc, KeyError) and exc.args else f" ({exc})" if exc.args else ""
        )
        raise SomaError(f"{store.url}/{WEIGHTS} does not hold an export's tensors{said}; export again") from None
    try:
        subs = {}
        for s in manifest["substituted"]:
            e = _expert_number(s["expert"], cfg.n_experts)
            subs[e] = Substitute(e, s["end"], s["step"], s["reason"])
        steps = {_expert_number(n, cfg.n_experts): int(v) for n, v in manifest["steps"].items()}
    except (KeyError, TypeError, ValueError):
        raise SomaError(f"{store.url}/{EXPORT_FILE} names experts it cannot hold; export again") from None
    if set(index) & set(subs) or any(not 0 <= e < cfg.n_experts for e in index):
        raise SomaError(f"{store.url}: its weights and its manifest disagree about the experts; export again")
    return Exported(cfg, load_router(store), experts, seed, subs, steps)


_EXPERT_TENSOR = re.compile(r"^(expert-\d{4,})\.(.+)$")


def _named(t: dict[str, torch.Tensor], cfg: CampaignConfig) -> tuple[list[int], dict, tuple]:
    """Format 2: each expert's body rebuilt from its named tensors (Layout.flat), its head its own or the shared one.
    KeyError naming a missing tensor, ValueError one of another shape (or a name no expert has)."""
    layout = Layout(cfg.model)
    by_expert: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in t.items():
        if m := _EXPERT_TENSOR.match(key):
            by_expert.setdefault(m.group(1), {})[m.group(2)] = value
    experts = {}
    for name, tensors in sorted(by_expert.items()):
        head = tensors.pop(EMBED_TENSOR, None)
        if head is None:
            head = t[EMBED_TENSOR]
        try:
            body = layout.flat(tensors)
        except KeyError as exc:
            raise KeyError(f"{name}.{exc.args[0]}") from None
        if extra := sorted(set(tensors) - set(layout.named(body))):
            raise ValueError(f"{name}.{extra[0]} is no tensor of this model")
        experts[_expert_number(name, cfg.n_experts)] = (body, head)
    seed_tensors = {k[len(SEED) + 1 :]: v for k, v in t.items() if k.startswith(f"{SEED}.")}
    try:
        seed = (layout.flat(seed_tensors), seed_tensors[EMBED_TENSOR])
    except KeyError as exc:
        raise KeyError(f"{SEED}.{exc.args[0]}") from None
    return sorted(experts), experts, seed


def _flat(t: dict[str, torch.Tensor], cfg: CampaignConfig) -> tuple[list[int], dict, tuple]:
    """Format 1: flat vectors, experts.index naming the rows of experts.body and experts.head."""
    index = [int(e) for e in t["experts.index"].tolist()]
    heads = t["experts.head"]
    experts = {e: (t["experts.body"][i], heads[i if len(heads) > 1 else 0]) for i, e in enumerate(index)}
    return index, experts, (t["seed.body"], t["seed.head"])


def _expert_number(name: str, n_experts: int) -> int:
    """expert-0007 -> 7, refused unless it is one of the campaign's experts."""
    m = re.fullmatch(r"expert-(\d{4,})", name)
    if m is None or int(m.group(1)) >= n_experts:
        raise ValueError(name)
    return int(m.group(1))


# -- the model card ---------------------------------------------------------------------------------------------
LICENSE = re.compile(r"^[a-z0-9][a-z0-9.+-]{0,63}$")  # a Hugging Face license identifier: apache-2.0, cc-by-4.0
TAGS = ["soma", "byte-level", "lstm", "mixture-of-experts", "routed-ensemble", "zero-order", "spsa"]


def check_license(license: str) -> None:
    if not isinstance(license, str) or not LICENSE.match(license):
        raise SomaError(
            f"--license {license!r}: give a license identifier as Hugging Face lists them (apache-2.0, mit, "
            "cc-by-4.0, ...), or other (the training data's terms)"
        )


def dataset_id(cfg: CampaignConfig) -> str:
    """The card's name for the training corpus: the built-in one's, else local/<its directory's name> (a path is
    this machine's: the card names no path in its metadata)."""
    source = cfg.corpus.source
    if source == "builtin":
        return "soma-cluster/builtin-corpus"
    base = re.sub(r"[^A-Za-z0-9._-]+", "-", os.path.basename(source.rstrip("/"))).strip("-.")
    return f"local/{base or 'corpus'}"


def card_metadata(cfg: CampaignConfig, metrics: dict | None, ledger: dict, license: str) -> dict:
    """The YAML a Hugging Face model card starts with: license, library_name, tags, datasets, and (once the campaign
    was evaluated) model-index with the test losses and the compute spent (dollars, and the GPU-hours no price
    covered, where the campaign has prices)."""
    meta: dict = {"license": license}
    if license == "other":
        meta["license_name"] = "training-data-terms"  # the Hub asks other licenses for a name
    meta |= {"library_name": "soma-cluster", "pipeline_tag": "text-generation", "tags": TAGS}
    meta["datasets"] = [dataset_id(cfg)]
    if metrics and metrics.get("ensemble"):
        meta["model-index"] = [
            {
                "name": cfg.name,
                "results": [
                    {
                        "task": {"type": "text-generation", "name": "Byte-level language modeling"},
                        "dataset": {
                            "type": dataset_id(cfg),
                            "name": f"{cfg.name}: held-out test documents",
                            "split": "test",
                        },
                        "metrics": _card_metrics(metrics, ledger),
                    }
                ],
            }
        ]
    return meta


def _card_metrics(metrics: dict, ledger: dict) -> list[dict]:
    ens, seed = metrics["ensemble"], metrics.get("seed") or {}
    lo, hi = ens.get("ci95", [None, None])
    bits = float(ens["nats_per_byte"]) / math.log(2)
    out = [
        {"type": "nats_per_byte", "value": float(ens["nats_per_byte"]), "name": "Test loss (nats/byte)"},
        {"type": "bits_per_byte", "value": float(ens.get("bits_per_byte", bits)), "name": "Test loss (bits/byte)"},
    ]
    if lo is not None:
        out[0]["args"] = {"ci95": [float(lo), float(hi)], "windows": metrics.get("windows")}
    if seed.get("nats_per_byte") is not None:
        out.append(
            {
                "type": "seed_nats_per_byte",
                "value": float(seed["nats_per_byte"]),
                "name": "Seed model test loss (nats/byte)",
            }
        )
    unit = ledger.get("unit", "GPU-hours")
    out.append({"type": "gpu_hours", "value": float(ledger.get("gpu_hours_total", 0.0)), "name": f"Compute ({unit})"})
    if ledger.get("usd_priced"):
        out.append({"type": "usd", "value": float(ledger.get("usd_total", 0.0)), "name": "Cost (USD)"})
        if ledger.get("unpriced_gpu_hours"):
            out.append(
                {
                    "type": "unpriced_gpu_hours",
                    "value": float(ledger["unpriced_gpu_hours"]),
                    "name": f"Unpriced compute ({unit})",
                }
            )
    return out


def _dollars(ledger: dict) -> str:
    if not ledger.get("usd_priced"):
        return " No prices were set (`prices.*`): no dollars."
    unpriced = ledger.get("unpriced_gpu_hours") or 0.0
    rest = f"; {unpriced:.4f} GPU-hours ran without a price and are not in it" if unpriced else ""
    return f" ${ledger.get('usd_total', 0.0):,.2f} at the prices in force when each record was written{rest}."


def _weight_rows(cfg: CampaignConfig) -> str:
    layout = Layout(cfg.model)
    rows = [(tensor_name(s.name), s.shape) for s in layout.specs if not s.name.startswith("b") or s.name[1] == "0"]
    rows = [(n.replace("blocks.0.", "blocks.B."), shape) for n, shape in rows] + [
        (EMBED_TENSOR, (256, cfg.model.embed_dim))
    ]
    text = [f"| `{n}` | {' x '.join(map(str, shape))} |" for n, shape in rows]
    return "\n".join(text) + f"\n\n(B = 0 .. {cfg.model.depth - 1}.)"


def _head_text(cfg: CampaignConfig) -> str:
    if cfg.model.head == "shared_frozen":
        return "Every expert shares one, `embed.weight` (the seed model's is `seed.embed.weight`)."
    return "Each expert has its own, `expert-E.embed.weight` (the seed model's is `seed.embed.weight`)."


def _loss(m: dict | None) -> str:
    if not m:
        return "n/a"
    lo, hi = m.get("ci95", [math.nan, math.nan])
    return f"{m['nats_per_byte']:.4f} [{lo:.4f}, {hi:.4f}] nats/byte ({m['nats_per_byte'] / math.log(2):.4f} bits/byte)"


CARD_SOURCES = 20  # the model card's table of sources lists the largest this many (10,000 labels are not a table)


def model_card(
    cfg: CampaignConfig, manifest: dict, corpus: dict, metrics: dict | None, ledger: dict, license: str = "other"
) -> str:
    """README.md of an export: Hugging Face's metadata (card_metadata) between --- lines, then what the model is,
    its data, how it was trained, how good it is, what it cost, and how to read its weights."""
    sources = corpus.get("sources") or {}
    total = sum(sources.values()) or 1
    ranked = sorted(sources.items(), key=lambda kv: (-kv[1], kv[0]))  # the largest CARD_SOURCES, the rest in a row
    cells = [(k.replace("|", "\\|"), v) for k, v in ranked[:CARD_SOURCES]]
    if len(ranked) > CARD_SOURCES:
        cells.append((f"{len(ranked) - CARD_SOURCES:,} more sources", sum(v for _, v in ranked[CARD_SOURCES:])))
    src_rows = "\n".join(f"| {k} | {v:,} | {100 * v / total:.1f}% |" for k, v in cells) or "| - | - | - |"
    subs = manifest["substituted"]
    sub_text = (
        f"\n**Partial campaign: {len(subs)} of {cfg.n_experts} experts have no checkpoint; the seed model stands in "
        f"for them** ({', '.join(s['expert'] + ' (' + s['end'] + ')' for s in subs)}). `RoutedLM.seed_fallback` and "
        "every score's `seed_fallback` name them.\n"
        if subs
        else ""
    )
    if metrics:
        evaluation = (
            f"Test set of the campaign ({metrics['windows']} windows of {cfg.eval.window_bytes} bytes from "
            f"{metrics['documents']} held-out documents, {metrics['scored_bytes']:,} scored bytes; 95% intervals from "
            "a paired document bootstrap):\n\n| model | test loss |\n|---|---|\n"
            f"| routed ensemble | {_loss(metrics.get('ensemble'))} |\n"
            f"| seed model (N = 1) | {_loss(metrics.get('seed'))} |\n"
            "| uniform over bytes | 5.5452 nats/byte (8 bits/byte) |\n"
        )
        if not metrics.get("complete", True):
            evaluation += "\nThat evaluation ran on a partial or still-training campaign (its report says which).\n"
    else:
        evaluation = "Not evaluated: `soma eval CAMPAIGN` before exporting puts the test losses here.\n"
    steps = manifest["steps"].values()
    gpu = ledger.get("gpu_hours", {})
    meta = yaml.safe_dump(card_metadata(cfg, metrics, ledger, license), sort_keys=False, allow_unicode=True, width=1000)
    return f"""---
{meta}---

# {cfg.name}: a SOMA routed ensemble of {cfg.n_experts} byte-level LSTM experts

Exported by soma-cluster {manifest["written_by"].get("soma-cluster", "?")} from `{manifest["campaign"]["url"]}`
(config digest {manifest["campaign"]["config_digest"]}), weights in {manifest["dtype"]}.
{sub_text}
## Use

```python
from soma_cluster.inference import RoutedLM
lm = RoutedLM.load("THIS_DIRECTORY")
lm.score("some text").bits_per_byte
lm.generate("Once upon a time", max_bytes=200, temperature=0.8, top_k=40, seed=0)
```

or `soma score THIS_DIRECTORY FILE` and `soma sample THIS_DIRECTORY --prompt "..."` (docs/inference.md).

## Model

N = {cfg.n_experts} experts, each a byte-level recurrent model: a tied byte embedding (256 x {cfg.model.embed_dim},
head {cfg.model.head}), {cfg.model.depth} pre-norm residual blocks of a bias-free LSTM and a GELU MLP at width
d = {cfg.model.d}. A router (TF-IDF -> SVD {cfg.router.svd_dim} -> centroids, rule {cfg.router.rule}) reads the first
{cfg.router.prefix_bytes} bytes of a window and mixes the next-byte probabilities of its top
{cfg.top_k()} experts ({cfg.router.weighting} weights).

## Data

{corpus.get("bytes", 0):,} bytes in {corpus.get("documents", "?")} documents (corpus `{cfg.corpus.source}`), clustered
into {cfg.n_experts} shards of {cfg.shards.seq_bytes}-byte sequences; each expert trained on its own shard only.

| source | bytes | share |
|---|---|---|
{src_rows}

## Training

SOMA: zero-order training (SPSA, {cfg.spsa.n_pert} probe directions, batch {cfg.spsa.batch} x {cfg.spsa.seq_len}
bytes, Adam, eps = lr = {cfg.spsa.lr}), no backpropagation; experts never communicate. The seed model trained
{manifest["seed_step"]} updates on the whole corpus and every expert started from it; the experts trained
{min(steps, default=0)}-{max(steps, default=0)} updates (target {cfg.train.updates}).

## Evaluation

{evaluation}
## Compute (from the campaign's ledger)

{ledger.get("gpu_hours_total", 0.0):.4f} aggregate {ledger.get("unit", "GPU-hours")}:
{", ".join(f"{k} {v:.4f}" for k, v in gpu.items())}.{_dollars(ledger)}

## Weights

`weights.safetensors` names every tensor (PyTorch's conventions; read it with `safetensors` alone). Expert E's are
`expert-{{E:04d}}.<name>`, the seed model's `seed.<name>`:

| name | shape |
|---|---|
{_weight_rows(cfg)}

The byte embedding is tied: logits = h E^T. {_head_text(cfg)} The forward of one expert, reading bytes x:
h = E[x]{" proj_in^T" if cfg.model.d != cfg.model.embed_dim else ""}; in each block, h += LSTM(LN(h) g1) (one layer, no
biases, gates i, f, g, o as `torch.nn.LSTM`), then h += fc2(GELU(fc1(LN(h) g2))); then h = LN(h) g_f
{"proj_out^T " if cfg.model.d != cfg.model.embed_dim else ""}and the next byte's distribution is softmax(h E^T). LN is a
gain-only LayerNorm (eps {LN_EPS:g}, no bias; its gains g1, g2, g_f are `ln1`, `ln2`, `ln_f`); GELU is the exact
(erf) one. The router in `router/` picks each
window's top {cfg.top_k()} experts from its first {cfg.router.prefix_bytes} bytes; their distributions are mixed
({cfg.router.weighting} weights). The file's metadata holds the model's shape (`soma.model`).

## Limits

A byte-level LSTM ensemble trained by a zero-order method: it models bytes of text like its corpus and is far from a
chat or instruction-following model. SOMA beats other zero-order training at matched compute; it does not beat
backpropagation, which remains far better per GPU-hour. It reads at most {cfg.eval.window_bytes - 1} bytes of
context; its samples are statistical text, not facts.
"""
