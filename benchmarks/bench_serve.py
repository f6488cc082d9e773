"""soma serve under load: the Serve application against the in-process API, N = 256 against N = 8, in one run.

The two ensembles are bench_lm.py's (a real router fit on the built-in text, random weights: N = 256 narrow experts
d = 32 with one shared head, N = 8 wide ones d = 181 with their own heads, top-4), written as `soma export`
directories (soma_cluster.inference.export.export, float32) and served from them exactly as `soma serve EXPORT` serves
(pipelines.serve_app.build: a router replica and one expert replica) on a local Ray started here, on loopback.

Load: --windows test windows of 1,025 bytes, each a document scored as soma eval scores it (the first 257 bytes as
its prefix, the 768 after it scored: RoutedLM.score(w[257:], prefix=w[:257])); a request carries --docs documents
(`texts` and `prefix` lists, base64: the exact bytes). Clients are threads of this process, each sending its next
request when the last one was answered (a closed loop), over one kept-alive HTTP connection to 127.0.0.1 each; a
503 is retried after its Retry-After and counted. Each level of concurrency (--concurrency) runs every window once
per repeat, the two ensembles alternating. Readings: byte-tokens/s (1,024 predictions read per window, bench_lm.py's
unit), requests/s, p50 and p99 latency of a request.

The API, at the same batch size: RoutedLM.score_many on the same documents in groups of max_batch_windows (the
expert replica's pass) in this process, timed around the call. The goal: service / API >= 0.8 at the highest
concurrency. The service's answers are checked against the API's: the same nats, document by document, to
float32's precision (a pass that holds other requests' windows may round differently; alone, a request's nats are
the API's bit for bit, as tests/test_serve.py checks).

  PYTHONPATH=. python benchmarks/bench_serve.py [--windows 256] [--docs 8] [--concurrency 1,8,32]
                                                [--batch-windows 256] [--repeats 2] [--fit-chunks 8000]

The numbers of a dated run are in docs/results/benchmarks/bench_serve.md.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import http.client
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_inference import corpus_chunks  # noqa: E402
from bench_lm import ENSEMBLES, build  # noqa: E402

from soma_cluster.checkpoint import Checkpoint  # noqa: E402
from soma_cluster.ensemble import CampaignModels  # noqa: E402
from soma_cluster.inference.export import EXPORT_FILE, export  # noqa: E402
from soma_cluster.inference.lm import RoutedLM  # noqa: E402
from soma_cluster.router import save_router  # noqa: E402
from soma_cluster.storage import Store  # noqa: E402

PREFIX = 257  # bytes of a window read as its prefix: the 768 after it are scored, as soma eval scores them


def write_export(lm: RoutedLM, root: str) -> str:
    """The in-memory ensemble as a `soma export` directory (soma_cluster.inference.export.export from a directory
    holding only its router: no ledger, no metrics)."""
    src = Store(os.path.join(root, "src"))
    save_router(src, lm.router)
    step = {"state": {"step": 1}}
    ck = {e: Checkpoint("step-000001", step, {"body": b, "head": h}) for e, (b, h) in lm.experts.items()}
    seed = Checkpoint("step-000000", {"state": {"step": 0}}, {"body": lm.seed[0], "head": lm.seed[1]})
    dest = os.path.join(root, "export")
    try:
        export(src, lm.config, CampaignModels(ck, seed, {}), Store(dest))
    except FileNotFoundError:  # written; then export() sizes the checkpoints it came from, which are in memory here
        pass
    if not Store(dest).exists(EXPORT_FILE):
        raise RuntimeError(f"no export was written to {dest}")
    return dest


@contextlib.contextmanager
def local_serve(prefix: str, num_cpus: int, port: int) -> Iterator[str]:
    """A local Ray (its own temp dir under /tmp, no dashboard, quiet) with Serve's proxy on 127.0.0.1:`port`, and a
    scratch directory (`prefix`) for the exports: yielded, then Serve, Ray and both directories are gone."""
    import ray
    from ray import serve

    root = tempfile.mkdtemp(prefix=prefix)
    tmp_ray = tempfile.mkdtemp(prefix="soma-ray-", dir="/tmp")
    try:
        ray.init(
            num_cpus=num_cpus, include_dashboard=False, _temp_dir=tmp_ray, logging_level="WARNING", log_to_driver=False
        )
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield root
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            shutil.rmtree(root, ignore_errors=True)
            shutil.rmtree(tmp_ray, ignore_errors=True)


def request_bodies(docs: list[tuple[bytes, bytes]], per_request: int) -> list[bytes]:
    """(text, prefix) documents as /v1/score bodies of `per_request` documents each, base64: the exact bytes (a
    window may cut a character)."""
    bodies = []
    for i in range(0, len(docs), per_request):
        group = docs[i : i + per_request]
        b64 = lambda x: base64.b64encode(x).decode()  # noqa: E731
        bodies.append(
            json.dumps(
                {"texts": [b64(t) for t, _ in group], "prefix": [b64(q) for _, q in group], "encoding": "base64"}
            ).encode()
        )
    return bodies


def post(url: str, body: bytes, conn: http.client.HTTPConnection | None = None) -> tuple[float, dict, int]:
    """(seconds, answer, 503s retried) of one request: over `conn` (kept alive by its client) or a fresh connection."""
    t, retried = time.perf_counter(), 0
    parts = urllib.parse.urlsplit(url)
    own = conn is None
    if own:
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=300)
    try:
        for _ in range(100):  # bounded
            conn.request("POST", parts.path, body=body, headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            data = r.read()
            if r.status == 200:
                return time.perf_counter() - t, json.loads(data), retried
            if r.status != 503:
                raise RuntimeError(f"HTTP {r.status}: {data[:300]!r}")
            retried += 1
            time.sleep(float(r.headers.get("Retry-After", "1")) / 10)
        raise RuntimeError("503 a hundred times")
    finally:
        if own:
            conn.close()


def load(url: str, bodies: list[bytes], concurrency: int) -> dict:
    """Every body once, `concurrency` clients in a closed loop -> wall seconds, latencies, answers."""
    lat, answers, retried, lock = [], [None] * len(bodies), [0], threading.Lock()
    nxt = iter(range(len(bodies)))

    def client() -> None:
        parts = urllib.parse.urlsplit(url)
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=300)  # kept alive, as a real client's
        try:
            while True:
                with lock:
                    i = next(nxt, None)
                if i is None:
                    return
                s, out, r = post(url, bodies[i], conn)
                with lock:
                    lat.append(s)
                    answers[i] = out
                    retried[0] += r
        finally:
            conn.close()

    t = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(client) for _ in range(concurrency)]:
            f.result()
    return {"seconds": time.perf_counter() - t, "latency": lat, "answers": answers, "retried": retried[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--windows", type=int, default=256, help="test windows of 1,025 bytes, each a document")
    p.add_argument("--docs", type=int, default=8, help="documents per request")
    p.add_argument("--concurrency", default="1,8,32", help="levels of concurrent clients")
    p.add_argument("--batch-windows", type=int, default=256, help="max_batch_windows, and the API's group size")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--fit-chunks", type=int, default=8000)
    p.add_argument("--port", type=int, default=18765)
    p.add_argument("--device", default="cpu", help="cpu or cuda: the expert replica's device, and the API's")
    args = p.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    from ray import serve

    from pipelines.serve_app import build as build_app

    fit, data = corpus_chunks(args.fit_chunks, args.windows)
    rows = [bytes(w) for w in data]
    docs = [(r[PREFIX:], r[:PREFIX]) for r in rows]
    bodies = request_bodies(docs, args.docs)
    as_sent = docs
    tokens = len(rows) * 1024
    print(
        f"{len(rows)} windows, {len(bodies)} requests of {args.docs} documents, batch {args.batch_windows}, "
        f"concurrency {levels}, {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    with local_serve("soma-bench-serve-", os.cpu_count() or 1, args.port) as root:
        setups = {}
        for n, d, head in ENSEMBLES:
            lm = build(n, d, head, fit, 128)
            path = write_export(lm, os.path.join(root, f"n{n}"))
            api_lm = RoutedLM.load(path, device=args.device)
            setups[n] = (d, path, api_lm)
        url = f"http://127.0.0.1:{args.port}/v1/score"
        runs: dict[tuple[int, str], list[dict]] = {}
        agree: list[float] = []
        for rep in range(args.repeats):
            for n in list(setups) if rep % 2 == 0 else list(setups)[::-1]:
                d, path, api_lm = setups[n]
                serve.run(
                    build_app(
                        {
                            "source": path,
                            "max_batch_windows": args.batch_windows,
                            "batch_wait_s": 0.002,
                            "cpus_per_replica": os.cpu_count(),
                            "router_cpus": 0,
                            "device": args.device,
                            "max_queued_requests": 4096,
                            "max_ongoing_requests": 256,
                        }
                    ),
                    name="soma",
                    route_prefix="/",
                )
                post(url, bodies[0])  # warm: the first pass of each replica
                for c in levels:
                    r = load(url, bodies, c)
                    runs.setdefault((n, f"service, {c} clients"), []).append(r)
                    print(
                        f"  rep {rep}: N={n} service, {c} clients: {r['seconds']:.2f} s, {r['retried']} retried",
                        flush=True,
                    )
                got = [s["nats"] for a in runs[n, f"service, {levels[-1]} clients"][-1]["answers"] for s in a["scores"]]
                t = time.perf_counter()
                want = []
                for i in range(0, len(as_sent), args.batch_windows):
                    group = as_sent[i : i + args.batch_windows]
                    want += [s.nats for s in api_lm.score_many([g[0] for g in group], prefix=[g[1] for g in group])]
                runs.setdefault((n, "API"), []).append({"seconds": time.perf_counter() - t, "latency": []})
                print(f"  rep {rep}: N={n} API: {runs[n, 'API'][-1]['seconds']:.2f} s", flush=True)
                # a pass of other requests' windows beside them may round differently (float32 matmuls over another
                # batch shape): the same nats to float32's precision, not bit for bit
                diff = float(np.max(np.abs(np.array(got) - np.array(want)) / np.abs(np.array(want))))
                agree.append(diff)
                assert diff < 1e-5, f"the service's nats differ from the API's by {diff:.2e} (relative)"
                serve.delete("soma")
        print("\n| case | " + " | ".join(f"N={n}, d={setups[n][0]}" for n in setups) + " | N=256 / N=8 |")
        print("|---|---|---|---|")
        for case in ["API", *(f"service, {c} clients" for c in levels)]:
            cells, best = [], {}
            for n in setups:
                r = min(runs[n, case], key=lambda x: x["seconds"])
                best[n] = r["seconds"]
                text = f"{tokens / r['seconds']:,.0f} byte-tokens/s"
                if r["latency"]:
                    q = np.percentile(r["latency"], [50, 99]) * 1000
                    text += f", {len(bodies) / r['seconds']:.1f} req/s, p50 {q[0]:.0f} ms, p99 {q[1]:.0f} ms"
                cells.append(text)
            a, b = list(setups)
            print(f"| {case} | " + " | ".join(cells) + f" | {best[b] / best[a]:.2f}x |")
        top = f"service, {levels[-1]} clients"
        for n in setups:
            ratio = min(r["seconds"] for r in runs[n, "API"]) / min(r["seconds"] for r in runs[n, top])
            print(f"N={n}: service at {levels[-1]} clients / API throughput = {ratio:.2f} (goal >= 0.8)")
        print(f"service against API: largest relative difference of a document's nats {max(agree):.1e}")
        print(f"device {args.device}; torch threads {torch.get_num_threads()}; load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
