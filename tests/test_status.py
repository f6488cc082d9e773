"""`soma status` without Ray: job states derived from the scheduler (not the last event), the snapshot's schema,
the fallback to the events log for a campaign without status.json, and a piped table that cuts nothing."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

from conftest import micro_config, soma
from rich.console import Console
from test_schedule import beat, by, scheduler, started

from pipelines.status import Watch, load_status, print_full, render, watch_step
from soma_cluster.config import to_yaml_text
from soma_cluster.ledger import CATEGORIES
from soma_cluster.schedule import Lost, Start
from soma_cluster.snapshot import SNAPSHOT, STATES, build, eta_s, scheduler_rows, summary_line

ROW_KEYS = {
    "job",
    "expert",
    "state",
    "step",
    "target",
    "val",
    "loss",
    "gpu_hours",
    "budget_left_gpu_hours",
    "retries",
    "failures",
    "node",
    "device",
    "last_error",
    "heartbeat_age_s",
}


def test_states_come_from_the_scheduler_not_the_last_event(tmp_path):
    now = [0.0]
    s = scheduler(
        tmp_path,
        clock=now,
        n_experts=4,
        budget={"expert_gpu_hours": 1.0, "pool_policy": "even"},
        retry={"max_retries": 1, "backoff_s": 10.0},
    )
    s.restore({})
    units = [a.unit for a in by(s.requests(2, 2), Start)]
    state = lambda: {r["job"]: r["state"] for r in scheduler_rows(s).values()}  # noqa: E731
    assert state() == {
        "expert-0000": "queued",
        "expert-0001": "queued",
        "expert-0002": "pending",
        "expert-0003": "pending",
    }
    s.on_setup(units[0].id, started([0]))
    s.on_chunk(units[0].id, _report(0, beat(3, 2.0, 24)))
    s.on_setup(units[1].id, started([1]))
    assert state()["expert-0000"] == "running" and state()["expert-0001"] == "running"
    # expert 1 fails: it waits out its backoff as "retrying" (its last event is retry_scheduled)
    s.on_lost(units[1].id, Lost("actor_died", "boom"))
    assert state()["expert-0001"] == "retrying"
    # expert 0 finishes early (budget_exhausted) -> the pool grants expert 1 budget: it still reads "retrying",
    # not "budget_granted" (which is the last event written for it)
    s.on_chunk(units[0].id, _report(0, beat(6, 3.0, 48, reason="budget_exhausted")))
    assert s.store.read_log("events.jsonl")[-1]["event"] == "budget_granted"
    assert state()["expert-0000"] == "budget_exhausted" and state()["expert-0001"] == "retrying"
    rows = scheduler_rows(s)
    assert set(rows["expert-0001"]) == ROW_KEYS
    assert rows["expert-0001"]["retries"] == 1 and rows["expert-0001"]["last_error"] == "actor_died: boom"
    assert (
        rows["expert-0000"]["step"] == 6
        and rows["expert-0000"]["node"] == "127.0.0.1"
        and rows["expert-0000"]["device"] == "cpu"
    )
    assert rows["expert-0002"]["budget_left_gpu_hours"] > 1.0 and rows["expert-0000"]["budget_left_gpu_hours"] is None
    # (expert 2 got a third of expert 0's unspent hour from the pool: budget left is what it may really spend)
    # after the backoff it is queued again, still a retry
    now[0] = 100.0
    by(s.requests(4, 4), Start)
    assert state()["expert-0001"] == "retrying"


def _report(expert, hb):
    from soma_cluster.messages import ChunkReport

    return ChunkReport({expert: hb}, 1.0)


def test_snapshot_schema_eta_and_summary_line(tmp_path):
    s = scheduler(tmp_path, n_experts=2)
    s.restore({})
    rows = scheduler_rows(s)
    snap = build(
        cfg=s.cfg,
        url=s.store.url,
        rows=rows,
        by_category_s={"seed": 36.0, "expert_training": 72.0},
        devices={"cpu": 108.0},
        started_at=0.0,
        rate=None,
        final=False,
        source="driver",
    )
    assert {
        "schema",
        "source",
        "campaign",
        "name",
        "preset",
        "written_at",
        "driver_started_at",
        "elapsed_s",
        "final",
        "unit",
        "counts",
        "gpu_hours",
        "gpu_hours_total",
        "budget",
        "eta_s",
        "losses",
        "jobs",
    } <= set(snap)
    assert snap["schema"] == 1 and set(snap["gpu_hours"]) == set(CATEGORIES) and set(snap["counts"]) <= set(STATES)
    assert abs(snap["gpu_hours_total"] - 0.03) < 1e-12 and snap["unit"] == "logical GPU-hours on cpu"
    line = summary_line(snap)
    assert "\n" not in line and "2 pending" in line and "0.0300 logical GPU-hours on cpu" in line and "ETA" in line
    assert "| loss train - val - |" in line  # none measured yet
    jobs = [{"target": 12, "step": 6, "state": "running"}, {"target": 12, "step": 12, "state": "finished"}]
    assert eta_s(jobs, rate=2.0) == 3.0 and eta_s(jobs, None) is None and eta_s(jobs[1:], None) == 0.0


def test_status_without_a_snapshot_reads_the_events_log_and_cuts_nothing_when_piped(tmp_path):
    cfg = micro_config(n_experts=3, name="a-campaign-name-long-enough-to-be-cut-by-an-80-column-table")
    camp = tmp_path / "c"
    camp.mkdir()
    (camp / "campaign.yaml").write_text(to_yaml_text(cfg))
    from soma_cluster.events import emit
    from soma_cluster.storage import Store

    store = Store(str(camp))
    emit(store, "queued", "expert-0001", attempt=0)
    emit(store, "started", "expert-0001", attempt=0, step=0, device="cpu", node_ip="10.0.0.7")
    emit(store, "failed", "expert-0001", attempt=0, step=3, reason="exception: RuntimeError: " + "x" * 120)
    snap = load_status(store, cfg)
    assert snap["source"] == "events" and not (camp / SNAPSHOT).exists()
    assert [r["state"] for r in snap["jobs"]] == ["pending", "pending", "retrying", "pending"]
    buf = io.StringIO()
    print_full(Console(file=buf, width=80), render(snap))
    text = buf.getvalue()
    assert "expert-0001" in text and "x" * 120 in text and cfg.name in text and "…" not in text
    # the CLI: the table on stdout, nothing on stderr; --json is one document with the same rows
    proc = soma("status", str(camp))
    assert proc.returncode == 0 and "expert-0002" in proc.stdout and "10.0.0.7" in proc.stdout and proc.stderr == ""
    doc = json.loads(soma("status", str(camp), "--json").stdout)
    assert doc["schema"] == 1 and [r["job"] for r in doc["jobs"]] == [
        "seed",
        "expert-0000",
        "expert-0001",
        "expert-0002",
    ]
    assert doc["jobs"][2]["retries"] == 1 and doc["jobs"][2]["node"] == "10.0.0.7"


def test_watch_refreshes_a_live_snapshot_a_bounded_number_of_times(tmp_path):
    from soma_cluster.storage import Store

    s = scheduler(tmp_path, n_experts=2)
    s.restore({})
    (tmp_path / "c").mkdir(exist_ok=True)
    (tmp_path / "c" / "campaign.yaml").write_text(to_yaml_text(s.cfg))
    snap = build(
        cfg=s.cfg,
        url=s.store.url,
        rows=scheduler_rows(s),
        by_category_s={},
        devices={},
        started_at=0.0,
        rate=None,
        final=False,
        source="driver",
    )
    Store(str(tmp_path / "c")).write_json(SNAPSHOT, snap)
    proc = soma("status", str(tmp_path / "c"), "--watch", "--interval", "0.2", "--count", "3")
    assert proc.returncode == 0 and proc.stdout.count("expert-0001") == 3, proc.stdout
    snap["written_at"] -= 3600  # a driver silent for an hour: STALE, and the watch waits --wait for a new driver
    Store(str(tmp_path / "c")).write_json(SNAPSHOT, snap)
    proc = soma("status", str(tmp_path / "c"), "--watch", "--interval", "0.2", "--wait", "0.5")
    assert proc.returncode == 0 and 1 <= proc.stdout.count("expert-0001") <= 6 and "STALE" in proc.stdout
    assert "no driver took" in proc.stderr and "--wait" in proc.stderr, proc.stderr
    assert json.loads(soma("status", str(tmp_path / "c"), "--json").stdout)["stale"] is True


def test_plan_against_actual_once_every_job_ended(tmp_path):
    from pipelines.status import PLAN, plan_vs_actual
    from soma_cluster.ledger import Ledger
    from soma_cluster.storage import Store

    store = Store(str(tmp_path / "c"))
    for job, t0, t1 in (("seed", 0.0, 100.0), ("expert-0000", 200.0, 400.0)):
        store.append("events.jsonl", {"event": "queued", "job": job, "t": t0, "attempt": 0})
        store.append("events.jsonl", {"event": "finished", "job": job, "t": t1, "attempt": 0})
    Ledger(store).record(category="seed", gpu_seconds=360.0, wall_seconds=100.0)
    Ledger(store).record(category="expert_training", gpu_seconds=720.0, wall_seconds=200.0, expert=0)
    plan = {
        "gpus": 1,
        "seed_trained": False,
        "gpu_hours": {"seed": 0.11, "expert_training": 0.18, "wasted": 0.0, "training_total": 0.29},
        "wall_seconds": {"seed": 110.0, "experts": 180.0},
    }
    store.write_json(PLAN, plan)
    ended = {"jobs": [{"state": "finished"}, {"state": "finished"}]}
    rows = {r["what"]: r for r in plan_vs_actual(store, ended)["rows"]}
    assert (
        abs(rows["GPU-hours, seed"]["error"] - 0.1) < 1e-9
        and abs(rows["GPU-hours, expert training"]["error"] + 0.1) < 1e-9
    )
    assert rows["wall seconds, seed"]["actual"] == 100.0 and rows["wall seconds, experts"]["actual"] == 200.0
    assert plan_vs_actual(store, {"jobs": [{"state": "finished"}, {"state": "running"}]}) is None  # not before the end
    store.write_json(PLAN, {**plan, "seed_trained": True})  # a seed trained before the plan is not a prediction
    assert not [r for r in plan_vs_actual(store, ended)["rows"] if "seed" in r["what"]]


def watched(states, source="driver", final=False, written_at=100.0, driver=None, held=False) -> dict:
    return {
        "jobs": [{"job": f"j{i}", "state": s} for i, s in enumerate(states)],
        "source": source,
        "final": final,
        "stale": False,
        "written_at": written_at,
        "driver": driver,
        "lease": {"held": held},
    }


def test_watch_follows_the_driver_it_was_started_for():
    """`soma status --watch` right after `ray job submit --no-wait -- soma launch`: the seed stage's final snapshot
    (written before the watch began) or no snapshot at all is not the end; the new driver's end is."""
    since, wait = 1000.0, 300.0
    seed_done = watched(["finished", "pending", "pending"], final=True, written_at=900.0)
    assert watch_step(seed_done, since, since, since + 10, wait) is Watch.WAITING
    assert watch_step(seed_done, since, since, since + 301, wait) is Watch.NO_DRIVER
    never = watched(["pending", "pending"], source="events", written_at=0.0)
    assert watch_step(never, since, since, since + 1, wait) is Watch.WAITING
    assert watch_step({**seed_done, "lease": {"held": True}}, since, since, since + 1, wait) is Watch.RUNNING
    live = watched(["finished", "running", "queued"], written_at=1005.0)
    assert watch_step(live, since, since, since + 6, wait) is Watch.RUNNING
    stopped = watched(["finished", "interrupted", "pending"], written_at=1500.0, driver={"state": "stopped"})
    assert watch_step(stopped, since, since, 1501.0, wait) is Watch.DRIVER_ENDED
    ended = watched(["finished", "failed_permanently", "budget_exhausted"], final=True, written_at=1600.0)
    assert watch_step(ended, since, since, 1601.0, wait) is Watch.ENDED
    assert watch_step(ended, since, since, 1601.0, wait) is Watch.ENDED  # even if ended before the watch


def test_retries_count_the_retries_not_the_failures(tmp_path):
    """A job that failed permanently with retry.max_retries = 2 failed 3 times and was retried twice, as the error
    line says ("after 2 retries"); one that is retrying after its first failure has one retry under way."""
    from soma_cluster.jobs import Job, JobState, JobStatus, JobView
    from soma_cluster.snapshot import _row

    cfg = micro_config()
    view = JobView(step=3)
    done = _row(cfg, Job(0), JobStatus(state=JobState.FAILED_PERMANENTLY, view=view, spent_s=1.0, retries=3))
    again = _row(cfg, Job(1), JobStatus(state=JobState.RETRYING, view=view, spent_s=1.0, retries=1))
    assert (done["retries"], done["failures"]) == (2, 3)
    assert (again["retries"], again["failures"]) == (1, 1)


def _status_at(camp, columns: int) -> str:
    env = {**os.environ, "COLUMNS": str(columns), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.run(
        [sys.executable, "-m", "pipelines.cli", "status", str(camp)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    return proc.stdout


def test_status_fits_80_columns_without_cutting_a_name_and_shows_all_at_200(tmp_path):
    """At 80 columns the table leaves whole columns out (naming them), never cuts a job's name or state; at 200 it
    shows every column, the last error wrapped in what is left."""
    from soma_cluster.events import emit
    from soma_cluster.storage import Store

    cfg = micro_config(n_experts=3)
    camp = tmp_path / "c"
    camp.mkdir()
    (camp / "campaign.yaml").write_text(to_yaml_text(cfg))
    store = Store(str(camp))
    emit(store, "queued", "expert-0001", attempt=0)
    emit(store, "started", "expert-0001", attempt=0, step=0, device="cuda:0", node_ip="10.0.0.7")
    emit(store, "heartbeat", "expert-0001", attempt=0, step=3, loss=2.4567, val=2.5678, gpu_seconds=1.0)
    emit(store, "failed", "expert-0001", attempt=0, step=3, reason="exception: RuntimeError: " + "y" * 90)
    narrow, wide = _status_at(camp, 80), _status_at(camp, 200)
    for text, width in ((narrow, 80), (wide, 200)):
        assert max(len(x) for x in text.splitlines()) <= width and "…" not in text, text
        rows = {x.split()[0]: x.split()[1] for x in text.splitlines() if x.startswith(("seed ", "expert-"))}
        assert rows == {
            "seed": "pending",
            "expert-0000": "pending",
            "expert-0001": "retrying",
            "expert-0002": "pending",
        }
        assert "2.4567" in text and "2.5678" in text  # the newest train and validation loss
    assert "columns left out at 80 wide" in narrow and "10.0.0.7" not in narrow and "last error" in narrow
    assert "10.0.0.7" in wide and "cuda:0" in wide and "left out" not in wide
    assert "y" * 60 in "".join(wide.split())  # the error whole, wrapped
    print(f"\nCOLUMNS=80:\n{narrow}\nCOLUMNS=200:\n{wide}")


def test_a_launch_ends_with_a_small_table_of_its_experts_by_end_state():
    from pipelines.campaign import ended_line, ended_table
    from soma_cluster.jobs import JobView

    outcome = {f"expert-000{i}": "finished" for i in range(6)} | {"expert-0006": "budget_exhausted"}
    views = {n: JobView(step=400, val=2.5, loss=2.4) for n in outcome} | {"expert-0006": JobView(step=230, loss=2.6)}
    buf = io.StringIO()
    Console(file=buf, width=200).print(ended_table(outcome, views))
    lines = buf.getvalue().splitlines()
    assert ended_line(outcome) == "7 expert(s) ended: 1 budget_exhausted (expert-0006), 6 finished."
    assert lines[0].split() == ["ended", "experts", "train", "expert-val", "steps", "which"]
    assert lines[1].split()[:5] == ["finished", "6", "2.4000", "2.5000", "400"] and "(2 more)" in lines[1]
    assert lines[2].split() == ["budget_exhausted", "1", "2.6000", "-", "230", "expert-0006"]
