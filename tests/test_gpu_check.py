"""benchmarks/gpu_check.sh, the first GPU's check, in its CPU smoke mode: every step runs at toy sizes, so the
script cannot rot before a GPU runs it (issue 17)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_smoke_prints_one_table():
    env = dict(os.environ, PYTHON=sys.executable)  # the script bounds itself (120 s in smoke mode)
    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--smoke"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "| check | setting | result | seconds | byte-tokens/s | peak GPU MiB | verdict |" in out
    for check in ("update == CPU update", "update time", "eval throughput", "TF32 vs FP32"):
        assert f"| {check} |" in out, check
    assert "FAIL" not in out and out.rstrip().splitlines()[-1].startswith("PASS")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the full check runs where there is a GPU")
def test_gpu_check_without_a_gpu_says_so():
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "no CUDA device" in proc.stderr


def test_pick_device_keeps_tf32_off_unless_asked(monkeypatch):
    from soma_cluster import trainer

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        monkeypatch.delenv("SOMA_TF32", raising=False)
        assert trainer.pick_device().type == "cuda"
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
        monkeypatch.setenv("SOMA_TF32", "1")
        trainer.pick_device()
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
