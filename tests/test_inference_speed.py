"""Inference at the machine's speed (issue 48), its behaviour only (benchmarks/bench_speed.py has the timings):
threads chosen per op and the caller's put back, generation batched by distinct expert drawing the bytes each prompt
draws alone, and continuous batching (soma_cluster/inference/batching.py) where a stream joining mid-batch or leaving
early gets its own seeded bytes."""

from __future__ import annotations

import os

import pytest
import torch

from soma_cluster.errors import SomaError
from soma_cluster.inference.batching import Batcher
from soma_cluster.inference.generation import GenerationConfig
from soma_cluster.inference.lm import RoutedLM, generator, sample
from soma_cluster.inference.threads import MIN_MACS_PER_THREAD, Threads, auto_threads, checked, cpus, runnable_others

PROMPTS = [b"", b"x", b"Once upon a time", "café ünïcode".encode(), bytes(range(256)) * 5, b"def main():"]


@pytest.fixture(scope="module")
def lm(trained_campaign) -> RoutedLM:
    return RoutedLM.load(str(trained_campaign), device="cpu")


@pytest.fixture
def torch_threads():
    """The test's own torch setting, put back after it."""
    before = torch.get_num_threads()
    yield before
    torch.set_num_threads(before)


# -- threads ---------------------------------------------------------------------------------------------------------
def test_auto_threads_split_only_big_ops_over_free_cores():
    assert auto_threads(MIN_MACS_PER_THREAD - 1, ceiling=64, free=64) == 1  # a decoding step's small ops
    assert auto_threads(16 * MIN_MACS_PER_THREAD, ceiling=64, free=64) == 16
    assert auto_threads(10**12, ceiling=64, free=64) == 64
    assert auto_threads(10**12, ceiling=2, free=1) == 1  # the other core busy: one thread
    assert auto_threads(10**12, ceiling=1, free=64) == 1  # OMP_NUM_THREADS=1 (or the caller's setting) bounds it


def test_the_free_cores_are_read_from_the_host(tmp_path):
    f = tmp_path / "loadavg"
    f.write_text("4.81 3.35 2.35 3/512 6901\n")
    assert runnable_others(str(f)) == 2  # three running, this one of them
    f.write_text("garbage")
    assert runnable_others(str(f)) == 0
    assert runnable_others(str(tmp_path / "absent")) == 0
    assert 1 <= Threads().free_cores() <= cpus() == len(os.sched_getaffinity(0))


@pytest.mark.parametrize("bad", [0, -1, 1025, True, 2.0, "2"])
def test_a_bad_thread_count_is_one_message(bad, lm):
    with pytest.raises(SomaError, match="threads: .* is not a whole number >= 1 and at most 1024"):
        checked(bad)
    with pytest.raises(SomaError, match="threads"):
        RoutedLM.load("/nonexistent", threads=bad)  # refused before anything is read


def test_a_set_count_is_used_up_to_the_cpus(torch_threads):
    assert Threads(1).count(10**12, caller=8) == 1
    assert Threads(64).count(1, caller=1) == cpus()  # 64 on a 2-core host: 2 (more only wait for each other)
    with Threads(1).using(10**12) as n:
        assert n == 1 == torch.get_num_threads()
    assert torch.get_num_threads() == torch_threads


def test_generation_puts_the_callers_threads_back_at_every_byte(lm, torch_threads):
    """Between two bytes of a stream (the caller's code runs there) and after every call, torch has the caller's
    setting; the bytes do not depend on the threads."""
    out = {}
    for setting in (None, 1, 2, 64):
        lm.threads = setting
        for caller in (1, 2):
            torch.set_num_threads(caller)
            got = bytearray()
            for piece in lm.stream(b"Once upon", max_bytes=40, seed=3):
                assert torch.get_num_threads() == caller
                got += piece
            out[setting, caller] = bytes(got)
            lm.generate(PROMPTS, max_bytes=5, seed=1)
            lm.score_many([b"some text to score " * 10])
            lm.forward([b"a window"], every_byte=True)
            assert torch.get_num_threads() == caller
    lm.threads = None
    assert len(set(out.values())) == 1


# -- batched by distinct expert -----------------------------------------------------------------------------------
def alone(lm: RoutedLM, prompts: list[bytes], cfg: GenerationConfig) -> list[bytes]:
    """generate(prompts)'s bytes with each prompt decoded in its own Decoding (its k experts, one row each), the
    batch's rows drawn from one generator in order, as generate() draws them."""
    with torch.no_grad():
        decs = [lm.prefill([lm.prompt_kept(p)]) for p in prompts]
        gen, out = generator(lm.device, cfg.seed), [bytearray() for _ in prompts]
        for n in range(cfg.max_bytes):
            nxt = sample(torch.cat([d.logprobs() for d in decs]), cfg, gen)
            for i, d in enumerate(decs):
                out[i].append(int(nxt[i]))
                if n + 1 < cfg.max_bytes:
                    d.advance(nxt[i : i + 1])
    return [bytes(b) for b in out]


@pytest.mark.parametrize("size", [1, 2, 33])
def test_a_batch_draws_what_each_prompt_draws_alone(lm, size):
    """One copy of each distinct expert with its rows on the batch axis, the prompts prefilled together: the same
    bytes as every prompt decoded on its own, for prompts of every length (empty, 1 byte, past the window)."""
    prompts = (PROMPTS * 6)[:size]
    cfg = GenerationConfig(max_bytes=24, temperature=0.8, seed=11)
    assert lm.generate(prompts, cfg) == alone(lm, prompts, cfg)


def test_a_batch_shares_the_weights_of_an_expert(lm):
    with torch.no_grad():
        d = lm.prefill([lm.prompt_kept(p) for p in PROMPTS * 4])
    rows = len(PROMPTS) * 4 * d.k
    assert len(set(d.units)) <= lm.n_experts + 1  # the distinct experts (and the seed), not one copy per row
    assert len(d.units) * d.batch < 2 * rows + d.batch * len(set(d.units))  # padding under a copy per unit


def test_max_bytes_zero_and_one(lm):
    assert lm.generate(PROMPTS, max_bytes=0) == [b""] * len(PROMPTS)
    assert [len(b) for b in lm.generate(PROMPTS, max_bytes=1, seed=0)] == [1] * len(PROMPTS)
    assert lm.generate([], max_bytes=5) == []


# -- continuous batching ----------------------------------------------------------------------------------------
def test_streams_joining_and_leaving_a_running_batch_draw_their_own_seeded_bytes(lm):
    """Streams join at step boundaries (one at the start, two after 3 steps, one after 10, one routed elsewhere as
    soma serve routes), finish at different lengths, one leaves early (its client gone): each stream's bytes are
    stream()'s for its prompt, seed and route alone."""
    b = Batcher(lm)
    elsewhere = lm.route(b"def main():\n    return 0\n")
    plan = {  # step at which it joins: (prompt, config, route)
        0: [(PROMPTS[2], GenerationConfig(max_bytes=30, seed=1), None)],
        3: [
            (PROMPTS[0], GenerationConfig(max_bytes=5, seed=2), None),
            (PROMPTS[4], GenerationConfig(max_bytes=40, seed=2), None),
        ],
        10: [(PROMPTS[5], GenerationConfig(max_bytes=12, temperature=0.7, top_k=5, seed=3), elsewhere)],
        11: [(PROMPTS[1], GenerationConfig(max_bytes=0, seed=4), None)],
    }
    want, got = {}, {}
    for step in range(60):
        for prompt, cfg, route in plan.get(step, []):
            (key,) = b.join([prompt], [cfg], None if route is None else [route])
            want[key] = b"".join(lm.stream(prompt, cfg, route=route))
            got[key] = bytearray()
        if step == 20:
            b.leave([2, 99])  # the 40-byte stream's client goes away (99: no such stream)
        for key, byte, done in b.step():
            got[key].append(byte)
            assert done == (len(got[key]) == len(want[key]))
    assert not len(b)
    assert got[2] == want[2][:17]  # steps 3 .. 19
    for key in (0, 1, 3, 4):
        assert bytes(got[key]) == want[key], key
