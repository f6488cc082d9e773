"""Clustering and sharding: how well the routing rule recovers real topics, what it does at N = 256, and
prepare's throughput at corpus scale. Four parts (`--part`, default quality and campaign):

quality   The built-in corpus (real text on this machine) carries labels: every document comes from one
          source (man pages, package docs, Python sources, licenses, ...), counted by `soma prepare`. Its
          train sequences are packed exactly as prepare packs them, each labelled by the source of the
          document its first byte belongs to. The router's features (TF-IDF -> SVD -> unit vectors) are fit
          once on a sample; then, for each N and on the same sequences and features:
            balanced  balanced k-means whose assignment step is the balanced rule, offsets refit on all
                      sequences (what `soma prepare` does with router.rule balanced)
            nearest   the same centroids, each sequence to its nearest one (router.rule nearest, the paper's)
            k-means   plain k-means on the router's own features (the price of equal shares at equal features)
            c-BTM     the c-BTM recipe: word TF-IDF (router.tokens words) -> SVD -> plain k-means (sklearn KMeans,
                      k-means++, Lloyd) on the sample, nearest centroid for all
            greedy    greedy-balanced spherical k-means (proposal rounds, the router before issue 19) on the word
                      features, its balanced assignment applied to all sequences at once (no per-sequence rule)
            before    the router before issue 19: greedy-balanced k-means centroids, nearest centroid (words)
          Reported: size spread over all sequences (max |size / mean - 1|), NMI against the sources
          (sklearn normalized_mutual_info_score, arithmetic mean), mutual information I(C; S) in nats and
          the cluster entropy H(C) (NMI = 2 I / (H(C) + H(S)): at equal information a balanced clustering,
          H(C) = ln N, scores lower), and for the two rules how often a sequence routed by its first 256
          bytes (as a test window is) has its own shard first / among its top 4 experts. "spread, new half":
          the balanced rule's offsets fitted on every other sequence, the sizes counted on the rest (what
          the tolerance does not cover: text the offsets were not fitted on).
campaign  A tiny campaign per rule and N through the CLI, prepare -> seed -> launch -> eval, experts packed
          in two actors (resources.experts_per_actor = N / 2), few updates; each stage timed, the routed
          ensemble's test loss reported. The nearest arm starts from the balanced arm's seed model and is
          evaluated on the same test windows with `soma eval --compare`: a paired difference. At N = 256 the
          nearest rule leaves experts too small for the tiny preset's shards (prepare refuses, naming the
          expert); that arm runs with shards.min_train_seqs = 1 and shards.val_fraction = 0.05 (one val row
          from 20 sequences on) and is marked.
scale     `soma prepare` on a >= 1 GB JSONL corpus generated from random lines of the built-in text: throughput
          (MB/s), peak RSS (bounded by the sample, not the corpus) and shard sizes.
settle    The balanced rule's offsets fit with and without its exact last step (router._settle), on prepare's fit
          sample and on every sequence: seconds, sizes and how many sequences change shard.

  PYTHONPATH=. python benchmarks/bench_clustering.py [--part quality campaign] [--mb 64] [--experts 16 64 256]
  PYTHONPATH=. python benchmarks/bench_clustering.py --part scale --gb 1.0 --experts 16 [--rule balanced nearest]
  PYTHONPATH=. python benchmarks/bench_clustering.py --part settle --mb 190 --experts 16 256 [--repeats 2]

Measurement records (dated runs, their commands and readings): docs/results/benchmarks/bench_clustering.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from soma_cluster.config import resolve
from soma_cluster.corpus import Packer, is_test_doc
from soma_cluster.parts import row_keys
from soma_cluster.router import (
    TIE_DIMS,
    _l2,
    assign,
    balanced_kmeans,
    cluster_spread,
    fit_offsets,
    fit_router,
    router_text,
)
from soma_cluster.storage import Store
from soma_cluster.textsources import builtin_documents


# -- quality ----------------------------------------------------------------------------------------------
def labelled_sequences(
    max_bytes: int, seq_bytes: int, test_fraction: float, seed: int
) -> tuple[list[bytes], np.ndarray, list[str]]:
    """prepare's train sequences of the built-in corpus and the source of each (its first byte's document)."""
    pack, seqs, labels, doc_source, names = Packer(seq_bytes), [], [], [], {}
    for doc in builtin_documents(max_bytes):
        if is_test_doc(doc.doc_id, test_fraction, seed):
            continue
        doc_source.append(names.setdefault(doc.source, len(names)))
        for seq, owner in pack.add(doc.data):
            seqs.append(seq)
            labels.append(doc_source[owner])
    return seqs, np.array(labels), list(names)


def balanced_assign_greedy(sims: np.ndarray) -> np.ndarray:
    """The router's old balanced assignment (sizes differ by at most one): rounds of proposals, every unassigned
    point to its best cluster with room, a cluster keeping its most similar proposers. Needs all points at once."""
    n, n_clusters = sims.shape
    labels = np.full(n, -1, dtype=np.int64)
    room = np.full(n_clusters, n // n_clusters, dtype=np.int64)
    for _ in range(2):  # second pass places the n mod N leftovers, one per cluster
        while (labels < 0).any() and room.sum() > 0:
            todo = np.flatnonzero(labels < 0)
            s = sims[todo].copy()
            s[:, room == 0] = -np.inf
            best = s.argmax(axis=1)
            order = np.lexsort((-s[np.arange(len(todo)), best], best))
            chosen = best[order]
            rank = np.arange(len(order)) - np.searchsorted(chosen, np.arange(n_clusters))[chosen]
            keep = rank < room[chosen]
            labels[todo[order[keep]]] = chosen[keep]
            room -= np.bincount(chosen[keep], minlength=n_clusters)
        room = np.where(np.bincount(labels[labels >= 0], minlength=n_clusters) > n // n_clusters, 0, 1)
    return labels


def greedy_kmeans(x: np.ndarray, n_clusters: int, iters: int, seed: int) -> np.ndarray:
    from sklearn.cluster import kmeans_plusplus

    centroids = kmeans_plusplus(x.astype(np.float64), n_clusters, random_state=seed)[0].astype(np.float32)
    for _ in range(iters):
        labels = balanced_assign_greedy(x @ centroids.T)
        sums = np.zeros_like(centroids)
        np.add.at(sums, labels, x)
        centroids = _l2(sums).astype(np.float32)
    return centroids


def embed_all(router, chunks: list[bytes], batch: int = 4096) -> np.ndarray:
    return np.concatenate(
        [router.embed([router_text(c) for c in chunks[a : a + batch]]) for a in range(0, len(chunks), batch)]
    )


def scores_of(name: str, labels: np.ndarray, sources: np.ndarray, n_clusters: int, seconds: float) -> dict:
    from scipy.stats import entropy
    from sklearn.metrics import mutual_info_score, normalized_mutual_info_score

    sizes = np.bincount(labels, minlength=n_clusters)
    return {
        "method": name,
        "N": n_clusters,
        "spread": cluster_spread(labels, n_clusters),
        "min": int(sizes.min()),
        "max": int(sizes.max()),
        "nmi": float(normalized_mutual_info_score(sources, labels)),
        "mi": float(mutual_info_score(sources, labels)),
        "h_c": float(entropy(np.bincount(labels))),
        "seconds": seconds,
    }


def prepare_sample(n_seqs: int, size: int, seed: int) -> list[int]:
    """The indices of prepare's router sample, in its order: the `size` sequences of lowest key
    (soma_cluster.parts.row_keys; the built-in corpus is one part)."""
    return np.argsort(row_keys(seed, 0, 0, n_seqs), kind="stable")[:size].tolist()


def methods(
    emb: np.ndarray, words: np.ndarray, sample: list[int], n: int, iters: int, seed: int, router=None
) -> tuple[dict[str, np.ndarray], dict]:
    """Labels of every sequence under each method, k-means seeded with `seed`, and the two rules' (centroids,
    offsets); `router` (prepare's own, for the first seed) gives the balanced k-means centroids and sample
    offsets instead of fitting them here. `emb` are the router's features, `words` the c-BTM recipe's
    (router.tokens words), on which the baselines run."""
    from sklearn.cluster import KMeans

    if router is None:
        centroids, offsets, _ = balanced_kmeans(emb[sample], n, iters, seed)
    else:
        centroids, offsets = router.centroids, router.offsets
    rules = {
        "balanced": (centroids, fit_offsets(emb, centroids, offsets)),  # prepare's refit over all
        "nearest": (centroids, np.zeros(n, np.float32)),
    }
    labels = {name: assign(emb, c, b) for name, (c, b) in rules.items()}

    def kmeans(x: np.ndarray) -> np.ndarray:  # plain k-means fit on the sample, every sequence to its nearest
        return KMeans(n, n_init=1, random_state=seed).fit(x[sample]).predict(x)

    labels["k-means, router features"] = kmeans(_l2(emb[:, :-TIE_DIMS]))  # the router's own features (SVD part)
    plain = _l2(words[:, :-TIE_DIMS])  # the baselines' own recipes: word TF-IDF, the SVD part
    old = greedy_kmeans(plain[sample], n, iters, seed)
    labels["c-BTM k-means"] = kmeans(plain)
    labels["greedy-balanced k-means"] = balanced_assign_greedy(plain @ old.T)
    labels["router before issue 19"] = assign(plain, old, np.zeros(n, np.float32))
    return labels, rules


def routed_corpus(cfg):
    """The built-in corpus's labelled train sequences, prepare's router sample of them (indices and texts), the
    router's features fit on it (TF-IDF and SVD do not depend on N) and every sequence embedded."""
    seqs, sources, names = labelled_sequences(
        cfg.corpus.max_bytes, cfg.shards.seq_bytes, cfg.corpus.test_fraction, cfg.seed
    )
    sample = prepare_sample(len(seqs), cfg.router.sample_chunks, cfg.seed)
    texts = [router_text(seqs[i]) for i in sample]
    features = fit_router(texts, 1, cfg.router, cfg.seed)[0]
    return seqs, sources, names, sample, texts, features, embed_all(features, seqs)


def quality(args, cfg) -> list[dict]:
    """Every method on the same sequences and features. For the first k-means seed the two rules use the
    router `soma prepare` fits (same sample, same seed), so their rows describe the campaigns' own shards;
    NMI is also given as the mean over args.seeds k-means seeds (its spread between seeds is ~0.01)."""
    from sklearn.metrics import normalized_mutual_info_score

    t = time.perf_counter()
    seqs, sources, names, sample, texts, features, emb = routed_corpus(cfg)
    recipe = cfg.router.model_copy(update={"tokens": "words"})
    words = emb if recipe == cfg.router else embed_all(fit_router(texts, 1, recipe, cfg.seed)[0], seqs)
    probe = np.random.default_rng(cfg.seed).choice(len(seqs), min(20_000, len(seqs)), replace=False)
    prefix = embed_all(features, [seqs[i][: cfg.router.prefix_bytes] for i in probe])
    freq = np.bincount(sources) / len(sources)
    print(
        f"{len(seqs):,} sequences from {len(names)} sources ({', '.join(names)}), "
        f"H(S) = {float(-(freq * np.log(freq)).sum()):.3f} "
        f"nats; features fit on {len(sample):,} and every sequence embedded in {time.perf_counter() - t:.0f} s",
        flush=True,
    )
    rows = []
    for n in args.experts:
        t = time.perf_counter()
        router, _ = fit_router(texts, n, cfg.router, cfg.seed)
        labels, rules = methods(emb, words, sample, n, cfg.router.kmeans_iters, cfg.seed, router)
        seconds = time.perf_counter() - t
        half = fit_offsets(
            emb[::2], router.centroids, router.offsets
        )  # out of sample: fit on one half, count the other
        held_out = cluster_spread(assign(emb[1::2], router.centroids, half), n)
        extra = [methods(emb, words, sample, n, cfg.router.kmeans_iters, cfg.seed + s)[0] for s in range(1, args.seeds)]
        for name, lab in labels.items():
            row = scores_of(name, lab, sources, n, seconds)
            row["nmi_seeds"] = [row["nmi"]] + [float(normalized_mutual_info_score(sources, e[name])) for e in extra]
            if name in rules:
                centroids, b = rules[name]
                top = np.argsort(-(prefix @ centroids.T - b), axis=1)[:, : min(4, n)]  # routed by 256 bytes
                own = lab[probe]  # its shard
                row["prefix_top1"], row["prefix_top4"] = (
                    float(np.mean(top[:, 0] == own)),
                    float(np.mean((top == own[:, None]).any(1))),
                )
                row["held_out"] = held_out if name == "balanced" else row["spread"]
            rows.append(row)
            print(
                f"  N={n} {name:24s} spread {row['spread']:.3f} ({row['min']}-{row['max']}) NMI {row['nmi']:.4f} "
                f"(mean over seeds {np.mean(row['nmi_seeds']):.4f}) I {row['mi']:.3f} H(C) {row['h_c']:.3f}",
                flush=True,
            )
    return rows


# -- campaign ---------------------------------------------------------------------------------------------
def run_stage(args: list[str]) -> tuple[float, subprocess.CompletedProcess]:
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled", "COLUMNS": "200"}
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pipelines.cli", *args], capture_output=True, text=True, env=env)
    return time.perf_counter() - t, proc


# the tiny preset made smaller still: 256 experts x 40 updates in two actors on 2 busy cores in minutes; eps = lr
# = 2.5e-3 (the paper's value for its seed and wide controls) so a few updates move the experts off the seed
CAMPAIGN_SETS = [
    "spsa.n_pert=4",
    "spsa.batch=4",
    "spsa.seq_len=128",
    "spsa.pert_chunk=4",
    "spsa.eps=0.0025",
    "spsa.lr=0.0025",
    "train.chunk_updates=5",
    "retry.heartbeat_timeout_s=1800",
]


def share_seed(parent: str, child: str) -> None:
    """The nearest arm starts from the balanced arm's seed model (files and seed events copied, as `soma fork`
    does): the seed is trained on all train sequences either way, and one seed for both rules leaves the
    rule as the only difference between the two ensembles."""
    from soma_cluster.events import LOG

    src, dst = Store(parent), Store(child)
    for rel in src.walk("seed"):
        dst.write_bytes(rel, src.read_bytes(rel))
    for ev in src.read_log(LOG):
        if ev["job"] == "seed":
            dst.append(LOG, {k: v for k, v in ev.items() if k != "checksum"})


def arm(root: str, rule: str, n: int, args, parent: str | None) -> dict:
    sets = [
        f"corpus.max_bytes={int(args.mb * 1e6)}",
        f"router.rule={rule}",
        f"router.tokens={args.tokens}",
        f"resources.experts_per_actor={max(1, n // 2)}",
        *CAMPAIGN_SETS,
        f"seed_stage.updates={2 * args.updates}",
        f"train.updates={args.updates}",
        f"train.checkpoint_every={args.updates}",
        f"train.val_every={args.updates}",
    ]
    camp, row = os.path.join(root, f"{rule}-{n}"), {"rule": rule, "N": n, "relaxed": False}
    secs, proc = run_stage(["prepare", camp, "-n", str(n), *sum((["--set", s] for s in sets), [])])
    if proc.returncode != 0:
        row["refused"] = proc.stderr.strip().splitlines()[-1]
        print(f"  {rule} N={n}: {row['refused']}", flush=True)
        shutil.rmtree(camp, ignore_errors=True)
        sets += ["shards.min_train_seqs=1", "shards.val_fraction=0.05"]
        row["relaxed"] = True
        secs, proc = run_stage(["prepare", camp, "-n", str(n), *sum((["--set", s] for s in sets), [])])
    row["prepare_s"], row["seed_s"] = secs, 0.0
    stages = [["seed", camp, "--no-progress"]] if parent is None else []
    stages += [["launch", camp, "--no-progress"], ["eval", camp] + (["--compare", parent] if parent else [])]
    if parent is not None and proc.returncode == 0:
        share_seed(parent, camp)
    for stage in stages:
        if proc.returncode != 0:
            raise SystemExit(f"{rule} N={n}: {proc.stderr[-2000:]}")
        secs, proc = run_stage(stage)
        row[f"{stage[0]}_s"] = secs
    with open(os.path.join(camp, "eval", "metrics.json")) as f:
        m = json.load(f)
    with open(os.path.join(camp, "shards", "manifest.json")) as f:
        manifest = json.load(f)
    row.update(
        test=m["ensemble"]["nats_per_byte"],
        ci=m["ensemble"]["ci95"],
        seed_loss=m["seed"]["nats_per_byte"],
        minus_seed=m["ensemble_minus_seed"]["nats_per_byte"],
        spread=manifest["assigned_size_spread"],
        rows=[min(manifest["train_rows"]), max(manifest["train_rows"])],
        minus_balanced=m.get("compare", {}).get("this_minus_other"),
    )
    print(
        f"  {rule} N={n}: test {row['test']:.4f} (seed {row['seed_loss']:.4f}), shards {row['rows']} train rows; "
        f"prepare {row['prepare_s']:.0f} s, seed {row['seed_s']:.0f} s, launch {row['launch_s']:.0f} s, "
        f"eval {row['eval_s']:.0f} s",
        flush=True,
    )
    return row


def campaign(args, root: str) -> list[dict]:
    rows = []
    for n in args.experts:
        rows.append(arm(root, "balanced", n, args, None))
        if not args.balanced_only:
            rows.append(arm(root, "nearest", n, args, os.path.join(root, f"balanced-{n}")))
        shutil.rmtree(os.path.join(root, f"balanced-{n}"), ignore_errors=True)
        shutil.rmtree(os.path.join(root, f"nearest-{n}"), ignore_errors=True)
    return rows


def paired(c: dict) -> str:
    d = c.get("minus_balanced")
    return f"{d['nats_per_byte']:+.4f} [{d['ci95'][0]:+.4f}, {d['ci95'][1]:+.4f}]" if d else "-"


def print_tables(quality_rows: list[dict], campaign_rows: list[dict]) -> None:
    loss = {(r["rule"], r["N"]): r for r in campaign_rows}
    print(
        "\n| N | method | spread (min-max) | spread, new half | NMI | NMI, seeds: mean (min-max) | I(C;S) nats "
        "| H(C) | prefix: own shard 1st / in top 4 | test nats/byte [95% CI] |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in quality_rows:
        c = loss.get((r["method"], r["N"]))
        test = f"{c['test']:.4f} [{c['ci'][0]:.4f}, {c['ci'][1]:.4f}]{' *' if c['relaxed'] else ''}" if c else "-"
        pre = f"{r['prefix_top1']:.1%} / {r['prefix_top4']:.1%}" if "prefix_top1" in r else "-"
        held = f"{r['held_out']:.3f}" if "held_out" in r else "-"
        seeds = f"{np.mean(r['nmi_seeds']):.4f} ({min(r['nmi_seeds']):.4f}-{max(r['nmi_seeds']):.4f})"
        print(
            f"| {r['N']} | {r['method']} | {r['spread']:.3f} ({r['min']}-{r['max']}) | {held} | "
            f"{r['nmi']:.4f} | {seeds} | {r['mi']:.3f} | {r['h_c']:.3f} | {pre} | {test} |"
        )
    if campaign_rows:
        print(
            "\n| rule | N | shard train rows min-max | prepare s | seed s | launch s | eval s | total s "
            "| test nats/byte | seed model | ensemble - seed | nearest - balanced, paired [95% CI] |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for c in campaign_rows:
            total = c["prepare_s"] + c["seed_s"] + c["launch_s"] + c["eval_s"]
            seed = f"{c['seed_s']:.0f}" if c["seed_s"] else "shared"
            print(
                f"| {c['rule']}{' *' if c['relaxed'] else ''} | {c['N']} | {c['rows'][0]}-{c['rows'][1]} | "
                f"{c['prepare_s']:.0f} | {seed} | {c['launch_s']:.0f} | {c['eval_s']:.0f} | {total:.0f} | "
                f"{c['test']:.4f} | {c['seed_loss']:.4f} | {c['minus_seed']:+.4f} | {paired(c)} |"
            )
        for c in campaign_rows:
            if c.get("refused"):
                print(f"* {c['rule']} N={c['N']} at the preset's shard settings: {c['refused']}")


# -- scale ------------------------------------------------------------------------------------------------
def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def generate(root: str, total_bytes: int, seed: int) -> int:
    """JSONL files of documents built from random lines of the built-in real text; returns bytes of text."""
    lines = [
        ln for doc in builtin_documents(8_000_000) for ln in router_text(doc.data).splitlines() if len(ln.strip()) > 20
    ]
    rng = random.Random(seed)
    written, f = 0, 0
    while written < total_bytes:
        with open(os.path.join(root, f"part-{f:04d}.jsonl"), "w") as fh:
            for _ in range(4000):
                size, doc = rng.randint(2048, 16384), []
                n = 0
                while n < size:
                    ln = lines[rng.randrange(len(lines))]
                    doc.append(ln)
                    n += len(ln) + 1
                text = "\n".join(doc)
                fh.write(json.dumps({"text": text}) + "\n")
                written += len(text)
        f += 1
    return written


def settle(args, cfg) -> None:
    """The offsets fit with and without its exact last step (router._settle), side by side on the same router
    and rows: prepare's fit sample (every cluster at once) and its refit over every sequence (candidate
    clusters past router.DENSE_ENTRIES). Alternating repeats, the fastest of each kept."""
    _, _, _, sample, texts, _, emb = routed_corpus(cfg)
    print(
        "\n| N | rows | Newton only: s | sizes (excess over the shares) | with the settling step: s | sizes (excess) "
        "| rows moved |"
    )
    print("|---|---|---|---|---|---|---|")
    for n in args.experts:
        router, _ = fit_router(texts, n, cfg.router, cfg.seed)
        for what, x in [("fit sample", emb[sample]), ("all sequences", emb)]:
            runs: dict[bool, list] = {False: [], True: []}
            for flag in [False, True] * args.repeats:
                t = time.perf_counter()
                offsets = fit_offsets(x, router.centroids, router.offsets, settle=flag)
                runs[flag].append((time.perf_counter() - t, offsets))
            cells, labels = [], []
            for flag in (False, True):
                seconds, offsets = min(runs[flag], key=lambda r: r[0])
                labels.append(assign(x, router.centroids, offsets))
                sizes = np.bincount(labels[-1], minlength=n)
                excess = int(np.maximum(sizes - -(-len(x) // n), 0).sum())
                cells.append(f"{seconds:.2f} | {sizes.min()}-{sizes.max()} ({excess})")
            print(
                f"| {n} | {what}, {len(x):,} | {cells[0]} | {cells[1]} | {int(np.sum(labels[0] != labels[1]))} |",
                flush=True,
            )


def scale(args, tmp: str) -> None:
    corpus = os.path.join(tmp, "corpus")
    os.makedirs(corpus)
    t = time.perf_counter()
    text_bytes = generate(corpus, int(args.gb * 1e9), seed=0)
    rss_before = peak_rss_mib()
    print(
        f"generated {text_bytes / 1e9:.2f} GB of text in {time.perf_counter() - t:.0f} s; "
        f"peak RSS so far {rss_before:.0f} MiB",
        flush=True,
    )
    for n, rule in [(n, rule) for n in args.experts for rule in args.rule]:
        cfg = resolve(
            "tiny",
            {
                "name": "bench-cluster",
                "n_experts": n,
                "corpus": {"source": corpus, "max_bytes": text_bytes + 1, "test_fraction": 0.001},
                "router": {
                    "sample_chunks": args.sample,
                    "max_features": 50_000,
                    "min_df": 5,
                    "svd_dim": 128,
                    "rule": rule,
                },
            },
        )
        from pipelines.prepare import prepare

        store = Store(os.path.join(tmp, f"campaign-{rule}-{n}"))
        t = time.perf_counter()
        summary = prepare(store, cfg)
        wall = time.perf_counter() - t
        rows = summary["train_rows"]
        print(
            "\n| corpus | experts | rule | router sample | prepare wall s | MB/s | peak RSS MiB | shard rows min/max "
            "| spread |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        print(
            f"| {summary['corpus']['bytes'] / 1e9:.2f} GB JSONL, {summary['corpus']['documents']:,} docs | {n} | "
            f"{rule} | {args.sample:,} chunks | {wall:.0f} | {summary['corpus']['bytes'] / 1e6 / wall:.1f} | "
            f"{peak_rss_mib():.0f} | {min(rows):,}/{max(rows):,} | {summary['assigned_size_spread']:.3f} |"
        )
        print(f"(peak RSS before prepare, from generating the corpus: {rss_before:.0f} MiB)")
        shutil.rmtree(store.url, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--part", nargs="+", default=["quality", "campaign"], choices=["quality", "campaign", "scale", "settle"]
    )
    p.add_argument("--experts", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--mb", type=float, default=64.0, help="built-in corpus MB for quality and campaign")
    p.add_argument("--seeds", type=int, default=3, help="quality: k-means seeds the NMI is averaged over")
    p.add_argument(
        "--updates", type=int, default=40, help="updates per expert in the tiny campaigns (the seed: twice that)"
    )
    p.add_argument("--gb", type=float, default=1.0, help="scale: generated corpus size")
    p.add_argument("--sample", type=int, default=40_000, help="scale: router.sample_chunks (the paper: 400k)")
    p.add_argument("--balanced-only", action="store_true", help="campaign: skip the nearest arm")
    p.add_argument(
        "--tokens",
        default="layout",
        choices=["words", "layout"],
        help="quality and campaign: router.tokens (the quality baselines use words)",
    )
    p.add_argument("--repeats", type=int, default=2, help="settle: alternating repeats of each fit")
    p.add_argument(
        "--rule", nargs="+", default=["balanced"], choices=["balanced", "nearest"], help="scale: router.rule(s)"
    )
    args = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="soma-bench-cluster-", dir="/tmp")
    try:
        if "scale" in args.part:
            scale(args, tmp)
        cfg = resolve("tiny", {"corpus": {"max_bytes": int(args.mb * 1e6)}, "router": {"tokens": args.tokens}})
        if "settle" in args.part:
            settle(args, cfg)
        q = quality(args, cfg) if "quality" in args.part else []
        c = campaign(args, tmp) if "campaign" in args.part else []
        if q or c:
            print_tables(q, c)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
