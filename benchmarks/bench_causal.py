"""What causal scoring (routing rule causal/1, docs/inference.md) costs or gains against the rule before it, on a
campaign's own held-out documents and on local lm-eval tasks made from them, side by side in one run.

"before" is the rule the code had until issue 47: each window routed on its first router.prefix_bytes (256) bytes,
scored ones included (a document's bytes 1..255; a text after a prefix shorter than 256 bytes), run here as a Rule
whose only segment is the whole window (`WindowRule`): the same forward, windows and totals, only the bytes the
router reads differ. "after" is RoutedLM as it is.

Cases, per campaign (a campaign directory, or an export beside --corpus-of):
  - test documents: every held-out document of the campaign (test/documents.json, read back from its corpus) scored
    whole from its first byte, nats/byte over all bytes, over bytes 1..255 (where the rules differ) and from byte
    256 on (where they must agree, bit for bit), and the seconds both took (each the fastest of 5 runs, the two
    rules alternating; lm-eval's seconds are of one run each).
  - soma eval --text: the same documents in soma eval --text's strided windows (documents shorter than a window
    left out, at most eval.eval_windows() windows): before is the ensemble pass alone, after is
    pipelines.evaluate.route_causally over it (what soma eval --text reports now).
  - first bytes (--alternatives): the ways bytes 1..255 of a document's first window could be scored causally,
    each on the same documents: the seed model, the uniform mixture of every expert, the route of byte 0 (a
    1-byte context), routes re-chosen at 1, 2, 4, ..., 128 bytes (causal/1's), re-chosen at every byte; and before.
    And after a context of c = 8, 32, 64, 128 bytes (the documents' first c bytes), bytes 256..1,024 of the window
    under the context's route held (causal/1) against re-routed at byte 256 on the window's first 256 bytes.
  - short documents: the test documents cut into lines (a worst case for causal/1: every line is read in up to 8
    short segments), before and after: nats/byte and seconds.
  - lm-eval (--lmeval, with the lmeval extra): two local tasks written from the test documents, run by the real
    harness as the model "soma" (after) and "soma-window" (before, registered here):
      cloze: multiple choice; a context of 16, 64, 200 or 400 bytes of a test document ending before a word, the
             next word against 3 words from other documents (acc, acc_norm);
      ppl:   loglikelihood_rolling of the test documents (bits_per_byte).
    and, for 24 contexts of 1 to 200 bytes, the sum over all 256 one-byte continuations of their probabilities
    (the largest distance from 1 of each rule: one distribution under one route gives 1 to float32 rounding).

  PYTHONPATH=. python benchmarks/bench_causal.py CAMPAIGN [CAMPAIGN ...] [--alternatives] [--lmeval]
                                                 [--max-docs 200] [--device cpu]

Measurement records (dated runs, their commands and readings): docs/results/benchmarks/bench_causal.md.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import random
import re
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from soma_cluster.corpus import documents
from soma_cluster.ensemble import strided_windows
from soma_cluster.inference.lm import RoutedLM
from soma_cluster.inference.routing import Routes
from soma_cluster.inference.scoring import Kind, Rule, Segment
from soma_cluster.revisions import config_in_force
from soma_cluster.storage import Store

LN2 = math.log(2)
CLOZE_CONTEXTS = (16, 64, 200, 400)


class WindowRule(Rule):
    """The rule before causal/1: a window is one segment, routed on its first prefix_bytes, scored bytes or not."""

    name = "window/0"

    def segments(self, size: int, first: int, start: int = 0, context: bool = False) -> list[Segment]:
        return [Segment(start, start + size, first, min(self.prefix_bytes, size), Kind.WINDOW)]


class BeforeLM(RoutedLM):
    """RoutedLM scoring under WindowRule: the scores the code gave before causal/1."""

    @property
    def rule(self) -> Rule:
        r = self.routing.rule
        return WindowRule(r.window_bytes, r.stride, r.prefix_bytes)


def before(lm: RoutedLM) -> BeforeLM:
    return BeforeLM(lm.config, lm.router, lm.experts, lm.seed, lm.substituted, lm.source, lm.device, lm.steps)


def test_documents(url: str, max_docs: int) -> list[bytes]:
    """The campaign's held-out documents, whole, in corpus order (at most max_docs)."""
    store = Store(url)
    names = {d["name"] for d in json.loads(store.read_bytes("test/documents.json"))["documents"]}
    cfg = config_in_force(store)
    return [d.data for d in documents(cfg.corpus) if d.doc_id in names][:max_docs]


REPEATS = 5  # timed runs of each rule, alternating (the host is shared): the fastest is kept


def timed_pair(after, before) -> tuple[float, object, float, object]:
    """(seconds, result) of after() and of before(), each the fastest of REPEATS runs, the two alternating."""
    best = [math.inf, math.inf]
    outs = [None, None]
    for r in range(REPEATS):
        for i in (0, 1) if r % 2 == 0 else (1, 0):
            t = time.perf_counter()
            outs[i] = (after, before)[i]()
            best[i] = min(best[i], time.perf_counter() - t)
    return best[0], outs[0], best[1], outs[1]


def split_mean(scores, lo: int, hi: int) -> float:
    """nats/byte over the bytes lo..hi-1 of each document (per_byte index j is byte j + 1)."""
    parts = [s.per_byte[max(lo - 1, 0) : max(hi - 1, 0)] for s in scores]
    v = np.concatenate([p for p in parts if len(p)])
    return float(v.mean())


def whole_documents(lm: RoutedLM, old: BeforeLM, docs: list[bytes]) -> list[str]:
    ta, a, tb, b = timed_pair(lambda: lm.score_many(docs, per_byte=True), lambda: old.score_many(docs, per_byte=True))
    same_after = all(np.array_equal(x.per_byte[255:], y.per_byte[255:]) for x, y in zip(a, b, strict=True))
    n = sum(s.scored_bytes for s in a)
    rows = [
        ("all bytes", sum(s.nats for s in b) / n, sum(s.nats for s in a) / n),
        ("bytes 1..255", split_mean(b, 1, 256), split_mean(a, 1, 256)),
        ("bytes 256 on", split_mean(b, 256, 1 << 62), split_mean(a, 256, 1 << 62)),
    ]
    out = [
        f"| test documents ({len(docs)}, {n:,} scored bytes), {name} | {x:.4f} | {y:.4f} | {y - x:+.4f} |"
        for name, x, y in rows
    ]
    out.append(f"| test documents: seconds | {tb:.2f} | {ta:.2f} | {ta / tb:.2f}x |")
    out.append(f"| bytes 256 on: the same bits before and after | {same_after} | | |")
    return out


def text_mode(lm: RoutedLM, docs: list[bytes]) -> list[str]:
    from pipelines.evaluate import route_causally

    cfg = lm.config
    st = strided_windows(docs, cfg.eval.window_bytes, lm.stride, cfg.eval_windows())
    main = lm.routes([bytes(w) for w in st.windows.data])
    rows = [bytes(w) for w in st.windows.data]
    nats = np.stack([-lp for lp in lm.forward(rows, main)])
    mask = st.scored
    was = float(nats[mask].mean())
    route_causally(lm, st, main, nats, [str(i) for i in range(len(docs))])
    now = float(nats[mask].mean())
    what = f"soma eval --text ({len(rows)} windows, {int(mask.sum()):,} bytes)"
    return [f"| {what} | {was:.4f} | {now:.4f} | {now - was:+.4f} |"]


def short_documents(lm: RoutedLM, old: BeforeLM, docs: list[bytes]) -> list[str]:
    lines = [line for d in docs for line in d.split(b"\n") if len(line) >= 2][:4000]
    ta, a, tb, b = timed_pair(lambda: lm.score_many(lines), lambda: old.score_many(lines))
    n = sum(s.scored_bytes for s in a)
    x, y = sum(s.nats for s in b) / n, sum(s.nats for s in a) / n
    return [
        f"| lines of the test documents ({len(lines)}, {n:,} scored bytes) | {x:.4f} | {y:.4f} | {y - x:+.4f} |",
        f"| lines: seconds | {tb:.2f} | {ta:.2f} | {ta / tb:.2f}x |",
    ]


def alternatives(lm: RoutedLM, docs: list[bytes]) -> list[str]:
    """Bytes 1..255 of each document's first window under each causal option, and under the rule before."""
    r = lm.router.cfg.prefix_bytes
    wins = [d[: lm.window_bytes] for d in docs if len(d) > r]
    heads = [w[: r + 1] for w in wins]  # predictions 0..r-1: bytes 1..r
    seed_only = RoutedLM(lm.config, lm.router, {}, lm.seed, device=lm.device)
    n = lm.n_experts

    def under(model: RoutedLM, routes: Routes) -> np.ndarray:
        return np.concatenate([-lp[: r - 1] for lp in model.forward(heads, routes)])

    def rerouted(points: list[int]) -> np.ndarray:
        out = np.zeros((len(heads), r - 1))
        for a, b in zip(points, [*points[1:], r], strict=True):
            rows = lm.forward([h[:b] for h in heads], lm.routing.routes_on([h[:a] for h in heads]))
            for i, lp in enumerate(rows):
                out[i, a - 1 : b - 1] = -lp[a - 1 : b - 1]
        return out.reshape(-1)

    cases = {
        "before (the window's first 256 bytes, scored ones included)": under(lm, lm.routes(heads)),
        "seed model": under(seed_only, lm.routes(heads)),
        f"uniform mixture of all {n} experts": under(
            lm, Routes(np.tile(np.arange(n), (len(heads), 1)), np.full((len(heads), n), 1 / n))
        ),
        "route of byte 0 (a 1-byte context)": under(lm, lm.routing.routes_on([h[:1] for h in heads])),
        "re-routed at 1, 2, 4, ..., 128 (causal/1)": rerouted(lm.rule.points(1)[:-1]),
        "re-routed at every byte": rerouted(list(range(1, r))),
    }
    ref = cases["before (the window's first 256 bytes, scored ones included)"].mean()
    rows = [
        f"| first bytes ({len(heads)} documents): {k} | {ref:.4f} | {v.mean():.4f} | {v.mean() - ref:+.4f} |"
        for k, v in cases.items()
    ]
    return rows + held_context(lm, [d[: lm.window_bytes] for d in docs if len(d) >= lm.window_bytes])


def held_context(lm: RoutedLM, wins: list[bytes]) -> list[str]:
    """Bytes 256..1,024 of a window after a context of c bytes: under the context's route, held for the window
    (causal/1), against re-routed at byte 256 on the window's first 256 bytes (the alternative not taken)."""
    r = lm.router.cfg.prefix_bytes
    rerouted = np.concatenate([-lp[r - 1 :] for lp in lm.forward(wins, lm.routes(wins))])
    rows = []
    for c in (8, 32, 64, 128):
        held = np.concatenate([-lp[r - 1 :] for lp in lm.forward(wins, lm.routing.routes_on([w[:c] for w in wins]))])
        what = f"bytes 256..1,024 after a {c}-byte context ({len(wins)} windows): re-routed at 256 -> held (causal/1)"
        rows.append(f"| {what} | {rerouted.mean():.4f} | {held.mean():.4f} | {held.mean() - rerouted.mean():+.4f} |")
    return rows


# -- lm-eval ---------------------------------------------------------------------------------------------------
def cloze_docs(docs: list[bytes], seed: int = 0) -> list[dict]:
    """Questions: a context of c bytes ending before a word, the word (with its space) against 3 from elsewhere."""
    rng = random.Random(seed)
    texts = [d.decode("utf-8", errors="ignore") for d in docs]
    words = [w for t in texts for w in re.findall(r" [A-Za-z]{3,12}", t)]
    out = []
    for t in texts:
        spots = [m.start() for m in re.finditer(r" [A-Za-z]{3,12}\b", t)]
        for c in CLOZE_CONTEXTS:
            good = [p for p in spots if p >= c]
            if not good or len(words) < 4:
                continue
            p = rng.choice(good)
            word = re.match(r" [A-Za-z]{3,12}", t[p:]).group(0)
            others = rng.sample([w for w in sorted(set(words)) if w != word][:2000], 3)
            choices = [word, *others]
            rng.shuffle(choices)
            out.append({"context": t[p - c : p], "choices": choices, "label": choices.index(word), "c": c})
    return out


@functools.cache
def register_before() -> None:
    """The lm-eval model "soma-window": SomaLM scoring under the rule before causal/1."""
    from lm_eval.api.registry import register_model

    from soma_cluster.inference.lmeval import SomaLM

    @register_model("soma-window")
    class SomaWindowLM(SomaLM):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.lm = before(self.lm)


def lmeval_rows(url: str, lm: RoutedLM, old: BeforeLM, docs: list[bytes], device: str) -> list[str]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    register_before()
    root = Path(tempfile.mkdtemp(prefix="soma-bench-causal-"))
    questions = cloze_docs(docs)
    tasks = {
        "cloze": (
            [{k: q[k] for k in ("context", "choices", "label")} for q in questions],
            {"output_type": "multiple_choice", "doc_to_text": "context", "doc_to_choice": "choices",
             "doc_to_target": "label", "target_delimiter": ""},
            ["acc", "acc_norm"],
        ),
        "ppl": (
            [{"text": d.decode("utf-8", errors="replace")} for d in docs],
            {"output_type": "loglikelihood_rolling", "doc_to_text": "", "doc_to_target": "text"},
            ["bits_per_byte"],
        ),
    }  # fmt: skip
    for name, (rows, spec, metrics) in tasks.items():
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        full = {
            "task": f"bench_{name}",
            "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(data)}, "cache_dir": str(root / "hf")},
            "test_split": "test",
            **spec,
            "metric_list": [{"metric": m, "aggregation": "bits_per_byte" if m == "bits_per_byte" else "mean",
                             "higher_is_better": m != "bits_per_byte"} for m in metrics],
        }  # fmt: skip
        (root / f"bench_{name}.yaml").write_text(json.dumps(full))
    results, seconds = {}, {}
    for model in ("soma-window", "soma"):
        t = time.perf_counter()
        out = lm_eval.simple_evaluate(
            model=model,
            model_args=f"pretrained={url},device={device},batch_size=64",
            tasks=["bench_cloze", "bench_ppl"],
            task_manager=TaskManager(include_path=str(root), include_defaults=False),
            bootstrap_iters=0,
        )
        results[model], seconds[model] = out["results"], time.perf_counter() - t
    rows = []
    for task, metric in (
        ("bench_cloze", "acc,none"),
        ("bench_cloze", "acc_norm,none"),
        ("bench_ppl", "bits_per_byte,none"),
    ):
        x, y = results["soma-window"][task][metric], results["soma"][task][metric]
        n = f"{len(questions)} questions" if "cloze" in task else f"{len(docs)} documents"
        what = f"lm-eval {task.removeprefix('bench_')} ({n}), {metric.split(',')[0]}"
        rows.append(f"| {what} | {x:.4f} | {y:.4f} | {y - x:+.4f} |")
    a, b = seconds["soma-window"], seconds["soma"]
    rows.append(f"| lm-eval: seconds (both tasks) | {a:.1f} | {b:.1f} | {b / a:.2f}x |")
    rows += alphabet_sums(lm, old, docs)
    return rows


def alphabet_sums(lm: RoutedLM, old: BeforeLM, docs: list[bytes]) -> list[str]:
    """The largest |sum - 1| over contexts of the 256 one-byte continuations' probabilities, under each rule."""
    text = b"\n".join(docs)
    rng = np.random.default_rng(0)
    worst = {}
    for name, model in (("before", old), ("after", lm)):
        gap = 0.0
        for _ in range(24):
            n = int(rng.integers(1, 200))
            at = int(rng.integers(0, len(text) - n))
            ctx = text[at : at + n]
            every = model.score_many([bytes([b]) for b in range(256)], prefix=[ctx] * 256)
            gap = max(gap, abs(float(sum(math.exp(-s.nats) for s in every)) - 1))
        worst[name] = gap
    what = "256 one-byte continuations of 24 contexts (1-199 bytes): largest abs(sum p - 1)"
    return [f"| {what} | {worst['before']:.2e} | {worst['after']:.2e} | |"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("campaigns", nargs="+")
    p.add_argument("--max-docs", type=int, default=200)
    p.add_argument("--alternatives", action="store_true", help="also the causal options for the first bytes")
    p.add_argument("--lmeval", action="store_true", help="also the local lm-eval tasks (the lmeval extra)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    for url in args.campaigns:
        lm = RoutedLM.load(url, device=args.device)
        old = before(lm)
        docs = test_documents(url, args.max_docs)
        k = lm.router.cfg.k(lm.n_experts)
        print(
            f"\n{url}: N = {lm.n_experts}, top-{k} ({lm.router.cfg.weighting}), {len(docs)} test documents, "
            f"{sum(map(len, docs)):,} bytes, digest {lm.digest[:12]}, load average {os.getloadavg()[0]:.1f}"
        )
        print("\n| case | before (window/0) | after (causal/1) | after - before |\n|---|---|---|---|")
        rows = whole_documents(lm, old, docs) + text_mode(lm, docs) + short_documents(lm, old, docs)
        if args.alternatives:
            rows += alternatives(lm, docs)
        if args.lmeval:
            rows += lmeval_rows(url, lm, old, docs, args.device)
        for row in rows:
            print(row, flush=True)


if __name__ == "__main__":
    main()
