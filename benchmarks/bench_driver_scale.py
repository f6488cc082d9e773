"""Driver scale: campaigns of N = 256 and 1,024 experts on a local Ray with many logical GPUs.

The trainer here is a STAND-IN, not ExpertWorker: `StandInTrainer` holds no torch and no data; each
chunk it sleeps `chunk_updates x sec_per_update` seconds and returns a heartbeat shaped like
ExpertWorker.run_chunk's. So what is measured is orchestration only: the real Driver
(pipelines.campaign.Driver, handed this actor factory) with its ledger and events writes, and Ray
starting and stopping one actor per expert (or per pack of G, resources.experts_per_actor; with
--reuse also resources.reuse_actors). Beside it, Ray Tune runs the same trials (same chunks,
same sleep, same GPU share, one report per chunk) when `ray[tune]` is installed (the `bench` extra).

Ratios printed:
  wall / ideal        ideal = sum of work / slots (slots = logical GPUs / GPU share); target <= 1.05
  wall / bound        bound = max(ideal, N / spawn rate): a host starts actor processes at a finite
                      rate (measured first; ~2/s on 2 cores), which no one-actor-per-expert system beats
  actor start s       mean launched -> started (process start + setup()); a slot is held meanwhile, so
  wall/(ideal+start)  compares with (work + start) / slots: what is left is the Driver's own overhead
  driver loop ms/hb   the Driver loop's own time (all but blocking for the first result), per expert
                      heartbeat (or setup): fetching results, accounting, launching actors, submitting
                      chunks, building ledger + events records and handing them to the log writer;
                      target < 1 ms, i.e. a heartbeat round over N experts costs < N ms
  log writer ms/hb    the background writer thread's durable writes (group commit: one append +
                      fdatasync per log every 0.25 s), off the loop
  driver CPU ms/hb    driver process CPU (Python + Ray's core-worker threads + the writer) per heartbeat
  bare Ray loop       the same wait/get/submit loop over the same stand-ins with no Driver in it, measured
                      first in the same run: the floor under "driver loop ms/hb"

Tracking (--tracking): the same Driver at each N with experiment tracking off and on (TensorBoard into the
campaign directory, and MLflow: --mlflow-uri, by default a loopback port where nothing listens, the worst case
in which every call fails and is retried), alternating off/on/on/off (--repeats pairs), G = 1. Printed: the
driver loop's ms per heartbeat, median over repeats, and on/off; the issue's target is on/off <= 1.05. Each run
also prints where the time goes: the loop thread's own CPU per heartbeat (what it computes; the rest of its time
it waits, for a core or the interpreter lock), the garbage collector's pauses per heartbeat (and how many were
full passes; a pause stalls the loop, whichever thread set it off), the tracker calls made inside the loop
(turning records into points and enqueueing them), and each sink thread's own CPU (time.pthread_getcpuclockid).

Not a test. With the defaults (N = 256, 16 slots, 12 s of work per expert: ideal 192 s) the Driver run
takes ~4 min on 2 cores and Ray Tune ~7.5 min. N = 1,024 at these settings is ~15 min a
system; a spawn-bound quick look: `--experts 1024 --no-tune --chunks 2 --chunk-s 1`.

  PYTHONPATH=. python benchmarks/bench_driver_scale.py [--experts 256 1024] [--no-tune] [--campaign-dir /dev/shm/x]

Measurement records (dated runs, their commands and readings): docs/results/benchmarks/bench_driver_scale.md.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import shutil
import statistics
import tempfile
import time

for _k, _v in {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
}.items():
    os.environ.setdefault(_k, _v)

import ray  # noqa: E402

from pipelines.campaign import Driver, also_ready, expert_jobs  # noqa: E402
from soma_cluster.config import resolve  # noqa: E402
from soma_cluster.events import history  # noqa: E402
from soma_cluster.jobs import StopReason  # noqa: E402
from soma_cluster.messages import ChunkReport, ExpertStart, Heartbeat, Incarnation, SetupReport, Usage  # noqa: E402
from soma_cluster.storage import Store  # noqa: E402
from workers import SCHEDULING  # noqa: E402


class StandInTrainer:
    """STAND-IN for workers.ExpertWorker: same setup()/run_chunk() contract and typed reports, sleeps instead of
    training.

    A pack of G experts (resources.experts_per_actor) sleeps as long per chunk as one expert: it stands for
    G small experts that each underfill a GPU and share its passes (what packing is for)."""

    def __init__(
        self,
        campaign_url: str,
        storage_options: dict,
        experts,
        attempts,
        num_gpus: float,
        target: int,
        sec_per_update: float,
    ):
        self.t0 = self.t_end = time.monotonic()
        self.held_from = time.time()
        self.experts = list(experts)
        self.num_gpus, self.target, self.sec_per_update, self.step = num_gpus, target, sec_per_update, 0

    def holding(self) -> float:
        return self.held_from

    def setup(self, experts=None, attempts=None) -> SetupReport:
        if experts is not None:  # reused (resources.reuse_actors): the new experts' clock starts at the last report
            self.experts, self.step = list(experts), 0
            self.t0, self.held_from = self.t_end, time.time() - (time.monotonic() - self.t_end)
        held = (time.monotonic() - self.t0) / len(self.experts)
        start = ExpertStart(
            step=0, target=self.target, resumed=False, forwards=0, n_train=0, usage=Usage(held * self.num_gpus, held)
        )
        return SetupReport(
            "stand-in",
            None,
            Incarnation(ray.get_runtime_context().get_node_id(), os.getpid(), self.held_from),
            self.held_from,
            0.0,
            dict.fromkeys(self.experts, start),
        )

    def run_chunk(self, max_updates: int, caps=None) -> ChunkReport:
        if self.step >= self.target:
            return ChunkReport({}, time.monotonic() - self.t0)
        todo = min(max_updates, self.target - self.step)
        time.sleep(todo * self.sec_per_update)
        self.step += todo
        self.t_end = time.monotonic()
        held = (self.t_end - self.t0) / len(self.experts)
        done = self.step >= self.target
        beat = Heartbeat(
            step=self.step,
            target=self.target,
            updates=todo,
            loss=5.0,
            val=None,
            best_val=None,
            eps=1e-3,
            lr=1e-3,
            checkpoint=None,
            checkpoint_step=self.step,
            usage=Usage(held * self.num_gpus, held, self.step * 129, self.step * 64 * 1024),
            sec_per_update=self.sec_per_update,
            reason=StopReason.FINISHED if done else None,
        )
        return ChunkReport(dict.fromkeys(self.experts, beat), time.monotonic() - self.t0)


RemoteStandIn = ray.remote(StandInTrainer)


def stand_in_factory(target: int, sec_per_update: float):
    """An actor factory with start_worker's signature, for Driver(actor_factory=...)."""

    def start(*, campaign_url, storage_options, experts, attempts, num_gpus, num_cpus, placement="pack", **_):
        return RemoteStandIn.options(
            num_gpus=num_gpus,
            num_cpus=num_cpus,
            max_restarts=0,
            max_task_retries=0,
            scheduling_strategy=SCHEDULING[placement],
        ).remote(campaign_url, storage_options, experts, attempts, num_gpus, target, sec_per_update)

    return start


class TimedDriver(Driver):
    """The real Driver; only counts expert heartbeats and times handling them (its loop's own thread), and
    apart from that the log writes, which its background writer thread does off the loop."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.collect_s, self.append_s, self.results = 0.0, 0.0, 0
        self.loop_cpu_s = 0.0  # the loop thread's own CPU in its sweeps (blocking included: it spends ~none)
        self.feed_s, self.sink_cpu = 0.0, {}  # with tracking on: see _open_tracker
        write, flush = self.store._write_lines, self.store.flush

        def timed_write(log, lines):
            t = time.perf_counter()
            write(log, lines)
            self.append_s += time.perf_counter() - t

        def timed_flush(wait=True):  # the loop's side of group commit: handing records over
            t = time.perf_counter()
            flush(wait)
            self.collect_s += time.perf_counter() - t

        self.store._write_lines, self.store.flush = timed_write, timed_flush

    def _open_tracker(self, hist):
        """The tracker's calls in the loop are timed (they are part of collect_s too), and each sink thread's own
        CPU is read from its CPU clock just before the tracker closes (its threads end then)."""
        tracker = super()._open_tracker(hist)
        if tracker is None:
            return None
        for name in ("on_event", "on_ledger"):
            call = getattr(tracker, name)

            def timed(rec, call=call):
                t = time.perf_counter()
                call(rec)
                self.feed_s += time.perf_counter() - t

            (self.sched if name == "on_event" else self.sched.books.ledger).observe = timed
        close = tracker.close

        def timed_close(record=True):
            for th in tracker.threads:
                self.sink_cpu[th.sink.name] = time.clock_gettime(time.pthread_getcpuclockid(th._thread.ident))
            return close(record)

        tracker.close = timed_close
        return tracker

    def _collect(self, uid, ref, result=None):
        self.results += len(self.sched.units[uid].live())
        return super()._collect(uid, ref, result)

    def _sweep(self) -> None:
        """All the loop's time in a sweep except blocking for the first result (or sleeping)."""
        t, c = time.perf_counter(), time.thread_time()
        self.blocked = 0.0
        super()._sweep()
        self.collect_s += time.perf_counter() - t - self.blocked
        self.loop_cpu_s += time.thread_time() - c

    def _block(self, refs):
        t = time.perf_counter()
        out = super()._block(refs)
        self.blocked += time.perf_counter() - t
        return out


class GcClock:
    """The interpreter's garbage collections while it is entered: their seconds (every thread waits for them) and
    how many were full (the oldest generation: they traverse every object the process holds)."""

    def __init__(self):
        self.seconds, self.full, self._t = 0.0, 0, 0.0

    def _tick(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t
            self.full += info["generation"] == 2

    def __enter__(self) -> "GcClock":
        gc.callbacks.append(self._tick)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._tick)


def _stand_in(start, expert: int, share: float):
    """One stand-in through the factory's keyword-only signature (start_worker's)."""
    return start(campaign_url="", storage_options={}, experts=[expert], attempts=[0], num_gpus=share, num_cpus=0.0)


def spawn_rate(share: float, k: int) -> float:
    """Actors per second this host starts (create k stand-ins, wait for setup, kill them)."""
    start = stand_in_factory(1, 0.0)
    t = time.monotonic()
    actors = [_stand_in(start, i, share) for i in range(k)]
    ray.get([a.setup.remote() for a in actors], timeout=600)
    rate = k / (time.monotonic() - t)
    for a in actors:
        ray.kill(a)
    return rate


def ray_floor_ms(slots: int, share: float, calls: int, chunk_s: float) -> float:
    """The same loop with no Driver in it: `slots` stand-ins, each result fetched and the next chunk submitted
    at once. Returns the loop's own ms per result (blocking for the first ready result excluded): what Ray
    itself costs per heartbeat on this host, the floor under the Driver's number."""
    start = stand_in_factory(10**9, chunk_s / 10)
    actors = [_stand_in(start, i, share) for i in range(slots)]
    ray.get([a.setup.remote() for a in actors], timeout=600)
    owner = {a.run_chunk.remote(10): a for a in actors}
    spent, done = 0.0, 0
    while done < calls:
        first, rest = Driver._block(list(owner))
        t = time.perf_counter()
        ready = also_ready(first, rest)
        for ref, _ in zip(ready, ray.get(ready, timeout=60), strict=True):
            a = owner.pop(ref)
            owner[a.run_chunk.remote(10)] = a
        done += len(ready)
        spent += time.perf_counter() - t
    for a in actors:
        ray.kill(a)
    return 1e3 * spent / done


def tracking_section(on: bool, args, campaign: str) -> dict:
    if not on:
        return {}
    return {
        "backends": args.backends.split(","),
        "mlflow_uri": args.mlflow_uri,
        "tensorboard_dir": os.path.join(campaign, "tensorboard"),
        "drain_s": 5.0,  # after the loop: not in the loop's time
    }


def run_driver(
    n: int, args, root: str, pack: int = 1, reuse: bool = False, pending: int | None = None, tracking: bool = False
) -> dict:
    where = tempfile.mkdtemp(prefix=f"driver-{n}-{pack}-{reuse}-{pending}-", dir=args.campaign_dir or root)
    cfg = resolve(
        "tiny",
        {
            "name": f"bench-{n}-{pack}-{reuse}-{pending}",
            "n_experts": n,
            "train": {"updates": args.chunks * args.chunk_updates, "chunk_updates": args.chunk_updates},
            "resources": {
                "num_gpus": args.share,
                "num_cpus": 0.0,
                "experts_per_actor": pack,
                "reuse_actors": reuse,
                "max_pending": pending,
            },
            "retry": {"heartbeat_timeout_s": 600.0},
            "tracking": tracking_section(tracking, args, where),
        },
    )
    store = Store(where)
    driver = TimedDriver(
        store,
        cfg,
        expert_jobs(cfg.n_experts),
        show_progress=False,
        actor_factory=stand_in_factory(cfg.train.updates, args.chunk_s / args.chunk_updates),
    )
    cpu, t = time.process_time(), time.monotonic()
    with GcClock() as gc_clock:
        outcome = driver.run()
    wall, cpu = time.monotonic() - t, time.process_time() - cpu
    assert set(outcome.values()) == {"finished"} and len(outcome) == n, outcome
    hist = history(store).values()
    beats = sum(1 for h in hist for e in h.events if e["event"] == "heartbeat")
    at = {(h.job, e["event"]): e["t"] for h in hist for e in h.events}
    start_s = sum(at[(h.job, "started")] - at[(h.job, "launched")] for h in hist) / n  # actor start + setup()
    per = 1e3 / driver.results
    return {
        "wall": wall,
        "beats": beats,
        "start_s": start_s,
        "collect_ms": driver.collect_s * per,
        "append_ms": driver.append_s * per,
        "cpu_ms": cpu * per,
        "gc_ms": gc_clock.seconds * per,
        "loop_cpu_ms": driver.loop_cpu_s * per,
        "feed_ms": driver.feed_s * per,
        "sink_cpu_ms": {k: v * per for k, v in driver.sink_cpu.items()},
        "full_gcs": gc_clock.full,
    }


def run_tune(n: int, args, root: str) -> dict:
    from ray import tune

    chunks, chunk_s = args.chunks, args.chunk_s

    def trial(config):  # the same stand-in work: one report per chunk
        t0 = time.monotonic()
        for i in range(chunks):
            time.sleep(chunk_s)
            tune.report(
                {"step": (i + 1) * args.chunk_updates, "loss": 5.0, "gpu_seconds": (time.monotonic() - t0) * args.share}
            )

    tuner = tune.Tuner(
        tune.with_resources(trial, {"cpu": 0, "gpu": args.share}),
        tune_config=tune.TuneConfig(num_samples=n),
        run_config=tune.RunConfig(name=f"tune-{n}", storage_path=os.path.join(root, "tune"), verbose=0),
    )
    t = time.monotonic()
    results = tuner.fit()
    wall = time.monotonic() - t
    assert len(results) == n and not results.errors, results.errors
    return {
        "wall": wall,
        "beats": n * chunks,
        "start_s": float("nan"),
        "collect_ms": float("nan"),
        "append_ms": float("nan"),
        "cpu_ms": float("nan"),
    }


def compare_tracking(args, root: str, floor: float) -> None:
    """Tracking off and on, alternating (off, on, on, off, ...), G = 1: the loop's ms per heartbeat of each."""
    for n in args.experts:
        got: dict[bool, list[dict]] = {False: [], True: []}
        for i in range(args.repeats):
            for on in (False, True) if i % 2 == 0 else (True, False):
                r = run_driver(n, args, root, tracking=on)
                got[on].append(r)
                print(f"  N={n} tracking {'on ' if on else 'off'}: loop {r['collect_ms']:.3f} ms/hb "
                      f"(its thread's CPU {r['loop_cpu_ms']:.3f}), "
                      f"wall {r['wall']:.1f} s, CPU {r['cpu_ms']:.2f} ms/hb, garbage collection "
                      f"{r['gc_ms']:.3f} ms/hb ({r['full_gcs']} full); in the loop, feeding the trackers "
                      f"{r['feed_ms']:.3f} ms/hb; sink threads' CPU "
                      f"{', '.join(f'{k} {v:.3f}' for k, v in r['sink_cpu_ms'].items()) or '-'} ms/hb",
                      flush=True)  # fmt: skip
        med = {on: statistics.median(r["collect_ms"] for r in rs) for on, rs in got.items()}
        cpu = {on: statistics.median(r["cpu_ms"] for r in rs) for on, rs in got.items()}
        print(
            f"\n| N | tracking | driver loop ms/heartbeat (median of {args.repeats}) | driver CPU ms/heartbeat |\n"
            f"|---|---|---|---|\n| {n} | off | {med[False]:.3f} | {cpu[False]:.2f} |\n"
            f"| {n} | on ({args.backends.replace(',', ' + ')}; mlflow at {args.mlflow_uri}) | {med[True]:.3f} "
            f"| {cpu[True]:.2f} |\n"
            f"N={n}: loop on/off = {med[True] / med[False]:.3f} (target <= 1.05); bare Ray loop {floor:.3f} ms"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, nargs="+", default=[256])
    # defaults: 16 slots x 12 s of work per expert keeps actor starts (16 / 12 s) under the host's ~2/s
    p.add_argument("--gpus", type=int, default=8, help="logical GPUs of the local Ray")
    p.add_argument("--share", type=float, default=0.5, help="GPU share per expert actor")
    p.add_argument("--chunks", type=int, default=6, help="heartbeats per expert")
    p.add_argument("--chunk-updates", type=int, default=10)
    p.add_argument("--chunk-s", type=float, default=2.0, help="stand-in seconds of work per chunk")
    p.add_argument(
        "--pack", type=int, nargs="+", default=[1, 4], help="experts per actor (resources.experts_per_actor)"
    )
    p.add_argument("--reuse", action="store_true", help="also run each G with resources.reuse_actors")
    p.add_argument(
        "--max-pending",
        nargs="+",
        default=["default"],
        help=(
            "resources.max_pending values to run each G with ('default': every remaining job queued at once, "
            "0 with reuse)"
        ),
    )
    p.add_argument("--no-tune", action="store_true")
    p.add_argument("--tracking", action="store_true", help="compare tracking off and on instead (docs/tracking.md)")
    p.add_argument("--repeats", type=int, default=2, help="with --tracking: off/on pairs, alternating order")
    p.add_argument(
        "--mlflow-uri", default="http://127.0.0.1:9", help="with --tracking (default: nothing listens: a down tracker)"
    )
    p.add_argument(
        "--backends",
        default="tensorboard,mlflow",
        help="with --tracking: the trackers turned on (one at a time: which costs)",
    )
    p.add_argument("--campaign-dir", help="where the Driver's campaign (events, ledger) goes; /dev/shm: no disk syncs")
    args = p.parse_args()
    if args.campaign_dir:  # made if missing, as a campaign directory is
        os.makedirs(args.campaign_dir, exist_ok=True)
    slots = int(args.gpus / args.share + 1e-9)
    root = tempfile.mkdtemp(prefix="soma-bench-", dir="/tmp")
    ray.init(
        num_gpus=args.gpus,
        num_cpus=os.cpu_count() or 1,
        include_dashboard=False,
        _temp_dir=os.path.join(root, "ray"),
        log_to_driver=False,
        logging_level="WARNING",
    )
    try:
        rate = spawn_rate(args.share, min(slots, 32))
        print(
            f"host starts {rate:.2f} actors/s; {slots} slots ({args.gpus} logical GPUs / {args.share}), "
            f"{args.chunks} chunks x {args.chunk_s} s per expert",
            flush=True,
        )
        floor = ray_floor_ms(slots, args.share, 40 * slots, args.chunk_s)
        print(f"bare Ray loop (wait + get + submit, no Driver): {floor:.3f} ms per result", flush=True)
        if args.tracking:
            return compare_tracking(args, root, floor)
        rows = []
        for n in args.experts:
            systems = [
                (
                    f"soma Driver, G={g}{', reuse' if reuse else ''}{'' if mp == 'default' else f', max_pending={mp}'}",
                    g,
                    lambda n, a, r, g=g, reuse=reuse, mp=mp: run_driver(
                        n, a, r, g, reuse, None if mp == "default" else int(mp)
                    ),
                )
                for g in args.pack
                for reuse in ((False, True) if args.reuse else (False,))
                for mp in args.max_pending
            ]
            if not args.no_tune:
                systems.append(("Ray Tune", 1, run_tune))
            for name, g, fn in systems:
                actors = math.ceil(n / g)  # actor *jobs*: with reuse, fewer processes start
                ideal = actors * args.chunks * args.chunk_s / slots  # the actors' work / slots
                r = fn(n, args, root)
                rows.append((name, n, g, actors, ideal, max(ideal, actors / rate), r))
                print(f"  done: {name} N={n} in {r['wall']:.1f} s", flush=True)
        print(
            "\n| system | N | actors | slots | ideal s | spawn bound s | wall s | wall/ideal | wall/bound "
            "| actor start s | wall/(ideal+start) | driver loop ms/heartbeat | log writer thread ms/heartbeat "
            "| driver process CPU ms/heartbeat |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for name, n, _, actors, ideal, bound, r in rows:
            with_start = ideal + actors * r["start_s"] / slots  # slots are held while an actor starts, too
            print(
                f"| {name} | {n} | {actors} | {slots} | {ideal:.1f} | {bound:.1f} | {r['wall']:.1f} | "
                f"{r['wall'] / ideal:.2f} | {r['wall'] / bound:.2f} | {r['start_s']:.2f} | "
                f"{r['wall'] / with_start:.2f} | {r['collect_ms']:.3f} | {r['append_ms']:.3f} | {r['cpu_ms']:.2f} |"
            )
        for name, n, g, *_, r in rows:
            if name.startswith("soma"):
                print(
                    f"{name} N={n}: driver loop / bare Ray loop per heartbeat = {r['collect_ms'] / floor:.2f} "
                    f"(per actor call: {r['collect_ms'] * g / floor:.2f})"
                )
        drivers = {n: r for name, n, g, *_, r in rows if name.startswith("soma Driver, G=1") and "reuse" not in name}
        for name, n, *_, r in rows:
            if name == "Ray Tune" and n in drivers:
                print(f"N={n}: Ray Tune wall / soma Driver (G=1) wall = {r['wall'] / drivers[n]['wall']:.2f}")
    finally:
        ray.shutdown()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
