"""SPSA update speed: our batched-copy forward vs the peer a user would write, side by side in one run.

Peer: the same model built from torch modules (fused nn.LSTM, Linear, LayerNorm), one forward per
perturbed copy (2 * n_pert forwards per update), parameters loaded with vector_to_parameters.
Ours: `spsa_estimate` with all copies of a probe chunk in one batched pass.
Useful FLOPs count only the matmuls (2 x MACs) the model needs; the machine's sgemm FLOP/s is
measured in the same run. Run: .venv/bin/python benchmarks/bench_spsa.py [--peer-fraction 0.125]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import time

import torch
from torch import nn

from soma_cluster.config import ModelConfig
from soma_cluster.model import Layout, copy_losses, init_body, init_head
from soma_cluster.shards import Shard
from soma_cluster.spsa import probes, spsa_estimate


def sgemm_flops(n: int = 2048, reps: int = 5) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    t = time.perf_counter()
    for _ in range(reps):
        torch.mm(a, b)
    return reps * 2 * n ** 3 / (time.perf_counter() - t)


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


def peer_update_seconds(cfg, n_pert, x, y, head, fraction):
    model = PeerModel(cfg.d, cfg.depth)
    theta = nn.utils.parameters_to_vector(model.parameters()).detach()
    z = torch.randint(-1, 2, (2 * n_pert, theta.numel())).float()
    count = max(1, round(2 * n_pert * fraction))
    with torch.no_grad():
        nn.utils.vector_to_parameters(theta, model.parameters())
        model.loss(head, x[:, :16], y[:, :16])
        t = time.perf_counter()
        for j in range(count):
            nn.utils.vector_to_parameters(theta + 1e-3 * z[j], model.parameters())
            model.loss(head, x, y)
        return (time.perf_counter() - t) * (2 * n_pert / count)


def ours_update_seconds(cfg, n_pert, x, y, head, chunk, compiled, block=8):
    g = torch.Generator().manual_seed(0)
    theta = init_body(cfg, g)
    mask = Layout(cfg).gain_mask()
    f = lambda bodies: copy_losses(cfg, bodies, head, x, y, compiled, block)  # noqa: E731
    with torch.no_grad():
        z = probes(n_pert, mask, 0)
        spsa_estimate(theta, z[:chunk], 1e-3, lambda b: copy_losses(cfg, b, head, x[:, :16], y[:, :16], compiled), chunk)
        t = time.perf_counter()
        spsa_estimate(theta, z, 1e-3, f, chunk)
        return time.perf_counter() - t


def _vm_hwm_mib() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) / 1024


def _peak_child(q, d, b, t, n_pert, chunk):
    cfg = ModelConfig(d=d, embed_dim=d)
    base = _vm_hwm_mib()
    x, y = torch.randint(0, 256, (b, t)), torch.randint(0, 256, (b, t))
    ours_update_seconds(cfg, n_pert, x, y, init_head(cfg, torch.Generator().manual_seed(1)), chunk, False)
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
            out.append(Trainer(cfg, spsa, Shard(e, t + 1, [rows], [rows[:4]]), st, 0, e, torch.device("cpu"), 4))
        return out
    sep, pk = trainers(), trainers()
    sep[0].update(), update_experts(pk[:2])                 # warm-up
    t0 = time.perf_counter()
    for tr in sep:
        tr.update()
    t_sep = time.perf_counter() - t0
    t0 = time.perf_counter()
    update_experts(pk)
    return t_sep, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--peer-fraction", type=float, default=0.125, help="share of the peer's 2*n_pert forwards timed (scaled up)")
    ap.add_argument("--chunks", default="8,16")
    ap.add_argument("--compile", action="store_true", help="also time the torch.compile'd step")
    ap.add_argument("--whole-sequence", action="store_true", help="also time without time blocking (block = T)")
    args = ap.parse_args()
    peak = sgemm_flops()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; sgemm {peak / 1e9:.1f} GFLOP/s")
    rows = []
    for name, d, b, t, n_pert in (("paper-small", 32, 64, 1023, 64), ("tiny", 32, 8, 255, 8)):
        cfg = ModelConfig(d=d, embed_dim=d)
        x, y = torch.randint(0, 256, (b, t)), torch.randint(0, 256, (b, t))
        head = init_head(cfg, torch.Generator().manual_seed(1))
        flops = useful_flops(cfg, 2 * n_pert * b * t)
        peer = peer_update_seconds(cfg, n_pert, x, y, head, args.peer_fraction)
        rows.append((name, "peer nn.LSTM loop", peer, 1.0, flops / peer / peak))
        chunks = sorted({min(int(c), n_pert) for c in args.chunks.split(",")})
        for chunk in chunks:
            variants = [(False, 8)] + ([(True, 8)] if args.compile else []) + ([(False, 0)] if args.whole_sequence else [])
            for compiled, block in variants:
                s = ours_update_seconds(cfg, n_pert, x, y, head, chunk, compiled, block)
                label = f"ours chunk={chunk} block={block or 'T'}{' compiled' if compiled else ''}"
                rows.append((name, label, s, peer / s, flops / s / peak))
        n_var = 1 + bool(args.compile) + bool(args.whole_sequence)
        for r in rows[-(1 + len(chunks) * n_var):]:
            print(f"{r[0]:12s} {r[1]:36s} {r[2]:8.2f} s/update  speed-up {r[3]:5.2f}x  useful/sgemm {r[4]:.3f}", flush=True)
    t_sep, t_pk = packed_vs_separate()
    print(f"G=16 tiny experts: 16 separate updates {t_sep:.2f} s, one packed update {t_pk:.2f} s, ratio {t_sep / t_pk:.2f}x")
    base, peak_mib = peak_memory_mb(32, 64, 1023, 64, 8)
    print(f"peak RSS of one paper-small update (chunk 8): {peak_mib:.0f} MiB ({peak_mib - base:.0f} MiB above the process after imports)")


if __name__ == "__main__":
    main()
