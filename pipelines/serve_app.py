"""The Serve application of `soma serve` (docs/serving.md): a router deployment in front of expert replicas.

    SomaRouter (HTTP ingress, FastAPI)          SomaExperts (replicas: every expert, on a GPU where there is one)
      validate (inference.serveinput)             score: @serve.batch, windows of many requests in one pass
                                                         (Passes: one pass at a time, every queued batch in it)
      cut documents into soma eval's windows      generate: a streamed generator, the route given by the router;
      and their segments; route each segment on   the replica's concurrent streams decode together (Decoder:
                                                  continuous batching, inference.batching.Batcher)
      the bytes before what it scores (Routing:
      no weights; scoring.Rule)
      -> handle calls, retried on a lost replica
      total each document's segments into its
      score and record (Cut.scores)

Build it with `build(args)` (a Serve application builder: `import_path: pipelines.serve_app:build` in a Serve
config file, as deploy/kuberay/rayservice.yaml does) or through `soma serve`.

Placement: every expert replica holds every expert. An ensemble of the paper's size is tens of MB (docs/serving.md
has the measurement), so one device holds it all, and a window's top-k experts run in the same pass as every other
window's: a request fans out to no other replica and nothing is loaded on demand. Multiplexing groups of experts
(@serve.multiplexed) measured slower at N = 256: 0.70 to 0.89 of this throughput
(benchmarks/bench_serve_placement.py).
"""

import asyncio
import base64
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.config import BackpressureConfig
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle
from ray.serve.metrics import Counter, Gauge, Histogram

from soma_cluster.corpus import shown
from soma_cluster.errors import SomaError
from soma_cluster.inference.batching import Batcher
from soma_cluster.inference.generation import GenerationConfig
from soma_cluster.inference.lm import RoutedLM
from soma_cluster.inference.routing import Route, Routes, Routing
from soma_cluster.inference.serveinput import (
    RequestError,
    ScoreInput,
    ServeSettings,
    Status,
    parse_generate,
    parse_score,
    settings,
)

log = logging.getLogger("ray.serve")

CALL_TRIES = 4  # a handle call lost with its replica (killed, preempted, replaced by an update) is tried again
RETRY_PAUSE_S = 0.25  # times the try's number, between tries
READ_PIECE = 1 << 16


class VersionMismatch(Exception):
    """A router of one version reached an expert replica of another (during a rolling update): try another."""


@dataclass
class WindowJob:
    """Segments of one request (or part of one) for a pass: their bytes, first scored prediction and routes."""

    version: str
    windows: list[bytes]
    firsts: list[int]
    routes: Routes
    per_byte: bool = False  # False: each window's (summed nats, scored bytes) come back, not its per-byte nats


@dataclass
class GenerateJob:
    version: str
    prompt: bytes
    config: GenerationConfig
    route: Route


def version_of(cfg: ServeSettings) -> str:
    """What router and experts must agree on: the source and the step, and for an export its manifest's digest."""
    from soma_cluster.inference.export import EXPORT_FILE
    from soma_cluster.storage import Store, storage_options_from_env

    store = Store(cfg.source, storage_options_from_env(cfg.source))
    digest = hashlib.sha256(store.read_bytes(EXPORT_FILE)).hexdigest()[:16] if store.exists(EXPORT_FILE) else ""
    return json.dumps([store.url, cfg.step, digest])


def _windows_in(jobs: list[WindowJob]) -> int:
    return sum(len(j.windows) for j in jobs)


class Passes:
    """Serve's batches coalesced into passes of the ensemble, one pass at a time, each taking every batch queued
    when it starts (oldest first, up to `max_windows`; a batch larger than that runs alone).

    Why not @serve.batch alone: in Ray 2.60 (concurrent batches, ray-project/ray#53096) its queue forms the next
    batch as soon as a request arrives, while the current pass runs, and freezes it `batch_wait_timeout_s` later;
    under load the replica then runs many small passes instead of one full one. Measured on 2 CPU cores at N = 8,
    32 clients of 8 windows each (256 in flight): passes of 8 to 56 windows at 87 ms a window, against 40 ms a
    window in passes of 256. Here Serve's batches (its batch metrics count them) wait while a pass runs and join
    the next."""

    def __init__(self, run: Callable[[list], list], max_windows: int, size: Callable[[list], int] = _windows_in):
        """`run(items)`: one pass, an answer per item, in a thread; `size(items)`: their windows (WindowJobs' by
        default; benchmarks/bench_serve_placement.py passes its own items)."""
        self.run, self.max_windows, self.size = run, max_windows, size
        self.queued: list[tuple[list, asyncio.Future]] = []
        self.lock = asyncio.Lock()  # one pass at a time; asyncio's lock wakes its waiters in order

    async def submit(self, jobs: list) -> list:
        done: asyncio.Future = asyncio.get_running_loop().create_future()
        self.queued.append((jobs, done))
        while not done.done():
            async with self.lock:
                if done.done():  # an earlier holder's pass took it
                    break
                take, windows = [], 0
                while self.queued and (not take or windows + self.size(self.queued[0][0]) <= self.max_windows):
                    take.append(self.queued.pop(0))
                    windows += self.size(take[-1][0])
                try:
                    out = await asyncio.to_thread(self.run, [j for group, _ in take for j in group])
                except Exception as exc:  # noqa: BLE001 - every caller of the pass gets its error
                    for _, fut in take:
                        fut.set_exception(exc)
                else:
                    at = 0
                    for group, fut in take:
                        fut.set_result(out[at : at + len(group)])
                        at += len(group)
        return await done


@dataclass(eq=False)
class Ticket:
    """A stream on its way through a replica's Decoder: the job, its queue of bytes, and its key once it has joined
    the batch."""

    job: GenerateJob
    queue: asyncio.Queue
    key: int | None = None
    closed: bool = False  # the caller has gone (or has every byte)


STEPS_S = 0.02  # a replica's decoding thread hands its bytes over at least this often
DONE = None  # a stream's queue: bytes (ints) as they are drawn, then DONE, or an exception


class Decoder:
    """Continuous batching on one replica (soma_cluster/inference/batching.py has the rule): one asyncio step loop,
    running while any stream is in the batch. Streams that arrive wait for the next step boundary, are prefilled
    together and join the batch; every step draws one byte of each stream, which goes to that stream's queue at
    once; a stream leaves when it has its bytes or its caller has gone (the generator closed). The model's work
    runs in a thread (asyncio.to_thread), so the event loop keeps sending bytes and taking requests meanwhile.

    As Text Generation Inference's router (router/src/infer.rs, batching_task: prefill what is queued, concatenate
    it to the running batch, filter out finished and dropped requests, decode) and vLLM's scheduler (a waiting queue
    admitted at each step, a running batch). Back-pressure is Serve's, as before: max_ongoing_requests streams per
    replica, then its queue, then 503."""

    def __init__(self, lm: RoutedLM, interval_s: float = 0.0):
        self.interval_s = interval_s  # a stream's pieces after its first go at most this often (bytes gather)
        self.batcher = Batcher(lm)
        self.arrivals: list[Ticket] = []
        self.running: dict[int, Ticket] = {}
        self.task: asyncio.Task | None = None

    async def stream(self, job: GenerateJob) -> AsyncIterator[bytes]:
        """The job's bytes, each piece every byte drawn since the last one was sent: the first at once, the next ones
        at most every interval_s (each piece is a message from this replica to the router, and on 2 cores a
        message a byte for 20 streams costs more than decoding them)."""
        ticket = Ticket(job, asyncio.Queue())
        sent = None
        self.arrivals.append(ticket)
        if self.task is None or self.task.done():
            self.task = asyncio.create_task(self._loop())
        try:
            while True:
                items = [await ticket.queue.get()]
                wait = 0.0 if sent is None else self.interval_s - (time.monotonic() - sent)
                if wait > 0 and items[0] is not DONE:
                    await asyncio.sleep(wait)
                while not ticket.queue.empty():
                    items.append(ticket.queue.get_nowait())
                piece = bytes(b for b in items if isinstance(b, int))
                if piece:
                    sent = time.monotonic()
                    yield piece
                for item in items:
                    if isinstance(item, BaseException):
                        raise item
                if DONE in items:
                    return
        finally:
            ticket.closed = True  # the loop drops it at the next step boundary

    async def _loop(self) -> None:
        while self.arrivals or self.running:
            try:
                await self._step()
            except Exception as exc:  # noqa: BLE001 - every stream in the batch gets the error
                for t in [*self.running.values(), *self.arrivals]:
                    t.queue.put_nowait(exc)
                self.arrivals, self.running = [], {}
                self.batcher = Batcher(self.batcher.lm)

    async def _step(self) -> None:
        arrivals, self.arrivals = [t for t in self.arrivals if not t.closed], []
        gone = [k for k, t in self.running.items() if t.closed]
        for key in gone:
            del self.running[key]
        keys, drawn = await asyncio.to_thread(self._work, [t.job for t in arrivals], gone)
        for key, t in zip(keys, arrivals, strict=True):
            t.key = key
            if t.job.config.max_bytes == 0:
                t.queue.put_nowait(DONE)
            else:
                self.running[key] = t
        for key, byte, done in drawn:
            t = self.running[key]
            t.queue.put_nowait(byte)
            if done:
                t.queue.put_nowait(DONE)
                del self.running[key]

    def _work(self, jobs: list[GenerateJob], gone: list[int]) -> tuple[list[int], list[tuple[int, int, bool]]]:
        """Between two steps: the gone leave, the new join (prefilled together); then steps, until a stream
        arrives or goes, or for STEPS_S (one hop to this thread and back per STEPS_S, not per byte)."""
        self.batcher.leave(gone)
        keys = self.batcher.join([j.prompt for j in jobs], [j.config for j in jobs], [j.route for j in jobs])
        drawn, until = [], time.monotonic() + STEPS_S
        while len(self.batcher):
            drawn += self.batcher.step()
            if self.arrivals or time.monotonic() > until or any(t.closed for t in self.running.values()):
                break
        return keys, drawn


@serve.deployment(name="SomaExperts", health_check_period_s=5, health_check_timeout_s=30)
class SomaExperts:
    """Every expert of the ensemble, scoring windows in batched passes and generating bytes."""

    def __init__(self, args: dict):
        self.cfg = settings(args)
        self.lm = RoutedLM.load(
            self.cfg.source,
            device=None if self.cfg.device == "auto" else self.cfg.device,
            step=self.cfg.step,
            threads=self.cfg.threads,
        )
        if not self.lm.experts:
            raise SomaError(f"{self.lm.source} has no trained expert (no checkpoint yet); soma launch trains them")
        self.version = version_of(self.cfg)
        self._batched.set_max_batch_size(self.cfg.max_batch_windows)
        self._batched.set_batch_wait_timeout_s(self.cfg.batch_wait_s)
        self.passes = Passes(self._pass, self.cfg.max_batch_windows)
        self.decoder = Decoder(self.lm, self.cfg.stream_interval_s)
        Gauge("soma_serve_experts_loaded", description="Experts held by this replica (checkpoints, not the seed).").set(
            len(self.lm.experts)
        )
        self.windows = Counter("soma_serve_windows", description="Windows scored by this replica.")
        self.scored = Counter("soma_serve_scored_bytes", description="Bytes scored by this replica (predictions).")
        self.generated = Counter("soma_serve_generated_bytes", description="Bytes generated by this replica.")
        self.pass_windows = Histogram(
            "soma_serve_pass_windows",
            description="Windows in one pass of the ensemble (requests of a batch together).",
            boundaries=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096],
        )

    def info(self) -> dict:
        return {
            "version": self.version,
            "source": shown(self.lm.source),  # a path that is not UTF-8, escaped: JSON is text
            "n_experts": self.lm.n_experts,
            "experts_loaded": len(self.lm.experts),
            "seed_fallback": list(self.lm.seed_fallback),
            "device": str(self.lm.device),
            "top_k": self.lm.router.cfg.top_k,
            "ensemble_digest": self.lm.digest,
        }

    async def score(self, job: WindowJob) -> tuple[list, tuple[int, ...], str]:
        """The job's nats, the experts the seed stands in for, and the ensemble's digest (for the scores' record)."""
        if job.version != self.version:
            raise VersionMismatch(f"router {job.version}, experts {self.version}")
        return await self._batched(job), self.lm.seed_fallback, self.lm.digest

    # batches run concurrently (max_concurrent_batches): each only queues its jobs for the next pass (Passes)
    @serve.batch(max_batch_size=256, batch_wait_timeout_s=0.005, batch_size_fn=_windows_in, max_concurrent_batches=4096)
    async def _batched(self, jobs: list[WindowJob]) -> list[list]:
        return await self.passes.submit(jobs)

    def _pass(self, jobs: list[WindowJob]) -> list[list]:
        """One pass over the windows of every job; per job, per window: its nats (per_byte) or (sum, count)."""
        windows = [w for j in jobs for w in j.windows]
        firsts = [f for j in jobs for f in j.firsts]
        nats = self.lm.window_nats(windows, firsts, Routes.concat([j.routes for j in jobs]))
        self.pass_windows.observe(len(windows))
        self.windows.inc(len(windows))
        self.scored.inc(sum(len(n) for n in nats))
        out, at = [], 0
        for j in jobs:
            mine = nats[at : at + len(j.windows)]
            out.append(mine if j.per_byte else [(float(n.sum()), len(n)) for n in mine])
            at += len(j.windows)
        return out

    async def generate(self, job: GenerateJob) -> AsyncIterator[bytes]:
        """The job's bytes as they are drawn, decoded together with every other stream on this replica."""
        if job.version != self.version:
            raise VersionMismatch(f"router {job.version}, experts {self.version}")
        async for piece in self.decoder.stream(job):
            self.generated.inc(len(piece))
            yield piece


api = FastAPI(title="soma", description="A SOMA routed ensemble: score and generate bytes (docs/serving.md).")


def _error(exc: RequestError, retry_after_s: int | None = None) -> JSONResponse:
    headers = {"Retry-After": str(retry_after_s)} if exc.status is Status.UNAVAILABLE and retry_after_s else None
    return JSONResponse(exc.body(), status_code=int(exc.status), headers=headers)


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) as soon as it passes `limit` bytes: a flood of large bodies cannot fill memory."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError(Status.TOO_LARGE, f"the body is {declared} bytes, over the limit of {limit}")
    buf = bytearray()
    async for piece in request.stream():
        buf += piece
        if len(buf) > limit:
            raise RequestError(Status.TOO_LARGE, f"the body is over the limit of {limit} bytes")
    return bytes(buf)


@serve.deployment(name="SomaRouter", health_check_period_s=5)
@serve.ingress(api)
class SomaRouter:
    """The HTTP ingress: validates, cuts documents into windows, routes them, and calls the expert replicas."""

    def __init__(self, experts: DeploymentHandle, args: dict):
        self.cfg = settings(args)
        self.routing = Routing.load(self.cfg.source)
        self.version = version_of(self.cfg)
        self.experts = experts
        self.docs = Counter("soma_serve_documents", description="Documents scored through this router.")

    # -- endpoints -------------------------------------------------------------------------------------------
    @api.get("/healthz")
    async def healthz(self) -> Response:
        """200 with what is served once an expert replica of this version answers; 503 while none does."""
        try:
            info = await self._call("info", None)
        except RequestError as exc:
            return JSONResponse(
                {"status": "unavailable", "error": exc.message},
                status_code=503,
                headers={"Retry-After": str(self.cfg.retry_after_s)},
            )
        return JSONResponse({"status": "ok", **info, "window_bytes": self.routing.window_bytes})

    @api.post("/v1/score")
    async def score(self, request: Request) -> Response:
        try:
            req = parse_score(await _read_body(request, self.cfg.max_request_bytes), self.cfg)
            scores = await self._score(req)
        except RequestError as exc:
            return _error(exc, self.cfg.retry_after_s)
        self.docs.inc(len(req.docs))
        return JSONResponse({"source": shown(self.routing.source), "scores": scores})

    @api.post("/v1/generate")
    async def generate(self, request: Request) -> Response:
        try:
            req, prompt = parse_generate(await _read_body(request, self.cfg.max_request_bytes), self.cfg)
            route = self.routing.prompt_route(prompt)
            job = GenerateJob(self.version, prompt, req.generation(), route)
            pieces = await self._stream(job)
        except RequestError as exc:
            return _error(exc, self.cfg.retry_after_s)
        if req.stream:
            return StreamingResponse(
                pieces, media_type="application/octet-stream", headers={"X-Soma-Route": json.dumps(route.as_dict())}
            )
        data = b"".join([p async for p in pieces])
        return JSONResponse(
            {
                "text": data.decode("utf-8", "replace"),
                "bytes": len(data),
                "base64": base64.b64encode(data).decode(),
                "route": route.as_dict(),
            }
        )

    # -- work ----------------------------------------------------------------------------------------------------
    async def _score(self, req: ScoreInput) -> list[dict]:
        cut = self.routing.cut(req.docs, req.prefixes)
        routes = await asyncio.to_thread(self.routing.routes_on, cut.heads)
        cut, rows = cut.merged(routes.experts, routes.weights)  # a window's segments under one route: read as one
        routes = routes.take(rows)
        step = self.cfg.max_batch_windows
        firsts = cut.firsts
        parts = await asyncio.gather(
            *(
                self._call(
                    "score",
                    WindowJob(
                        self.version,
                        cut.windows[i : i + step],
                        firsts[i : i + step],
                        routes.take(slice(i, i + step)),
                        req.per_byte,
                    ),
                )
                for i in range(0, len(cut.windows), step)
            )
        )
        results = [n for part, _, _ in parts for n in part]
        substituted, digest = (
            (parts[0][1], parts[0][2]) if parts else ((), (await self._call("info", None))["ensemble_digest"])
        )
        out = []
        for s in cut.scores(routes.experts, routes.weights, results, substituted, req.per_byte, req.routes, digest):
            d = s.as_dict()
            if req.per_byte:
                d["per_byte"] = [float(x) for x in s.per_byte]
            out.append(d)
        return out

    async def _stream(self, job: GenerateJob) -> AsyncIterator[bytes]:
        """The generator's stream, its first piece already received (so a lost replica is retried before any
        byte was sent); a replica lost after that ends the stream early (the client sees a short body)."""
        for attempt in range(1, CALL_TRIES + 1):
            gen = self.experts.options(stream=True).generate.remote(job)
            try:
                first = await gen.__anext__() if job.config.max_bytes else b""
            except StopAsyncIteration:
                first = b""
            except Exception as exc:  # noqa: BLE001 - sorted by _retryable
                await self._after_failure(exc, attempt)
                continue

            async def rest(first=first, gen=gen) -> AsyncIterator[bytes]:
                if first:
                    yield first
                    async for piece in gen:
                        yield piece

            return rest()
        raise RequestError(Status.UNAVAILABLE, "no expert replica answered; retry")

    async def _call(self, method: str, job):
        for attempt in range(1, CALL_TRIES + 1):
            try:
                handle = getattr(self.experts, method)
                return await (handle.remote(job) if job is not None else handle.remote())
            except Exception as exc:  # noqa: BLE001 - sorted by _after_failure
                await self._after_failure(exc, attempt)
        raise RequestError(Status.UNAVAILABLE, "no expert replica answered; retry")

    async def _after_failure(self, exc: Exception, attempt: int) -> None:
        """A lost replica or a replica of another version: pause and try again; back-pressure: a 503 now."""
        if isinstance(exc, BackPressureError):
            raise RequestError(Status.UNAVAILABLE, "the expert replicas are at capacity; retry") from None
        if isinstance(exc, (RayActorError, DeploymentUnavailableError, VersionMismatch)):
            log.warning("soma serve: try %d of %d failed (%s)", attempt, CALL_TRIES, type(exc).__name__)
            await asyncio.sleep(RETRY_PAUSE_S * attempt)
            return
        if isinstance(exc, SomaError):
            raise RequestError(Status.INVALID, str(exc)) from None
        raise exc


def build(args: dict) -> serve.Application:
    """The application from its settings (soma_cluster.inference.serveinput.ServeSettings): a Serve application
    builder."""
    cfg = settings(dict(args))
    back = BackpressureConfig(status_code=503, retry_after_s=cfg.retry_after_s)
    scaling = (
        {"num_replicas": cfg.replicas}
        if cfg.max_replicas is None
        else {
            "num_replicas": "auto",
            "autoscaling_config": {
                "min_replicas": cfg.replicas,
                "initial_replicas": cfg.replicas,
                "max_replicas": cfg.max_replicas,
                "target_ongoing_requests": cfg.target_ongoing_requests,
            },
        }
    )
    experts = SomaExperts.options(
        **scaling,
        ray_actor_options={"num_gpus": cfg.gpus_per_replica, "num_cpus": cfg.cpus_per_replica},
        max_ongoing_requests=cfg.max_ongoing_requests,
        max_queued_requests=cfg.max_queued_requests,
        backpressure_config=back,
    ).bind(cfg.model_dump())
    return SomaRouter.options(
        num_replicas=cfg.router_replicas,
        ray_actor_options={"num_cpus": cfg.router_cpus},
        max_ongoing_requests=cfg.max_ongoing_requests,
        max_queued_requests=cfg.max_queued_requests,
        backpressure_config=back,
    ).bind(experts, cfg.model_dump())
