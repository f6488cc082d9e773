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
from collections.abc import Sequence
from functools import cache
from pathlib import Path

import torch

from soma_cluster.config import ModelConfig
from soma_cluster.envvars import value as env_value

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "kernels.c"
# Widest d for which the whole-expert kernel beats torch's composed path, and for which the recurrence
# kernel beats torch's step-by-step bmm (benchmarks/bench_kernels.py on the 2-core host).
MAX_EXPERT_D = 192
MAX_RECURRENT_D = 1024
EXPERT_ROWS = 32  # batch rows of one copy per task of the whole-expert kernel
RECURRENT_ROWS = 32  # likewise for the recurrence kernel
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
    root = os.environ.get("SOMA_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "soma_cluster"
    )
    return Path(root) / "kernels"


def _build(cc: str) -> Path:
    src = SOURCE.read_bytes()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout.splitlines()[:1]
    key = hashlib.sha256(
        b"\0".join(
            [src, " ".join(FLAGS).encode(), str(version).encode(), _cpu_flags().encode(), platform.machine().encode()]
        )
    ).hexdigest()[:16]
    target = cache_dir() / f"soma-kernels-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)  # concurrent builders each write their own file
    os.close(fd)
    try:
        subprocess.run([cc, *FLAGS, str(SOURCE), "-o", tmp], check=True, capture_output=True, text=True, timeout=120)
        os.replace(tmp, target)  # atomic: a reader never sees half a library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@cache
def _library():
    if env_value("SOMA_FUSED") is False:
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.warning("no C compiler found: the fused CPU kernels are off and the model runs in plain torch (slower)")
        return None
    try:
        lib = ctypes.CDLL(str(_build(cc)))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning(
            "building the fused CPU kernels failed (%s): the model runs in plain torch (slower)",
            str(detail).strip()[:300],
        )
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    signatures = {  # name: (result, arguments), as in kernels.c
        "expert_forward": (None, [ptr] * 3 + [i64] + [ptr] * 2 + [i64] * 3 + [ptr] * 3 + [i64] * 8),
        "lstm_block": (None, [ptr] * 5 + [i64] * 5),
        "target_logprobs": (None, [ptr] * 4 + [i64] * 5),
        "pack_recurrent": (None, [ptr] * 2 + [i64] * 2),
        "padded_width": (i64, [i64]),
        "pointwise": (None, [i64, ptr, i64]),
    }
    for name, (result, args) in signatures.items():
        getattr(lib, name).restype, getattr(lib, name).argtypes = result, args
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


def expert_usable(cfg: ModelConfig, *tensors: torch.Tensor) -> bool:
    """The whole-expert kernel can stand in for the model's torch forward (see `usable`), and wins at this width."""
    return cfg.d <= MAX_EXPERT_D and usable(*tensors)


Tensors = torch.Tensor | Sequence[torch.Tensor]


def _pointers(ts: Tensors, shape: tuple[int, ...], what: str) -> tuple[ctypes.Array, list[torch.Tensor]]:
    """A C array of pointers to float32 tensors of `shape`: the rows of one tensor or a list of them (no stacking,
    no copies unless one is not contiguous); also the tensors, to keep them alive during the call."""
    keep = [t.contiguous() for t in ts]
    if any(t.shape != shape or t.dtype != torch.float32 for t in keep):
        raise ValueError(f"expert kernel: every {what} must be float32 of shape {shape}")
    return (ctypes.c_void_p * len(keep))(*(t.data_ptr() for t in keep)), keep


def _byte_rows(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """x, y (G, B, T) bytes -> uint8 tensors sharing their row and group strides (views of one array, such as the
    inputs and targets of windows, are passed as they are), row stride, group stride."""
    if not (x.dtype == y.dtype == torch.uint8 and x.stride() == y.stride() and x.stride(-1) == 1):
        x, y = x.to(torch.uint8).contiguous(), y.to(torch.uint8).contiguous()
    return x, y, x.stride(1), x.stride(0)


def check_sizes(sizes: Sequence[int], groups: int, rows: int) -> None:
    """Real rows per group of a padded batch (groups of `rows` rows): one count per group, each 0 to rows."""
    if len(sizes) != groups or any(not 0 <= int(n) <= rows for n in sizes):
        raise ValueError(f"sizes {list(sizes)}: need 0 to {rows} real rows for each of {groups} groups")


def _expert_forward(
    layout,
    bodies: Tensors,
    heads: Tensors,
    x: torch.Tensor,
    y: torch.Tensor,
    first: int,
    keep: bool,
    sizes: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    cfg = layout.cfg
    x, y = (t[None] if t.dim() == 2 else t for t in (x, y))
    heads = heads[None] if isinstance(heads, torch.Tensor) and heads.dim() == 2 else heads
    c, groups, b, t = len(bodies), *x.shape
    if c % groups or y.shape != x.shape or len(heads) not in (1, groups):
        raise ValueError(
            f"expert kernel: {c} copies, {len(heads)} heads, x {tuple(x.shape)}, y {tuple(y.shape)} do not fit"
        )
    if sizes is not None:
        check_sizes(sizes, groups, b)
    real = (ctypes.c_int64 * groups)(*map(int, sizes)) if sizes is not None else None
    body_ptrs, body_keep = _pointers(bodies, (layout.size,), "body")
    head_ptrs, head_keep = _pointers(heads, (256, cfg.embed_dim), "head")
    names = (
        (["proj_in"] if layout.wide else [None])
        + [f"b{k}.{n}" for k in range(cfg.depth) for n in BLOCK_TENSORS]
        + ["lnf", "proj_out" if layout.wide else None]
    )
    offsets = (ctypes.c_int64 * len(names))(*(layout.offsets[n][0] if n else -1 for n in names))
    x, y, ldx, ldg = _byte_rows(x, y)
    nll = torch.empty(c, b, dtype=torch.float64)
    logp = torch.empty(c, b, t - first) if keep else None
    _library().expert_forward(
        body_ptrs,
        offsets,
        head_ptrs,
        len(heads),
        x.data_ptr(),
        y.data_ptr(),
        ldx,
        ldg,
        groups,
        real,
        logp.data_ptr() if keep else None,
        nll.data_ptr(),
        c,
        b,
        t,
        first,
        cfg.d,
        cfg.embed_dim,
        cfg.depth,
        EXPERT_ROWS,
    )
    del body_keep, head_keep
    return nll, logp


BLOCK_TENSORS = ("ln1", "w_ih", "w_hh", "ln2", "w1", "w2")  # kernels.c's pack_body reads them in this order


def expert_nll(layout, bodies: Tensors, heads: Tensors, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Sum over time of -log p(y) of every copy and row, float64 (C, B). layout: model.Layout of the expert;
    bodies (C, M) or C tensors (M,); heads (256, e), (H, 256, e) or H tensors (256, e); x, y (B, T) bytes shared by
    all copies, or (G, B, T) with copies g*P .. g*P+P-1 on group g (and head g when H = G)."""
    return _expert_forward(layout, bodies, heads, x, y, 0, keep=False)[0]


def expert_logprobs(
    layout,
    bodies: Tensors,
    heads: Tensors,
    x: torch.Tensor,
    y: torch.Tensor,
    first: int = 0,
    sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    """log p(y) of the predictions t >= first: (C, B, T - first) float32; arguments as `expert_nll`. The decoder
    is not run for t < first. sizes, when given, are the real rows of each group of x (one entry per group): the
    rows after them are padding, not computed, and their log p is 0."""
    return _expert_forward(layout, bodies, heads, x, y, first, keep=True, sizes=sizes)[1]


def pack_recurrent(w_hh_t: torch.Tensor) -> torch.Tensor:
    """W_hh^T (P, d, 4d), its g columns already scaled by 2 (model.LSTMState) -> the recurrence kernel's layout
    (P, D, 4D): D = d rounded up to the vector width, the four gates of each vector of hidden units side by side."""
    p, d, _ = w_hh_t.shape
    big = _library().padded_width(d)
    w_hh_t = w_hh_t.contiguous()
    out = w_hh_t.new_empty(p, big, 4 * big)
    _library().pack_recurrent(w_hh_t.data_ptr(), out.data_ptr(), p, d)
    return out


def lstm_block(gates_in: torch.Tensor, w_hh: torch.Tensor, h: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """gates_in (P, T, B, 4d), w_hh packed by `pack_recurrent`, state h, c (P, B, d) updated in place -> out
    (P, T, B, d). The kernel spreads its tiles over torch's intra-op threads (the same OpenMP runtime); ctypes
    releases the GIL during the call."""
    p, t, b, four_d = gates_in.shape
    d = four_d // 4
    big = _library().padded_width(d)
    if w_hh.shape != (p, big, 4 * big):
        raise ValueError(f"lstm_block: w_hh {tuple(w_hh.shape)} is not packed for d = {d} (see pack_recurrent)")
    gates_in, w_hh = gates_in.contiguous(), w_hh.contiguous()
    if not (h.is_contiguous() and c.is_contiguous()):
        raise ValueError("lstm_block updates h and c in place: they must be contiguous")
    out = gates_in.new_empty(p, t, b, d)
    _library().lstm_block(
        gates_in.data_ptr(), w_hh.data_ptr(), h.data_ptr(), c.data_ptr(), out.data_ptr(), p, t, b, d, RECURRENT_ROWS
    )
    return out


def target_logprobs(h: torch.Tensor, heads: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """log p(y) for C copies of R rows: h (C, R, e), heads (H, 256, e), y (Y, R) bytes, where copy i reads
    targets y[i // (C // Y)] and head heads[(i // (C // Y)) % H] -> (C, R) float32."""
    c, r, e = h.shape
    groups, heads_n = y.shape[0], heads.shape[0]
    if c % groups or y.shape[1] != r or heads.shape[1:] != (256, e) or heads_n not in (1, groups):
        raise ValueError(
            f"target_logprobs: h {tuple(h.shape)}, heads {tuple(heads.shape)}, y {tuple(y.shape)} do not fit"
        )
    h = h.contiguous()
    heads_t = heads.transpose(1, 2).contiguous()  # (H, e, 256): a row of E^T per input unit
    y = y.to(torch.uint8).contiguous()
    out = h.new_empty(c, r)
    _library().target_logprobs(
        h.data_ptr(), heads_t.data_ptr(), y.data_ptr(), out.data_ptr(), c, r, e, c // groups, heads_n
    )
    return out
