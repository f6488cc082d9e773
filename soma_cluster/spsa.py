"""The SOMA estimator: SPSA with regenerated ternary probes, Adam, and the eps/lr halving schedule.

    d_j = (L(theta + eps z_j) - L(theta - eps z_j)) / (2 eps),   g_hat = mean_j d_j z_j
Probes: LayerNorm gains dense +-1; every other body coordinate 0 w.p. 1/2, +-1 w.p. 1/4 each.
All 2 n_pert copies see the same batch and are evaluated in batched passes of `pert_chunk` probes
(`paired_losses`, shared with the EGGROLL baseline in soma_cluster.eggroll).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable

import torch

from soma_cluster.config import SPSAConfig


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed from (campaign seed, expert, step, ...): probes and data order are regenerated, never stored."""
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def probes(n_pert: int, gain_mask: torch.Tensor, seed: int) -> torch.Tensor:
    """(n_pert, M) float32 probe directions, a pure function of (seed, M, device type)."""
    gen = torch.Generator(device=gain_mask.device).manual_seed(seed)
    r = torch.randint(0, 4, (n_pert, gain_mask.numel()), generator=gen, device=gain_mask.device, dtype=torch.int8)
    sparse = (r == 2).float() - (r == 3).float()  # 0, 0, +1, -1
    dense = 1.0 - 2.0 * (r & 1).float()  # +1, -1, +1, -1
    return torch.where(gain_mask, dense, sparse)


LossFn = Callable[[torch.Tensor], torch.Tensor]  # (C, M) bodies -> (C,) losses, C = G * 2c copies


@dataclass
class Estimate:
    grad: torch.Tensor  # (G, M), or (M,) for a single expert
    loss: torch.Tensor  # (G,) mean of (L+ + L-)/2 over probes: the batch loss near theta
    forwards: int  # perturbed-copy forwards per expert


def paired_losses(
    theta: torch.Tensor, z: torch.Tensor, scale, loss_fn: LossFn, pert_chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """L(theta + s z_j) and L(theta - s z_j) of G experts, each on its own batch: probes in chunks, and each
    chunk of every expert's +/- copies is ONE batched forward. theta (G, M), z (G, n, M), scale (G,) or a
    float -> (L+, L-) each (G, n)."""
    g, n, _ = z.shape
    s = torch.as_tensor(scale, dtype=theta.dtype, device=theta.device).reshape(-1).expand(g)[:, None, None]
    plus, minus = [], []
    for a in range(0, n, pert_chunk):
        zc = z[:, a : a + pert_chunk]  # (G, c, M)
        c = zc.shape[1]
        bodies = torch.cat([theta[:, None] + s * zc, theta[:, None] - s * zc], dim=1)  # (G, 2c, M)
        losses = loss_fn(bodies.reshape(g * 2 * c, -1)).view(g, 2 * c)
        plus.append(losses[:, :c])
        minus.append(losses[:, c:])
    return torch.cat(plus, dim=1), torch.cat(minus, dim=1)


def spsa_estimate(
    theta: torch.Tensor, z: torch.Tensor, eps, loss_fn: LossFn, pert_chunk: int, summed: bool = False
) -> Estimate:
    """Central-difference SPSA of G experts at once. theta (G, M) with z (G, n, M) and eps (G,) -- or a single
    expert: theta (M,), z (n, M), eps float. `summed` is the baselines' control (docs/results.md): probe j perturbs
    every expert at once (the joint direction is the concatenation of their z_j) and each expert's estimate
    is driven by the difference of the SUM of all experts' losses, d_j = sum_i d_ij, instead of its own d_ij."""
    single = theta.dim() == 1
    if single:
        theta, z = theta[None], z[None]
    n = z.shape[1]
    lp, lm = paired_losses(theta, z, eps, loss_fn, pert_chunk)
    eps_t = torch.as_tensor(eps, dtype=lp.dtype, device=lp.device).reshape(-1).expand(lp.shape[0])[:, None]
    d = (lp - lm) / (2 * eps_t)  # (G, n)
    if summed:
        d = d.sum(dim=0, keepdim=True).expand_as(d)
    grad = torch.einsum("gn,gnm->gm", d, z) / n
    loss = (lp + lm).mean(dim=1) / 2
    return Estimate(grad[0] if single else grad, loss[0] if single else loss, 2 * n)


@dataclass
class Adam:
    """Adam with bias correction on a flat tensor; moments are part of the checkpoint."""

    m: torch.Tensor
    v: torch.Tensor
    t: int = 0

    @classmethod
    def zeros_like(cls, p: torch.Tensor) -> "Adam":
        return cls(torch.zeros_like(p), torch.zeros_like(p), 0)

    def step(self, param: torch.Tensor, grad: torch.Tensor, lr: float, cfg: SPSAConfig) -> None:
        self.t += 1
        self.m.mul_(cfg.beta1).add_(grad, alpha=1 - cfg.beta1)
        self.v.mul_(cfg.beta2).addcmul_(grad, grad, value=1 - cfg.beta2)
        m_hat = self.m / (1 - cfg.beta1**self.t)
        v_hat = self.v / (1 - cfg.beta2**self.t)
        param.sub_(lr * m_hat / (v_hat.sqrt() + cfg.adam_eps))


@dataclass
class Schedule:
    """eps and lr halve together after `patience` updates without expert-val improvement, floor 1e-5."""

    eps: float
    lr: float
    best_val: float = float("inf")
    since_best: int = 0
    halvings: int = 0

    def observe(self, val_loss: float, updates_since_last: int, patience: int, floor: float) -> bool:
        """Record a validation result; returns True when it halved eps and lr."""
        if val_loss < self.best_val:
            self.best_val, self.since_best = val_loss, 0
            return False
        self.since_best += updates_since_last
        if self.since_best < patience:
            return False
        self.eps, self.lr = max(self.eps / 2, floor), max(self.lr / 2, floor)
        self.since_best, self.halvings = 0, self.halvings + 1
        return True
