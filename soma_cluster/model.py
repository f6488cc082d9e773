"""The expert: a tied byte embedding and a small pre-norm LSTM/MLP residual body.

Parameters live in one flat body vector per copy, so SPSA can perturb it as a whole and the forward
evaluates P perturbed copies in one batched pass (a leading copy axis on every weight). Activations
are copy-major, (P, T, B, d): the hoisted matmuls are one bmm each, and a recurrent step reads the
(P, B, 4d) slab of time t.

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

from soma_cluster import fused
from soma_cluster.config import ModelConfig

VOCAB = 256
LN_EPS = 1e-5


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    gain: bool  # LayerNorm gain: dense +-1 probes, initialised to 1

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
            out += [
                ParamSpec(f"b{b}.ln1", (d,), True),
                ParamSpec(f"b{b}.w_ih", (4 * d, d), False),
                ParamSpec(f"b{b}.w_hh", (4 * d, d), False),
                ParamSpec(f"b{b}.ln2", (d,), True),
                ParamSpec(f"b{b}.w1", (4 * d, d), False),
                ParamSpec(f"b{b}.w2", (d, 4 * d), False),
            ]
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

    def named(self, body: torch.Tensor) -> dict[str, torch.Tensor]:
        """One body (M,) as its tensors under their public names (tensor_name: `blocks.0.lstm.weight_ih`, ...), in
        layout order: what `soma export` writes, for readers outside soma. Views (no copies)."""
        return {tensor_name(s.name): body[slice(*self.offsets[s.name])].view(s.shape) for s in self.specs}

    def flat(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """`named`'s inverse: the body (M,) from its public tensors, each checked for its shape; KeyError naming a
        missing tensor, ValueError naming one of another shape."""
        parts = []
        for s in self.specs:
            name = tensor_name(s.name)
            t = tensors[name]
            if tuple(t.shape) != s.shape:
                raise ValueError(f"{name} has shape {tuple(t.shape)}, not {s.shape}")
            parts.append(t.reshape(-1))
        return torch.cat(parts)


# The body's tensors as a reader outside soma names them (torch's conventions: `weight`, nn.LSTM's weight_ih and
# weight_hh in its gate order i, f, g, o, no biases): Layout's names are short for its own flat vector.
_BLOCK_TENSORS = {
    "ln1": "ln1.weight",
    "w_ih": "lstm.weight_ih",
    "w_hh": "lstm.weight_hh",
    "ln2": "ln2.weight",
    "w1": "mlp.fc1.weight",
    "w2": "mlp.fc2.weight",
}
_TENSORS = {"proj_in": "proj_in.weight", "lnf": "ln_f.weight", "proj_out": "proj_out.weight"}
EMBED_TENSOR = "embed.weight"  # the tied byte embedding and decoder E (256, e): logits = h E^T


def tensor_name(spec: str) -> str:
    """A Layout name's public one: b3.w_ih -> blocks.3.lstm.weight_ih, lnf -> ln_f.weight."""
    block, _, part = spec.partition(".")
    if part:
        return f"blocks.{int(block[1:])}.{_BLOCK_TENSORS[part]}"
    return _TENSORS[spec]


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
    """Gain-only LayerNorm over the last axis. x (P or 1, T, B, d), gain (P, d)."""
    return F.layer_norm(x, x.shape[-1:], eps=LN_EPS) * gain[:, None, None, :]


def copy_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per-copy x W^T. x (P, T, B, i), w (P, o, i) -> (P, T, B, o); one bmm over the copy axis, no copies."""
    p, t, b, i = x.shape
    return torch.bmm(x.reshape(p, t * b, i), w.transpose(1, 2)).view(p, t, b, -1)


def _cell(
    gates_t: torch.Tensor, h: torch.Tensor, c: torch.Tensor, w_hh_t: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One LSTM step for all copies: gates (P, B, 4d) with the g rows pre-scaled by 2."""
    s = torch.sigmoid(torch.baddbmm(gates_t, h, w_hh_t))
    i, f, g, o = s.chunk(4, dim=-1)
    c = f * c + i * (2.0 * g - 1.0)  # tanh(z) = 2 sigmoid(2z) - 1
    return o * torch.tanh(c), c


_compiled_cell = None


def cell_fn(compiled: bool):
    """The step function: eager, or fused by torch.compile (one bmm + one pointwise kernel per step)."""
    global _compiled_cell
    if not compiled:
        return _cell
    if _compiled_cell is None:
        _compiled_cell = torch.compile(_cell, dynamic=False)
    return _compiled_cell


class LSTMState:
    """Recurrent state (h, c) of one bias-free LSTM layer for all copies, carried across time blocks.
    Gate order (i, f, g, o) as torch.nn.LSTM; the g rows are pre-scaled by 2 so that one sigmoid serves
    all four gates: tanh(z) = 2 sigmoid(2z) - 1."""

    def __init__(self, w_ih: torch.Tensor, w_hh: torch.Tensor, batch: int, compiled: bool):
        p, four_d, d = w_ih.shape
        scale = torch.ones(four_d, 1, dtype=w_ih.dtype, device=w_ih.device)
        scale[2 * d : 3 * d] = 2.0
        self.w_ih = w_ih * scale  # (P, 4d, d)
        self.w_hh_t = (w_hh * scale).transpose(1, 2).contiguous()  # (P, d, 4d)
        self.h = w_ih.new_zeros(p, batch, d)
        self.c = w_ih.new_zeros(p, batch, d)
        self.compiled = compiled
        self.step = cell_fn(compiled)
        self.w_hh_packed = None  # W_hh^T in the fused kernel's layout, made once

    def run(self, x: torch.Tensor) -> torch.Tensor:
        """x (P or 1, Tb, B, d) -> h (P, Tb, B, d): the input matmul hoisted over the block, then the
        sequential part h W_hh^T: in the fused CPU kernel where it can (see soma_cluster.fused), else step
        by step."""
        gates_in = copy_matmul(x.expand(self.h.shape[0], -1, -1, -1), self.w_ih)  # (P, Tb, B, 4d)
        if (
            not self.compiled
            and self.h.shape[-1] <= fused.MAX_RECURRENT_D
            and fused.usable(gates_in, self.w_hh_t, self.h, self.c)
        ):
            if self.w_hh_packed is None:
                self.w_hh_packed = fused.pack_recurrent(self.w_hh_t)
            return fused.lstm_block(gates_in, self.w_hh_packed, self.h, self.c)
        out, self.h, self.c = step_by_step(gates_in, self.w_hh_t, self.h, self.c, self.step)
        return out


def step_by_step(gates_in: torch.Tensor, w_hh_t: torch.Tensor, h: torch.Tensor, c: torch.Tensor, step=_cell):
    """The recurrence in torch, one `step` per time step: gates_in (P, T, B, 4d), w_hh_t (P, d, 4d), state
    h, c (P, B, d) -> (out (P, T, B, d), h, c)."""
    by_time = gates_in.transpose(0, 1).contiguous()  # (T, P, B, 4d): one slab per step
    out = gates_in.new_empty(*gates_in.shape[:3], h.shape[-1])
    for t in range(by_time.shape[0]):
        h, c = step(by_time[t], h, c, w_hh_t)
        out[:, t] = h
    return out, h, c


def lstm(x: torch.Tensor, w_ih: torch.Tensor, w_hh: torch.Tensor, compiled: bool = False) -> torch.Tensor:
    """Bias-free LSTM over a whole sequence. x (P, T, B, d) -> h (P, T, B, d)."""
    return LSTMState(w_ih, w_hh, x.shape[2], compiled).run(x)


def mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return copy_matmul(F.gelu(copy_matmul(x, w1)), w2)


def embed(head: torch.Tensor, x: torch.Tensor, copies: int) -> torch.Tensor:
    """Input embeddings. One batch x (B, T) -> (1, T, B, e), broadcast over all copies; a leading expert
    axis x (G, B, T) with heads (G, 256, e) or one shared (256, e) -> (G*P, T, B, e), P = copies // G."""
    if x.dim() == 2:
        return head[x.t().long()][None]
    g = x.shape[0]
    heads = head if head.dim() == 3 else head.expand(g, -1, -1)
    emb = heads[torch.arange(g, device=x.device)[:, None, None], x.transpose(1, 2).long()]  # (G, T, B, e)
    return emb if copies == g else emb.repeat_interleave(copies // g, dim=0)


class BodyState:
    """C copies of the body advanced one time block at a time, the LSTM states of every layer kept between calls:
    forward_blocks reads a sequence this way, and generation feeds it one byte per call (O(1) per byte)."""

    def __init__(self, cfg: ModelConfig, body: torch.Tensor, batch: int, compiled: bool = False):
        self.layout = Layout(cfg)
        self.w = self.layout.views(body)
        self.copies = body.shape[0]
        self.lstm = [LSTMState(self.w[f"b{k}.w_ih"], self.w[f"b{k}.w_hh"], batch, compiled) for k in range(cfg.depth)]

    def advance(self, emb: torch.Tensor) -> torch.Tensor:
        """Embeddings of the next block (1 or C, Tb, B, e) -> h (C, Tb, B, e), the states carried on."""
        w, h = self.w, emb
        if self.layout.wide:
            h = copy_matmul(h.expand(self.copies, -1, -1, -1), w["proj_in"])  # (C, Tb, B, d)
        for k, state in enumerate(self.lstm):
            h = h + state.run(layer_norm(h, w[f"b{k}.ln1"]))
            h = h + mlp(layer_norm(h, w[f"b{k}.ln2"]), w[f"b{k}.w1"], w[f"b{k}.w2"])
        h = layer_norm(h, w["lnf"])
        if self.layout.wide:
            h = copy_matmul(h, w["proj_out"])  # (C, Tb, B, e)
        return h


def forward_blocks(
    cfg: ModelConfig, body: torch.Tensor, head: torch.Tensor, x: torch.Tensor, compiled: bool = False, block: int = 0
):
    """Yield (t0, t1, h) for consecutive time blocks, h (C, t1-t0, B, e). Every layer advances one block
    at a time (its LSTM state carried over), so the working set is (C, block, B, 4d), not (C, T, B, 4d):
    at the paper's shape the whole-sequence activations are gigabytes and memory-bound. block 0 = T."""
    emb = embed(head, x, body.shape[0])  # (1 or C, T, B, e)
    t_len = emb.shape[1]
    state = BodyState(cfg, body, emb.shape[2], compiled)
    step = block or t_len
    for t0 in range(0, t_len, step):
        h = state.advance(emb[:, t0 : t0 + step])
        yield t0, t0 + h.shape[1], h


def body_forward(
    cfg: ModelConfig, body: torch.Tensor, head: torch.Tensor, x: torch.Tensor, compiled: bool = False
) -> torch.Tensor:
    """Copies of the body in one batched pass. body (C, M), head (256, e) or (G, 256, e), x (B, T) or
    (G, B, T) bytes -> h (C, T, B, e). With an expert axis, copies g*P .. g*P+P-1 belong to expert g."""
    return torch.cat([h for _, _, h in forward_blocks(cfg, body, head, x, compiled)], dim=1)


def _target_logprobs(h: torch.Tensor, head: torch.Tensor, y: torch.Tensor, block: int) -> torch.Tensor:
    p, t, b, e = h.shape
    flat = h.reshape(-1, e)
    tgt = y.t().reshape(-1).long()  # (T*B,), the same for every copy
    out = torch.empty(flat.shape[0], dtype=h.dtype, device=h.device)
    for a in range(0, flat.shape[0], block):
        rows = torch.arange(a, min(a + block, flat.shape[0]), device=h.device)
        out[a : a + block] = -F.cross_entropy(flat[a : a + block] @ head.t(), tgt[rows % (t * b)], reduction="none")
    return out.view(p, t, b)


def target_logprobs(h: torch.Tensor, head: torch.Tensor, y: torch.Tensor, block: int = 8192) -> torch.Tensor:
    """log p(y) per position, in row blocks so the (rows, 256) logits stay cache-sized.
    h (C, T, B, e), y (B, T) or (G, B, T) with head (256, e) or (G, 256, e) -> (C, T, B) float32."""
    if fused.usable(h, head):
        c, t, b, e = h.shape
        ys = (
            y.t().reshape(1, t * b) if y.dim() == 2 else y.transpose(1, 2).reshape(y.shape[0], t * b)
        )  # time-major as h
        return fused.target_logprobs(h.reshape(c, t * b, e), head if head.dim() == 3 else head[None], ys).view(c, t, b)
    if y.dim() == 2:
        return _target_logprobs(h, head, y, block)
    g = y.shape[0]
    p = h.shape[0] // g
    heads = head if head.dim() == 3 else head.expand(g, -1, -1)
    return torch.cat([_target_logprobs(h[i * p : (i + 1) * p], heads[i], y[i], block) for i in range(g)])


def copy_losses(
    cfg: ModelConfig,
    body: torch.Tensor,
    head: torch.Tensor,
    x: torch.Tensor,
    y: torch.Tensor,
    compiled: bool = False,
    block: int = 8,
) -> torch.Tensor:
    """Mean next-byte cross-entropy (nats/byte) of each copy, body (C, M) -> (C,): in the fused whole-expert
    kernel where it runs (soma_cluster.fused), else block by block in time (see forward_blocks) with the loss
    of each block reduced as soon as it exists."""
    if not compiled and fused.expert_usable(cfg, body, head):
        nll = fused.expert_nll(Layout(cfg), body, head, x, y)  # (C, B) float64
        return (nll.sum(dim=1) / (y.shape[-1] * y.shape[-2])).float()
    total = torch.zeros(body.shape[0], dtype=torch.float64, device=body.device)
    for t0, t1, h in forward_blocks(cfg, body, head, x, compiled, block):
        total -= target_logprobs(h, head, y[..., t0:t1]).sum(dim=(1, 2)).double()
    return (total / (y.shape[-1] * y.shape[-2])).float()


def decoder_gradient(h: torch.Tensor, head: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Exact local cross-entropy gradient w.r.t. the decoder E with h held fixed (no BPTT):
    (1/BT) sum (softmax(E h) - onehot(y)) h^T.  h (1, T, B, e), y (B, T) -> (256, e)."""
    hf = h[0].reshape(-1, h.shape[-1])  # (T*B, e)
    probs = torch.softmax(hf @ head.t(), dim=-1)  # (T*B, 256)
    probs[torch.arange(len(hf), device=hf.device), y.t().reshape(-1).long()] -= 1.0
    return probs.t() @ hf / len(hf)
