"""Fused CPU kernels (csrc/kernels.c) for the two hot spots of narrow experts.

- The LSTM recurrence. Step by step in torch it is a tiny bmm plus half a dozen pointwise ops per time
  step, each a separate pass over memory and a dispatch: at d = 32 that overhead, not arithmetic, is
  most of the time. The kernel keeps a tile of rows in cache and runs the whole time block.
- log p(target) under the byte decoder. In torch it writes (rows, 256) logits, reads them back for
  log_softmax, writes that and gathers one column; the kernel keeps each tile's logits in cache.

Both run on torch's own OpenMP threads: the library links libgomp.so.1, which the process already has
loaded from torch, so the two share one runtime and one thread pool instead of competing for cores.

The library is compiled with the machine's C compiler at first use (0.2 s here) into a cache keyed by
the source, the compiler and the CPU, since it is built for the CPU it runs on. Without a compiler, or
with SOMA_FUSED=0, `available()` is False and the model keeps its torch path; the kernel never runs
under autograd or on CUDA (the caller checks `usable`).
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

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "kernels.c"
# Widest d for which the recurrence kernel beats torch's step-by-step bmm. benchmarks/bench_kernels.py on
# the 2-core host, kernel speed-up: d=32 2.0-2.4x, d=64 1.2x, d=128 0.7x, d=181 0.5x; above d=64,
# MKL's reuse of W_hh across many rows wins.
MAX_RECURRENT_D = 64
MAX_KERNEL_D = 1024       # the kernel keeps 8 rows x 4d gates on the thread's stack: 128 KiB at this width
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
    lib.lstm_block.restype = lib.target_logprobs.restype = None
    lib.lstm_block.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 4
    lib.target_logprobs.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 5
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


def lstm_block(gates_in: torch.Tensor, w_hh_t: torch.Tensor, h: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """gates_in (P, T, B, 4d), w_hh_t (P, d, 4d), state h, c (P, B, d) updated in place -> out (P, T, B, d).
    The kernel spreads its tiles over torch's intra-op threads (the same OpenMP runtime); ctypes releases
    the GIL during the call."""
    p, t, b, four_d = gates_in.shape
    if four_d // 4 > MAX_KERNEL_D:
        raise ValueError(f"lstm_block: d = {four_d // 4} is wider than the kernel's stack buffers allow ({MAX_KERNEL_D}); use the torch path")
    gates_in, w_hh_t = gates_in.contiguous(), w_hh_t.contiguous()
    if not (h.is_contiguous() and c.is_contiguous()):
        raise ValueError("lstm_block updates h and c in place: they must be contiguous")
    out = gates_in.new_empty(p, t, b, four_d // 4)
    _library().lstm_block(gates_in.data_ptr(), w_hh_t.data_ptr(), h.data_ptr(), c.data_ptr(), out.data_ptr(), p, t, b, four_d // 4)
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
