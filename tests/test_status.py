"""`soma status` without Ray: job states derived from the scheduler (not the last event), the snapshot's schema,
the fallback to the events log for a campaign without status.json, and a piped table that cuts nothing."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time

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
    "starting",
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
    # both fit the GPUs present (room 2): their actors hold a GPU while they start up, so they count as running
    assert [r["starting"] for r in scheduler_rows(s).values()] == [True, True, False, False]
    s.on_setup(units[0].id, started([0]))
    assert not scheduler_rows(s)["expert-0000"]["starting"]
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


def test_an_actor_placed_from_ray_s_queue_counts_as_running_without_a_budget(tmp_path):
    """N = 4 on 2 GPUs, no budget: the two granted actors are starting at once; the two asked beyond the GPUs wait
    in Ray's queue (queued). When a GPU frees, the oldest waiting one counts as starting (Ray places it; its process
    starts before it can say so), and one Ray placed (`holding`, asked of every such actor) is known to be: a GPU
    each, counted as running."""
    s = scheduler(tmp_path, n_experts=4)
    s.restore({})
    units = [a.unit for a in by(s.requests(4, 2), Start)]
    rows = lambda: scheduler_rows(s).values()  # noqa: E731
    assert [r["starting"] for r in rows()] == [True, True, False, False]
    s.on_setup(units[0].id, started([0]))
    assert [r["starting"] for r in rows()] == [False, True, False, False]  # expert 0 runs
    s.on_chunk(units[0].id, _report(0, beat(12, 3.0, 48, reason="finished")))
    # its GPU is free: Ray places the oldest waiting actor, whose process starts before it can say so
    assert [r["state"] for r in rows()] == ["finished", "queued", "queued", "queued"]
    assert [r["starting"] for r in rows()] == [False, True, True, False]
    from soma_cluster.statusview import experts_text, experts_view

    assert experts_text(experts_view(list(rows()))) == "2 running (2 starting), 1/4 ended (1 finished), 1 queued"
    s.on_placed(units[3].id, 0.5)  # Ray placed the last one instead: known, and the guess moves to it
    assert [r["starting"] for r in rows()] == [False, True, False, True]


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
    Console(file=buf, width=200).print(ended_table(outcome, views, width=200))
    lines = buf.getvalue().splitlines()
    assert ended_line(outcome) == "7 expert(s) ended: 1 budget_exhausted (expert-0006), 6 finished."
    assert lines[0].split() == ["ended", "experts", "train", "expert-val", "steps", "which"]
    assert lines[1].split() == ["finished", "6", "2.4000", "2.5000", "400", "0-5"]
    assert lines[2].split() == ["budget_exhausted", "1", "2.6000", "-", "230", "expert-0006"]


def test_a_launch_s_closing_table_fits_80_columns_at_n_256():
    """N = 256 with failures scattered over the range: every row one line within 80 columns, the experts of each
    end state as numbered runs (what soma status --expert takes), cut with a count of those left out."""
    from pipelines.campaign import ended_line, ended_table
    from soma_cluster.jobs import JobView

    failed = {3, 17, 40, 41, 42, 43, 44, 99, 120, 133, 150, 151, 200, 201, 230, 255}
    outcome = {f"expert-{e:04d}": "failed_permanently" if e in failed else "finished" for e in range(256)}
    views = {n: JobView(step=300 if s == "finished" else 120, val=2.5, loss=2.4) for n, s in outcome.items()}
    for width in (80, 60, 40):
        buf = io.StringIO()
        Console(file=buf, width=width).print(ended_table(outcome, views, width=width))
        lines = buf.getvalue().splitlines()
        assert len(lines) == 3 and max(map(len, lines)) <= width and "…" not in buf.getvalue(), buf.getvalue()
        assert ("train" in lines[0]) == (width == 80), lines[0]  # a narrower terminal loses the train column first
        assert lines[1].startswith("finished") and lines[2].startswith("failed_permanently"), lines
        if width >= 60:
            assert "0-2, " in lines[1] and "3, 17, " in lines[2] and " more" in lines[2], lines
        if width == 80:
            assert "0-2, 4-16, +224 more" in lines[1] and "3, 17, 40-44, +9 more" in lines[2], buf.getvalue()
    line = ended_line(outcome)
    assert line.startswith("256 expert(s) ended: 16 failed_permanently (experts 3, 17, 40-44") and len(line) <= 120


def test_the_progress_info_gives_way_before_the_bar_wraps():
    """The live bar at N = 256 on 80 columns: the longest description, M/N of all updates, elapsed and the info fit
    with a bar of MIN_BAR; the info falls back from the counts and losses to the ETA alone."""
    from pipelines.common import MIN_BAR, fit_info, info_room
    from soma_cluster.statusview import experts_text, experts_view

    rows = [_fake_row(e, s) for e, s in enumerate(["running"] * 3 + ["queued"] + ["finished"] * 50 + ["queued"] * 202)]
    rows[3]["starting"] = True
    view = experts_view(rows)
    assert experts_text(view).startswith("4 running (1 starting), 50/256 ended (50 finished), 202 queued")
    room = info_room(80, ["experts"], 256 * 300)
    said = [f"{experts_text(view)}, ETA 0:08:05  train 2.4000 val 2.5000", "4 running, 50/256 ended, ETA 0:08:05"]
    info = fit_info(said, room)
    assert info == said[1] and len("experts") + MIN_BAR + len("76800/76800") + 8 + len(info) + 4 <= 80
    assert fit_info(said, 3) == "" and info_room(20, ["expert-0000"], 300) == 0


# -- the summary at any N ------------------------------------------------------------------------------------------
def _fake_row(e: int | None, state: str, step: int | None = None, **kw) -> dict:
    """A status.json row (soma_cluster/snapshot.py) as a driver writes it, for a job of 300 updates."""
    from soma_cluster.jobs import expert_name

    step = {"finished": 300, "pending": 0, "queued": 0}.get(state, 150) if step is None else step
    row = {
        "job": "seed" if e is None else expert_name(e),
        "expert": e,
        "state": state,
        "step": step,
        "target": 300,
        "val": 2.5 if step else None,
        "loss": 2.4 if step else None,
        "gpu_hours": step * 1e-4,
        "budget_left_gpu_hours": None,
        "retries": 0,
        "failures": 0,
        "node": "10.0.0.7",
        "device": "cuda:0",
        "last_error": None,
        "heartbeat_age_s": 2.0 if state == "running" else None,
        "starting": False,
    }
    if state == "failed_permanently":
        row.update(retries=2, failures=3, last_error="exception: RuntimeError: CUDA error: an illegal memory access")
    if state == "retrying":
        row.update(retries=1, failures=1, last_error="actor_died: the actor died unexpectedly before finishing")
    return {**row, **kw}


def fake_campaign(root, n: int, states: dict[str, int], final: bool = False, **rows_kw) -> tuple:
    """A campaign directory `soma status` reads (campaign.yaml and a driver's status.json) with N experts in the
    given states (the rest pending) and the seed finished: no training. Returns (path, config)."""
    from soma_cluster.storage import Store

    cfg = micro_config(n_experts=n)
    root.mkdir(parents=True, exist_ok=True)
    (root / "campaign.yaml").write_text(to_yaml_text(cfg))
    kinds = [s for s, k in states.items() for _ in range(k)] + ["pending"] * (n - sum(states.values()))
    rows = {"seed": _fake_row(None, "finished")}
    for e, state in enumerate(kinds):
        row = _fake_row(e, state, step=150 + e % 100 if state == "running" else None)
        rows[row["job"]] = {**row, **rows_kw.get(row["job"], {})}
    snap = build(
        cfg=cfg,
        url=str(root),
        rows=rows,
        by_category_s={"seed": 36.0, "expert_training": 3600.0 * n / 4},
        devices={"cuda": 3636.0},
        started_at=time.time() - 312.0,
        rate=None,
        estimate=lambda _: 485.0,
        final=final,
        source="driver",
        driver={"state": "ended" if final else "running", "stopped_by": None, "host": "h", "pid": 1},
    )
    Store(str(root)).write_json(SNAPSHOT, snap)
    return root, cfg


def _summary_text(camp, cfg, width: int | None, height: int = 24) -> str:
    from pipelines.status import summary
    from soma_cluster.storage import Store

    buf = io.StringIO()
    print_full(Console(file=buf, width=width or 80), summary(load_status(Store(str(camp)), cfg), width, height), width)
    return buf.getvalue()


MIXES = {
    2: {"finished": 1, "running": 1},
    4: {"finished": 1, "running": 2, "retrying": 1},
    16: {"finished": 6, "running": 4, "retrying": 1, "failed_permanently": 1},
    256: {"finished": 50, "running": 4, "queued": 1, "retrying": 3, "failed_permanently": 9, "budget_exhausted": 2},
    1024: {"failed_permanently": 1024},
}


def test_the_summary_fits_one_80_by_24_screen_at_any_n(tmp_path):
    """N = 2, 4, 16, 256 and 1,024 (all failed) at 80 x 24, 120 x 40 and 40 x 24: at most the height less the
    prompt's line, no line past the width, and the counts (the seed apart), GPU-hours and ETA always there; where
    every job does not fit, the experts that need attention, most urgent first, and how to list the rest."""
    from rich.cells import cell_len

    for n, mix in MIXES.items():
        camp, cfg = fake_campaign(tmp_path / f"n{n}", n, mix)
        for width, height in ((80, 24), (120, 40), (40, 24)):
            text = _summary_text(camp, cfg, width, height)
            lines = text.splitlines()
            assert len(lines) <= height - 1 and max(map(cell_len, lines)) <= width, (n, width, text)
            flat = " ".join(text.split())
            assert f"experts ({n}):" in flat and "seed finished;" in flat, text
            assert "GPU-hours" in flat and "ETA 0:08:05" in flat, text
            if width == 80:
                print(f"\nN = {n} at {width} x {height}:\n{text}")
        wide = " ".join(_summary_text(camp, cfg, 80).split())
        ended = mix.get("finished", 0) + mix.get("failed_permanently", 0) + mix.get("budget_exhausted", 0)
        assert f"{ended}/{n} ended" in wide, wide
        if n >= 16:  # every job does not fit: the attention list and how to list the rest
            assert "needs attention" in wide and "--all" in wide, wide
        else:
            assert all(f"expert-{e:04d}" in wide for e in range(n)), wide  # small N: every row stays
    text = _summary_text(tmp_path / "n256", micro_config(n_experts=256), 80)
    rows = [x.split()[0] for x in text.splitlines() if x.startswith("expert-")]
    # failed first, then retrying, then over budget: the 9 + 3 + 2 flagged, as many as fit, the rest counted
    assert rows[:3] == ["expert-0058", "expert-0059", "expert-0060"], text  # the first failed ones, by name
    assert "needs attention (14 of 256 experts): 9 failed, 3 retrying, 2 over budget" in text, text
    assert f"+{14 - len(rows)} more: --state" in " ".join(text.split()), text
    from pipelines.status import render
    from soma_cluster.storage import Store

    snap = load_status(Store(str(tmp_path / "n256")), micro_config(n_experts=256))
    buf = io.StringIO()
    print_full(Console(file=buf, width=80), render(snap, 80, 24), 80)  # --watch --all: one screen, rows counted
    lines = buf.getvalue().splitlines()
    assert len(lines) <= 23 and max(map(len, lines)) <= 80 and "more rows below the screen" in buf.getvalue(), lines
    everything = _summary_text(tmp_path / "n1024", micro_config(n_experts=1024), 80)
    assert "1024/1024 ended (1024 failed_permanently)" in everything and "1024 failed" in everything, everything


def test_the_summary_names_starting_silent_slow_and_over_budget_experts(tmp_path):
    """A starting expert counts as running (it holds a GPU); one silent for a quarter of the heartbeat timeout, one
    at 1.5 x the median GPU-seconds per update, one past its cap: each flagged with its reason."""
    over = {"expert-0002": {"gpu_hours": 9.0}, "expert-0003": {"heartbeat_age_s": 400.0}}
    slow = {"expert-0001": {"gpu_hours": 150 * 1e-4 * 3}}
    camp, cfg = fake_campaign(
        tmp_path / "c", 32, {"running": 8, "queued": 4}, **{**over, **slow, "expert-0008": {"starting": True}}
    )
    from pipelines.status import limits
    from soma_cluster.statusview import Concern, attention
    from soma_cluster.storage import Store

    cfg = cfg.model_copy(update={"budget": cfg.budget.model_copy(update={"expert_gpu_hours": 1.0})})
    snap = load_status(Store(str(camp)), cfg)
    assert snap["experts"]["starting"] == 1 and snap["experts"]["counts"]["running"] == 8
    flags = {f.job: f for f in attention(snap["jobs"], limits(cfg))}
    assert flags["expert-0002"].concern == Concern.OVER_BUDGET and "cap of 1" in flags["expert-0002"].why
    assert flags["expert-0003"].concern == Concern.SILENT and "400 s" in flags["expert-0003"].why
    assert flags["expert-0001"].concern == Concern.SLOW and "3.0x the median" in flags["expert-0001"].why
    assert set(flags) == {"expert-0001", "expert-0002", "expert-0003"}, flags
    text = " ".join(_summary_text(camp, cfg, 80).split())
    assert "9 running (1 starting)" in text and "3 queued" in text, text


def test_summary_line_counts_experts_apart_from_the_seed_and_starting_ones_as_running(tmp_path):
    """The log collector's line at N = 256: 4 running on 4 GPUs (one starting up), and the seed said apart, never
    among the experts' finished."""
    rows = {"seed": _fake_row(None, "finished")}
    for e, state in enumerate(["running"] * 3 + ["queued"] * 200 + ["finished"] * 53):
        rows[f"expert-{e:04d}"] = _fake_row(e, state, starting=e == 3)
    snap = build(
        cfg=micro_config(n_experts=256),
        url="c",
        rows=rows,
        by_category_s={},
        devices={},
        started_at=0.0,
        rate=None,
        final=False,
        source="driver",
    )
    line = summary_line(snap)
    assert "experts 4 running (1 starting), 53/256 ended (53 finished), 199 queued | seed finished |" in line, line


def test_status_at_n_256_through_the_cli_summary_all_filters_and_bad_values(tmp_path):
    """The real command at N = 256: the summary within 80 x 24 (piped: 24 lines), --all every row, --state and
    --expert together (both must hold), --json with the filter, a filter that matches nothing, and bad values."""
    camp, _ = fake_campaign(tmp_path / "c", 256, MIXES[256])
    env = {"COLUMNS": "80"}
    text = soma("status", str(camp), env=env).stdout
    assert len(text.splitlines()) <= 23 and max(map(len, text.splitlines())) <= 80, text
    assert "needs attention (14 of 256 experts)" in text and "ETA 0:08:05" in text, text
    every = soma("status", str(camp), "--all", env=env).stdout
    assert sum(len(x.split()) > 1 and x.split()[1] in STATES for x in every.splitlines()) == 257, every
    both = soma("status", str(camp), "--state", "failed,retrying", "--expert", "50-59,seed", env=env)
    listed = [x.split()[0] for x in both.stdout.splitlines() if x.startswith("expert-")]
    assert both.returncode == 0 and listed == [f"expert-{e:04d}" for e in range(55, 60)], both.stdout
    assert "5 of 257 jobs match --state retrying,failed_permanently --expert seed,50-59" in both.stdout
    doc = json.loads(soma("status", str(camp), "--json", "-t", "failed", "-e", "expert-0058,60-200").stdout)
    assert [r["job"] for r in doc["jobs"]] == [f"expert-{e:04d}" for e in (58, *range(60, 67))], doc["jobs"]
    assert doc["filter"]["matched"] == 8 and doc["filter"]["jobs"] == 257 and doc["experts"]["n"] == 256
    assert {a["job"] for a in doc["attention"]} == {r["job"] for r in doc["jobs"]}  # the attention of those listed
    assert doc["counts"]["failed_permanently"] == 9  # the counts stay the whole campaign's
    none = soma("status", str(camp), "--state", "converged", env=env)
    assert none.returncode == 0 and "no job of 257 matches --state converged" in none.stdout, none.stdout
    for bad, said in (("--expert=256", "this campaign has 256 experts"), ("--state=runing", "'runing' is not")):
        proc = soma("status", str(camp), bad, env=env)
        errors = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
        assert proc.returncode == 2 and len(errors) == 1 and said in errors[0] and proc.stdout == "", proc.stderr
