"""The Ray engine of `soma prepare`: soma_cluster.parts' per-part work as Ray Data operators on the cluster's CPU
workers, driven by pipelines.prepare.prepare_with (the same driver as the local engine, hence the same campaign).
It knows the driver only by what pipelines.prepare_engine says an engine is asked for and hands back.

- read: one task per part reads its files (local paths every node sees, or s3://), packs them and stages the
  train sequences and test windows under the campaign's hidden .soma-staging/ prefix; only counts and each part's
  lowest keys come back to the driver.
- sample: tasks send back the router's fit sample (the sequences of lowest key).
- embed, count, write: tasks on the same pool of worker processes, each of which loads the router once from the
  staged router files (never a pickled sklearn object; Ray reuses a task's process, and an actor pool per stage
  cost each stage ~2 s of process start and imports), embed every sequence (staged beside it), count each part's
  sequences per expert, then write each part's files of every expert's shard straight into the campaign (a
  part's files are its own, and the counts of the parts before it place its sequences in each expert's corpus
  order: no shuffle).

The driver holds only the samples (router.sample_chunks texts, router.refit_rows embeddings), the parts' lowest
keys and the manifests; the corpus never passes through it. The built-in corpus is the files of the driver's own
machine, so its one part is read by the driver. Bad input found by a worker (a corrupt Parquet row group, a JSONL
line that is not JSON, a missing column) comes back as one error naming the file; a failed prepare removes its
staging, and, when the campaign directory was empty, everything it wrote (campaign.yaml included).
Each task records its own CPU and wall seconds when SOMA_TASK_TIMES names a directory (soma_cluster.stagecost;
benchmarks/bench_prepare.py), and does nothing more otherwise.
"""

from __future__ import annotations

import json
import logging
import tempfile
from dataclasses import asdict

import numpy as np
import pyarrow as pa

from pipelines.common import console, open_store
from pipelines.prepare_engine import Routed
from soma_cluster.config import CampaignConfig
from soma_cluster.corpus import CorpusFile, Part
from soma_cluster.errors import SomaError
from soma_cluster.parts import SEQS, PartStats, count_part, embed_part, read_part, sample_part, write_part
from soma_cluster.router import Router, load_router, save_router
from soma_cluster.shards import rows_to_numpy
from soma_cluster.stagecost import TaskClock
from soma_cluster.storage import STAGING as STAGING_ROOT
from soma_cluster.storage import Store

STAGING = f"{STAGING_ROOT}/prepare"  # hidden: listings leave it out, and all of .soma-staging/ goes at the end


def _part(row_json: str) -> Part:
    spec = json.loads(row_json)
    return Part(spec["index"], tuple(CorpusFile(**f) for f in spec["files"]))


def _read(batch: dict, cfg_json: str, stage_url: str, options: dict, keep: int) -> dict:
    cfg = CampaignConfig.model_validate_json(cfg_json)
    part = _part(batch["spec"][0])
    clock = TaskClock("read", part.index)
    try:
        st = read_part(cfg, part, Store(stage_url, options), keep)
    except SomaError as exc:  # bad input comes back as data: Ray Data would wrap it in its own exception
        return {
            "stats": np.array([""], dtype=object),
            "keys": np.array([b""], dtype=object),
            "node": np.array([_node_id()], dtype=object),
            "error": np.array([str(exc)], dtype=object),
        }
    body = asdict(st)
    keys = body.pop("lowest_keys")
    clock.done(_node_id)
    return {
        "stats": np.array([json.dumps(body)], dtype=object),
        "keys": np.array([keys.astype("<u8").tobytes()], dtype=object),
        "node": np.array([_node_id()], dtype=object),
        "error": np.array([""], dtype=object),
    }


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


def _sample(batch: dict, seed: int, stage_url: str, options: dict, below: int, seq_bytes: int) -> pa.Table:
    clock = TaskClock("sample", int(batch["part"][0]))
    with tempfile.TemporaryDirectory(prefix="soma-sample-") as tmp:
        keys, seqs = sample_part(seed, Store(stage_url, options), int(batch["part"][0]), below, tmp)
    out = pa.table({"key": pa.array(keys, pa.uint64()), "seq": pa.array(seqs, pa.binary(seq_bytes))})
    clock.done(_node_id)
    return out


_ROUTER: dict[str, Router] = {}  # this worker process's router, by its files' digests: loaded once per process


def _router(stage_url: str, options: dict, router_dir: str) -> Router:
    """The router saved under the staging prefix, loaded once per worker process (Ray reuses a task's process
    for the next task), never a pickled sklearn object. Known by the sha256 of its files, not its path (a later
    prepare of the same campaign stages another router there); only the latest is kept."""
    store = Store(f"{stage_url}/{router_dir}", options)
    key = json.dumps(store.read_json("router/router.json")["files"], sort_keys=True)
    if key not in _ROUTER:
        _ROUTER.clear()
        _ROUTER[key] = load_router(store)
    return _ROUTER[key]


def _embed(batch: dict, stage_url: str, options: dict, router_dir: str, seed: int, below: int | None) -> pa.Table:
    clock = TaskClock("embed", int(batch["part"][0]))
    router = _router(stage_url, options, router_dir)
    with tempfile.TemporaryDirectory(prefix="soma-embed-") as tmp:
        keys, emb = embed_part(seed, router, Store(stage_url, options), int(batch["part"][0]), below, tmp)
    width = emb.shape[1] * 4  # rows as fixed-size binary: an empty refit sample converts too
    # the array's own memory as the column's buffer (no copy of it in the task; Ray copies it once into the store)
    data = pa.py_buffer(np.ascontiguousarray(emb))
    rows = pa.FixedSizeBinaryArray.from_buffers(pa.binary(width), len(emb), [None, data])
    out = pa.table({"key": pa.array(keys, pa.uint64()), "emb": rows})
    clock.done(_node_id)
    return out


def _count(batch: dict, stage_url: str, options: dict, router_dir: str) -> dict:
    part = int(batch["part"][0])
    clock = TaskClock("count", part)
    with tempfile.TemporaryDirectory(prefix="soma-count-") as tmp:
        table = count_part(_router(stage_url, options, router_dir), Store(stage_url, options), part, tmp)
    clock.done(_node_id)
    # (S, N) of this part, S its own: as bytes with its row count (parts' S differ, so no fixed-shape column)
    return {
        "part": np.array([part]),
        "rows": np.array([table.shape[0]]),
        "table": np.array([table.astype("<i8").tobytes()], dtype=object),
    }


def _write(
    batch: dict,
    stage_url: str,
    options: dict,
    router_dir: str,
    campaign_url: str,
    val_every: int,
    rows_per_file: int,
) -> dict:
    """A part's sequences into the campaign's shard files (every part's files are its own: no shuffle)."""
    part = int(batch["part"][0])
    clock = TaskClock("write", part)
    with tempfile.TemporaryDirectory(prefix="soma-write-") as tmp:
        written = write_part(
            _router(stage_url, options, router_dir),
            Store(stage_url, options),
            Store(campaign_url, options),
            part,
            batch["before"][0],
            val_every,
            rows_per_file,
            tmp,
        )
    clock.done(_node_id)
    return {"part": np.array([part]), "written": np.array([json.dumps(written)], dtype=object)}


class RayEngine:
    """The per-part work as Ray Data operators; staging under the campaign (every worker reaches it)."""

    def __init__(self, store: Store, cfg: CampaignConfig):
        import ray.data

        self.rd = ray.data
        self.cfg, self.store = cfg, store
        self.stage = open_store(f"{store.url}/{STAGING}", store.storage_options)
        self.options = store.storage_options
        self.cfg_json = cfg.model_dump_json()
        workers = cfg.prepare.workers or None
        self.tasks = dict(num_cpus=1, compute=ray.data.TaskPoolStrategy(size=workers))

    def _parts(self, parts: list[int]):
        return self.rd.from_items([{"part": p} for p in parts], override_num_blocks=max(1, len(parts)))

    def _save_router(self, router: Router, name: str) -> str:
        save_router(open_store(f"{self.stage.url}/{name}", self.options), router)
        return name

    def read(self, parts: list[Part], keep_keys: int) -> list[PartStats]:
        out = [read_part(self.cfg, p, self.stage, keep_keys) for p in parts if p.named]  # the driver's own files
        remote = [p for p in parts if not p.named]
        if remote:
            console.print(f"reading {len(remote)} parts on the cluster")
            rows = [{"spec": json.dumps({"index": p.index, "files": [asdict(f) for f in p.files]})} for p in remote]
            ds = self.rd.from_items(rows, override_num_blocks=len(rows)).map_batches(
                _read,
                batch_size=1,
                fn_kwargs=dict(cfg_json=self.cfg_json, stage_url=self.stage.url, options=self.options, keep=keep_keys),
                **self.tasks,
            )
            nodes = set()
            for row in ds.iter_rows():
                if row["error"]:
                    raise SomaError(row["error"])
                body = json.loads(row["stats"])
                out.append(PartStats(**body, lowest_keys=np.frombuffer(row["keys"], dtype="<u8").astype(np.uint64)))
                nodes.add(row["node"])
            unseen = [p.index for p in remote if not self.stage.exists(SEQS.format(p.index))]
            if unseen:
                raise SomaError(
                    f"the Ray workers staged parts {unseen[:5]} where this driver cannot see them: the campaign "
                    f"{self.store.url} must be on storage every node reaches (s3://, or a filesystem shared by all "
                    "nodes)"
                )
            console.print(f"read {len(remote)} parts on {len(nodes)} node{'s' * (len(nodes) > 1)}")
        return sorted(out, key=lambda st: st.part)

    def sample(self, parts: list[int], below: int) -> tuple[np.ndarray, list[bytes]]:
        ds = self._parts(parts).map_batches(
            _sample,
            batch_size=1,
            batch_format="numpy",
            **self.tasks,
            fn_kwargs=dict(
                seed=self.cfg.seed,
                stage_url=self.stage.url,
                options=self.options,
                below=below,
                seq_bytes=self.cfg.shards.seq_bytes,
            ),
        )
        keys, seqs = [], []
        for batch in ds.iter_batches(batch_format="pyarrow", batch_size=None):
            keys.append(batch.column("key").to_numpy())
            seqs += batch.column("seq").to_pylist()
        return (np.concatenate(keys) if keys else np.zeros(0, np.uint64)), seqs

    def embed(self, router: Router, parts: list[int], below: int | None) -> tuple[np.ndarray, np.ndarray]:
        name = self._save_router(router, "router-fit")
        console.print(f"embedding {len(parts)} parts on the cluster")
        ds = self._parts(parts).map_batches(
            _embed,
            batch_size=1,
            **self.tasks,
            fn_kwargs=dict(
                stage_url=self.stage.url, options=self.options, router_dir=name, seed=self.cfg.seed, below=below
            ),
        )
        keys, emb = [np.zeros(0, np.uint64)], [np.zeros((0, router.centroids.shape[1]), np.float32)]
        for batch in ds.iter_batches(batch_format="pyarrow", batch_size=None):
            keys.append(batch.column("key").to_numpy())
            col = batch.column("emb").combine_chunks()
            emb.append(rows_to_numpy(col, col.type.byte_width).view(np.float32).copy())
        return np.concatenate(keys), np.concatenate(emb)

    def count(self, router: Router, parts: list[int]) -> tuple[list[np.ndarray], Routed]:
        """Each part's sequences per source and expert (parts.count_part); the router is staged for the workers
        here, and `write` is handed where (the returned Routed)."""
        router_dir = self._save_router(router, "router")
        ds = self._parts(parts).map_batches(
            _count,
            batch_size=1,
            **self.tasks,
            fn_kwargs=dict(stage_url=self.stage.url, options=self.options, router_dir=router_dir),
        )
        tables = {}
        for batch in ds.iter_batches(batch_format="numpy", batch_size=None):
            for p, rows, raw in zip(batch["part"].tolist(), batch["rows"].tolist(), batch["table"], strict=True):
                tables[p] = np.frombuffer(raw, dtype="<i8").reshape(rows, router.n_experts).astype(np.int64)
        return [tables[p] for p in parts], Routed(router, router_dir)

    def write(
        self, store: Store, cfg: CampaignConfig, routed: Routed, parts: list[int], before: np.ndarray, val_every: int
    ) -> list[dict]:
        if routed.staged is None:
            raise ValueError("RayEngine.write needs the router its own count staged")
        console.print(f"writing {len(parts)} parts of the {cfg.n_experts} experts' shards from the cluster")
        rows = [{"part": p, "before": b} for p, b in zip(parts, before, strict=True)]
        ds = self.rd.from_items(rows, override_num_blocks=max(1, len(rows))).map_batches(
            _write,
            batch_size=1,
            **self.tasks,
            fn_kwargs=dict(
                stage_url=self.stage.url,
                options=self.options,
                router_dir=routed.staged,
                campaign_url=store.url,
                val_every=val_every,
                rows_per_file=cfg.shards.rows_per_file,
            ),
        )
        written = {}
        for row in ds.iter_rows():
            written[int(row["part"])] = {int(e): files for e, files in json.loads(row["written"]).items()}
        return [written[p] for p in parts]


def quiet_ray_data() -> None:
    """Ray Data's own progress bars and INFO lines off: stages are reported by ours."""
    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    log = logging.getLogger("ray.data")
    log.setLevel(logging.WARNING)
    if not any(isinstance(f, _NoBarsNote) for f in log.filters):
        log.addFilter(_NoBarsNote())


class _NoBarsNote(logging.Filter):
    """Ray Data's note that its progress bars are off (we turned them off) is not a warning to the operator."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Progress bars disabled")
