"""Routed-ensemble evaluation with the paper's protocol.

Windows of 1,025 bytes: the model reads bytes 0..1023 (state reset per window); prediction i is for
byte i+1, and predictions i = 256..1023 are scored (768 per window), so every scored byte comes
after the 256-byte prefix the router saw. The ensemble averages the probabilities of the top
min(4, N) experts under the router's rule, the one its shards were made with (uniform, or c-BTM
softmax(-d^2/T) weights). Reductions are FP64; confidence
intervals come from a paired document bootstrap.

A partial campaign (some experts ended without a checkpoint) is evaluated with the seed model in their
place: the router still picks the same top-k experts with the same weights, and a missing expert's
probabilities are the seed model's (see `unit_routes`).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import torch

from soma_cluster import fused
from soma_cluster.checkpoint import Checkpoint, checkpoint_steps, has_checkpoint, load_checkpoint
from soma_cluster.config import ModelConfig
from soma_cluster.errors import ChecksumError, SomaError
from soma_cluster.events import JobHistory, history
from soma_cluster.jobs import ENDED_WITH_CHECKPOINT, SEED_JOB, Job, expert_name
from soma_cluster.model import Layout, forward_blocks, target_logprobs
from soma_cluster.parts import DOCUMENTS
from soma_cluster.router import Router, router_text
from soma_cluster.shards import rows_to_numpy
from soma_cluster.storage import Store, sha256

UNIFORM_NATS = math.log(256)


@dataclass
class Windows:
    data: np.ndarray  # (n, window_bytes) uint8
    docs: np.ndarray  # (n,) document index owning the first scored byte


def _window_file(store: Store, rel: str, digest: str) -> pa.Table:
    try:
        raw = store.read_bytes(rel)
    except FileNotFoundError:
        raise SomaError(f"{store.url}/{rel} is missing; re-run soma prepare on a new campaign URL") from None
    if sha256(raw) != digest:
        raise ChecksumError(
            f"{store.url}/{rel} fails its checksum (corrupt); re-run soma prepare on a new campaign URL"
        )
    return ipc.open_file(pa.BufferReader(raw)).read_all()


def load_windows(store: Store, max_windows: int) -> Windows:
    """At most max_windows test windows, evenly spaced over all of them (deterministic). Only the files holding
    chosen windows are read: test/part-*.arrow, one per corpus part (test/windows.arrow in campaigns prepared
    before parts)."""
    meta = store.read_json("test/manifest.json")
    files = meta.get("files") or [{"name": "windows.arrow", "rows": meta["windows"], "sha256": meta["sha256"]}]
    total = sum(f["rows"] for f in files)
    keep = np.linspace(0, total - 1, max_windows).round().astype(np.int64) if total > max_windows else np.arange(total)
    bounds = np.cumsum([0] + [f["rows"] for f in files])
    data, docs = [], []
    for i, f in enumerate(files):
        mine = keep[(keep >= bounds[i]) & (keep < bounds[i + 1])] - bounds[i]
        if not len(mine):
            continue
        table = _window_file(store, f"test/{f['name']}", f["sha256"])
        if len(table) != f["rows"]:
            raise ChecksumError(
                f"{store.url}/test/{f['name']} holds {len(table)} windows, its manifest says {f['rows']}; "
                "re-run soma prepare"
            )
        data.append(rows_to_numpy(table.column("window").combine_chunks(), meta["window_bytes"])[mine])
        docs.append(table.column("doc").to_numpy()[mine])
    return Windows(np.ascontiguousarray(np.concatenate(data)), np.concatenate(docs))


def load_documents(store: Store) -> dict[int, tuple[str, str]]:
    """Document id -> (name, source) of the test windows' documents; empty for a campaign prepared before
    test/documents.json (its windows' source is then "unknown")."""
    entry = store.read_json("test/manifest.json").get("documents")
    if not entry:
        return {}
    raw = store.read_bytes(DOCUMENTS)
    if sha256(raw) != entry["sha256"]:
        raise ChecksumError(f"{store.url}/{DOCUMENTS} fails its checksum (corrupt); re-run soma prepare")
    return {int(d["doc"]): (d["name"], d["source"]) for d in json.loads(raw)["documents"]}


def windows_digest(store: Store) -> str:
    """The test windows' identity: test/manifest.json's sha256 over its window files (equal for a fork)."""
    try:
        return store.read_json("test/manifest.json")["sha256"]
    except FileNotFoundError:
        raise SomaError(f"{store.url} has no test windows (test/manifest.json); run soma prepare {store.url}") from None


def require_same_windows(base: tuple[str, str], others: list[tuple[str, str]]) -> None:
    """A paired comparison scores every campaign on one set of windows, which must be every campaign's held-out
    windows: (url, windows_digest) of the baseline and of each other; refused naming the first that differs."""
    for url, digest in others:
        if digest != base[1]:
            raise SomaError(
                f"{url} has other test windows than {base[0]} (test/manifest.json sha256 {digest[:12]} vs "
                f"{base[1][:12]}): a paired comparison needs the same held-out windows (one campaign's windows may be "
                f"the other's training data); compare campaigns forked from one parent (soma fork) or prepared from "
                f"the same corpus and config"
            )


# time steps per block of the evaluation forward: the working set stays in cache (16-32 beat 64 for both d=32 and d=181)
TIME_BLOCK = 32


def bmm_logprobs(h: torch.Tensor, heads: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """log p(y) in torch with one bmm for all experts: h (G, R, e), heads (G, 256, e), y (G, R) -> (G, R)."""
    logits = torch.bmm(h, heads.transpose(1, 2))  # (G, R, 256)
    return torch.log_softmax(logits, dim=-1).gather(-1, y.long()[..., None])[..., 0]


@torch.no_grad()
def packed_logprobs(
    model: ModelConfig,
    bodies: torch.Tensor | list[torch.Tensor],
    heads: torch.Tensor | list[torch.Tensor],
    windows: np.ndarray,
    context: int,
    device: torch.device,
    sizes: list[int] | None = None,
) -> np.ndarray:
    """G experts at once on the expert axis, each on its own windows: bodies (G, M), heads (G, 256, e) (or lists of
    G tensors), windows (G, B, W) -> log p(target) of the scored predictions (G, B, W-1-context) float64.
    sizes, when given, are the real windows of each expert (G entries, each <= B); the rest are padding, and their
    log p is 0. The whole-expert kernel does not compute them; the torch path computes and drops them."""
    if sizes is not None:
        fused.check_sizes(sizes, windows.shape[0], windows.shape[1])
    w = torch.from_numpy(np.ascontiguousarray(windows)).to(device)
    x, y = w[..., :-1], w[..., 1:]
    if device.type == "cpu" and fused.expert_usable(model, *bodies[:1], *heads[:1]):  # the whole expert in one kernel
        return fused.expert_logprobs(Layout(model), bodies, heads, x, y, context, sizes).numpy().astype(np.float64)
    bodies, heads = (torch.stack(list(t)).to(device) if isinstance(t, list) else t.to(device) for t in (bodies, heads))
    g, b = x.shape[0], x.shape[1]
    parts = []
    for t0, t1, h in forward_blocks(model, bodies, heads, x, block=TIME_BLOCK):  # h (G, Tb, B, e)
        if t1 <= context:  # nothing scored in this block: no decoder
            parts.append(h.new_zeros(g, t1 - t0, b))
            continue
        if fused.usable(h, heads):
            parts.append(target_logprobs(h, heads, y[..., t0:t1]))  # the fused kernel, no logits tensor
            continue
        tgt = y[..., t0:t1].transpose(1, 2).reshape(g, -1)  # (G, Tb*B), time-major as h
        parts.append(bmm_logprobs(h.reshape(g, -1, h.shape[-1]), heads, tgt).view(g, t1 - t0, b))
    lp = torch.cat(parts, dim=1)[:, context:].transpose(1, 2).double().cpu().numpy()  # (G, B, T - context)
    for i, n in enumerate(sizes if sizes is not None else ()):
        lp[i, n:] = 0.0
    return lp


def window_logprobs(
    model: ModelConfig,
    body: torch.Tensor,
    head: torch.Tensor,
    windows: np.ndarray,
    context: int,
    batch: int,
    device: torch.device,
) -> np.ndarray:
    """log p(target) for the scored predictions of each window: (n, window-1-context) float64."""
    out = [
        packed_logprobs(model, body[None], head[None], windows[a : a + batch][None], context, device)[0]
        for a in range(0, len(windows), batch)
    ]
    return np.concatenate(out) if out else np.zeros((0, windows.shape[1] - 1 - context))


def expert_probs(
    model: ModelConfig,
    units: list[tuple[torch.Tensor, torch.Tensor]],
    windows: np.ndarray,
    context: int,
    batch: int,
    device: torch.device,
) -> np.ndarray:
    """Every unit (body, head) on every window: p(target) (U, m, S) float64, in packed passes as the ensemble's
    (plan_passes), so U experts on m windows cost U x m window forwards in few wide passes."""
    out = np.zeros((len(units), len(windows), windows.shape[1] - 1 - context), dtype=np.float64)
    for passes in plan_passes(dict.fromkeys(range(len(units)), len(windows)), batch):
        padded = np.zeros((len(passes), passes[0][2], windows.shape[1]), dtype=np.uint8)
        for i, (_, a, n) in enumerate(passes):
            padded[i, :n] = windows[a : a + n]
        lp = packed_logprobs(
            model,
            [units[u][0] for u, _, _ in passes],
            [units[u][1] for u, _, _ in passes],
            padded,
            context,
            device,
            [n for _, _, n in passes],
        )
        for i, (u, a, n) in enumerate(passes):
            out[u, a : a + n] = np.exp(lp[i, :n])
    return out


def bootstrap_weights(groups: np.ndarray, resamples: int, seed: int) -> np.ndarray:
    """(R, n_windows) multiplicity of each window when documents are resampled with replacement."""
    uniq, inverse = np.unique(groups, return_inverse=True)
    rng = np.random.default_rng(seed)
    doc_counts = rng.multinomial(len(uniq), np.full(len(uniq), 1.0 / len(uniq)), size=resamples)  # (R, D)
    return doc_counts[:, inverse]


def ci(
    per_window_nats: np.ndarray, weights: np.ndarray, scored: np.ndarray | None = None
) -> tuple[float, float, float]:
    """Mean nats/byte and its 95% bootstrap interval. per_window_nats (n, S) -> (mean, lo, hi); `scored`
    (n, S) bool marks the predictions that count (default all). Works for a paired difference too."""
    mask = np.ones(per_window_nats.shape, dtype=bool) if scored is None else scored
    sums, counts = np.where(mask, per_window_nats, 0.0).sum(axis=1), mask.sum(axis=1).astype(np.float64)
    boots = (weights @ sums) / (weights @ counts)
    return float(sums.sum() / counts.sum()), float(np.percentile(boots, 2.5)), float(np.percentile(boots, 97.5))


@dataclass
class Strided:
    windows: Windows  # data (n, window) and the document of each window
    scored: np.ndarray  # (n, window - 1) bool: the predictions this window scores
    skipped: int  # documents shorter than one window
    starts: np.ndarray | None = None  # (n,) each window's offset in its document


def strided_windows(docs, window: int, stride: int, max_windows: int) -> Strided:
    """Long-document mode (the paper's WikiText-103 protocol): windows at offsets 0, stride, 2*stride, ...
    of each document (the last one aligned to its end); every byte after the first is scored exactly once,
    in the first window that predicts it, so a window after the first reads window - 1 - stride bytes of
    context before its first scored prediction. Documents shorter than a window are skipped."""
    data, owner, first, starts, skipped = [], [], [], [], 0
    for d, doc in enumerate(docs):
        if len(doc) < window:
            skipped += 1
            continue
        start, last = 0, 0  # targets (byte positions) <= last are scored already
        while len(data) < max_windows:
            data.append(np.frombuffer(doc[start : start + window], dtype=np.uint8))
            owner.append(d)
            starts.append(start)
            first.append(last - start)  # prediction i is for byte start + i + 1
            last = start + window - 1
            nxt = min(start + stride, len(doc) - window)
            if nxt <= start:
                break
            start = nxt
        if len(data) >= max_windows:
            break
    if not data:
        raise SomaError(
            f"no document of at least {window} bytes to evaluate in long-document mode; give longer documents"
        )
    first_a = np.array(first)
    scored = np.arange(window - 1)[None, :] >= first_a[:, None]
    return Strided(Windows(np.stack(data), np.array(owner)), scored, skipped, np.array(starts))


@dataclass
class EnsembleResult:
    nats: np.ndarray  # (n, S) ensemble -log p per scored byte
    per_expert_windows: dict[int, int]  # windows routed to each expert (a missing one's went to the seed)
    route_seconds: float
    model_seconds: float
    seed_windows: int = 0  # windows the seed model scored in place of missing experts (each once)
    top: np.ndarray | None = None  # (n, k) each window's experts (the report's routing by source)


def route_windows(router: Router, prefixes: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """Each window's experts and mixture weights from the bytes the router reads (its first prefix_bytes):
    top, weights (n, m)."""
    return router.route(router.embed([router_text(p) for p in prefixes]))


SEED_UNIT = -1  # the evaluation unit of the seed model standing in for missing experts


def unit_routes(top: np.ndarray, weights: np.ndarray, present: set[int]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Which windows each evaluation unit scores and each window's mixture weight for it: top, weights (n, m)
    from the router -> unit -> (rows, w). A present expert scores the windows routed to it with its routing
    weight. The seed (SEED_UNIT) scores once each window routed to any missing expert, with the summed weight
    of the missing experts in that window's top-m, so a window's mixture is
        p(x) = sum_{e in top, present} w_e p_e(x) + (sum_{e in top, missing} w_e) p_seed(x),
    exactly the routed ensemble with every missing expert's probabilities replaced by the seed model's (no
    re-routing to other experts, no renormalisation). Units with no window are left out."""
    routes: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for e in sorted(present):
        rows, slots = np.nonzero(top == e)  # an expert appears at most once in a window's top-m
        if len(rows):
            routes[e] = (rows, weights[rows, slots])
    missing = ~np.isin(top, list(present))
    rows = np.nonzero(missing.any(axis=1))[0]
    if len(rows):
        routes[SEED_UNIT] = (rows, np.where(missing, weights, 0.0)[rows].sum(axis=1))
    return routes


def mixture(h: torch.Tensor, heads: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """unit_routes' rule over whole next-byte distributions, as the routed experts' states give them: p = sum_k w_k
    softmax(h_k E_k^T). h (P*k, T, e): row r is window r // k's slot r % k; heads (P*k, 256, e); weights (P, k) ->
    (P, T, 256) float32. evaluate_ensemble mixes the same way, target bytes only, in float64."""
    probs = torch.softmax(torch.bmm(h, heads.transpose(1, 2)), dim=-1)  # (P*k, T, 256)
    p, k = weights.shape
    return (probs.view(p, k, *probs.shape[1:]) * weights.view(p, k, 1, 1)).sum(dim=1)


def plan_passes(counts: dict[int, int], batch: int) -> list[list[tuple[int, int, int]]]:
    """Cut every expert's routed windows into units (expert, first, size) of at most `batch` windows and
    pack them into passes of at most `batch` sequences. A pass pads every unit to its largest one, so units
    go in by decreasing size: each pass holds units of nearly equal size and padding stays small, whether
    N = 256 experts get a dozen windows each or N = 8 get hundreds. (Torch's batched path computes the padding;
    the whole-expert CPU kernel is told each unit's size and skips it.)"""
    units = sorted(
        ((e, a, min(batch, n - a)) for e, n in counts.items() for a in range(0, n, batch)),
        key=lambda u: (-u[2], u[0], u[1]),
    )
    passes: list[list[tuple[int, int, int]]] = []
    for unit in units:
        if passes and (len(passes[-1]) + 1) * passes[-1][0][2] <= batch:
            passes[-1].append(unit)
        else:
            passes.append([unit])
    return passes


NEVER_LAUNCHED = "never_launched"


@dataclass(frozen=True)
class Substitute:
    """An expert the seed model stands in for: it has no checkpoint, and its events say why."""

    expert: int
    end: str  # budget_exhausted, failed_permanently, never_launched, or the JobState of one not ended (as status)
    step: int  # the step its events last reported
    reason: str | None  # the end event's reason or note


def substitute_for(expert: int, h: JobHistory | None) -> Substitute | None:
    """The seed model stands in for an expert with no checkpoint file at all, unless its events say it ended
    finished or converged (those wrote one, so it was lost: `soma resume` retrains it; None here, the caller
    refuses). An expert that never started, ended budget_exhausted or failed_permanently before its first
    checkpoint, or has not ended yet, is substituted."""
    if h is not None and h.state in ENDED_WITH_CHECKPOINT:
        return None
    if h is not None and h.terminal:
        end = next(ev for ev in reversed(h.events) if ev["event"] == h.state)
        return Substitute(expert, h.state, h.step, end.get("reason") or end.get("note"))
    if h is None or not h.attempts:
        return Substitute(expert, NEVER_LAUNCHED, 0, "no attempt of it was ever started")
    return Substitute(
        expert, h.state, h.step, "not ended and no checkpoint yet (is a driver still training it? soma status)"
    )


def evaluate_ensemble(
    router: Router,
    model: ModelConfig,
    experts: dict[int, tuple[torch.Tensor, torch.Tensor]],
    win: Windows,
    context: int,
    batch: int,
    device: torch.device,
    seed: tuple[torch.Tensor, torch.Tensor] | None = None,
    routed: tuple[np.ndarray, np.ndarray] | None = None,
) -> EnsembleResult:
    """Route each window by its first prefix_bytes (or take `routed`: (top, weights) (n, m) from the router, for
    windows padded past their end, whose padding the router must not read), run every expert once over all the
    windows routed to it, mix. The experts of a pass run together on the expert axis (see plan_passes): N = 256 narrow
    experts cost a few wide passes instead of 256 thin ones. Experts missing from `experts` are served by
    `seed` (body, head) under `unit_routes`' rule, as one more unit in the same passes."""
    t0 = time.perf_counter()
    if routed is None:
        top, weights = route_windows(router, [bytes(w[: router.cfg.prefix_bytes]) for w in win.data])
    else:
        top, weights = routed
    t1 = time.perf_counter()
    routes = unit_routes(top, weights, set(experts))
    models = dict(experts)
    if SEED_UNIT in routes:
        if seed is None:
            absent = sorted({int(e) for e in np.unique(top)} - set(experts))
            raise SomaError(
                f"windows are routed to experts {absent} that have no model, and no seed model stands in for them"
            )
        models[SEED_UNIT] = seed
    prob = np.zeros((len(win.data), win.data.shape[1] - 1 - context), dtype=np.float64)
    for units in plan_passes({u: len(r[0]) for u, r in routes.items()}, batch):
        padded = np.zeros((len(units), units[0][2], win.data.shape[1]), dtype=np.uint8)
        for i, (u, a, n) in enumerate(units):
            padded[i, :n] = win.data[routes[u][0][a : a + n]]
        lp = packed_logprobs(
            model,
            [models[u][0] for u, _, _ in units],
            [models[u][1] for u, _, _ in units],
            padded,
            context,
            device,
            [n for _, _, n in units],
        )
        for i, (u, a, n) in enumerate(units):
            rows, w = routes[u][0][a : a + n], routes[u][1][a : a + n]
            np.add.at(prob, rows, w[:, None] * np.exp(lp[i, :n]))
    t2 = time.perf_counter()
    counts = {e: n for e in range(router.n_experts) if (n := int((top == e).sum())) or e in experts}
    seed_windows = len(routes[SEED_UNIT][0]) if SEED_UNIT in routes else 0
    return EnsembleResult(-np.log(np.maximum(prob, 1e-300)), counts, t1 - t0, t2 - t1, seed_windows, top)


@dataclass
class CampaignModels:
    """The checkpoints a campaign's ensemble is made of: each expert's latest (or a chosen step's), the seed model's,
    and the experts the seed stands in for because they have none (see substitute_for)."""

    checkpoints: dict[int, Checkpoint]
    seed: Checkpoint
    substituted: dict[int, Substitute]


def require_checkpoint(store: Store, directory: str, what: str, name: str | None = None) -> Checkpoint:
    if not has_checkpoint(store, directory):
        command = "soma seed" if directory == SEED_JOB.model_dir else "soma launch (or soma resume)"
        raise SomaError(f"{what} has no checkpoint under {store.url}/{directory}; run {command} {store.url} first")
    return load_checkpoint(store, directory, name)


def load_models(store: Store, n_experts: int, step: int | None = None) -> CampaignModels:
    """The latest checkpoints, or those of one step (every expert must have one there). Without `step`, an expert
    that never wrote a checkpoint is substituted by the seed model (substitute_for says when)."""
    name = None if step is None else f"step-{step:06d}"
    seed = require_checkpoint(store, SEED_JOB.model_dir, "the seed model")
    past = None  # the events log, read only if an expert has no checkpoint (minutes on S3 at N = 256)
    cks, subs = {}, {}
    for e in range(n_experts):
        d = Job(e).model_dir
        sub = None
        if step is None and not has_checkpoint(store, d) and not checkpoint_steps(store, d):
            past = history(store) if past is None else past
            sub = substitute_for(e, past.get(expert_name(e)))
        if sub is None and step is not None and step not in (kept := checkpoint_steps(store, d)):
            raise SomaError(
                f"{expert_name(e)} has no checkpoint of step {step} under {store.url}/{d}; it has "
                f"{', '.join(map(str, kept)) or 'none'}: pass one of those (or no step: the latest)"
            )
        if sub is None:
            cks[e] = require_checkpoint(store, d, expert_name(e), name)
        else:
            subs[e] = sub
    return CampaignModels(cks, seed, subs)
