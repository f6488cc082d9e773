"""Router: TF-IDF (router.tokens) -> TruncatedSVD -> mean removal -> L2 norm (plus a few coordinates hashed from
the text, see _tie_break), balanced spherical k-means centroids, and the rule that sends training sequences to
shards and test windows to experts.

The rule. A chunk's score for expert j is its cosine similarity to centroid j minus a per-expert
offset b_j. A training sequence goes to the expert of its highest score; a test window to the experts
of its top-k scores. `router.rule: balanced` fits the offsets so that this argmax gives every expert an
equal share of the data it was fitted on (the offsets are the dual prices of the balanced assignment);
`router.rule: nearest` is the paper's nearest centroid (b = 0), whose shards are as unequal as the
corpus's topics. k-means, shard assignment and routing all use the same scores.

Saved without pickle: the vocabulary as JSON, the arrays as safetensors, both checksummed, so a
router written on one machine loads bit-identically on any other.
"""

from __future__ import annotations

import codecs
import hashlib
import itertools
import json
import math
from dataclasses import dataclass, field

import numpy as np
import scipy.sparse as sp
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save
from scipy.sparse.csgraph import csgraph_from_dense, dijkstra
from sklearn.cluster import kmeans_plusplus
from sklearn.decomposition import TruncatedSVD
from sklearn.feature_extraction.text import TfidfVectorizer

from soma_cluster.config import RouterConfig
from soma_cluster.errors import ChecksumError, SomaError
from soma_cluster.storage import Store, sha256

SCORE_BATCH = 8192  # rows per (rows, N) score block: 8 MiB of float32 at N = 256
TIE_DIMS = 8  # coordinates hashed from a chunk's text, appended to its embedding (_tie_break)
TIE_SCALE = 0.25  # their norm beside the unit SVD part


def _cut_or_latin1(exc: UnicodeDecodeError) -> tuple[str, int]:
    """Bytes that are not UTF-8: the pieces of a character cut by the chunk's edges (continuation bytes at
    the start, a lead byte without its continuation at the end) are dropped; any other byte is read as its
    Latin-1 character, so Latin-1 letters stay letters."""
    cut = exc.reason == "unexpected end of data" or all(0x80 <= b < 0xC0 for b in exc.object[: exc.end])
    return ("" if cut else exc.object[exc.start : exc.end].decode("latin-1")), exc.end


codecs.register_error("soma-router", _cut_or_latin1)


def router_text(data: bytes) -> str:
    """The text the router reads from a chunk of bytes (the fit sample, every shard sequence, every test
    window's prefix): UTF-8 where the bytes are UTF-8, Latin-1 where they are not ('f\\xefle' -> 'fïle')."""
    return data.decode("utf-8", errors="soma-router")


TOKEN_PATTERNS = {
    "words": r"(?u)\b\w\w+\b",  # scikit-learn's default
    "layout": r"(?u)\b\w+\b|[^\w\s]+|\n\s*",  # + 1-letter words, punctuation runs, newline + indentation
}


def _vectorizer(cfg: RouterConfig, vocabulary: dict[str, int] | None = None) -> TfidfVectorizer:
    return TfidfVectorizer(
        max_features=cfg.max_features,
        sublinear_tf=True,
        stop_words="english",
        token_pattern=TOKEN_PATTERNS[cfg.tokens],
        min_df=1 if vocabulary is not None else cfg.min_df,
        vocabulary=vocabulary,
        dtype=np.float32,
    )


def _l2(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def _tie_break(texts: list[str]) -> np.ndarray:
    """(n, TIE_DIMS) float32 rows of norm TIE_SCALE, a hash of each text.

    Chunks the SVD part cannot tell apart (no vocabulary term: numbers, base64, tables; or terms outside
    the top components) all land on one point, -mean; a rule that is a function of that point alone sends
    every one of them to one expert, however many there are, and no offsets can balance them. The hashed
    coordinates make them distinct points that balanced k-means and the offsets can split, while leaving
    real topics alone: every embedding has the same norm split (1 : TIE_SCALE), so a row's cosine scores
    shrink by one common factor (an argmax the offsets absorb), and a topic centroid averages the random
    hash coordinates of its members to near zero. Identical texts still hash alike and share an expert."""
    raw = b"".join(
        hashlib.blake2b(t.encode("utf-8", "surrogatepass"), digest_size=2 * TIE_DIMS).digest() for t in texts
    )
    h = np.frombuffer(raw, dtype="<i2").reshape(len(texts), TIE_DIMS).astype(np.float32) + np.float32(
        0.5
    )  # never all zero
    return np.float32(TIE_SCALE) * _l2(h)


def _unit_rows(proj: np.ndarray, mean: np.ndarray, texts: list[str], tie_break: bool = True) -> np.ndarray:
    """Router embeddings (n, k [+ TIE_DIMS]) of unit norm from SVD projections (n, k) of `texts`."""
    u = _l2(proj - mean)
    if not tie_break:
        return u.astype(np.float32)
    return (np.hstack([u, _tie_break(texts)]) / np.float32(np.sqrt(1.0 + TIE_SCALE**2))).astype(np.float32)


def assign(emb: np.ndarray, centroids: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """The rule on unit rows emb (n, k), in blocks (emb may be a memory map): (n,) argmax_j emb.c_j - b_j."""
    b = offsets.astype(np.float32)
    return np.concatenate(
        [np.argmax(emb[a : a + SCORE_BATCH] @ centroids.T - b, axis=1) for a in range(0, len(emb), SCORE_BATCH)]
        or [np.zeros(0, np.int64)]
    )


@dataclass
class Router:
    cfg: RouterConfig
    vocabulary: list[str]  # term of each TF-IDF column
    idf: np.ndarray  # (V,) float32
    components: np.ndarray  # (k, V) float32, SVD rows
    mean: np.ndarray  # (k,) float32, subtracted after projection
    centroids: np.ndarray  # (N, k + TIE_DIMS) float32, unit rows
    offsets: np.ndarray  # (N,) float32, subtracted from the cosine similarity; zeros for rule nearest
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
        """(n,) texts -> (n, k + TIE_DIMS) unit vectors in the router space (n, k for a router saved before
        the hashed coordinates existed: its centroids have k columns)."""
        tfidf = self.vectorizer().transform(texts).astype(np.float32)
        return _unit_rows(
            np.asarray(tfidf @ self.components.T, dtype=np.float32),
            self.mean,
            texts,
            tie_break=self.centroids.shape[1] > self.mean.shape[0],
        )

    def scores(self, emb: np.ndarray) -> np.ndarray:
        """(n, k) -> (n, N) the rule's scores: cosine similarity to each centroid minus its offset."""
        return emb @ self.centroids.T - self.offsets

    def assign(self, emb: np.ndarray) -> np.ndarray:
        """(n, k) -> (n,) the expert whose shard a sequence belongs to: its best score."""
        return assign(emb, self.centroids, self.offsets)

    def route(self, emb: np.ndarray, top_k: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(n, k) -> experts (n, m) and weights (n, m) for the m = min(top_k, N) best scores (top_k: the config's
        unless given; the evaluation's top-k sensitivity asks for others), so the first
        expert of a window is the one whose shard it would be in. softmax weighting is c-BTM's
        exp(-d^2 / T) with the rule's distance d^2 = 2 - 2 score: for unit vectors 2 - 2 cos is the squared
        Euclidean distance to the centroid, and the offset adds 2 b_j (nothing under rule nearest)."""
        scores = self.scores(emb)
        m = min(top_k or self.cfg.k(self.n_experts), self.n_experts)
        top = np.argsort(-scores, axis=1, kind="stable")[:, :m]
        if self.cfg.weighting == "uniform":
            return top, np.full(top.shape, 1.0 / m, dtype=np.float64)
        d2 = 2.0 - 2.0 * np.take_along_axis(scores, top, axis=1).astype(np.float64)
        logits = -d2 / self.cfg.temperature
        w = np.exp(logits - logits.max(axis=1, keepdims=True))
        return top, w / w.sum(axis=1, keepdims=True)


# -- the balanced rule's offsets -----------------------------------------------------------------------------
TEMPERATURES = (0.05, 0.02, 0.01, 0.005, 0.002, 1e-3, 3e-4, 1e-4)  # smoothing, in cosine units; the last sets how
# close the soft loads are to the hard argmax's counts
WARM_FROM = 2  # a warm start (offsets near the answer already) skips the two coarsest temperatures
CANDIDATES = 16  # clusters a row is looked at for (its best under the current offsets) past DENSE_ENTRIES
DENSE_ENTRIES = 1 << 23  # rows x clusters fitted on every cluster at once (float64 temporaries of 64 MiB)
ROUNDS = 6  # candidate refreshes; one more than the first is typical
NEWTON_ITERS = 20  # per temperature; 2-4 are typical
KMEANS_TEMPERATURE = 0.01  # how far intermediate k-means steps fit the offsets
MAX_STEP = 0.25  # largest change of one offset per Newton step (similarities span [-1, 1])
SETTLE_PATHS = 4096  # surplus rows settled exactly after Newton (a few per cluster at most when it converged)
SETTLE_MARGINS = (1e-6, 4e-7, 1.6e-7, 0.0)  # how far a settled row beats its next candidate, widest first (float32
# scores resolve about 1e-7; at 0, ties fall with rounding)
SETTLE_CYCLES = 64  # cycles of ties closer than that, shared out, before a narrower margin is tried


def _candidates(emb: np.ndarray, centroids: np.ndarray, offsets: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's m best clusters under the offsets: similarities (n, m) float32 and cluster ids (n, m)."""
    sims, cols = [], []
    b = offsets.astype(np.float32)
    for a in range(0, len(emb), SCORE_BATCH):
        s = emb[a : a + SCORE_BATCH] @ centroids.T
        c = (
            np.argpartition(b - s, m - 1, axis=1)[:, :m]
            if m < len(centroids)
            else np.broadcast_to(np.arange(m), s.shape)
        )
        sims.append(np.take_along_axis(s, c, axis=1))
        cols.append(c.astype(np.int32))
    return np.concatenate(sims), np.concatenate(cols)


def _reach(
    emb: np.ndarray, centroids: np.ndarray, b: np.ndarray, sims: np.ndarray, cols: np.ndarray, caps: np.ndarray
) -> np.ndarray:
    """Lower the offset of every cluster that is a candidate of fewer rows than its cap (a cold start from
    far-off centroids) just enough that it becomes one for cap rows: the fit is then feasible."""
    short = np.flatnonzero(np.bincount(cols.ravel(), minlength=len(caps)) < caps)
    if not len(short):
        return b
    worst = (sims - b[cols]).min(axis=1)  # a row's m-th best score
    margin = (
        np.concatenate([emb[a : a + SCORE_BATCH] @ centroids[short].T for a in range(0, len(emb), SCORE_BATCH)])
        - worst[:, None]
    )
    b = b.copy()
    for i, j in enumerate(short):  # cap-th largest margin: that many rows take j in
        b[j] = min(b[j], np.partition(margin[:, i], -int(caps[j]))[-int(caps[j])] - 1e-6)
    return b


def _smoothed_dual(
    sims: np.ndarray, cols: np.ndarray, caps: np.ndarray, b: np.ndarray, temp: float
) -> tuple[float, np.ndarray]:
    """D_T(b) = sum_i T logsumexp_j((s_ij - b_j) / T) + caps.b and the soft assignment pi (n, m)."""
    z = (sims - b[cols]) / temp
    top = z.max(axis=1, keepdims=True)
    e = np.exp(z - top)
    total = e.sum(axis=1, keepdims=True)
    return float(temp * (top + np.log(total)).sum() + caps @ b), e / total


def _gram(pi: np.ndarray, cols: np.ndarray, n_clusters: int) -> np.ndarray:
    """sum_i pi_i pi_i^T over the clusters (N, N): one matmul when every row sees every cluster, else sparse
    (at small T a row's mass sits on one or two of its candidates)."""
    if cols.shape[1] == n_clusters:
        return pi.T @ pi
    keep = pi > 1e-12
    p = sp.csr_matrix((pi[keep], (np.nonzero(keep)[0], cols[keep])), shape=(len(pi), n_clusters))
    return (p.T @ p).toarray()


def _newton(sims: np.ndarray, cols: np.ndarray, caps: np.ndarray, b: np.ndarray, temp: float) -> np.ndarray:
    """Minimise D_T from b. Gradient: caps - soft loads; Hessian: (diag(loads) - sum_i pi_i pi_i^T) / T, a
    graph Laplacian over the clusters (null space: a shift of every offset, which changes no argmax)."""
    n_clusters = len(caps)
    f, pi = _smoothed_dual(sims, cols, caps, b, temp)
    for _ in range(NEWTON_ITERS):
        load = np.bincount(cols.ravel(), pi.ravel(), minlength=n_clusters)
        grad = caps - load
        if np.abs(grad).max() < 0.5:  # every soft load within half a row of its cap
            break
        hess = (np.diag(load) - _gram(pi, cols, n_clusters)) / temp
        hess += np.eye(n_clusters) * 1e-6 * max(np.trace(hess) / n_clusters, 1.0)  # ridge: the null space, and rows
        step = -np.linalg.solve(hess, grad)  # all on one cluster (no soft mass)
        step *= min(1.0, MAX_STEP / np.abs(step).max())
        t, slope = 1.0, float(grad @ step)
        for _ in range(20):  # backtracking (Armijo) line search
            f_new, pi_new = _smoothed_dual(sims, cols, caps, b + t * step, temp)
            if f_new <= f + 1e-4 * t * slope:
                break
            t *= 0.5
        else:
            break  # no descent left at this temperature's precision
        b, f, pi = b + t * step, f_new, pi_new
    return b


def _load_spread(emb: np.ndarray, centroids: np.ndarray, b: np.ndarray, caps: np.ndarray) -> float:
    return size_spread(np.bincount(assign(emb, centroids, b), minlength=len(caps)) / caps)


def _fit_rounds(
    emb: np.ndarray, centroids: np.ndarray, b: np.ndarray, caps: np.ndarray, m: int, temps: tuple
) -> np.ndarray:
    """Newton over every temperature on each row's m candidate clusters, refreshing the candidates until no
    row's best cluster lies outside them (with m = N, one round). With m < N a round is kept only if it leaves
    the hard loads over emb nearer equal than the best offsets before it: where the candidate sets cannot give
    every cluster its share (topics so tight that many centroids sit within a row's similarity noise; seen at
    N = 256 on real text features), the restricted dual has no minimum and Newton walks the offsets off."""
    n = len(emb)
    chosen, kept, kept_spread = None, b, np.inf if m == len(centroids) else _load_spread(emb, centroids, b, caps)
    for _ in range(ROUNDS):
        sims, cols = _candidates(emb, centroids, b, m)
        best = cols[np.arange(n), np.argmax(sims - b[cols], axis=1)]
        if chosen is not None and np.array_equal(best, chosen):
            break
        reached = _reach(emb, centroids, b, sims, cols, caps)
        if reached is not b:  # candidates again under the lowered offsets
            b = reached
            sims, cols = _candidates(emb, centroids, b, m)
        for temp in temps:
            b = _newton(sims, cols, caps, b, temp)
        if m == len(centroids):
            return b
        spread = _load_spread(emb, centroids, b, caps)
        if spread < kept_spread:
            kept, kept_spread = b, spread
        chosen = cols[np.arange(n), np.argmax(sims - b[cols], axis=1)]
        temps = temps[WARM_FROM:] or temps[-1:]  # later rounds start warm
    return kept


def _cheapest(to: np.ndarray, red: np.ndarray, n_clusters: int) -> tuple[np.ndarray, np.ndarray]:
    """Per cluster k: the least red over the entries going to k (inf where none) and that entry's index."""
    low, at = np.full(n_clusters, np.inf), np.full(n_clusters, -1, np.int64)
    order = np.argsort(to, kind="stable")  # entries by cluster (a radix sort)
    to, red = to[order], red[order]
    new = np.r_[True, to[1:] != to[:-1]]
    seg = np.cumsum(new) - 1
    hit = np.flatnonzero(red == np.minimum.reduceat(red, np.flatnonzero(new))[seg])
    hit = hit[np.r_[True, seg[hit][1:] != seg[hit][:-1]]]  # the first entry at each cluster's minimum
    low[to[hit]], at[to[hit]] = red[hit], order[hit]
    return low, at


def _leave_costs(
    sims: np.ndarray,
    cols: np.ndarray,
    b: np.ndarray,
    slot: np.ndarray,
    movable: np.ndarray,
    members: np.ndarray,
    n_clusters: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For one cluster's member rows, per cluster k: the least score any member gives up by moving to k under
    the offsets b (what the offsets must keep; >= 0 while every row is at its best, up to float rounding; inf
    where no member has k as a candidate), the same over the movable members only (the cost of a move) and
    that member."""
    keep, move, who = np.full(n_clusters, np.inf), np.full(n_clusters, np.inf), np.full(n_clusters, -1, np.int64)
    if not len(members):
        return keep, move, who
    adj = sims[members] - b[cols[members]]
    i = np.arange(len(members))
    red = adj[i, slot[members]][:, None] - adj
    red[i, slot[members]] = np.inf
    to = cols[members].ravel()
    keep, at = _cheapest(to, red.ravel(), n_clusters)
    if not movable[members].all():  # identical rows: constraints, never movers
        red[~movable[members]] = np.inf
        move, at = _cheapest(to, red.ravel(), n_clusters)
    else:
        move = keep  # the caller copies both into its matrices
    found = at >= 0
    who[found] = members[at[found] // cols.shape[1]]
    return keep, move, who


def _strict(cost: np.ndarray, margin: float) -> np.ndarray | None:
    """Offset changes x (N,) with x_j - x_k <= cost_jk - margin (Bellman-Ford over the clusters): every row then
    beats each of its other candidates by the margin. A cycle of clusters whose costs add up to less than that
    (rows within float rounding of each other across a boundary) cannot: its edges share what it has equally,
    up to SETTLE_CYCLES such cycles; past that, None."""
    n_clusters = len(cost)
    bound = cost - margin
    for _ in range(SETTLE_CYCLES + 1):
        x, pred = np.zeros(n_clusters), np.full(n_clusters, -1)
        for _ in range(n_clusters):
            via = x[None, :] + bound
            k = np.argmin(via, axis=1)
            better = via[np.arange(n_clusters), k] < x
            if not better.any():
                return x
            x[better], pred[better] = via[better, k[better]], k[better]
        j = np.flatnonzero(better)[0]
        for _ in range(n_clusters):  # back along the predecessors into a cycle
            j = pred[j]
        cycle = [j]
        while pred[cycle[-1]] != j:
            cycle.append(pred[cycle[-1]])
        src, dst = np.array(cycle), np.array(cycle[1:] + cycle[:1])
        share = max(float(cost[src, dst].sum()), 0.0) / len(cycle)
        bound[src, dst] = np.maximum(bound[src, dst], cost[src, dst] - share)
    return None


def _pinned_caps(caps: np.ndarray, pinned: np.ndarray) -> np.ndarray:
    """Caps that hold every cluster's identical rows (pinned: they cannot be split) and take what that leaves over
    from the largest caps, so the rest stay as equal as they can (same total)."""
    if (pinned <= caps).all():
        return caps
    total = caps.sum()
    level = max(int(caps.max()), 1)
    while level > 0 and np.maximum(pinned, np.minimum(caps, level - 1)).sum() >= total:
        level -= 1
    out = np.maximum(pinned, np.minimum(caps, level))
    cut = np.flatnonzero((out == level) & (pinned < level))[: int(out.sum() - total)]
    out[cut] -= 1
    return out


def _row_keys(emb: np.ndarray) -> np.ndarray:
    """(n,) uint64: a hash of each row's bytes (random odd multipliers, sums wrapping mod 2^64), in blocks, so
    identical rows are found without sorting or copying the rows themselves (1 M rows of 136 floats: 0.5 GB)."""
    n_words = emb.shape[1] * emb.dtype.itemsize // 4  # 32-bit words of a row
    mult = np.random.default_rng(0).integers(1, 2**62, n_words, dtype=np.uint64) * 2 + 1
    keys = np.empty(len(emb), np.uint64)
    for a in range(0, len(emb), SCORE_BATCH):
        words = np.ascontiguousarray(emb[a : a + SCORE_BATCH]).view(np.uint32).astype(np.uint64)
        keys[a : a + SCORE_BATCH] = (words * mult).sum(axis=1)
    return keys


def _settle(emb: np.ndarray, centroids: np.ndarray, b32: np.ndarray, caps: np.ndarray, m: int) -> np.ndarray:
    """The last rows. Newton leaves the hard argmax a few rows off the caps: rows within the last temperature of
    a tie, which fall one way or the other with the machine's float rounding. Settle them exactly as a min-cost
    flow: from the argmax under b (every row at its best, so every move costs >= 0), send each surplus row along
    the cheapest chain of moves (Dijkstra over the clusters, edge j -> k costing the least any member of j gives
    up by moving to k) to a cluster short of its cap, raising the offsets of the clusters nearer than that
    chain's cost by the difference (the transportation problem's successive shortest paths). Then spread the
    ties that leaves (Bellman-Ford) so every row beats its next candidate by a margin float32 rounding cannot
    undo, and keep the result if `assign` confirms it is nearer equal. Identical rows score alike under any
    offsets, so no rule can split them: a group larger than a share stays where it is (its cluster's cap grows to
    hold it, other members leave instead); a smaller group moves row by row, and where a chain moved one of its
    rows the group's tie falls together, leaving its clusters a row or two off."""
    n_clusters = len(caps)
    sims, cols = _candidates(emb, centroids, b32, m)
    slot = np.argmax(sims - b32[cols], axis=1)  # float32, as `assign` computes it
    label = cols[np.arange(len(sims)), slot]
    load = np.bincount(label, minlength=n_clusters)
    if np.array_equal(load, caps):
        return b32
    b = b32.astype(np.float64)
    _, twin, count = np.unique(_row_keys(emb), return_inverse=True, return_counts=True)
    movable = count[twin] <= caps.min()  # identical rows share every score: a group larger than a share stays
    caps = _pinned_caps(caps, np.bincount(label[~movable], minlength=n_clusters))
    best, best_excess = b32, np.maximum(load - caps, 0).sum()  # label is the rule's own argmax under b32
    keep, free, who = (
        np.empty((n_clusters, n_clusters)),
        np.empty((n_clusters, n_clusters)),
        np.empty((n_clusters, n_clusters), np.int64),
    )
    groups = np.split(np.argsort(label, kind="stable"), np.cumsum(load)[:-1])  # members of each cluster
    for j in range(n_clusters):
        keep[j], free[j], who[j] = _leave_costs(sims, cols, b, slot, movable, groups[j], n_clusters)
    for _ in range(SETTLE_PATHS):
        over, short = np.flatnonzero(load > caps), np.flatnonzero(load < caps)
        if not len(over):
            break
        dist, pred, _ = dijkstra(
            csgraph_from_dense(np.maximum(free, 0.0), null_value=np.inf),
            indices=over,
            min_only=True,
            return_predecessors=True,
        )
        d = short[np.argmin(dist[short])]
        if not np.isfinite(dist[d]):
            break  # no chain of candidates reaches a short cluster
        rise = np.maximum(dist[d] - dist, 0.0)  # keeps every move's cost >= 0; the chain's are 0
        b += rise
        keep += rise[None, :] - rise[:, None]
        free += rise[None, :] - rise[:, None]
        path = [d]
        while pred[path[-1]] >= 0:
            path.append(pred[path[-1]])
        for k, j in itertools.pairwise(path):  # the cheapest movable member of j moves to k
            r = who[j, k]
            slot[r] = np.flatnonzero(cols[r] == k)[0]
            groups[j], groups[k] = groups[j][groups[j] != r], np.append(groups[k], r)
        load[path[-1]] -= 1
        load[d] += 1
        for j in path:
            keep[j], free[j], who[j] = _leave_costs(sims, cols, b, slot, movable, groups[j], n_clusters)

    def excess(offsets: np.ndarray) -> float:  # rows over the caps under the rule itself
        return np.maximum(np.bincount(assign(emb, centroids, offsets), minlength=n_clusters) - caps, 0).sum()

    for bounds in (keep, free):  # free: identical rows may move, as a whole
        for margin in SETTLE_MARGINS:  # the widest margin the ties allow
            x = _strict(bounds, margin)
            if x is None:
                continue
            offsets = (b + x).astype(np.float32)
            found = excess(offsets)
            if found < best_excess:
                best, best_excess = offsets, found
            if found == 0:
                return best
    return best


def _caps(n: int, n_clusters: int) -> np.ndarray:
    caps = np.full(n_clusters, n // n_clusters, dtype=np.float64)
    caps[: n % n_clusters] += 1
    return caps


def fit_offsets(
    emb: np.ndarray,
    centroids: np.ndarray,
    offsets: np.ndarray | None = None,
    temperature: float = TEMPERATURES[-1],
    settle: bool = True,
) -> np.ndarray:
    """Offsets b (N,) under which the rule argmax_j(emb.c_j - b_j) gives every cluster an equal share of the
    rows of emb (n, k): to the row at the last temperature (_settle), up to the rows within about `temperature`
    of a tie at a coarser one (k-means steps).

    They are the dual prices of the balanced assignment, the linear program "maximise the total similarity,
    every cluster holding n / N rows": at its optimum every row is in its cluster of highest similarity minus
    price, so the prices turn the balanced assignment into a rule any new chunk can follow. We minimise the
    entropy-smoothed dual D_T (convex; see _smoothed_dual) by Newton's method while lowering T to
    `temperature`, so the soft loads it balances become the hard argmax's counts. Every fit, cold or warm,
    first runs on every cluster at once, on all rows or on DENSE_ENTRIES / N evenly spaced ones (a warm
    start restricted to candidate clusters from the start diverged at N = 256 when the centroids had moved:
    k-means iterations); past that limit each row is then looked at for its CANDIDATES best clusters only
    (bounded memory for millions of rows). `offsets` warm-starts the fit (k-means iterations, the refit over
    all sequences). `settle=False` stops at Newton (benchmarks/bench_clustering.py --part settle compares)."""
    n, n_clusters = len(emb), len(centroids)
    if n_clusters == 1:
        return np.zeros(1, np.float32)
    schedule = tuple(t for t in TEMPERATURES if t >= temperature)
    b = np.zeros(n_clusters) if offsets is None else offsets.astype(np.float64)
    if offsets is not None:
        schedule = schedule[WARM_FROM:] or schedule[-1:]
    dense = n * n_clusters <= DENSE_ENTRIES
    rows = emb if dense else emb[np.linspace(0, n - 1, DENSE_ENTRIES // n_clusters).astype(np.int64)]
    b = _fit_rounds(rows, centroids, b, _caps(len(rows), n_clusters), n_clusters, schedule)
    if not dense:
        b = _fit_rounds(emb, centroids, b, _caps(n, n_clusters), CANDIDATES, schedule[WARM_FROM:] or schedule[-1:])
    b = (b - b.mean()).astype(np.float32)
    if temperature > TEMPERATURES[-1] or not settle:
        return b  # k-means steps: near-equal is enough
    return _settle(emb, centroids, b, _caps(n, n_clusters), n_clusters if dense else CANDIDATES)


# -- fitting ----------------------------------------------------------------------------------------------
def balanced_kmeans(x: np.ndarray, n_clusters: int, iters: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Spherical k-means on unit rows x (n, k) whose assignment step is the balanced rule itself: returns
    centroids (N, k), their offsets (N,) and the labels (n,) the rule gives x (equal sizes up to ties).
    Intermediate steps fit the offsets only down to KMEANS_TEMPERATURE (near-equal is enough to move the
    centroids); the final centroids get the full fit.

    Seeded by sklearn's k-means++: on unit rows its squared Euclidean distance is 2 - 2 cos, twice the cosine
    distance, so its D^2 sampling is spherical k-means++ (with sklearn's greedy local trials on top)."""
    # float64 in: on float32 rows sklearn upcasts its distances block by block, about 10x slower here
    centroids = kmeans_plusplus(x.astype(np.float64), n_clusters, random_state=seed)[0].astype(np.float32)
    offsets, labels = None, None
    for _ in range(iters - 1):
        offsets = fit_offsets(x, centroids, offsets, KMEANS_TEMPERATURE)
        new = assign(x, centroids, offsets)
        if labels is not None and np.array_equal(new, labels):
            break
        labels = new
        members = sp.csr_matrix((np.ones(len(x), np.float32), (labels, np.arange(len(x)))), shape=(n_clusters, len(x)))
        sums = np.asarray(members @ x)
        empty = np.bincount(labels, minlength=n_clusters) == 0  # identical rows cannot be split: keep such a centroid
        centroids = np.where(empty[:, None], centroids, _l2(sums)).astype(np.float32)
    offsets = fit_offsets(x, centroids, offsets)
    return centroids, offsets, assign(x, centroids, offsets)


def identical_share(sample: list[bytes]) -> tuple[float, float]:
    """(the share of the sample that its most repeated sequence makes up, a lower bound on that share in the whole
    corpus at about 3 standard deviations). The sample is drawn by key, uniformly over the corpus's sequences, so
    the count c of the most repeated one is about Poisson: c - 3 sqrt(c) is rarely above its true count."""
    if not sample:
        return 0.0, 0.0
    counts: dict[bytes, int] = {}
    for s in sample:
        counts[s] = counts.get(s, 0) + 1
    c = max(counts.values())
    return c / len(sample), max(0.0, c - 3.0 * math.sqrt(c)) / len(sample)


def size_spread(sizes: np.ndarray) -> float:
    """max |size / mean size - 1| over the clusters: 0 is perfect balance."""
    return float(np.abs(sizes / sizes.mean() - 1.0).max())


def cluster_spread(labels: np.ndarray, n_clusters: int) -> float:
    return size_spread(np.bincount(labels, minlength=n_clusters))


def _top_terms(tfidf, labels: np.ndarray, vocabulary: list[str], n_clusters: int, k: int = 8) -> list[list[str]]:
    out = []
    for c in range(n_clusters):
        rows = tfidf[labels == c]
        weights = np.asarray(rows.mean(axis=0)).ravel() if rows.shape[0] else np.zeros(len(vocabulary))
        out.append([vocabulary[i] for i in np.argsort(-weights)[:k]])
    return out


def fit_router(texts: list[str], n_clusters: int, cfg: RouterConfig, seed: int) -> tuple[Router, np.ndarray]:
    """Fit on a sample of chunk texts; returns the router and the sample's balanced k-means labels (equal to
    the row but for identical chunks, which share a cluster; prepare refits the offsets over all sequences).
    Under rule nearest the offsets are zero (the centroids are the same). The router keeps cfg with top_k resolved
    for N = n_clusters (router.json then says what routing the campaign uses)."""
    cfg = cfg.resolved(n_clusters)
    if len(texts) < n_clusters:
        raise SomaError(f"router sample has {len(texts)} chunks for {n_clusters} experts; lower n_experts or add data")
    vec = _vectorizer(cfg)
    try:
        tfidf = vec.fit_transform(texts)
    except ValueError:
        raise SomaError(
            f"router: no word occurs in >= {cfg.min_df} chunks (corpus too small or not text); "
            "add text or lower router.min_df"
        ) from None
    vocabulary = [t for t, _ in sorted(vec.vocabulary_.items(), key=lambda kv: kv[1])]
    dim = min(cfg.svd_dim, len(vocabulary) - 1, len(texts) - 1)
    if dim < 2:
        raise SomaError(
            f"router: only {len(vocabulary)} terms survive min_df={cfg.min_df}; add text or lower router.min_df"
        )
    svd = TruncatedSVD(n_components=dim, random_state=seed, algorithm="randomized")
    proj = svd.fit_transform(tfidf).astype(np.float32)
    mean = proj.mean(axis=0)
    emb = _unit_rows(proj, mean, texts)
    centroids, offsets, labels = balanced_kmeans(emb, n_clusters, cfg.kmeans_iters, seed)
    if cfg.rule == "nearest":
        offsets = np.zeros(n_clusters, np.float32)
    router = Router(
        cfg,
        vocabulary,
        vec.idf_.astype(np.float32),
        svd.components_.astype(np.float32),
        mean.astype(np.float32),
        centroids,
        offsets,
    )
    router.top_terms = _top_terms(tfidf, labels, vocabulary, n_clusters)
    return router, labels


# -- persistence ------------------------------------------------------------------------------------------
def save_router(store: Store, router: Router) -> None:
    arrays = st_save(
        {
            k: np.ascontiguousarray(v)
            for k, v in {
                "idf": router.idf,
                "components": router.components,
                "mean": router.mean,
                "centroids": router.centroids,
                "offsets": router.offsets,
            }.items()
        }
    )
    vocab = json.dumps(router.vocabulary).encode()
    store.write_bytes("router/arrays.safetensors", arrays)
    store.write_bytes("router/vocabulary.json", vocab)
    store.write_json(
        "router/router.json",
        {
            "config": router.cfg.model_dump(mode="json"),
            "n_experts": router.n_experts,
            "svd_dim": int(router.mean.shape[0]),
            "top_terms": router.top_terms,
            "files": {"arrays.safetensors": sha256(arrays), "vocabulary.json": sha256(vocab)},
        },
    )


def load_router(store: Store) -> Router:
    """A router saved before the balanced rule existed has no offsets: it loads as rule nearest, the rule its
    campaign's shards were made with, so routing still agrees with them; one saved before router.tokens existed
    loads with the terms it was fitted with (words)."""
    meta = store.read_json("router/router.json")
    blobs = {}
    for name, digest in meta["files"].items():
        try:
            blobs[name] = store.read_bytes(f"router/{name}")
        except FileNotFoundError:
            raise SomaError(
                f"{store.url}/router/{name} is missing; re-run soma prepare on a new campaign URL"
            ) from None
        if sha256(blobs[name]) != digest:
            raise ChecksumError(
                f"{store.url}/router/{name} fails its checksum (corrupt); re-run soma prepare on a new campaign URL"
            )
    arrays = st_load(blobs["arrays.safetensors"])
    cfg = RouterConfig.model_validate({"tokens": "words", **meta["config"]})  # saved before tokens existed: words
    if "offsets" not in arrays:
        cfg = cfg.model_copy(update={"rule": "nearest"})
    offsets = arrays.get("offsets", np.zeros(len(arrays["centroids"]), np.float32))
    return Router(
        cfg,
        json.loads(blobs["vocabulary.json"]),
        arrays["idf"],
        arrays["components"],
        arrays["mean"],
        arrays["centroids"],
        offsets,
        meta["top_terms"],
    )
