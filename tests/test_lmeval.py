"""EleutherAI's lm-evaluation-harness (the lmeval extra) evaluates a soma ensemble: the real harness on task files
written here (local JSON Lines, nothing downloaded), its numbers checked against RoutedLM's own scores."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

# the harness reads its tasks' data with Hugging Face datasets: local files only, never the Hub
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
os.environ.update(OFFLINE)

pytest.importorskip("lm_eval", reason="the lmeval extra is not installed: pip install 'soma-cluster[lmeval]'")

import numpy as np  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402

from soma_cluster.inference.lm import RoutedLM  # noqa: E402
from soma_cluster.inference.scoring import as_bytes  # noqa: E402

LN256 = math.log(256)
GEN_BYTES = 24
UNTIL = ["\n", "."]
AGGREGATION = {  # lm-eval's defaults for these metrics, stated (else it warns that it fills them in)
    **{m: {"aggregation": "mean", "higher_is_better": True} for m in ("acc", "acc_norm", "acc_mutual_info")},
    "exact_match": {"aggregation": "mean", "higher_is_better": True},
    "word_perplexity": {"aggregation": "weighted_perplexity", "higher_is_better": False},
    "byte_perplexity": {"aggregation": "weighted_perplexity", "higher_is_better": False},
    "bits_per_byte": {"aggregation": "bits_per_byte", "higher_is_better": False},
}


def corpus_text(text_corpus: Path, start: int, n: int) -> str:
    """n bytes or so of real text from the test corpus (whole UTF-8 characters)."""
    data = b"".join(p.read_bytes() for p in sorted(text_corpus.iterdir()))
    text = data[start : start + n].decode("utf-8", errors="ignore")
    assert len(text.encode()) >= n - 3, (start, n, len(data))
    return text


@pytest.fixture(scope="module")
def tasks(tmp_path_factory, text_corpus) -> dict:
    """Three tasks, one per request type: multiple choice (loglikelihood, and the unconditional ("", choice) pairs
    of acc_mutual_info), perplexity (loglikelihood_rolling) and generation (generate_until)."""
    root = tmp_path_factory.mktemp("lmeval-tasks")
    long_ctx = corpus_text(text_corpus, 10_000, 400)  # longer than router.prefix_bytes: routed on the context alone
    docs = {
        "mc": [
            {"question": "The cat sat on the", "choices": ["mat.", "moon.", "idea."], "label": 0},
            {"question": "Paris is the capital of", "choices": ["France.", "the sea.", "Tuesday."], "label": 0},
            {"question": long_ctx, "choices": ["the", "of the", "zzqx"], "label": 1},
        ],
        "ppl": [
            {"text": "A short line of text."},
            {"text": "Café, naïve, Zürich — 東京 and 🙂: bytes of many widths."},
            {"text": "x"},  # a single byte: nothing predicts it, only the first-byte convention scores it
            {"text": corpus_text(text_corpus, 20_000, 3_000)},  # several windows (1,025 bytes at a stride of 768)
        ],
        "gen": [
            {"prompt": "Once upon a time", "answer": " there"},
            {"prompt": long_ctx, "answer": "x"},
        ],
    }
    metrics = {
        "mc": ["acc", "acc_norm", "acc_mutual_info"],
        "ppl": ["word_perplexity", "byte_perplexity", "bits_per_byte"],
        "gen": ["exact_match"],
    }
    specific = {
        "mc": {
            "output_type": "multiple_choice",
            "doc_to_text": "question",
            "doc_to_choice": "choices",
            "doc_to_target": "label",
        },
        "ppl": {"output_type": "loglikelihood_rolling", "doc_to_text": "", "doc_to_target": "text"},
        "gen": {
            "output_type": "generate_until",
            "doc_to_text": "prompt",
            "doc_to_target": "answer",
            "generation_kwargs": {"until": UNTIL, "max_gen_toks": GEN_BYTES, "do_sample": False},
        },
    }
    for name, rows in docs.items():
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
        spec = {
            "task": f"soma_{name}",
            "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(data)}, "cache_dir": str(root / "hf-cache")},
            "test_split": "test",
            **specific[name],
            "metric_list": [{"metric": m, **AGGREGATION[m]} for m in metrics[name]],
        }
        (root / f"soma_{name}.yaml").write_text(json.dumps(spec, ensure_ascii=False, indent=1))  # JSON is YAML
    return {"dir": root, "docs": docs}


@pytest.fixture(scope="module")
def routed(trained_campaign) -> RoutedLM:
    return RoutedLM.load(str(trained_campaign), device="cpu")


@pytest.fixture(scope="module")
def evaluated(trained_campaign, tasks) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    import soma_cluster.inference.lmeval  # noqa: F401  (registers "soma")

    out = lm_eval.simple_evaluate(
        model="soma",
        model_args=f"pretrained={trained_campaign},device=cpu,batch_size=4",
        tasks=["soma_mc", "soma_ppl", "soma_gen"],
        task_manager=TaskManager(include_path=str(tasks["dir"]), include_defaults=False),
        bootstrap_iters=0,
        log_samples=True,
    )
    assert out is not None
    return out


ALPHABET_TASK = """task: soma_alphabet
dataset_path: json
dataset_kwargs:
  data_files: {test: DATA}
  cache_dir: CACHE
test_split: test
output_type: multiple_choice
doc_to_text: question
doc_to_choice: !function alphabet.every_byte
doc_to_target: label
target_delimiter: ""
metric_list:
  - {metric: acc, aggregation: mean, higher_is_better: true}
"""
ALPHABET_CHOICES = """def every_byte(doc):
    # the one-byte continuations lm-eval can hold: the 128 ASCII bytes (its results encode every choice as strict
    # UTF-8, so a lone byte of 0x80 or more is refused there; the test asks the model for those directly)
    return [chr(b) for b in range(128)]
"""


@pytest.fixture(scope="module")
def alphabet(tmp_path_factory, text_corpus, trained_campaign) -> dict:
    """A multiple-choice task whose choices are every byte (a task file, its choices from a function beside it, as
    lm-eval's own tasks write them), evaluated by the real harness: contexts of 1 byte, shorter than
    router.prefix_bytes, of exactly 256 bytes and longer."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    import soma_cluster.inference.lmeval  # noqa: F401

    root = tmp_path_factory.mktemp("lmeval-alphabet")
    questions = [
        "x",
        "The cat sat on the",
        corpus_text(text_corpus, 50_000, 256),
        corpus_text(text_corpus, 60_000, 600),
    ]
    data = root / "alphabet.jsonl"
    data.write_text("".join(json.dumps({"question": q, "label": 0}) + "\n" for q in questions), encoding="utf-8")
    task = ALPHABET_TASK.replace("DATA", json.dumps(str(data))).replace("CACHE", json.dumps(str(root / "hf-cache")))
    (root / "soma_alphabet.yaml").write_text(task)
    (root / "alphabet.py").write_text(ALPHABET_CHOICES)
    out = lm_eval.simple_evaluate(
        model="soma",
        model_args=f"pretrained={trained_campaign},device=cpu,batch_size=256",
        tasks=["soma_alphabet"],
        task_manager=TaskManager(include_path=str(root), include_defaults=False),
        bootstrap_iters=0,
        log_samples=True,
    )
    return {"questions": questions, "out": out}


def expected_bits_per_byte(routed: RoutedLM, texts: list[str]) -> float:
    """Our own: every document's nats plus ln 256 for its unpredicted first byte, over all its bytes."""
    nats = sum(routed.score(t).nats + LN256 for t in texts)
    return nats / sum(len(as_bytes(t)) for t in texts) / math.log(2)


def test_harness_numbers_are_routedlm_scores(evaluated, routed, tasks):
    res = evaluated["results"]
    for task, metric in [("soma_mc", "acc,none"), ("soma_ppl", "bits_per_byte,none"), ("soma_gen", "exact_match,none")]:
        assert math.isfinite(res[task][metric]), (task, res[task])
    assert evaluated["config"]["soma_experts"] == routed.n_experts

    # perplexity: lm-eval's bits_per_byte (its sums over the documents) is ours, every byte counted
    texts = [d["text"] for d in tasks["docs"]["ppl"]]
    bpb = expected_bits_per_byte(routed, texts)
    assert res["soma_ppl"]["bits_per_byte,none"] == pytest.approx(bpb, rel=1e-6)
    assert res["soma_ppl"]["byte_perplexity,none"] == pytest.approx(2**bpb, rel=1e-6)
    rolling = {s["arguments"][0][0]: s["resps"][0][0] for s in evaluated["samples"]["soma_ppl"]}
    assert rolling["x"] == pytest.approx(-LN256, rel=1e-12)  # one byte: the uniform first byte alone

    # multiple choice: each (context, continuation) is RoutedLM.score(continuation, prefix=context); an empty
    # context (acc_mutual_info's unconditional pairs) adds log(1/256) for the continuation's first byte
    pairs = 0
    for sample in evaluated["samples"]["soma_mc"]:
        for (ctx, cont), [(ll, greedy)] in zip(sample["arguments"], sample["resps"], strict=True):
            s = routed.score(cont, prefix=ctx)
            want = -s.nats - (LN256 if not ctx else 0.0)
            assert ll == pytest.approx(want, rel=1e-6, abs=1e-9), (ctx[:40], cont)
            assert isinstance(greedy, bool)
            pairs += 1
    assert pairs == 3 * 3 * 2  # 3 documents x 3 choices, conditional and unconditional

    # generation: greedy bytes (top_k=1), cut at the first stop string, decoded
    for sample in evaluated["samples"]["soma_gen"]:
        ctx, kwargs = sample["arguments"][0]
        assert kwargs["max_gen_toks"] == GEN_BYTES and kwargs["until"] == UNTIL
        raw = routed.generate(ctx, max_bytes=GEN_BYTES, top_k=1, seed=0)
        ends = [i for u in UNTIL if (i := raw.find(u.encode())) >= 0]
        assert sample["resps"][0][0] == raw[: min(ends, default=len(raw))].decode("utf-8", errors="replace")


def greedy_reference(routed: RoutedLM, doc: bytes, p: int) -> int:
    """The most likely byte at offset p of doc as RoutedLM.score predicts it, from next_byte_probs: p is scored in
    the first window (offsets s .. s + window_bytes - 1, s a multiple of the stride) that holds it with a byte
    before it, routed by that window's first prefix_bytes. With p - s >= prefix_bytes, next_byte_probs(doc[s:p])
    reads the same bytes and the same route."""
    s = 0 if p < routed.window_bytes else -(-(p - routed.window_bytes + 1) // routed.stride) * routed.stride
    assert p - s >= routed.router.cfg.prefix_bytes
    return int(np.argmax(routed.next_byte_probs(doc[s:p])))


def test_is_greedy_is_exact(trained_campaign, routed, text_corpus):
    """is_greedy holds for a continuation of greedy bytes, and fails once one byte differs: in one window, where
    the continuation is what greedy generation gives, and across a window boundary. Contexts are longer than
    router.prefix_bytes, so next_byte_probs reads each scored byte's route (see greedy_reference)."""
    from lm_eval.api.registry import get_model

    import soma_cluster.inference.lmeval  # noqa: F401

    model = get_model("soma").create_from_arg_string(f"pretrained={trained_campaign}", {"device": "cpu"})
    ctx = corpus_text(text_corpus, 30_000, 300)
    raw = routed.generate(ctx, max_bytes=12, top_k=1, seed=0)
    long_ctx = corpus_text(text_corpus, 40_000, 1_000)  # its continuation crosses into the second window
    doc = bytearray(long_ctx.encode())
    for p in range(len(doc), routed.window_bytes + 16):
        doc.append(greedy_reference(routed, bytes(doc), p))
    raw_long = bytes(doc[len(long_ctx.encode()) :])
    assert [greedy_reference(routed, ctx.encode() + raw, len(ctx.encode()) + i) for i in range(len(raw))] == list(raw)

    def flip(data: bytes, i: int) -> bytes:
        return data[:i] + bytes([(data[i] + 1) % 256]) + data[i + 1 :]

    cases = [
        (ctx, raw, True),
        (ctx, flip(raw, len(raw) - 1), False),
        (ctx, flip(raw, 0), False),
        (long_ctx, raw_long, True),
        (long_ctx, flip(raw_long, len(raw_long) - 1), False),  # a byte the second window scores
        (ctx, b"", True),
    ]
    requests = [
        Instance("loglikelihood", {}, (c, cont.decode("utf-8", errors="surrogateescape")), i)  # str -> those bytes
        for i, (c, cont, _) in enumerate(cases)
    ]
    out = model.loglikelihood(requests, disable_tqdm=True)
    assert [g for _, g in out] == [want for _, _, want in cases]
    for (c, cont, _), (ll, _) in zip(cases, out, strict=True):
        assert ll == pytest.approx(-routed.score(cont, prefix=c).nats, rel=1e-9, abs=1e-12)
    assert out[-1] == (0.0, True)  # an empty continuation: probability 1


def test_command_line(trained_campaign, tasks, routed, tmp_path):
    """The documented command line: lm-eval's own CLI with the "soma" model registered; model_args' device and
    batch_size win over the defaults it passes (cuda:0, 1)."""
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "soma_cluster.inference.lmeval",
            "--model",
            "soma",
            "--model_args",
            f"pretrained={trained_campaign},device=cpu,batch_size=8",  # beside the CLI's own device and batch_size
            "--tasks",
            "soma_ppl",
            "--include_path",
            str(tasks["dir"]),
            "--output_path",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **OFFLINE},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = out.rglob("results_*.json")
    res = json.loads(path.read_text())["results"]["soma_ppl"]
    texts = [d["text"] for d in tasks["docs"]["ppl"]]
    assert res["bits_per_byte,none"] == pytest.approx(expected_bits_per_byte(routed, texts), rel=1e-6)


def test_without_the_extra_the_import_error_says_how_to_install():
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; sys.modules['lm_eval'] = None; import soma_cluster.inference.lmeval"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError:") and "pip install 'soma-cluster[lmeval]'" in last, proc.stderr[-2000:]


def test_the_choices_of_one_question_are_one_distribution(alphabet, routed, lmeval_model):
    """Every choice of a question is scored under one route, chosen from the context alone: with every byte as a
    choice, their probabilities are one next-byte distribution and sum to 1 (at most 1, to float32 rounding), for
    a context of any length. (Routed on the context plus each choice, as before, they need not.) The harness holds
    the 128 ASCII bytes as choices; the other 128 go to the same model directly, as the str that encodes to them."""
    samples = alphabet["out"]["samples"]["soma_alphabet"]
    assert len(samples) == len(alphabet["questions"])
    for sample in samples:
        ctx = sample["arguments"][0][0]
        ascii_lls = [resp[0][0] for resp in sample["resps"]]
        assert [as_bytes(c) for _, c in sample["arguments"]] == [bytes([b]) for b in range(128)]
        high = [
            Instance("loglikelihood", {}, (ctx, bytes([b]).decode("utf-8", "surrogateescape")), b)
            for b in range(128, 256)
        ]
        lls = np.array(ascii_lls + [ll for ll, _ in lmeval_model.loglikelihood(high, disable_tqdm=True)])
        total = float(np.exp(lls).sum())
        assert float(np.exp(ascii_lls).sum()) < 1 and total <= 1 + 1e-6 and abs(total - 1) < 1e-5, (len(ctx), total)
        assert np.allclose(np.exp(lls), routed.next_byte_probs(ctx), rtol=1e-5, atol=0)  # what generation samples
    config = alphabet["out"]["config"]
    assert config["soma_ensemble_digest"] == routed.digest and config["soma_routing"]["rule"] == "causal/1"


def test_multi_byte_choices_share_the_context_s_route(evaluated, routed):
    """The choices of each question of the mc task (several bytes each) are scored under the one route of their
    context, whatever their bytes: the route generation would fix on that context."""
    for sample in evaluated["samples"]["soma_mc"]:
        ctxs = {ctx for ctx, _ in sample["arguments"] if ctx}
        for ctx in ctxs:
            routes = set()
            for c, cont in sample["arguments"]:
                if c == ctx:
                    s = routed.score(cont, prefix=ctx, routes=True)
                    routes |= {(r.experts, r.weights) for r in s.routes}
            want = routed.routing.prompt_route(as_bytes(ctx))
            assert routes == {(want.experts, want.weights)}, ctx[:40]


@settings(max_examples=12, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(
    ctx=st.binary(max_size=300) | st.sampled_from(["", "Paris is the capital of", "x"]),
    cont=st.binary(min_size=1, max_size=40) | st.sampled_from([" France.", "é日本"]),
)
def test_loglikelihood_is_the_api_s_causal_score(lmeval_model, routed, ctx, cont):
    """lm-eval's loglikelihood is RoutedLM.score's number, bit for bit, for generated contexts and continuations
    (bytes that are not UTF-8 too, as the str that encodes to them): the property test of tests/test_lm.py holds
    behind this door."""
    as_str = [x.decode("utf-8", "surrogateescape") if isinstance(x, bytes) else x for x in (ctx, cont)]
    ((ll, _),) = lmeval_model.loglikelihood([Instance("loglikelihood", {}, tuple(as_str), 0)], disable_tqdm=True)
    s = routed.score(as_str[1], prefix=as_str[0])
    assert ll == 0.0 - s.nats + (-LN256 if not as_bytes(as_str[0]) else 0.0)


@pytest.fixture(scope="module")
def lmeval_model(trained_campaign):
    from lm_eval.api.registry import get_model

    import soma_cluster.inference.lmeval  # noqa: F401

    return get_model("soma").create_from_arg_obj({"pretrained": str(trained_campaign), "device": "cpu"})
