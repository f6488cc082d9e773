"""The fused CPU kernels (soma_cluster/fused.py) against the torch path they replace, side by side in one run.

Whole expert: log p(target) of C copies x B rows x T steps (the evaluator's shapes: narrow experts packed on the
copy axis, wide ones with many rows), three ways: torch only (SOMA_FUSED=0), torch's matmuls with the recurrence
and decoder kernels (the composed path wider experts take), and the whole-expert kernel. Recurrence: one time
block of a bias-free LSTM layer (gates_in given: the sequential h W_hh^T + cell part only), torch's
step-by-step bmm vs the kernel. Decoder: log p(target) of C x R rows against a 256-way head. GF/s counts the
matmul FLOPs only. Each timing is the fastest of --repeats alternating runs; the machine's sgemm (best of 5
at n = 4096) is measured in the same run.

  PYTHONPATH=. python benchmarks/bench_kernels.py [--repeats 3] [--tables expert,rows,recurrence,decoder]

Not re-measured since the whole-expert kernel and the packed recurrence layout landed (issue 17: the 2-core
host was shared and saturated; bench_spsa.py and bench_inference.py carry that round's measurements). The
previous table (2026-12-03, sgemm 146 GF/s) measured the old L1-accumulating recurrence kernel: 2.0-2.35x torch
at d = 32, 1.21x at d = 64, 0.46-0.68x at d >= 128, whence the old d <= 64 cut. fused.MAX_EXPERT_D = 192 and
MAX_RECURRENT_D = 1024 came from this script's expert and recurrence tables on the register-blocked kernels
(per fused.py); those runs' tables were not kept.

Rows table (--tables rows --repeats 3), 2026-12-05 on the quiet 2-core host (sgemm 191-194 GF/s), main at 658f54b
("before") and with weight vectors kept in registers for blocks of 2+ rows (kernels.c, vload_weight; "after"), two runs
of each, alternating between the trees:

  | rows per copy | copies | before: ms | before: of sgemm | after: ms | after: of sgemm |
  |---|---|---|---|---|---|
  | 1 | 768 | 200.3, 189.5 | 0.42, 0.44 | 198.4, 191.2 | 0.42, 0.44 |
  | 2 | 384 | 137.6, 133.7 | 0.61, 0.62 | 124.9, 120.6 | 0.67, 0.70 |
  | 3 | 256 | 133.3, 130.5 | 0.63, 0.64 | 114.6, 111.1 | 0.73, 0.75 |
  | 4 | 192 | 131.8, 127.1 | 0.64, 0.66 | 110.6, 107.8 | 0.75, 0.78 |
  | 6 | 128 | 111.3, 108.5 | 0.76, 0.77 | 109.5, 106.6 | 0.76, 0.79 |
  | 8 | 96 | 121.5, 119.5 | 0.69, 0.70 | 107.3, 105.5 | 0.78, 0.79 |
  | 16 | 48 | 109.7, 107.9 | 0.77, 0.77 | 106.1, 104.7 | 0.78, 0.80 |
  | 32 | 24 | 106.2, 106.3 | 0.79, 0.78 | 105.3, 104.0 | 0.79, 0.81 |

  GCC had folded the weight loads into every FMA of blocks of 2-4 rows (8 rows go as two blocks of 4), which made
  them load-bound; 6 and 16+ rows use blocks of 6, where it kept them in registers. One row per copy is a
  matrix-vector product per step, bound by reading the expert's weights from L2 (the register load is not used
  there: each weight vector feeds one FMA either way).
"""

from __future__ import annotations

import argparse
import os
import time
from contextlib import contextmanager

import numpy as np
import torch
from bench_spsa import sgemm_flops, steady_malloc, useful_flops  # this folder is on sys.path when run as a script

from soma_cluster import fused
from soma_cluster.config import ModelConfig
from soma_cluster.ensemble import bmm_logprobs, packed_logprobs
from soma_cluster.model import Layout, init_body, init_head, step_by_step

EXPERT = [
    (32, 8, 256, 32),
    (4, 64, 256, 64),
    (2, 64, 256, 128),
    (2, 64, 128, 181),
    (2, 64, 64, 256),
    (2, 64, 32, 361),
]  # C, B, T, d
RECURRENCE = [
    (32, 32, 16, 32),
    (8, 32, 64, 64),
    (2, 32, 256, 128),
    (1, 32, 512, 181),
    (1, 32, 256, 361),
    (1, 32, 128, 512),
]  # P, T, B, d
DECODER = [(32, 512, 32), (1, 16384, 32)]  # C, R, e
CPU = torch.device("cpu")


def fastest(fns: dict, repeats: int) -> dict[str, float]:
    best = {k: float("inf") for k in fns}
    for _ in range(repeats):  # alternate, keep each one's least disturbed run
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            best[k] = min(best[k], time.perf_counter() - t)
    return best


@contextmanager
def kernels(expert: bool, any_: bool = True):
    """The kernels on or off: all (SOMA_FUSED=0), or only the whole-expert one (the composed path)."""
    saved = fused.MAX_EXPERT_D
    if not any_:
        os.environ["SOMA_FUSED"] = "0"
        fused._library.cache_clear()
    fused.MAX_EXPERT_D = saved if expert else 0
    try:
        yield
    finally:
        fused.MAX_EXPERT_D = saved
        os.environ.pop("SOMA_FUSED", None)
        fused._library.cache_clear()


def expert_table(repeats: int, gen: torch.Generator) -> None:
    print(
        "| whole expert C x B x T, d | torch only ms | composed ms | kernel ms | torch GF/s | composed GF/s | kernel GF/s "
        "| kernel vs composed |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for c, b, t, d in EXPERT:
        cfg = ModelConfig(d=d, head="own")
        bodies = torch.stack([init_body(cfg, gen) for _ in range(c)])
        heads = torch.stack([init_head(cfg, gen) for _ in range(c)])
        windows = np.random.default_rng(0).integers(0, 256, size=(c, b, t + 1), dtype=np.uint8)

        def run(expert, any_=True):
            def go():
                with kernels(expert, any_):
                    packed_logprobs(cfg, bodies, heads, windows, 0, CPU)

            return go

        s = fastest({"torch": run(False, False), "composed": run(False), "kernel": run(True)}, repeats)
        flop = useful_flops(cfg, c * b * t) / 1e9
        print(
            f"| {c} x {b} x {t}, {d} | {s['torch'] * 1e3:.0f} | {s['composed'] * 1e3:.0f} | {s['kernel'] * 1e3:.0f} | "
            f"{flop / s['torch']:.1f} | {flop / s['composed']:.1f} | {flop / s['kernel']:.1f} | {s['composed'] / s['kernel']:.2f}x |",
            flush=True,
        )


def rows_table(repeats: int, gen: torch.Generator, sgemm: float) -> None:
    """The whole-expert kernel at d = 32 (shared head) by the rows each copy has: the same 768 rows x 256 steps cut
    into copies of 1 to 32 rows. Routed evaluation at N = 256 gives most experts a few windows each."""
    print("\n| whole expert d = 32, rows per copy | copies | kernel ms | kernel GF/s | of sgemm |")
    print("|---|---|---|---|---|")
    cfg, t = ModelConfig(d=32, head="shared_frozen"), 256
    head = init_head(cfg, gen)
    for rows in (1, 2, 3, 4, 6, 8, 16, 32):
        c = 768 // rows
        bodies = torch.stack([init_body(cfg, gen) for _ in range(c)])
        x = torch.randint(0, 256, (c, rows, t), generator=gen, dtype=torch.uint8)
        s = fastest({"kernel": lambda: fused.expert_nll(Layout(cfg), bodies, head, x, x)}, repeats)["kernel"]
        gf = useful_flops(cfg, c * rows * t) / s / 1e9
        print(f"| {rows} | {c} | {s * 1e3:.1f} | {gf:.1f} | {gf * 1e9 / sgemm:.2f} |", flush=True)


def recurrence_table(repeats: int, gen: torch.Generator) -> None:
    print("\n| recurrence P x T x B, d | torch ms | kernel ms | torch GF/s | kernel GF/s | kernel speed-up |")
    print("|---|---|---|---|---|---|")
    for pp, t, b, d in RECURRENCE:
        gi, w = torch.randn(pp, t, b, 4 * d, generator=gen), torch.randn(pp, d, 4 * d, generator=gen) / d**0.5
        packed = fused.pack_recurrent(w)
        h, c = torch.zeros(pp, b, d), torch.zeros(pp, b, d)
        s = fastest(
            {
                "torch": lambda: step_by_step(gi, w, h.clone(), c.clone()),
                "kernel": lambda: fused.lstm_block(gi, packed, h.clone(), c.clone()),
            },
            repeats,
        )
        flop = 2 * pp * t * b * d * 4 * d / 1e9
        print(
            f"| {pp} x {t} x {b}, {d} | {s['torch'] * 1e3:.1f} | {s['kernel'] * 1e3:.1f} | {flop / s['torch']:.1f} | "
            f"{flop / s['kernel']:.1f} | {s['torch'] / s['kernel']:.2f}x |",
            flush=True,
        )


def decoder_table(repeats: int, gen: torch.Generator) -> None:
    print("\n| decoder C x R, e | torch ms | kernel ms | torch GF/s | kernel GF/s | kernel speed-up |")
    print("|---|---|---|---|---|---|")
    for cc, r, e in DECODER:
        h, heads = torch.randn(cc, r, e, generator=gen), torch.randn(cc, 256, e, generator=gen) * 0.3
        y = torch.randint(0, 256, (cc, r), generator=gen, dtype=torch.uint8)
        s = fastest(
            {"torch": lambda: bmm_logprobs(h, heads, y), "kernel": lambda: fused.target_logprobs(h, heads, y)}, repeats
        )
        flop = 2 * cc * r * e * 256 / 1e9
        print(
            f"| {cc} x {r}, {e} | {s['torch'] * 1e3:.1f} | {s['kernel'] * 1e3:.1f} | {flop / s['torch']:.1f} | "
            f"{flop / s['kernel']:.1f} | {s['torch'] / s['kernel']:.2f}x |",
            flush=True,
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--tables", default="expert,rows,recurrence,decoder")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(steady_malloc())
    if not fused.available():
        raise SystemExit("the fused kernels are not available here (no C compiler, or SOMA_FUSED=0)")
    gen = torch.Generator().manual_seed(0)
    sgemm = sgemm_flops()
    print(
        f"{args.threads} threads, sgemm {sgemm / 1e9:.0f} GF/s (best of 5, n=4096), load average {os.getloadavg()[0]:.2f}\n"
    )
    tables = {
        "expert": expert_table,
        "rows": lambda r, g: rows_table(r, g, sgemm),
        "recurrence": recurrence_table,
        "decoder": decoder_table,
    }
    with torch.no_grad():
        for name in args.tables.split(","):
            tables[name](args.repeats, gen)
    print(f"\nload average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
