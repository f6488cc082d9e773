"""The routed-ensemble evaluator: experts packed on the expert axis give what each expert gives alone,
the mixture is the routed average, and the strided long-document mode scores every byte once."""
import numpy as np
import pytest
import torch

from soma_cluster.config import ModelConfig, RouterConfig
from soma_cluster.corpus import builtin_documents
from soma_cluster.ensemble import Windows, evaluate_ensemble, packed_logprobs, plan_passes, window_logprobs
from soma_cluster.model import init_body, init_head
from soma_cluster.router import fit_router, router_text

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def chunks():
    data = b"".join(d.data for d in builtin_documents(400_000))
    return [data[i:i + 1025] for i in range(0, len(data) - 1025, 1025)]


def experts(cfg: ModelConfig, n: int, own_head: bool):
    gen = torch.Generator().manual_seed(7)
    shared = init_head(cfg, gen)
    return {e: (init_body(cfg, gen), init_head(cfg, gen) if own_head else shared) for e in range(n)}


@pytest.mark.parametrize("d,own", [(32, False), (40, True)])
def test_packed_experts_match_each_expert_alone(chunks, d, own):
    cfg = ModelConfig(d=d, head="own" if own else "shared_frozen")
    ex = experts(cfg, 3, own)
    wins = np.frombuffer(b"".join(chunks[:12]), dtype=np.uint8).reshape(3, 4, 1025)[..., :300]
    packed = packed_logprobs(cfg, torch.stack([b for b, _ in ex.values()]), torch.stack([h for _, h in ex.values()]), wins, 100, CPU)
    for e, (body, head) in ex.items():
        alone = window_logprobs(cfg, body, head, wins[e], 100, 2, CPU)
        np.testing.assert_allclose(packed[e], alone, rtol=0, atol=2e-5)
    assert packed.shape == (3, 4, 199)


def test_ensemble_is_the_routed_average(chunks):
    cfg = ModelConfig(d=32)
    n = 6
    router, _ = fit_router([router_text(c) for c in chunks], n, RouterConfig(max_features=2000, min_df=2, svd_dim=8), 0)
    ex = experts(cfg, n, False)
    data = np.frombuffer(b"".join(chunks[:40]), dtype=np.uint8).reshape(40, 1025)[:, :400]
    win = Windows(np.ascontiguousarray(data), np.arange(40) // 4)
    res = evaluate_ensemble(router, cfg, ex, win, 256, 16, CPU)
    texts = [router_text(bytes(w[:256])) for w in win.data]
    top, weights = router.route(router.embed(texts))
    want = np.zeros((40, 400 - 1 - 256))
    for i in range(40):
        for slot, e in enumerate(top[i]):
            want[i] += weights[i, slot] * np.exp(window_logprobs(cfg, *ex[int(e)], win.data[i:i + 1], 256, 1, CPU)[0])
    np.testing.assert_allclose(res.nats, -np.log(want), rtol=0, atol=5e-5)
    assert sum(res.per_expert_windows.values()) == 40 * min(4, n)


@pytest.mark.parametrize("counts,batch", [
    ({e: c for e, c in enumerate(np.random.default_rng(0).poisson(16, 256))}, 512),    # N = 256: a dozen windows each
    ({0: 908, 1: 505, 2: 176, 3: 700, 4: 512}, 512),                                  # N = 8: more than one pass each
    ({0: 3, 1: 1}, 1),
])
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
    docs = [bytes(range(256)) * 10, b"short", bytes(3000)]          # 2,560 and 3,000 bytes, one skipped
    st = strided_windows(docs, 1025, 768, 100)
    assert st.skipped == 1
    assert st.scored.sum() == (2560 - 1) + (3000 - 1)                # every byte but a document's first
    first = [int(np.argmax(row)) for row in st.scored]
    assert first[0] == 0 and first[1] == 256                         # then 256 bytes of context, as the paper
    d0 = st.windows.data[st.windows.docs == 0]
    assert bytes(d0[-1]) == docs[0][-1025:]                          # the last window ends at the document's end
    with pytest.raises(Exception, match="at least 1025 bytes"):
        strided_windows([b"x" * 10], 1025, 768, 10)
