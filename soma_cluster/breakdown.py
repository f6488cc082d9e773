"""What an evaluation's one number is made of: loss per source and per document, the baselines scored in the same
paired protocol (best single expert, oracle routing, uniform mixture over the experts), the loss against top-k,
the routing load and whether it concentrates. Pure numpy on per-window arrays; `pipelines/evaluate.py` runs the
models and writes what these return.

Arrays: nats (n, S) -log p of each scored prediction of n windows; probs (N, m, S) each expert's p(target) on m
windows (a sample of the n, `baseline_rows`); weights (R, n) the bootstrap's multiplicity of each window
(ensemble.bootstrap_weights), so a subset of windows keeps the same document resampling (weights[:, rows]).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from soma_cluster.ensemble import ci
from soma_cluster.errors import SomaError

# The baselines need every expert on every window they score: N x m forwards of a window, where the routed ensemble
# needs k x n. They score m windows, evenly spaced over the n, with N x m at most max(BASELINE_MIN_EXPERT_WINDOWS,
# BASELINE_COST x k x n): never more than twice the ensemble's own pass, and all windows whenever that fits; but never
# fewer than BASELINE_MIN_WINDOWS (all of them if fewer): at N = 256 the budget alone gave 16 windows, on which the
# best single expert was a different one from the one all 2,310 windows named. Above the budget this costs N x 256
# window passes (about 5 minutes at N = 256 on 2 CPU cores, 30 s on a GPU), and the report says so.
BASELINE_MIN_EXPERT_WINDOWS = 4096
BASELINE_COST = 2
BASELINE_MIN_WINDOWS = 256
# The routing load concentrates when the busiest expert's share of the windows exceeds min(2 f, (1 + f) / 2), f = k/N
# the fair share (top-k of N: each window counts for k experts): twice its share, or past half the way from its share
# to every window where twice is out of reach. Judged only where the fair count f x n is at least LOAD_MIN_FAIR windows
# (below, the count is noise: N = 256 experts on 256 windows see about 4 each).
LOAD_MIN_FAIR = 10
ORACLE_RULE = (
    "per window, the k experts whose own loss on that window's scored bytes is lowest (chosen with hindsight, on "
    "the targets), their probabilities mixed uniformly (1/k each)"
)
BEST_SINGLE_RULE = "the one expert with the lowest loss summed over every scored window, alone on all of them"
UNIFORM_MIXTURE_RULE = "every expert's probabilities averaged (1/N each) on every window, no router"


@dataclass(frozen=True)
class Loss:
    """nats/byte with its 95% document-bootstrap interval."""

    nats_per_byte: float
    lo: float
    hi: float

    @classmethod
    def of(cls, nats: np.ndarray, weights: np.ndarray) -> "Loss":
        """weights (R, n) of these windows; on a subset (one source's windows), the resamples that drew none of its
        documents say nothing of it and are left out (no interval when none is left)."""
        drew = weights[weights.sum(axis=1) > 0]
        if not len(drew):
            return cls(float(nats.mean()), math.nan, math.nan)
        return cls(*ci(nats, drew))

    def as_dict(self) -> dict:
        return {"nats_per_byte": self.nats_per_byte, "ci95": [self.lo, self.hi]}

    def summary(self) -> dict:
        """As the existing metrics' summaries: with bits/byte."""
        return {**self.as_dict(), "bits_per_byte": self.nats_per_byte / math.log(2)}


# -- per source, per document ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GroupLoss:
    """One source's windows: the ensemble's and the seed's loss there, and their paired difference."""

    source: str
    windows: int
    documents: int
    ensemble: Loss
    seed: Loss
    ensemble_minus_seed: Loss

    def as_dict(self) -> dict:
        return {
            "source": self.source,
            "windows": self.windows,
            "documents": self.documents,
            "ensemble": self.ensemble.summary(),
            "seed": self.seed.summary(),
            "ensemble_minus_seed": self.ensemble_minus_seed.as_dict(),
        }


def by_source(
    nats: np.ndarray, seed_nats: np.ndarray, docs: np.ndarray, sources: dict[int, str], weights: np.ndarray
) -> list[GroupLoss]:
    """Loss per source of the windows' documents (docs (n,) document ids; sources: id -> source, "unknown" for an id
    it lacks), largest source first. A source's interval resamples only its own documents' windows."""
    label = np.array([sources.get(int(d), "unknown") for d in docs], dtype=object)
    out = []
    for s in sorted(set(label), key=lambda s: (-(label == s).sum(), s)):
        rows = np.flatnonzero(label == s)
        w = weights[:, rows]
        out.append(
            GroupLoss(
                s,
                len(rows),
                len(np.unique(docs[rows])),
                Loss.of(nats[rows], w),
                Loss.of(seed_nats[rows], w),
                Loss.of(nats[rows] - seed_nats[rows], w),
            )
        )
    return out


@dataclass(frozen=True)
class DocumentLoss:
    doc: int  # the held-out document's id (parts.owner_id)
    name: str  # its name in the corpus ("" for a campaign prepared before test/documents.json)
    source: str
    windows: int
    ensemble_nats_per_byte: float
    seed_nats_per_byte: float


def by_document(
    nats: np.ndarray, seed_nats: np.ndarray, docs: np.ndarray, names: dict[int, tuple[str, str]]
) -> list[DocumentLoss]:
    """Loss per document (no interval: one document is one bootstrap unit), hardest first; names: id -> (name,
    source)."""
    out = []
    for d in np.unique(docs):
        rows = docs == d
        name, source = names.get(int(d), ("", "unknown"))
        out.append(
            DocumentLoss(int(d), name, source, int(rows.sum()), float(nats[rows].mean()), float(seed_nats[rows].mean()))
        )
    return sorted(out, key=lambda x: (-x.ensemble_nats_per_byte, x.doc))


# -- the baselines ---------------------------------------------------------------------------------------------------
def baseline_rows(n_windows: int, n_experts: int, top_k: int) -> np.ndarray:
    """The windows the baselines score: all of them when N x n fits the budget (see BASELINE_COST), else m evenly
    spaced ones."""
    budget = max(BASELINE_MIN_EXPERT_WINDOWS, BASELINE_COST * top_k * n_windows)
    m = min(n_windows, max(BASELINE_MIN_WINDOWS, budget // max(n_experts, 1)))
    if m >= n_windows:
        return np.arange(n_windows)
    return np.unique(np.linspace(0, n_windows - 1, m).round().astype(np.int64))


def mixture_nats(probs: np.ndarray, experts: np.ndarray, mix: np.ndarray) -> np.ndarray:
    """-log sum_j mix[i, j] p_{experts[i, j]}(x) for every scored byte: probs (N, m, S), experts and mix (m, k) ->
    (m, S)."""
    rows = np.arange(probs.shape[1])[:, None]
    chosen = probs[experts, rows]  # (m, k, S)
    return -np.log(np.maximum(np.einsum("mk,mks->ms", mix, chosen), 1e-300))


def oracle_experts(probs: np.ndarray, k: int) -> np.ndarray:
    """(m, k) each window's k experts of lowest loss on it (ORACLE_RULE)."""
    own = -np.log(np.maximum(probs, 1e-300)).sum(axis=2)  # (N, m) each expert's nats on each window
    return np.argsort(own.T, axis=1, kind="stable")[:, :k]


@dataclass(frozen=True)
class Baseline:
    name: str  # best_single, oracle, uniform_mixture, seed
    rule: str
    loss: Loss
    ensemble_minus_this: Loss  # paired, same windows: < 0 where the routed ensemble is better
    expert: int | None = None  # best_single's expert
    k: int | None = None  # oracle's k

    def as_dict(self) -> dict:
        d = {"rule": self.rule, **self.loss.summary(), "ensemble_minus_this": self.ensemble_minus_this.as_dict()}
        if self.expert is not None:
            d["expert"] = self.expert
        if self.k is not None:
            d["k"] = self.k
        return d


def baselines(
    probs: np.ndarray, ens_nats: np.ndarray, seed_nats: np.ndarray, weights: np.ndarray, k: int
) -> list[Baseline]:
    """The baselines on the sampled windows, each paired with the routed ensemble there: probs (N, m, S), ens_nats
    and seed_nats (m, S), weights (R, m)."""
    n, m = probs.shape[0], probs.shape[1]
    expert_nats = -np.log(np.maximum(probs, 1e-300))  # (N, m, S)
    best = int(np.argmin(expert_nats.sum(axis=(1, 2))))
    oracle = mixture_nats(probs, oracle_experts(probs, k), np.full((m, k), 1.0 / k))
    uniform = mixture_nats(probs, np.tile(np.arange(n), (m, 1)), np.full((m, n), 1.0 / n))

    def one(name: str, rule: str, nats: np.ndarray, **extra) -> Baseline:
        return Baseline(name, rule, Loss.of(nats, weights), Loss.of(ens_nats - nats, weights), **extra)

    return [
        one("best_single", BEST_SINGLE_RULE, expert_nats[best], expert=best),
        one("oracle", ORACLE_RULE, oracle, k=k),
        one("uniform_mixture", UNIFORM_MIXTURE_RULE, uniform),
        one("seed", "the seed model (N = 1) the experts started from", seed_nats),
    ]


def sensitivity_ks(n_experts: int, top_k: int) -> list[int]:
    """k = 1, 2, 4, ... up to N, with the configured k and N itself."""
    ks = {1, min(top_k, n_experts), n_experts}
    p = 2
    while p < n_experts:
        ks.add(p)
        p *= 2
    return sorted(ks)


@dataclass(frozen=True)
class TopK:
    k: int
    router: Loss  # the router's k nearest experts, weighted by its rule over those k
    router_minus_ensemble: Loss  # paired against the configured k
    oracle: Loss  # ORACLE_RULE at this k

    def as_dict(self) -> dict:
        return {
            "k": self.k,
            "router": self.router.summary(),
            "router_minus_ensemble": self.router_minus_ensemble.as_dict(),
            "oracle": self.oracle.summary(),
        }


def top_k_sensitivity(
    probs: np.ndarray, routes: dict[int, tuple[np.ndarray, np.ndarray]], ens_nats: np.ndarray, weights: np.ndarray
) -> list[TopK]:
    """The loss at each k from the same per-expert probabilities: routes k -> (experts, weights) (m, k) from the
    router."""
    m = probs.shape[1]
    out = []
    for k, (top, mix) in sorted(routes.items()):
        routed = mixture_nats(probs, top, mix)
        oracle = mixture_nats(probs, oracle_experts(probs, k), np.full((m, k), 1.0 / k))
        out.append(TopK(k, Loss.of(routed, weights), Loss.of(routed - ens_nats, weights), Loss.of(oracle, weights)))
    return out


# -- the routing load ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RoutingLoad:
    windows: int
    top_k: int
    n_experts: int
    per_expert: dict[int, int]  # windows routed to each expert (each window counts for its k experts)
    fair_share: float  # k / N of the windows
    max_share: float
    busiest: int
    threshold: float  # min(2 f, (1 + f) / 2)
    normalized_entropy: float  # of the load over the experts: 1 for an even load, 0 for one expert taking all
    idle: list[int]  # experts no window was routed to
    judged: bool  # fair count >= LOAD_MIN_FAIR windows
    concentrated: bool

    def as_dict(self) -> dict:
        d = asdict(self)
        d["per_expert"] = {str(e): c for e, c in self.per_expert.items()}
        return d

    def warning(self, name) -> str | None:
        """One sentence when the load concentrates (name: expert index -> its name)."""
        if not self.concentrated:
            return None
        return (
            f"routing concentrates: {name(self.busiest)} gets {self.per_expert[self.busiest]} of {self.windows} "
            f"windows (share {self.max_share:.2f}; fair share k/N = {self.fair_share:.2f}, warned above "
            f"{self.threshold:.2f}); normalized entropy of the load {self.normalized_entropy:.2f}"
            + (f", {len(self.idle)} expert(s) get none" if self.idle else "")
            + ": the experts barely specialise on these windows"
        )


def routing_load(per_expert: dict[int, int], windows: int, top_k: int, n_experts: int) -> RoutingLoad:
    counts = {e: int(per_expert.get(e, 0)) for e in range(n_experts)}
    k = min(top_k, n_experts)
    fair = k / n_experts
    busiest = max(counts, key=lambda e: (counts[e], -e))
    share = counts[busiest] / max(windows, 1)
    threshold = min(2 * fair, (1 + fair) / 2)
    c = np.array(list(counts.values()), dtype=np.float64)
    p = c[c > 0] / max(c.sum(), 1)
    entropy = float(-(p * np.log(p)).sum() / math.log(n_experts)) if n_experts > 1 and len(p) else 1.0
    judged = fair * windows >= LOAD_MIN_FAIR and k < n_experts
    return RoutingLoad(
        windows,
        k,
        n_experts,
        counts,
        fair,
        share,
        busiest,
        threshold,
        entropy,
        [e for e, n in counts.items() if n == 0],
        judged,
        judged and share > threshold,
    )


# -- the routing load by source --------------------------------------------------------------------------------------
# The fair share k/N assumes every source spread over the experts alike; a test set that is 64% one language routes
# most windows to the experts that language's training sequences went to, and that is the sharding working, not the
# routing failing. So where prepare recorded the source x expert table of the train sequences (shards/manifest.json's
# source_experts), each expert's load is judged against what the test windows' own mix of sources predicts:
#   expected windows of expert e = sum over sources s of n_s x min(1, k x P_train(e | s)),
# n_s the test windows of source s, P_train(e | s) the share of s's train sequences in e's shard (a source with none:
# the shards' overall shares). The warning fires for an expert whose share of the windows exceeds min(2 f_e,
# (1 + f_e) / 2), f_e its expected share (the fair-share rule's form), f_e counting at least LOAD_MIN_FAIR windows.
MIX_RULE = (
    "expected windows of expert e = sum over sources s of n_s x min(1, k x P_train(e | s)): n_s the test windows of "
    "source s, P_train(e | s) the share of s's train sequences in e's shard (the shards' overall shares for a source "
    "without train sequences)"
)


@dataclass(frozen=True)
class SourceRouting:
    windows: int
    top_k: int
    n_experts: int
    sources: dict[str, int]  # test windows per source, largest first
    routed: dict[str, np.ndarray]  # source -> (N,) its windows routed to each expert (each window counts for its k)
    predicted: dict[str, np.ndarray]  # source -> (N,) min(1, k P_train(e | s)): the share of its windows e should get
    trained: bool  # the training table was there (a campaign prepared before it: no expectation, nothing judged)
    expected: np.ndarray  # (N,) expected windows per expert under the mix (MIX_RULE)
    threshold: np.ndarray  # (N,) share of the windows above which an expert is warned about
    judged: bool  # trained, k < N and k/N x windows >= LOAD_MIN_FAIR (as routing_load)
    over: list[int]  # experts above their threshold, most over first
    explained: list[int]  # experts above the fair-share rule's threshold but within their mix's

    def observed(self) -> np.ndarray:
        return sum(self.routed.values(), np.zeros(self.n_experts, np.int64))

    def as_dict(self) -> dict:
        """Every source and expert (metrics.json keeps every row; the report shows the largest)."""
        obs = self.observed()
        return {
            "windows": self.windows,
            "top_k": self.top_k,
            "n_experts": self.n_experts,
            "trained": self.trained,
            "judged": self.judged,
            "concentrated": bool(self.over) and self.judged,
            "over": self.over,
            "explained_by_mix": self.explained,
            "rule": MIX_RULE,
            "sources": [
                {
                    "source": s,
                    "windows": n,
                    "routed": {str(e): int(c) for e, c in enumerate(self.routed[s]) if c},
                    "predicted_share": {str(e): round(float(p), 6) for e, p in enumerate(self.predicted[s]) if p}
                    if self.trained
                    else {},
                }
                for s, n in self.sources.items()
            ],
            "experts": [
                {
                    "expert": e,
                    "windows": int(obs[e]),
                    "share": float(obs[e]) / max(self.windows, 1),
                    "expected_share": float(self.expected[e]) / max(self.windows, 1) if self.trained else None,
                    "threshold": float(self.threshold[e]) if self.trained else None,
                }
                for e in range(self.n_experts)
            ],
        }

    def mix(self, shown: int = 3) -> str:
        """'perl 64%, man 20%, 4 more 16%'."""
        items = list(self.sources.items())
        text = ", ".join(f"{s} {100 * n / max(self.windows, 1):.0f}%" for s, n in items[:shown])
        rest = sum(n for _, n in items[shown:])
        return text + (f", {len(items) - shown} more {100 * rest / max(self.windows, 1):.0f}%" if rest else "")

    def _why(self, e: int) -> str:
        """The source that sends expert e the most expected windows: '64% of them perl, 85% of which the training
        shards predict go to it'."""
        s = max(self.sources, key=lambda s: (self.sources[s] * self.predicted[s][e], s))
        share = 100 * self.sources[s] / max(self.windows, 1)
        return f"{share:.0f}% of them {s}, {self.predicted[s][e]:.0%} of which the training shards predict go to it"

    def warning(self, name) -> str | None:
        """One sentence when an expert takes more windows than the test windows' mix of sources predicts."""
        if not (self.judged and self.over):
            return None
        e = self.over[0]
        obs = int(self.observed()[e])
        more = f"; {len(self.over) - 1} more expert(s) over their mark" if len(self.over) > 1 else ""
        return (
            f"routing concentrates beyond the test windows' mix of sources: {name(e)} gets {obs} of {self.windows} "
            f"windows (share {obs / self.windows:.2f}), where that mix ({self.mix()}) routed as the training shards "
            f"were predicts {self.expected[e] / self.windows:.2f} (warned above {self.threshold[e]:.2f}){more}: the "
            "router sends these windows to it more than their sources' training sequences went to it"
        )

    def note(self, name) -> str | None:
        """What the mix explains: an expert over the fair-share mark but within what the mix predicts."""
        if not (self.judged and self.explained):
            return None
        e = self.explained[0]
        obs = int(self.observed()[e])
        fair = self.top_k / self.n_experts
        return (
            f"{name(e)} gets {obs} of {self.windows} windows (share {obs / self.windows:.2f}), above the fair share's "
            f"mark {min(2 * fair, (1 + fair) / 2):.2f}, but the test windows' mix of sources predicts "
            f"{self.expected[e] / self.windows:.2f} ({self._why(e)}): the mix, not the router, concentrates the load"
        )


def routing_by_source(
    window_sources: list[str], top: np.ndarray, n_experts: int, train: dict[str, np.ndarray] | None
) -> SourceRouting:
    """The test windows' routing by source (window_sources (n,) each window's source, top (n, k) its experts) and
    each expert's load judged against the mix (MIX_RULE; train: source -> (N,) train sequences per expert, None for
    a campaign prepared before prepare recorded it)."""
    n, k = len(window_sources), min(top.shape[1] if top.ndim == 2 else 1, n_experts)
    labels = np.array(window_sources, dtype=object)
    counts = {s: int((labels == s).sum()) for s in dict.fromkeys(window_sources)}
    sources = dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
    routed = {
        s: np.bincount(top[labels == s].ravel(), minlength=n_experts).astype(np.int64)[:n_experts] for s in sources
    }
    trained = bool(train)
    predicted = {s: _predicted(train, s, k, n_experts) for s in sources} if trained else {}
    expected = sum((sources[s] * predicted[s] for s in predicted), np.zeros(n_experts))  # zeros without a table
    f_e = np.maximum(expected, LOAD_MIN_FAIR) / max(n, 1)
    threshold = np.minimum(2 * f_e, (1 + f_e) / 2)
    share = sum(routed.values(), np.zeros(n_experts)) / max(n, 1)
    fair = k / n_experts
    judged = trained and k < n_experts and fair * n >= LOAD_MIN_FAIR
    over = [int(e) for e in np.argsort(-(share / threshold), kind="stable") if share[e] > threshold[e]]
    fair_mark = min(2 * fair, (1 + fair) / 2)
    explained = [int(e) for e in np.argsort(-share, kind="stable") if share[e] > fair_mark and e not in over]
    return SourceRouting(
        n, k, n_experts, sources, routed, predicted, trained, expected, threshold, judged, over, explained
    )


def _predicted(train: dict[str, np.ndarray], source: str, k: int, n_experts: int) -> np.ndarray:
    """(N,) min(1, k P_train(e | source)); the shards' overall shares for a source with no train sequences."""
    row = train.get(source)
    if row is None or row.sum() == 0:
        row = sum(train.values(), np.zeros(n_experts))
    return np.minimum(1.0, k * row / max(row.sum(), 1))


# -- elapsed wall time -----------------------------------------------------------------------------------------------
def elapsed_seconds(records: list[dict]) -> dict[str, float]:
    """Per ledger category, the wall time during which at least one of its records was running: the length of the
    union of the intervals [t - wall_seconds, t] (t: when the record was written). The ledger's `wall_seconds` sum
    the records, so N actors working side by side count N times; this counts the clock once."""
    spans: dict[str, list[tuple[float, float]]] = {}
    for r in records:
        if r.get("t") is None or r["wall_seconds"] <= 0:
            continue
        spans.setdefault(r["category"], []).append((r["t"] - r["wall_seconds"], r["t"]))
    out = {}
    for cat, iv in spans.items():
        total, end = 0.0, -math.inf
        for a, b in sorted(iv):
            if b > end:
                total += b - max(a, end)
                end = b
        out[cat] = total
    return out


# -- campaigns side by side (soma compare) ---------------------------------------------------------------------------
@dataclass(frozen=True)
class CompareRow:
    campaign: str
    ensemble: Loss
    minus_baseline: Loss | None  # paired on the same windows; None for the baseline itself


def compare_rows(names: list[str], nats: list[np.ndarray], weights: np.ndarray, baseline: int) -> list[CompareRow]:
    """Each campaign's ensemble loss on the same windows (nats: one (n, S) per campaign), and its paired difference
    from the baseline's (< 0: better than the baseline)."""
    return [
        CompareRow(name, Loss.of(x, weights), None if i == baseline else Loss.of(x - nats[baseline], weights))
        for i, (name, x) in enumerate(zip(names, nats, strict=True))
    ]


def pick_baseline(given: list[str], urls: list[str], baseline: str | None) -> int:
    """The index of --baseline among the campaigns, matched as typed or as its URL (default: the first)."""
    if baseline is None:
        return 0
    for i, (g, u) in enumerate(zip(given, urls, strict=True)):
        if baseline in (g, u) or baseline.rstrip("/") in (g.rstrip("/"), u.rstrip("/")):
            return i
    raise SomaError(
        f"--baseline {baseline} is not one of the campaigns compared ({', '.join(given)}); give one of them, or "
        "leave it out for the first"
    )
