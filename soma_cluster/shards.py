"""Per-expert Arrow IPC shards: train-*.arrow and val.arrow with one fixed_size_binary column.

Writers stream record batches (bounded memory per expert); readers memory-map the files and
verify each file's checksum against the manifest before use.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from soma_cluster.errors import ChecksumError, SomaError
from soma_cluster.storage import Store, file_sha256, put_file

COLUMN = "seq"
BATCH_ROWS = 1024


def expert_name(expert: int) -> str:
    return f"expert-{int(expert):04d}"


def val_every(val_fraction: float) -> int:
    """One sequence in this many of an expert's (in corpus order) is val."""
    return max(2, round(1.0 / val_fraction))


def schema(seq_bytes: int) -> pa.Schema:
    return pa.schema([pa.field(COLUMN, pa.binary(seq_bytes))])


def rows_to_numpy(arr: pa.FixedSizeBinaryArray, seq_bytes: int) -> np.ndarray:
    """Zero-copy (rows, seq_bytes) uint8 view of a fixed_size_binary array."""
    buf = arr.buffers()[1]
    flat = np.frombuffer(buf, dtype=np.uint8)
    return flat[arr.offset * seq_bytes:(arr.offset + len(arr)) * seq_bytes].reshape(len(arr), seq_bytes)


class _ArrowFile:
    """One IPC file being written in a local temp directory, moved into the campaign on close."""

    def __init__(self, store: Store, rel: str, seq_bytes: int, tmpdir: str):
        self.store, self.rel, self.seq_bytes = store, rel, seq_bytes
        fd, self.path = tempfile.mkstemp(dir=tmpdir, suffix=".arrow")
        os.close(fd)
        self.sink = pa.OSFile(self.path, "wb")
        self.writer = ipc.new_file(self.sink, schema(seq_bytes))
        self.rows = 0

    def write(self, rows: list[bytes]) -> None:
        self.writer.write_batch(pa.record_batch([pa.array(rows, type=pa.binary(self.seq_bytes))], schema=schema(self.seq_bytes)))
        self.rows += len(rows)

    def close(self) -> dict:
        self.writer.close()
        self.sink.close()
        entry = {"name": self.rel.rsplit("/", 1)[-1], "rows": self.rows, "bytes": os.path.getsize(self.path), "sha256": file_sha256(self.path)}
        put_file(self.store, self.path, self.rel)
        return entry


class ExpertWriter:
    """Streams one expert's sequences into train-*.arrow files of rows_per_file rows and val.arrow: every
    `val_every`-th sequence added is val. The files depend only on the order the sequences come in."""

    def __init__(self, store: Store, expert: int, seq_bytes: int, val_fraction: float, rows_per_file: int, tmpdir: str):
        self.store, self.expert, self.seq_bytes, self.rows_per_file, self.tmpdir = store, expert, seq_bytes, rows_per_file, tmpdir
        self.val_every = val_every(val_fraction)
        self.seen = 0
        self.pending: dict[str, list[bytes]] = {"train": [], "val": []}
        self.open: dict[str, _ArrowFile] = {}
        self.done: dict[str, list[dict]] = {"train": [], "val": []}

    def add(self, seq: bytes) -> None:
        kind = "val" if self.seen % self.val_every == self.val_every - 1 else "train"
        self.seen += 1
        buf = self.pending[kind]
        buf.append(seq)
        if len(buf) >= min(BATCH_ROWS, self.rows_per_file):
            self._flush(kind)

    def _flush(self, kind: str) -> None:
        rows, self.pending[kind] = self.pending[kind], []
        if not rows:
            return
        if kind not in self.open:
            name = "val.arrow" if kind == "val" else f"train-{len(self.done['train']):05d}.arrow"
            self.open[kind] = _ArrowFile(self.store, f"shards/{expert_name(self.expert)}/{name}", self.seq_bytes, self.tmpdir)
        f = self.open[kind]
        f.write(rows)
        if kind == "train" and f.rows >= self.rows_per_file:
            self.done["train"].append(self.open.pop(kind).close())

    def close(self) -> dict:
        """Flush, write the expert's manifest.json; returns it."""
        for kind in ("train", "val"):
            self._flush(kind)
        for kind, f in list(self.open.items()):
            self.done[kind].append(f.close())
        self.open.clear()
        m = {"expert": self.expert, "seq_bytes": self.seq_bytes, "train": self.done["train"], "val": self.done["val"],
             "train_rows": sum(x["rows"] for x in self.done["train"]), "val_rows": sum(x["rows"] for x in self.done["val"])}
        self.store.write_json(f"shards/{expert_name(self.expert)}/manifest.json", m)
        return m


class ShardWriter:
    """Every expert's ExpertWriter, fed in corpus order."""

    def __init__(self, store: Store, n_experts: int, seq_bytes: int, val_fraction: float, rows_per_file: int):
        self.tmp = tempfile.TemporaryDirectory(prefix="soma-shards-")
        self.experts = [ExpertWriter(store, e, seq_bytes, val_fraction, rows_per_file, self.tmp.name) for e in range(n_experts)]

    def add(self, expert: int, seq: bytes) -> None:
        self.experts[expert].add(seq)

    def close(self) -> list[dict]:
        """Flush everything, write one manifest per expert; returns those manifests."""
        manifests = [w.close() for w in self.experts]
        self.tmp.cleanup()
        return manifests


@dataclass
class Shard:
    """An expert's sequences, memory-mapped: `train` and `val` are lists of (rows, seq_bytes) uint8 views."""
    expert: int
    seq_bytes: int
    train: list[np.ndarray]
    val: list[np.ndarray]

    @property
    def n_train(self) -> int:
        return sum(len(a) for a in self.train)

    def gather(self, rows: np.ndarray, split: str = "train") -> np.ndarray:
        """Rows by global index across the split's files -> (len(rows), seq_bytes) copy."""
        parts = self.train if split == "train" else self.val
        bounds = np.cumsum([0] + [len(a) for a in parts])
        f = np.searchsorted(bounds, rows, side="right") - 1
        return np.stack([parts[fi][r - bounds[fi]] for fi, r in zip(f, rows)]) if len(rows) else np.zeros((0, self.seq_bytes), np.uint8)


def _open_file(path: str, entry: dict, seq_bytes: int, where: str) -> np.ndarray:
    if not os.path.exists(path):
        raise SomaError(f"shard file {where} is missing; re-run soma prepare on a new campaign URL")
    if file_sha256(path) != entry["sha256"]:
        raise ChecksumError(f"shard file {where} fails its checksum (corrupt); re-run soma prepare on a new campaign URL")
    try:
        reader = ipc.open_file(pa.memory_map(path, "r"))
        table = reader.read_all()
    except pa.ArrowInvalid:
        raise ChecksumError(f"shard file {where} is not a readable Arrow IPC file; re-run soma prepare") from None
    col = table.column(COLUMN).combine_chunks()
    if len(col) != entry["rows"]:
        raise ChecksumError(f"shard file {where} holds {len(col)} rows, manifest says {entry['rows']}; re-run soma prepare")
    return rows_to_numpy(col, seq_bytes)


def open_shard(store: Store, expert: int, cache_dir: str | None = None) -> Shard:
    base = f"shards/{expert_name(expert)}"
    manifest = store.read_json(f"{base}/manifest.json")
    cache = cache_dir or os.path.join(tempfile.gettempdir(), "soma-cache")
    seq_bytes = manifest["seq_bytes"]
    splits = {}
    for split in ("train", "val"):
        splits[split] = [_open_file(store.local_copy(f"{base}/{e['name']}", cache, e["sha256"]), e, seq_bytes, f"{store.url}/{base}/{e['name']}")
                         for e in manifest[split]]
    return Shard(expert, seq_bytes, splits["train"], splits["val"])
