"""`soma prepare`: corpus -> packed sequences -> router fit on a sample -> per-expert Arrow shards.

The corpus is read once; train sequences are spilled to a local Arrow stream so assignment and
shard writing stream in batches with bounded memory.
"""
from __future__ import annotations

import math
import os
import random
import tempfile
import time
from dataclasses import replace

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from pipelines.common import claim_campaign, console, progress
from soma_cluster.config import CampaignConfig
from soma_cluster.corpus import Packer, describe_counts, describe_skipped, documents, is_test_doc
from soma_cluster.errors import SomaError
from soma_cluster.ledger import Ledger
from soma_cluster.router import Router, cluster_spread, fit_offsets, fit_router, router_text, save_router, size_spread
from soma_cluster.shards import ShardWriter, expert_name, rows_to_numpy, schema
from soma_cluster.storage import Store, file_sha256, put_file

SPILL_BATCH = 4096
EMBED_BATCH = 4096


class _Spill:
    """Train sequences on local disk, in write order, plus a reservoir sample of their texts."""

    def __init__(self, seq_bytes: int, sample_size: int, seed: int, tmpdir: str):
        self.seq_bytes, self.sample_size = seq_bytes, sample_size
        self.path = os.path.join(tmpdir, "spill.arrow")
        self.sink = pa.OSFile(self.path, "wb")
        self.writer = ipc.new_stream(self.sink, schema(seq_bytes))
        self.buf: list[bytes] = []
        self.n = 0
        self.sample: list[str] = []
        self.rng = random.Random(seed)

    def add(self, seq: bytes) -> None:
        if len(self.sample) < self.sample_size:
            self.sample.append(router_text(seq))
        else:
            j = self.rng.randrange(self.n + 1)
            if j < self.sample_size:
                self.sample[j] = router_text(seq)
        self.n += 1
        self.buf.append(seq)
        if len(self.buf) >= SPILL_BATCH:
            self.flush()

    def flush(self) -> None:
        if self.buf:
            self.writer.write_batch(pa.record_batch([pa.array(self.buf, type=pa.binary(self.seq_bytes))], schema=schema(self.seq_bytes)))
            self.buf = []

    def close(self) -> None:
        self.flush()
        self.writer.close()
        self.sink.close()

    def batches(self):
        with pa.OSFile(self.path, "rb") as fh:
            for batch in ipc.open_stream(fh):
                yield batch.column(0)


def _read_corpus(cfg: CampaignConfig, tmpdir: str, store: Store) -> tuple[_Spill, dict, int]:
    """Stream documents: held-out ones become evaluation windows, the rest packed train sequences."""
    spill = _Spill(cfg.shards.seq_bytes, cfg.router.sample_chunks, cfg.seed, tmpdir)
    win = cfg.eval.window_bytes
    test_path = os.path.join(tmpdir, "windows.arrow")
    test_schema = pa.schema([pa.field("window", pa.binary(win)), pa.field("doc", pa.int64())])
    train_pack = Packer(cfg.shards.seq_bytes)
    test_pack = Packer(win, owner_at=cfg.eval.context_bytes + 1)
    counts: dict[str, int] = {}
    skipped: dict[str, list[str]] = {}          # user files left out, by reason (not text, empty)
    n_docs = n_test = n_windows = 0
    windows, owners = [], []
    with progress() as bar, pa.OSFile(test_path, "wb") as sink, ipc.new_file(sink, test_schema) as test_out:
        def flush_windows() -> None:          # test windows stream to disk too: driver memory stays bounded
            if windows:
                test_out.write_batch(pa.record_batch([pa.array(windows, type=pa.binary(win)), pa.array(owners, type=pa.int64())], schema=test_schema))
                windows.clear()
                owners.clear()
        task = bar.add_task("reading corpus (MB)", total=round(cfg.corpus.max_bytes / 1e6))
        read = 0
        for doc in documents(cfg.corpus, counts, skipped):
            n_docs += 1
            read += len(doc.data)
            bar.update(task, completed=min(round(read / 1e6), round(cfg.corpus.max_bytes / 1e6)))
            if is_test_doc(doc.doc_id, cfg.corpus.test_fraction, cfg.seed):
                n_test += 1
                for w, owner in test_pack.add(doc.data):
                    windows.append(w)
                    owners.append(owner)
                    n_windows += 1
                if len(windows) >= SPILL_BATCH:
                    flush_windows()
            else:
                for seq, _ in train_pack.add(doc.data):
                    spill.add(seq)
        flush_windows()
    spill.close()
    if n_docs == 0 or read == 0:
        raise SomaError(f"corpus {cfg.corpus.source} holds no text; point corpus.source at files with text in them")
    if not n_windows:
        raise SomaError(f"corpus {cfg.corpus.source}: the {n_test} held-out documents fill no {win}-byte evaluation window; add data or raise corpus.test_fraction")
    console.print(f"corpus: {n_docs} documents, {read / 1e6:.1f} MB ({describe_counts(counts)}); "
                  f"{spill.n} train sequences, {n_windows} test windows from {n_test} held-out documents{describe_skipped(skipped, 3)}")
    return spill, {"documents": n_docs, "bytes": read, "sources": counts, "test_documents": n_test,
                   "skipped_files": {why: len(files) for why, files in skipped.items()},
                   "test_windows": n_windows, "test_path": test_path}, spill.n


def _embed_all(spill: _Spill, router: Router, tmpdir: str) -> np.ndarray:
    """Every train sequence's router embedding (n, svd_dim + 8 hashed coordinates) float32, memory-mapped
    from local disk (544 bytes a sequence at svd_dim 128: about half the spill itself)."""
    emb = np.lib.format.open_memmap(os.path.join(tmpdir, "embeddings.npy"), mode="w+", dtype=np.float32,
                                    shape=(spill.n, router.centroids.shape[1]))
    pos = 0
    with progress() as bar:
        task = bar.add_task("embedding sequences", total=spill.n)
        for col in spill.batches():
            seqs = rows_to_numpy(col, spill.seq_bytes)
            for a in range(0, len(seqs), EMBED_BATCH):
                texts = [router_text(s.tobytes()) for s in seqs[a:a + EMBED_BATCH]]
                emb[pos:pos + len(texts)] = router.embed(texts)
                pos += len(texts)
                bar.advance(task, len(texts))
    return emb


def _assign(spill: _Spill, router: Router, tmpdir: str) -> tuple[Router, np.ndarray]:
    """Shard labels (n,) of every train sequence under the router's rule. The balanced rule's offsets are
    refitted on all the sequences (warm from the sample's), so the shards, not just the sample, are equal
    up to ties; the router saved and used for routing carries these offsets."""
    emb = _embed_all(spill, router, tmpdir)
    if router.cfg.rule == "balanced":
        router = replace(router, offsets=fit_offsets(emb, router.centroids, router.offsets))
    labels = router.assign(emb)
    del emb
    return router, labels


def _check_sizes(cfg: CampaignConfig, sizes: np.ndarray) -> None:
    val_every = max(2, round(1.0 / cfg.shards.val_fraction))
    e = int(np.argmin(sizes))
    n = int(sizes[e])
    n_val = n // val_every
    if n - n_val < cfg.shards.min_train_seqs:
        raise SomaError(f"{expert_name(e)} would get {n} sequences ({n_val} val), below shards.min_train_seqs="
                        f"{cfg.shards.min_train_seqs} train; lower n_experts or add data")
    if n_val < 1:
        need = math.ceil(1000 / max(n, 2)) / 1000     # round(1 / fraction) <= n puts one of its n sequences in val
        raise SomaError(f"{expert_name(e)} would get {n} sequences and 0 val: shards.val_fraction={cfg.shards.val_fraction} puts one in "
                        f"every {val_every} in val; raise shards.val_fraction to {need} or more (or add data, or lower n_experts)")
    spread = size_spread(sizes)
    if cfg.router.rule == "balanced" and spread > cfg.router.balance_tolerance:
        raise SomaError(f"router: the balanced rule gives shards of {sizes.min()}-{sizes.max()} sequences ({spread:.1%} from the mean), over "
                        f"router.balance_tolerance={cfg.router.balance_tolerance} (identical chunks always share a shard); "
                        "raise the tolerance, lower n_experts or add data")


def prepare(store: Store, cfg: CampaignConfig) -> dict:
    """Run the stage; returns the shard summary. Idempotent for the same config, refuses another."""
    t0 = time.monotonic()
    if store.exists("campaign.yaml") and store.exists("shards/manifest.json"):
        claim_campaign(store, cfg)
        console.print(f"{store.url} is already prepared for this config; skipping prepare")
        return store.read_json("shards/manifest.json")
    claim_campaign(store, cfg, write=False)           # refuse a foreign directory before reading any data
    with tempfile.TemporaryDirectory(prefix="soma-prepare-") as tmp:
        spill, corpus_info, n_seqs = _read_corpus(cfg, tmp, store)
        if n_seqs < cfg.n_experts:
            raise SomaError(f"corpus gives {n_seqs} train sequences of {cfg.shards.seq_bytes} bytes, fewer than n_experts={cfg.n_experts}; lower n_experts or add data")
        console.print(f"fitting router on {len(spill.sample)} sampled sequences (TF-IDF -> SVD {cfg.router.svd_dim} -> balanced k-means, "
                      f"N={cfg.n_experts}, rule {cfg.router.rule})")
        router, sample_labels = fit_router(spill.sample, cfg.n_experts, cfg.router, cfg.seed)
        router, labels = _assign(spill, router, tmp)
        sizes = np.bincount(labels, minlength=cfg.n_experts)
        _check_sizes(cfg, sizes)
        claim_campaign(store, cfg)                      # nothing is written before the data is known to fit
        save_router(store, router)
        writer = ShardWriter(store, cfg.n_experts, cfg.shards.seq_bytes, cfg.shards.val_fraction, cfg.shards.rows_per_file)
        pos = 0
        for col in spill.batches():
            for seq, lab in zip(col.to_pylist(), labels[pos:pos + len(col)]):
                writer.add(int(lab), seq)
            pos += len(col)
        manifests = writer.close()
        test_sha = file_sha256(corpus_info["test_path"])
        put_file(store, corpus_info.pop("test_path"), "test/windows.arrow")
    store.write_json("test/manifest.json", {"windows": corpus_info["test_windows"], "window_bytes": cfg.eval.window_bytes, "sha256": test_sha})
    fit_sizes = np.bincount(sample_labels, minlength=cfg.n_experts)
    summary = {"complete": True, "n_experts": cfg.n_experts, "seq_bytes": cfg.shards.seq_bytes, "corpus": corpus_info,
               "train_rows": [m["train_rows"] for m in manifests], "val_rows": [m["val_rows"] for m in manifests],
               "rule": router.cfg.rule, "fit_cluster_sizes": fit_sizes.tolist(), "fit_size_spread": cluster_spread(sample_labels, cfg.n_experts),
               "assigned_size_spread": cluster_spread(labels, cfg.n_experts), "top_terms": router.top_terms, "wall_seconds": time.monotonic() - t0}
    store.write_json("shards/manifest.json", summary)
    how = "offsets refitted on all of them" if router.cfg.rule == "balanced" else "each to its nearest centroid"
    console.print(f"cluster sizes: within {summary['fit_size_spread']:.1%} of the mean on the fit sample (balanced k-means), "
                  f"{summary['assigned_size_spread']:.1%} over all sequences (rule {router.cfg.rule}: {how})")
    Ledger(store).record("preprocessing", 0.0, summary["wall_seconds"], note="driver CPU: corpus, router fit, shard writing")
    for e, terms in enumerate(router.top_terms):
        console.print(f"  {expert_name(e)}: {summary['train_rows'][e]:6d} train / {summary['val_rows'][e]:4d} val  top terms: {', '.join(terms[:8])}")
    return summary
