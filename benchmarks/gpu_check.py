"""The first GPU: one prepared check of the SPSA engine on a CUDA machine, printing one table (run it through
benchmarks/gpu_check.sh, which bounds it to 8 minutes).

  1. equality: the device's update equals the CPU's on the same seed (the same data, probes, eps, Adam), for
     narrow experts packed on the expert axis (shared frozen head) and a wide expert training its own head;
     two updates each. Compared: the batch losses, Adam's first moment after the updates (the SPSA estimates
     themselves, plus weight decay) and the bodies' moves. Probes are a function of the device type (torch's
     CUDA generator is not the CPU's), so here both sides draw them on the CPU.
  2. timing: seconds per update at paper-small (one d=32 expert, B 64, T 1024, n_pert 64) and paper-n256 packed
     (G d=32 experts in one actor's update, chunk 32), byte-tokens/s, peak GPU memory.
  3. eval throughput: routed top-4 evaluation of N=256 (d=32, shared head) vs N=8 (d=181, own heads) on the same
     windows (random weights: speed does not depend on them), routing share, peak GPU memory.
  4. TF32: SPSA reads loss differences of order eps = 1e-3 between perturbed copies, which TF32's 10-bit
     mantissa may drown. On the same probes and batch: the estimate's cosine with the autograd gradient under
     FP32 and under TF32, and the two estimates' cosine with each other. trainer.pick_device keeps TF32 off
     (SOMA_TF32=1 turns it on); this check says whether turning it on costs anything.

--smoke runs every step on the CPU at toy sizes in well under a minute (tests/test_gpu_check.py, so the script
cannot rot): the "device" side is then the CPU's plain torch path (SOMA_FUSED=0) against the fused kernels,
and the TF32 flags have no effect.

  benchmarks/gpu_check.sh            # CUDA; exits 2 without a GPU
  benchmarks/gpu_check.sh --smoke    # CPU, toy sizes

Not yet run on a GPU: no device has been lent to this project's sessions so far (issue 17).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from contextlib import contextmanager, nullcontext

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_inference beside this file
from bench_inference import corpus_chunks, ensemble  # noqa: E402

import soma_cluster.trainer as trainer_mod  # noqa: E402
from soma_cluster import fused  # noqa: E402
from soma_cluster.config import ModelConfig, RouterConfig, SPSAConfig  # noqa: E402
from soma_cluster.ensemble import Windows, evaluate_ensemble  # noqa: E402
from soma_cluster.model import Layout, copy_losses, init_body, init_head  # noqa: E402
from soma_cluster.router import fit_router  # noqa: E402
from soma_cluster.shards import Shard  # noqa: E402
from soma_cluster.spsa import probes, spsa_estimate  # noqa: E402
from soma_cluster.trainer import Trainer, TrainState, update_experts  # noqa: E402

CPU = torch.device("cpu")
# (B, T, n_pert) of each step, and the experts packed per actor, eval windows and router fit chunks
SIZES = {
    "full": dict(
        equal=(8, 256, 8),
        small=(64, 1024, 64),
        n256=(64, 1024, 64),
        pack=8,
        timed=3,
        windows=1024,
        eval_batch=512,
        fit=8000,
        tf32=(16, 512, 64),
        wide_d=181,
        balance=0.05,
        ensembles=((256, 32), (8, 181)),
        eval_runs=2,
    ),
    "smoke": dict(
        equal=(2, 32, 4),
        small=(2, 32, 4),
        n256=(2, 32, 4),
        pack=4,
        timed=1,
        windows=4,
        eval_batch=8,
        fit=300,
        tf32=(2, 32, 8),
        wide_d=48,
        balance=10.0,  # 300 chunks cannot balance 256 clusters; the smoke run does not need them to
        ensembles=((256, 32), (8, 64)),
        eval_runs=1,
    ),
}
# |loss diff| in nats/byte; rel. L2 of Adam's m; cosine of the moves. A probe's d_j = (L+ - L-) / 2eps carries the
# losses' float32 rounding (~5.5 * 6e-8) over 2e-3, ~2e-4 in absolute terms, so two correct float32 paths that
# reduce in different orders differ by ~1e-3 relative in the estimate at these sizes (measured: fused kernel vs
# torch path, 1.1e-3), and Adam's first step, ~lr * sign(g), flips only coordinates whose g is near zero.
TOL = dict(loss=1e-4, moment=2e-2, move_cos=0.99)
START = time.perf_counter()
ROWS: list[tuple] = []  # check, setting, result, s, byte-tokens/s, peak MiB, verdict


def row(check, setting, result, seconds=None, rate=None, peak=None, verdict=""):
    ROWS.append(
        (
            check,
            setting,
            result,
            "-" if seconds is None else f"{seconds:.3f}",
            "-" if rate is None else f"{rate:,.0f}",
            "-" if peak is None else f"{peak:,.0f}",
            verdict,
        )
    )
    print(f"  [{time.perf_counter() - START:.0f} s] {check} | {setting} | {result} | {verdict}", flush=True)


@contextmanager
def fused_off():
    """The model's plain torch path on the CPU (the smoke mode's stand-in for the device)."""
    os.environ["SOMA_FUSED"] = "0"
    fused._library.cache_clear()
    try:
        yield
    finally:
        del os.environ["SOMA_FUSED"]
        fused._library.cache_clear()


@contextmanager
def cpu_probes():
    """Probes drawn on the CPU and moved to the expert's device, so both sides of the equality see the same ones."""
    real = trainer_mod.probes
    trainer_mod.probes = lambda n, mask, seed: real(n, mask.cpu(), seed).to(mask.device)
    try:
        yield
    finally:
        trainer_mod.probes = real


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def reset_peak(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def peak_mib(device):
    return torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None


def trainers(cfg: ModelConfig, spsa: SPSAConfig, g: int, device: torch.device) -> list[Trainer]:
    """g experts, each on its own shard of random bytes, from fixed starts (the same on every device)."""
    rows = np.random.default_rng(0).integers(0, 256, size=(64, spsa.seq_len + 1), dtype=np.uint8)
    out = []
    for e in range(g):
        gen = torch.Generator().manual_seed(e)
        st = TrainState.fresh(init_body(cfg, gen), init_head(cfg, gen), cfg.head == "own", spsa.eps, spsa.lr)
        st = TrainState.restore(st.tensors(), st.scalars(), device)
        shard = Shard(e, spsa.seq_len + 1, [rows], [rows[:4]])
        out.append(Trainer(model=cfg, spsa=spsa, shard=shard, state=st, seed=0, expert=e, device=device, val_rows=4))
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm().clamp_min(1e-30))


def cos(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu().flatten(), b.double().cpu().flatten()
    return float(a @ b / (a.norm() * b.norm()).clamp_min(1e-30))


def check_equal(device, smoke: bool, size: dict) -> bool:
    b, t, n = size["equal"]
    ok = True
    for label, cfg, g in (
        ("narrow d=32, shared head", ModelConfig(d=32, head="shared_frozen"), 4),
        (f"wide d={size['wide_d']}, own head", ModelConfig(d=size["wide_d"], head="own"), 1),
    ):
        spsa = SPSAConfig(n_pert=n, batch=b, seq_len=t, pert_chunk=n)
        ref, dev = trainers(cfg, spsa, g, CPU), trainers(cfg, spsa, g, device)
        with cpu_probes():
            ref_loss = [s.loss for _ in range(2) for s in update_experts(ref)]
            with fused_off() if smoke else nullcontext():
                dev_loss = [s.loss for _ in range(2) for s in update_experts(dev)]
        start = trainers(cfg, spsa, g, CPU)
        loss = max(abs(a - c) for a, c in zip(ref_loss, dev_loss, strict=True))
        moment = max(rel(d.state.body_opt.m, r.state.body_opt.m) for r, d in zip(ref, dev, strict=True))
        move = min(
            cos(d.state.body.cpu() - s.state.body, r.state.body - s.state.body)
            for r, d, s in zip(ref, dev, start, strict=True)
        )
        if cfg.head == "own":
            move = min(
                move,
                *(
                    cos(d.state.head.cpu() - s.state.head, r.state.head - s.state.head)
                    for r, d, s in zip(ref, dev, start, strict=True)
                ),
            )
        good = loss <= TOL["loss"] and moment <= TOL["moment"] and move >= TOL["move_cos"]
        ok &= good
        row(
            "update == CPU update",
            f"{label}, G={g}, B={b} T={t} n_pert={n}, 2 updates",
            f"max |loss diff| {loss:.1e}, Adam m rel. L2 {moment:.1e}, cos(moves) {move:.6f}",
            verdict="ok" if good else "FAIL",
        )
    return ok


def time_updates(device, label: str, cfg: ModelConfig, spsa: SPSAConfig, g: int, timed: int) -> None:
    pack = trainers(cfg, spsa, g, device)
    update_experts(pack)  # warm-up (kernel build, CUDA context, allocator)
    sync(device)
    reset_peak(device)
    secs, tokens = [], []
    for _ in range(timed):
        before = sum(tr.state.tokens for tr in pack)
        t0 = time.perf_counter()
        update_experts(pack)
        sync(device)
        secs.append(time.perf_counter() - t0)
        tokens.append(sum(tr.state.tokens for tr in pack) - before)
    s = statistics.median(secs)
    row(
        "update time",
        f"{label}: G={g}, B={spsa.batch} T={spsa.seq_len} n_pert={spsa.n_pert} chunk={spsa.pert_chunk}",
        f"median of {timed}: {', '.join(f'{x:.3f}' for x in secs)} s",
        s,
        tokens[0] / s,
        peak_mib(device),
    )


def check_eval(device, size: dict) -> None:
    fit, data = corpus_chunks(size["fit"], size["windows"])
    win = Windows(np.ascontiguousarray(data), np.arange(len(data)))
    rcfg = RouterConfig(
        max_features=20000,
        min_df=3,
        svd_dim=min(128, len(fit) // 4),
        kmeans_iters=5,
        balance_tolerance=size["balance"],
        top_k=4,  # the paper's top-4, at every N measured
    )
    rates = {}
    for n, d in size["ensembles"]:
        cfg = ModelConfig(d=d, head="shared_frozen" if d == 32 else "own")
        router, _ = fit_router(fit, n, rcfg, seed=0)
        experts = {e: (b.to(device), h.to(device)) for e, (b, h) in ensemble(cfg, n, seed=1).items()}
        best = None
        for _ in range(size["eval_runs"]):  # the first run warms up; keep the fastest
            reset_peak(device)
            res = evaluate_ensemble(router, cfg, experts, win, 256, size["eval_batch"], device)
            sync(device)
            total = res.route_seconds + res.model_seconds
            if best is None or total < best[0]:
                best = (total, res.route_seconds, peak_mib(device))
        rates[n] = len(data) * 1024 / best[0]
        row(
            "eval throughput",
            f"N={n}, d={d}, top-4, {len(data)} windows",
            f"routing {100 * best[1] / best[0]:.2f}% of the time",
            best[0],
            rates[n],
            best[2],
        )
    (n_narrow, _), (n_wide, _) = size["ensembles"]
    row(
        "eval throughput",
        f"N={n_narrow} / N={n_wide}",
        f"{rates[n_narrow] / rates[n_wide]:.2f}x (paper, N=256 / N=8 on one GPU: 9.2x)",
    )


def check_tf32(device, size: dict) -> None:
    b, t, n = size["tf32"]
    cfg = ModelConfig(d=32, head="shared_frozen")
    gen = torch.Generator().manual_seed(0)
    theta, head = init_body(cfg, gen).to(device), init_head(cfg, gen).to(device)
    xy = torch.randint(0, 256, (b, t + 1), generator=gen, dtype=torch.uint8).to(device)
    x, y = xy[:, :-1], xy[:, 1:]
    z = probes(n, Layout(cfg).gain_mask(CPU), 0).to(device)
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        with torch.enable_grad():
            th = theta[None].clone().requires_grad_(True)
            copy_losses(cfg, th, head, x, y).sum().backward()
        exact = th.grad[0]
        est = {}
        for name, on in (("FP32", False), ("TF32", True)):
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = on
            with torch.no_grad():
                est[name] = spsa_estimate(
                    theta, z, 1e-3, lambda bodies: copy_losses(cfg, bodies, head, x, y), min(n, 16)
                ).grad
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
    c32, ctf, cboth = cos(est["FP32"], exact), cos(est["TF32"], exact), cos(est["TF32"], est["FP32"])
    no_loss = cboth >= 0.99 and ctf >= c32 - 0.005
    setting = f"d=32, B={b} T={t} n_pert={n}, eps 1e-3, same probes" + (
        "" if device.type == "cuda" else " (CPU: flags have no effect)"
    )
    row(
        "TF32 vs FP32",
        setting,
        f"cos(SPSA, autograd) FP32 {c32:.4f}, TF32 {ctf:.4f}; cos(TF32 est., FP32 est.) {cboth:.4f}",
        verdict="n/a on the CPU (no TF32)"
        if device.type != "cuda"
        else "no loss shown: TF32 may be enabled (SOMA_TF32=1)"
        if no_loss
        else "loss shown: keep TF32 off",
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="CPU only, toy sizes (what make test runs)")
    p.add_argument("--skip", default="", help="comma-separated steps to leave out: equal,time,eval,tf32")
    args = p.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run with --smoke for the CPU check", file=sys.stderr)
        raise SystemExit(2)
    device = CPU if args.smoke else torch.device("cuda")
    if args.smoke:
        torch.set_num_threads(1)  # toy sizes: OpenMP workers would only spin against make test's other processes
    size = SIZES["smoke" if args.smoke else "full"]
    skip = set(filter(None, args.skip.split(",")))
    name = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(
        f"gpu_check on {name}; torch {torch.__version__}; {'smoke (toy sizes)' if args.smoke else 'full'}", flush=True
    )
    t0 = time.perf_counter()
    ok = True
    if "equal" not in skip:
        ok = check_equal(device, args.smoke, size)
    if "time" not in skip:
        d32 = ModelConfig(d=32, head="shared_frozen")
        b, t, n = size["small"]
        time_updates(
            device,
            "paper-small",
            d32,
            SPSAConfig(n_pert=n, batch=b, seq_len=t, pert_chunk=min(n, 16)),
            1,
            size["timed"],
        )
        b, t, n = size["n256"]
        time_updates(
            device,
            "paper-n256 packed",
            d32,
            SPSAConfig(n_pert=n, batch=b, seq_len=t, pert_chunk=min(n, 32)),
            size["pack"],
            size["timed"],
        )
    if "eval" not in skip:
        check_eval(device, size)
    if "tf32" not in skip:
        check_tf32(device, size)
    print(
        "\n| check | setting | result | seconds | byte-tokens/s | peak GPU MiB | verdict |\n"
        "|---|---|---|---|---|---|---|"
    )
    for r in ROWS:
        print("| " + " | ".join(r) + " |")
    print(f"\n{'PASS' if ok else 'FAIL'}: {time.perf_counter() - t0:.0f} s in all")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
