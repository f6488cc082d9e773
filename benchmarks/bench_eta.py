"""The ETA and `soma plan` against what happened: a real tiny-preset campaign, its ETA's error over time and the
plan's GPU-hours and wall time against the ledger's and the events log's.

Method: prepare (the tiny preset, N experts, train.updates U; `--machine` reads the machine's own text, ~250 MB,
capped at --max-bytes, as N = 256 needs: fine for a benchmark, never for a test), seed, `soma plan` (its
calibration, the concurrent probe included), then `soma launch --no-progress --log-every 5`, whose summary lines
carry the ETA the driver showed. Then, from the campaign alone: the events log reduced to a trace
(soma_cluster/eta.py trace_rows) and the estimator replayed over it every 5 s (replay): its error at 10, 25, 50 and
75% progress (updates made over updates to make, as the progress bar counts) and of time; the driver's own ETA
lines against the true end; `soma status`'s plan-against-actual rows. `--record tests/assets/eta_trace_nN` writes
the trace (.csv) and what the tests need to check the plan without running (.json: the config's overrides, the
calibration, the GPUs and cores, the ledger's totals, the stage's wall time).

  PYTHONPATH=. python benchmarks/bench_eta.py --experts 4                      # make demo's size, about 2 min
  PYTHONPATH=. python benchmarks/bench_eta.py --experts 256 --updates 60 --machine --dir /tmp/eta256   # ~25 min
  PYTHONPATH=. python benchmarks/bench_eta.py --campaign /tmp/eta256           # an ended campaign: the report only

Not in `make test`. Numbers measured on a shared 2-core host are in the commit that added this script.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from soma_cluster.campaignfile import load_campaign_config  # noqa: E402
from soma_cluster.costmodel import PLAN, actors_at_once, predict  # noqa: E402
from soma_cluster.eta import Prior, Tick, replay, trace_rows  # noqa: E402
from soma_cluster.ledger import Ledger  # noqa: E402
from soma_cluster.storage import Store  # noqa: E402

ENV = {
    **os.environ,
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
}
TICK_S = 5.0  # the driver's snapshot period: when an ETA is shown
MARKS = (0.10, 0.25, 0.50, 0.75)
LINE = re.compile(r"elapsed (\d+):(\d\d):(\d\d) \| ETA (\d+):(\d\d):(\d\d)")


def soma(*args: str, log: str | None = None) -> None:
    cmd = [sys.executable, "-m", "pipelines.cli", *args]
    t = time.monotonic()
    with open(log or os.devnull, "w") as err:
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=ENV, check=False)
    print(f"soma {args[0]}: {time.monotonic() - t:.0f} s", file=sys.stderr)
    if r.returncode != 0:
        sys.exit(f"soma {' '.join(args)} failed (exit {r.returncode}); see {log}")


def run(args: argparse.Namespace) -> tuple[str, list[float]]:
    """A whole campaign: prepare, seed, plan, launch (its stderr kept in launch.log beside the campaign), with the
    driver SIGKILLed and resumed, or the config revised, where asked. Returns the campaign and when drivers
    (re)started (wall time)."""
    camp = os.path.join(args.dir, "c")
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    sets = [f"n_experts={args.experts}", f"train.updates={args.updates}", *args.set]
    if args.machine:
        sets += ["corpus.source=machine", f"corpus.max_bytes={args.max_bytes}"]
    soma("prepare", camp, "--preset", "tiny", *[x for s in sets for x in ("--set", s)])
    soma("seed", camp, "--no-progress")
    soma("plan", camp)
    log = open(os.path.join(args.dir, "launch.log"), "w")  # noqa: SIM115  both drivers write it
    starts, total = [time.time()], args.experts * args.updates
    cmd = [sys.executable, "-m", "pipelines.cli"]
    proc = subprocess.Popen([*cmd, "launch", camp, "--no-progress", "--log-every", "5"], stderr=log, env=ENV)
    todo = sorted([(args.kill_at, "kill")] * (args.kill_at is not None) + [(args.revise_at, "set")] * bool(args.revise))
    while proc.poll() is None:
        time.sleep(0.5)
        done = sum(progress(camp).values()) / total
        while todo and done >= todo[0][0]:
            what = todo.pop(0)[1]
            print(f"{what} at {done:.0%} of the updates", file=sys.stderr)
            if what == "set":
                soma("set", camp, *args.revise)
                continue
            proc.send_signal(signal.SIGKILL)  # the driver only: its actors go with it
            proc.wait()
            starts.append(time.time())
            proc = subprocess.Popen([*cmd, "resume", camp, "--no-progress", "--log-every", "5"], stderr=log, env=ENV)
    log.close()
    if proc.returncode != 0:
        sys.exit(f"the launch failed (exit {proc.returncode}); see {args.dir}/launch.log")
    return camp, starts


def progress(camp: str) -> dict[str, int]:
    """Each expert's newest step, from the events log as it is written (a line cut short is skipped)."""
    step: dict[str, int] = {}
    try:
        with open(os.path.join(camp, "events.jsonl"), "rb") as f:
            for line in f.read().splitlines():
                try:
                    e = json.loads(line)
                except ValueError:
                    continue
                if e["event"] == "heartbeat" and e["job"].startswith("expert-"):
                    step[e["job"]] = e["step"]
    except FileNotFoundError:
        pass
    return step


def stage_events(camp: str) -> list[dict]:
    with open(os.path.join(camp, "events.jsonl"), "rb") as f:
        rows = [json.loads(line) for line in f.read().splitlines() if line.strip()]
    return [e for e in rows if e["job"].startswith("expert-")]


def at(ticks: list[Tick], key, mark: float) -> Tick | None:
    return next((k for k in ticks if key(k) >= mark and k.eta_s is not None), None)


def error_table(ticks: list[Tick]) -> list[str]:
    """The ETA's error of the time left, and of the predicted end (against the whole stage), at each mark."""
    total = ticks[-1].t + ticks[-1].left_s
    out = [f"stage {total:.0f} s; ETA replayed every {TICK_S:.0f} s (error of the time left / of the end)"]
    for name, key in (("updates", lambda k: k.done), ("time", lambda k: k.t / total)):
        cells = []
        for m in MARKS:
            k = at(ticks, key, m)
            cells.append("-" if k is None else f"{k.eta_s / k.left_s - 1:+.0%} / {(k.t + k.eta_s) / total - 1:+.1%}")
        out.append(f"  by {name:7s} " + "  ".join(f"{m:.0%}: {c}" for m, c in zip(MARKS, cells, strict=True)))
    worst = max(
        (abs(k.eta_s / k.left_s - 1) for k in ticks if k.eta_s is not None and k.done >= 0.10 and k.left_s > TICK_S),
        default=None,
    )
    out.append(
        f"  worst error of the time left from 10% of the updates on (more than {TICK_S:.0f} s left): "
        + ("-" if worst is None else f"{worst:.0%}")
    )
    return out


def live_lines(camp: str, log: str, end: float) -> list[str]:
    """The driver's own ETA (its summary lines) against the true time left."""
    if not os.path.exists(log):
        return []
    started = Store(camp).read_json("status.json").get("driver_started_at")
    out = ["driver's own ETA (summary lines): elapsed, ETA, true time left"]
    got = []
    with open(log) as f:
        lines = f.read().splitlines()
    for line in lines:
        m = LINE.search(line)
        if m and started:
            h, mi, s, eh, em, es = map(int, m.groups())
            now = started + h * 3600 + mi * 60 + s
            got.append((now - started, eh * 3600 + em * 60 + es, end - now))
    for e, eta, left in got[:: max(1, len(got) // 12)]:
        out.append(f"  {e:6.0f} s  ETA {eta:6.0f} s  true {left:6.0f} s  ({eta / left - 1:+.0%})" if left > 0 else "")
    return out


def plan_lines(camp: str, facts: dict) -> list[str]:
    store = Store(camp)
    plan = store.read_json(PLAN)
    cfg = load_campaign_config(store)
    again = predict(cfg, facts["calibration"], facts["gpus"], facts["cores"], {}, True)  # this code on its inputs
    out = ["plan against what happened (GPU-hours: the ledger's expert_training; wall: first queued to last end)"]
    for what, made, now, actual in (
        (
            "GPU-hours",
            plan["gpu_hours"]["expert_training"],
            again["gpu_hours"]["expert_training"],
            facts["ledger"]["expert_training"],
        ),
        ("wall s", plan["wall_seconds"]["experts"], again["wall_seconds"]["experts"], facts["wall_s"]),
    ):
        out.append(
            f"  {what:9s} plan {made:10.4f} ({made / actual - 1:+.1%})  this code {now:10.4f} "
            f"({now / actual - 1:+.1%})  actual {actual:10.4f}"
        )
    out.append(
        f"  unbilled (queued actors' start-up): {again['unbilled_gpu_hours']:.4f} GPU-hours; "
        f"contention {again['cpu_contention']:.2f}x"
    )
    return out


def facts_of(camp: str, rows: list[dict]) -> dict:
    """What a test needs to check the plan without running: the config's overrides, calibration, GPUs, cores, the
    ledger's totals by category (GPU-hours) and the stage's wall time (s)."""
    store = Store(camp)
    plan = store.read_json(PLAN)
    cfg = load_campaign_config(store)
    totals = Ledger(store).totals()
    cal = {k: v for k, v in plan["calibration"].items() if k != "checksum"}
    return {
        "overrides": {"n_experts": cfg.n_experts, "train": {"updates": cfg.train.updates}},
        "lanes": actors_at_once(cfg, plan["gpus"]) * cfg.resources.experts_per_actor,
        "target": cfg.train.updates,
        "gpus": plan["gpus"],
        "cores": plan["cores"],
        "calibration": cal,
        "prior": plan.get("actor", {}).get("experts"),
        "ledger": {str(k): v / 3600.0 for k, v in totals.gpu_seconds.items()},
        "wall_s": max(
            r["t"] for r in rows if r["event"] in ("finished", "converged", "budget_exhausted", "failed_permanently")
        ),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--updates", type=int, default=300)
    p.add_argument("--machine", action="store_true", help="corpus.source=machine (a benchmark only, never a test)")
    p.add_argument("--max-bytes", type=int, default=45_000_000)
    p.add_argument("--dir", default="/tmp/soma-bench-eta")
    p.add_argument("--set", action="append", default=[], help="another override for prepare (repeatable)")
    p.add_argument("--kill-at", type=float, help="SIGKILL the driver at this fraction of the updates, then resume")
    p.add_argument("--revise", action="append", default=[], help="KEY=VALUE for soma set during the launch")
    p.add_argument("--revise-at", type=float, default=0.3, help="when --revise is applied (fraction of the updates)")
    p.add_argument("--campaign", help="an ended campaign to report on (nothing is run)")
    p.add_argument("--record", help="write the trace and its facts to RECORD.csv and RECORD.json")
    args = p.parse_args()
    camp = args.campaign or run(args)
    log = (
        os.path.join(os.path.dirname(camp), "launch.log")
        if not args.campaign
        else os.path.join(camp, "..", "launch.log")
    )
    rows = trace_rows(stage_events(camp))
    facts = facts_of(camp, rows)
    prior = Prior(**facts["prior"]) if facts["prior"] else None
    ticks = replay(rows, facts["target"], facts["lanes"], TICK_S, prior)
    end = max(
        e["t"]
        for e in stage_events(camp)
        if e["event"] in ("finished", "converged", "budget_exhausted", "failed_permanently")
    )
    print(f"{camp}: N = {facts['overrides']['n_experts']}, {facts['target']} updates, {facts['lanes']} lanes")
    for line in error_table(ticks) + live_lines(camp, log, end) + plan_lines(camp, facts):
        print(line)
    if args.record:
        with open(args.record + ".csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["t", "event", "job", "attempt", "step"])
            w.writeheader()
            w.writerows(rows)
        with open(args.record + ".json", "w") as f:
            json.dump(facts, f, indent=1, sort_keys=True)
            f.write("\n")
        print(f"recorded {args.record}.csv ({len(rows)} rows) and {args.record}.json", file=sys.stderr)


if __name__ == "__main__":
    main()
