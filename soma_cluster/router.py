"""Router: TF-IDF -> TruncatedSVD -> mean removal -> L2 norm, and balanced spherical k-means centroids.

Saved without pickle: the vocabulary as JSON, the arrays as safetensors, both checksummed, so a
router written on one machine loads bit-identically on any other.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save
from sklearn.decomposition import TruncatedSVD
from sklearn.feature_extraction.text import TfidfVectorizer

from soma_cluster.config import RouterConfig
from soma_cluster.errors import ChecksumError, SomaError
from soma_cluster.storage import Store, sha256


def _vectorizer(cfg: RouterConfig, vocabulary: dict[str, int] | None = None) -> TfidfVectorizer:
    return TfidfVectorizer(
        max_features=cfg.max_features, sublinear_tf=True, stop_words="english",
        min_df=1 if vocabulary is not None else cfg.min_df, vocabulary=vocabulary, dtype=np.float32,
    )


def _l2(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


@dataclass
class Router:
    cfg: RouterConfig
    vocabulary: list[str]          # term of each TF-IDF column
    idf: np.ndarray                # (V,) float32
    components: np.ndarray         # (k, V) float32, SVD rows
    mean: np.ndarray               # (k,) float32, subtracted after projection
    centroids: np.ndarray          # (N, k) float32, unit rows
    top_terms: list[list[str]] = field(default_factory=list)
    _vec: TfidfVectorizer | None = field(default=None, repr=False)

    @property
    def n_experts(self) -> int:
        return self.centroids.shape[0]

    def vectorizer(self) -> TfidfVectorizer:
        if self._vec is None:
            vec = _vectorizer(self.cfg, {t: i for i, t in enumerate(self.vocabulary)})
            vec.idf_ = self.idf.astype(np.float64)
            self._vec = vec
        return self._vec

    def embed(self, texts: list[str]) -> np.ndarray:
        """(n,) texts -> (n, k) unit vectors in the router space."""
        tfidf = self.vectorizer().transform(texts).astype(np.float32)
        return _l2(np.asarray(tfidf @ self.components.T, dtype=np.float32) - self.mean)

    def nearest(self, emb: np.ndarray) -> np.ndarray:
        """(n, k) -> (n,) index of the nearest centroid (cosine)."""
        return np.argmax(emb @ self.centroids.T, axis=1)

    def route(self, emb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(n, k) -> experts (n, m) and weights (n, m) for the m = min(top_k, N) nearest centroids."""
        sims = emb @ self.centroids.T
        m = min(self.cfg.top_k, self.n_experts)
        top = np.argsort(-sims, axis=1, kind="stable")[:, :m]
        if self.cfg.weighting == "uniform":
            return top, np.full(top.shape, 1.0 / m, dtype=np.float64)
        d2 = 2.0 - 2.0 * np.take_along_axis(sims, top, axis=1).astype(np.float64)   # squared distance of unit vectors
        logits = -d2 / self.cfg.temperature
        w = np.exp(logits - logits.max(axis=1, keepdims=True))
        return top, w / w.sum(axis=1, keepdims=True)


# -- fitting ----------------------------------------------------------------------------------------------
def balanced_assign(sims: np.ndarray) -> np.ndarray:
    """Assign n points to N clusters maximising similarity with cluster sizes differing by at most 1.

    Rounds of proposals: every unassigned point proposes to its best cluster that has room; a
    cluster keeps its most similar proposers up to its room. Each round fills at least one cluster,
    so there are at most N rounds of O(n N) work.
    """
    n, n_clusters = sims.shape
    labels = np.full(n, -1, dtype=np.int64)
    room = np.full(n_clusters, n // n_clusters, dtype=np.int64)
    for _ in range(2):                         # second pass places the n mod N leftovers, one per cluster
        while (labels < 0).any() and room.sum() > 0:
            todo = np.flatnonzero(labels < 0)
            s = sims[todo].copy()
            s[:, room == 0] = -np.inf
            best = s.argmax(axis=1)
            score = s[np.arange(len(todo)), best]
            order = np.lexsort((-score, best))
            chosen = best[order]
            first = np.searchsorted(chosen, np.arange(n_clusters))
            rank = np.arange(len(order)) - first[chosen]
            keep = rank < room[chosen]
            labels[todo[order[keep]]] = chosen[keep]
            room -= np.bincount(chosen[keep], minlength=n_clusters)
        room = np.where(np.bincount(labels[labels >= 0], minlength=n_clusters) > n // n_clusters, 0, 1)
    return labels


def _init_centroids(x: np.ndarray, n_clusters: int, rng: np.random.Generator) -> np.ndarray:
    """Spherical k-means++: next centroid drawn with probability proportional to its cosine distance."""
    chosen = [int(rng.integers(len(x)))]
    dist = 1.0 - x @ x[chosen[0]]
    for _ in range(1, n_clusters):
        p = np.clip(dist, 0, None).astype(np.float64)
        idx = int(rng.choice(len(x), p=p / p.sum())) if p.sum() > 0 else int(rng.integers(len(x)))
        chosen.append(idx)
        dist = np.minimum(dist, 1.0 - x @ x[idx])
    return x[chosen].copy()


def balanced_kmeans(x: np.ndarray, n_clusters: int, iters: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Balanced spherical k-means on unit rows x (n, k): returns centroids (N, k) and labels (n,)."""
    rng = np.random.default_rng(seed)
    centroids = _init_centroids(x, n_clusters, rng)
    labels = np.full(len(x), -1)
    for _ in range(iters):
        new = balanced_assign(x @ centroids.T)
        sums = np.zeros_like(centroids)
        np.add.at(sums, new, x)
        centroids = _l2(sums)
        if np.array_equal(new, labels):
            break
        labels = new
    return centroids.astype(np.float32), labels


def cluster_spread(labels: np.ndarray, n_clusters: int) -> float:
    """max |size / mean size - 1| over the clusters: 0 is perfect balance."""
    sizes = np.bincount(labels, minlength=n_clusters)
    return float(np.abs(sizes / sizes.mean() - 1.0).max())


def _top_terms(tfidf, labels: np.ndarray, vocabulary: list[str], n_clusters: int, k: int = 8) -> list[list[str]]:
    out = []
    for c in range(n_clusters):
        rows = tfidf[labels == c]
        weights = np.asarray(rows.mean(axis=0)).ravel() if rows.shape[0] else np.zeros(len(vocabulary))
        out.append([vocabulary[i] for i in np.argsort(-weights)[:k]])
    return out


def fit_router(texts: list[str], n_clusters: int, cfg: RouterConfig, seed: int) -> tuple[Router, np.ndarray]:
    """Fit on a sample of chunk texts; returns the router and the sample's balanced labels."""
    if len(texts) < n_clusters:
        raise SomaError(f"router sample has {len(texts)} chunks for {n_clusters} experts; lower n_experts or add data")
    vec = _vectorizer(cfg)
    try:
        tfidf = vec.fit_transform(texts)
    except ValueError:
        raise SomaError(f"router: no word occurs in >= {cfg.min_df} chunks (corpus too small or not text); add text or lower router.min_df") from None
    vocabulary = [t for t, _ in sorted(vec.vocabulary_.items(), key=lambda kv: kv[1])]
    dim = min(cfg.svd_dim, len(vocabulary) - 1, len(texts) - 1)
    if dim < 2:
        raise SomaError(f"router: only {len(vocabulary)} terms survive min_df={cfg.min_df}; add text or lower router.min_df")
    svd = TruncatedSVD(n_components=dim, random_state=seed, algorithm="randomized")
    proj = svd.fit_transform(tfidf).astype(np.float32)
    mean = proj.mean(axis=0)
    emb = _l2(proj - mean)
    centroids, labels = balanced_kmeans(emb, n_clusters, cfg.kmeans_iters, seed)
    spread = cluster_spread(labels, n_clusters)
    if spread > cfg.balance_tolerance:
        raise SomaError(f"router: fitted cluster sizes differ from the mean by {spread:.1%}, over router.balance_tolerance="
                        f"{cfg.balance_tolerance}; raise router.sample_chunks (now {len(texts)} for {n_clusters} experts) or the tolerance")
    router = Router(cfg, vocabulary, vec.idf_.astype(np.float32), svd.components_.astype(np.float32), mean.astype(np.float32), centroids)
    router.top_terms = _top_terms(tfidf, labels, vocabulary, n_clusters)
    return router, labels


# -- persistence ------------------------------------------------------------------------------------------
def save_router(store: Store, router: Router) -> None:
    arrays = st_save({k: np.ascontiguousarray(v) for k, v in {"idf": router.idf, "components": router.components,
                                                              "mean": router.mean, "centroids": router.centroids}.items()})
    vocab = json.dumps(router.vocabulary).encode()
    store.write_bytes("router/arrays.safetensors", arrays)
    store.write_bytes("router/vocabulary.json", vocab)
    store.write_json("router/router.json", {
        "config": router.cfg.model_dump(mode="json"), "n_experts": router.n_experts, "svd_dim": int(router.mean.shape[0]),
        "top_terms": router.top_terms,
        "files": {"arrays.safetensors": sha256(arrays), "vocabulary.json": sha256(vocab)},
    })


def load_router(store: Store) -> Router:
    meta = store.read_json("router/router.json")
    blobs = {}
    for name, digest in meta["files"].items():
        try:
            blobs[name] = store.read_bytes(f"router/{name}")
        except FileNotFoundError:
            raise SomaError(f"{store.url}/router/{name} is missing; re-run soma prepare on a new campaign URL") from None
        if sha256(blobs[name]) != digest:
            raise ChecksumError(f"{store.url}/router/{name} fails its checksum (corrupt); re-run soma prepare on a new campaign URL")
    arrays = st_load(blobs["arrays.safetensors"])
    return Router(RouterConfig.model_validate(meta["config"]), json.loads(blobs["vocabulary.json"]), arrays["idf"],
                  arrays["components"], arrays["mean"], arrays["centroids"], meta["top_terms"])
