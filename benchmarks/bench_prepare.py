"""`soma prepare`'s engines side by side on one generated corpus, in one run: the local engine (the driver does
everything), and the Ray engine (Ray Data) with 1 and with 2 CPU workers on a local Ray. Each run is a fresh
process (its own Ray), in turn; reported: wall seconds and MB/s of corpus text, the stages' seconds (from the
shard manifest), peak RSS of the driver process and of the largest Ray worker process, and whether the
campaigns are identical (router, shards, test windows: sha256 of every file).

  PYTHONPATH=. python benchmarks/bench_prepare.py [--gb 1.0] [--experts 16] [--sample 40000] [--repeats 1]

The corpus is bench_clustering's: JSONL files of documents built from random lines of the built-in text.

Measurement records (dated runs, their commands and readings): docs/results/benchmarks/bench_prepare.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)


def _worker_rss(stop: threading.Event, peak: list[float]) -> None:
    """Largest private resident memory (RSS less shared pages: a worker maps the object store's shared memory, which
    RSS would count) of any Ray worker process (named ray::...), every 0.2 s."""
    import psutil

    while not stop.wait(0.2):
        for proc in psutil.process_iter(["name", "cmdline", "memory_info"]):
            try:
                cmd = " ".join(proc.info["cmdline"] or [])
                if cmd.startswith("ray::") and proc.info["memory_info"] is not None:
                    mem = proc.info["memory_info"]
                    peak[0] = max(peak[0], (mem.rss - getattr(mem, "shared", 0)) / 2**20)
            except (psutil.Error, TypeError):
                continue


def one(args) -> None:
    """A single prepare in this process; prints one JSON line."""
    from pipelines.prepare import prepare
    from soma_cluster.config import resolve
    from soma_cluster.storage import Store

    cfg = resolve(
        "tiny",
        {
            "name": "bench-prepare",
            "n_experts": args.experts,
            "corpus": {"source": args.corpus, "max_bytes": 10**13, "test_fraction": 0.001},
            "router": {"sample_chunks": args.sample, "max_features": 50_000, "min_df": 5, "svd_dim": 128},
            "prepare": {"engine": args.engine, "workers": args.workers, "part_bytes": args.part_mb * 10**6},
        },
    )
    stop, peak = threading.Event(), [0.0]
    watcher = threading.Thread(target=_worker_rss, args=(stop, peak), daemon=True)
    watcher.start()
    t = time.perf_counter()
    summary = prepare(Store(args.campaign), cfg)
    wall = time.perf_counter() - t
    stop.set()
    watcher.join()
    print(
        json.dumps(
            {
                "wall": wall,
                "bytes": summary["corpus"]["bytes"],
                "parts": summary["corpus"]["parts"],
                "stages": summary["stage_seconds"],
                "driver_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "worker_rss_mib": peak[0],
                "rows": [min(summary["train_rows"]), max(summary["train_rows"])],
            }
        )
    )


def digests(root: str) -> dict[str, str]:
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            rel = os.path.relpath(os.path.join(dirpath, name), root)
            if rel.startswith("ledger") or name == "campaign.yaml" or rel == os.path.join("shards", "manifest.json"):
                continue
            with open(os.path.join(dirpath, name), "rb") as fh:
                out[rel] = hashlib.sha256(fh.read()).hexdigest()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, default=1.0)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--sample", type=int, default=40_000, help="router.sample_chunks (the paper: 400k)")
    p.add_argument("--part-mb", type=int, default=64, help="prepare.part_bytes in MB")
    p.add_argument("--repeats", type=int, default=1, help="rounds of the three runs (alternating)")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--engine", default="local", help=argparse.SUPPRESS)
    p.add_argument("--workers", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--corpus", help=argparse.SUPPRESS)
    p.add_argument("--campaign", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        one(args)
        return
    from bench_clustering import generate

    tmp = tempfile.mkdtemp(prefix="soma-bench-prepare-", dir="/tmp")
    try:
        corpus = os.path.join(tmp, "corpus")
        os.makedirs(corpus)
        t = time.perf_counter()
        text = generate(corpus, int(args.gb * 1e9), seed=0)
        print(
            f"generated {text / 1e9:.2f} GB of JSONL text in {time.perf_counter() - t:.0f} s",
            file=sys.stderr,
            flush=True,
        )
        arms = [("local", 0), ("ray", 1), ("ray", 2)]
        results: dict[tuple[str, int], list[dict]] = {a: [] for a in arms}
        files = {}
        for r in range(args.repeats):
            for engine, workers in arms:
                camp = os.path.join(tmp, f"camp-{engine}-{workers}")
                shutil.rmtree(camp, ignore_errors=True)
                cmd = [
                    sys.executable,
                    os.path.abspath(__file__),
                    "--one",
                    "--engine",
                    engine,
                    "--workers",
                    str(workers),
                    "--corpus",
                    corpus,
                    "--campaign",
                    camp,
                    "--experts",
                    str(args.experts),
                    "--sample",
                    str(args.sample),
                    "--part-mb",
                    str(args.part_mb),
                ]
                res = subprocess.run(
                    cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.path.dirname(HERE)}
                )
                if res.returncode:
                    sys.exit(f"{engine}/{workers} failed:\n{res.stderr[-3000:]}")
                results[(engine, workers)].append(json.loads(res.stdout.strip().splitlines()[-1]))
                files[(engine, workers)] = digests(camp)
                print(
                    f"round {r}: {engine} {workers or ''} {results[(engine, workers)][-1]['wall']:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )
        same = all(f == files[arms[0]] for f in files.values())
        print(
            f"\n{text / 1e9:.2f} GB JSONL, N = {args.experts}, router sample {args.sample:,}, "
            f"parts of {args.part_mb} MB; "
            f"campaigns identical across engines: {same} ({len(files[arms[0]])} files)\n"
        )
        print(
            "| engine | workers | wall s (median) | MB/s | vs local | vs 1 worker | read | sample | fit | embed "
            "| refit | count | write | driver peak RSS MiB | worker peak private RSS MiB |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        import statistics

        wall = {a: statistics.median(x["wall"] for x in results[a]) for a in arms}
        for a in arms:
            x = results[a][-1]
            st = x["stages"]
            per_worker = f"{wall[('ray', 1)] / wall[a]:.2f}x" if a[0] == "ray" else "-"
            print(
                f"| {a[0]} | {a[1] or '-'} | {wall[a]:.1f} | {x['bytes'] / 1e6 / wall[a]:.1f} | "
                f"{wall[arms[0]] / wall[a]:.2f}x | {per_worker} | "
                + " | ".join(
                    f"{st.get(k, 0):.1f}" for k in ("read", "sample", "fit", "embed", "refit", "count", "write")
                )
                + f" | {max(r['driver_rss_mib'] for r in results[a]):.0f} | "
                f"{max(r['worker_rss_mib'] for r in results[a]):.0f} |"
            )
        pairs = [
            (
                results[arms[0]][r]["wall"] / results[arms[1]][r]["wall"],
                results[arms[1]][r]["wall"] / results[arms[2]][r]["wall"],
            )
            for r in range(args.repeats)
        ]
        print(
            "\n(stage seconds: the last round.) Paired within each round: local / ray 1 worker "
            + ", ".join(f"{p[0]:.2f}" for p in pairs)
            + "; ray 1 / ray 2 workers "
            + ", ".join(f"{p[1]:.2f}" for p in pairs)
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
