import numpy as np
import pytest

from soma_cluster.config import RouterConfig
from soma_cluster.corpus import builtin_documents
from soma_cluster.errors import ChecksumError, SomaError
from soma_cluster.router import balanced_assign, balanced_kmeans, fit_router, load_router, save_router
from soma_cluster.shards import ShardWriter, open_shard
from soma_cluster.storage import Store


@pytest.mark.parametrize("n,k", [(100, 4), (101, 4), (7, 7), (1000, 13)])
def test_balanced_assign_sizes_differ_by_at_most_one(n, k):
    sims = np.random.default_rng(n).normal(size=(n, k)).astype(np.float32)
    sims[:, 0] += 3.0                                   # everyone prefers cluster 0
    sizes = np.bincount(balanced_assign(sims), minlength=k)
    assert sizes.sum() == n and sizes.max() - sizes.min() <= 1


def test_balanced_kmeans_recovers_separated_clusters():
    rng = np.random.default_rng(0)
    centers = np.eye(8)[:4]
    x = np.concatenate([c + 0.05 * rng.normal(size=(50, 8)) for c in centers])
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    _, labels = balanced_kmeans(x.astype(np.float32), 4, 10, seed=0)
    for block in range(4):
        assert len(set(labels[block * 50:(block + 1) * 50])) == 1


@pytest.fixture(scope="module")
def texts():
    out = []
    for doc in builtin_documents(800_000):
        out += [doc.data[i:i + 1024].decode("utf-8", "ignore") for i in range(0, len(doc.data) - 1023, 1024)]
    return out


def test_router_clusters_are_balanced_and_reload_identically(tmp_path, texts):
    cfg = RouterConfig(max_features=3000, min_df=3, svd_dim=16)
    router, labels = fit_router(texts, 4, cfg, seed=0)
    sizes = np.bincount(labels, minlength=4)
    assert sizes.max() - sizes.min() <= 1
    assert all(len(t) == 8 for t in router.top_terms)
    store = Store(str(tmp_path / "c"))
    save_router(store, router)
    again = load_router(store)
    emb_a, emb_b = router.embed(texts[:50]), again.embed(texts[:50])
    np.testing.assert_array_equal(emb_a, emb_b)
    top, w = again.route(emb_b)
    assert top.shape == (50, 4) and np.allclose(w.sum(1), 1.0)
    arrays = tmp_path / "c" / "router" / "arrays.safetensors"
    arrays.write_bytes(arrays.read_bytes()[:-10])
    with pytest.raises(ChecksumError, match="arrays.safetensors"):
        load_router(store)


def test_balance_tolerance_is_enforced(texts):
    from soma_cluster.router import cluster_spread
    cfg = RouterConfig(max_features=3000, min_df=3, svd_dim=16, balance_tolerance=0.05)
    router, labels = fit_router(texts[:400], 8, cfg, seed=0)          # 50 per cluster: within 2%
    assert cluster_spread(labels, 8) <= 0.05
    with pytest.raises(SomaError, match="balance_tolerance"):
        fit_router(texts[:403], 100, cfg.model_copy(update={"min_df": 2}), seed=0)   # 4 or 5 per cluster: 24% apart


def test_router_needs_enough_chunks():
    with pytest.raises(SomaError, match="lower n_experts"):
        fit_router(["a b c"] * 3, 4, RouterConfig(), 0)


def test_shards_round_trip_byte_exactly_and_detect_corruption(tmp_path):
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 256, 64, dtype=np.uint8).tobytes() for _ in range(500)]
    labels = rng.integers(0, 3, len(seqs))
    store = Store(str(tmp_path / "c"))
    writer = ShardWriter(store, 3, 64, val_fraction=0.1, rows_per_file=70)
    for s, lab in zip(seqs, labels):
        writer.add(int(lab), s)
    manifests = writer.close()
    for e in range(3):
        shard = open_shard(store, e)
        got = [bytes(r) for part in shard.train + shard.val for r in part]
        want = [s for s, lab in zip(seqs, labels) if lab == e]
        assert sorted(got) == sorted(want) and len(got) == len(want)
        assert manifests[e]["train_rows"] + manifests[e]["val_rows"] == len(want)
        assert len(shard.train) > 1                      # rows_per_file rotation happened
    victim = tmp_path / "c" / "shards" / "expert-0001" / "val.arrow"
    data = bytearray(victim.read_bytes())
    data[-100] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="expert-0001/val.arrow"):
        open_shard(store, 1)
