"""Placement of the experts under Ray Serve: every replica holds every expert (soma serve's application) against
multiplexing (`@serve.multiplexed`, a group of experts per model id, loaded on demand with Serve's LRU), measured.

Issue 38 asks for the experts served in batches, each replica holding the experts it serves, by whichever placement
measures better. Two arms, on the same ensembles, documents, load generator and CPUs:

  - all experts: pipelines.serve_app.build as benchmarks/bench_serve.py deploys it (SomaRouter ingress + SomaExperts),
    with --replicas expert replicas, each holding every expert and scoring the windows of many requests in one
    pass (@serve.batch batches coalesced by pipelines.serve_app.Passes; RoutedLM.window_nats).
  - multiplexed G:M: the experts cut into G groups of contiguous ids (N/G each); an expert deployment SomaGroups
    (--replicas replicas) whose multiplexed model id is a group's number, and whose loader (serve.multiplexed with
    max_num_models_per_replica=M) reads that group's weights from a safetensors file of its own and builds a
    RoutedLM of those experts only, each load logged with its seconds (the table's loads are those of the timed
    run; the warm-up's are printed apart). The ingress MuxRouter checks the request with
    soma_cluster.inference.serveinput.parse_score, cuts documents into soma eval's windows (Routing.cut), routes each
    window (lm.Routing) exactly as SomaRouter does, then sends each window to every group holding one of its top-k
    experts (one call per group per request, handle.options(multiplexed_model_id=group)). The group replica scores
    in @serve.batch batches (Serve splits a batch by model id) coalesced into one pass at a time, as SomaExperts's
    (pipelines.serve_app.Passes; each group's pairs through its model): each (window, expert) pair is a row of
    RoutedLM.window_nats routed to that expert alone with weight 1, whose nats are -log(exp(log p)) = -log p, and
    it sends back each pair's per-byte log-probability as float32 (the kernel's own precision: the value comes
    back bit for bit). The router mixes them as ensemble.evaluate_ensemble does: p = sum_k w_k exp(log p_k) in
    float64, nats = -log(max(p, 1e-300)), then totals each document with scoring.Cut.scores. A pass of the
    group replica holds up to k x --batch-windows pairs, the expert-rows of an all-experts pass of --batch-windows
    windows.

With R replicas and M < G a replica cannot hold every group (and with R x M < G the replicas together cannot
either): groups are loaded on demand and evicted. With M = G every replica can hold every group: after the first
loads, multiplexing costs only its fan-out (k calls instead of one, per-byte log-probabilities crossing the handle,
smaller passes). Defaults: G:M 8:2 (on demand), 8:4 (R x M = G: Serve's model-aware routing may settle each group
on one replica), 8:8 (every group fits).

Ensembles, documents and load are benchmarks/bench_serve.py's (imported: its export writer, request bodies, closed
loop HTTP clients on 127.0.0.1, a 503 retried after its Retry-After): bench_lm.py's N = 256 (d = 32, shared head)
and N = 8 (d = 181, own heads), top-4, random weights, a real router; --windows test windows of 1,025 bytes, each a
document scored as soma eval scores it (a 257-byte prefix, 768 scored bytes), --docs documents a request. Each
arm is deployed fresh per repeat, warmed with one request, and runs every window once at each --concurrency; the
arms alternate over --repeats (reversed on odd repeats) and each case's fastest repeat is reported (its loads are
those of that run). Each replica has --cpus / --replicas CPUs (default: all of this host's), the router 0.
Correctness: every arm's nats at the highest concurrency are checked against the in-process API's
(RoutedLM.score_many in groups of --batch-windows), document by document, to float32's precision (relative 1e-5),
and the largest difference is printed. The API's own throughput is printed for reference.

  PYTHONPATH=. python benchmarks/bench_serve_placement.py [--ensembles 256,8] [--multiplex 8:2,8:4,8:8]
      [--replicas 2] [--windows 256] [--docs 8] [--concurrency 1,8,32] [--batch-windows 256] [--repeats 2]
      [--fit-chunks 8000] [--device cpu]

A smoke run (2.5 minutes on a loaded 2-core host, most of it Ray and Serve starting): --ensembles 256,8
--multiplex 8:2,8:8 --windows 16 --docs 4 --concurrency 1,4 --repeats 1 --fit-chunks 1000.
"""

import argparse
import asyncio
import os
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.serve.handle import DeploymentHandle
from safetensors.torch import load_file, save_file

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_inference import corpus_chunks  # noqa: E402
from bench_lm import ENSEMBLES, build  # noqa: E402
from bench_serve import PREFIX, load, local_serve, post, request_bodies, write_export  # noqa: E402

from pipelines.serve_app import Passes, _error, _read_body  # noqa: E402
from soma_cluster.corpus import shown  # noqa: E402
from soma_cluster.inference.lm import RoutedLM  # noqa: E402
from soma_cluster.inference.routing import Routes, Routing  # noqa: E402
from soma_cluster.inference.scoring import Cut  # noqa: E402
from soma_cluster.inference.serveinput import RequestError, Status, parse_score, settings  # noqa: E402


@dataclass
class GroupJob:
    """One request's work for one group: the windows it needs there, and its (window, expert) pairs."""

    group: str
    windows: list[bytes]
    firsts: list[int]
    rows: np.ndarray  # per pair: its window, an index into `windows`
    experts: np.ndarray  # per pair: the expert (of this group) that scores it


def _pairs_in(jobs: list[GroupJob]) -> int:
    return sum(len(j.rows) for j in jobs)


def group_file(root: str, g: int | str) -> str:
    return os.path.join(root, f"group-{g}.safetensors")


def write_groups(lm: RoutedLM, groups: list[np.ndarray], root: str) -> None:
    """Each group's experts (their bodies, and their heads or the one shared head) in a file of its own, and the
    seed model's: a group replica reads only the groups it loads."""
    os.makedirs(root, exist_ok=True)
    for g, members in enumerate(groups):
        bodies = torch.stack([lm.experts[int(e)][0] for e in members]).contiguous()
        heads = [lm.experts[int(e)][1] for e in members]
        shared = all(h is heads[0] for h in heads)
        head = (heads[0][None] if shared else torch.stack(heads)).clone().contiguous()
        index = torch.as_tensor(members, dtype=torch.int64)
        save_file({"index": index, "body": bodies, "head": head}, group_file(root, g))
    seed = {"body": lm.seed[0].clone().contiguous(), "head": lm.seed[1].clone().contiguous()}
    save_file(seed, group_file(root, "seed"))


@serve.deployment(name="SomaGroups", health_check_period_s=5, health_check_timeout_s=30)
class SomaGroups:
    """Expert replicas of the multiplexed arm: the groups of experts a replica was asked for, at most M at a time
    (Serve's LRU), each scoring its (window, expert) pairs in batched passes."""

    def __init__(self, args: dict):
        routing = Routing.load(args["source"])  # the config and router (the RoutedLM needs both), no expert weights
        self.config, self.router = routing.config, routing.router
        self.dir, self.log, self.device = args["groups_dir"], args["load_log"], args["device"]
        seed = load_file(group_file(self.dir, "seed"))
        self.seed = (seed["body"], seed["head"])

        async def load_group(group: str) -> RoutedLM:
            return await asyncio.to_thread(self._load, group)

        # M from the args: the instance-attribute form of @serve.multiplexed (Serve detects it on the instance)
        self.get_group = serve.multiplexed(max_num_models_per_replica=args["max_groups"])(load_group)
        self._batched.set_max_batch_size(args["max_batch_pairs"])
        self.passes = Passes(self._run, args["max_batch_pairs"], lambda items: _pairs_in([j for _, j in items]))
        self._batched.set_batch_wait_timeout_s(args["batch_wait_s"])

    def _load(self, group: str) -> RoutedLM:
        t = time.perf_counter()
        w = load_file(group_file(self.dir, int(group)))
        heads = w["head"]
        experts = {int(e): (w["body"][i], heads[i if len(heads) > 1 else 0]) for i, e in enumerate(w["index"].tolist())}
        lm = RoutedLM(self.config, self.router, experts, self.seed, device=self.device)
        with open(self.log, "a") as f:  # one short line, appended: atomic between replicas
            f.write(f"{os.getpid()} {group} {time.perf_counter() - t:.4f}\n")
        return lm

    async def score(self, job: GroupJob) -> list[np.ndarray]:
        return await self._batched(job)

    # as the application's SomaExperts: Serve's batches (split by model id) queue for one pass at a time, which
    # takes every queued batch, of any group, each with the group model it was given (held against Serve's LRU)
    @serve.batch(max_batch_size=1024, batch_wait_timeout_s=0.005, batch_size_fn=_pairs_in, max_concurrent_batches=4096)
    async def _batched(self, jobs: list[GroupJob]) -> list[list[np.ndarray]]:
        models = {g: await self.get_group(g) for g in dict.fromkeys(j.group for j in jobs)}
        return await self.passes.submit([(models[j.group], j) for j in jobs])

    def _run(self, items: list[tuple[RoutedLM, GroupJob]]) -> list[list[np.ndarray]]:
        """One pass: each group's pairs together, through that group's model."""
        out: list = [None] * len(items)
        for group in dict.fromkeys(j.group for _, j in items):
            mine = [i for i, (_, j) in enumerate(items) if j.group == group]
            for i, lp in zip(mine, self._pass(items[mine[0]][0], [items[i][1] for i in mine]), strict=True):
                out[i] = lp
        return out

    @staticmethod
    def _pass(lm: RoutedLM, jobs: list[GroupJob]) -> list[list[np.ndarray]]:
        """One pass over every pair of the jobs, each pair its window routed to its expert alone (weight 1): the
        mixture of one is that expert, nats = -log p -> per pair, the float32 log p of each scored byte."""
        windows = [j.windows[r] for j in jobs for r in j.rows]
        firsts = [j.firsts[r] for j in jobs for r in j.rows]
        top = np.concatenate([j.experts for j in jobs])[:, None]
        nats = lm.window_nats(windows, firsts, Routes(top, np.ones(top.shape)))
        out, at = [], 0
        for j in jobs:
            out.append([(-n).astype(np.float32) for n in nats[at : at + len(j.rows)]])
            at += len(j.rows)
        return out


mux_api = FastAPI(title="soma, multiplexed (benchmark)")


@serve.deployment(name="MuxRouter", health_check_period_s=5)
@serve.ingress(mux_api)
class MuxRouter:
    """The ingress of the multiplexed arm: SomaRouter's checks, windows and routes; a call per group a request's
    windows are routed into; the experts' log-probabilities mixed with the routes' weights."""

    def __init__(self, groups: DeploymentHandle, args: dict):
        self.cfg = settings(args["serve"])
        self.routing = Routing.load(self.cfg.source)
        self.group_of = np.asarray(args["group_of"], dtype=np.int64)  # expert -> its group
        self.groups = {g: groups.options(multiplexed_model_id=str(g)) for g in np.unique(self.group_of).tolist()}

    @mux_api.post("/v1/score")
    async def score(self, request: Request) -> Response:
        try:
            req = parse_score(await _read_body(request, self.cfg.max_request_bytes), self.cfg)
            if req.per_byte or req.routes:
                raise RequestError(Status.INVALID, "per_byte and routes: not in this benchmark", "per_byte")
            scores = await self._score(req.docs, req.prefixes)
        except RequestError as exc:
            return _error(exc, self.cfg.retry_after_s)
        return JSONResponse({"source": shown(self.routing.source), "scores": scores})

    async def _score(self, docs: list[bytes], pre: list[bytes]) -> list[dict]:
        cut = self.routing.cut(docs, pre)
        routes = await asyncio.to_thread(self.routing.routes_on, cut.heads)
        cut, rows = cut.merged(routes.experts, routes.weights)
        routes = routes.take(rows)
        windows, firsts = cut.windows, cut.firsts
        top, weights = routes.experts, routes.weights
        where = self.group_of[top]  # (n, k): the group of each routed expert
        calls, pairs = [], []
        for g in np.unique(where).tolist():
            rows, slots = np.nonzero(where == g)
            need, local = np.unique(rows, return_inverse=True)
            job = GroupJob(str(g), [windows[r] for r in need], [firsts[r] for r in need], local, top[rows, slots])
            calls.append(self.groups[g].score.remote(job))
            pairs.append((rows, slots))
        answers = await asyncio.gather(*calls)
        return await asyncio.to_thread(self._mix, cut, top, weights, pairs, answers)

    @staticmethod
    def _mix(cut: Cut, top, weights, pairs, answers) -> list[dict]:
        """p = sum_k w_k exp(log p_k) per scored byte (float64, as evaluate_ensemble), nats = -log p, per document."""
        prob = [np.zeros(len(w) - 1 - f) for w, f in zip(cut.windows, cut.firsts, strict=True)]
        for (rows, slots), lps in zip(pairs, answers, strict=True):
            for r, s, lp in zip(rows, slots, lps, strict=True):
                prob[r] += weights[r, s] * np.exp(lp.astype(np.float64))
        totals = [(float(n.sum()), len(n)) for n in (-np.log(np.maximum(p, 1e-300)) for p in prob)]
        scores = cut.scores(top, weights, totals, (), False)  # every expert has weights here: no seed fallback
        return [s.as_dict() for s in scores]


def mux_app(path: str, groups_dir: str, group_of: np.ndarray, m: int, log: str, a: argparse.Namespace, cpus: float):
    common = {"max_ongoing_requests": 256, "max_queued_requests": 4096}
    top_k = Routing.load(path).router.cfg.top_k
    groups = SomaGroups.options(num_replicas=a.replicas, ray_actor_options={"num_cpus": cpus}, **common).bind(
        {
            "source": path,
            "groups_dir": groups_dir,
            "load_log": log,
            "device": a.device,
            "max_groups": m,
            "max_batch_pairs": top_k * a.batch_windows,
            "batch_wait_s": 0.002,
        }
    )
    serve_args = {"source": path, "max_batch_windows": a.batch_windows, "device": a.device}
    return MuxRouter.options(num_replicas=1, ray_actor_options={"num_cpus": 0}, **common).bind(
        groups, {"serve": serve_args, "group_of": group_of.tolist()}
    )


def all_app(path: str, a: argparse.Namespace, cpus: float):
    from pipelines.serve_app import build as build_app

    return build_app(
        {
            "source": path,
            "replicas": a.replicas,
            "max_batch_windows": a.batch_windows,
            "batch_wait_s": 0.002,
            "cpus_per_replica": cpus,
            "router_cpus": 0,
            "device": a.device,
            "max_queued_requests": 4096,
            "max_ongoing_requests": 256,
        }
    )


def loads_in(path: str) -> list[float]:
    """The seconds of each group load logged so far (none for the all-experts arm)."""
    try:
        with open(path) as f:
            return [float(line.split()[2]) for line in f]
    except FileNotFoundError:
        return []


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ensembles", default="256,8", help="N of bench_lm.py's ensembles to run (256, 8 or both)")
    p.add_argument("--multiplex", default="8:2,8:4,8:8", help="multiplexed arms, G:M each (groups : groups/replica)")
    p.add_argument("--replicas", type=int, default=2, help="expert replicas of each arm")
    p.add_argument("--cpus", type=float, default=float(os.cpu_count() or 1), help="CPUs shared by the replicas")
    p.add_argument("--windows", type=int, default=256, help="test windows of 1,025 bytes, each a document")
    p.add_argument("--docs", type=int, default=8, help="documents per request")
    p.add_argument("--concurrency", default="1,8,32", help="levels of concurrent clients")
    p.add_argument("--batch-windows", type=int, default=256, help="max_batch_windows, and the API's group size")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--fit-chunks", type=int, default=8000)
    p.add_argument("--port", type=int, default=18766)
    p.add_argument("--device", default="cpu", help="cpu or cuda: the expert replicas' device, and the API's")
    a = p.parse_args()
    levels = [int(c) for c in a.concurrency.split(",")]
    wanted = [int(n) for n in a.ensembles.split(",")]
    ensembles = [e for e in ENSEMBLES if e[0] in wanted]
    mux = [tuple(int(x) for x in s.split(":")) for s in a.multiplex.split(",") if s]
    if not ensembles or any(g < 1 or m < 1 for g, m in mux):
        p.error("--ensembles: 256 and/or 8; --multiplex: G:M pairs of positive numbers")
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    cpus = a.cpus / a.replicas
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # the replicas import this module (its deployments) by name: benchmarks/ on their path, as on ours
    os.environ["PYTHONPATH"] = os.pathsep.join(x for x in (HERE, os.environ.get("PYTHONPATH", "")) if x)
    import bench_serve_placement as me  # the deployments by module name, not __main__'s copies

    fit, data = corpus_chunks(a.fit_chunks, a.windows)
    rows = [bytes(w) for w in data]
    docs = [(r[PREFIX:], r[:PREFIX]) for r in rows]
    bodies = request_bodies(docs, a.docs)
    tokens = len(rows) * 1024
    arms = ["all experts", *(f"multiplexed {g}:{m}" for g, m in mux)]
    print(
        f"{len(rows)} windows, {len(bodies)} requests of {a.docs} documents, batch {a.batch_windows}, concurrency "
        f"{levels}, {a.replicas} replicas of {cpus:g} CPUs, arms {arms}; {os.cpu_count()} CPUs here, load average "
        f"{os.getloadavg()[0]:.2f}",
        flush=True,
    )
    with local_serve("soma-bench-place-", max(os.cpu_count() or 1, int(np.ceil(a.cpus))), a.port) as root:
        url = f"http://127.0.0.1:{a.port}/v1/score"
        setups, runs, agree, api = {}, {}, {}, {}
        for n, d, head in ensembles:
            lm = build(n, d, head, fit, 128)
            path = write_export(lm, os.path.join(root, f"n{n}"))
            for g, _ in mux:
                members = np.array_split(np.arange(n), g)
                write_groups(lm, members, os.path.join(root, f"n{n}", f"groups-{g}"))
            setups[n] = (d, path, RoutedLM.load(path, device=a.device))
        for rep in range(a.repeats):
            for n in setups:
                d, path, api_lm = setups[n]
                t, want = time.perf_counter(), []
                for i in range(0, len(docs), a.batch_windows):
                    group = docs[i : i + a.batch_windows]
                    want += [s.nats for s in api_lm.score_many([g[0] for g in group], prefix=[g[1] for g in group])]
                runs.setdefault((n, "API", 0), []).append({"seconds": time.perf_counter() - t, "latency": []})
                api[n] = np.array(want)
                for arm in arms if rep % 2 == 0 else arms[::-1]:
                    log = os.path.join(root, f"loads-{n}-{rep}-{arm.split()[-1].replace(':', '-')}.log")
                    if arm == "all experts":
                        app = all_app(path, a, cpus)
                    else:
                        g, m = (int(x) for x in arm.split()[-1].split(":"))
                        group_of = np.repeat(np.arange(g), [len(x) for x in np.array_split(np.arange(n), g)])
                        app = me.mux_app(path, os.path.join(root, f"n{n}", f"groups-{g}"), group_of, m, log, a, cpus)
                    serve.run(app, name="soma", route_prefix="/")
                    post(url, bodies[0])  # warm: a first pass (and, multiplexed, the first loads)
                    print(f"  rep {rep}: N={n} {arm}, warm-up: {len(loads_in(log))} loads", flush=True)
                    for c in levels:
                        before = len(loads_in(log))
                        r = load(url, bodies, c)
                        r["loads"] = loads_in(log)[before:]
                        runs.setdefault((n, arm, c), []).append(r)
                        print(
                            f"  rep {rep}: N={n} {arm}, {c} clients: {r['seconds']:.2f} s, {len(r['loads'])} loads, "
                            f"{r['retried']} retried",
                            flush=True,
                        )
                    got = np.array([s["nats"] for x in runs[n, arm, levels[-1]][-1]["answers"] for s in x["scores"]])
                    diff = float(np.max(np.abs(got - api[n]) / np.abs(api[n])))
                    agree[n, arm] = max(diff, agree.get((n, arm), 0.0))
                    assert diff < 1e-5, f"N={n} {arm}: nats differ from the API's by {diff:.2e} (relative)"
                    serve.delete("soma")
        print("\n| arm | clients | " + " | ".join(f"N={n}, d={setups[n][0]}" for n in setups) + " |")
        print("|---|---|" + "---|" * len(setups))
        best = {}
        for arm, c in [("API", 0), *((arm, c) for arm in arms for c in levels)]:
            cells = []
            for n in setups:
                r = min(runs[n, arm, c], key=lambda x: x["seconds"])
                best[n, arm, c] = r["seconds"]
                text = f"{tokens / r['seconds']:,.0f} byte-tokens/s"
                if r["latency"]:
                    q = np.percentile(r["latency"], [50, 99]) * 1000
                    text += f", {len(bodies) / r['seconds']:.1f} req/s, p50 {q[0]:.0f} ms, p99 {q[1]:.0f} ms"
                    if arm == "all experts":
                        text += ", 0 loads (all at start)"
                    else:
                        ms = f" of {1000 * np.mean(r['loads']):.1f} ms" if r["loads"] else ""
                        text += f", {len(r['loads'])} loads{ms}"
                cells.append(text)
            print(f"| {arm} | {c or '-'} | " + " | ".join(cells) + " |")
        print()
        for n in setups:
            for arm in arms[1:]:
                ratios = ", ".join(f"{best[n, 'all experts', c] / best[n, arm, c]:.2f} at {c}" for c in levels)
                print(f"N={n} {arm} / all experts, throughput: {ratios} clients")
        for (n, arm), diff in agree.items():
            print(f"N={n} {arm}: largest relative difference of a document's nats from the API's {diff:.1e}")
        print(f"device {a.device}; load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
