"""The fused CPU kernels (soma_cluster/fused.py, csrc/kernels.c) against the plain torch path they replace."""
from __future__ import annotations

import logging
import os
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from soma_cluster import fused
from soma_cluster.config import ModelConfig
from soma_cluster.ensemble import packed_logprobs
from soma_cluster.model import LSTMState, copy_losses, init_body, init_head, target_logprobs

pytestmark = pytest.mark.skipif(not fused.available(), reason="no C compiler: the fused kernels are off on this machine")


@pytest.fixture
def torch_only(monkeypatch):
    """A context in which the kernels are switched off (SOMA_FUSED=0), so the same call takes the torch path."""
    @contextmanager
    def off():
        monkeypatch.setenv("SOMA_FUSED", "0")
        fused._library.cache_clear()
        try:
            yield
        finally:
            monkeypatch.delenv("SOMA_FUSED")
            fused._library.cache_clear()
    yield off()
    fused._library.cache_clear()


def run_blocks(w_ih, w_hh, x, cuts):
    """The LSTM over x (P, T, B, d) in time blocks cut at `cuts`, the state carried across them."""
    state = LSTMState(w_ih, w_hh, x.shape[2], compiled=False)
    edges = [0, *cuts, x.shape[1]]
    return torch.cat([state.run(x[:, a:b]) for a, b in zip(edges, edges[1:])], dim=1), state


@pytest.mark.parametrize("p,t,b,d", [(3, 17, 5, 8), (1, 9, 19, 20), (4, 33, 16, 32), (2, 6, 9, 64)])
def test_recurrence_kernel_equals_torch_steps(torch_only, p, t, b, d):
    g = torch.Generator().manual_seed(d)
    x = torch.randn(p, t, b, d, generator=g)
    w_ih, w_hh = torch.randn(p, 4 * d, d, generator=g) / d ** 0.5, torch.randn(p, 4 * d, d, generator=g) / d ** 0.5
    out, state = run_blocks(w_ih, w_hh, x, [t // 3, t // 2])          # B not a multiple of the tile, state carried
    with torch_only:
        ref, ref_state = run_blocks(w_ih, w_hh, x, [t // 3, t // 2])
    assert fused.available()
    torch.testing.assert_close(out, ref, rtol=0, atol=2e-6)
    torch.testing.assert_close(state.c, ref_state.c, rtol=0, atol=2e-6)
    assert torch.equal(out, run_blocks(w_ih, w_hh, x, [t // 3, t // 2])[0])   # deterministic, whatever the thread split


def test_recurrence_kernel_is_right_above_the_width_it_is_used_for(torch_only):
    p, t, b, d = 2, 5, 3, fused.MAX_RECURRENT_D + 36                  # LSTMState keeps torch here; the kernel still must agree
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(p, t, b, d, generator=g), torch.randn(p, 4 * d, d, generator=g) / d ** 0.5
    state = LSTMState(w, w, b, compiled=False)
    gates_in = torch.bmm(x.reshape(p, t * b, d), state.w_ih.transpose(1, 2)).view(p, t, b, 4 * d)
    got = fused.lstm_block(gates_in, state.w_hh_t, state.h, state.c)
    with torch_only:
        ref = LSTMState(w, w, b, compiled=False).run(x)
    torch.testing.assert_close(got, ref, rtol=0, atol=2e-6)


def test_recurrence_result_does_not_depend_on_threads():
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(5, 12, 11, 16, generator=g), torch.randn(5, 64, 16, generator=g) / 4
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run_blocks(w, w, x, [])[0]
        torch.set_num_threads(max(2, threads))
        assert torch.equal(one, run_blocks(w, w, x, [])[0])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("layout", ["copies share y and head", "expert axis, own heads", "expert axis, shared head"])
def test_target_logprob_kernel_equals_log_softmax(torch_only, layout):
    g = torch.Generator().manual_seed(7)
    h = torch.randn(6, 13, 5, 32, generator=g) * 3
    y = torch.randint(0, 256, (5, 13) if layout.startswith("copies") else (3, 5, 13), generator=g)
    head = torch.randn(3, 256, 32, generator=g) if "own" in layout else torch.randn(256, 32, generator=g)
    got = target_logprobs(h, head, y)
    with torch_only:
        ref = target_logprobs(h, head, y)
    assert got.shape == ref.shape == (6, 13, 5)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=2e-5)


def test_extreme_logits_stay_finite(torch_only):
    h = torch.zeros(1, 4, 1, 8)
    h[0, :, 0, 0] = torch.tensor([0.0, 50.0, -50.0, 500.0])
    head = torch.zeros(256, 8)
    head[:, 0] = torch.linspace(-1, 1, 256)
    y = torch.tensor([[0, 255, 3, 128]])
    got = target_logprobs(h, head, y)
    with torch_only:
        ref = target_logprobs(h, head, y)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)


def test_model_losses_and_packed_eval_match_torch(torch_only):
    cfg = ModelConfig(d=32, head="shared_frozen")
    g = torch.Generator().manual_seed(11)
    bodies, head = torch.stack([init_body(cfg, g) for _ in range(3)]), init_head(cfg, g) * 40
    x, y = torch.randint(0, 256, (2, 40), generator=g), torch.randint(0, 256, (2, 40), generator=g)
    windows = np.random.default_rng(0).integers(0, 256, size=(3, 4, 81), dtype=np.uint8)
    heads = head.expand(3, -1, -1)
    got = copy_losses(cfg, bodies, head, x, y), packed_logprobs(cfg, bodies, heads, windows, 16, torch.device("cpu"))
    with torch_only:
        ref = copy_losses(cfg, bodies, head, x, y), packed_logprobs(cfg, bodies, heads, windows, 16, torch.device("cpu"))
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=1e-5)
    np.testing.assert_allclose(got[1], ref[1], rtol=0, atol=1e-4)


def test_autograd_and_float64_keep_the_torch_path():
    d = 8
    w = torch.randn(1, 4 * d, d, requires_grad=True)
    out = LSTMState(w, w, 2, compiled=False).run(torch.randn(1, 5, 2, d))
    assert out.grad_fn is not None                                    # BPTT still differentiates through the LSTM
    out.sum().backward()
    assert w.grad is not None and torch.isfinite(w.grad).all()
    assert not fused.usable(torch.zeros(2, dtype=torch.float64))
    with torch.no_grad():
        assert fused.usable(w)


def test_kernels_off_without_a_compiler(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("SOMA_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    fused._library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="soma_cluster.fused"):
            assert not fused.available()
        assert "plain torch" in caplog.text
        x = torch.randint(0, 256, (2, 9))
        cfg = ModelConfig()
        g = torch.Generator().manual_seed(3)
        assert torch.isfinite(copy_losses(cfg, init_body(cfg, g)[None], init_head(cfg, g), x, x)).all()
        assert list(tmp_path.iterdir()) == []                         # nothing half-built left behind
    finally:
        fused._library.cache_clear()


def test_build_is_cached_per_source_and_cpu(monkeypatch, tmp_path):
    monkeypatch.setenv("SOMA_KERNEL_CACHE", str(tmp_path))
    cc = os.environ.get("CC") or "cc"
    first = fused._build(cc)
    stamp = first.stat().st_mtime_ns
    assert first.parent == tmp_path / "kernels" and first.name.startswith("soma-kernels-")
    assert fused._build(cc) == first and first.stat().st_mtime_ns == stamp      # reused, not rebuilt
    assert [p.name for p in first.parent.iterdir()] == [first.name]           # no temporary files left
