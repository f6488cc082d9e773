"""The fused CPU kernels (soma_cluster/fused.py) against the torch path they replace, side by side in one run.

Recurrence: one time block of a bias-free LSTM layer (gates_in given, the sequential h W_hh^T + gates part
only), at the evaluator's shapes: narrow experts packed on the copy axis (P copies of B rows) and wide
ones (one copy of many rows). Decoder: log p(target) of C x R rows against a 256-way head, torch's
bmm + log_softmax + gather vs the kernel. GF/s counts the matmul FLOPs only. Each timing is the fastest
of --repeats alternating runs; the machine's sgemm GF/s is measured in the same run.

  PYTHONPATH=. python benchmarks/bench_kernels.py [--repeats 3]

Measured 2026-12-03 on the 2-core CPU host (sgemm 146 GF/s), --repeats 3:

  | recurrence P x T x B, d | torch ms | kernel ms | torch GF/s | kernel GF/s | kernel speed-up |
  |---|---|---|---|---|---|
  | 32 x 32 x 16, 32 | 7.3 | 3.6 | 18.4 | 37.2 | 2.02x |
  | 256 x 32 x 16, 32 | 70.7 | 30.1 | 15.2 | 35.6 | 2.35x |
  | 8 x 32 x 64, 64 | 13.7 | 11.3 | 39.3 | 47.4 | 1.21x |
  | 2 x 32 x 256, 128 | 27.2 | 39.9 | 79.1 | 53.8 | 0.68x |
  | 1 x 32 x 512, 181 | 45.0 | 97.9 | 95.5 | 43.9 | 0.46x |

  | decoder C x R, e | torch ms | kernel ms | torch GF/s | kernel GF/s | kernel speed-up |
  |---|---|---|---|---|---|
  | 32 x 512, 32 | 6.1 | 5.4 | 44.1 | 49.5 | 1.12x |
  | 1 x 16384, 32 | 6.1 | 4.4 | 44.0 | 60.9 | 1.38x |

  Hence fused.MAX_RECURRENT_D = 64. The kernel's inner product keeps its accumulators in L1 rather than
  registers (one load and one store per vector FMA), which caps it near 50 GF/s; torch's per-step bmm wins once
  d is wide enough for MKL to reuse W_hh across many rows. Before the kernels ran on torch's own OpenMP threads
  (an early version used a Python thread pool), torch's spinning OpenMP workers cost ~5 ms per call.
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from bench_spsa import sgemm_flops        # this folder is on sys.path when run as a script
from soma_cluster import fused
from soma_cluster.ensemble import bmm_logprobs
from soma_cluster.model import step_by_step

RECURRENCE = [(32, 32, 16, 32), (256, 32, 16, 32), (8, 32, 64, 64), (2, 32, 256, 128), (1, 32, 512, 181)]   # P, T, B, d
DECODER = [(32, 512, 32), (1, 16384, 32)]                                                                 # C, R, e


def fastest(fns: dict, repeats: int) -> dict[str, float]:
    best = {k: float("inf") for k in fns}
    for _ in range(repeats):                 # alternate, keep each one's least disturbed run
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            best[k] = min(best[k], time.perf_counter() - t)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if not fused.available():
        raise SystemExit("the fused kernels are not available here (no C compiler, or SOMA_FUSED=0)")
    gen = torch.Generator().manual_seed(0)
    print(f"{args.threads} threads, sgemm {sgemm_flops() / 1e9:.0f} GF/s\n")
    print("| recurrence P x T x B, d | torch ms | kernel ms | torch GF/s | kernel GF/s | kernel speed-up |")
    print("|---|---|---|---|---|---|")
    with torch.no_grad():
        for pp, t, b, d in RECURRENCE:
            gi, w = torch.randn(pp, t, b, 4 * d, generator=gen), torch.randn(pp, d, 4 * d, generator=gen) / d ** 0.5
            h, c = torch.zeros(pp, b, d), torch.zeros(pp, b, d)
            s = fastest({"torch": lambda: step_by_step(gi, w, h.clone(), c.clone()),
                         "kernel": lambda: fused.lstm_block(gi, w, h.clone(), c.clone())}, args.repeats)
            flop = 2 * pp * t * b * d * 4 * d / 1e9
            print(f"| {pp} x {t} x {b}, {d} | {s['torch'] * 1e3:.1f} | {s['kernel'] * 1e3:.1f} | {flop / s['torch']:.1f} | "
                  f"{flop / s['kernel']:.1f} | {s['torch'] / s['kernel']:.2f}x |")
        print("\n| decoder C x R, e | torch ms | kernel ms | torch GF/s | kernel GF/s | kernel speed-up |")
        print("|---|---|---|---|---|---|")
        for cc, r, e in DECODER:
            h, heads = torch.randn(cc, r, e, generator=gen), torch.randn(cc, 256, e, generator=gen) * 0.3
            y = torch.randint(0, 256, (cc, r), generator=gen, dtype=torch.uint8)
            s = fastest({"torch": lambda: bmm_logprobs(h, heads, y), "kernel": lambda: fused.target_logprobs(h, heads, y)}, args.repeats)
            flop = 2 * cc * r * e * 256 / 1e9
            print(f"| {cc} x {r}, {e} | {s['torch'] * 1e3:.1f} | {s['kernel'] * 1e3:.1f} | {flop / s['torch']:.1f} | "
                  f"{flop / s['kernel']:.1f} | {s['torch'] / s['kernel']:.2f}x |")


if __name__ == "__main__":
    main()
