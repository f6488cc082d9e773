"""SPSA update speed: our batched-copy forward vs the peer a user would write, side by side in one run.

Peer: the same model built from torch modules (fused nn.LSTM, Linear, LayerNorm), one forward per
perturbed copy (2 * n_pert forwards per update), parameters loaded with vector_to_parameters.
Ours: `spsa_estimate` with all copies of a probe chunk in one batched pass (soma_cluster.model.copy_losses:
the fused whole-expert kernel on the CPU, see soma_cluster/fused.py).

The host is shared and noisy, so the peer and ours run in paired repeats, alternating which goes first, each
timing one whole update (all 2 * n_pert forwards of both); the ratio is the median of the per-repeat ratios.
Useful FLOPs count only the matmuls (2 x MACs) the model needs; sgemm is the best of 5 runs at n = 4096,
measured before and after the updates (the best of all 10 is used, which makes the fraction conservative).
glibc malloc's thresholds are fixed for the run (steady_malloc): left dynamic, they made the peer's time depend on
the process's history (17 s or 25 s an update, below).

  PYTHONPATH=. python benchmarks/bench_spsa.py [--repeats 5] [--chunks 16] [--torch-path] [--shapes ...] [--no-extras]
                                               [--default-malloc]

Measurement records (dated runs, their commands and readings): docs/results/benchmarks/bench_spsa.md.
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import os
import resource
import statistics
import time

import torch
from torch import nn

from soma_cluster import fused
from soma_cluster.config import ModelConfig
from soma_cluster.model import Layout, copy_losses, init_body, init_head
from soma_cluster.shards import Shard
from soma_cluster.spsa import probes, spsa_estimate


def sgemm_flops(n: int = 4096, reps: int = 5) -> float:
    """The machine's sgemm FLOP/s: the best of `reps` timed n x n products (one untimed first)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def useful_flops(cfg: ModelConfig, tokens: int) -> float:
    d, e = cfg.d, cfg.embed_dim
    per_token = cfg.depth * 2 * 16 * d * d + 2 * 256 * e + (4 * d * e if d != e else 0)
    return per_token * tokens


class PeerLN(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.g = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return nn.functional.layer_norm(x, x.shape[-1:]) * self.g


class PeerBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln1, self.lstm, self.ln2 = PeerLN(d), nn.LSTM(d, d, bias=False, batch_first=True), PeerLN(d)
        self.w1, self.w2 = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        x = x + self.lstm(self.ln1(x))[0]
        return x + self.w2(nn.functional.gelu(self.w1(self.ln2(x))))


class PeerModel(nn.Module):
    """What a user writes: the same d=32 expert with fused torch modules."""

    def __init__(self, d, depth):
        super().__init__()
        self.blocks = nn.ModuleList(PeerBlock(d) for _ in range(depth))
        self.lnf = PeerLN(d)

    def loss(self, head, x, y):
        h = head[x.long()]
        for b in self.blocks:
            h = b(h)
        return nn.functional.cross_entropy((self.lnf(h) @ head.t()).reshape(-1, 256), y.reshape(-1).long())


class Peer:
    """One SPSA update the way a user would write it: 2 * n_pert forwards of the nn.Module model, one per copy."""

    def __init__(self, cfg, n_pert, x, y, head):
        self.model = PeerModel(cfg.d, cfg.depth)
        self.theta = nn.utils.parameters_to_vector(self.model.parameters()).detach()
        self.z = torch.randint(-1, 2, (n_pert, self.theta.numel())).float()
        self.x, self.y, self.head = x, y, head
        with torch.no_grad():
            self.model.loss(head, x, y)  # warm-up: one whole forward

    @torch.no_grad()
    def update(self) -> None:
        for zj in self.z:
            for sign in (1.0, -1.0):
                nn.utils.vector_to_parameters(self.theta + sign * 1e-3 * zj, self.model.parameters())
                self.model.loss(self.head, self.x, self.y)


class Ours:
    """One SPSA update through spsa_estimate: every chunk of probes' +/- copies in one batched pass."""

    def __init__(self, cfg, n_pert, x, y, head, chunk):
        self.theta = init_body(cfg, torch.Generator().manual_seed(0))
        self.z = probes(n_pert, Layout(cfg).gain_mask(), 0)
        self.loss = lambda bodies: copy_losses(cfg, bodies, head, x, y)  # noqa: E731
        self.chunk = chunk
        with torch.no_grad():  # warm-up: one batched pass (and the kernel build)
            spsa_estimate(self.theta, self.z[:chunk], 1e-3, self.loss, chunk)

    @torch.no_grad()
    def update(self) -> None:
        spsa_estimate(self.theta, self.z, 1e-3, self.loss, self.chunk)


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def paired(fns: dict, repeats: int) -> dict[str, list[float]]:
    """Seconds of each fn per repeat, run in turn, the order reversed every other repeat (drift cancels)."""
    out = {k: [] for k in fns}
    for rep in range(repeats):
        for k in list(fns) if rep % 2 == 0 else list(fns)[::-1]:
            out[k].append(timed(fns[k]))
    return out


def _vm_hwm_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) / 1024


def _peak_child(q, d, b, t, n_pert, chunk):
    cfg = ModelConfig(d=d, embed_dim=d)
    base = _vm_hwm_mib()
    x, y = torch.randint(0, 256, (b, t)), torch.randint(0, 256, (b, t))
    Ours(cfg, n_pert, x, y, init_head(cfg, torch.Generator().manual_seed(1)), chunk).update()
    q.put((base, _vm_hwm_mib()))


def peak_memory_mb(d, b, t, n_pert, chunk) -> tuple[float, float]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_peak_child, args=(q, d, b, t, n_pert, chunk))
    p.start()
    out = q.get(timeout=1200)
    p.join()
    return out


def packed_vs_separate(g_experts=16, b=8, t=256, n_pert=8):
    from soma_cluster.config import SPSAConfig
    from soma_cluster.trainer import Trainer, TrainState, update_experts

    cfg = ModelConfig()
    spsa = SPSAConfig(n_pert=n_pert, batch=b, seq_len=t, pert_chunk=n_pert)
    rows = torch.randint(0, 256, (64, t + 1), dtype=torch.uint8).numpy()

    def trainers():
        out = []
        for e in range(g_experts):
            gen = torch.Generator().manual_seed(e)
            st = TrainState.fresh(init_body(cfg, gen), init_head(cfg, gen), False, 1e-3, 1e-3)
            shard = Shard(e, t + 1, [rows], [rows[:4]])
            cpu = torch.device("cpu")
            out.append(Trainer(model=cfg, spsa=spsa, shard=shard, state=st, seed=0, expert=e, device=cpu, val_rows=4))
        return out

    sep, pk = trainers(), trainers()
    sep[0].update(), update_experts(pk[:2])  # warm-up
    t0 = time.perf_counter()
    for tr in sep:
        tr.update()
    t_sep = time.perf_counter() - t0
    t0 = time.perf_counter()
    update_experts(pk)
    return t_sep, time.perf_counter() - t0


def torch_path(fn):
    """fn run with the fused kernels off (SOMA_FUSED=0): the model's plain torch path."""

    def run():
        os.environ["SOMA_FUSED"] = "0"
        fused._library.cache_clear()
        try:
            fn()
        finally:
            del os.environ["SOMA_FUSED"]
            fused._library.cache_clear()

    return run


def steady_malloc(leave: bool = False) -> str:
    """Fix glibc malloc's thresholds for the whole run, unless `leave` (--default-malloc); says which.

    By default glibc serves large blocks with fresh mmaps and raises that threshold as blocks are freed, so whether
    the peer's activations (MBs per nn.LSTM call) come from reused heap or from freshly zeroed pages depends on the
    process's history: in one process of four the same peer update took 17 s, in the others 25 s, a third of it in
    the kernel zeroing pages. With the thresholds fixed (what MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ do)
    every process gets the fast peer."""
    if leave:
        return "glibc malloc as it comes (--default-malloc)"
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(-3, 32 << 20) == 1 and libc.mallopt(-1, 1 << 30) == 1  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        ok = False
    return (
        "glibc malloc: mmap threshold 32 MiB, trim threshold 1 GiB"
        if ok
        else "malloc thresholds left as they are (no glibc)"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5, help="paired repeats (peer, ours) per shape")
    ap.add_argument("--chunks", default="16", help="probes per batched pass (spsa.pert_chunk), comma-separated")
    ap.add_argument("--torch-path", action="store_true", help="also time ours with the fused kernels off")
    ap.add_argument("--shapes", default="paper-small,tiny", help=f"of {', '.join(s[0] for s in SHAPES)}")
    ap.add_argument("--no-extras", action="store_true", help="skip the packed-vs-separate and peak-memory runs")
    ap.add_argument(
        "--default-malloc", action="store_true", help="leave glibc's malloc thresholds dynamic (see steady_malloc)"
    )
    args = ap.parse_args()
    print(steady_malloc(args.default_malloc), flush=True)
    sgemm = [sgemm_flops()]
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"sgemm {sgemm[0] / 1e9:.1f} GFLOP/s (best of 5, n=4096); load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    results = []
    for name, d, b, t, n_pert in SHAPES:
        if name not in args.shapes.split(","):
            continue
        cfg = ModelConfig(d=d, embed_dim=d)
        x, y = torch.randint(0, 256, (b, t)), torch.randint(0, 256, (b, t))
        head = init_head(cfg, torch.Generator().manual_seed(1))
        fns = {"peer nn.LSTM loop": Peer(cfg, n_pert, x, y, head).update}
        for chunk in sorted({min(int(c), n_pert) for c in args.chunks.split(",")}):
            ours = Ours(cfg, n_pert, x, y, head, chunk)
            fns[f"ours chunk={chunk}"] = ours.update
            if args.torch_path:
                fns[f"ours chunk={chunk}, torch path"] = torch_path(ours.update)
        secs = paired(fns, args.repeats)
        for k, v in secs.items():
            print(f"  {name} {k}: " + ", ".join(f"{s:.2f}" for s in v) + " s", flush=True)
        results.append((name, useful_flops(cfg, 2 * n_pert * b * t), secs))
    sgemm.append(sgemm_flops())
    peak = max(sgemm)
    print(
        f"\nsgemm {', '.join(f'{s / 1e9:.1f}' for s in sgemm)} GFLOP/s (best of 5, n=4096, before/after): "
        f"using {peak / 1e9:.1f}; load average {os.getloadavg()[0]:.2f}\n"
    )
    print(
        "| shape | code | s/update, median (min-max) | ratio to peer, median of paired (per repeat) "
        "| useful/sgemm, median (best) |"
    )
    print("|---|---|---|---|---|")
    for name, flops, secs in results:
        peer = secs["peer nn.LSTM loop"]
        for k, v in secs.items():
            ratios = [p / s for p, s in zip(peer, v, strict=True)]
            print(
                f"| {name} | {k} | {statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f}) | "
                f"{statistics.median(ratios):.2f}x ({', '.join(f'{r:.2f}' for r in ratios)}) | "
                f"{flops / statistics.median(v) / peak:.3f} ({flops / min(v) / peak:.3f}) |"
            )
    if args.no_extras:
        return
    t_sep, t_pk = packed_vs_separate()
    print(
        f"\nG=16 tiny experts: 16 separate updates {t_sep:.2f} s, one packed update {t_pk:.2f} s, "
        f"ratio {t_sep / t_pk:.2f}x"
    )
    base, peak_mib = peak_memory_mb(32, 64, 1023, 64, 16)
    print(
        f"peak RSS of one paper-small update (chunk 16): {peak_mib:.0f} MiB "
        f"({peak_mib - base:.0f} MiB above the process after imports)"
    )


SHAPES = [
    ("paper-small", 32, 64, 1023, 64),
    ("paper-small-T256", 32, 64, 255, 64),
    ("tiny", 32, 8, 255, 8),
]  # name, d, B, T, n_pert


if __name__ == "__main__":
    main()
