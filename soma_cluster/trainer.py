"""One expert's training loop state: data order, updates, the decoder rule, validation; and the estimators an
update can use (SOMA's SPSA, the EGGROLL and BPTT baselines), which soma_cluster.methods registers by name.

Everything an update depends on is either in `TrainState` (checkpointed) or regenerated from
(campaign seed, expert, step), so a run resumed from a checkpoint continues bitwise identically.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from soma_cluster.config import ModelConfig, SPSAConfig
from soma_cluster.eggroll import directions, eggroll_estimate
from soma_cluster.envvars import value as env_value
from soma_cluster.model import Layout, body_forward, copy_losses, decoder_gradient
from soma_cluster.shards import Shard
from soma_cluster.spsa import Adam, Estimate, LossFn, Schedule, derive_seed, probes, spsa_estimate


class NonFiniteLoss(RuntimeError):
    """The loss went NaN/inf: the expert fails (and is retried from its checkpoint) instead of training on garbage.
    `experts` are the positions, in the packed update, of the experts at fault (nothing was applied to any)."""

    def __init__(self, message: str, experts: list[int] | None = None):
        super().__init__(message)
        self.experts = experts or [0]


def pick_device() -> torch.device:
    """CUDA when present, else the CPU. TF32 matmuls stay off unless SOMA_TF32=1: SPSA reads loss differences of
    order eps = 1e-3 between perturbed copies, which TF32's 10-bit mantissa may drown, and no measurement has
    shown yet that it does not (benchmarks/gpu_check.sh compares the estimate under TF32 and FP32)."""
    if torch.cuda.is_available():
        tf32 = bool(env_value("SOMA_TF32"))
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
        return torch.device("cuda")
    return torch.device("cpu")


@dataclass
class TrainState:
    body: torch.Tensor  # (M,) float32
    head: torch.Tensor  # (256, e) float32
    body_opt: Adam
    head_opt: Adam | None  # None when the head is shared and frozen
    schedule: Schedule
    step: int = 0
    epoch: int = 0
    cursor: int = 0  # next position in this epoch's permutation of train rows
    forwards: int = 0  # perturbed-copy forwards (B windows each) spent so far
    tokens: int = 0  # byte-tokens processed by those forwards
    history: list[dict] = field(default_factory=list)  # (step, train, val) points for the curve

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"body": self.body, "head": self.head, "body_m": self.body_opt.m, "body_v": self.body_opt.v}
        if self.head_opt is not None:
            out |= {"head_m": self.head_opt.m, "head_v": self.head_opt.v}
        return {k: v.detach().cpu().contiguous() for k, v in out.items()}

    def scalars(self) -> dict:
        s = self.schedule
        return {
            "step": self.step,
            "epoch": self.epoch,
            "cursor": self.cursor,
            "forwards": self.forwards,
            "tokens": self.tokens,
            "body_t": self.body_opt.t,
            "head_t": self.head_opt.t if self.head_opt else 0,
            "eps": s.eps,
            "lr": s.lr,
            "best_val": s.best_val if math.isfinite(s.best_val) else None,
            "since_best": s.since_best,
            "halvings": s.halvings,
            "history": self.history,
        }

    @classmethod
    def restore(cls, tensors: dict[str, torch.Tensor], scalars: dict, device: torch.device) -> "TrainState":
        t = {k: v.to(device) for k, v in tensors.items()}
        head_opt = Adam(t["head_m"], t["head_v"], scalars["head_t"]) if "head_m" in t else None
        best = scalars["best_val"]
        sched = Schedule(
            scalars["eps"],
            scalars["lr"],
            float("inf") if best is None else best,
            scalars["since_best"],
            scalars["halvings"],
        )
        return cls(
            t["body"],
            t["head"],
            Adam(t["body_m"], t["body_v"], scalars["body_t"]),
            head_opt,
            sched,
            scalars["step"],
            scalars["epoch"],
            scalars["cursor"],
            scalars["forwards"],
            scalars["tokens"],
            list(scalars["history"]),
        )

    @classmethod
    def fresh(cls, body: torch.Tensor, head: torch.Tensor, train_head: bool, eps: float, lr: float) -> "TrainState":
        return cls(
            body.clone(),
            head.clone(),
            Adam.zeros_like(body),
            Adam.zeros_like(head) if train_head else None,
            Schedule(eps, lr),
        )


@dataclass
class UpdateStats:
    step: int
    loss: float  # nats/byte on this update's batch (near theta)
    forwards: int


class Trainer:
    """Trains one expert on one shard. `seed` and `expert` name the RNG streams; `estimator` is the training
    method (SOMA's SPSA when none is given)."""

    def __init__(
        self,
        *,
        model: ModelConfig,
        spsa: SPSAConfig,
        shard: Shard,
        state: TrainState,
        seed: int,
        expert: int,
        device: torch.device,
        val_rows: int,
        estimator: Estimator | None = None,
    ):
        self.model, self.spsa, self.shard, self.state = model, spsa, shard, state
        self.seed, self.expert, self.device = seed, expert, device
        # how the body trains; soma_cluster.methods builds one by train.method's name
        self.estimator = estimator if estimator is not None else SPSA()
        self.layout = Layout(model)
        self.gain_mask = self.layout.gain_mask(device)
        self._perm: tuple[int, np.ndarray] | None = None
        n_val = min(val_rows, sum(len(a) for a in shard.val))
        self.val_x, self.val_y = (
            self._xy(shard.gather(np.arange(n_val), "val")[:, : spsa.seq_len]) if n_val else (None, None)
        )

    # -- data ---------------------------------------------------------------------------------------------
    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perm is None or self._perm[0] != epoch:
            rng = np.random.default_rng(derive_seed(self.seed, self.expert, "data", epoch))
            self._perm = (epoch, rng.permutation(self.shard.n_train))
        return self._perm[1]

    def _next_rows(self, n: int) -> np.ndarray:
        st, rows = self.state, []
        while n > 0:
            perm = self._permutation(st.epoch)
            take = perm[st.cursor : st.cursor + n]
            rows.append(take)
            n -= len(take)
            st.cursor += len(take)
            if st.cursor >= len(perm):
                st.epoch, st.cursor = st.epoch + 1, 0
        return np.concatenate(rows)

    def _xy(self, seqs: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.from_numpy(np.ascontiguousarray(seqs)).to(self.device)
        return t[:, :-1], t[:, 1:]

    def batch(self, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        """B windows of seq_len bytes at random offsets: x (B, T-1) inputs, y (B, T-1) next bytes."""
        seqs = self.shard.gather(self._next_rows(self.spsa.batch))
        span = self.shard.seq_bytes - self.spsa.seq_len
        rng = np.random.default_rng(derive_seed(self.seed, self.expert, "crop", self.state.step, micro))
        offs = rng.integers(0, span + 1, size=len(seqs))
        return self._xy(np.stack([s[o : o + self.spsa.seq_len] for s, o in zip(seqs, offs, strict=True)]))

    # -- one update ---------------------------------------------------------------------------------------
    def update(self) -> UpdateStats:
        return update_experts([self])[0]

    def apply(
        self, grad: torch.Tensor, head_grad: torch.Tensor | None, loss: float, forwards: int, tokens: int
    ) -> UpdateStats:
        """Coupled weight decay, then Adam on the body (and on the head when it trains); the same for every method."""
        st, cfg = self.state, self.spsa
        grad = grad + cfg.weight_decay * st.body
        st.body_opt.step(st.body, grad, st.schedule.lr, cfg)
        if head_grad is not None:
            st.head_opt.step(st.head, head_grad, st.schedule.lr, cfg)
        st.step += 1
        st.forwards += forwards
        st.tokens += tokens
        return UpdateStats(st.step, loss, forwards)

    @torch.no_grad()
    def validate(self) -> float:
        """Mean nats/byte on the expert-validation rows (fixed rows, offset 0)."""
        if self.val_x is None:
            return float("nan")
        losses = [
            copy_losses(
                self.model, self.state.body[None], self.state.head, self.val_x[i : i + 64], self.val_y[i : i + 64]
            )
            * len(self.val_x[i : i + 64])
            for i in range(0, len(self.val_x), 64)
        ]
        return float(torch.stack(losses).sum() / len(self.val_x))

    def observe_val(self, val: float, updates_since_last: int) -> bool:
        return self.state.schedule.observe(val, updates_since_last, self.spsa.patience, self.spsa.floor)


@torch.no_grad()
def update_experts(trainers: list[Trainer]) -> list[UpdateStats]:
    """One update of G independent experts in shared batched passes (the expert axis).

    Each expert keeps its own data, probes, eps, optimizer and head; only the forward is shared, so
    the result for each expert is what it would get alone (up to float reassociation in bmm) -- except
    under spsa.objective summed, the control in which the experts' loss differences are added up."""
    t0 = trainers[0]
    cfg = t0.spsa
    train_head = t0.state.head_opt is not None
    g = len(trainers)
    grad = torch.zeros(g, t0.layout.size, device=t0.device)
    head_grad = [torch.zeros_like(t.state.head) for t in trainers] if train_head else None
    loss = torch.zeros(g, dtype=torch.float64)
    forwards = 0
    cursors = [(t.state.epoch, t.state.cursor) for t in trainers]
    for micro in range(cfg.accum):
        x, y, heads = _packed_batch(trainers, micro)
        step = t0.estimator(trainers, x, y, heads, micro)
        grad += step.grad / cfg.accum
        loss += step.loss.double() / cfg.accum
        forwards += step.forwards
        if train_head:
            for i in range(g):
                head_grad[i] += step.head_grad[i] / cfg.accum
    tokens = forwards * x.shape[-2] * x.shape[-1]  # byte-tokens per expert: forwards x B x T
    bad = [i for i in range(g) if not math.isfinite(float(loss[i])) or not torch.isfinite(grad[i]).all()]
    if bad:  # checked for all before any is applied, so a pack can drop the bad ones and redo the rest
        for t, (epoch, cursor) in zip(trainers, cursors, strict=True):
            t.state.epoch, t.state.cursor = epoch, cursor
        t = trainers[bad[0]]
        raise NonFiniteLoss(f"expert {t.expert}: non-finite loss {float(loss[bad[0]])} at step {t.state.step}", bad)
    return [
        t.apply(grad[i], head_grad[i] if train_head else None, float(loss[i]), forwards, tokens)
        for i, t in enumerate(trainers)
    ]


def _packed_batch(trainers: list[Trainer], micro: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, y (B, T) for one expert or (G, B, T) for a pack, and the head(s) (256, e) or (G, 256, e)."""
    batches = [t.batch(micro) for t in trainers]
    if len(trainers) == 1:
        return batches[0][0], batches[0][1], trainers[0].state.head
    return (
        torch.stack([b[0] for b in batches]),
        torch.stack([b[1] for b in batches]),
        torch.stack([t.state.head for t in trainers]),
    )


@dataclass
class Step:
    """One micro-batch's estimate for G packed experts, as every training method returns it."""

    grad: torch.Tensor  # (G, M) the bodies' gradient
    loss: torch.Tensor  # (G,) the batch loss near theta, nats/byte
    forwards: int  # forwards per expert (perturbed copies, or one forward and backward)
    head_grad: list[torch.Tensor] | None = None  # (256, e) per expert when the heads train


class Estimator(Protocol):
    """A training method's update direction for the packed experts on one micro-batch: x, y (B, T) or
    (G, B, T), heads (256, e) or (G, 256, e)."""

    def __call__(
        self, trainers: list[Trainer], x: torch.Tensor, y: torch.Tensor, heads: torch.Tensor, micro: int
    ) -> Step: ...


@dataclass(frozen=True)
class ZeroOrder(ABC):
    """A zero-order estimate of every body's gradient from the losses of perturbed copies; an own head learns
    by the delta rule from h at theta itself (one more forward per expert). Directions are regenerated from
    (campaign seed, expert, step, micro-batch); the perturbation scale is the schedule's eps."""

    def __call__(
        self, trainers: list[Trainer], x: torch.Tensor, y: torch.Tensor, heads: torch.Tensor, micro: int
    ) -> Step:
        t0 = trainers[0]
        model, cfg = t0.model, t0.spsa
        theta = torch.stack([t.state.body for t in trainers])
        scale = [t.state.schedule.eps for t in trainers]  # SPSA's eps, or EGGROLL's sigma
        est = self.estimate(
            trainers,
            theta,
            scale,
            micro,
            lambda bodies: copy_losses(model, bodies, heads, x, y, cfg.compile, cfg.time_block),
        )
        if t0.state.head_opt is None:
            return Step(est.grad, est.loss, est.forwards)
        h = body_forward(model, theta, heads, x, cfg.compile)
        one = len(trainers) == 1
        head_grad = [decoder_gradient(h[i : i + 1], t.state.head, y if one else y[i]) for i, t in enumerate(trainers)]
        return Step(est.grad, est.loss, est.forwards + 1, head_grad)

    @abstractmethod
    def estimate(
        self, trainers: list[Trainer], theta: torch.Tensor, scale: list[float], micro: int, loss_fn: LossFn
    ) -> Estimate:
        """The bodies' gradient estimate from perturbed copies: each estimator's own."""


@dataclass(frozen=True)
class SPSA(ZeroOrder):
    """SOMA's estimator: ternary probes and central differences (spsa.objective summed: the control)."""

    def estimate(
        self, trainers: list[Trainer], theta: torch.Tensor, scale: list[float], micro: int, loss_fn: LossFn
    ) -> Estimate:
        cfg = trainers[0].spsa
        z = torch.stack(
            [
                probes(cfg.n_pert, t.gain_mask, derive_seed(t.seed, t.expert, "probe", t.state.step, micro))
                for t in trainers
            ]
        )
        return spsa_estimate(theta, z, scale, loss_fn, cfg.pert_chunk, summed=cfg.objective == "summed")


@dataclass(frozen=True)
class Eggroll(ZeroOrder):
    """The EGGROLL baseline: low-rank Gaussian directions of rank `rank` per matrix, z-scored fitness."""

    rank: int = 1

    def estimate(
        self, trainers: list[Trainer], theta: torch.Tensor, scale: list[float], micro: int, loss_fn: LossFn
    ) -> Estimate:
        cfg = trainers[0].spsa
        e = torch.stack(
            [
                directions(
                    t.layout,
                    cfg.n_pert,
                    self.rank,
                    derive_seed(t.seed, t.expert, "eggroll", t.state.step, micro),
                    t.device,
                )
                for t in trainers
            ]
        )
        return eggroll_estimate(theta, e, scale, loss_fn, cfg.pert_chunk)


@dataclass(frozen=True)
class Backprop:
    """BPTT: the exact gradient of each expert's batch loss by autograd through the whole sequence (the head
    too when it trains), clipped per expert to `grad_clip` (0: off). One forward (and one backward) per expert."""

    grad_clip: float = 1.0

    def __call__(
        self, trainers: list[Trainer], x: torch.Tensor, y: torch.Tensor, heads: torch.Tensor, micro: int
    ) -> Step:
        t0 = trainers[0]
        train_head = t0.state.head_opt is not None
        with torch.enable_grad():
            theta = torch.stack([t.state.body for t in trainers]).requires_grad_(True)
            h = heads.detach().clone().requires_grad_(True) if train_head else heads
            losses = copy_losses(t0.model, theta, h, x, y, block=t0.spsa.time_block)  # (G,)
            losses.sum().backward()  # experts are independent
        grad = theta.grad
        head_grad = (h.grad if h.grad.dim() == 3 else h.grad[None]) if train_head else None
        if self.grad_clip > 0:
            sq = grad.pow(2).sum(dim=1) + (head_grad.pow(2).sum(dim=(1, 2)) if train_head else 0)
            factor = (self.grad_clip / sq.sqrt().clamp_min(1e-12)).clamp(max=1.0)
            grad = grad * factor[:, None]
            head_grad = head_grad * factor[:, None, None] if train_head else None
        return Step(grad, losses.detach(), 1, list(head_grad) if train_head else None)
