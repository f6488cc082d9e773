"""EGGROLL, the low-rank evolution-strategies baseline of the paper's comparisons (docs/results.md).

Each population pair k perturbs every body matrix W (a x b) by sigma E_k with E_k = A_k B_k^T / sqrt(r),
A_k (a x r), B_k (b x r) standard Gaussian; LayerNorm gains (vectors) get a dense Gaussian. The pair is
antithetic (theta +- sigma E_k) and the 2 n fitnesses f = -L are z-scored before they weigh the directions:

    g_hat = -(1 / (n sigma)) sum_k (f^_k+ - f^_k-) / 2 * E_k         (a descent direction for the loss)

The perturbed forward of a matrix is x (W + sigma E_k)^T = x W^T + (x B_k)(sigma / sqrt(r)) A_k^T. We evaluate
it by adding sigma E_k to the copy's weights and running the same batched copy forward as SPSA (a leading
copy axis): the same numbers, and at d = 32 the same cost, since every copy has its own activations anyway.
The tied embedding is never perturbed, as in SPSA.
"""

from __future__ import annotations

import math

import torch

from soma_cluster.model import Layout
from soma_cluster.spsa import Estimate, LossFn, paired_losses


def directions(layout: Layout, n: int, rank: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(n, M) flat low-rank directions E_k (matrices) and dense Gaussians (gains), a pure function of the seed."""
    gen = torch.Generator(device=device).manual_seed(seed)
    parts = []
    for s in layout.specs:
        if s.gain:
            parts.append(torch.randn(n, s.size, generator=gen, device=device))
        else:
            a, b = s.shape
            r = min(rank, a, b)
            left = torch.randn(n, a, r, generator=gen, device=device)
            right = torch.randn(n, b, r, generator=gen, device=device)
            parts.append((left @ right.transpose(1, 2) / math.sqrt(r)).reshape(n, -1))
    return torch.cat(parts, dim=1)


def zscore(f: torch.Tensor) -> torch.Tensor:
    """Per expert over its population: f (G, P) -> (f - mean) / std (std 0 -> all zeros)."""
    std = f.std(dim=1, keepdim=True)
    return torch.where(std > 0, (f - f.mean(dim=1, keepdim=True)) / std.clamp_min(1e-30), torch.zeros_like(f))


def eggroll_estimate(theta: torch.Tensor, e: torch.Tensor, sigma, loss_fn: LossFn, pert_chunk: int) -> Estimate:
    """theta (G, M), directions e (G, n, M), sigma (G,) or float -> Estimate with grad (G, M), the batch loss
    near theta (mean of the population) and 2 n forwards per expert."""
    lp, lm = paired_losses(theta, e, sigma, loss_fn, pert_chunk)
    n = e.shape[1]
    f = zscore(-torch.cat([lp, lm], dim=1))  # fitness of the whole population, (G, 2n)
    coef = (f[:, :n] - f[:, n:]) / 2
    s = torch.as_tensor(sigma, dtype=theta.dtype, device=theta.device).reshape(-1).expand(theta.shape[0])[:, None]
    grad = -torch.einsum("gn,gnm->gm", coef, e) / (n * s)
    return Estimate(grad, (lp + lm).mean(dim=1) / 2, 2 * n)
