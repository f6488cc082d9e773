"""The fused CPU kernels (soma_cluster/fused.py) against the torch path they replace, side by side in one run.

Whole expert: log p(target) of C copies x B rows x T steps (the evaluator's shapes: narrow experts packed on the
copy axis, wide ones with many rows), three ways: torch only (SOMA_FUSED=0), torch's matmuls with the recurrence
and decoder kernels (the composed path wider experts take), and the whole-expert kernel. Recurrence: one time
block of a bias-free LSTM layer (gates_in given: the sequential h W_hh^T + cell part only), torch's
step-by-step bmm vs the kernel. Decoder: log p(target) of C x R rows against a 256-way head. GF/s counts the
matmul FLOPs only. Each timing is the fastest of --repeats alternating runs; the machine's sgemm (best of 5
at n = 4096) is measured in the same run.

  PYTHONPATH=. python benchmarks/bench_kernels.py [--repeats 3] [--tables expert,rows,recurrence,decoder]

Measurement records (dated runs, their commands and readings): docs/results/benchmarks/bench_kernels.md.
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


def expert_pass(cfg: ModelConfig, bodies, heads, windows, expert: bool, any_: bool = True):
    """One timed pass of the expert table: packed_logprobs with the kernels as `kernels(expert, any_)` sets them.
    Its arguments are bound here, not read from the caller's loop when the pass runs."""

    def go():
        with kernels(expert, any_):
            packed_logprobs(cfg, bodies, heads, windows, 0, CPU)

    return go


def expert_table(repeats: int, gen: torch.Generator) -> None:
    print(
        "| whole expert C x B x T, d | torch only ms | composed ms | kernel ms | torch GF/s | composed GF/s "
        "| kernel GF/s | kernel vs composed |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for c, b, t, d in EXPERT:
        cfg = ModelConfig(d=d, head="own")
        bodies = torch.stack([init_body(cfg, gen) for _ in range(c)])
        heads = torch.stack([init_head(cfg, gen) for _ in range(c)])
        windows = np.random.default_rng(0).integers(0, 256, size=(c, b, t + 1), dtype=np.uint8)
        data = (cfg, bodies, heads, windows)
        s = fastest(
            {
                "torch": expert_pass(*data, False, False),
                "composed": expert_pass(*data, False),
                "kernel": expert_pass(*data, True),
            },
            repeats,
        )
        flop = useful_flops(cfg, c * b * t) / 1e9
        print(
            f"| {c} x {b} x {t}, {d} | {s['torch'] * 1e3:.0f} | {s['composed'] * 1e3:.0f} | {s['kernel'] * 1e3:.0f} | "
            f"{flop / s['torch']:.1f} | {flop / s['composed']:.1f} | {flop / s['kernel']:.1f} | "
            f"{s['composed'] / s['kernel']:.2f}x |",
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
        fns = {"kernel": lambda bodies=bodies, x=x: fused.expert_nll(Layout(cfg), bodies, head, x, x)}
        s = fastest(fns, repeats)["kernel"]
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
                "torch": lambda gi=gi, w=w, h=h, c=c: step_by_step(gi, w, h.clone(), c.clone()),
                "kernel": lambda gi=gi, packed=packed, h=h, c=c: fused.lstm_block(gi, packed, h.clone(), c.clone()),
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
            {
                "torch": lambda h=h, heads=heads, y=y: bmm_logprobs(h, heads, y),
                "kernel": lambda h=h, heads=heads, y=y: fused.target_logprobs(h, heads, y),
            },
            repeats,
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
        f"{args.threads} threads, sgemm {sgemm / 1e9:.0f} GF/s (best of 5, n=4096), "
        f"load average {os.getloadavg()[0]:.2f}\n"
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
