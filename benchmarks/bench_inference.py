"""Routed inference throughput: N = 256 narrow experts (d = 32, one shared head) against N = 8 wide
ones (d = 181, own heads), top-4, on the same test windows, in one run.

Both ensembles go through the real evaluator (soma_cluster.ensemble.evaluate_ensemble): each window
is routed by its first 256 bytes (a real router fit on the built-in text: TF-IDF -> SVD -> balanced
k-means), every expert runs once over all windows routed to it, and N = 256's small experts run many
at a time on the expert axis. The weights are random (init_body/init_head from a fixed seed): speed
does not depend on them (the models are untrained, so no loss is printed).

Each ensemble runs --repeats times, alternating, and its fastest run is kept (the host is shared).
Printed: byte-tokens/s including routing, the routing share of the time, and the ratio N=256 / N=8
(paper, one GPU: 2.36M vs 257k byte-tokens/s, 9.2x; routing 7.5% vs 0.87%).

  PYTHONPATH=. python benchmarks/bench_inference.py [--windows 256] [--batch 256] [--fit-chunks 8000]

Measurement records (dated runs, their commands and readings): docs/results/benchmarks/bench_inference.md.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

from soma_cluster.config import ModelConfig, RouterConfig
from soma_cluster.ensemble import Windows, evaluate_ensemble
from soma_cluster.model import Layout, init_body, init_head
from soma_cluster.router import fit_router, router_text
from soma_cluster.textsources import builtin_documents


def corpus_chunks(n_fit: int, n_windows: int) -> tuple[list[str], np.ndarray]:
    """Fit texts (1,024-byte chunks) and, from other documents, test windows of 1,025 bytes."""
    fit, wins = [], []
    for i, doc in enumerate(builtin_documents(int((n_fit + n_windows) * 1100 * 1.3))):
        pieces = [doc.data[a : a + 1025] for a in range(0, len(doc.data) - 1024, 1025)]
        if i % 5 == 0 and len(wins) < n_windows:
            wins += pieces[: n_windows - len(wins)]
        else:
            fit += [router_text(p[:1024]) for p in pieces]
    return fit[:n_fit], np.frombuffer(b"".join(wins), dtype=np.uint8).reshape(-1, 1025)


def ensemble(cfg: ModelConfig, n: int, seed: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    shared = init_head(cfg, gen)
    return {e: (init_body(cfg, gen), init_head(cfg, gen) if cfg.head == "own" else shared) for e in range(n)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--windows", type=int, default=256)
    p.add_argument("--batch", type=int, default=128, help="sequences per forward pass (eval.batch)")
    p.add_argument("--fit-chunks", type=int, default=8000)
    p.add_argument("--repeats", type=int, default=3, help="alternating runs of each; the fastest of each is reported")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    fit, data = corpus_chunks(args.fit_chunks, args.windows)
    win = Windows(np.ascontiguousarray(data), np.arange(len(data)))
    print(f"{len(fit)} fit chunks, {len(data)} test windows of 1,025 bytes, {args.threads} threads", flush=True)
    setups = []
    for n, d, head in ((256, 32, "shared_frozen"), (8, 181, "own")):
        cfg = ModelConfig(d=d, head=head)
        t = time.perf_counter()
        rcfg = RouterConfig(max_features=20000, min_df=3, svd_dim=128, kmeans_iters=5, top_k=4)  # the paper's top-4
        router, _ = fit_router(fit, n, rcfg, seed=0)
        params = n * Layout(cfg).size + (256 * 32 if head != "own" else n * 256 * 32)
        setups.append((n, d, cfg, router, ensemble(cfg, n, seed=1), params, time.perf_counter() - t))
    best: dict[int, tuple[float, float]] = {}
    paired = []  # N=8 seconds / N=256 seconds of each repeat
    for rep in range(args.repeats):  # alternate the two, keep each one's fastest (least disturbed) run
        seconds = {}
        for n, d, cfg, router, ex, _, _ in setups:
            res = evaluate_ensemble(router, cfg, ex, win, 256, args.batch, torch.device("cpu"))
            total = seconds[n] = res.route_seconds + res.model_seconds
            print(f"  rep {rep}: N={n} d={d}: {total:.1f} s ({res.route_seconds:.3f} s routing)", flush=True)
            if n not in best or total < best[n][0]:
                best[n] = (total, res.route_seconds)
        paired.append(seconds[8] / seconds[256])
    rows = [(n, d, params, *best[n], len(data) * 1024 / best[n][0], fit_s) for n, d, _, _, _, params, fit_s in setups]
    print("\n| ensemble | parameters | seconds | byte-tokens/s incl. routing | routing share |")
    print("|---|---|---|---|---|")
    for n, d, params, total, route, tps, _ in rows:
        print(f"| N={n}, d={d}, top-4 | {params:,} | {total:.1f} | {tps:,.0f} | {100 * route / total:.2f}% |")
    print(
        f"\nN=256 / N=8 throughput: {rows[0][5] / rows[1][5]:.2f}x from each one's fastest run (paper, one GPU: 9.2x); "
        f"per repeat {', '.join(f'{r:.2f}x' for r in paired)}, median {float(np.median(paired)):.2f}x"
    )


if __name__ == "__main__":
    main()
