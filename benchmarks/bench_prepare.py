"""`soma prepare`'s cost, measured where 2 cores can measure it: CPU-seconds per MB of every stage in each engine,
the driver's serial part, how evenly the tasks divide, and the Amdahl projection those give, checked.

  PYTHONPATH=. python benchmarks/bench_prepare.py --part engines [--gb 0.25] [--experts 16] [--sample 20000]
  PYTHONPATH=. python benchmarks/bench_prepare.py --part engines --gb 0.1 0.3 [--rounds 2] [--refit-rows 50000]
  PYTHONPATH=. python benchmarks/bench_prepare.py --part serial [--fit-sizes 25000 50000 100000] [--experts 256]
  PYTHONPATH=. python benchmarks/bench_prepare.py --part scale [--gb 0.1] [--refit-rows 50000]
  PYTHONPATH=. python benchmarks/bench_prepare.py --part division [--gb 0.2] [--part-mb 32] [--uneven]

engines: the local engine, then the Ray engine (Ray Data) with 1 and 2 CPU workers on a local Ray, each a fresh
process. CPU is read from the OS (psutil, user + system), never estimated, at every stage boundary
(pipelines.prepare.STAGE_HOOKS) for every process of the run, in three groups: the driver (all its threads:
Ray Data's executor, deserialising results, the fits), Ray's worker processes (named ray::...), and Ray's own
processes (gcs_server, raylet with its object store, agents). A background thread samples them every 0.25 s so a
process that exits keeps what it used (its own CPU is taken off the driver's). Each Ray task also times itself
(soma_cluster.stagecost.TaskClock: process CPU while the task's function ran), so the workers' CPU splits into
the tasks' own work and what Ray's worker does around them (serialising into the object store, Ray Data's
batch conversion, task start). Other engineers' processes are the machine's CPU less ours: reported as "others"
and taken off the 2 cores in the projection's check. Campaigns are compared file for file (sha256). Every process
runs one BLAS/OpenMP thread (THREADS), so CPU-s/MB is one core's cost.

engines with two sizes (--gb SMALL BIG): the local engine and the Ray engine (1 worker) interleaved (local small,
ray small, local big, ray big; --rounds times), each stage's CPU split as fixed + marginal x MB: the marginal
CPU-s/MB (what one more MB costs: the goal's measure) without what a run pays once (Ray's start, a worker's imports,
the router's load, a stage's scheduling). The task clock also reads the task's own thread, so Ray's threads in a
worker process show as tasks less task thread. Use a --refit-rows below both corpora's sequences: the embeddings
that travel to the driver are then a fixed cost, as at scale.

scale: the local engine and the Ray engine (1 worker) at gb and 2 x gb: the driver's peak RSS at each, and each
stage's marginal CPU-s/MB (what a run pays once left out; needs a steady load to mean anything).
serial: the router fit on the driver (TF-IDF, SVD, balanced k-means, `fit_router`) and the offsets' refit on the
sample (`fit_offsets`, warm), each sample size in a fresh process: wall, CPU seconds and peak RSS, fitted as
a * n^b. division: a ray.cluster_utils.Cluster (head with 0 CPUs, 2 worker nodes with 1 CPU each, 127.0.0.1),
parts' sizes and each stage's per-task times: slowest against the mean, and the stage's wall against the
makespan its task times allow on 2 workers (--uneven: one part twice the others).

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

from soma_cluster.stagecost import (  # noqa: E402
    TASK_TIMES_ENV,
    Projection,
    makespan,
    parallel_wall,
    power_fit,
    read_task_times,
    spread,
)

STAGES = ("setup", "read", "sample", "fit", "embed", "refit", "count", "write")
PARALLEL = ("read", "sample", "embed", "count", "write")  # run as tasks in the Ray engine
SERIAL = ("fit", "refit")  # the driver alone, in both engines
GROUPS = ("driver", "workers", "ray", "tasks")  # tasks: the Ray tasks' own CPU, part of workers
ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
# one BLAS/OpenMP thread in every process (Ray already gives its 1-CPU workers one): CPU-s per MB is then the cost
# of one core's work, and no idle BLAS thread spins on a host whose 2 cores are shared (spinning counts as CPU)
THREADS = {k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}


class CpuMeter:
    """CPU seconds (user + system) of this process and every process under it, by group, from the OS."""

    def __init__(self, period: float = 0.25):
        import psutil

        self.psutil, self.me = psutil, psutil.Process()
        self.seen: dict[int, tuple[str, float]] = {}  # pid -> (group, last CPU seconds read)
        self.own = 0.0  # the sampling thread's own CPU, taken off the driver's
        self.worker_rss_mib = 0.0  # largest private RSS of a Ray worker (RSS less the object store's shared pages)
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.machine0 = self._machine()
        self.thread = threading.Thread(target=self._loop, args=(period,), daemon=True)
        self.thread.start()

    def _machine(self) -> float:
        t = self.psutil.cpu_times()
        return t.user + t.system + getattr(t, "nice", 0) + getattr(t, "irq", 0) + getattr(t, "softirq", 0)

    def _sample(self) -> None:
        procs = [self.me]
        try:
            procs += self.me.children(recursive=True)
        except self.psutil.Error:
            pass
        for p in procs:
            try:
                cpu = p.cpu_times()
                if p.pid == self.me.pid:
                    group = "driver"
                else:
                    group = "workers" if " ".join(p.cmdline()).startswith("ray::") else "ray"
                if group == "workers":
                    mem = p.memory_info()
                    self.worker_rss_mib = max(self.worker_rss_mib, (mem.rss - getattr(mem, "shared", 0)) / 2**20)
                with self.lock:
                    self.seen[p.pid] = (group, cpu.user + cpu.system)
            except self.psutil.Error:
                continue

    def _loop(self, period: float) -> None:
        while not self.stop.wait(period):
            t = time.thread_time()
            self._sample()
            self.own += time.thread_time() - t

    def snapshot(self) -> dict[str, float]:
        """Cumulative CPU seconds per group, plus 'machine' (every process on the host) and 'time' (wall)."""
        self._sample()
        with self.lock:
            out = {g: 0.0 for g in ("driver", "workers", "ray")}
            for group, cpu in self.seen.values():
                out[group] += cpu
        out["driver"] -= self.own
        out["machine"] = self._machine() - self.machine0
        out["time"] = time.monotonic()
        return out

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def _config(args):
    from soma_cluster.config import resolve

    return resolve(
        "tiny",
        {
            "name": "bench-prepare",
            "n_experts": args.experts,
            "corpus": {"source": args.corpus, "max_bytes": 10**13, "test_fraction": 0.001},
            "router": {
                "sample_chunks": args.sample,
                "refit_rows": args.refit_rows,
                "max_features": 50_000,
                "min_df": 5,
                "svd_dim": 128,
            },
            "prepare": {"engine": args.engine, "workers": args.workers, "part_bytes": args.part_mb * 10**6},
        },
    )


def one(args) -> None:
    """A single prepare in this process (on a multi-node cluster of its own with --cluster); prints one JSON line."""
    from pipelines import prepare as prep
    from soma_cluster.storage import Store

    cfg = _config(args)
    times = tempfile.mkdtemp(prefix="soma-task-times-", dir="/tmp")
    os.environ[TASK_TIMES_ENV] = times  # before Ray starts: its workers inherit it
    meter = CpuMeter()
    marks: list[tuple[str, dict]] = [("start", meter.snapshot())]
    prep.STAGE_HOOKS.append(lambda name: marks.append((name, meter.snapshot())))
    cluster, address = None, None
    try:
        if args.cluster:
            cluster, address = _start_cluster()
        t = time.perf_counter()
        summary = prep.prepare(Store(args.campaign), cfg, address)
        wall = time.perf_counter() - t
    finally:
        marks.append(("end", meter.snapshot()))
        meter.close()
        if cluster is not None:
            cluster.shutdown()  # our own handle: the nodes this process started, nothing else
    stages = {}
    for (_, a), (name, b) in zip(marks, marks[1:], strict=False):
        if name != "end":
            stages[name] = {g: b[g] - a[g] for g in ("driver", "workers", "ray", "machine", "time")}
    tasks = read_task_times(times)
    shutil.rmtree(times, ignore_errors=True)
    for name, st in stages.items():
        st["tasks"] = sum(t.cpu_s for t in tasks if t.stage == name)
        st["thread"] = sum(t.thread_cpu_s for t in tasks if t.stage == name)  # the tasks' own threads: part of tasks
    print(
        json.dumps(
            {
                "wall": wall,
                "bytes": summary["corpus"]["bytes"],
                "parts": summary["corpus"]["parts"],
                "stage_wall": summary["stage_seconds"],
                "cpu": stages,
                "tasks": [t.__dict__ for t in tasks],
                "driver_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "worker_rss_mib": meter.worker_rss_mib,
                "rows": [min(summary["train_rows"]), max(summary["train_rows"])],
            }
        )
    )


def _start_cluster():
    """Head (0 CPUs: the driver's node runs no task) + 2 worker nodes of 1 CPU, all on 127.0.0.1."""
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "num_gpus": 0, "include_dashboard": False})
    for _ in range(2):
        c.add_node(num_cpus=1, num_gpus=0)
    c.wait_for_nodes(timeout=120)
    return c, c.address


def digests(root: str) -> dict[str, str]:
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            rel = os.path.relpath(os.path.join(dirpath, name), root)
            if (
                rel.startswith("ledger")
                or name in ("campaign.yaml", "driver-lease.json")
                or rel == os.path.join("shards", "manifest.json")
            ):
                continue
            with open(os.path.join(dirpath, name), "rb") as fh:
                out[rel] = hashlib.sha256(fh.read()).hexdigest()
    return out


def run_one(args, corpus: str, camp: str, engine: str, workers: int, cluster: bool = False) -> dict:
    shutil.rmtree(camp, ignore_errors=True)
    cmd = [sys.executable, os.path.abspath(__file__), "--one", "--engine", engine, "--workers", str(workers)]
    cmd += ["--corpus", corpus, "--campaign", camp, "--experts", str(args.experts), "--sample", str(args.sample)]
    cmd += ["--part-mb", str(args.part_mb), "--refit-rows", str(args.refit_rows)] + (["--cluster"] if cluster else [])
    env = {**os.environ, **ENV, **THREADS, "PYTHONPATH": os.path.dirname(HERE)}
    if cluster:
        env["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="soma-bench-ray-", dir="/tmp")
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    finally:
        if cluster:
            shutil.rmtree(env["RAY_TMPDIR"], ignore_errors=True)
    if res.returncode:
        sys.exit(f"{engine}/{workers} failed:\n{res.stderr[-3000:]}")
    out = json.loads(res.stdout.strip().splitlines()[-1])
    print(f"{engine} {workers or ''}{' cluster' if cluster else ''}: {out['wall']:.0f} s", file=sys.stderr, flush=True)
    return out


def _corpus(tmp: str, gb: float, name: str = "corpus") -> tuple[str, int]:
    from bench_clustering import generate

    corpus = os.path.join(tmp, name)
    os.makedirs(corpus)
    t = time.perf_counter()
    text = generate(corpus, int(gb * 1e9), seed=0)
    print(f"generated {text / 1e9:.2f} GB of JSONL text in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    return corpus, text


def _cpu(run: dict, stages, group: str | None = None) -> float:
    """CPU seconds of `stages`, one group or all of ours (driver + workers + ray; tasks are inside workers)."""
    groups = (group,) if group else ("driver", "workers", "ray")
    return sum(run["cpu"].get(s, {}).get(g, 0.0) for s in stages for g in groups)


def _others(run: dict) -> float:
    """Cores the rest of the machine (other engineers) used on average during the run."""
    st = run["cpu"].values()
    machine = sum(s["machine"] for s in st)
    ours = sum(s["driver"] + s["workers"] + s["ray"] for s in st)
    return max(machine - ours, 0.0) / max(sum(s["time"] for s in st), 1e-9)


def engines(args) -> None:
    if len(args.gb) > 1:
        marginal(args)
        return
    tmp = tempfile.mkdtemp(prefix="soma-bench-prepare-", dir="/tmp")
    try:
        corpus, _ = _corpus(tmp, args.gb[0])
        arms = [("local", 0), ("ray", 1), ("ray", 2)]
        runs, files = {}, {}
        for engine, workers in arms:
            camp = os.path.join(tmp, f"camp-{engine}-{workers}")
            runs[(engine, workers)] = run_one(args, corpus, camp, engine, workers)
            files[(engine, workers)] = digests(camp)
            shutil.rmtree(camp, ignore_errors=True)
        same = all(f == files[arms[0]] for f in files.values())
        mb = runs[arms[0]]["bytes"] / 1e6
        print(
            f"\n{mb / 1e3:.2f} GB JSONL text, N = {args.experts}, router sample {args.sample:,}, parts of "
            f"{args.part_mb} MB ({runs[arms[0]]['parts']}); campaigns identical across engines: {same} "
            f"({len(files[arms[0]])} files); machine: {os.cpu_count()} cores, other users' load during each run: "
            + ", ".join(f"{e} {w or ''} {_others(r):.2f} cores" for (e, w), r in runs.items())
        )
        stage_table(runs, arms, mb)
        overhead_table(runs, mb)
        check_projection(runs, mb)
        for a in arms:
            r = runs[a]
            print(
                f"{a[0]} {a[1] or ''}: wall {r['wall']:.1f} s, driver peak RSS {r['driver_rss_mib']:.0f} MiB, worker "
                f"peak private RSS {r['worker_rss_mib']:.0f} MiB, shard rows {r['rows'][0]}-{r['rows'][1]}"
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def marginal(args) -> None:
    """engines at two corpus sizes: local and Ray (1 worker) interleaved, small then big, `rounds` times. Each
    stage's CPU as fixed + marginal x MB: the marginal CPU-s/MB (the difference of a round's two runs over the
    difference of their MB) is what the corpus's size pays; the fixed part (the small run less marginal x its MB)
    is paid once (Ray's and the workers' start, imports, the router's load, a stage's scheduling)."""
    if len(args.gb) != 2 or args.gb[0] >= args.gb[1]:
        sys.exit("error: --gb takes one size, or two (small then big) for marginal costs; e.g. --gb 0.1 0.3")
    if args.rounds < 1:
        sys.exit("error: --rounds must be 1 or more")
    tmp = tempfile.mkdtemp(prefix="soma-bench-marginal-", dir="/tmp")
    arms = [("local", 0), ("ray", 1)]
    try:
        corpora = {gb: _corpus(tmp, gb, f"corpus-{gb}")[0] for gb in args.gb}
        rounds, same = [], True
        for _ in range(args.rounds):
            runs = {}
            for gb in args.gb:
                files = []
                for engine, workers in arms:
                    camp = os.path.join(tmp, "camp")
                    runs[(engine, gb)] = run_one(args, corpora[gb], camp, engine, workers)
                    files.append(digests(camp))
                    shutil.rmtree(camp, ignore_errors=True)
                same = same and files[0] == files[1]
            rounds.append(runs)
        marginal_report(args, rounds, same)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _fixed_marginal(rounds: list[dict], engine: str, gbs, stages, group: str | None) -> tuple[float, float]:
    """(fixed CPU-s, marginal CPU-s/MB) of `stages` in one engine, each the mean over the rounds."""
    fixed, marg = [], []
    for runs in rounds:
        lo, hi = runs[(engine, gbs[0])], runs[(engine, gbs[1])]
        m = (_cpu(hi, stages, group) - _cpu(lo, stages, group)) / ((hi["bytes"] - lo["bytes"]) / 1e6)
        marg.append(m)
        fixed.append(_cpu(lo, stages, group) - m * lo["bytes"] / 1e6)
    return sum(fixed) / len(fixed), sum(marg) / len(marg)


def marginal_report(args, rounds: list[dict], same: bool) -> None:
    gbs = args.gb
    r0 = rounds[0]
    print(
        f"\nN = {args.experts}, router sample {args.sample:,}, refit rows {args.refit_rows:,}, parts of "
        f"{args.part_mb} MB; {len(rounds)} round(s) of local, ray 1 at "
        + " and ".join(f"{r0[('local', g)]['bytes'] / 1e9:.3f} GB ({r0[('local', g)]['parts']} parts)" for g in gbs)
        + f"; campaigns identical across engines at each size: {same}; others' load per run (cores): "
        + "; ".join(", ".join(f"{e} {g} {_others(r):.2f}" for (e, g), r in runs.items()) for runs in rounds)
    )
    print(
        "\nEach stage's CPU (every process of the run) = fixed + marginal x MB, from the two sizes (mean of the "
        "rounds). ray 1's marginal split: tasks (the task processes' CPU while a task ran; of which task thread: the "
        "task's own thread, the rest Ray's threads in that process), worker overhead (worker processes outside "
        "the tasks), driver, Ray (raylet, gcs_server, agents).\n"
    )
    print(
        "| stage | local: CPU-s/MB | fixed CPU-s | ray 1: CPU-s/MB | fixed CPU-s | tasks | of which task thread "
        "| worker overhead | driver "
        "| Ray | ray / local per MB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    rows = [(s, (s,)) for s in STAGES] + [("parallel (read..write)", PARALLEL), ("serial (fit, refit)", SERIAL)]
    for label, stages in rows:
        lf, lm = _fixed_marginal(rounds, "local", gbs, stages, None)
        rf, rm = _fixed_marginal(rounds, "ray", gbs, stages, None)
        split = [
            _fixed_marginal(rounds, "ray", gbs, stages, g)[1] for g in ("tasks", "thread", "workers", "driver", "ray")
        ]
        ratio = f"{rm / lm:.2f}x" if lm > 1e-4 else "-"
        print(
            f"| {label} | {lm:.4f} | {lf:.1f} | {rm:.4f} | {rf:.1f} | {split[0]:.4f} | {split[1]:.4f} | "
            f"{split[2] - split[0]:.4f} | {split[3]:.4f} | {split[4]:.4f} | {ratio} |"
        )
    per_round = []
    for runs in rounds:
        one = [runs]
        per_round.append(
            _fixed_marginal(one, "ray", gbs, PARALLEL, None)[1] / _fixed_marginal(one, "local", gbs, PARALLEL, None)[1]
        )
    print("\nparallel stages, ray / local per MB in each round: " + ", ".join(f"{x:.2f}x" for x in per_round))
    for runs in rounds:
        print(
            "wall s: "
            + ", ".join(f"{e} {g}: {r['wall']:.0f}" for (e, g), r in runs.items())
            + "; parallel stages' CPU-s, all: "
            + ", ".join(f"{e} {g}: {_cpu(r, PARALLEL):.1f}" for (e, g), r in runs.items())
        )


def stage_table(runs: dict, arms: list, mb: float) -> None:
    print(
        "\nCPU-s/MB: every process of the run (driver + Ray workers + Ray's own), per MB of corpus text; MB/s per "
        "core = 1 / that. Wall s: the stage's wall time (shared host).\n"
    )
    head = " | ".join(f"{e}{' ' + str(w) if w else ''}: CPU-s/MB | MB/s/core | wall s" for e, w in arms)
    print(f"| stage | {head} | ray 1 / local |")
    print("|---|" + "---|" * (3 * len(arms) + 1))
    rows = [(s, (s,)) for s in STAGES] + [("parallel (read..write)", PARALLEL), ("serial (fit, refit)", SERIAL)]
    for label, stages in rows + [("all", STAGES)]:
        cells = []
        for a in arms:
            c = _cpu(runs[a], stages) / mb
            w = sum(runs[a]["cpu"].get(s, {}).get("time", 0.0) for s in stages)
            cells.append(f"{c:.4f} | {1 / c if c else 0:.1f} | {w:.1f}")
        loc = _cpu(runs[arms[0]], stages)
        ratio = f"{_cpu(runs[arms[1]], stages) / loc:.2f}x" if loc else "-"
        print(f"| {label} | " + " | ".join(cells) + f" | {ratio} |")


def overhead_table(runs: dict, mb: float) -> None:
    """Where the Ray engine's CPU goes in each parallel stage, against the local engine's (CPU-s/MB)."""
    print(
        "\nThe parallel stages' CPU-s/MB by process group. tasks: the Ray tasks' own process CPU while their "
        "function ran; worker overhead: Ray worker processes' CPU outside the tasks (serialising results into the "
        "object store, Ray Data's batch conversion, task start, idle workers); driver: the driver while the stage "
        "ran (Ray Data's executor and scheduling, deserialising results; in the local engine: all the work); Ray: "
        "gcs_server, raylet (object store, scheduling), agents.\n"
    )
    print("| stage | local: driver | ray w: tasks | worker overhead | driver | Ray | total | / local |")
    print("|---|---|---|---|---|---|---|---|")
    local = runs[("local", 0)]
    for w in (1, 2):
        r = runs[("ray", w)]
        for s in PARALLEL + ("parallel",):
            stages = PARALLEL if s == "parallel" else (s,)
            loc = _cpu(local, stages) / mb
            tasks = _cpu(r, stages, "tasks") / mb
            work = _cpu(r, stages, "workers") / mb
            drv, ray = _cpu(r, stages, "driver") / mb, _cpu(r, stages, "ray") / mb
            total = work + drv + ray
            print(
                f"| {s} | {loc:.4f} | {w}: {tasks:.4f} | {work - tasks:.4f} | {drv:.4f} | {ray:.4f} | {total:.4f} "
                f"| {total / loc:.2f}x |"
            )


def check_projection(runs: dict, mb: float) -> None:
    """The model's wall time for each Ray arm from the other arm's measured costs, against its measured wall.

    wall = setup + serial + parallel_wall(task CPU, all CPU, workers, cores), cores = 2 less what other users'
    processes took during the predicted run (measured), serial = the fit and refit's wall (driver alone)."""
    print(
        "\nProjection check on this host: each Ray arm's wall from the OTHER arm's CPU-s/MB (parallel stages) and "
        "serial seconds: T = setup + serial + max(task CPU / workers, all CPU / cores), cores = 2 - others' load.\n"
    )
    print(
        "| predicted | from | setup s | serial s | task CPU s | all CPU s: predicted | measured | cores | wall s: "
        "predicted | measured | error |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for w, src in ((1, 2), (2, 1)):
        r, s = runs[("ray", w)], runs[("ray", src)]
        setup = s["cpu"]["setup"]["time"]
        serial = sum(s["cpu"][x]["time"] for x in SERIAL)
        tasks = _cpu(s, PARALLEL, "tasks") / (s["bytes"] / 1e6) * mb
        allc = _cpu(s, PARALLEL) / (s["bytes"] / 1e6) * mb
        cores = os.cpu_count() - _others(r)
        pred = setup + serial + parallel_wall(tasks, allc, w, cores)
        meas = sum(r["cpu"][x]["time"] for x in STAGES)
        print(
            f"| ray {w} | ray {src} | {setup:.1f} | {serial:.1f} | {tasks:.1f} | {allc:.1f} | {_cpu(r, PARALLEL):.1f} "
            f"| {cores:.2f} | {pred:.1f} | {meas:.1f} | {pred / meas - 1:+.0%} |"
        )
    r = runs[("ray", 1)]
    proj = Projection(0.0, _cpu(r, PARALLEL) / mb)
    print(
        f"\nParallel stages, Ray engine, 1 worker: {proj.cpu_s_per_mb:.4f} CPU-s/MB = "
        f"{1 / proj.cpu_s_per_mb:.1f} MB/s per core; 1 TB (1e6 MB) on K nodes of 32 cores: "
        f"{proj.hours(1e6, 32):.2f} / K hours + the serial part (--part serial)"
    )


def fit_one(args) -> None:
    """One router fit + offsets refit at args.sample chunks of 1024 bytes from the corpus; prints one JSON line."""
    import numpy as np

    from soma_cluster.config import RouterConfig
    from soma_cluster.router import assign, fit_offsets, fit_router, size_spread

    texts: list[str] = []
    for name in sorted(os.listdir(args.corpus)):
        with open(os.path.join(args.corpus, name)) as fh:
            for line in fh:
                b = json.loads(line)["text"].encode()
                texts += [b[i : i + 1024].decode("utf-8", "ignore") for i in range(0, len(b) - 1023, 1024)]
                if len(texts) >= args.sample:
                    break
        if len(texts) >= args.sample:
            break
    if len(texts) < args.sample:
        sys.exit(f"corpus gives {len(texts)} chunks, fewer than {args.sample}")
    texts = texts[: args.sample]
    cfg = RouterConfig(max_features=50_000, min_df=5, svd_dim=128, sample_chunks=args.sample)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t, c = time.perf_counter(), time.process_time()
    router, _ = fit_router(texts, args.experts, cfg, 0)
    fit = (time.perf_counter() - t, time.process_time() - c)
    emb = router.embed(texts)
    del texts
    t, c = time.perf_counter(), time.process_time()
    offsets = fit_offsets(emb, router.centroids, router.offsets)
    refit = (time.perf_counter() - t, time.process_time() - c)
    print(
        json.dumps(
            {
                "n": args.sample,
                "fit_wall": fit[0],
                "fit_cpu": fit[1],
                "refit_wall": refit[0],
                "refit_cpu": refit[1],
                "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "base_mib": base,
                "spread": size_spread(np.bincount(assign(emb, router.centroids, offsets), minlength=args.experts)),
            }
        )
    )


def serial(args) -> None:
    tmp = tempfile.mkdtemp(prefix="soma-bench-serial-", dir="/tmp")
    try:
        corpus, _ = _corpus(tmp, max(args.fit_sizes) * 1100 / 1e9 * 1.15)
        points = []
        for n in args.fit_sizes:
            cmd = [sys.executable, os.path.abspath(__file__), "--fit-one", "--corpus", corpus, "--sample", str(n)]
            cmd += ["--experts", str(args.experts)]
            res = subprocess.run(
                cmd,
                capture_output=True,
                text=True,
                env={**os.environ, **ENV, **THREADS, "PYTHONPATH": os.path.dirname(HERE)},
            )
            if res.returncode:
                sys.exit(f"fit at {n} failed:\n{res.stderr[-3000:]}")
            points.append(json.loads(res.stdout.strip().splitlines()[-1]))
            p = points[-1]
            print(f"fit {n}: {p['fit_wall']:.0f} s, refit {p['refit_wall']:.0f} s", file=sys.stderr, flush=True)
        print(
            f"\nThe driver's serial part at N = {args.experts}, svd_dim 128, max_features 50,000, chunks of 1024 "
            "bytes; each size a fresh process (peak RSS: the whole process, texts included). Wall times under "
            "shared load (other engineers on the 2 cores); CPU seconds are the robust figure.\n"
        )
        print("| sample chunks | fit wall s | fit CPU s | refit wall s | refit CPU s | peak RSS MiB |")
        print("|---|---|---|---|---|---|")
        for p in points:
            print(
                f"| {p['n']:,} | {p['fit_wall']:.1f} | {p['fit_cpu']:.1f} | {p['refit_wall']:.1f} | "
                f"{p['refit_cpu']:.1f} | {p['rss_mib']:.0f} |"
            )
        if len(points) > 1:
            xs = [p["n"] for p in points]
            for key in ("fit_wall", "fit_cpu", "refit_cpu", "rss_mib"):
                if min(p[key] for p in points) <= 0:
                    continue  # below the clock's resolution: no power law
                f = power_fit(xs, [p[key] for p in points])
                print(
                    f"\n{key}: {f.a:.3g} * n^{f.b:.2f}; at 400,000: {f(400_000):.0f}; at 1,000,000: {f(1e6):.0f}",
                    end="",
                )
            print()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def scale(args) -> None:
    """The local engine and the Ray engine (1 worker) at two corpus sizes: the driver's peak RSS at each, and
    each stage's marginal CPU-s/MB (the difference of the two runs' CPU over the difference of their MB), which
    leaves out what a run pays once (Ray's start, worker processes' imports, the router's load)."""
    tmp = tempfile.mkdtemp(prefix="soma-bench-scale-", dir="/tmp")
    arms = [("local", 0), ("ray", 1)]
    try:
        runs = {}
        for gb in (args.gb[0], 2 * args.gb[0]):
            corpus, _ = _corpus(tmp, gb, f"corpus-{gb}")
            for engine, workers in arms:
                runs[(engine, gb)] = run_one(args, corpus, os.path.join(tmp, "camp"), engine, workers)
                shutil.rmtree(os.path.join(tmp, "camp"), ignore_errors=True)
            shutil.rmtree(corpus, ignore_errors=True)
        print(
            f"\nrouter sample {args.sample:,}, refit rows {args.refit_rows:,}, N = {args.experts}, parts of "
            f"{args.part_mb} MB; shared host\n"
        )
        print(
            "| engine | corpus GB | parts | driver peak RSS MiB | worker peak private RSS MiB | wall s | others' load |"
        )
        print("|---|---|---|---|---|---|---|")
        for (engine, _), r in runs.items():
            print(
                f"| {engine} | {r['bytes'] / 1e9:.2f} | {r['parts']} | {r['driver_rss_mib']:.0f} | "
                f"{r['worker_rss_mib']:.0f} | {r['wall']:.0f} | {_others(r):.2f} cores |"
            )
        print("\nMarginal CPU-s/MB (runs at 2 sizes: difference of CPU / difference of MB), every process of the run\n")
        print(
            "| stage | local | MB/s/core | ray 1: all | MB/s/core | of which tasks | worker overhead | driver | Ray "
            "| ray / local |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        small, big = args.gb[0], 2 * args.gb[0]
        for label, stages in [(x, (x,)) for x in PARALLEL] + [("parallel", PARALLEL), ("serial (fit, refit)", SERIAL)]:
            cells = []
            for engine in ("local", "ray"):
                lo, hi = runs[(engine, small)], runs[(engine, big)]
                dmb = (hi["bytes"] - lo["bytes"]) / 1e6

                groups = (None, "tasks", "workers", "driver", "ray") if engine == "ray" else (None,)
                cells.append([(_cpu(hi, stages, g) - _cpu(lo, stages, g)) / dmb for g in groups])
            loc, ray = cells
            print(
                f"| {label} | {loc[0]:.4f} | {1 / loc[0] if loc[0] > 0 else 0:.1f} | {ray[0]:.4f} | "
                f"{1 / ray[0] if ray[0] > 0 else 0:.1f} | {ray[1]:.4f} | {ray[2] - ray[1]:.4f} | {ray[3]:.4f} | "
                f"{ray[4]:.4f} | {ray[0] / loc[0] if loc[0] > 0 else 0:.2f}x |"
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def division(args) -> None:
    tmp = tempfile.mkdtemp(prefix="soma-bench-division-", dir="/tmp")
    try:
        corpus, _ = _corpus(tmp, args.gb[0])
        if args.uneven:  # the first two files as one: a part twice the others (a part is whole files)
            first, second = sorted(os.listdir(corpus))[:2]
            with open(os.path.join(corpus, first), "ab") as out, open(os.path.join(corpus, second), "rb") as src:
                shutil.copyfileobj(src, out)
            os.remove(os.path.join(corpus, second))
        sizes = sorted(os.path.getsize(os.path.join(corpus, f)) for f in os.listdir(corpus))
        r = run_one(args, corpus, os.path.join(tmp, "camp"), "ray", 0, cluster=True)
        nodes = sorted({t["node"] for t in r["tasks"]})
        from soma_cluster.corpus import plan_parts

        args.engine, args.corpus = "ray", corpus
        mb = {
            p.index: sum(os.path.getsize(f.path) for f in p.files) / 1e6
            for p in plan_parts(_config(args).corpus, args.part_mb * 10**6)
        }
        print(
            f"\nHead (0 CPUs, the driver) + 2 worker nodes of 1 CPU on 127.0.0.1; {r['bytes'] / 1e9:.2f} GB in "
            f"{r['parts']} parts, prepare.part_bytes {args.part_mb} MB (parts of {min(mb.values()):.1f}-"
            f"{max(mb.values()):.1f} MB on disk, mean {sum(mb.values()) / len(mb):.1f}; files of "
            f"{sizes[0] / 1e6:.1f}-{sizes[-1] / 1e6:.1f} MB); tasks ran on {len(nodes)} nodes. Shared host: "
            f"others' load {_others(r):.2f} cores.\n"
        )
        print(
            "| stage | tasks | per node | wall: mean s | slowest s | slowest / mean | CPU: mean s | most / mean "
            "| task wall s per MB of part: min-max | makespan of the tasks on 2 s | stage wall s | task CPU / wall |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for s in PARALLEL:
            ts = [t for t in r["tasks"] if t["stage"] == s]
            sp, spc = spread([t["wall_s"] for t in ts]), spread([t["cpu_s"] for t in ts])
            per_node = "/".join(str(sum(t["node"] == n for t in ts)) for n in nodes)
            cpu = sum(t["cpu_s"] for t in ts) / max(sum(t["wall_s"] for t in ts), 1e-9)
            if not ts:  # e.g. no part had sequences below the sample's key
                print(f"| {s} | 0 | - | - | - | - | - | - | - | - | {r['cpu'][s]['time']:.1f} | - |")
                continue
            rate = [t["wall_s"] / mb[t["part"]] for t in ts]
            print(
                f"| {s} | {sp.tasks} | {per_node} | {sp.mean_s:.2f} | {sp.max_s:.2f} | {sp.ratio:.2f} | "
                f"{spc.mean_s:.2f} | {spc.ratio:.2f} | {min(rate):.3f}-{max(rate):.3f} | "
                f"{makespan([t['wall_s'] for t in sorted(ts, key=lambda t: t['end'])], 2):.1f} | "
                f"{r['cpu'][s]['time']:.1f} | {cpu:.2f} |"
            )
        for s in ("read", "embed"):
            per = {t["part"]: t for t in r["tasks"] if t["stage"] == s}
            print(
                f"\n{s} tasks by part (MB on disk: wall s / CPU s): "
                + ", ".join(f"{p} ({mb[p]:.0f} MB: {t['wall_s']:.1f}/{t['cpu_s']:.1f})" for p, t in sorted(per.items()))
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("engines", "serial", "scale", "division"), default="engines")
    p.add_argument("--gb", type=float, nargs="+", default=[0.25], help="engines: two sizes give marginal costs")
    p.add_argument("--rounds", type=int, default=1, help="engines with two --gb: interleaved rounds")
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--sample", type=int, default=20_000, help="router.sample_chunks (the paper: 400k)")
    p.add_argument("--part-mb", type=int, default=64, help="prepare.part_bytes in MB")
    p.add_argument("--refit-rows", type=int, default=1_000_000, help="router.refit_rows (the driver's embeddings)")
    p.add_argument("--fit-sizes", type=int, nargs="+", default=[25_000, 50_000, 100_000], help="serial: sample sizes")
    p.add_argument("--uneven", action="store_true", help="division: one file (so one part) twice the others")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--fit-one", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--cluster", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--engine", default="local", help=argparse.SUPPRESS)
    p.add_argument("--workers", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--corpus", help=argparse.SUPPRESS)
    p.add_argument("--campaign", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        one(args)
    elif args.fit_one:
        fit_one(args)
    else:
        {"engines": engines, "serial": serial, "scale": scale, "division": division}[args.part](args)


if __name__ == "__main__":
    main()
