"""The expert: a tied byte embedding and a small pre-norm LSTM/MLP residual body.

Parameters live in one flat body vector per copy, so SPSA can perturb it as a whole and the forward
evaluates P perturbed copies in one batched pass (a leading copy axis on every weight). Activations
are time-major, (T, P, B, d): each recurrent step reads one contiguous (P, B, 4d) slab.

    E        (256, e)   tied byte embedding / decoder, logits = h E^T, never perturbed
    proj_in  (d, e)     only when d != e (wide experts), likewise proj_out (e, d)
    block b: ln1 (d) -> LSTM W_ih (4d, d), W_hh (4d, d), no bias;  ln2 (d) -> W1 (4d, d), GELU, W2 (d, 4d)
    lnf      (d)        final gain-only LayerNorm
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from soma_cluster.config import ModelConfig

VOCAB = 256
LN_EPS = 1e-5


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    gain: bool          # LayerNorm gain: dense +-1 probes, initialised to 1

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Layout:
    """Where each body tensor sits in the flat body vector."""
    cfg: ModelConfig

    @property
    def wide(self) -> bool:
        return self.cfg.d != self.cfg.embed_dim

    @cached_property
    def specs(self) -> tuple[ParamSpec, ...]:
        d, e = self.cfg.d, self.cfg.embed_dim
        out = [ParamSpec("proj_in", (d, e), False)] if self.wide else []
        for b in range(self.cfg.depth):
            out += [ParamSpec(f"b{b}.ln1", (d,), True), ParamSpec(f"b{b}.w_ih", (4 * d, d), False),
                    ParamSpec(f"b{b}.w_hh", (4 * d, d), False), ParamSpec(f"b{b}.ln2", (d,), True),
                    ParamSpec(f"b{b}.w1", (4 * d, d), False), ParamSpec(f"b{b}.w2", (d, 4 * d), False)]
        out.append(ParamSpec("lnf", (d,), True))
        if self.wide:
            out.append(ParamSpec("proj_out", (e, d), False))
        return tuple(out)

    @cached_property
    def offsets(self) -> dict[str, tuple[int, int]]:
        pos, out = 0, {}
        for s in self.specs:
            out[s.name] = (pos, pos + s.size)
            pos += s.size
        return out

    @property
    def size(self) -> int:
        return sum(s.size for s in self.specs)

    def gain_mask(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """(M,) bool: True on LayerNorm gains."""
        mask = torch.zeros(self.size, dtype=torch.bool, device=device)
        for s in self.specs:
            if s.gain:
                a, b = self.offsets[s.name]
                mask[a:b] = True
        return mask

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """(P, M) -> {name: (P, *shape)} views (no copies)."""
        return {s.name: flat[:, slice(*self.offsets[s.name])].view(flat.shape[0], *s.shape) for s in self.specs}


def body_param_count(cfg: ModelConfig) -> int:
    return Layout(cfg).size


def head_param_count(cfg: ModelConfig) -> int:
    return VOCAB * cfg.embed_dim


def campaign_param_count(cfg: ModelConfig, n_experts: int) -> int:
    """All trainable parameters of an N-expert ensemble: N bodies plus one shared or N own heads."""
    heads = 1 if cfg.head == "shared_frozen" else n_experts
    return n_experts * body_param_count(cfg) + heads * head_param_count(cfg)


def init_body(cfg: ModelConfig, generator: torch.Generator) -> torch.Tensor:
    """(M,) float32: gains 1, weights U(-1/sqrt(fan_in), 1/sqrt(fan_in)) as torch's Linear/LSTM defaults."""
    layout = Layout(cfg)
    parts = []
    for s in layout.specs:
        if s.gain:
            parts.append(torch.ones(s.size))
        else:
            bound = 1.0 / math.sqrt(s.shape[1])
            parts.append((torch.rand(s.size, generator=generator) * 2 - 1) * bound)
    return torch.cat(parts)


def init_head(cfg: ModelConfig, generator: torch.Generator) -> torch.Tensor:
    """(256, e) float32, small so the first predictions are near uniform."""
    return torch.randn(VOCAB, cfg.embed_dim, generator=generator) * 0.02


def layer_norm(x: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
    """Gain-only LayerNorm over the last axis. x (T, P, B, d), gain (P, d)."""
    return F.layer_norm(x, x.shape[-1:], eps=LN_EPS) * gain[None, :, None, :]


def copy_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per-copy x W^T. x (T, P, B, i), w (P, o, i) -> (T, P, B, o); one bmm over the copy axis."""
    t, p, b, i = x.shape
    flat = x.permute(1, 0, 2, 3).reshape(p, t * b, i)
    return torch.bmm(flat, w.transpose(1, 2)).view(p, t, b, -1).permute(1, 0, 2, 3)


def lstm(x: torch.Tensor, w_ih: torch.Tensor, w_hh: torch.Tensor) -> torch.Tensor:
    """Bias-free LSTM, gate order (i, f, g, o) as torch.nn.LSTM. x (T, P, B, d) -> h (T, P, B, d).

    The input matmul is hoisted out of the time loop; only h W_hh^T is sequential. The g rows are
    pre-scaled by 2 so one sigmoid serves all four gates: tanh(z) = 2 sigmoid(2z) - 1.
    """
    t_len, p, b, d = x.shape
    scale = torch.ones(4 * d, 1, dtype=x.dtype, device=x.device)
    scale[2 * d:3 * d] = 2.0
    gates_in = copy_matmul(x, w_ih * scale).contiguous()          # (T, P, B, 4d)
    w_hh_t = (w_hh * scale).transpose(1, 2).contiguous()           # (P, d, 4d)
    h = x.new_zeros(p, b, d)
    c = x.new_zeros(p, b, d)
    out = x.new_empty(t_len, p, b, d)
    for t in range(t_len):
        s = torch.sigmoid(torch.baddbmm(gates_in[t], h, w_hh_t))   # (P, B, 4d)
        i, f, g, o = s.split(d, dim=-1)
        c = torch.addcmul(f * c, i, g * 2.0 - 1.0)
        h = o * torch.tanh(c)
        out[t] = h
    return out


def mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return copy_matmul(F.gelu(copy_matmul(x, w1)), w2)


def body_forward(cfg: ModelConfig, body: torch.Tensor, head: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """P copies of the body on one batch. body (P, M), head (256, e), x (B, T) bytes -> h (T, P, B, e)."""
    layout = Layout(cfg)
    w = layout.views(body)
    p = body.shape[0]
    emb = head[x.t().long()]                                        # (T, B, e), shared by all copies
    h = emb[:, None].expand(-1, p, -1, -1)                          # (T, P, B, e)
    if layout.wide:
        h = copy_matmul(h, w["proj_in"])                             # (T, P, B, d)
    for blk in range(cfg.depth):
        h = h + lstm(layer_norm(h, w[f"b{blk}.ln1"]), w[f"b{blk}.w_ih"], w[f"b{blk}.w_hh"])
        h = h + mlp(layer_norm(h, w[f"b{blk}.ln2"]), w[f"b{blk}.w1"], w[f"b{blk}.w2"])
    h = layer_norm(h, w["lnf"])
    if layout.wide:
        h = copy_matmul(h, w["proj_out"])                            # (T, P, B, e)
    return h


def target_logprobs(h: torch.Tensor, head: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """log p(y) per position. h (T, P, B, e), y (B, T) -> (T, P, B) in float32."""
    logits = h @ head.t()                                           # (T, P, B, 256)
    tgt = y.t().long()[:, None, :, None].expand(-1, h.shape[1], -1, 1)
    return logits.gather(-1, tgt).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def copy_losses(cfg: ModelConfig, body: torch.Tensor, head: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy (nats/byte) of each copy. body (P, M) -> (P,)."""
    return -target_logprobs(body_forward(cfg, body, head, x), head, y).mean(dim=(0, 2))


def decoder_gradient(h: torch.Tensor, head: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Exact local cross-entropy gradient w.r.t. the decoder E with h held fixed (no BPTT):
    (1/BT) sum (softmax(E h) - onehot(y)) h^T.  h (T, 1, B, e), y (B, T) -> (256, e)."""
    hf = h[:, 0].reshape(-1, h.shape[-1])                            # (T*B, e)
    probs = torch.softmax(hf @ head.t(), dim=-1)                      # (T*B, 256)
    probs[torch.arange(len(hf), device=hf.device), y.t().reshape(-1).long()] -= 1.0
    return probs.t() @ hf / len(hf)
