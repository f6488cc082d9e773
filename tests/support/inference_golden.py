"""Golden outputs of the inference API on the tests' trained micro campaign (tests/conftest.py `trained`): scores with
and without a prefix (their records too), streamed, routes, next-byte distributions, seeded generations, an export's
weight and router files, soma eval's numbers on the test windows, and the lm-eval model's loglikelihoods and
generations, every float as its exact hex.

tests/test_inference_golden.py compares them, bit for bit, with tests/assets/inference_golden.json. The record was
first made from the code before the inference room (f348811) and made again when scoring became causal (routing
rule causal/1, issue 47): then the scores and the lm-eval loglikelihoods changed where a route had read the bytes it
scored, and nothing else did (routes, next-byte distributions, generations, the export, lm-eval's generations: the
same bits as the f348811 record; soma eval's numbers: the same bits as b5a9fab, the code before the rule, gave). The
campaign's weights are part of the record (`weights_digest`): where the fixture trains other weights (other
training code, another machine's arithmetic), the comparison says so and is skipped.

    PYTHONPATH=. python tests/support/inference_golden.py CAMPAIGN tests/assets/inference_golden.json
"""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

RNG_SEED = 0
PROMPT = b"The LSTM reads one byte at a time; " * 3


def _routed_lm():
    try:
        from soma_cluster.inference.lm import RoutedLM
    except ImportError:  # the code before the move
        from soma_cluster.lm import RoutedLM
    return RoutedLM


def weights_digest(campaign: str | Path) -> str:
    """sha256 over the router's files and every checkpoint's tensors: the weights the goldens belong to."""
    root = Path(campaign)
    files = sorted(
        [*root.glob("router/*"), *root.glob("seed/*.safetensors"), *root.glob("experts/*/*.safetensors")],
        key=lambda p: str(p.relative_to(root)),
    )
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.relative_to(root)).encode() + b"\0" + hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


def _hex(x) -> str | None:
    return None if x is None else float(x).hex()


def _array(a: np.ndarray) -> str:
    return f"{hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()}:{a.dtype}:{a.shape}"


def _score(s) -> dict:
    d = s.as_dict()
    for k in ("nats", "nats_per_byte", "bits_per_byte"):
        d[k] = _hex(d[k])
    if s.per_byte is not None:
        d["per_byte"] = _array(s.per_byte)
    return d


def texts() -> list[bytes]:
    rng = np.random.default_rng(RNG_SEED)
    return [
        b"",
        b"a",
        b"ab",
        "def main():\n    print('hello')\n".encode(),
        "é日本語 text ünïcode ".encode() * 40,
        bytes(rng.integers(0, 256, 3000, dtype=np.uint8)),
        b"x" * 3000,
        bytes(range(256)) * 5,
    ]


def api_outputs(lm) -> dict:
    """Scores, routes, distributions and generations of the Python API."""
    docs, prefixes = texts(), [b"", b"The ", b"q" * 300, "Café ".encode() * 100]
    big = bytes(np.random.default_rng(1).integers(0, 256, 20_000, dtype=np.uint8))
    pairs = [(t, p) for t in docs[2:] for p in prefixes]
    out = {
        "score": [_score(s) for s in lm.score_many(docs, per_byte=True)],
        "score_prefix": [_score(s) for s in lm.score_many([t for t, _ in pairs], [p for _, p in pairs], True)],
        "score_one": _score(lm.score(docs[4], prefix=b"The ")),
        "score_stream": _score(lm.score_stream(big[i : i + 777] for i in range(0, len(big), 777))),
        "route": [lm.route(t).as_dict() for t in docs],
        "next_byte_probs": [_array(lm.next_byte_probs(p)) for p in (b"", b"The ", docs[3], docs[5])],
    }
    gens = {
        "seed7": lm.generate(PROMPT, max_bytes=64, seed=7),
        "sampled": lm.generate(b"def ", max_bytes=120, temperature=0.9, top_k=40, seed=7),
        "greedy": lm.generate(PROMPT, max_bytes=40, top_k=1),
        "cold": lm.generate(PROMPT, max_bytes=100, temperature=0.05, top_k=3, seed=1),
        "hot": lm.generate(PROMPT, max_bytes=100, temperature=5.0, seed=2),
        "tiny_temperature": lm.generate(PROMPT, max_bytes=30, temperature=1e-40, seed=3),
        "empty_prompt": lm.generate(b"", max_bytes=50, seed=4),
        "long_prompt": lm.generate(big[:5000], max_bytes=50, seed=5),
        "stream": b"".join(lm.stream(PROMPT, max_bytes=64, seed=7)),
        "stream_route": b"".join(
            lm.stream(PROMPT, max_bytes=50, temperature=0.8, top_k=20, seed=9, route=lm.route(b"def main():"))
        ),
    }
    batch = [b"", b"x", PROMPT, "café ünïcode".encode(), bytes(range(256)) * 5]
    for i, b in enumerate(lm.generate(batch, max_bytes=30, temperature=0.7, seed=11)):
        gens[f"batch{i}"] = b
    out["generate"] = {k: base64.b64encode(v).decode() for k, v in gens.items()}
    return out


def export_outputs(campaign: str) -> dict:
    """The sha256 of an export's weights and router files, float32 and bfloat16 (the model card and the manifest
    name the campaign's path and the code's version: not compared), written by soma export's own flow. The weights
    are hashed as format 1 wrote them (flat_weights): an export of either format that reads back to the same
    tensors, bit for bit, hashes the same."""
    from pipelines.inference import export_campaign

    out = {}
    with tempfile.TemporaryDirectory(prefix="soma-golden-") as tmp:
        for dtype in ("float32", "bfloat16"):
            dest = Path(tmp) / dtype
            export_campaign(campaign, str(dest), dtype)
            out[dtype] = {
                str(f.relative_to(dest)): hashlib.sha256(
                    flat_weights(dest) if f.name == "weights.safetensors" else f.read_bytes()
                ).hexdigest()
                for f in sorted(dest.rglob("*"))
                if f.is_file() and f.name not in ("README.md", "soma-export.json")
            }
            shutil.rmtree(dest)
    return out


def flat_weights(export: Path) -> bytes:
    """An export's weights, as read back, in format 1's file (soma-cluster before its tensors had names): experts.index,
    experts.body (P, M), experts.head (1 head when all are equal, else P), seed.body, seed.head."""
    import torch
    from safetensors.torch import save

    from soma_cluster.inference.export import read_export
    from soma_cluster.storage import Store

    x = read_export(Store(str(export)))
    present = sorted(x.experts)
    bodies = [x.experts[e][0] for e in present]
    heads = [x.experts[e][1] for e in present]
    shared = all(torch.equal(h, heads[0]) for h in heads)
    tensors = {
        "experts.index": torch.tensor(present, dtype=torch.int64),
        "experts.body": torch.stack(bodies) if bodies else x.seed[0].new_zeros(0, x.seed[0].numel()),
        "experts.head": torch.stack(heads[:1] if shared else heads) if heads else x.seed[1][None],
        "seed.body": x.seed[0],
        "seed.head": x.seed[1],
    }
    return save({k: v.clone().contiguous() for k, v in tensors.items()})


def lmeval_outputs(campaign: str) -> dict:
    """The lm-eval model's three requests on a few cases, called as the harness calls them."""
    from lm_eval.api.instance import Instance
    from lm_eval.api.registry import get_model

    try:
        import soma_cluster.inference.lmeval  # noqa: F401  (registers "soma")
    except ImportError:
        import soma_cluster.lmeval  # noqa: F401

    model = get_model("soma").create_from_arg_obj({"pretrained": campaign, "device": "cpu", "batch_size": 4})
    ctx = "Paris is the capital of"
    long_ctx = "The quick brown fox jumps over the lazy dog. " * 12
    pairs = [(ctx, " France."), (ctx, " the sea."), ("", "France."), (long_ctx, "The"), (long_ctx, "zzqx"), (ctx, "")]
    ll = model.loglikelihood([Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)], disable_tqdm=True)
    rolling_texts = ["A short line of text.", "x", "Café, naïve, Zürich — 東京 and 🙂", long_ctx * 3]
    rolling = model.loglikelihood_rolling(
        [Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(rolling_texts)], disable_tqdm=True
    )
    kwargs = [
        {"until": ["\n", "."], "max_gen_toks": 24, "do_sample": False},
        {"until": ["\n"], "max_gen_toks": 40, "do_sample": True, "temperature": 0.7, "top_k": 20},
        {"until": ["\n"], "max_gen_toks": 16, "do_sample": True, "temperature": 1.3},
    ]
    requests = [(c, k) for c in ("Once upon a time", long_ctx) for k in kwargs] + [("", kwargs[1])]
    gen = model.generate_until(
        [Instance("generate_until", {}, r, i) for i, r in enumerate(requests)], disable_tqdm=True
    )
    return {
        "loglikelihood": [[_hex(v), g] for v, g in ll],
        "loglikelihood_rolling": [_hex(v) for v in rolling],
        "generate_until": gen,
    }


EVAL_TIMES = ("seconds", "ensemble_seconds", "seed_seconds", "routing_time_share", "byte_tokens_per_second")


def _numbers(x):
    """soma eval's metrics without what a clock or a path gives: floats as exact hex."""
    if isinstance(x, dict):
        return {k: _numbers(v) for k, v in x.items() if k not in EVAL_TIMES}
    if isinstance(x, list):
        return [_numbers(v) for v in x]
    return _hex(x) if isinstance(x, float) else x


def eval_outputs(campaign: str | Path) -> dict:
    """soma eval's numbers on the test windows (the protocol: each window routed on its unscored first 256 bytes),
    run on a copy of the campaign (it writes its report there)."""
    from pipelines.evaluate import evaluate
    from soma_cluster.revisions import config_in_force
    from soma_cluster.storage import Store

    keys = ("windows", "documents", "scored_bytes", "ensemble", "seed", "ensemble_minus_seed", "per_expert")
    with tempfile.TemporaryDirectory(prefix="soma-golden-eval-") as tmp:
        copy = Path(tmp) / "c"
        shutil.copytree(campaign, copy, ignore=shutil.ignore_patterns("eval"))
        store = Store(str(copy))
        m = evaluate(store, config_in_force(store))
    more = ("baselines", "top_k_sensitivity", "expert_test_nats", "by_document")
    return _numbers({k: m[k] for k in (*keys, *more)})


def outputs(campaign: str | Path, lmeval: bool = True) -> dict:
    campaign = str(campaign)
    out = {"weights_digest": weights_digest(campaign), **api_outputs(_routed_lm().load(campaign, device="cpu"))}
    out["export"] = export_outputs(campaign)
    out["eval"] = eval_outputs(campaign)
    if lmeval:
        out["lmeval"] = lmeval_outputs(campaign)
    return out


if __name__ == "__main__":
    Path(sys.argv[2]).write_text(json.dumps(outputs(sys.argv[1]), indent=1, sort_keys=True, ensure_ascii=False) + "\n")
    print(f"recorded {sys.argv[2]}", file=sys.stderr)
