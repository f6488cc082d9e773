"""Training throughput at matched size, the paper's other claim: byte-tokens per second of SPSA training on this
machine for the same total parameters (within 1%) split four ways, with the same n_pert, B and T, in one run.

    N=256, d=32   narrow experts with one shared frozen head, G packed per actor (trainer.update_experts)
    N=8,   d=180  wide experts with their own heads (d=181 would be 1.4% over N=256's total, d=180 is 0.3%)
    N=2,   d=361  wide experts with their own heads
    N=1,   d=512  one monolithic model (d=509 would be 1.2% under, d=512 is 0.1%)

One machine trains one actor's update at a time, so its throughput is one actor's: the byte-tokens of an update
(trainer's own count: forwards x B x T per expert, the decoder's forward at theta included where heads train,
times the G experts of a pack) over its wall seconds. The configurations run in paired repeats, the order
rotated every repeat; each ratio is the median of its per-repeat ratios. Every update goes through the real
Trainer (data, probes, Adam) on random bytes: speed does not depend on the data.

  PYTHONPATH=. python benchmarks/bench_training.py [--repeats 5] [--batch 16] [--seq-len 128] [--n-pert 8] [--pack 16]

Measurement records (dated runs, their commands and readings): docs/results/benchmarks/bench_training.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch
from bench_spsa import steady_malloc  # this folder is on sys.path when run as a script

from soma_cluster.config import ModelConfig, SPSAConfig
from soma_cluster.model import campaign_param_count, init_body, init_head
from soma_cluster.shards import Shard
from soma_cluster.trainer import Trainer, TrainState, update_experts

SETUPS = [  # label, N experts, d, head, experts packed per actor
    ("N=256, d=32, shared head", 256, 32, "shared_frozen", None),
    ("N=8, d=180", 8, 180, "own", 1),
    ("N=2, d=361", 2, 361, "own", 1),
    ("N=1, d=512 (monolith)", 1, 512, "own", 1),
]


def pack(label: str, n: int, d: int, head: str, g: int, spsa: SPSAConfig) -> list[Trainer]:
    """g trainers of one actor, each on its own shard of random bytes."""
    cfg = ModelConfig(d=d, head=head)
    rows = np.random.default_rng(0).integers(0, 256, size=(256, spsa.seq_len + 1), dtype=np.uint8)
    out = []
    for e in range(g):
        gen = torch.Generator().manual_seed(e)
        st = TrainState.fresh(init_body(cfg, gen), init_head(cfg, gen), head == "own", spsa.eps, spsa.lr)
        shard = Shard(e, spsa.seq_len + 1, [rows], [rows[:4]])
        out.append(
            Trainer(
                model=cfg, spsa=spsa, shard=shard, state=st, seed=0, expert=e, device=torch.device("cpu"), val_rows=4
            )
        )
    return out


def one_update(trainers: list[Trainer]) -> float:
    """Byte-tokens per second of one update of the pack."""
    before = sum(t.state.tokens for t in trainers)
    t0 = time.perf_counter()
    update_experts(trainers)
    return (sum(t.state.tokens for t in trainers) - before) / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--n-pert", type=int, default=8)
    p.add_argument("--pack", type=int, default=16, help="narrow experts per actor (resources.experts_per_actor)")
    p.add_argument(
        "--default-malloc",
        action="store_true",
        help="leave glibc's malloc thresholds dynamic (bench_spsa.steady_malloc)",
    )
    args = p.parse_args()
    print(steady_malloc(args.default_malloc), flush=True)
    spsa = SPSAConfig(n_pert=args.n_pert, batch=args.batch, seq_len=args.seq_len, pert_chunk=min(args.n_pert, 16))
    total = campaign_param_count(ModelConfig(d=32, head="shared_frozen"), 256)
    packs = {}
    for label, n, d, head, g in SETUPS:
        params = campaign_param_count(ModelConfig(d=d, head=head), n)
        assert abs(params / total - 1) <= 0.01, f"{label}: {params:,} parameters, not within 1% of {total:,}"
        packs[label] = (params, pack(label, n, d, head, g or args.pack, spsa))
        one_update(packs[label][1])  # warm-up (and the kernel build)
    print(
        f"{torch.get_num_threads()} threads; n_pert {spsa.n_pert}, B {spsa.batch}, T {spsa.seq_len}, "
        f"{args.pack} narrow experts per actor; load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    rates: dict[str, list[float]] = {k: [] for k in packs}
    order = list(packs)
    for rep in range(args.repeats):
        for label in order[rep % len(order) :] + order[: rep % len(order)]:
            rates[label].append(one_update(packs[label][1]))
        print(f"  rep {rep}: " + ", ".join(f"{k}: {v[-1]:,.0f}/s" for k, v in rates.items()), flush=True)
    mono, n8 = rates[SETUPS[-1][0]], rates[SETUPS[1][0]]
    print(f"\nload average {os.getloadavg()[0]:.2f}\n")
    print("| configuration | parameters | byte-tokens/s, median (min-max) | vs monolith, median of paired | vs N=8 |")
    print("|---|---|---|---|---|")
    for label, (params, _) in packs.items():
        r = rates[label]
        vs_mono = statistics.median(a / b for a, b in zip(r, mono, strict=True))
        vs_n8 = statistics.median(a / b for a, b in zip(r, n8, strict=True))
        print(
            f"| {label} | {params:,} | {statistics.median(r):,.0f} ({min(r):,.0f}-{max(r):,.0f}) | "
            f"{vs_mono:.2f}x | {vs_n8:.2f}x |"
        )


if __name__ == "__main__":
    main()
