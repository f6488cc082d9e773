"""The router (features, balanced k-means, the balanced rule and its offsets, persistence, the bytes-to-text
decoding) and the per-expert Arrow shards, including N = 256 prepared on the built-in corpus."""

import json
import re

import numpy as np
import pyarrow as pa
import pytest
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from soma_cluster.config import RouterConfig, resolve
from soma_cluster.errors import ChecksumError, SomaError
from soma_cluster.router import (
    TIE_SCALE,
    Router,
    assign,
    balanced_kmeans,
    cluster_spread,
    fit_offsets,
    fit_router,
    load_router,
    router_text,
    save_router,
)
from soma_cluster.shards import open_shard, write_manifests, write_part_shards
from soma_cluster.storage import Store, sha256
from soma_cluster.textsources import builtin_documents


def equal_shares(labels: np.ndarray, n_clusters: int) -> bool:
    """Every cluster holds n // N or n // N + 1 rows: the exact split of n rows."""
    sizes = np.bincount(labels, minlength=n_clusters)
    return sizes.sum() == len(labels) and sizes.max() - sizes.min() <= 1


def skewed(n: int, seed: int, dim: int = 16) -> np.ndarray:
    """Unit rows from a mixture whose components have weights 1 : 2 : ... : 8 around random directions."""
    rng = np.random.default_rng(0)
    centers = rng.normal(size=(8, dim))
    draw = np.random.default_rng(seed)
    comp = draw.choice(8, size=n, p=np.arange(1, 9) / 36)
    x = centers[comp] + 0.8 * draw.normal(size=(n, dim))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


@pytest.mark.parametrize("n_clusters", [2, 16, 64])
def test_balanced_rule_splits_the_fit_set_equally_where_nearest_does_not(n_clusters):
    x = skewed(20_000, seed=1)
    centroids = x[np.linspace(0, len(x) - 1, n_clusters).astype(int)]  # data points: nearest is lopsided
    assert cluster_spread(assign(x, centroids, np.zeros(n_clusters)), n_clusters) > 0.3
    offsets = fit_offsets(x, centroids)
    assert equal_shares(assign(x, centroids, offsets), n_clusters)  # to the row: the last ones settled
    # new rows from the same distribution: the deviation expected of a sample, about sqrt(N / n) per cluster
    fresh = assign(skewed(20_000, seed=2), centroids, offsets)
    assert cluster_spread(fresh, n_clusters) < 5 * np.sqrt(n_clusters / len(x))
    # a warm start (what prepare's refit over all sequences does) lands on the same rule
    again = fit_offsets(x, centroids, offsets + np.float32(0.01) * np.sin(np.arange(n_clusters)).astype(np.float32))
    assert np.mean(assign(x, centroids, again) == assign(x, centroids, offsets)) > 0.99


def test_one_cluster_and_candidate_fit_beyond_the_dense_limit(monkeypatch):
    x = skewed(3000, seed=3)
    assert fit_offsets(x, x[:1]).tolist() == [0.0]
    import soma_cluster.router as router_mod

    monkeypatch.setattr(router_mod, "DENSE_ENTRIES", 3000 * 40 // 4)  # cold fit on a subsample, then candidates
    monkeypatch.setattr(router_mod, "CANDIDATES", 6)
    centroids = x[np.linspace(0, 2999, 40).astype(int)]
    assert equal_shares(assign(x, centroids, fit_offsets(x, centroids)), 40)  # 75 rows a cluster


def tight_topics(n: int, seed: int, dim: int = 24, topics: int = 12) -> np.ndarray:
    """Unit rows from a few tight topics of very unequal weights (Dirichlet 0.3): balanced k-means must put many
    centroids inside the big topics, within a row's similarity noise of each other."""
    rng = np.random.default_rng(seed)
    weights = rng.dirichlet(np.full(topics, 0.3))
    centers = rng.normal(size=(topics, dim))
    x = centers[rng.choice(topics, n, p=weights)] + 0.3 * rng.normal(size=(n, dim)) * rng.uniform(0.2, 2.0, size=(n, 1))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def test_balanced_kmeans_stays_balanced_on_tight_unequal_topics_past_the_dense_limit(monkeypatch):
    """k-means iterations warm-start the offsets from centroids that have moved; fitted on candidate clusters
    only, that fit walked the offsets off (fit-sample shards of 0 to thousands at N = 256 on real features)."""
    import soma_cluster.router as router_mod

    x = tight_topics(6000, seed=1)
    monkeypatch.setattr(router_mod, "DENSE_ENTRIES", 6000 * 64 // 2)  # the candidate fit past a 3,000-row subsample
    centroids, offsets, labels = balanced_kmeans(x, 64, 10, seed=0)
    sizes = np.bincount(labels, minlength=64)  # share 93.75 (before: 0 to 3,498 rows)
    assert sizes.min() >= 92 and sizes.max() <= 95  # candidates only: within a row of exact
    np.testing.assert_array_equal(labels, assign(x, centroids, offsets))


@pytest.mark.parametrize("n_clusters, dense", [(16, True), (64, True), (64, False)])
def test_offsets_a_little_off_are_settled_to_the_row(monkeypatch, n_clusters, dense):
    """The rows Newton leaves within a tie fall with float rounding (another CPU's BLAS, a float32 cast): offsets
    fitted, then moved by up to about 1e-4, are settled back to shares exact to the row."""
    import soma_cluster.router as router_mod

    x = skewed(12_000, seed=4)
    if not dense:
        monkeypatch.setattr(router_mod, "DENSE_ENTRIES", len(x) * n_clusters // 3)
    centroids = x[np.linspace(0, len(x) - 1, n_clusters).astype(int)]
    offsets = fit_offsets(x, centroids)
    off = (offsets + 4e-5 * np.random.default_rng(0).standard_normal(n_clusters)).astype(np.float32)
    assert not equal_shares(assign(x, centroids, off), n_clusters)
    m = n_clusters if dense else router_mod.CANDIDATES
    settled = router_mod._settle(x, centroids, off, router_mod._caps(len(x), n_clusters), m)
    assert equal_shares(assign(x, centroids, settled), n_clusters)
    assert np.abs(settled - off).max() < 1e-3  # the rule hardly moves
    assert np.mean(assign(x, centroids, settled) == assign(x, centroids, offsets)) > 0.995


def test_identical_rows_stay_together_and_the_rest_share_what_is_left():
    """Identical rows (a boilerplate chunk repeated) score alike under any offsets, so no rule can split them:
    their cluster keeps them all and the other clusters split the remaining rows as equally as they can."""
    x = skewed(2000, seed=1)
    x[:50] = x[0]  # 50 copies, a share is 31.25
    centroids, offsets, labels = balanced_kmeans(x, 64, 10, seed=0)
    sizes = np.bincount(labels, minlength=64)
    assert len(set(labels[:50])) == 1 and sizes[labels[0]] == 50
    rest = np.delete(sizes, labels[0])
    assert rest.sum() == 1950 and rest.max() - rest.min() <= 1  # 30 or 31 each
    np.testing.assert_array_equal(labels, assign(x, centroids, offsets))


def test_balanced_kmeans_recovers_separated_clusters():
    rng = np.random.default_rng(0)
    centers = np.eye(8)[:4]
    x = np.concatenate([c + 0.05 * rng.normal(size=(50, 8)) for c in centers])
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    centroids, offsets, labels = balanced_kmeans(x.astype(np.float32), 4, 10, seed=0)
    for block in range(4):
        assert len(set(labels[block * 50 : (block + 1) * 50])) == 1
    np.testing.assert_array_equal(labels, assign(x.astype(np.float32), centroids, offsets))


@pytest.fixture(scope="module")
def texts():
    out = []
    for doc in builtin_documents(800_000):
        out += [router_text(doc.data[i : i + 1024]) for i in range(0, len(doc.data) - 1023, 1024)]
    return out


def test_router_clusters_are_balanced_and_reload_identically(tmp_path, texts):
    cfg = RouterConfig(max_features=3000, min_df=3, svd_dim=16)
    router, labels = fit_router(texts, 4, cfg, seed=0)
    sizes = np.bincount(labels, minlength=4)
    assert sizes.max() - sizes.min() <= 2
    assert all(len(t) == 8 for t in router.top_terms)
    store = Store(str(tmp_path / "c"))
    save_router(store, router)
    again = load_router(store)
    emb_a, emb_b = router.embed(texts[:50]), again.embed(texts[:50])
    np.testing.assert_array_equal(emb_a, emb_b)
    np.testing.assert_array_equal(router.offsets, again.offsets)
    assert again.cfg.rule == "balanced" and np.abs(again.offsets).max() > 0
    top, w = again.route(emb_b)  # router.top_k unset: the default for N = 4 routes each window to one expert
    assert again.cfg.top_k == 1 and top.shape == (50, 1) and np.allclose(w.sum(1), 1.0)
    top, w = again.route(emb_b, top_k=4)
    assert top.shape == (50, 4) and np.allclose(w.sum(1), 1.0)
    arrays = tmp_path / "c" / "router" / "arrays.safetensors"
    arrays.write_bytes(arrays.read_bytes()[:-10])
    with pytest.raises(ChecksumError, match="arrays.safetensors"):
        load_router(store)


def test_routing_ranks_by_the_rules_scores(texts):
    router, _ = fit_router(texts, 8, RouterConfig(max_features=3000, min_df=3, svd_dim=16, weighting="softmax"), seed=0)
    emb = router.embed(texts[:200])
    top, w = router.route(emb)
    np.testing.assert_array_equal(top[:, 0], router.assign(emb))  # a window's first expert: its shard's
    assert (np.diff(w, axis=1) <= 1e-12).all() and np.allclose(w.sum(1), 1.0)  # weights fall along the ranking
    nearest = fit_router(texts, 8, RouterConfig(max_features=3000, min_df=3, svd_dim=16, rule="nearest"), seed=0)[0]
    np.testing.assert_array_equal(nearest.centroids, router.centroids)  # same k-means, only the rule differs
    assert not nearest.offsets.any()
    np.testing.assert_array_equal(nearest.assign(emb), np.argmax(emb @ nearest.centroids.T, axis=1))


def test_router_saved_before_offsets_existed_loads_as_nearest(tmp_path, texts):
    router, _ = fit_router(texts[:400], 4, RouterConfig(max_features=3000, min_df=3, svd_dim=16), seed=0)
    store = Store(str(tmp_path / "c"))
    save_router(store, router)
    arrays = st_load(store.read_bytes("router/arrays.safetensors"))
    old = st_save({k: v for k, v in arrays.items() if k != "offsets"})  # the layout written before this change
    store.write_bytes("router/arrays.safetensors", old)
    meta = store.read_json("router/router.json")
    del meta["config"]["rule"], meta["config"]["tokens"]
    meta["files"]["arrays.safetensors"] = sha256(old)
    store.write_json("router/router.json", meta)
    loaded = load_router(store)
    assert loaded.cfg.rule == "nearest" and not loaded.offsets.any()
    assert loaded.cfg.tokens == "words"  # the terms it was fitted with
    emb = loaded.embed(texts[:50])
    np.testing.assert_array_equal(loaded.assign(emb), np.argmax(emb @ loaded.centroids.T, axis=1))


def test_router_saved_before_the_hashed_coordinates_embeds_without_them(texts):
    router, _ = fit_router(texts[:400], 4, RouterConfig(max_features=3000, min_df=3, svd_dim=16), seed=0)
    k = router.mean.shape[0]
    old = Router(
        router.cfg,
        router.vocabulary,
        router.idf,
        router.components,
        router.mean,
        router.centroids[:, :k] / np.linalg.norm(router.centroids[:, :k], axis=1, keepdims=True),
        router.offsets,
    )
    emb = old.embed(texts[:50])
    assert emb.shape == (50, k)  # the columns its centroids were fit on
    np.testing.assert_allclose(emb, router.embed(texts[:50])[:, :k] * np.sqrt(1 + TIE_SCALE**2), atol=1e-6)


def test_layout_tokens_see_indentation_and_punctuation_that_words_drop(tmp_path, texts):
    words, _ = fit_router(texts[:400], 4, RouterConfig(max_features=3000, min_df=3, svd_dim=16, tokens="words"), seed=0)
    layout, _ = fit_router(texts[:400], 4, RouterConfig(max_features=3000, min_df=3, svd_dim=16), seed=0)
    assert layout.cfg.tokens == "layout"
    assert all(re.fullmatch(r"\w\w+", t) for t in words.vocabulary)
    assert any(re.fullmatch(r"\n +", t) for t in layout.vocabulary) and any(
        re.fullmatch(r"[^\w\s]+", t) for t in layout.vocabulary
    )
    store = Store(str(tmp_path / "c"))
    save_router(store, layout)
    again = load_router(store)
    assert again.cfg.tokens == "layout"
    np.testing.assert_array_equal(again.embed(texts[:50]), layout.embed(texts[:50]))  # same terms after a reload


def test_router_text_keeps_every_letter():
    assert router_text("naïve café".encode()) == "naïve café"  # UTF-8 as UTF-8
    assert router_text("fïle naïve".encode("latin-1")) == "fïle naïve"  # Latin-1 letters stay letters
    assert router_text("x café".encode()[:-1]) == "x caf"  # a character cut at the chunk's end
    assert router_text("é is".encode()[1:]) == " is"  # and at its start
    assert router_text(b"a\xff\xfeb") == "a\xff\xfeb"
    words = [
        "fïle",
        "système",
        "über",
        "naïve",
        "déjà",
        "crème",
        "garçon",
        "château",
        "river",
        "stone",
        "cloud",
        "paper",
    ]
    rng = np.random.default_rng(0)
    latin = [" ".join(rng.choice(words, 12)).encode("latin-1") for _ in range(120)]  # a Latin-1 corpus
    router, _ = fit_router(
        [router_text(t) for t in latin], 2, RouterConfig(max_features=100, min_df=2, svd_dim=4), seed=0
    )
    assert {"fïle", "système", "über", "garçon"} <= set(router.vocabulary)


def test_fit_sample_is_balanced_down_to_a_few_rows_per_cluster(texts):
    cfg = RouterConfig(max_features=3000, min_df=3, svd_dim=16)
    _, labels = fit_router(texts[:400], 8, cfg, seed=0)  # 50 per cluster
    assert cluster_spread(labels, 8) <= 0.05
    distinct = list(dict.fromkeys(texts))[:403]  # identical chunks (licences) share a cluster: their own test
    _, labels = fit_router(distinct, 100, cfg.model_copy(update={"min_df": 2}), seed=0)  # 4 or 5 per cluster
    # to the row on every machine (before the settling step, rows within the last temperature of a tie fell with
    # the CPU's float rounding: 3 to 5 rows on one); before the hashed coordinates, 8 chunks the SVD part could
    # not tell apart shared one cluster and left another empty
    assert equal_shares(labels, 100)


def test_chunks_without_vocabulary_are_split_by_their_hash(texts):
    """Chunks with no vocabulary term (numbers here) all embed at one point of the SVD part: only the
    hashed coordinates let the balanced rule split them (before them: one cluster took 126 of the 200,
    sizes 83-175 where the share is 125)."""
    rng = np.random.default_rng(0)
    numbers = [" ".join(str(x) for x in rng.integers(0, 10**6, 150)) for _ in range(200)]
    router, labels = fit_router(texts[:800] + numbers, 8, RouterConfig(max_features=3000, min_df=3, svd_dim=16), seed=0)
    assert cluster_spread(labels, 8) <= 0.02
    assert (np.bincount(labels[800:], minlength=8) >= 20).sum() >= 2  # the numbers fill more than one expert
    emb = router.embed(numbers[:2] + numbers[:1])
    np.testing.assert_array_equal(emb[0], emb[2])  # identical text, identical embedding
    assert emb.shape == (3, 16 + 8) and np.allclose(np.linalg.norm(emb, axis=1), 1.0)
    assert np.allclose(emb[0, :16], emb[1, :16]) and not np.allclose(emb[0, 16:], emb[1, 16:])


def test_router_needs_enough_chunks():
    with pytest.raises(SomaError, match="lower n_experts"):
        fit_router(["a b c"] * 3, 4, RouterConfig(), 0)


def test_size_errors_name_the_setting_to_change():
    from pipelines.prepare import _check_sizes, _val_split
    from soma_cluster.shards import ValSplit

    cfg = resolve("tiny", {"n_experts": 4, "shards": {"min_train_seqs": 16, "val_fraction": 0.01}})
    sizes = np.array([300, 300, 10, 300])
    with pytest.raises(SomaError, match="shards.min_train_seqs") as err:
        _check_sizes(cfg, sizes, _val_split(cfg, 10))
    assert "expert-0002" in str(err.value)
    with pytest.raises(SomaError, match="shards.val_fraction") as err:  # train rows fine, no val row at one in 100
        _check_sizes(cfg, np.array([60, 60, 60, 60]), ValSplit(every=100, wanted=32, configured=100))
    fix = float(str(err.value).split("raise shards.val_fraction to ")[1].split()[0])
    fixed = cfg.model_copy(update={"shards": cfg.shards.model_copy(update={"val_fraction": fix})})
    _check_sizes(fixed, np.array([60, 60, 60, 60]), ValSplit(every=60, wanted=32, configured=60))
    _check_sizes(cfg, np.array([60, 60, 60, 60]), _val_split(cfg, 60))  # prepare's own split raises the share
    with pytest.raises(SomaError, match="balance_tolerance"):
        _check_sizes(cfg, np.array([300, 300, 200, 400]), _val_split(cfg, 200))
    nearest = cfg.model_copy(update={"router": cfg.router.model_copy(update={"rule": "nearest"})})
    _check_sizes(nearest, np.array([300, 300, 200, 400]), _val_split(cfg, 200))  # the paper's rule is not held to it


def test_shards_round_trip_byte_exactly_and_detect_corruption(tmp_path):
    """Three parts written one at a time: each expert's rows come back in corpus order, every 10th val across
    parts, train files of at most rows_per_file rows; a flipped byte is a checksum error naming the file."""
    rng = np.random.default_rng(0)
    parts = [[rng.integers(0, 256, 64, dtype=np.uint8).tobytes() for _ in range(n)] for n in (200, 170, 130)]
    labels = [rng.integers(0, 3, len(p)) for p in parts]
    store = Store(str(tmp_path / "c"))
    before, written = np.zeros(3, np.int64), []
    for i, (seqs, lab) in enumerate(zip(parts, labels, strict=True)):
        written.append(
            write_part_shards(store, i, pa.array(seqs, pa.binary(64)), lab, before, every=10, rows_per_file=20)
        )
        before = before + np.bincount(lab, minlength=3)
    manifests = write_manifests(store, 3, 64, written)
    for e in range(3):
        want = [s for seqs, lab in zip(parts, labels, strict=True) for s, x in zip(seqs, lab, strict=True) if x == e]
        shard = open_shard(store, e)
        assert [bytes(r) for part in shard.val for r in part] == want[9::10]
        assert [bytes(r) for part in shard.train for r in part] == [s for i, s in enumerate(want) if i % 10 != 9]
        assert manifests[e]["train_rows"] + manifests[e]["val_rows"] == len(want)
        assert max(len(f) for f in shard.train) <= 20 and len(shard.train) > 3  # rows_per_file rotation happened
    victim = tmp_path / "c" / "shards" / "expert-0001" / "val-00001.arrow"
    data = bytearray(victim.read_bytes())
    data[-100] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="expert-0001/val-00001.arrow"):
        open_shard(store, 1)


def shard_rows(store: Store, expert: int) -> list[bytes]:
    shard = open_shard(store, expert)
    return [bytes(r) for part in shard.train + shard.val for r in part]


@pytest.mark.parametrize("rule", ["balanced", "nearest"])
def test_prepare_makes_shards_by_the_rule_that_routes(tmp_path, rule, capsys):
    """Both rules through prepare on real text: every sequence of every shard (train and val) is routed by
    route() to its own shard first; balanced shards are within router.balance_tolerance over all
    sequences, nearest shards are each sequence's nearest centroid (zero offsets, saved as such)."""
    from conftest import micro_config

    from pipelines.prepare import prepare, printable

    cfg = micro_config(n_experts=8, corpus={"max_bytes": 3_000_000}, router={"rule": rule})
    store = Store(str(tmp_path / "c"))
    summary = prepare(store, cfg)
    router = load_router(store)
    printed = capsys.readouterr().err.splitlines()
    for e, terms in enumerate(router.top_terms):  # one line per expert, whatever its terms hold (a newline, a tab)
        (line,) = [ln for ln in printed if ln.startswith(f"  expert-{e:04d}: ")]
        assert line.endswith("top terms: " + " ".join(printable(t) for t in terms[:8])), line
    assert summary["rule"] == router.cfg.rule == rule
    rows = [shard_rows(store, e) for e in range(8)]
    sizes = np.array([len(r) for r in rows])
    assert sizes.tolist() == [t + v for t, v in zip(summary["train_rows"], summary["val_rows"], strict=True)]
    emb = router.embed([router_text(r) for part in rows for r in part])
    shard = np.repeat(np.arange(8), sizes)
    top, _ = router.route(emb)
    np.testing.assert_array_equal(top[:, 0], shard)  # test routing agrees with the shards
    cosine = np.argmax(emb @ router.centroids.T, axis=1)
    if rule == "balanced":
        assert np.abs(sizes / sizes.mean() - 1).max() <= cfg.router.balance_tolerance
        assert np.mean(cosine != shard) > 0.01  # the offsets do move sequences
    else:
        assert not router.offsets.any()
        np.testing.assert_array_equal(cosine, shard)


def test_n256_prepare_on_a_large_corpus_gives_every_shard_an_equal_share(tmp_path):
    """The mission's N: 32 MB of topical text (real lines of the built-in corpus, drawn from a seed: it holds only
    8 MB), 256 experts of about 115 sequences. The paper's nearest-centroid rule leaves some experts with a handful
    here; the balanced rule's shards are all within router.balance_tolerance, and the saved router routes a shard's
    sequences back to it."""
    from support.textgen import write_topical_corpus

    from pipelines.prepare import prepare

    corpus_dir = write_topical_corpus(tmp_path / "corpus", 32_000_000, topics=96)
    cfg = resolve(
        "tiny",
        {
            "n_experts": 256,
            "corpus": {"source": str(corpus_dir), "max_bytes": 32_000_000},
            "router": {"kmeans_iters": 10},
            "shards": {"min_train_seqs": 64},
        },
    )
    store = Store(str(tmp_path / "c"))
    summary = prepare(store, cfg)
    sizes = np.array(summary["train_rows"]) + np.array(summary["val_rows"])
    assert len(sizes) == 256 and sizes.sum() > 25_000
    assert summary["assigned_size_spread"] <= cfg.router.balance_tolerance
    assert np.abs(sizes / sizes.mean() - 1).max() <= cfg.router.balance_tolerance
    assert min(summary["val_rows"]) >= 1 and summary["rule"] == "balanced"
    router = load_router(store)
    assert json.loads((tmp_path / "c" / "router" / "router.json").read_text())["config"]["rule"] == "balanced"
    rows = [shard_rows(store, e)[:12] for e in range(256)]  # 12 sequences of every shard
    emb = router.embed([router_text(r) for part in rows for r in part])
    top, _ = router.route(emb)
    np.testing.assert_array_equal(top[:, 0], np.repeat(np.arange(256), [len(r) for r in rows]))
    # the same centroids without the offsets (rule nearest) would not: a large share lands elsewhere
    assert np.mean(np.argmax(emb @ router.centroids.T, axis=1) != top[:, 0]) > 0.05


def test_what_the_sizes_and_sample_rule_out_is_refused_before_the_router_fit():
    """-n too large for the corpus, and one sequence repeated through it, are known before the fit (minutes on a
    large corpus): refused with the cause and the largest n_experts that can work."""
    from conftest import micro_config

    from pipelines.prepare import _check_feasible
    from soma_cluster.errors import SomaError
    from soma_cluster.router import identical_share

    # 4424 sequences leave at most 14 per expert: val raised to one in 10 (1), 13 train < shards.min_train_seqs 16;
    # a shard needs 17 (16 train, 1 val), so 4424 // 17 = 260 experts can work
    cfg = micro_config(n_experts=300)
    with pytest.raises(SomaError, match=r"at most 14 \(1 val, one in every 10.*lower n_experts to 260 or less"):
        _check_feasible(cfg, 4424, [])
    _check_feasible(micro_config(n_experts=40), 4424, [bytes([i % 251, i // 251]) for i in range(2000)])
    same = [b"x" * 8] * 1000 + [bytes([i % 251, i // 251]) for i in range(1000)]
    share, at_least = identical_share(same)
    assert share == 0.5 and 0.45 < at_least < 0.5
    with pytest.raises(SomaError, match=r"50.0% of the 2000 sampled sequences are one and the same"):
        _check_feasible(micro_config(n_experts=8), 40_000, same)


@pytest.mark.parametrize(
    "n,k,windows",
    [(1, 1, 2048), (2, 1, 2048), (4, 1, 2048), (16, 1, 2048), (96, 2, 2048), (256, 4, 2048), (1024, 4, 8192)],
)
def test_defaults_that_depend_on_n_route_and_see_every_expert(n, k, windows):
    """router.top_k and eval.max_windows unset: top-k routes (never N, a uniform mixture, for N >= 2) and is the
    paper's 4 at N = 256; the windows give every expert about 32 or more at an even load."""
    from soma_cluster.config import default_eval_windows, default_top_k

    cfg = resolve("tiny", {"n_experts": n})
    assert cfg.router.top_k is None and cfg.eval.max_windows is None  # the tiny preset leaves both to N
    assert default_top_k(n) == cfg.top_k() == k and (k < n or n == 1)
    assert cfg.eval_windows() == default_eval_windows(n, k) == windows and windows * k / n >= 32
    asked = resolve("tiny", {"n_experts": n, "router": {"top_k": 4}, "eval": {"max_windows": 100}})
    assert asked.top_k() == min(4, n) and asked.eval_windows() == 100  # what is asked for is kept
    assert resolve("paper-n256", {}).top_k() == 4 and resolve("paper-small", {}).top_k() == 4  # the paper's values


def test_the_val_split_holds_what_one_validation_reads():
    """shards.val_fraction is the least share: raised, up to 10%, so that the smallest shard's val holds
    train.val_batches x spsa.batch sequences; never lowered."""
    from soma_cluster.shards import val_split

    assert val_split(0.01, 32, 10_000).every == 100  # 100 val of 10,000: enough, as configured
    s = val_split(0.01, 32, 1400)  # the demo's shards: 14 val at 1%, 32 wanted
    assert s.raised and s.every == 43 and s.val_rows(1400) == 32
    capped = val_split(0.01, 32, 171)  # N = 256 on 45 MB: 1 val at 1%; capped at 10%
    assert capped.every == 10 and capped.val_rows(171) == 17
    assert val_split(0.25, 32, 100).every == 4  # a larger share asked for is kept


def test_a_refusal_for_too_little_data_names_what_bound_it():
    """The preset's corpus.max_bytes, the built-in corpus's size, or the data: each named with the setting that
    changes it and about how much is needed."""
    from pipelines.prepare import _check_feasible, more_data

    capped = resolve("tiny", {"n_experts": 256})
    info = {"bytes": 6_000_000, "train_sequences": 5609}
    with pytest.raises(SomaError) as err:
        _check_feasible(capped, 5609, [], info)
    line = str(err.value)
    assert "lower n_experts to 79 or less" in line and "corpus.max_bytes=6_000_000 (preset tiny)" in line
    assert "about 21 MB" in line
    whole = resolve("tiny", {"n_experts": 256, "corpus": {"max_bytes": 100_000_000}})
    assert "the built-in corpus holds 8.0 MB" in more_data(whole, {"bytes": 8_012_518, "train_sequences": 7392})
    mine = resolve("tiny", {"corpus": {"source": "/data", "max_bytes": 100_000_000}})
    assert more_data(mine, {"bytes": 1_000_000}) == "add data"
    setit = resolve("tiny", {"corpus": {"max_bytes": 5_000_000}})
    assert "(set in the config or --set)" in more_data(setit, {"bytes": 5_000_000})
