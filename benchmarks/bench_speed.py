"""Inference at the machine's speed (issue 48): every ratio of its four goals from one run, side by side, on the two
ensembles bench_lm.py builds (N = 256 narrow experts, d = 32, one shared head; N = 8 wide ones, d = 181, own heads;
top-4; a real router fit on the built-in text, random weights).

Sections (--only picks some):
  threads  One stream of --gen-bytes with a busy loop beside it (a process spinning on one core, started and
           stopped here): RoutedLM(threads=None), the default, against each fixed setting 1 .. the CPUs (torch's
           default before, 2 on a 2-core host), alternating, --runs runs each. Per setting the median and the worst
           bytes/s; the goal: the default at >= 0.9 of the best setting, median against median and worst against
           worst.
  batch    generate() of one prompt against a list of 32 (bytes/s in all, prefill included), --repeats alternating,
           each case's fastest; the goal: >= 4x at N = 8 and N = 256.
  serve    `soma serve` on this ensemble (a Ray Serve application on a local cluster started here, the CPU):
           --clients concurrent clients streaming --serve-bytes each from POST /v1/generate, against in-process
           generate([--clients prompts]) of the same bytes; the goal: >= 0.8. The p50 time to first byte and the
           p99 request time are stated. (Needs an export on disk: the ensemble is written as one, float32.)
  score    `soma score`'s path (RoutedLM.score_stream, one document read in chunks) on --score-mb of the built-in
           text, MB/s, against bench_inference.py's kernel (evaluate_ensemble over the test windows, context 256)
           in byte-tokens/s, alternating; the goal: >= 0.9.

  PYTHONPATH=. python benchmarks/bench_speed.py [--only threads,batch,serve,score] [--runs 10] [--repeats 3]
      [--gen-bytes 500] [--fit-chunks 2000] [--clients 20] [--serve-bytes 200] [--score-mb 4] [--intervals 0.05]

Measurement records: docs/results/benchmarks/bench_speed.md (with the load average of each run: the host is shared).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_inference, bench_lm beside this file
from bench_inference import corpus_chunks  # noqa: E402
from bench_lm import ENSEMBLES, build  # noqa: E402

from soma_cluster.ensemble import Windows, evaluate_ensemble  # noqa: E402
from soma_cluster.inference.lm import READ_BYTES, RoutedLM  # noqa: E402
from soma_cluster.inference.threads import cpus  # noqa: E402
from soma_cluster.textsources import builtin_documents  # noqa: E402

SECTIONS = ("threads", "batch", "serve", "score")


class BusyLoop:
    """A process spinning on one core for the duration (the other job of a shared host), stopped by its pid."""

    def __enter__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        time.sleep(0.5)
        return self

    def __exit__(self, *exc):
        self.proc.kill()
        self.proc.wait()


def rate(fn, nbytes: int) -> float:
    t = time.perf_counter()
    fn()
    return nbytes / (time.perf_counter() - t)


def load() -> str:
    return f"{os.getloadavg()[0]:.2f}"


def section_threads(lms: dict[int, RoutedLM], prompts: list[bytes], args) -> None:
    settings = [None, *range(1, cpus() + 1)]
    name = {None: "default (auto)", **{t: f"threads={t}" for t in settings[1:]}}
    print(f"\n## threads: one stream of {args.gen_bytes} B, a busy loop beside it, {args.runs} runs (load {load()})")
    print("\n| ensemble | setting | median B/s | worst B/s |")
    print("|---|---|---|---|")
    verdicts = []
    with BusyLoop():
        for n, lm in lms.items():
            runs = {t: [] for t in settings}
            for r in range(args.runs):
                for t in settings if r % 2 == 0 else settings[::-1]:
                    lm.threads = t
                    runs[t].append(rate(lambda lm=lm: lm.generate(prompts[0], max_bytes=args.gen_bytes, seed=0), 1))
            lm.threads = None
            for t in settings:
                med, worst = float(np.median(runs[t])) * args.gen_bytes, min(runs[t]) * args.gen_bytes
                print(f"| N={n} | {name[t]} | {med:,.0f} | {worst:,.0f} |")
            best_med = max(float(np.median(runs[t])) for t in settings[1:])
            best_worst = max(min(runs[t]) for t in settings[1:])
            verdicts.append(
                f"N={n}: default / best setting {float(np.median(runs[None])) / best_med:.2f} (median), "
                f"{min(runs[None]) / best_worst:.2f} (worst)"
            )
    print("\n" + "; ".join(verdicts) + f" (goal >= 0.9); load average after: {load()}")


def section_batch(lms: dict[int, RoutedLM], prompts: list[bytes], args) -> None:
    print(f"\n## batch: generate() of 1 prompt against 32, {args.gen_bytes} B each (load {load()})")
    print("\n| ensemble | 1 stream B/s | batch of 32 B/s in all | ratio |")
    print("|---|---|---|---|")
    for n, lm in lms.items():
        one, many = [], []
        for _ in range(args.repeats):
            one.append(rate(lambda lm=lm: lm.generate(prompts[0], max_bytes=args.gen_bytes, seed=0), args.gen_bytes))
            many.append(
                rate(lambda lm=lm: lm.generate(prompts[:32], max_bytes=args.gen_bytes, seed=0), 32 * args.gen_bytes)
            )
        print(f"| N={n} | {max(one):,.0f} | {max(many):,.0f} | {max(many) / max(one):.2f}x (goal >= 4x) |")
    print(f"\nload average after: {load()}")


def stream_client(url: str, body: dict) -> tuple[float, float, bytes]:
    """(seconds to the first byte, seconds in all, the bytes) of one streamed POST /v1/generate; 503s retried."""
    t = time.perf_counter()
    for _ in range(100):  # bounded
        req = urllib.request.Request(url + "v1/generate", data=json.dumps(body).encode(), method="POST")
        first, got = None, bytearray()
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                while piece := r.read1(65536):
                    first = time.perf_counter() - t if first is None else first
                    got += piece
            return first, time.perf_counter() - t, bytes(got)
        except urllib.error.HTTPError as exc:
            if exc.code != 503:
                raise
            time.sleep(0.1)
    raise RuntimeError("503 a hundred times")


def section_serve(lms: dict[int, RoutedLM], prompts: list[bytes], args) -> None:
    """soma serve's application (pipelines.serve_app.build) on a local Ray started here, against in-process
    generate() of the same prompts, alternating, --repeats each, the fastest of each kept."""
    from bench_serve import local_serve, write_export
    from ray import serve

    from pipelines.serve_app import build as build_app

    c, nbytes = args.clients, args.serve_bytes
    ps = [prompts[i % len(prompts)] for i in range(c)]
    print(f"\n## serve: {c} concurrent clients, {nbytes} B each, against generate([{c} prompts]) (load {load()})")
    print(f"\n| ensemble | stream_interval_s | in-process B/s | service B/s | ratio | p50 first byte | p99 request | "
          f"{c} requests of 1 B |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    intervals = [float(x) for x in args.intervals.split(",")]
    with local_serve("soma-bench-speed-", cpus(), args.port) as root:
        url = f"http://127.0.0.1:{args.port}/"
        for n, lm in lms.items():
            path = write_export(lm, os.path.join(root, f"n{n}"))
            api_lm = RoutedLM.load(path)
            bodies = [
                {"prompt": base64.b64encode(p).decode(), "encoding": "base64", "max_bytes": nbytes, "seed": i}
                for i, p in enumerate(ps)
            ]
            ones = [{**b, "max_bytes": 1} for b in bodies]  # what the requests cost apart from their bytes
            api, svc = [], {x: [] for x in intervals}
            for _ in range(args.repeats):  # the in-process run and each interval's service, alternating
                for interval in intervals:
                    api.append(rate(lambda api_lm=api_lm: api_lm.generate(ps, max_bytes=nbytes, seed=0), c * nbytes))
                    app = {"source": path, "cpus_per_replica": cpus(), "router_cpus": 0, "max_ongoing_requests": 256,
                           "max_queued_requests": 4096, "stream_interval_s": interval}  # fmt: skip
                    serve.run(build_app(app), name="soma", route_prefix="/")
                    stream_client(url, {"prompt": "warm", "max_bytes": 2, "seed": 0})
                    t = time.perf_counter()
                    with ThreadPoolExecutor(c) as pool:
                        list(pool.map(lambda b: stream_client(url, b), ones))
                    fixed = time.perf_counter() - t
                    t = time.perf_counter()
                    with ThreadPoolExecutor(c) as pool:
                        res = list(pool.map(lambda b: stream_client(url, b), bodies))
                    svc[interval].append((c * nbytes / (time.perf_counter() - t), res, fixed))
                    serve.delete("soma")
            for interval in intervals:
                best_svc, res, fixed = max(svc[interval], key=lambda x: x[0])
                for i in range(min(3, c)):  # a stream is the API's alone, byte for byte
                    want = api_lm.generate(ps[i], max_bytes=nbytes, seed=i)
                    assert res[i][2] == want, f"N={n}: stream {i} differs from the API's"
                first_ms = 1000 * float(np.median([r[0] for r in res]))
                p99_ms = 1000 * float(np.percentile([r[1] for r in res], 99))
                print(
                    f"| N={n} | {interval:g} s | {max(api):,.0f} | {best_svc:,.0f} | {best_svc / max(api):.2f} "
                    f"(goal >= 0.8) | {first_ms:.0f} ms | {p99_ms:.0f} ms | {1000 * fixed:.0f} ms |"
                )
    print(f"\nload average after: {load()}")


def section_score(lms: dict[int, RoutedLM], data: np.ndarray, args) -> None:
    """soma score's path (score_stream over 1 MiB chunks, as `soma score FILE` reads) against the kernel."""
    text = b"".join(d.data for d in builtin_documents(int(args.score_mb * 1e6) + 1))[: int(args.score_mb * 1e6)]
    win = Windows(np.ascontiguousarray(data), np.arange(len(data)))
    print(f"\n## score: soma score's path on {len(text) / 1e6:.1f} MB against the kernel on {len(data)} windows "
          f"(load {load()})")  # fmt: skip
    print("\n| ensemble | kernel byte-tokens/s | soma score MB/s | ratio | soma score / kernel per byte read |")
    print("|---|---|---|---|---|")
    for n, lm in lms.items():
        kern, api = [], []
        for _ in range(args.repeats):
            t = time.perf_counter()
            evaluate_ensemble(lm.router, lm.config.model, lm.experts, win, 256, 128, torch.device("cpu"))
            kern.append(len(data) * 1024 / (time.perf_counter() - t))
            t = time.perf_counter()
            s = lm.score_stream(text[i : i + READ_BYTES] for i in range(0, len(text), READ_BYTES))
            api.append(len(text) / (time.perf_counter() - t))
            assert s.scored_bytes == len(text) - 1
        reads = s.windows * lm.window_bytes / len(text)  # bytes each text byte is read in (windows overlap)
        ratio = max(api) / max(kern)
        print(f"| N={n} | {max(kern):,.0f} | {max(api) / 1e6:.3f} | {ratio:.2f} (goal >= 0.9) | {ratio * reads:.2f} |")
    print(f"\nload average after: {load()}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=",".join(SECTIONS), help=f"sections, comma-separated: {', '.join(SECTIONS)}")
    p.add_argument("--runs", type=int, default=10, help="threads: runs of each setting")
    p.add_argument("--repeats", type=int, default=3, help="batch, score: alternating repeats, the fastest kept")
    p.add_argument("--gen-bytes", type=int, default=500)
    p.add_argument("--fit-chunks", type=int, default=2000)
    p.add_argument("--windows", type=int, default=64, help="score: the kernel's test windows")
    p.add_argument("--clients", type=int, default=20)
    p.add_argument("--serve-bytes", type=int, default=200)
    p.add_argument("--score-mb", type=float, default=4.0)
    p.add_argument("--port", type=int, default=18766)
    p.add_argument("--intervals", default="0.05", help="serve: stream_interval_s values, comma-separated, each a row")
    args = p.parse_args()
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    if bad := sorted(set(only) - set(SECTIONS)):
        p.error(f"--only {bad[0]}: the sections are {', '.join(SECTIONS)}")
    fit, data = corpus_chunks(args.fit_chunks, max(args.windows, 32))
    prompts = [bytes(w[:256]) for w in data[:: max(1, len(data) // 32)][:32]]
    print(
        f"bench_speed: {cpus()} CPUs, torch {torch.__version__} ({torch.get_num_threads()} threads by default), "
        f"{len(fit)} fit chunks; load average {load()}",
        flush=True,
    )
    lms = {n: build(n, d, head, fit, 128) for n, d, head in ENSEMBLES}
    if "threads" in only:
        section_threads(lms, prompts, args)
    if "batch" in only:
        section_batch(lms, prompts, args)
    if "serve" in only:
        section_serve(lms, prompts, args)
    if "score" in only:
        section_score(lms, data[: args.windows], args)
    print(f"\nload average at the end: {load()} (this run counts in it)")


if __name__ == "__main__":
    main()
