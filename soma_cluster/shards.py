"""Per-expert Arrow IPC shards: train-*.arrow and val-*.arrow (one or more per corpus part) with one
fixed_size_binary column.

Prepare writes them a corpus part at a time (every part's files are its own, so parts are written in
parallel); readers memory-map the files and verify each file's checksum against the manifest before use.
"""

from __future__ import annotations

import logging
import os
import tempfile
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from soma_cluster.diskerrors import condition_of
from soma_cluster.errors import ChecksumError, SomaError
from soma_cluster.jobs import expert_name
from soma_cluster.storage import Store, file_sha256, sha256

log = logging.getLogger(__name__)

COLUMN = "seq"
BATCH_ROWS = 1024


def val_every(val_fraction: float) -> int:
    """One sequence in this many of an expert's (in corpus order) is val."""
    return max(2, round(1.0 / val_fraction))


MAX_VAL_SHARE = 0.1  # the most of a shard that expert validation is raised to (unless shards.val_fraction asks more)


@dataclass(frozen=True)
class ValSplit:
    """How a campaign's shards are split into train and expert validation: one sequence in `every` (in corpus order)
    is val. shards.val_fraction is the least share; it is raised (up to MAX_VAL_SHARE) so that the smallest shard's
    val holds `wanted` sequences, what one validation pass reads (train.val_batches x spsa.batch): a validation that
    reads one sequence over and over drives the learning-rate schedule on noise."""

    every: int
    wanted: int  # sequences one validation pass reads
    configured: int  # the `every` shards.val_fraction alone gives

    @property
    def raised(self) -> bool:
        return self.every < self.configured

    def val_rows(self, n: int) -> int:
        """Val sequences of a shard of n."""
        return n // self.every


def val_split(val_fraction: float, wanted: int, smallest: int) -> ValSplit:
    """The split for shards whose smallest holds `smallest` sequences (see ValSplit)."""
    configured = val_every(val_fraction)
    every = configured
    if smallest // configured < wanted:
        cap = val_every(max(MAX_VAL_SHARE, val_fraction))
        every = max(cap, min(configured, smallest // max(wanted, 1)))
    return ValSplit(every, wanted, configured)


def schema(seq_bytes: int) -> pa.Schema:
    return pa.schema([pa.field(COLUMN, pa.binary(seq_bytes))])


def rows_to_numpy(arr: pa.FixedSizeBinaryArray, seq_bytes: int) -> np.ndarray:
    """Zero-copy (rows, seq_bytes) uint8 view of a fixed_size_binary array."""
    buf = arr.buffers()[1]
    flat = np.frombuffer(buf, dtype=np.uint8)
    return flat[arr.offset * seq_bytes : (arr.offset + len(arr)) * seq_bytes].reshape(len(arr), seq_bytes)


def write_rows(store: Store, rel: str, rows: pa.FixedSizeBinaryArray, scratch: str | None = None) -> dict:
    """One shard file of `rows` (record batches of BATCH_ROWS) at rel; returns its manifest entry. Staged beside
    its target on a local store (an atomic rename wherever the campaign lives), in `scratch` for a remote one."""
    seq_bytes = rows.type.byte_width
    with store.stage_file(rel, ".arrow", scratch) as staged:
        with pa.OSFile(os.fsencode(staged.path), "wb") as sink, ipc.new_file(sink, schema(seq_bytes)) as writer:
            for a in range(0, len(rows), BATCH_ROWS):
                writer.write_batch(pa.record_batch([rows.slice(a, BATCH_ROWS)], schema=schema(seq_bytes)))
        entry = {
            "name": rel.rsplit("/", 1)[-1],
            "rows": len(rows),
            "bytes": os.path.getsize(staged.path),
            "sha256": file_sha256(staged.path),
        }
        staged.publish()
    return entry


def write_part_shards(
    store: Store,
    part: int,
    seqs: pa.FixedSizeBinaryArray,
    labels: np.ndarray,
    before: np.ndarray,
    every: int,
    rows_per_file: int,
) -> dict[int, dict[str, list[dict]]]:
    """A corpus part's sequences into each expert's shard: shards/expert-E/train-PPPPP-KK.arrow (at most
    rows_per_file rows each) and val-PPPPP.arrow. `before[e]` counts expert e's sequences in the parts before
    this one: an expert's sequences, in corpus order, are val at every `every`-th place (ValSplit.every). Returns
    {expert: {"train": entries, "val": entries}} for the experts with rows here."""
    order = np.argsort(labels, kind="stable")  # by expert, corpus order within each
    bounds = np.concatenate([[0], np.cumsum(np.bincount(labels, minlength=len(before)))])
    out: dict[int, dict[str, list[dict]]] = {}
    with store.scratch() if not store.local else nullcontext() as tmp:
        for e in np.flatnonzero(np.diff(bounds)).tolist():
            idx = order[bounds[e] : bounds[e + 1]]
            val = (before[e] + np.arange(len(idx))) % every == every - 1
            base = f"shards/{expert_name(e)}"
            train = seqs.take(pa.array(idx[~val]))
            files = {
                "train": [
                    write_rows(store, f"{base}/train-{part:05d}-{k:02d}.arrow", train.slice(a, rows_per_file), tmp)
                    for k, a in enumerate(range(0, len(train), rows_per_file))
                ],
                "val": [],
            }
            if val.any():
                files["val"].append(
                    write_rows(store, f"{base}/val-{part:05d}.arrow", seqs.take(pa.array(idx[val])), tmp)
                )
            out[e] = files
    return out


def write_manifests(
    store: Store, n_experts: int, seq_bytes: int, written: list[dict[int, dict[str, list[dict]]]]
) -> list[dict]:
    """Every expert's manifest.json from the parts' written files (in part order); returns the manifests."""
    manifests = []
    for e in range(n_experts):
        files = {
            split: [entry for part in written for entry in part.get(e, {}).get(split, [])] for split in ("train", "val")
        }
        m = {
            "expert": e,
            "seq_bytes": seq_bytes,
            **files,
            "train_rows": sum(x["rows"] for x in files["train"]),
            "val_rows": sum(x["rows"] for x in files["val"]),
        }
        store.write_json(f"shards/{expert_name(e)}/manifest.json", m)
        manifests.append(m)
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
        return (
            np.stack([parts[fi][r - bounds[fi]] for fi, r in zip(f, rows, strict=True)])
            if len(rows)
            else np.zeros((0, self.seq_bytes), np.uint8)
        )


def _open_file(path: str, entry: dict, seq_bytes: int, where: str) -> np.ndarray:
    if not os.path.exists(path):
        raise SomaError(f"shard file {where} is missing; re-run soma prepare on a new campaign URL")
    if file_sha256(path) != entry["sha256"]:
        raise ChecksumError(
            f"shard file {where} fails its checksum (corrupt); re-run soma prepare on a new campaign URL"
        )
    return _rows(pa.memory_map(os.fsencode(path), "r"), entry, seq_bytes, where)


def _rows(source, entry: dict, seq_bytes: int, where: str) -> np.ndarray:
    try:
        table = ipc.open_file(source).read_all()
    except pa.ArrowInvalid:
        raise ChecksumError(f"shard file {where} is not a readable Arrow IPC file; re-run soma prepare") from None
    col = table.column(COLUMN).combine_chunks()
    if len(col) != entry["rows"]:
        raise ChecksumError(
            f"shard file {where} holds {len(col)} rows, manifest says {entry['rows']}; re-run soma prepare"
        )
    return rows_to_numpy(col, seq_bytes)


def _open_cached(store: Store, rel: str, entry: dict, seq_bytes: int, cache: str) -> np.ndarray:
    """A shard file through the local read cache (memory-mapped); where the cache cannot be written (the temp dir
    full, missing or read-only) the file is read into memory instead: a cache never fails a command."""
    where = f"{store.url}/{rel}"
    try:
        path = store.local_copy(rel, cache, entry["sha256"])
    except OSError as exc:
        if store.local or condition_of(exc) is None:
            raise
        log.warning("read cache %s unusable (%s): reading %s into memory", cache, condition_of(exc), where)
        data = store.read_bytes(rel)
        if sha256(data) != entry["sha256"]:
            raise ChecksumError(
                f"shard file {where} fails its checksum (corrupt); re-run soma prepare on a new campaign URL"
            ) from None
        return _rows(pa.BufferReader(data), entry, seq_bytes, where)
    return _open_file(path, entry, seq_bytes, where)


def open_shard(store: Store, expert: int, cache_dir: str | None = None) -> Shard:
    base = f"shards/{expert_name(expert)}"
    manifest = store.read_json(f"{base}/manifest.json")
    cache = cache_dir or os.path.join(tempfile.gettempdir(), "soma-cache")
    seq_bytes = manifest["seq_bytes"]
    splits = {
        split: [_open_cached(store, f"{base}/{e['name']}", e, seq_bytes, cache) for e in manifest[split]]
        for split in ("train", "val")
    }
    return Shard(expert, seq_bytes, splits["train"], splits["val"])
