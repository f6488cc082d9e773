"""The per-part work of `soma prepare`, the same in both engines: the local engine runs it in its own process,
part after part; the Ray engine runs it as Ray Data tasks on the cluster's CPU workers. Whatever runs it, a
part's output depends only on the config and the part.

- read_part: pack a part's documents (soma_cluster.corpus.Part) into train sequences and evaluation windows,
  staged as Arrow IPC files, and report its counts and its lowest keys.
- sample_part / embed_part: the router's fit sample, then every sequence's embedding and the offsets' refit
  sample.
- count_part / write_part: each sequence's expert under the fitted rule, the sizes it gives per source (each train
  sequence's source is staged beside it: the source x expert table of shards/manifest.json), and the part's files
  of every expert's shard.

Keys. Every train sequence has a 64-bit key hashed from (seed, part, index in the part). The router is fitted
on the router.sample_chunks sequences of smallest key, the balanced rule's offsets are refitted on the
router.refit_rows smallest (a superset), both in key order. Keys depend on nothing an engine decides (worker
count, completion order), so both engines draw the same samples: uniform over the whole corpus and reproducible
from the seed. Sequences keep their corpus order (part, then index in the part) in each expert's shard, whose
every val_every-th sequence is val (soma_cluster.shards.ValSplit), in both engines.
"""

from __future__ import annotations

import io
import os
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from soma_cluster.config import CampaignConfig
from soma_cluster.corpus import Packer, Part, is_test_doc, part_documents
from soma_cluster.router import Router, router_text
from soma_cluster.shards import COLUMN, rows_to_numpy, schema, write_part_shards
from soma_cluster.storage import Store, file_sha256

SEQS = "seqs/part-{:05d}.arrow"  # staged train sequences of a part (their keys are row_keys of their places)
EMBEDDINGS = "emb/part-{:05d}.npy"  # their router embeddings, float32
SEQ_SOURCES = "src/part-{:05d}.npy"  # each staged train sequence's source: int32 index into PartStats.seq_sources
DOCUMENTS = "test/documents.json"  # each held-out document that owns a window: its id, name and source
WINDOWS = "test/part-{:05d}.arrow"  # a part's evaluation windows (window, doc): staged, then published as is
WRITE_ROWS = 4096  # rows per record batch of a staged file
EMBED_ROWS = 4096  # texts per router.embed call
MASK64 = (1 << 64) - 1


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on uint64 (a bijection whose output bits all depend on every input bit)."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def row_keys(seed: int, part: int, start: int, n: int) -> np.ndarray:
    """(n,) uint64 keys of rows start..start+n of a part."""
    salt = _splitmix64(np.array([seed & MASK64], dtype=np.uint64))[0]
    rows = (np.uint64(part) << np.uint64(32)) + np.arange(start, start + n, dtype=np.uint64)
    return _splitmix64(rows ^ salt)


def lowest(keys: np.ndarray, k: int) -> np.ndarray:
    """The k smallest keys, ascending (all of them if fewer)."""
    if len(keys) > k:
        keys = np.partition(keys, k - 1)[:k]
    return np.sort(keys)


def threshold(lowest_keys: np.ndarray, k: int) -> int:
    """The largest key of the k-smallest sample over every part's k lowest keys (all rows: the largest)."""
    merged = lowest(lowest_keys, k)
    return int(merged[-1]) if len(merged) else 0


def owner_id(part: int, doc: int) -> int:
    """A held-out document's id, unique across parts (the bootstrap resamples by it)."""
    return (part << 32) | doc


@dataclass
class PartStats:
    """What reading a part found (sent from a worker to the driver)."""

    part: int
    documents: int = 0
    bytes: int = 0
    test_documents: int = 0
    seqs: int = 0
    windows: int = 0
    windows_sha256: str = ""
    sources: dict[str, int] = field(default_factory=dict)  # document bytes per source
    formats: dict[str, int] = field(default_factory=dict)  # document bytes per format read (text, jsonl, parquet, ...)
    skipped: dict[str, list[str]] = field(default_factory=dict)
    lowest_keys: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    # [owner id, name, source] of each held-out document that owns a window (test/documents.json: loss per source)
    test_docs: list[list] = field(default_factory=list)
    # the sources of the part's train sequences, in the order first seen (SEQ_SOURCES indexes it): a sequence's
    # source is that of the document owning its first byte
    seq_sources: list[str] = field(default_factory=list)


class _Staged:
    """An Arrow IPC file written in batches to a staged local file (storage.StagedFile), then put into a store."""

    def __init__(self, schema: pa.Schema, store: Store, rel: str, scratch: str | None):
        self.schema, self.rel = schema, rel
        self.file = store.stage_file(rel, ".arrow", scratch)
        self.path = self.file.path
        self.sink = pa.OSFile(os.fsencode(self.path), "wb")  # bytes: pyarrow encodes str paths as strict UTF-8
        self.writer = ipc.new_file(self.sink, schema)
        self.cols: list[list] = [[] for _ in schema]
        self.rows = 0

    def add(self, *values) -> None:
        for col, v in zip(self.cols, values, strict=True):
            col.append(v)
        if len(self.cols[0]) >= WRITE_ROWS:
            self.flush()

    def flush(self) -> None:
        if self.cols[0]:
            self.writer.write_batch(
                pa.record_batch(
                    [pa.array(c, type=f.type) for c, f in zip(self.cols, self.schema, strict=True)], schema=self.schema
                )
            )
            self.rows += len(self.cols[0])
            self.cols = [[] for _ in self.schema]

    def close(self) -> None:
        self.flush()
        self.writer.close()
        self.sink.close()

    def publish(self) -> str:
        """Close, put into the store, return the file's sha256."""
        self.close()
        digest = file_sha256(self.path)
        self.file.publish()
        return digest

    def __enter__(self) -> "_Staged":
        return self

    def __exit__(self, kind, exc, tb) -> None:
        if not self.sink.closed:
            self.sink.close()
        self.file.__exit__(kind, exc, tb)  # an unpublished file is removed; a disk error names its directory


def window_schema(window_bytes: int) -> pa.Schema:
    return pa.schema([pa.field("window", pa.binary(window_bytes)), pa.field("doc", pa.int64())])


def read_part(cfg: CampaignConfig, part: Part, stage: Store, keep_keys: int) -> PartStats:
    """Pack one part: held-out documents (corpus.test_fraction, by document name) become evaluation windows,
    the rest train sequences, each packed on its own within the part. Stages both; a part without windows
    stages no window file."""
    stats = PartStats(part.index)
    with (
        stage.scratch() if not stage.local else nullcontext() as tmp,
        _Staged(schema(cfg.shards.seq_bytes), stage, SEQS.format(part.index), tmp) as seqs,
        _Staged(window_schema(cfg.eval.window_bytes), stage, WINDOWS.format(part.index), tmp) as windows,
    ):
        train = Packer(cfg.shards.seq_bytes)
        test = Packer(cfg.eval.window_bytes, owner_at=cfg.eval.context_bytes + 1)
        names: dict[int, tuple[str, str]] = {}  # held-out documents that own no window yet: (name, source)
        batch: list[bytes] = []
        sources = _SourceIndex(stats.seq_sources)  # train documents' sources, by their index in `train`

        def flush_seqs() -> None:
            for s in batch:
                seqs.add(s)
            k = row_keys(cfg.seed, part.index, stats.seqs, len(batch))
            stats.lowest_keys = lowest(np.concatenate([stats.lowest_keys, k]), keep_keys)
            stats.seqs += len(batch)
            batch.clear()

        for doc in part_documents(cfg.corpus, part, stats.sources, stats.skipped, stats.formats):
            stats.documents += 1
            stats.bytes += len(doc.data)
            if is_test_doc(doc.doc_id, cfg.corpus.test_fraction, cfg.seed):
                stats.test_documents += 1
                names[test.n_docs] = (doc.doc_id, doc.source)
                for w, owner in test.add(doc.data):
                    windows.add(w, owner_id(part.index, owner))
                    stats.windows += 1
                    if owner in names:  # its first window: the document's name and source are kept once
                        stats.test_docs.append([owner_id(part.index, owner), *names.pop(owner)])
                        for passed in [k for k in names if k < owner]:  # owners only grow: these own none
                            del names[passed]
            else:
                sources.add(train.n_docs, doc.source)
                for s, owner in train.add(doc.data):
                    batch.append(s)
                    sources.sequence(owner)
                if len(batch) >= WRITE_ROWS:
                    flush_seqs()
        flush_seqs()
        seqs.publish()
        stage.write_bytes(SEQ_SOURCES.format(part.index), sources.npy())
        if stats.windows:
            stats.windows_sha256 = windows.publish()
    return stats


class _SourceIndex:
    """The source of each train sequence of a part as it is packed: documents' sources by their index in the packer
    (only those that may still own a sequence are kept: owners only grow), and each sequence's as an index into
    `labels` (PartStats.seq_sources), which holds the sources of some sequence only, so S = max index + 1."""

    def __init__(self, labels: list[str]):
        self.labels = labels
        self.index: dict[str, int] = {}
        self.docs: dict[int, str] = {}  # packer document index -> its source
        self.seqs: list[int] = []

    def add(self, doc: int, label: str) -> None:
        self.docs[doc] = label

    def sequence(self, owner: int) -> None:
        label = self.docs[owner]
        if label not in self.index:
            self.index[label] = len(self.labels)
            self.labels.append(label)
        self.seqs.append(self.index[label])
        for passed in [d for d in self.docs if d < owner]:
            del self.docs[passed]

    def npy(self) -> bytes:
        buf = io.BytesIO()
        np.save(buf, np.array(self.seqs, dtype=np.int32))
        return buf.getvalue()


def read_seqs(stage: Store, part: int, cache_dir: str) -> pa.FixedSizeBinaryArray:
    """A part's staged train sequences."""
    path = stage.local_copy(SEQS.format(part), cache_dir)
    return ipc.open_file(pa.memory_map(os.fsencode(path), "r")).read_all().column(COLUMN).combine_chunks()


def _seqs_and_keys(seed: int, stage: Store, part: int, cache_dir: str) -> tuple[pa.FixedSizeBinaryArray, np.ndarray]:
    seqs = read_seqs(stage, part, cache_dir)
    return seqs, row_keys(seed, part, 0, len(seqs))


def sample_part(seed: int, stage: Store, part: int, below: int, cache_dir: str) -> tuple[np.ndarray, list[bytes]]:
    """(keys, sequences) of the part's rows with key <= below."""
    seqs, keys = _seqs_and_keys(seed, stage, part, cache_dir)
    take = np.flatnonzero(keys <= np.uint64(below))
    return keys[take], [seqs[int(i)].as_py() for i in take]


def embed_part(
    seed: int, router: Router, stage: Store, part: int, below: int | None, cache_dir: str
) -> tuple[np.ndarray, np.ndarray]:
    """Embed every sequence of a part (staged beside them); returns (keys, embeddings) of the rows with
    key <= below (the offsets' refit sample; none for None)."""
    seqs, keys = _seqs_and_keys(seed, stage, part, cache_dir)
    rows = rows_to_numpy(seqs, seqs.type.byte_width)
    emb = np.zeros((len(rows), router.centroids.shape[1]), np.float32)
    for a in range(0, len(rows), EMBED_ROWS):
        emb[a : a + EMBED_ROWS] = router.embed([router_text(s.tobytes()) for s in rows[a : a + EMBED_ROWS]])
    buf = io.BytesIO()
    np.save(buf, emb)
    stage.write_bytes(EMBEDDINGS.format(part), buf.getvalue())
    take = np.flatnonzero(keys <= np.uint64(below)) if below is not None else np.zeros(0, np.int64)
    return keys[take], emb[take]


def label_part(router: Router, stage: Store, part: int, cache_dir: str) -> np.ndarray:
    """(n,) the expert of each of a part's sequences under the router's rule (in SCORE_BATCH blocks from the
    part's first row, so the scores are the same arithmetic in every engine)."""
    emb = np.load(stage.local_copy(EMBEDDINGS.format(part), cache_dir), mmap_mode="r")
    return router.assign(emb)


def count_part(router: Router, stage: Store, part: int, cache_dir: str) -> np.ndarray:
    """(S, N) how many of a part's sequences of each source (PartStats.seq_sources, S of them) each expert gets;
    its column sums are the experts' sizes."""
    experts = label_part(router, stage, part, cache_dir)
    sources = np.load(stage.local_copy(SEQ_SOURCES.format(part), cache_dir)).astype(np.int64)
    if len(sources) != len(experts):  # staged by the same read_part: a mismatch is a bug, not bad input
        raise ValueError(f"part {part}: {len(sources)} staged sources for {len(experts)} sequences")
    n, n_sources = router.n_experts, int(sources.max()) + 1 if len(sources) else 0
    return np.bincount(sources * n + experts, minlength=n_sources * n).reshape(n_sources, n)


def write_part(
    router: Router,
    stage: Store,
    store: Store,
    part: int,
    before: np.ndarray,
    val_every: int,
    rows_per_file: int,
    cache_dir: str,
) -> dict[int, dict[str, list[dict]]]:
    """A part's sequences into the campaign's shard files; before[e]: expert e's sequences in earlier parts; one in
    val_every of an expert's sequences is val (soma_cluster.shards.ValSplit)."""
    seqs = read_seqs(stage, part, cache_dir)
    return write_part_shards(
        store, part, seqs, label_part(router, stage, part, cache_dir), before, val_every, rows_per_file
    )


def select(keys: np.ndarray, values, below: int):
    """The rows with key <= below from gathered (keys, values), in key order."""
    order = np.argsort(keys, kind="stable")
    order = order[keys[order] <= np.uint64(below)]
    if isinstance(values, np.ndarray):
        return keys[order], values[order]
    return keys[order], [values[int(i)] for i in order]
