"""The public inference API (soma_cluster.inference) on a real trained micro campaign: scoring that is exactly soma
eval's loss on a test window, any length and streamed, generation that carries the LSTM state, routing, a partial
campaign's seed fallback, and the docs' examples."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from soma_cluster.campaignfile import load_campaign_config
from soma_cluster.ensemble import evaluate_ensemble, load_models, load_windows
from soma_cluster.errors import SomaError
from soma_cluster.inference.lm import RoutedLM
from soma_cluster.inference.routing import Routes
from soma_cluster.inference.scoring import windows_of
from soma_cluster.router import load_router
from soma_cluster.storage import Store

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def lm(trained_campaign) -> RoutedLM:
    return RoutedLM.load(str(trained_campaign))


def test_a_test_window_scores_exactly_what_soma_eval_gives(trained_campaign, lm):
    store = Store(str(trained_campaign))
    cfg = load_campaign_config(store)
    win = load_windows(store, cfg.eval_windows())
    models = load_models(store, cfg.n_experts)
    experts = {e: (ck.tensors["body"], ck.tensors["head"]) for e, ck in models.checkpoints.items()}
    res = evaluate_ensemble(load_router(store), cfg.model, experts, win, cfg.eval.context_bytes, cfg.eval.batch, CPU)
    ctx = cfg.eval.context_bytes + 1  # prediction i is for byte i + 1: the first scored byte is 257
    windows = [bytes(w) for w in win.data]
    scores = lm.score_many([w[ctx:] for w in windows], prefix=[w[:ctx] for w in windows], per_byte=True)
    for s, want in zip(scores, res.nats, strict=True):
        assert s.scored_bytes == len(want) and np.array_equal(s.per_byte, want)  # bitwise, not close
        assert s.nats == float(want.sum()) and s.windows == 1
    one = lm.score(windows[3][ctx:], prefix=windows[3][:ctx])
    assert one.nats == scores[3].nats  # alone or in a batch: the same number


@pytest.mark.parametrize("n", [0, 1, 2, 255, 256, 1024, 1025, 1026, 1793, 1794, 4000])
def test_every_byte_after_the_first_is_scored_once_at_any_length(lm, n):
    rng = np.random.default_rng(n)
    doc = rng.integers(0, 256, n, dtype=np.uint8).tobytes()  # any bytes: UTF-8 or not, a byte model reads them
    whole = lm.score(doc, per_byte=True)
    assert whole.bytes == n and whole.scored_bytes == max(n - 1, 0) and len(whole.per_byte) == whole.scored_bytes
    expect_windows = 0 if n < 2 else 1 + max(0, -(-(n - lm.window_bytes) // lm.stride))
    assert whole.windows == expect_windows
    streamed = lm.score_stream(doc[i : i + 97] for i in range(0, n, 97))
    assert streamed.nats == whole.nats and streamed.scored_bytes == whole.scored_bytes
    if n:
        assert (
            whole.nats_per_byte is None
            if n == 1
            else abs(whole.bits_per_byte * np.log(2) - whole.nats_per_byte) < 1e-12
        )
    assert np.all(np.isfinite(whole.per_byte)) and np.all(whole.per_byte >= 0)


def test_windows_hold_bounded_memory_and_cover_each_target_once():
    consumed = []

    def source(total: int, chunk: int):
        for a in range(0, total, chunk):
            consumed.append(min(a + chunk, total))
            yield bytes(chunk if a + chunk <= total else total - a)

    for total, chunk, skip in [(10_000, 333, 0), (10_000, 5000, 700), (50, 7, 3), (1025, 1025, 257)]:
        consumed.clear()
        targets = []
        for data, first, start in windows_of(source(total, chunk), 1025, 768, skip):
            assert consumed[-1] <= start + 1025 + chunk  # never reads ahead of the window it yields by a chunk
            targets += [start + i + 1 for i in range(first, len(data) - 1)]
        assert targets == list(range(max(1, skip), total))


def test_generation_samples_the_distribution_scoring_measures(lm):
    prompt = b"The LSTM reads one byte at a time; " * 3
    probs = lm.next_byte_probs(prompt)
    assert abs(probs.sum() - 1) < 1e-5
    for b in (b"T", b" ", b"\xff"):
        s = lm.score(b, prefix=prompt, per_byte=True)
        assert np.isclose(probs[b[0]], np.exp(-s.per_byte[0]), rtol=1e-5)  # the step path and the kernel agree
    text = lm.generate(prompt, max_bytes=64, seed=7)
    assert len(text) == 64 and text == lm.generate(prompt, max_bytes=64, seed=7)
    assert b"".join(lm.stream(prompt, max_bytes=64, seed=7)) == text
    # the state is carried: greedy continuation byte by byte equals the argmax of the distribution after each prefix
    greedy = lm.generate(prompt, max_bytes=6, top_k=1)
    for i in range(6):
        assert greedy[i] == int(np.argmax(lm.next_byte_probs(prompt + greedy[:i])))
    # a batch of prompts of different lengths is each prompt alone (greedy: no randomness to share)
    prompts = [b"", b"x", prompt, "café ünïcode".encode(), bytes(range(256)) * 5]
    batch = lm.generate(prompts, max_bytes=12, top_k=1)
    assert batch == [lm.generate(p, max_bytes=12, top_k=1) for p in prompts]
    assert lm.generate(prompt, max_bytes=0) == b""
    low = lm.generate(prompt, max_bytes=200, temperature=0.05, top_k=3, seed=1)
    assert len(low) == 200


def test_the_forward_is_what_scoring_lmeval_and_generation_read(lm):
    doc = b"The LSTM reads one byte at a time; " * 8  # 280 bytes: one window, routed on its first 256
    (logp,) = lm.forward([doc])
    assert np.array_equal(-logp, lm.score(doc, per_byte=True).per_byte)  # scoring sums the forward, bit for bit
    (dist,) = lm.forward([doc], every_byte=True)  # lm-eval's is_greedy reads these
    assert dist.shape == (len(doc) - 1, 256) and np.allclose(np.exp(dist).sum(axis=1), 1, atol=1e-5)
    assert np.allclose(dist[np.arange(len(doc) - 1), list(doc[1:])], logp, atol=1e-4)  # two paths, one model
    (longer,) = lm.forward([doc + b"x"], every_byte=True)  # generation's recurrent form reads the same mixture
    assert np.allclose(np.exp(longer[-1]), lm.next_byte_probs(doc), rtol=1e-4, atol=1e-7)
    routes = lm.routes([doc])
    swapped = Routes(routes.experts[:, ::-1].copy(), routes.weights[:, ::-1].copy())  # the same mixture, reordered
    assert np.allclose(lm.forward([doc], swapped)[0], logp, atol=1e-6)
    alone = Routes(routes.experts[:, :1], np.ones((1, 1)))  # any route: its first expert alone
    assert not np.allclose(lm.forward([doc], alone)[0], logp)
    assert lm.forward([]) == [] and [x.shape for x in lm.forward([b"", b"a", b"ab"])] == [(0,), (0,), (1,)]
    with pytest.raises(ValueError, match="routes name experts"):
        lm.forward([doc], Routes(np.array([[lm.n_experts, 0]]), np.array([[0.5, 0.5]])))
    with pytest.raises(ValueError, match="1 windows but 2 routes"):
        lm.forward([doc], Routes.concat([routes, routes]))


def test_a_prompt_longer_than_the_context_keeps_its_last_window(lm):
    long = bytes(np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8))
    assert lm.prompt_kept(long) == long[-(lm.window_bytes - 1) :]
    assert lm.generate(long, max_bytes=5, top_k=1) == lm.generate(long[-(lm.window_bytes - 1) :], max_bytes=5, top_k=1)
    assert lm.prompt_kept(b"") == b"\n"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_bytes": -1},
        {"max_bytes": 1.5},
        {"temperature": 0},
        {"temperature": float("nan")},
        {"temperature": float("inf")},
        {"top_k": 0},
        {"top_k": 257},
        {"seed": -1},
        {"top_k": True},
    ],
)
def test_bad_sampling_options_are_one_message(lm, kwargs):
    with pytest.raises(SomaError, match=next(iter(kwargs))):
        lm.generate("x", **{"max_bytes": 4, **kwargs})


def test_route_names_experts_and_weights(lm):
    r = lm.route("def main():\n    return 0\n")
    assert len(r.experts) == 2 and len(set(r.experts)) == 2 and abs(sum(r.weights) - 1) < 1e-9
    assert all(0 <= e < lm.n_experts for e in r.experts) and r.seed_fallback == ()
    assert lm.score("x" * 300).experts == lm.route("x" * 300).experts  # one window: its route
    with pytest.raises(TypeError):
        lm.score(12)


def partial(trained_campaign: Path, dest: Path, expert: str = "expert-0002") -> Path:
    """A copy in which one expert never ran: no checkpoint, no events."""
    shutil.copytree(trained_campaign, dest)
    shutil.rmtree(dest / "experts" / expert)
    events = dest / "events.jsonl"
    events.write_text("".join(line for line in events.read_text().splitlines(True) if f'"{expert}"' not in line))
    return dest


def test_a_partial_campaign_says_which_experts_the_seed_stands_in_for(trained_campaign, tmp_path):
    lm = RoutedLM.load(str(partial(trained_campaign, tmp_path / "p")))
    assert lm.seed_fallback == (2,) and lm.substituted[2].end == "never_launched"
    store = Store(str(trained_campaign))
    docs = [bytes(w) for w in load_windows(store, 64).data]  # the campaign's own test windows: balanced routes
    scores = lm.score_many(docs)
    routed_to_2 = [s for s in scores if 2 in s.experts]
    assert routed_to_2 and all(s.seed_fallback == (2,) for s in routed_to_2)
    assert all(s.seed_fallback == () for s in scores if 2 not in s.experts)
    r = next(lm.route(d) for d in docs if 2 in lm.route(d).experts)
    assert r.seed_fallback == (2,)


def test_load_refuses_what_is_not_a_model(tmp_path, trained_campaign):
    with pytest.raises(SomaError, match="neither a campaign"):
        RoutedLM.load(str(tmp_path))
    with pytest.raises(SomaError, match="device 'tpu'"):
        RoutedLM.load(str(trained_campaign), device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(SomaError, match="CUDA is not available"):
            RoutedLM.load(str(trained_campaign), device="cuda")


def test_the_docs_examples_run(trained_campaign, monkeypatch):
    """Every ```python block of docs/inference.md, with its campaign path pointed at the trained one."""
    text = (Path(__file__).parent.parent / "docs" / "inference.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) >= 3
    for block in blocks:
        if "lm_eval" in block:
            continue  # the optional extra's own test runs it
        code = block.replace('"runs/demo"', json.dumps(str(trained_campaign)))
        exec(compile(code, "docs/inference.md", "exec"), {})
