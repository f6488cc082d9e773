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


class ShardWriter:
    """Streams sequences into per-expert train/val files; every `val_every`-th sequence of an expert is val."""

    def __init__(self, store: Store, n_experts: int, seq_bytes: int, val_fraction: float, rows_per_file: int):
        self.store, self.n, self.seq_bytes, self.rows_per_file = store, n_experts, seq_bytes, rows_per_file
        self.val_every = max(2, round(1.0 / val_fraction))
        self.tmp = tempfile.TemporaryDirectory(prefix="soma-shards-")
        self.seen = [0] * n_experts
        self.pending: dict[tuple[int, str], list[bytes]] = {}
        self.open: dict[tuple[int, str], _ArrowFile] = {}
        self.done: dict[int, dict[str, list[dict]]] = {e: {"train": [], "val": []} for e in range(n_experts)}
        self.train_files = [0] * n_experts

    def add(self, expert: int, seq: bytes) -> None:
        kind = "val" if self.seen[expert] % self.val_every == self.val_every - 1 else "train"
        self.seen[expert] += 1
        buf = self.pending.setdefault((expert, kind), [])
        buf.append(seq)
        if len(buf) >= min(BATCH_ROWS, self.rows_per_file):
            self._flush(expert, kind)

    def _flush(self, expert: int, kind: str) -> None:
        rows = self.pending.pop((expert, kind), [])
        if not rows:
            return
        key = (expert, kind)
        if key not in self.open:
            name = "val.arrow" if kind == "val" else f"train-{self.train_files[expert]:05d}.arrow"
            self.open[key] = _ArrowFile(self.store, f"shards/{expert_name(expert)}/{name}", self.seq_bytes, self.tmp.name)
        f = self.open[key]
        f.write(rows)
        if kind == "train" and f.rows >= self.rows_per_file:
            self.done[expert]["train"].append(self.open.pop(key).close())
            self.train_files[expert] += 1

    def close(self) -> list[dict]:
        """Flush everything, write one manifest per expert; returns those manifests."""
        for key in list(self.pending):
            self._flush(*key)
        for (expert, kind), f in list(self.open.items()):
            self.done[expert][kind].append(f.close())
        self.open.clear()
        manifests = []
        for e in range(self.n):
            m = {"expert": e, "seq_bytes": self.seq_bytes, "train": self.done[e]["train"], "val": self.done[e]["val"],
                 "train_rows": sum(x["rows"] for x in self.done[e]["train"]), "val_rows": sum(x["rows"] for x in self.done[e]["val"])}
            self.store.write_json(f"shards/{expert_name(e)}/manifest.json", m)
            manifests.append(m)
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
