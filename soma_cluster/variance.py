"""Why sharding helps a zero-order estimator: the variance of SPSA with independent vs shared (summed) loss.

Split M parameters into N equal blocks, one per expert, with a separable objective f = sum_i f_i(theta_i).
One probe z gives d = z^T grad f (central difference). Each block's estimate is d_i z_i with its own loss
(independent, SOMA) or d z_i with the summed loss (d = sum_i d_i): the other blocks' terms are pure noise.
With relative variance V = E||g_hat - E g_hat||^2 / ||E g_hat||^2 over the whole vector:

    Rademacher probes (+-1):             V_indep / V_shared = (M/N - 1) / (M - 1)  -> 1/N
    SOMA's ternary probes (0, +-1 w.p. 1/2, 1/4, 1/4):  E z^2 = E z^4 = 1/2 gives V = m for m coordinates,
                                         so the ratio is (M/N) / M = 1/N exactly.

Both are measured here with the estimator's own paired forward (spsa.paired_losses), by Monte Carlo.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from soma_cluster.spsa import paired_losses, probes


@dataclass
class VarianceResult:
    n_blocks: int
    params: int  # M, all blocks together
    draws: int
    probe: str  # "rademacher" or "ternary"
    rel_var_independent: float
    rel_var_shared: float
    predicted_ratio: float  # V_indep / V_shared in theory

    @property
    def ratio(self) -> float:
        return self.rel_var_independent / self.rel_var_shared

    def as_dict(self) -> dict:
        return {
            "n_blocks": self.n_blocks,
            "params": self.params,
            "draws": self.draws,
            "probe": self.probe,
            "rel_var_independent": self.rel_var_independent,
            "rel_var_shared": self.rel_var_shared,
            "ratio": self.ratio,
            "predicted_ratio": self.predicted_ratio,
            "reduction": 1.0 / self.ratio,
            "predicted_reduction": 1.0 / self.predicted_ratio,
        }


def relative_variances(
    d: torch.Tensor, z: torch.Tensor, grad: torch.Tensor, second_moment: torch.Tensor
) -> tuple[float, float]:
    """Per-probe differences d (G, D), probes z (G, D, m), true block gradients grad (G, m), and E z^2 (m,) ->
    (V_independent, V_shared) around the estimator's expectation E g_hat = E[z z^T] g = E z^2 * g."""
    mean = (second_moment * grad).double()  # (G, m)
    z = z.double()
    d = d.double()
    indep = ((d[..., None] * z - mean[:, None]) ** 2).sum(dim=(0, 2)).mean()
    shared = ((d.sum(dim=0)[None, :, None] * z - mean[:, None]) ** 2).sum(dim=(0, 2)).mean()
    norm = (mean**2).sum()
    return float(indep / norm), float(shared / norm)


def _second_moment(mask: torch.Tensor) -> torch.Tensor:
    """E z^2 of the SOMA probes: 1 where dense (+-1), 1/2 where sparse ternary."""
    return torch.where(mask, 1.0, 0.5)


def separable_objective(params: int, n_blocks: int, seed: int):
    """f_i(x) = sum_k a_ik x_k^2 / 2 + b_ik x_k + 0.1 log cosh(x_k), a fixed smooth separable objective over
    N blocks of M/N parameters. Returns (theta (N, m), loss_fn over (N * c, m) bodies, exact grad (N, m))."""
    m = params // n_blocks
    gen = torch.Generator().manual_seed(seed)
    a = torch.rand(n_blocks, m, generator=gen, dtype=torch.float64) + 0.5
    b = torch.randn(n_blocks, m, generator=gen, dtype=torch.float64)
    theta = torch.randn(n_blocks, m, generator=gen, dtype=torch.float64)

    def loss_fn(bodies: torch.Tensor) -> torch.Tensor:
        x = bodies.view(n_blocks, -1, m)
        f = (a[:, None] * x**2 / 2 + b[:, None] * x + 0.1 * torch.log(torch.cosh(x))).sum(dim=-1)
        return f.reshape(-1)

    grad = a * theta + b + 0.1 * torch.tanh(theta)
    return theta, loss_fn, grad


def separable_ratio(
    params: int, n_blocks: int, draws: int, probe: str, seed: int = 0, eps: float = 1e-3, chunk: int = 512
) -> VarianceResult:
    """Measure V_indep / V_shared on the fixed separable objective with `draws` single-probe estimates."""
    theta, loss_fn, grad = separable_objective(params, n_blocks, seed)
    m = theta.shape[1]
    mask = torch.full((m,), probe == "rademacher")  # all dense +-1, or all SOMA-sparse ternary
    z = torch.stack([probes(draws, mask, seed=1000 * seed + i) for i in range(n_blocks)]).double()  # (N, D, m)
    lp, lm = paired_losses(theta, z, eps, loss_fn, chunk)
    vi, vs = relative_variances((lp - lm) / (2 * eps), z, grad, _second_moment(mask).double())
    predicted = (m - 1) / (params - 1) if probe == "rademacher" else 1.0 / n_blocks
    return VarianceResult(n_blocks, m * n_blocks, draws, probe, vi, vs, predicted)


def model_ratio(
    model,
    bodies: torch.Tensor,
    heads: torch.Tensor,
    x: torch.Tensor,
    y: torch.Tensor,
    gain_mask: torch.Tensor,
    eps: float,
    draws: int,
    chunk: int,
    seed: int = 0,
) -> VarianceResult:
    """The same measurement on real experts: G bodies (G, M) with their heads and one batch each x, y (G, B, T).
    The true gradient of each expert's batch loss comes from autograd; the probes are SOMA's (LayerNorm gains
    dense, the rest ternary) and the differences come from the batched perturbed forward, at eps."""
    from soma_cluster.model import copy_losses

    g = bodies.shape[0]
    with torch.enable_grad():
        theta = bodies.clone().requires_grad_(True)
        copy_losses(model, theta, heads, x, y).sum().backward()
    z = torch.stack([probes(draws, gain_mask, seed=1000 * seed + i) for i in range(g)])  # (G, D, M)
    with torch.no_grad():
        lp, lm = paired_losses(bodies, z, eps, lambda b: copy_losses(model, b, heads, x, y), chunk)
    vi, vs = relative_variances((lp - lm) / (2 * eps), z, theta.grad, _second_moment(gain_mask))
    m = bodies.shape[1]
    return VarianceResult(g, g * m, draws, "soma", vi, vs, (m - 1) / (g * m - 1))
