"""The routed-ensemble evaluator: experts packed on the expert axis give what each expert gives alone,
the mixture is the routed average, and the strided long-document mode scores every byte once."""

import numpy as np
import pytest
import torch

from soma_cluster.config import ModelConfig, RouterConfig
from soma_cluster.ensemble import Windows, evaluate_ensemble, packed_logprobs, plan_passes, window_logprobs
from soma_cluster.model import init_body, init_head
from soma_cluster.router import fit_router, router_text
from soma_cluster.textsources import builtin_documents

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def chunks():
    data = b"".join(d.data for d in builtin_documents(400_000))
    return [data[i : i + 1025] for i in range(0, len(data) - 1025, 1025)]


def experts(cfg: ModelConfig, n: int, own_head: bool):
    gen = torch.Generator().manual_seed(7)
    shared = init_head(cfg, gen)
    return {e: (init_body(cfg, gen), init_head(cfg, gen) if own_head else shared) for e in range(n)}


@pytest.mark.parametrize("d,own", [(32, False), (40, True)])
def test_packed_experts_match_each_expert_alone(chunks, d, own):
    cfg = ModelConfig(d=d, head="own" if own else "shared_frozen")
    ex = experts(cfg, 3, own)
    wins = np.frombuffer(b"".join(chunks[:12]), dtype=np.uint8).reshape(3, 4, 1025)[..., :300]
    packed = packed_logprobs(
        cfg, torch.stack([b for b, _ in ex.values()]), torch.stack([h for _, h in ex.values()]), wins, 100, CPU
    )
    for e, (body, head) in ex.items():
        alone = window_logprobs(cfg, body, head, wins[e], 100, 2, CPU)
        np.testing.assert_allclose(packed[e], alone, rtol=0, atol=2e-5)
    assert packed.shape == (3, 4, 199)


def test_ensemble_is_the_routed_average(chunks):
    cfg = ModelConfig(d=32)
    n = 6
    rcfg = RouterConfig(max_features=2000, min_df=2, svd_dim=8, top_k=4)  # a mixture of 4 (the default for 6: 1)
    router, _ = fit_router([router_text(c) for c in chunks], n, rcfg, 0)
    ex = experts(cfg, n, False)
    data = np.frombuffer(b"".join(chunks[:40]), dtype=np.uint8).reshape(40, 1025)[:, :400]
    win = Windows(np.ascontiguousarray(data), np.arange(40) // 4)
    res = evaluate_ensemble(router, cfg, ex, win, 256, 16, CPU)
    texts = [router_text(bytes(w[:256])) for w in win.data]
    top, weights = router.route(router.embed(texts))
    want = np.zeros((40, 400 - 1 - 256))
    for i in range(40):
        for slot, e in enumerate(top[i]):
            want[i] += weights[i, slot] * np.exp(window_logprobs(cfg, *ex[int(e)], win.data[i : i + 1], 256, 1, CPU)[0])
    np.testing.assert_allclose(res.nats, -np.log(want), rtol=0, atol=5e-5)
    assert sum(res.per_expert_windows.values()) == 40 * min(4, n)


@pytest.mark.parametrize(
    "counts,batch",
    [
        ({e: c for e, c in enumerate(np.random.default_rng(0).poisson(16, 256))}, 512),  # N = 256: a dozen windows each
        ({0: 908, 1: 505, 2: 176, 3: 700, 4: 512}, 512),  # N = 8: more than one pass each
        ({0: 3, 1: 1}, 1),
    ],
)
def test_passes_cover_every_window_once_with_little_padding(counts, batch):
    counts = {e: int(c) for e, c in counts.items() if c}
    passes = plan_passes(counts, batch)
    seen = {e: [] for e in counts}
    for units in passes:
        width = units[0][2]
        assert len(units) * width <= batch and all(n <= width for _, _, n in units)
        for e, a, n in units:
            seen[e] += range(a, a + n)
    assert all(sorted(seen[e]) == list(range(counts[e])) for e in counts)
    padded = sum(len(u) * u[0][2] for u in passes)
    assert padded - sum(counts.values()) <= 0.2 * sum(counts.values()) + batch


def test_strided_windows_score_every_byte_once():
    from soma_cluster.ensemble import strided_windows

    docs = [bytes(range(256)) * 10, b"short", bytes(3000)]  # 2,560 and 3,000 bytes, one skipped
    st = strided_windows(docs, 1025, 768, 100)
    assert st.skipped == 1
    assert st.scored.sum() == (2560 - 1) + (3000 - 1)  # every byte but a document's first
    first = [int(np.argmax(row)) for row in st.scored]
    assert first[0] == 0 and first[1] == 256  # then 256 bytes of context, as the paper
    d0 = st.windows.data[st.windows.docs == 0]
    assert bytes(d0[-1]) == docs[0][-1025:]  # the last window ends at the document's end
    with pytest.raises(Exception, match="at least 1025 bytes"):
        strided_windows([b"x" * 10], 1025, 768, 10)


# -- partial campaigns: the seed model stands in for experts without a checkpoint -------------------------
def test_unit_routes_give_a_missing_experts_weight_to_one_seed_unit():
    from soma_cluster.ensemble import SEED_UNIT, unit_routes

    top = np.array([[0, 1, 2], [1, 3, 0], [2, 0, 1], [3, 1, 2]])
    w = np.array([[0.5, 0.3, 0.2], [0.6, 0.3, 0.1], [0.4, 0.4, 0.2], [0.7, 0.2, 0.1]])
    routes = unit_routes(top, w, {0, 2})
    assert sorted(routes) == [SEED_UNIT, 0, 2]
    np.testing.assert_array_equal(routes[0][0], [0, 1, 2])
    np.testing.assert_allclose(routes[0][1], [0.5, 0.1, 0.4])
    np.testing.assert_array_equal(routes[2][0], [0, 2, 3])
    np.testing.assert_allclose(routes[2][1], [0.2, 0.4, 0.1])
    rows, sw = routes[SEED_UNIT]  # each window once, with its missing experts' summed weight
    np.testing.assert_array_equal(rows, [0, 1, 2, 3])
    np.testing.assert_allclose(sw, [0.3, 0.9, 0.2, 0.9])
    for r in range(4):  # the units' weights of a window still sum to its routing weights
        total = sum(float(ws[list(rs).index(r)]) for rs, ws in routes.values() if r in rs)
        assert total == pytest.approx(w[r].sum())
    assert SEED_UNIT not in unit_routes(top, w, {0, 1, 2, 3})
    assert list(unit_routes(top, w, set())) == [SEED_UNIT]  # no expert at all: the seed model alone


@pytest.mark.parametrize("weighting,missing", [("uniform", {1, 4}), ("softmax", {0}), ("uniform", set(range(6)))])
def test_a_missing_expert_is_replaced_by_the_seed_under_the_same_routing(chunks, weighting, missing):
    cfg = ModelConfig(d=32)
    n = 6
    rcfg = RouterConfig(max_features=2000, min_df=2, svd_dim=8, weighting=weighting)
    router, _ = fit_router([router_text(c) for c in chunks], n, rcfg, 0)
    ex = experts(cfg, n, False)
    gen = torch.Generator().manual_seed(99)
    seed = (init_body(cfg, gen), ex[0][1])
    data = np.frombuffer(b"".join(chunks[:40]), dtype=np.uint8).reshape(40, 1025)[:, :400]
    win = Windows(np.ascontiguousarray(data), np.arange(40) // 4)
    present = {e: m for e, m in ex.items() if e not in missing}
    res = evaluate_ensemble(router, cfg, present, win, 256, 16, CPU, seed=seed)
    # the same as a full ensemble whose missing experts ARE the seed model (each scored in its own slot)
    stand_in = evaluate_ensemble(
        router, cfg, {e: ex[e] if e not in missing else seed for e in range(n)}, win, 256, 16, CPU
    )
    np.testing.assert_allclose(res.nats, stand_in.nats, rtol=0, atol=5e-5)
    top, weights = router.route(router.embed([router_text(bytes(w[:256])) for w in win.data]))
    want = np.zeros((40, 400 - 1 - 256))
    for i in range(40):
        for slot, e in enumerate(top[i]):
            model = seed if int(e) in missing else ex[int(e)]
            want[i] += weights[i, slot] * np.exp(window_logprobs(cfg, *model, win.data[i : i + 1], 256, 1, CPU)[0])
    np.testing.assert_allclose(res.nats, -np.log(want), rtol=0, atol=5e-5)
    assert res.seed_windows == int(np.isin(top, list(missing)).any(axis=1).sum()) > 0
    assert res.per_expert_windows == stand_in.per_expert_windows  # windows routed to each expert, missing or not
    with pytest.raises(Exception, match="no seed model"):
        evaluate_ensemble(router, cfg, present, win, 256, 16, CPU)


def test_which_experts_the_seed_stands_in_for():
    from soma_cluster.ensemble import NEVER_LAUNCHED, substitute_for
    from soma_cluster.events import JobHistory
    from soma_cluster.jobs import replay

    def job(*evs):
        h = JobHistory("expert-0001", attempts=1 if any(e["event"] == "queued" for e in evs) else 0, events=list(evs))
        h.state = replay(list(evs))
        h.step = max((e.get("step", 0) for e in evs), default=0)
        return h

    q = {"event": "queued", "attempt": 0}
    assert substitute_for(1, None).end == NEVER_LAUNCHED
    cut = substitute_for(
        1, job(q, {"event": "budget_exhausted", "step": 0, "reason": "budget_exhausted: hard stop past the grace"})
    )
    assert (cut.end, cut.step, cut.reason) == ("budget_exhausted", 0, "budget_exhausted: hard stop past the grace")
    never = substitute_for(1, job({"event": "budget_exhausted", "note": "budget cannot cover a launch"}))
    assert never.end == "budget_exhausted" and never.reason == "budget cannot cover a launch"
    failed = substitute_for(1, job(q, {"event": "failed_permanently", "step": 3, "reason": "exception: NonFiniteLoss"}))
    assert (failed.end, failed.step, failed.reason) == ("failed_permanently", 3, "exception: NonFiniteLoss")
    assert (
        substitute_for(1, job(q, {"event": "started", "step": 0})).end == "running"
    )  # not ended: a live driver, perhaps (its state as soma status shows it)
    assert substitute_for(1, job({"event": "pending"})).end == NEVER_LAUNCHED
    for end in ("finished", "converged"):  # these wrote a checkpoint: its loss is for soma resume, not the seed
        assert substitute_for(1, job(q, {"event": end, "step": 12})) is None
