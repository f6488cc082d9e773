"""The trainer is the SOMA estimator (batched central-difference SPSA, soma_cluster/spsa.py), and a checkpoint
continues it bitwise."""

import numpy as np
import pytest
import torch
from conftest import assert_packed_equals_separate

from soma_cluster.checkpoint import load_checkpoint, save_checkpoint
from soma_cluster.config import ModelConfig, SPSAConfig, resolve
from soma_cluster.model import Layout, campaign_param_count, copy_losses, init_body, init_head
from soma_cluster.shards import Shard
from soma_cluster.spsa import probes, spsa_estimate
from soma_cluster.storage import Store
from soma_cluster.textsources import builtin_documents
from soma_cluster.trainer import Trainer, TrainState

SEQ = 128
SMALL = ModelConfig(d=16, embed_dim=16)


@pytest.fixture(scope="module")
def shards():
    data = b"".join(d.data for d in builtin_documents(400_000))
    rows = np.frombuffer(data[: (len(data) // SEQ) * SEQ], dtype=np.uint8).reshape(-1, SEQ)
    return [Shard(e, SEQ, [rows[e::3][:-8]], [rows[e::3][-8:]]) for e in range(3)]


def make(shard, model=SMALL, train_head=False, **spsa):
    cfg = SPSAConfig(**{"n_pert": 4, "batch": 3, "seq_len": 48, "pert_chunk": 3, **spsa})
    g = torch.Generator().manual_seed(7)
    state = TrainState.fresh(init_body(model, g), init_head(model, g) * 10, train_head, cfg.eps, cfg.lr)
    return Trainer(
        model=model,
        spsa=cfg,
        shard=shard,
        state=state,
        seed=11,
        expert=shard.expert,
        device=torch.device("cpu"),
        val_rows=8,
    )


def snapshot(tr):
    return {k: v.clone() for k, v in tr.state.tensors().items()} | {"scalars": tr.state.scalars()}


def same(a, b):
    assert a["scalars"] == b["scalars"]
    for k in a:
        if k != "scalars":
            assert torch.equal(a[k], b[k]), k


def test_same_seeds_give_bitwise_identical_updates(shards):
    a, b = make(shards[0]), make(shards[0])
    for _ in range(3):
        a.update(), b.update()
    same(snapshot(a), snapshot(b))


@pytest.mark.parametrize("train_head", [False, True])
def test_checkpoint_continues_bitwise(tmp_path, shards, train_head):
    straight = make(shards[1], train_head=train_head, accum=2)
    for _ in range(6):
        straight.update()
    first = make(shards[1], train_head=train_head, accum=2)
    for _ in range(3):
        first.update()
    first.validate() and first.observe_val(first.validate(), 3)
    store = Store(str(tmp_path))
    save_checkpoint(store, "experts/x", first.state)
    state = load_checkpoint(store, "experts/x").state(torch.device("cpu"))
    resumed = Trainer(
        model=first.model,
        spsa=first.spsa,
        shard=shards[1],
        state=state,
        seed=11,
        expert=1,
        device=torch.device("cpu"),
        val_rows=8,
    )
    for _ in range(3):
        resumed.update()
    a, b = snapshot(straight), snapshot(resumed)
    (
        a["scalars"].pop("best_val"),
        b["scalars"].pop("best_val"),
        a["scalars"].pop("since_best"),
        b["scalars"].pop("since_best"),
    )
    same(a, b)


def test_frozen_head_is_never_touched_and_probes_cover_the_body_only(shards):
    tr = make(shards[0])
    head = tr.state.head.clone()
    tr.update()
    assert torch.equal(tr.state.head, head)
    assert probes(4, tr.gain_mask, 0).shape[1] == Layout(tr.model).size


def test_accumulation_costs_2_a_n_pert_forwards(shards):
    for accum in (1, 2, 4):
        assert make(shards[0], accum=accum).update().forwards == 2 * accum * 4
    assert make(shards[0], train_head=True, accum=2).update().forwards == 2 * 2 * 4 + 2


def test_coupled_weight_decay_with_zero_signal(shards):
    tr = make(shards[0], weight_decay=1e-4, lr=1e-3)
    before = tr.state.body.clone()
    tr.apply(torch.zeros_like(before), None, 1.0, 0, 0)
    moved = before - tr.state.body  # first Adam step: lr * g / (|g| + eps), g = wd * theta
    g = 1e-4 * before
    torch.testing.assert_close(moved, 1e-3 * g / (g.abs() + 1e-8), rtol=1e-3, atol=1e-9)


def test_estimate_cosine_with_true_gradient_grows_with_n_pert():
    cfg = ModelConfig(d=8, embed_dim=8)
    g = torch.Generator().manual_seed(0)
    theta, head = init_body(cfg, g), init_head(cfg, g) * 30
    text = torch.tensor(list(b"zero-order training of sharded experts, one shard each. " * 2), dtype=torch.uint8)
    x, y = text[None, :-1], text[None, 1:]
    body = theta.clone().requires_grad_(True)
    copy_losses(cfg, body[None], head, x, y).sum().backward()
    true = body.grad
    mask = Layout(cfg).gain_mask()
    f = lambda bodies: copy_losses(cfg, bodies, head, x, y)  # noqa: E731
    means = []
    for n in (4, 32, 256):
        cos = [
            torch.nn.functional.cosine_similarity(
                spsa_estimate(theta, probes(n, mask, s), 1e-3, f, 64).grad, true, dim=0
            )
            for s in range(6)
        ]
        means.append(float(torch.stack(cos).mean()))
    assert 0 < means[0] < means[1] < means[2], means
    m = Layout(cfg).size  # theory for unit-variance probes: ~ sqrt(n / (n + M))
    assert means[2] > 0.5 * (256 / (256 + m)) ** 0.5, means


def test_packed_experts_match_separate_updates(shards):
    assert_packed_equals_separate([make(s) for s in shards], [make(s) for s in shards])


def test_wide_expert_with_own_head_trains(shards):
    tr = make(shards[2], model=ModelConfig(d=24, embed_dim=16, head="own"), train_head=True)
    head = tr.state.head.clone()
    tr.update()
    assert not torch.equal(tr.state.head, head)


@pytest.mark.parametrize("preset,count", [("paper-small", 271_616), ("paper-n2", 8_406_746), ("paper-n256", 8_437_760)])
def test_preset_parameter_counts(preset, count):
    cfg = resolve(preset)
    assert campaign_param_count(cfg.model, cfg.n_experts) == count
