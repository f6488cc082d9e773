import torch
from conftest import copy_problem

from soma_cluster.config import ModelConfig, SPSAConfig
from soma_cluster.model import Layout, copy_losses, init_body, init_head
from soma_cluster.spsa import Adam, Schedule, probes, spsa_estimate


def test_probe_distribution_and_regeneration():
    layout = Layout(ModelConfig())
    mask = layout.gain_mask()
    z = probes(64, mask, seed=123)
    assert z.shape == (64, layout.size)
    assert torch.equal(z, probes(64, mask, seed=123))
    assert not torch.equal(z, probes(64, mask, seed=124))
    gains, rest = z[:, mask], z[:, ~mask]
    assert set(gains.unique().tolist()) == {-1.0, 1.0}
    assert abs((rest == 0).float().mean().item() - 0.5) < 0.01
    assert abs((rest == 1).float().mean().item() - 0.25) < 0.01
    assert abs((rest == -1).float().mean().item() - 0.25) < 0.01


def test_spsa_step_lowers_loss_in_expectation_on_a_fixed_batch():
    cfg, theta, head, loss_fn = copy_problem()
    mask = Layout(cfg).gain_mask()
    base = float(loss_fn(theta[None]))
    gains = []
    for seed in range(12):
        est = spsa_estimate(theta, probes(16, mask, seed), 1e-3, loss_fn, pert_chunk=8)
        step = theta - 0.02 * est.grad / est.grad.norm()
        gains.append(base - float(loss_fn(step[None])))
    gains = torch.tensor(gains)
    assert gains.mean() > 3 * gains.std() / len(gains) ** 0.5, gains
    assert est.forwards == 32


def test_chunking_does_not_change_the_estimate():
    cfg = ModelConfig(d=8, embed_dim=8)
    g = torch.Generator().manual_seed(5)
    theta, head = init_body(cfg, g), init_head(cfg, g)
    x, y = torch.randint(0, 256, (2, 10), generator=g), torch.randint(0, 256, (2, 10), generator=g)
    z = probes(12, Layout(cfg).gain_mask(), 9)
    f = lambda bodies: copy_losses(cfg, bodies, head, x, y)  # noqa: E731
    a, b = spsa_estimate(theta, z, 1e-3, f, 12), spsa_estimate(theta, z, 1e-3, f, 5)
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6)


def test_adam_bias_correction_first_step_is_lr_times_sign():
    p = torch.zeros(3)
    opt = Adam.zeros_like(p)
    opt.step(p, torch.tensor([2.0, -0.5, 0.0]), 0.1, SPSAConfig())
    torch.testing.assert_close(p, torch.tensor([-0.1, 0.1, 0.0]), rtol=1e-5, atol=1e-6)


def test_schedule_halves_after_patience_with_floor():
    s = Schedule(eps=4e-5, lr=4e-5)
    assert not s.observe(1.0, 50, patience=100, floor=1e-5)
    assert not s.observe(1.1, 50, patience=100, floor=1e-5)
    assert s.observe(1.2, 50, patience=100, floor=1e-5) and s.eps == 2e-5 and s.lr == 2e-5
    s.observe(1.2, 100, 100, 1e-5)
    s.observe(1.2, 100, 100, 1e-5)
    assert s.eps == 1e-5 and s.lr == 1e-5 and s.halvings == 3
