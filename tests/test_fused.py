"""The fused CPU kernels (soma_cluster/fused.py, csrc/kernels.c) against the plain torch path they replace."""

from __future__ import annotations

import itertools
import logging
import math
import os
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from soma_cluster import fused
from soma_cluster.config import ModelConfig
from soma_cluster.ensemble import packed_logprobs
from soma_cluster.model import Layout, LSTMState, copy_losses, init_body, init_head, target_logprobs

pytestmark = pytest.mark.skipif(
    not fused.available(), reason="no C compiler: the fused kernels are off on this machine"
)
CPU = torch.device("cpu")


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


@pytest.fixture
def expert_calls(monkeypatch):
    """Counts the calls of the whole-expert kernel, so a test knows it ran rather than the torch fallback."""
    calls = []
    real = fused._expert_forward

    def counted(*args, **kwargs):
        calls.append(args[0].cfg.d)
        return real(*args, **kwargs)

    monkeypatch.setattr(fused, "_expert_forward", counted)
    return calls


def run_blocks(w_ih, w_hh, x, cuts):
    """The LSTM over x (P, T, B, d) in time blocks cut at `cuts`, the state carried across them."""
    state = LSTMState(w_ih, w_hh, x.shape[2], compiled=False)
    edges = [0, *cuts, x.shape[1]]
    return torch.cat([state.run(x[:, a:b]) for a, b in itertools.pairwise(edges)], dim=1), state


@pytest.mark.parametrize("p,t,b,d", [(3, 17, 5, 8), (1, 9, 37, 20), (4, 33, 16, 32), (2, 6, 9, 64), (1, 4, 3, 100)])
def test_recurrence_kernel_equals_torch_steps(torch_only, p, t, b, d):
    assert d <= fused.MAX_RECURRENT_D  # LSTMState takes the kernel at these widths
    g = torch.Generator().manual_seed(d)
    x = torch.randn(p, t, b, d, generator=g)
    w_ih, w_hh = torch.randn(p, 4 * d, d, generator=g) / d**0.5, torch.randn(p, 4 * d, d, generator=g) / d**0.5
    out, state = run_blocks(w_ih, w_hh, x, [t // 3, t // 2])  # B not a multiple of the tile, state carried
    with torch_only:
        ref, ref_state = run_blocks(w_ih, w_hh, x, [t // 3, t // 2])
    assert fused.available()
    torch.testing.assert_close(out, ref, rtol=0, atol=2e-6)
    torch.testing.assert_close(state.c, ref_state.c, rtol=0, atol=2e-6)
    assert torch.equal(out, run_blocks(w_ih, w_hh, x, [t // 3, t // 2])[0])  # deterministic, whatever the thread split


def test_results_do_not_depend_on_threads():
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(5, 12, 11, 16, generator=g), torch.randn(5, 64, 16, generator=g) / 4
    cfg = ModelConfig(d=24, embed_dim=16, head="own")
    bodies, head = torch.stack([init_body(cfg, g) for _ in range(3)]), init_head(cfg, g) * 30
    xb, yb = torch.randint(0, 256, (45, 19), generator=g), torch.randint(0, 256, (45, 19), generator=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run_blocks(w, w, x, [])[0], copy_losses(cfg, bodies, head, xb, yb)
        torch.set_num_threads(max(2, threads))
        assert torch.equal(one[0], run_blocks(w, w, x, [])[0])
        assert torch.equal(one[1], copy_losses(cfg, bodies, head, xb, yb))
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


EXPERTS = {  # name: ModelConfig fields, copies, batch rows, time steps
    "paper width d=32, shared head": (dict(d=32, head="shared_frozen"), 4, 37, 23),
    "d=20, one block (padded lanes)": (dict(d=20, embed_dim=20, depth=1, head="shared_frozen"), 2, 5, 30),
    "wide d=43, e=32, own heads, three blocks": (dict(d=43, depth=3, head="own"), 4, 9, 17),
    "d=8 below one vector, e=12": (dict(d=8, embed_dim=12, head="own"), 2, 3, 11),
    "d=181, the N=8 width": (dict(d=181, head="own"), 2, 4, 6),
}


@pytest.mark.parametrize("name", EXPERTS)
def test_expert_kernel_equals_torch(torch_only, expert_calls, name):
    fields, copies, b, t = EXPERTS[name]
    cfg = ModelConfig(**fields)
    assert cfg.d <= fused.MAX_EXPERT_D
    g = torch.Generator().manual_seed(11)
    bodies = torch.stack([init_body(cfg, g) for _ in range(copies)])
    bodies += torch.randn(bodies.shape, generator=g) * 0.05  # gains away from 1
    head, heads = init_head(cfg, g) * 40, torch.stack([init_head(cfg, g) * 30 for _ in range(copies)])
    x, y = torch.randint(0, 256, (b, t), generator=g), torch.randint(0, 256, (b, t), generator=g)
    windows = np.random.default_rng(0).integers(0, 256, size=(copies, b, t + 1), dtype=np.uint8)
    xs, ys = torch.randint(0, 256, (2, b, t), generator=g), torch.randint(0, 256, (2, b, t), generator=g)
    own = heads[:: copies // 2] if cfg.head == "own" else head  # expert axis: 2 groups of copies
    got = (
        copy_losses(cfg, bodies, head, x, y),
        packed_logprobs(cfg, bodies, heads, windows, t // 3, CPU),
        copy_losses(cfg, bodies, own, xs, ys),
    )
    assert len(expert_calls) == 3
    with torch_only:
        ref = (
            copy_losses(cfg, bodies, head, x, y),
            packed_logprobs(cfg, bodies, heads, windows, t // 3, CPU),
            copy_losses(cfg, bodies, own, xs, ys),
        )
    assert len(expert_calls) == 3
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=1e-5)
    assert got[1].shape == ref[1].shape == (copies, b, t - t // 3)
    np.testing.assert_allclose(got[1], ref[1], rtol=0, atol=1e-4)
    torch.testing.assert_close(got[2], ref[2], rtol=0, atol=1e-5)


def test_padding_rows_are_not_computed_and_score_zero(torch_only, expert_calls):
    """packed_logprobs told each expert's real windows (evaluate_ensemble's passes pad units to the largest): the
    kernel gives the real rows exactly what it gives them unpadded and 0 for the padding, also for an expert with
    no real rows whose body is NaN; the torch path agrees. (That the padding costs no time shows in
    benchmarks/bench_inference.py, not here.)"""
    cfg = ModelConfig(d=32, head="shared_frozen")
    g = torch.Generator().manual_seed(5)
    bodies = [init_body(cfg, g) for _ in range(3)]
    heads = [init_head(cfg, g)] * 3
    windows = np.random.default_rng(1).integers(0, 256, size=(3, 7, 20), dtype=np.uint8)
    sizes = [7, 2, 0]
    got = packed_logprobs(cfg, [*bodies[:2], torch.full_like(bodies[2], math.nan)], heads, windows, 5, CPU, sizes)
    whole = packed_logprobs(cfg, bodies[:2], heads[:2], windows[:2], 5, CPU)
    assert len(expert_calls) == 2 and got.shape == (3, 7, 14)
    np.testing.assert_array_equal(got[0], whole[0])
    np.testing.assert_array_equal(got[1, :2], whole[1, :2])
    assert (got[1, 2:] == 0).all() and (got[2] == 0).all() and (whole[1, 2:] < 0).all()
    with torch_only:
        ref = packed_logprobs(cfg, bodies, heads, windows, 5, CPU, sizes)
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-4)
    assert (ref[1, 2:] == 0).all() and (ref[2] == 0).all()
    for bad in ([7, 2], [8, 0, 0], [1, -1, 0]):
        with pytest.raises(ValueError, match="sizes"):
            packed_logprobs(cfg, bodies, heads, windows, 5, CPU, bad)
        with pytest.raises(ValueError, match="sizes"):
            fused.expert_logprobs(
                Layout(cfg),
                bodies,
                heads,
                torch.from_numpy(windows[..., :-1]),
                torch.from_numpy(windows[..., 1:]),
                5,
                bad,
            )


def test_wider_experts_keep_the_composed_path(expert_calls):
    cfg = ModelConfig(d=fused.MAX_EXPERT_D + 8, head="own")
    g = torch.Generator().manual_seed(2)
    x = torch.randint(0, 256, (2, 5), generator=g)
    loss = copy_losses(cfg, init_body(cfg, g)[None], init_head(cfg, g), x, x)
    assert expert_calls == [] and torch.isfinite(loss).all()


@pytest.mark.parametrize("kind", ["exp", "sigmoid", "gelu"])
def test_pointwise_functions_are_exact_to_float32(kind):
    """exp and sigmoid within a few float32 ulps of float64; GELU the exact (erf) form, at least as accurate as
    torch's own."""
    x = torch.linspace(-87, 88, 200_001) if kind != "gelu" else torch.linspace(-30, 30, 200_001)
    got, xd = fused.pointwise(kind, x).double(), x.double()
    if kind == "gelu":
        ref = xd * 0.5 * (1 + torch.special.erf(xd / math.sqrt(2)))
        assert ((got - ref).abs() / xd.abs().clamp_min(1e-30)).max() < 3e-7
        assert (got - ref).abs().max() < 1.2e-6  # torch's own F.gelu: 1.15e-6
    else:
        ref = xd.exp() if kind == "exp" else torch.sigmoid(xd)
        assert ((got - ref).abs() / ref).max() < 2e-7


def test_autograd_and_float64_keep_the_torch_path(expert_calls):
    d = 8
    w = torch.randn(1, 4 * d, d, requires_grad=True)
    out = LSTMState(w, w, 2, compiled=False).run(torch.randn(1, 5, 2, d))
    assert out.grad_fn is not None  # BPTT still differentiates through the LSTM
    out.sum().backward()
    assert w.grad is not None and torch.isfinite(w.grad).all()
    cfg = ModelConfig(d=8, embed_dim=8)
    body = init_body(cfg, torch.Generator().manual_seed(0))[None].requires_grad_(True)
    x = torch.randint(0, 256, (2, 5))
    copy_losses(cfg, body, init_head(cfg, torch.Generator()), x, x).sum().backward()
    assert expert_calls == [] and torch.isfinite(body.grad).all()
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
        assert list(tmp_path.iterdir()) == []  # nothing half-built left behind
    finally:
        fused._library.cache_clear()


def test_build_is_cached_per_source_and_cpu(monkeypatch, tmp_path):
    monkeypatch.setenv("SOMA_KERNEL_CACHE", str(tmp_path))
    cc = os.environ.get("CC") or "cc"
    first = fused._build(cc)
    stamp = first.stat().st_mtime_ns
    assert first.parent == tmp_path / "kernels" and first.name.startswith("soma-kernels-")
    assert fused._build(cc) == first and first.stat().st_mtime_ns == stamp  # reused, not rebuilt
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temporary files left
