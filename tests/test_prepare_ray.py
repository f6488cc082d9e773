"""prepare's two engines. The Ray engine (Ray Data) on a local Ray and on a real three-node cluster
(`ray.cluster_utils.Cluster`, loopback only) with the corpus and the campaign on the moto S3 server, against
the local engine: the same router, shards and test windows, file for file. Bad input found by a worker is
one error naming the file, and a failed prepare leaves nothing behind. The keyed sample is uniform over the
parts and reproducible from the seed."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import micro_config, soma
from support.s3server import s3  # noqa: F401

from pipelines.common import contents
from soma_cluster.config import CorpusConfig
from soma_cluster.corpus import plan_parts
from soma_cluster.errors import SomaError
from soma_cluster.parts import lowest, row_keys, threshold
from soma_cluster.shards import open_shard
from soma_cluster.storage import Store
from soma_cluster.textsources import builtin_documents

SKIP = ("campaign.yaml",)  # the engine is in the config (the ledger, holding wall time, is left out too)


def write_mixed_corpus(root: Path, max_bytes: int = 2_400_000) -> Path:
    """Real text in every format a user corpus has: JSONL, Parquet with small row groups, plain and gzipped
    text files; each JSONL and Parquet row has its document's built-in source as `lang` (a row label)."""
    root.mkdir(parents=True, exist_ok=True)
    docs = list(builtin_documents(max_bytes))
    for g in range(0, len(docs), 30):
        chunk, kind = docs[g : g + 30], (g // 30) % 4
        texts, langs = [d.data.decode("utf-8", "ignore") for d in chunk], [d.source for d in chunk]
        if kind == 0:
            rows = [{"text": t, "lang": lang} for t, lang in zip(texts, langs, strict=True)]
            (root / f"a{g:05d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        elif kind == 1:
            pq.write_table(pa.table({"text": texts, "lang": langs}), root / f"b{g:05d}.parquet", row_group_size=6)
        elif kind == 2:
            for j, d in enumerate(chunk):
                (root / f"c{g:05d}-{j:02d}.txt").write_bytes(d.data)
        else:
            (root / f"d{g:05d}.txt.gz").write_bytes(gzip.compress(b"\n\n".join(d.data for d in chunk)))
    return root


def campaign_digests(store: Store) -> dict[str, str]:
    """sha256 of every file of a campaign but those that hold the engine or wall time; the shard manifest
    without its wall time. The driver lease (who ran it, when) is not the campaign's content."""
    out = {}
    for rel in (rel for name in contents(store) for rel in store.walk(name)):
        if rel.rsplit("/", 1)[-1] in SKIP or rel.startswith("ledger"):
            continue
        data = store.read_bytes(rel)
        if rel == "shards/manifest.json":
            body = json.loads(data)
            for key in ("wall_seconds", "stage_seconds", "checksum"):
                body.pop(key)
            data = json.dumps(body, sort_keys=True).encode()
        out[rel] = hashlib.sha256(data).hexdigest()
    return out


def engine_config(source: str, engine: str, part_bytes: int = 300_000, **corpus):
    return micro_config(
        n_experts=6,
        corpus={"source": source, "max_bytes": 10**9, **corpus},
        prepare={"engine": engine, "part_bytes": part_bytes},
    )


@pytest.fixture(scope="module")
def cluster(s3):  # noqa: F811
    """Head (1 CPU) + 2 worker nodes (1 CPU each), every process on 127.0.0.1; the nodes reach the S3 server
    through the standard environment (endpoint and credentials), as pods would."""
    from ray.cluster_utils import Cluster

    tmp = tempfile.mkdtemp(prefix="soma-ray-p-", dir="/tmp")
    old = {k: os.environ.get(k) for k in [*s3.env(), "RAY_TMPDIR"]}
    os.environ.update(s3.env(), RAY_TMPDIR=tmp)
    try:
        c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0, "include_dashboard": False})
        for _ in range(2):
            c.add_node(num_cpus=1, num_gpus=0)
        c.wait_for_nodes(timeout=60)
        yield c
        c.shutdown()
    finally:
        for k, v in old.items():
            os.environ.pop(k, None) if v is None else os.environ.update({k: v})
        shutil.rmtree(tmp, ignore_errors=True)


def test_ray_engine_on_three_nodes_and_s3_equals_the_local_engine(cluster, s3, tmp_path, capfd):  # noqa: F811
    from pipelines.prepare import prepare

    local_corpus = write_mixed_corpus(tmp_path / "corpus")
    fs = s3.fs()
    fs.put(str(local_corpus) + "/", f"{s3.bucket}/corpus/", recursive=True)
    source = s3.url("corpus")
    stores = {e: Store(s3.url(f"camp-{e}"), s3.storage_options()) for e in ("local", "ray")}
    # The built-in text differs from machine to machine (man pages, licenses): parts sized from what was written
    on_disk = sum(f.stat().st_size for f in local_corpus.iterdir())
    summaries = {}
    labels = {"source_column": "lang", "source_patterns": {"c*.txt": "plain"}}  # rows labelled, files by pattern/type
    for engine, store in stores.items():
        cfg = engine_config(source, engine, part_bytes=on_disk // 8, **labels)
        summaries[engine] = prepare(store, cfg, cluster.address if engine == "ray" else None)
    read = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("read ") and " parts on " in ln]
    assert read and int(read[0].split(" on ")[1].split()[0]) >= 2, read  # the parts were read on several nodes
    a, b = (campaign_digests(s) for s in stores.values())
    assert a == b and len(a) > 20  # router, every shard file, test parts
    info = summaries["ray"]["corpus"]
    assert info["parts"] >= 5 and {"plain", "txt", "man-pages", "licenses"} <= set(info["sources"]), info["sources"]
    assert "jsonl" not in info["sources"] and "parquet" not in info["sources"]  # every row had its label
    assert summaries["ray"]["train_rows"] == summaries["local"]["train_rows"]
    # the source x expert table (shards/manifest.json, in the digests above too): the same from both engines
    assert summaries["ray"]["source_experts"] == summaries["local"]["source_experts"]
    assert sum(r["sequences"] for r in summaries["ray"]["source_experts"]) == info["train_sequences"]
    assert not stores["ray"].exists(".soma-staging")  # staging removed, directory and all
    print(
        f"identical: {len(a)} files ({sum(r.startswith('shards/') for r in a)} shard files and manifests, "
        f"{sum(r.startswith('test/') for r in a)} test, {sum(r.startswith('router/') for r in a)} router); "
        f"{info['parts']} parts, {info['documents']} documents, {info['train_sequences']} train sequences, "
        f"{info['test_windows']} test windows; "
        f"train rows {summaries['ray']['train_rows']}"
    )
    shard = open_shard(stores["ray"], 3, str(tmp_path / "cache"))  # what launch opens
    assert shard.n_train == summaries["ray"]["train_rows"][3]


def test_ray_engine_on_a_local_ray_equals_the_local_engine_on_the_builtin_corpus(ray_local, tmp_path):
    """The built-in corpus is the driver's own files: the driver reads its one part, the cluster does the rest."""
    from pipelines.prepare import prepare

    digests = []
    for engine in ("local", "ray"):
        store = Store(str(tmp_path / engine))
        prepare(store, micro_config(n_experts=4, prepare={"engine": engine}))
        digests.append(campaign_digests(store))
    assert digests[0] == digests[1]


def _bad_corpora(root: Path) -> dict[str, tuple[Path, str]]:
    """name -> (corpus dir, what the error must say)."""
    out = {}
    good = write_mixed_corpus(root / "good", 400_000)

    def variant(name: str, write) -> Path:
        d = root / name
        shutil.copytree(good, d)
        write(d)
        return d

    out["json"] = (
        variant("json", lambda d: (d / "z-broken.jsonl").write_text('{"text": "fine"}\n{"text": "cut\n')),
        r"z-broken\.jsonl line 2 is not JSON",
    )
    out["column"] = (
        variant("column", lambda d: pq.write_table(pa.table({"body": ["x" * 500]}), d / "z-nocol.parquet")),
        r"z-nocol\.parquet has no column 'text'",
    )

    def corrupt(d: Path) -> None:
        path = d / "z-corrupt.parquet"
        pq.write_table(
            pa.table({"text": [f"row {i} " * 200 for i in range(40)]}), path, row_group_size=10, compression="snappy"
        )
        meta = pq.ParquetFile(path).metadata
        start = meta.row_group(2).column(0).data_page_offset  # garble the third row group's data page
        data = bytearray(path.read_bytes())
        data[start + 8 : start + 120] = os.urandom(112)
        path.write_bytes(bytes(data))

    out["parquet"] = (variant("parquet", corrupt), r"z-corrupt\.parquet row group 2 of 4 is not readable")
    return out


def test_bad_input_is_one_error_naming_the_file_and_leaves_nothing(ray_local, tmp_path):
    from pipelines.prepare import prepare

    for name, (corpus, says) in _bad_corpora(tmp_path / "corpora").items():
        camp = tmp_path / f"camp-{name}"
        for engine in ("local", "ray"):
            store = Store(str(camp))
            with pytest.raises(SomaError, match=says):
                prepare(store, engine_config(str(corpus), engine, 100_000))
            assert not camp.exists() or not any(camp.iterdir()), (name, engine, list(camp.rglob("*")))


# With SOMA_SLOW=1 (18 s, a Ray Data start): the test above refuses the same files on the ray engine in process, and
# every prepare refusal through the CLI is one line (tests/test_cli.py, tests/test_config_inputs.py)
@pytest.mark.slow
def test_cli_prepare_on_ray_bad_input_exits_2_with_one_error_line(tmp_path):
    corpus, _ = _bad_corpora(tmp_path / "corpora")["json"]
    camp = tmp_path / "camp"
    res = soma(
        "prepare",
        str(camp),
        "--corpus",
        str(corpus),
        "--set",
        "prepare.engine=ray",
        "--set",
        "prepare.part_bytes=100000",
        "--set",
        "router.min_df=2",
        "-n",
        "2",
        timeout=300,
    )
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert res.returncode == 2 and len(errors) == 1 and "z-broken.jsonl line 2 is not JSON" in errors[0], res.stderr[
        -2000:
    ]
    assert not camp.exists() or not any(camp.iterdir())


# -- without Ray: parts and keys ---------------------------------------------------------------------------
def test_parts_group_files_in_order_and_the_cap_is_the_same_everywhere(tmp_path):
    root = tmp_path / "c"
    root.mkdir()
    for i in range(10):
        (root / f"f{i}.txt").write_bytes(b"x" * 1000)
    parts = plan_parts(CorpusConfig(source=str(root), max_bytes=10**9), part_bytes=2500)
    assert [[f.name for f in p.files] for p in parts] == [
        ["f0.txt", "f1.txt", "f2.txt"],
        ["f3.txt", "f4.txt", "f5.txt"],
        ["f6.txt", "f7.txt", "f8.txt"],
        ["f9.txt"],
    ]
    capped = plan_parts(CorpusConfig(source=str(root), max_bytes=4500), part_bytes=2500)
    files = [f for p in capped for f in p.files]
    assert [f.name for f in files] == ["f0.txt", "f1.txt", "f2.txt", "f3.txt", "f4.txt"]
    assert files[-1].budget == 500  # the last file gives what the cap leaves
    from soma_cluster.corpus import documents

    assert (
        sum(len(d.data) for d in documents(CorpusConfig(source=str(root), max_bytes=4500))) == 5000
    )  # f4.txt is one document


def test_the_keyed_sample_is_uniform_over_parts_and_follows_the_seed():
    sizes = [5000, 20000, 1000, 14000, 10000]  # rows per part
    k = 5000
    for seed in (0, 1):
        keys = [row_keys(seed, p, 0, n) for p, n in enumerate(sizes)]
        below = threshold(np.concatenate([lowest(kk, k) for kk in keys]), k)
        taken = np.array([(kk <= np.uint64(below)).sum() for kk in keys])
        assert taken.sum() == k
        expect = k * np.array(sizes) / sum(sizes)
        assert np.all(np.abs(taken - expect) <= 4 * np.sqrt(expect) + 1), (taken, expect)  # binomial, 4 sigma
        first, second = row_keys(seed, 1, 0, 100), row_keys(seed, 1, 40, 60)
        np.testing.assert_array_equal(first[40:], second)  # a row's key depends on its place only
    assert not np.array_equal(row_keys(0, 0, 0, 50), row_keys(1, 0, 0, 50))


def test_a_worker_process_reloads_the_router_when_another_is_staged_at_the_same_path(tmp_path):
    """Worker processes keep the router they loaded across tasks; a later prepare of the same campaign stages
    another router at the same path, and the cache (keyed by the files' sha256) must not hand out the old one."""
    from pipelines.prepare_ray import _router
    from soma_cluster.router import fit_router, router_text, save_router

    texts = [router_text(d.data[:1024]) for d in builtin_documents(400_000)][:300]
    cfg = micro_config().router
    stage = Store(str(tmp_path / "stage"))
    routers = []
    for n in (2, 3):
        router = fit_router(texts, n, cfg, 0)[0]
        save_router(Store(f"{stage.url}/router"), router)
        routers.append(_router(stage.url, {}, "router"))
        assert routers[-1].n_experts == n
    assert _router(stage.url, {}, "router") is routers[-1]  # loaded once, then reused
