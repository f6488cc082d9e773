"""`soma prepare`: corpus -> parts packed into train sequences and test windows -> router fit on a keyed sample ->
the balanced rule's offsets refitted -> per-expert Arrow shards, published with the manifests last.

Two engines run the same per-part work (soma_cluster.parts) and give the same campaign: `local` here, part after
part in the driver's process with its staging on local disk; `ray` (pipelines.prepare_ray) as Ray Data tasks on
the cluster's CPU workers, staging under the campaign. This module holds what the driver decides in both.
"""

from __future__ import annotations

import json
import math
import os
import time
from contextlib import contextmanager
from dataclasses import replace
from typing import Callable, Iterator

import numpy as np

from pipelines.campaign_lease import holding
from pipelines.common import claim_campaign, console, progress
from pipelines.prepare_engine import Engine, Routed
from pipelines.tracking import check_tracking, track_stage
from soma_cluster.campaignfile import CONFIG_FILE
from soma_cluster.config import CampaignConfig, default_top_k, setting_origin
from soma_cluster.corpus import (
    Part,
    check_listing,
    describe_counts,
    describe_skipped,
    more_test_documents,
    no_text_error,
    plan_parts,
    shown,
)
from soma_cluster.diskerrors import MARGIN_BYTES
from soma_cluster.errors import SomaError
from soma_cluster.jobs import Category, expert_name
from soma_cluster.ledger import Ledger
from soma_cluster.parts import (
    DOCUMENTS,
    WINDOWS,
    PartStats,
    count_part,
    embed_part,
    lowest,
    read_part,
    sample_part,
    select,
    threshold,
    write_part,
)
from soma_cluster.router import (
    Router,
    cluster_spread,
    fit_offsets,
    fit_router,
    identical_share,
    router_text,
    save_router,
    size_spread,
)
from soma_cluster.shards import MAX_VAL_SHARE, ValSplit, val_split, write_manifests
from soma_cluster.sources import label_parts, merge_tables, rows_note, table_json, table_lines
from soma_cluster.storage import Store, sha256
from soma_cluster.textsources import BUILTIN, NAMED_SOURCES
from soma_cluster.trackpoints import Stage

STAGE_HOOKS: list[Callable[[str], None]] = []  # called with each stage's name as it ends ("setup": prepare_with
# starts); benchmarks/bench_prepare.py reads every process's CPU there. Empty in normal use.


class LocalEngine:
    """The per-part work in this process, staged in `tmpdir`: the campaign's own scratch directory (a local
    campaign: its filesystem, whatever disk that is) or the checked temp dir (a remote campaign)."""

    def __init__(self, cfg: CampaignConfig, tmpdir: str):
        self.cfg = cfg
        self.stage = Store(os.path.join(tmpdir, "stage"))
        self.cache = os.path.join(tmpdir, "cache")

    def read(self, parts: list[Part], keep_keys: int) -> list[PartStats]:
        out = []
        with progress() as bar:
            task = bar.add_task("reading corpus (parts)", total=len(parts))
            for part in parts:
                out.append(read_part(self.cfg, part, self.stage, keep_keys))
                bar.advance(task)
        return out

    def sample(self, parts: list[int], below: int) -> tuple[np.ndarray, list[bytes]]:
        keys, seqs = [], []
        for p in parts:
            k, s = sample_part(self.cfg.seed, self.stage, p, below, self.cache)
            keys.append(k)
            seqs += s
        return np.concatenate(keys), seqs

    def embed(self, router: Router, parts: list[int], below: int | None) -> tuple[np.ndarray, np.ndarray]:
        keys, emb = [], []
        with progress() as bar:
            task = bar.add_task("embedding sequences (parts)", total=len(parts))
            for p in parts:
                k, e = embed_part(self.cfg.seed, router, self.stage, p, below, self.cache)
                keys.append(k)
                emb.append(e)
                bar.advance(task)
        return np.concatenate(keys), np.concatenate(emb)

    def count(self, router: Router, parts: list[int]) -> tuple[list[np.ndarray], Routed]:
        return [count_part(router, self.stage, p, self.cache) for p in parts], Routed(router)

    def write(
        self, store: Store, cfg: CampaignConfig, routed: Routed, parts: list[int], before: np.ndarray, val_every: int
    ) -> list[dict]:
        shards = cfg.shards
        return [
            write_part(routed.router, self.stage, store, p, b, val_every, shards.rows_per_file, self.cache)
            for p, b in zip(parts, before, strict=True)
        ]


def _corpus_info(cfg: CampaignConfig, stats: list[PartStats]) -> dict:
    """The corpus's totals over its parts, checked: text, and held-out windows to evaluate on."""
    sources: dict[str, int] = {}
    formats: dict[str, int] = {}
    skipped: dict[str, list[str]] = {}
    for st in stats:
        for k, v in st.sources.items():
            sources[k] = sources.get(k, 0) + v
        for k, v in st.formats.items():
            formats[k] = formats.get(k, 0) + v
        for why, files in st.skipped.items():
            skipped.setdefault(why, []).extend(files)
    n_docs, read = sum(st.documents for st in stats), sum(st.bytes for st in stats)
    n_test, n_windows, n_seqs = (
        sum(st.test_documents for st in stats),
        sum(st.windows for st in stats),
        sum(st.seqs for st in stats),
    )
    if n_docs == 0 or read == 0:
        if cfg.corpus.source in NAMED_SOURCES:
            raise SomaError(f"corpus {cfg.corpus.source} holds no text; point corpus.source at files with text in them")
        raise no_text_error(cfg.corpus, skipped)
    if not n_windows:
        raise SomaError(
            f"corpus {shown(cfg.corpus.source)}: the {n_test} held-out documents (of {n_docs}) fill no "
            f"{cfg.eval.window_bytes}-byte evaluation window; "
            + more_test_documents(cfg.corpus, n_docs, formats, cfg.eval.window_bytes, read)
        )
    capped = setting_origin(cfg, "corpus.max_bytes")
    console.print(
        f"corpus: {n_docs} documents, {read / 1e6:.1f} MB ({describe_counts(sources)}) in {len(stats)} "
        f"part{'s' * (len(stats) > 1)}; {n_seqs} train sequences, {n_windows} test windows from {n_test} held-out "
        f"documents{describe_skipped(skipped, 3)}"
        + (
            f"; reading stopped at corpus.max_bytes={cfg.corpus.max_bytes:_} ({capped})"
            if read >= cfg.corpus.max_bytes
            else ""
        )
    )
    return {
        "documents": n_docs,
        "bytes": read,
        "sources": sources,
        "formats": formats,
        "test_documents": n_test,
        "parts": len(stats),
        "skipped_files": {why: len(files) for why, files in skipped.items()},
        "test_windows": n_windows,
        "train_sequences": n_seqs,
    }


def _publish_windows(store: Store, stage: Store, stats: list[PartStats], cfg: CampaignConfig) -> None:
    """The staged test windows into test/, one file per part that has any, and test/manifest.json listing them
    (its sha256 is over the files' digests, so two campaigns with the same windows have the same one)."""
    files = []
    for st in stats:
        if st.windows:
            rel = WINDOWS.format(st.part)
            store.write_bytes(rel, stage.read_bytes(rel))
            files.append({"name": rel.rsplit("/", 1)[-1], "rows": st.windows, "sha256": st.windows_sha256})
    # each window's document's name and source, for the loss per source; outside the windows' own digest, so the
    # windows of a campaign prepared before it compare equal to the same windows prepared after
    docs = sorted((d for st in stats for d in st.test_docs), key=lambda d: d[0])
    raw = json.dumps({"documents": [{"doc": d, "name": n, "source": s} for d, n, s in docs]}).encode()
    store.write_bytes(DOCUMENTS, raw)
    store.write_json(
        "test/manifest.json",
        {
            "windows": sum(f["rows"] for f in files),
            "window_bytes": cfg.eval.window_bytes,
            "files": files,
            "sha256": sha256("".join(f["sha256"] for f in files).encode()),
            "documents": {"name": DOCUMENTS.rsplit("/", 1)[-1], "count": len(docs), "sha256": sha256(raw)},
        },
    )


def _val_split(cfg: CampaignConfig, smallest: int) -> ValSplit:
    return val_split(cfg.shards.val_fraction, cfg.train.val_batches * cfg.spsa.batch, smallest)


def more_data(cfg: CampaignConfig, info: dict, n_seqs_needed: int | None = None) -> str:
    """What gives prepare more data, naming what bound it: corpus.max_bytes (and where its value came from) when it
    stopped the reading, the built-in corpus's size when that was all of it, else the corpus itself."""
    c = cfg.corpus
    read = info.get("bytes", 0)
    need = ""
    if n_seqs_needed and info.get("train_sequences"):  # bytes per train sequence as this corpus packed them
        want = int(read * n_seqs_needed / info["train_sequences"] * 1.1) + 1
        need = f" (about {want / 1e6:,.0f} MB for that)" if want >= 1e6 else f" (about {want:_} bytes for that)"
    if read >= c.max_bytes:
        return (
            f"corpus.max_bytes={c.max_bytes:_} ({setting_origin(cfg, 'corpus.max_bytes')}) stopped the reading at "
            f"{read / 1e6:.1f} MB: raise it{need}"
        )
    if c.source == BUILTIN:
        return (
            f"the built-in corpus holds {read / 1e6:.1f} MB in all: name a larger corpus{need} (--corpus PATH, or "
            "corpus.source=machine for this machine's own text)"
        )
    return f"add data{need}"


def _smallest_shard(cfg: CampaignConfig) -> int:
    """The fewest sequences a shard can hold: shards.min_train_seqs train and at least one val under the split."""
    low = cfg.shards.min_train_seqs + 1
    # the split raises val to a share of at least MAX_VAL_SHARE when it must, so m = 10 (low + 1) has one val row
    for m in range(low, 2 * low + 20):
        n_val = _val_split(cfg, m).val_rows(m)
        if n_val >= 1 and m - n_val >= cfg.shards.min_train_seqs:
            return m
    return 2 * low + 20


def _check_sizes(cfg: CampaignConfig, sizes: np.ndarray, split: ValSplit, info: dict | None = None) -> None:
    info = info or {}
    e = int(np.argmin(sizes))
    n = int(sizes[e])
    n_val = split.val_rows(n)
    if n - n_val < cfg.shards.min_train_seqs:
        need = cfg.n_experts * (cfg.shards.min_train_seqs + split.wanted)
        raise SomaError(
            f"{expert_name(e)} would get {n} sequences ({n_val} val), below shards.min_train_seqs="
            f"{cfg.shards.min_train_seqs} train; lower n_experts, or {more_data(cfg, info, need)}"
        )
    if n_val < 1:
        need = math.ceil(1000 / max(n, 2)) / 1000  # round(1 / fraction) <= n puts one of its n sequences in val
        raise SomaError(
            f"{expert_name(e)} would get {n} sequences and 0 val: one in every {split.every} is val "
            f"(shards.val_fraction={cfg.shards.val_fraction}); raise shards.val_fraction to {need} or more (or "
            f"lower n_experts, or {more_data(cfg, info)})"
        )
    spread = size_spread(sizes)
    if cfg.router.rule == "balanced" and spread > cfg.router.balance_tolerance:
        raise SomaError(
            f"router: the balanced rule gives shards of {sizes.min()}-{sizes.max()} sequences ({spread:.1%} from "
            "the mean), over "
            f"router.balance_tolerance={cfg.router.balance_tolerance} (identical chunks always share a shard); "
            "raise the tolerance, lower n_experts or add data"
        )


def _check_feasible(cfg: CampaignConfig, n_seqs: int, sample: list[bytes], info: dict | None = None) -> None:
    """Refusals _check_sizes would make after the router's fit (minutes on a large corpus), made from what is known
    before it: the smallest shard holds at most n_seqs // n_experts sequences whatever the routing; and identical
    sequences always share a shard, so one that makes up a large share of the sample overfills its shard. A refusal
    for too little data names what bound it (more_data)."""
    info = info or {}
    most = n_seqs // cfg.n_experts
    split = _val_split(cfg, most)
    n_val = split.val_rows(most)
    if most - n_val < cfg.shards.min_train_seqs or n_val < 1:
        short = "shards.min_train_seqs" if most - n_val < cfg.shards.min_train_seqs else "shards.val_fraction"
        smallest = _smallest_shard(cfg)
        can = max(1, n_seqs // smallest)
        raise SomaError(
            f"{n_seqs} train sequences over n_experts={cfg.n_experts} leave the smallest shard at most {most} "
            f"({n_val} val, one in every {split.every}), too few for {short} "
            f"(shards.min_train_seqs={cfg.shards.min_train_seqs}, shards.val_fraction={cfg.shards.val_fraction}); "
            f"lower n_experts to {can} or less, or {more_data(cfg, info, cfg.n_experts * smallest)}"
        )
    if cfg.router.rule != "balanced" or not sample:
        return
    share, at_least = identical_share(sample)
    mean = n_seqs / cfg.n_experts
    if at_least * n_seqs / mean - 1.0 > cfg.router.balance_tolerance:
        raise SomaError(
            f"router: {share:.1%} of the {len(sample)} sampled sequences are one and the same "
            f"{cfg.shards.seq_bytes}-byte sequence (repetitive text), and identical sequences share a shard: its "
            f"shard would hold at least {at_least * n_seqs:.0f} of {n_seqs} sequences, over the mean "
            f"{mean:.0f} by more than router.balance_tolerance={cfg.router.balance_tolerance}; lower n_experts to "
            f"{max(1, int((1.0 + cfg.router.balance_tolerance) / share))} or less, deduplicate the corpus, or raise "
            "the tolerance"
        )


def resolve_engine(cfg: CampaignConfig, address: str | None) -> str:
    if cfg.prepare.engine != "auto":
        return cfg.prepare.engine
    return "ray" if address or os.environ.get("RAY_ADDRESS") else "local"


def check_prepare(store: Store, cfg: CampaignConfig) -> None:
    """What `soma prepare` refuses before it writes anything, its lease included: a tracker configured that cannot
    work here, and (unless the campaign is prepared already) a corpus its listing shows is not there or holds no
    file to read."""
    check_tracking(store, cfg)
    if not store.exists("shards/manifest.json"):
        check_listing(cfg.corpus)


@holding("soma prepare")
def prepare(store: Store, cfg: CampaignConfig, address: str | None = None) -> dict:
    """Run the stage; returns the shard summary. Idempotent for the same config, refuses another. The engine is
    cfg.prepare.engine (auto: ray when a Ray address is given). Checks the campaign can be written before it
    reads any data or starts Ray; a failure leaves the campaign as it found it (undone_on_failure)."""
    check_tracking(store, cfg)  # a tracker configured but not installed is refused before anything is written
    manifest = _prepare(store, cfg, address)
    track_stage(store, cfg, Stage.PREPARE, "finished")
    return manifest


def _prepare(store: Store, cfg: CampaignConfig, address: str | None) -> dict:
    if store.exists(CONFIG_FILE) and store.exists("shards/manifest.json"):
        claim_campaign(store, cfg)
        console.print(f"{store.url} is already prepared for this config; skipping prepare")
        return store.read_json("shards/manifest.json")
    claim_campaign(store, cfg, write=False)  # refuse a foreign directory before reading any data
    if resolve_engine(cfg, address) == "ray":
        return _prepare_on_ray(store, cfg, address)
    with undone_on_failure(store), store.scratch() as tmp:
        return prepare_with(LocalEngine(cfg, tmp), store, cfg)


def _prepare_on_ray(store: Store, cfg: CampaignConfig, address: str | None) -> dict:
    """prepare_with on the Ray engine (pipelines.prepare_ray), inside a Ray session (address, RAY_ADDRESS, else a
    local Ray). The campaign is claimed first (staging lives under it); a failure removes the staging and
    whatever this run added to the campaign (undone_on_failure)."""
    from pipelines.prepare_ray import STAGING, RayEngine, quiet_ray_data  # Ray and Ray Data only when asked for
    from pipelines.raysession import ray_session

    try:
        with undone_on_failure(store):
            claim_campaign(store, cfg)
            with ray_session(cfg, address):
                quiet_ray_data()
                return prepare_with(RayEngine(store, cfg), store, cfg)
    finally:
        store.remove_tree(STAGING.split("/")[0])


@contextmanager
def undone_on_failure(store: Store) -> Iterator[None]:
    """However prepare fails (bad data, a full disk, Ctrl-C), remove what it added at the campaign's top level:
    a directory it found empty (or absent) is left empty (or absent) again, so the same command can simply be
    rerun; what was there before is never touched."""
    before = set(store.listdir(""))
    absent = store.local and not os.path.exists(store.root)
    try:
        yield
    except BaseException:
        try:
            for name in set(store.listdir("")) - before:
                store.remove_tree(name)
            if absent and os.path.isdir(store.root) and not os.listdir(store.root):
                os.rmdir(store.root)
        except Exception as exc:  # the first error is the one to report; say what is left behind
            console.print(
                f"could not undo the failed prepare in {store.url} ({type(exc).__name__}: {exc}); "
                "remove what it wrote there"
            )
        raise


def shard_bytes(cfg: CampaignConfig, n_seqs: int, n_windows: int) -> int:
    """What publishing a prepared campaign writes: every train sequence once (the shards), the test windows,
    the manifests, router and logs (MARGIN_BYTES). The free space prepare asks for before it publishes."""
    return n_seqs * cfg.shards.seq_bytes + n_windows * cfg.eval.window_bytes + MARGIN_BYTES


def prepare_with(engine: Engine, store: Store, cfg: CampaignConfig) -> dict:
    """The driver's half of prepare, the same for every engine: plan the parts, have the engine read them, fit
    the router on the keyed sample, refit the offsets, check the sizes, then have the engine write the shards;
    nothing is written into the campaign before the data is known to fit, and shards/manifest.json comes last."""
    t0 = time.monotonic()
    stages: dict[str, float] = {}
    last = t0

    def lap(name: str) -> None:  # wall seconds of each stage, into the manifest
        nonlocal last
        now = time.monotonic()
        stages[name] = round(now - last, 3)
        last = now
        for hook in STAGE_HOOKS:
            hook(name)

    for hook in STAGE_HOOKS:
        hook("setup")

    labelled = label_parts(cfg.corpus, plan_parts(cfg.corpus, cfg.prepare.part_bytes))  # refusals before reading
    parts = labelled.parts
    for note in labelled.notes:
        console.print(f"warning: {note}", markup=False, soft_wrap=True)
    balanced = cfg.router.rule == "balanced"
    keep = max(cfg.router.sample_chunks, cfg.router.refit_rows if balanced else 0)
    stats = engine.read(parts, keep)
    lap("read")
    corpus_info = _corpus_info(cfg, stats)
    if note := rows_note(cfg.corpus, corpus_info["formats"]):
        console.print(f"warning: {note}", markup=False, soft_wrap=True)
    n_seqs = corpus_info["train_sequences"]
    if n_seqs < cfg.n_experts:
        raise SomaError(
            f"corpus gives {n_seqs} train sequences of {cfg.shards.seq_bytes} bytes, fewer than "
            f"n_experts={cfg.n_experts}; lower n_experts, or {more_data(cfg, corpus_info, cfg.n_experts * 20)}"
        )
    with_seqs = [st.part for st in stats if st.seqs]
    lowest_keys = lowest(np.concatenate([st.lowest_keys for st in stats]), keep)
    below = threshold(lowest_keys, cfg.router.sample_chunks)
    keys, seqs = select(*engine.sample(with_seqs, below), below)
    lap("sample")
    _check_feasible(cfg, n_seqs, seqs, corpus_info)  # what the sizes and the sample rule out, before the router's fit
    console.print(
        f"fitting router on {len(seqs)} sampled sequences (TF-IDF -> SVD {cfg.router.svd_dim} -> balanced k-means, "
        f"N={cfg.n_experts}, rule {cfg.router.rule})"
    )
    router, sample_labels = fit_router([router_text(s) for s in seqs], cfg.n_experts, cfg.router, cfg.seed)
    del seqs
    lap("fit")
    refit_below = threshold(lowest_keys, cfg.router.refit_rows) if balanced else None
    keys, emb = engine.embed(router, with_seqs, refit_below)
    lap("embed")
    if balanced:
        keys, emb = select(keys, emb, refit_below)
        router = replace(router, offsets=fit_offsets(emb, router.centroids, router.offsets))
    del emb
    lap("refit")
    tables, routed = engine.count(router, with_seqs)  # each part's (S_p, N): sequences per source and expert
    per_part = np.stack([t.sum(axis=0) for t in tables])  # (parts, N): each expert's sequences in each part
    sizes = per_part.sum(axis=0)
    labels = {st.part: st.seq_sources for st in stats}
    by_source = merge_tables(cfg.n_experts, ((labels[p], t) for p, t in zip(with_seqs, tables, strict=True)))
    lap("count")
    split = _val_split(cfg, int(sizes.min()))
    _check_sizes(cfg, sizes, split, corpus_info)
    store.check_writable(
        shard_bytes(cfg, n_seqs, corpus_info["test_windows"])
    )  # the room to publish, before publishing
    claim_campaign(store, cfg)  # nothing is written before the data is known to fit
    save_router(store, router)
    before = np.cumsum(per_part, axis=0) - per_part  # an expert's sequences in the parts before each
    manifests = write_manifests(
        store, cfg.n_experts, cfg.shards.seq_bytes, engine.write(store, cfg, routed, with_seqs, before, split.every)
    )
    _publish_windows(store, engine.stage, stats, cfg)
    lap("write")
    fit_sizes = np.bincount(sample_labels, minlength=cfg.n_experts)
    refit = min(cfg.router.refit_rows, n_seqs)
    summary = {
        "complete": True,
        "n_experts": cfg.n_experts,
        "seq_bytes": cfg.shards.seq_bytes,
        "corpus": corpus_info,
        "train_rows": [m["train_rows"] for m in manifests],
        "val_rows": [m["val_rows"] for m in manifests],
        "rule": router.cfg.rule,
        "fit_sample": len(sample_labels),
        "refit_sample": refit if balanced else 0,
        "fit_cluster_sizes": fit_sizes.tolist(),
        "fit_size_spread": cluster_spread(sample_labels, cfg.n_experts),
        "assigned_size_spread": size_spread(sizes),
        "top_terms": router.top_terms,
        "source_experts": table_json(by_source),
        "stage_seconds": stages,
        "wall_seconds": time.monotonic() - t0,
    }
    store.write_json("shards/manifest.json", summary)
    how = (
        f"offsets refitted on {'all' if refit == n_seqs else refit} of them"
        if balanced
        else "each to its nearest centroid"
    )
    console.print(
        f"cluster sizes: within {summary['fit_size_spread']:.1%} of the mean on the fit sample (balanced k-means), "
        f"{summary['assigned_size_spread']:.1%} over all sequences (rule {router.cfg.rule}: {how})"
    )
    Ledger(store).record(
        category=Category.PREPROCESSING,
        gpu_seconds=0.0,
        wall_seconds=summary["wall_seconds"],
        note="CPU: corpus, router fit, shard writing (no GPU)",
    )
    _show_experts(summary, router.top_terms)
    _show_sources(by_source)
    _state_settings(cfg, summary, split)
    return summary


SHOWN_EXPERTS = 16  # prepare lists every expert up to this N; beyond, the smallest and largest shards


def _show_experts(summary: dict, top_terms: list[list[str]]) -> None:
    """Each expert's shard and top terms, one line each; at N > SHOWN_EXPERTS the three smallest and largest shards
    and the rest counted (every expert is in shards/manifest.json)."""
    rows = np.array(summary["train_rows"]) + np.array(summary["val_rows"])
    n = len(rows)
    order = np.argsort(rows, kind="stable")
    shown = range(n) if n <= SHOWN_EXPERTS else sorted({*order[:3].tolist(), *order[-3:].tolist()})
    for e in shown:
        console.print(
            f"  {expert_name(e)}: {summary['train_rows'][e]:6d} train / {summary['val_rows'][e]:4d} val  "
            f"top terms: {' '.join(printable(t) for t in top_terms[e][:8])}",
            soft_wrap=True,  # one expert, one line, whatever the terminal's width
            markup=False,  # a term is text, never rich markup
        )
    if n > SHOWN_EXPERTS:
        console.print(
            f"  ... {n - len(shown)} more experts of {int(rows[order[3]])}-{int(rows[order[-4]])} sequences "
            "(shown: the 3 smallest and 3 largest shards; all in shards/manifest.json)"
        )


def _show_sources(by_source: dict[str, np.ndarray]) -> None:
    """How each source's train sequences were sharded: a compact source x expert table (at most SHOWN_SOURCES
    sources, every one in shards/manifest.json's source_experts)."""
    console.print(
        f"train sequences by source and expert ({len(by_source):,} source{'s' * (len(by_source) != 1)}; "
        "shards/manifest.json):",
        markup=False,
        soft_wrap=True,
    )
    for line in table_lines(by_source):
        console.print(line, markup=False, soft_wrap=True)


def _state_settings(cfg: CampaignConfig, summary: dict, split: ValSplit) -> None:
    """The settings whose defaults depend on N and on the data, as prepare chose them, each with the setting that
    changes it (docs/config.md): routing top-k, expert validation, evaluation windows."""
    from soma_cluster.breakdown import LOAD_MIN_FAIR  # here: it imports torch, which prepare's refusals run before

    n, k = cfg.n_experts, cfg.top_k()
    how = f"the default for N = {n}" if cfg.router.top_k is None else f"router.top_k={cfg.router.top_k}"
    console.print(f"routing: each window to the top {k} of {n} experts ({how}; set router.top_k to change)")
    if k >= n >= 2:
        console.print(
            f"warning: router.top_k={cfg.router.top_k} >= n_experts={n}: every window goes to every expert with "
            f"weight 1/{n}, a uniform mixture, no routing (the default for N = {n} is {default_top_k(n)})",
            markup=False,
        )
    val = min(summary["val_rows"])
    raised = (
        f", raised from shards.val_fraction={cfg.shards.val_fraction} so that a shard holds what one validation reads"
        if split.raised
        else ""
    )
    console.print(
        f"expert validation: one in every {split.every} sequences of a shard, {val} or more each{raised} "
        f"(train.val_batches x spsa.batch = {split.wanted})",
        markup=False,
    )
    if val < split.wanted:
        console.print(
            f"warning: each shard's validation holds {val} sequences, fewer than the {split.wanted} one validation "
            f"reads (the share is capped at {MAX_VAL_SHARE:.0%}): expert-validation losses, which drive the learning-"
            "rate schedule, reuse sequences and are noisier; add data or lower n_experts",
            markup=False,
        )
    windows = summary["corpus"]["test_windows"]
    cap = cfg.eval_windows()
    used = min(windows, cap)
    origin = f"the default for N = {n}, k = {k}" if cfg.eval.max_windows is None else "eval.max_windows"
    per = used * k / n
    console.print(
        f"evaluation: {used} of the {windows} test windows (at most {cap}: {origin}), about {per:.0f} routed to "
        "each expert at an even load",
        markup=False,
    )
    if per < LOAD_MIN_FAIR and n > 1:
        console.print(
            f"warning: about {per:.1f} test windows per expert is too few to judge each expert or the routing load: "
            f"raise corpus.test_fraction (now {cfg.corpus.test_fraction}) or add data",
            markup=False,
        )


def printable(term: str) -> str:
    """A term as one line can show it, quoted (a term may be "," or end in spaces): control characters (a
    newline, a tab) escaped as JSON writes them."""
    import json

    return json.dumps(term, ensure_ascii=False)
