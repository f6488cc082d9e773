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
  PYTHONPATH=. python benchmarks/bench_eta.py --experts 256 --updates 60 --machine --dir /tmp/eta256   # 20-45 min
  PYTHONPATH=. python benchmarks/bench_eta.py --campaign /tmp/eta256 [--plan P --log L]   # an ended campaign

Cases: --set KEY=VALUE (prepare's overrides: resources.num_gpus=0.5, resources.reuse_actors=true ...), --kill-at F
(SIGKILL the driver at that fraction of the updates, then `soma resume`), --fail-at F (SIGKILL the running actors:
retries), --revise KEY=VALUE [--revise-at F] (`soma set` while it runs). The report also gives the model's own error
(the same lanes given the start-up and speed the run then had, `hindsight_s`) and the plan's model on the run's own
times (soma_cluster/costmodel.py times_of_run), which separate the model from how the machine's speed changed.
Not in `make test`. Numbers measured on a shared 2-core host are in the commits that added this script.
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
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from soma_cluster.campaignfile import load_campaign_config  # noqa: E402
from soma_cluster.costmodel import PLAN, actors_at_once, predict, times_of_run  # noqa: E402
from soma_cluster.eta import Prior, Tick, replay, trace_rows  # noqa: E402
from soma_cluster.jobs import ENDS  # noqa: E402
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
LINE = re.compile(r"^\[soma (\d\d):(\d\d):(\d\d)\].*\| ETA (?:(\d+):(\d\d):(\d\d))?")


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
    todo = sorted(
        [(args.kill_at, "kill")] * (args.kill_at is not None)
        + [(args.revise_at, "set")] * bool(args.revise)
        + [(args.fail_at, "fail")] * (args.fail_at is not None)
    )
    while proc.poll() is None:
        time.sleep(0.5)
        done = sum(progress(camp).values()) / total
        while todo and done >= todo[0][0]:
            what = todo.pop(0)[1]
            print(f"{what} at {done:.0%} of the updates", file=sys.stderr)
            if what == "set":
                soma("set", camp, *args.revise)
                continue
            if what == "fail":  # the running actors' processes die: each attempt fails and is retried
                for pid in running_pids(camp):
                    os.kill(pid, signal.SIGKILL)
                continue
            proc.send_signal(signal.SIGKILL)  # the driver only: its actors go with it
            proc.wait()
            starts.append(time.time())
            proc = subprocess.Popen([*cmd, "resume", camp, "--no-progress", "--log-every", "5"], stderr=log, env=ENV)
    log.close()
    if proc.returncode != 0:
        sys.exit(f"the launch failed (exit {proc.returncode}); see {args.dir}/launch.log")
    return camp, starts


def running_pids(camp: str) -> list[int]:
    """The processes of the attempts that started and have not ended (their `started` events say which)."""
    pid: dict[str, int] = {}
    for e in read_events(camp):
        if e["event"] == "started" and e["job"].startswith("expert-"):
            pid[e["job"]] = e["pid"]
        elif e["event"] in ("finished", "failed", "preempted", "budget_exhausted", "converged"):
            pid.pop(e["job"], None)
    return sorted(set(pid.values()))


def read_events(camp: str) -> list[dict]:
    """The events log as it is written (a line cut short is skipped)."""
    out = []
    try:
        with open(os.path.join(camp, "events.jsonl"), "rb") as f:
            for line in f.read().splitlines():
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
    except FileNotFoundError:
        pass
    return out


def progress(camp: str) -> dict[str, int]:
    """Each expert's newest step, from the events log as it is written."""
    return {e["job"]: e["step"] for e in read_events(camp) if e["event"] == "heartbeat" and e["job"] != "seed"}


def stage_events(camp: str) -> list[dict]:
    return [e for e in read_events(camp) if e["job"].startswith("expert-")]


def at(ticks: list[Tick], key, mark: float) -> Tick | None:
    return next((k for k in ticks if key(k) >= mark and k.eta_s is not None), None)


def error_table(ticks: list[Tick]) -> list[str]:
    """At each mark: the ETA's error of the time left and of the predicted end (against the whole stage), and the
    model's own (the same lanes given the start-up and speed that came after: what is left is the machine's)."""
    total = ticks[-1].t + ticks[-1].left_s
    out = [f"stage {total:.0f} s; ETA replayed every {TICK_S:.0f} s: error of the time left / of the end [model's own]"]
    for name, key in (("updates", lambda k: k.done), ("time", lambda k: k.t / total)):
        cells = []
        for m in MARKS:
            k = at(ticks, key, m)
            model = "-" if k is None or k.hindsight_s is None else f"{k.hindsight_s / k.left_s - 1:+.1%}"
            cells.append(
                "-" if k is None else f"{k.eta_s / k.left_s - 1:+.0%} / {(k.t + k.eta_s) / total - 1:+.1%} [{model}]"
            )
        out.append(f"  by {name:7s} " + "  ".join(f"{m:.0%}: {c}" for m, c in zip(MARKS, cells, strict=True)))
    late = [k for k in ticks if k.eta_s is not None and 0.10 <= k.done <= 0.95]
    worst = max((abs(k.eta_s / k.left_s - 1) for k in late), default=None)
    model = max((abs(k.hindsight_s / k.left_s - 1) for k in late if k.hindsight_s is not None), default=None)
    out.append(
        "  worst error of the time left from 10% to 95% of the updates: "
        + ("-" if worst is None else f"{worst:.0%}")
        + (" [model's own: -]" if model is None else f" [model's own: {model:.1%}]")
    )
    return out


def live_lines(log: str, end: float) -> list[str]:
    """The drivers' own ETA (their summary lines, `[soma HH:MM:SS] ... | ETA H:MM:SS`) against the true time left."""
    if not os.path.exists(log):
        return []
    day = time.localtime(end)
    got = []
    with open(log) as f:
        lines = f.read().splitlines()
    for line in lines:
        m = LINE.search(line)
        if m and m.group(4) is not None:
            hh, mm, ss, eh, em, es = map(int, m.groups())
            now = time.mktime((day.tm_year, day.tm_mon, day.tm_mday, hh, mm, ss, 0, 0, -1))
            got.append((now, eh * 3600 + em * 60 + es, end - now))
    out = ["the drivers' own ETA (their summary lines): ETA, true time left"]
    t0 = got[0][0] if got else 0.0
    for now, eta, left in got[:: max(1, len(got) // 12)]:
        if left > 0:
            out.append(f"  at {now - t0:6.0f} s  ETA {eta:6.0f} s  true {left:6.0f} s  ({eta / left - 1:+.0%})")
    return out


def plan_lines(camp: str, facts: dict, rows: list[dict]) -> list[str]:
    """`soma plan` against the ledger and the events: as it was made (before the launch, its calibration then), this
    code on that calibration, this code on the times the run itself took (the model's own error, apart from how
    well the calibration foresaw the machine), and that again billed as the model did before 2026-12 (every
    actor's start-up counted)."""
    cfg = load_campaign_config(Store(camp))
    cal, gpus, cores = facts["calibration"], facts["gpus"], facts["cores"]
    again = predict(cfg, cal, gpus, cores, {}, True)
    ran = predict(cfg, {**cal, "concurrent": facts["measured"]}, gpus, cores, {}, True)
    hours, wall = facts["ledger"]["expert_training"], facts["wall_s"]
    out = [
        "plan against what happened (GPU-hours: the ledger's expert_training; wall s: first queued to last end)",
        f"  actual                          {hours:8.4f} GPU-hours  {wall:7.0f} s",
    ]
    for what, p in (
        ("as made (its own calibration)", facts["plan_made"]),
        ("this code, that calibration", again),
        ("this code, the run's own times", ran),
    ):
        h, w = p["gpu_hours"]["expert_training"], p["wall_seconds"]["experts"]
        out.append(f"  {what:31s} {h:8.4f} ({h / hours - 1:+6.1%})   {w:7.0f} ({w / wall - 1:+6.1%})")
    old = ran["gpu_hours"]["expert_training"] + ran["unbilled_gpu_hours"]
    out.append(f"  the run's own times, every start-up billed (the old model) {old:.4f} ({old / hours - 1:+.1%})")
    m = facts["measured"]
    out.append(
        f"  the run's times (costmodel.times_of_run): boot {m['boot_s']:.2f} s, load "
        f"{m['load_s']:.2f} s, {m['update_s']:.4f} s per update; calibration's probe: "
        + (
            "none"
            if not cal.get("concurrent")
            else f"boot {cal['concurrent']['boot_s']:.2f} s, {cal['concurrent']['update_s']:.4f} s per update"
        )
    )
    return out


def facts_of(camp: str, rows: list[dict], plan: dict) -> dict:
    """What a test needs to check the plan without running: the config's overrides, the plan as made and its
    calibration, GPUs, cores, the times the run took (costmodel.times_of_run), the ledger's totals by category
    (GPU-hours) and the stage's wall time (s)."""
    store = Store(camp)
    cfg = load_campaign_config(store)
    totals = Ledger(store).totals()
    lanes = actors_at_once(cfg, plan["gpus"])
    return {
        "overrides": {"n_experts": cfg.n_experts, "train": {"updates": cfg.train.updates}},
        "lanes": lanes * cfg.resources.experts_per_actor,
        "target": cfg.train.updates,
        "reuse": cfg.resources.reuse_actors,
        "gpus": plan["gpus"],
        "cores": plan["cores"],
        "calibration": {k: v for k, v in plan["calibration"].items() if k != "checksum"},
        "plan_made": {k: plan[k] for k in ("gpu_hours", "wall_seconds", "unbilled_gpu_hours") if k in plan},
        "prior": plan.get("actor", {}).get("experts"),
        "measured": times_of_run(rows, lanes, cfg.resources.experts_per_actor),
        "ledger": {str(k): v / 3600.0 for k, v in totals.gpu_seconds.items()},
        "wall_s": max(r["t"] for r in rows if r["event"] in ENDS),
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
    p.add_argument("--fail-at", type=float, help="SIGKILL the running actors at this fraction: retries")
    p.add_argument("--campaign", help="an ended campaign to report on (nothing is run)")
    p.add_argument("--log", help="the launch's stderr, for the drivers' own ETA (default: launch.log beside it)")
    p.add_argument(
        "--plan", help="the plan to judge (a plan.json kept from before the launch; default: the campaign's)"
    )
    p.add_argument("--record", help="write the trace and its facts to RECORD.csv and RECORD.json")
    args = p.parse_args()
    camp, starts = (args.campaign, []) if args.campaign else run(args)
    log = args.log or os.path.join(os.path.dirname(os.path.abspath(camp)), "launch.log")
    rows = trace_rows(stage_events(camp), starts[1:])
    plan = json.loads(Path(args.plan).read_text()) if args.plan else Store(camp).read_json(PLAN)
    facts = facts_of(camp, rows, plan)
    prior = Prior(**facts["prior"]) if facts["prior"] else None
    ticks = replay(rows, facts["target"], facts["lanes"], TICK_S, prior, facts["reuse"])
    end = max(e["t"] for e in stage_events(camp) if e["event"] in ENDS)
    print(f"{camp}: N = {facts['overrides']['n_experts']}, {facts['target']} updates, {facts['lanes']} lanes")
    for line in error_table(ticks) + live_lines(log, end) + plan_lines(camp, facts, rows):
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
