"""How fast a running campaign obeys `soma set`: the latency from the command to the driver applying the revision,
and to the first chunk that obeys it, at N = 64 experts (packed 16 to an actor on 4 logical GPUs of a local Ray).

Method: prepare and seed a tiny-preset campaign of N experts on the built-in corpus, launch it with a long target in
a process of its own, wait until every expert has trained, then lower budget.expert_gpu_hours below what each has
spent with `soma set ... --wait`. Measured on this host's clock (one host: the command, the driver and the events
share it): `applied_after_s` (soma set --json: until the driver logged config_revised), and from the command's start
to the first and the last `budget_exhausted` event (every expert obeying it at its next chunk). The campaign then
ends; `--raise` also raises the budget again and times `soma resume` back to training.

  PYTHONPATH=. python benchmarks/bench_live_budget.py [--experts 64] [--per-actor 16] [--dir /tmp/soma-live]

Measurement records: docs/results/benchmarks/bench_live_budget.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

ENV = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled", "PYTHONPATH": "."}


def soma(*args: str, timeout: float = 1800) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pipelines.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=ENV, check=False)


def events(camp: str) -> list[dict]:
    with open(os.path.join(camp, "events.jsonl"), "rb") as f:
        return [json.loads(line) for line in f.read().splitlines() if line.strip()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--per-actor", type=int, default=16)
    p.add_argument("--dir", default="/tmp/soma-live-budget")
    p.add_argument("--min-step", type=int, default=20, help="every expert trains this far before the change")
    args = p.parse_args()
    camp = os.path.join(args.dir, "c")
    shutil.rmtree(args.dir, ignore_errors=True)
    sets = [
        f"n_experts={args.experts}",
        "train.updates=100000",
        "train.checkpoint_every=50",
        "shards.min_train_seqs=16",
        "shards.val_fraction=0.05",
        "corpus.max_bytes=12000000",
        f"resources.experts_per_actor={args.per_actor}",
        "seed_stage.updates=20",
    ]
    t = time.monotonic()
    r = soma("prepare", camp, "--preset", "tiny", *[x for s in sets for x in ("--set", s)])
    assert r.returncode == 0, r.stderr[-3000:]
    r = soma("seed", camp, "--no-progress")
    assert r.returncode == 0, r.stderr[-3000:]
    print(f"prepared and seeded N={args.experts} in {time.monotonic() - t:.0f} s", flush=True)
    cmd = [sys.executable, "-m", "pipelines.cli", "launch", camp, "--no-progress"]
    launch = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        deadline = time.monotonic() + 1200
        while time.monotonic() < deadline:
            steps = {}
            for ev in events(camp):
                if ev["job"].startswith("expert-") and ev.get("step") is not None:
                    steps[ev["job"]] = max(steps.get(ev["job"], 0), ev["step"])
            if len(steps) == args.experts and min(steps.values()) >= args.min_step:
                break
            assert launch.poll() is None, launch.communicate()[1][-3000:]
            time.sleep(1.0)
        t0 = time.time()
        r = soma("set", camp, "budget.expert_gpu_hours=1e-7", "--wait", "120", "--json")
        assert r.returncode == 0, r.stderr[-3000:]
        doc = json.loads(r.stdout)
        _, err = launch.communicate(timeout=1200)
    finally:
        if launch.poll() is None:
            launch.kill()
    ends = sorted(ev["t"] for ev in events(camp) if ev["event"] == "budget_exhausted")
    revised = [ev["t"] for ev in events(camp) if ev["event"] == "config_revised"]
    print("\n| N | actors | driver applied (soma set --wait) | first chunk obeying | last expert stopped |")
    print("|---|---|---|---|---|")
    print(
        f"| {args.experts} | {-(-args.experts // args.per_actor)} | {doc['applied_after_s']:.2f} s "
        f"(config_revised {revised[0] - t0:.2f} s after the command) | {ends[0] - t0:.2f} s | {ends[-1] - t0:.2f} s |"
    )
    print(f"{len(ends)} of {args.experts} experts ended budget_exhausted; launch exit {launch.returncode}")


if __name__ == "__main__":
    main()
