"""Fused CPU kernels (csrc/kernels.c) for narrow experts.

- The whole expert (`expert_nll`, `expert_logprobs`): embedding, every LSTM/MLP block, the final norm and
  log p(target), for a tile of batch rows of one copy at a time, step by step. In torch each time step of
  a d = 32 layer is a tiny bmm plus a dozen pointwise passes over (copies, B, 4d) slabs: dispatch and
  memory traffic, not arithmetic, are most of the time. The kernel keeps the tile's activations in L1/L2
  and each copy's weights (160 KiB at d = 32) in L2, and fuses LayerNorm, the gate nonlinearities, the
  cell update and exact GELU into register-blocked matmuls.
- The LSTM recurrence alone (`lstm_block`) and the decoder's log-probabilities (`target_logprobs`), for
  wider experts that keep torch's big matmuls for the rest.

All run on torch's own OpenMP threads: the library links libgomp.so.1, which the process already has
loaded from torch, so the two share one runtime and one thread pool instead of competing for cores.

The library is compiled with the machine's C compiler at first use (a few seconds) into a cache keyed by
the source, the compiler and the CPU, since it is built for the CPU it runs on: AVX-512, AVX2+FMA, or
portable vector code elsewhere. Without a compiler, or with SOMA_FUSED=0, `available()` is False and the
model keeps its torch path; the kernels never run under autograd or on CUDA (the caller checks `usable`).
Results agree with the torch path to float32 rounding and do not depend on the number of threads.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

from soma_cluster.config import ModelConfig

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "kernels.c"
# Widest d for which the whole-expert kernel beats torch's composed path, and for which the recurrence
# kernel beats torch's step-by-step bmm (benchmarks/bench_kernels.py on the 2-core host).
MAX_EXPERT_D = 192
MAX_RECURRENT_D = 1024
EXPERT_ROWS = 32          # batch rows of one copy per task of the whole-expert kernel
RECURRENT_ROWS = 32       # likewise for the recurrence kernel
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-fPIC", "-shared"]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def cache_dir() -> Path:
    root = os.environ.get("SOMA_KERNEL_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "soma_cluster")
    return Path(root) / "kernels"


def _build(cc: str) -> Path:
    src = SOURCE.read_bytes()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout.splitlines()[:1]
    key = hashlib.sha256(b"\0".join([src, " ".join(FLAGS).encode(), str(version).encode(), _cpu_flags().encode(),
                                     platform.machine().encode()])).hexdigest()[:16]
    target = cache_dir() / f"soma-kernels-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)       # concurrent builders each write their own file
    os.close(fd)
    try:
        subprocess.run([cc, *FLAGS, str(SOURCE), "-o", tmp], check=True, capture_output=True, text=True, timeout=120)
        os.replace(tmp, target)                                      # atomic: a reader never sees half a library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@cache
def _library():
    if os.environ.get("SOMA_FUSED", "1") == "0":
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.warning("no C compiler found: the fused CPU kernels are off and the model runs in plain torch (slower)")
        return None
    try:
        lib = ctypes.CDLL(str(_build(cc)))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("building the fused CPU kernels failed (%s): the model runs in plain torch (slower)", str(detail).strip()[:300])
        return None
    lib.lstm_block.restype = lib.target_logprobs.restype = lib.expert_forward.restype = None
    lib.vector_lanes.restype = lib.expert_packed_floats.restype = ctypes.c_int64
    lib.vector_lanes.argtypes = []
    lib.pointwise.restype = None
    lib.pointwise.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
    lib.expert_packed_floats.argtypes = [ctypes.c_int64] * 3
    lib.lstm_block.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 5
    lib.target_logprobs.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 5
    lib.expert_forward.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 \
        + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 8
    return lib


def available() -> bool:
    return _library() is not None


def usable(*tensors: torch.Tensor) -> bool:
    """The kernel can stand in for the torch path: float32 on the CPU, no autograd through it."""
    if any(t.device.type != "cpu" or t.dtype != torch.float32 for t in tensors):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    return available()


def pointwise(kind: str, x: torch.Tensor) -> torch.Tensor:
    """The kernels' own exp, sigmoid or (exact) GELU of a float32 tensor, for tests."""
    out = x.to(torch.float32).contiguous().clone()
    _library().pointwise(("exp", "sigmoid", "gelu").index(kind), out.data_ptr(), out.numel())
    return out


def _round_up(n: int) -> int:
    lanes = _library().vector_lanes()
    return -(-n // lanes) * lanes


def _pad(t: torch.Tensor, *sizes: int) -> torch.Tensor:
    """t with its trailing len(sizes) dims zero-padded up to `sizes`."""
    out = t.new_zeros(*t.shape[:t.dim() - len(sizes)], *sizes)
    out[(..., *(slice(0, n) for n in t.shape[t.dim() - len(sizes):]))] = t
    return out


def _gate_columns(*ws: torch.Tensor, g_scale: float = 2.0) -> torch.Tensor:
    """LSTM weights (C, 4d, d) each (W_ih and W_hh, or just W_hh) -> [W^T; ...] (C, len(ws) * D, 4D): the columns
    of each `lanes` hidden units' four gates side by side (i, f, g, o), the g columns scaled by g_scale (see
    kernels.c: 2, unless the caller has scaled them already)."""
    c, four_d, d = ws[0].shape
    big, lanes = _round_up(d), _library().vector_lanes()
    scale = torch.tensor([1.0, 1.0, g_scale, 1.0], dtype=ws[0].dtype, device=ws[0].device).view(1, 1, 4, 1, 1)
    w = _pad(torch.stack(ws, 1).view(c, len(ws), 4, d, d) * scale, big, big)       # (C, src, gate, unit, k)
    w = w.view(c, len(ws), 4, big // lanes, lanes, big).permute(0, 1, 5, 3, 2, 4)  # (C, src, k, chunk, gate, lane)
    return w.reshape(c, len(ws) * big, 4 * big)


def pack_experts(cfg: ModelConfig, w: dict[str, torch.Tensor]) -> torch.Tensor:
    """The body tensors of C copies by name ((C, *shape) each, model.Layout.views) -> the kernel's packed weights
    (C, S): transposed, padded to the vector width, the LSTM's gate columns interleaved (layout: kernels.c)."""
    c = w["lnf"].shape[0]
    d, e = cfg.d, cfg.embed_dim
    big, big_e, hid = _round_up(d), _round_up(e), _round_up(4 * d)
    parts = [_pad(w["proj_in"].transpose(1, 2), big_e, big)] if d != e else []
    for k in range(cfg.depth):
        parts += [_pad(w[f"b{k}.ln1"], big), _gate_columns(w[f"b{k}.w_ih"], w[f"b{k}.w_hh"]), _pad(w[f"b{k}.ln2"], big),
                  _pad(w[f"b{k}.w1"].transpose(1, 2), big, hid), _pad(w[f"b{k}.w2"].transpose(1, 2), hid, big)]
    parts.append(_pad(w["lnf"], big))
    if d != e:
        parts.append(_pad(w["proj_out"].transpose(1, 2), big, big_e))
    packed = torch.cat([p.reshape(c, -1) for p in parts], dim=1)
    assert packed.shape[1] == _library().expert_packed_floats(d, e, cfg.depth), "kernels.c and pack_experts disagree"
    return packed


def expert_usable(cfg: ModelConfig, *tensors: torch.Tensor) -> bool:
    """The whole-expert kernel can stand in for the model's torch forward (see `usable`), and wins at this width."""
    return cfg.d <= MAX_EXPERT_D and usable(*tensors)


def _expert_forward(cfg: ModelConfig, w: dict[str, torch.Tensor], heads: torch.Tensor, x: torch.Tensor, y: torch.Tensor, first: int,
                    keep: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    c = w["lnf"].shape[0]
    heads = heads if heads.dim() == 3 else heads[None]
    x, y = (t[None] if t.dim() == 2 else t for t in (x, y))
    groups, b, t = x.shape
    if c % groups or y.shape != x.shape or heads.shape[0] not in (1, groups) or heads.shape[1:] != (256, cfg.embed_dim):
        raise ValueError(f"expert kernel: {c} copies, heads {tuple(heads.shape)}, x {tuple(x.shape)}, y {tuple(y.shape)} do not fit")
    packed = pack_experts(cfg, w)
    heads = heads.contiguous()
    heads_t = _pad(heads.transpose(1, 2), _round_up(cfg.embed_dim), 256).contiguous()      # (H, E, 256)
    x, y = x.to(torch.uint8).contiguous(), y.to(torch.uint8).contiguous()
    nll = torch.empty(c, b, dtype=torch.float64)
    logp = torch.empty(c, b, t - first) if keep else None
    _library().expert_forward(packed.data_ptr(), heads.data_ptr(), heads_t.data_ptr(), heads.shape[0], x.data_ptr(), y.data_ptr(),
                              t, groups, logp.data_ptr() if keep else None, nll.data_ptr(), c, b, t, first, cfg.d,
                              cfg.embed_dim, cfg.depth, EXPERT_ROWS)
    return nll, logp


def expert_nll(cfg: ModelConfig, w: dict[str, torch.Tensor], heads: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Sum over time of -log p(y) of every copy and row, float64 (C, B). w: the body tensors of C copies by name
    (model.Layout.views); heads (256, e) or (H, 256, e);
    x, y (B, T) bytes shared by all copies, or (G, B, T) with copies g*P .. g*P+P-1 on group g (and head g when H = G)."""
    return _expert_forward(cfg, w, heads, x, y, 0, keep=False)[0]


def expert_logprobs(cfg: ModelConfig, w: dict[str, torch.Tensor], heads: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
                    first: int = 0) -> torch.Tensor:
    """log p(y) of the predictions t >= first: (C, B, T - first) float32; arguments as `expert_nll`. The decoder
    is not run for t < first."""
    return _expert_forward(cfg, w, heads, x, y, first, keep=True)[1]


def pack_recurrent(w_hh_t: torch.Tensor) -> torch.Tensor:
    """W_hh^T (P, d, 4d), its g columns already scaled by 2 (model.LSTMState) -> the recurrence kernel's (P, D, 4D)."""
    return _gate_columns(w_hh_t.transpose(1, 2), g_scale=1.0)


def lstm_block(gates_in: torch.Tensor, w_hh: torch.Tensor, h: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """gates_in (P, T, B, 4d), w_hh packed by `pack_recurrent`, state h, c (P, B, d) updated in place -> out
    (P, T, B, d). The kernel spreads its tiles over torch's intra-op threads (the same OpenMP runtime); ctypes
    releases the GIL during the call."""
    p, t, b, four_d = gates_in.shape
    d = four_d // 4
    if w_hh.shape != (p, _round_up(d), 4 * _round_up(d)):
        raise ValueError(f"lstm_block: w_hh {tuple(w_hh.shape)} is not packed for d = {d} (see pack_recurrent)")
    gates_in, w_hh = gates_in.contiguous(), w_hh.contiguous()
    if not (h.is_contiguous() and c.is_contiguous()):
        raise ValueError("lstm_block updates h and c in place: they must be contiguous")
    out = gates_in.new_empty(p, t, b, d)
    _library().lstm_block(gates_in.data_ptr(), w_hh.data_ptr(), h.data_ptr(), c.data_ptr(), out.data_ptr(), p, t, b, d, RECURRENT_ROWS)
    return out


def target_logprobs(h: torch.Tensor, heads: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """log p(y) for C copies of R rows: h (C, R, e), heads (H, 256, e), y (Y, R) bytes, where copy i reads
    targets y[i // (C // Y)] and head heads[(i // (C // Y)) % H] -> (C, R) float32."""
    c, r, e = h.shape
    groups, heads_n = y.shape[0], heads.shape[0]
    if c % groups or y.shape[1] != r or heads.shape[1:] != (256, e) or heads_n not in (1, groups):
        raise ValueError(f"target_logprobs: h {tuple(h.shape)}, heads {tuple(heads.shape)}, y {tuple(y.shape)} do not fit")
    h = h.contiguous()
    heads_t = heads.transpose(1, 2).contiguous()                      # (H, e, 256): a row of E^T per input unit
    y = y.to(torch.uint8).contiguous()
    out = h.new_empty(c, r)
    _library().target_logprobs(h.data_ptr(), heads_t.data_ptr(), y.data_ptr(), out.data_ptr(), c, r, e, c // groups, heads_n)
    return out
