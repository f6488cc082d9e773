"""Routed-ensemble evaluation with the paper's protocol.

Windows of 1,025 bytes: the model reads bytes 0..1023 (state reset per window); prediction i is for
byte i+1, and predictions i = 256..1023 are scored (768 per window), so every scored byte comes
after the 256-byte prefix the router saw. The ensemble averages the probabilities of the top
min(4, N) experts (uniform, or c-BTM softmax(-d^2/T) weights). Reductions are FP64; confidence
intervals come from a paired document bootstrap.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import torch

from soma_cluster.config import ModelConfig
from soma_cluster.errors import ChecksumError, SomaError
from soma_cluster.model import body_forward, target_logprobs
from soma_cluster.router import Router
from soma_cluster.shards import rows_to_numpy
from soma_cluster.storage import Store, sha256

UNIFORM_NATS = math.log(256)


@dataclass
class Windows:
    data: np.ndarray        # (n, window_bytes) uint8
    docs: np.ndarray        # (n,) document index owning the first scored byte


def load_windows(store: Store, max_windows: int) -> Windows:
    meta = store.read_json("test/manifest.json")
    try:
        raw = store.read_bytes("test/windows.arrow")
    except FileNotFoundError:
        raise SomaError(f"{store.url}/test/windows.arrow is missing; re-run soma prepare on a new campaign URL") from None
    if sha256(raw) != meta["sha256"]:
        raise ChecksumError(f"{store.url}/test/windows.arrow fails its checksum (corrupt); re-run soma prepare on a new campaign URL")
    table = ipc.open_file(pa.BufferReader(raw)).read_all()
    data = rows_to_numpy(table.column("window").combine_chunks(), meta["window_bytes"])
    docs = table.column("doc").to_numpy()
    if len(data) > max_windows:                       # evenly spaced, deterministic subset
        keep = np.linspace(0, len(data) - 1, max_windows).round().astype(np.int64)
        data, docs = data[keep], docs[keep]
    return Windows(np.ascontiguousarray(data), docs)


@torch.no_grad()
def window_logprobs(model: ModelConfig, body: torch.Tensor, head: torch.Tensor, windows: np.ndarray, context: int,
                    batch: int, device: torch.device) -> np.ndarray:
    """log p(target) for the scored predictions of each window: (n, window-1-context) float64."""
    out = []
    for a in range(0, len(windows), batch):
        w = torch.from_numpy(windows[a:a + batch]).to(device)
        x, y = w[:, :-1], w[:, 1:]
        lp = target_logprobs(body_forward(model, body[None].to(device), head.to(device), x), head.to(device), y)  # (1, T, B)
        out.append(lp[0, context:].t().double().cpu().numpy())
    return np.concatenate(out) if out else np.zeros((0, windows.shape[1] - 1 - context))


def bootstrap_weights(groups: np.ndarray, resamples: int, seed: int) -> np.ndarray:
    """(R, n_windows) multiplicity of each window when documents are resampled with replacement."""
    uniq, inverse = np.unique(groups, return_inverse=True)
    rng = np.random.default_rng(seed)
    doc_counts = rng.multinomial(len(uniq), np.full(len(uniq), 1.0 / len(uniq)), size=resamples)   # (R, D)
    return doc_counts[:, inverse]


def ci(per_window_nats: np.ndarray, weights: np.ndarray) -> tuple[float, float, float]:
    """Mean nats/byte and its 95% bootstrap interval. per_window_nats (n, S) -> (mean, lo, hi)."""
    sums, counts = per_window_nats.sum(axis=1), np.full(len(per_window_nats), per_window_nats.shape[1], dtype=np.float64)
    boots = (weights @ sums) / (weights @ counts)
    return float(sums.sum() / counts.sum()), float(np.percentile(boots, 2.5)), float(np.percentile(boots, 97.5))


@dataclass
class EnsembleResult:
    nats: np.ndarray          # (n, S) ensemble -log p per scored byte
    per_expert_windows: dict[int, int]
    route_seconds: float
    model_seconds: float


def evaluate_ensemble(router: Router, model: ModelConfig, experts: dict[int, tuple[torch.Tensor, torch.Tensor]], win: Windows,
                      context: int, batch: int, device: torch.device) -> EnsembleResult:
    """Route each window by its first prefix_bytes, run each expert on the windows routed to it, mix."""
    t0 = time.perf_counter()
    texts = [bytes(w[: router.cfg.prefix_bytes]).decode("utf-8", errors="ignore") for w in win.data]
    top, weights = router.route(router.embed(texts))
    t1 = time.perf_counter()
    prob = np.zeros((len(win.data), win.data.shape[1] - 1 - context), dtype=np.float64)
    counts = {}
    for e, (body, head) in experts.items():
        rows, slots = np.nonzero(top == e)
        counts[e] = len(rows)
        if len(rows):
            lp = window_logprobs(model, body, head, win.data[rows], context, batch, device)
            np.add.at(prob, rows, weights[rows, slots][:, None] * np.exp(lp))
    t2 = time.perf_counter()
    return EnsembleResult(-np.log(np.maximum(prob, 1e-300)), counts, t1 - t0, t2 - t1)
