"""A real MLflow tracking server (tests/support/mlflowserver.py) and TensorBoard's own loaders: a tiny campaign tracked
live, its MLflow server killed in the middle of `soma launch` (training finishes, the gap is reported and
recorded), restarted, and `soma track` filling the gap from the campaign's record, twice (the second sends
nothing). Read back with MLflow's client: every job's losses at each step once, in order, equal to its curve
CSV (TensorBoard's too); the eval numbers and files; the config as parameters. And a resumed driver's sink
continuing a run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import soma
from support.mlflowserver import SKIP_REASON, MlflowServer, available
from test_tracking import replay, retried_campaign

from soma_cluster.jobcurves import read_curve
from soma_cluster.storage import Store

pytestmark = pytest.mark.skipif(not available(), reason=SKIP_REASON)
pytest.importorskip("mlflow")
pytest.importorskip("tensorboard")


@pytest.fixture(scope="module")
def server():
    s = MlflowServer().start()  # ~40 s to come up: started first, waited for where it is needed
    yield s
    s.close()


def client(server):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=server.uri)


def runs_of(server, experiment: str) -> dict[str, object]:
    c = client(server)
    exp = c.get_experiment_by_name(experiment)
    runs = c.search_runs([exp.experiment_id], max_results=1000)
    return {r.data.tags.get("soma.job", "campaign"): r for r in runs}


def steps_values(server, run, key: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in client(server).get_metric_history(run.info.run_id, key)]


def test_a_resumed_sink_continues_the_same_runs_in_order(server):
    from pipelines.tracking_mlflow import MlflowSink

    server.wait_ready()
    points = replay(*retried_campaign())
    first = MlflowSink(server.uri, "resume-test", "key-r", "micro", 10)
    first.write(first.open().admit(points)[:9])  # the first driver is lost after 9 points
    second = MlflowSink(server.uri, "resume-test", "key-r", "micro", 10)  # found again by the campaign's key
    second.write(second.open().admit(points))
    runs = runs_of(server, "resume-test")
    assert set(runs) == {"campaign", "expert-0000"}
    loss = steps_values(server, runs["expert-0000"], "train_loss")
    assert [s for s, _ in loss] == [3, 6, 9, 12]  # once each, in the order sent
    assert runs["expert-0000"].info.status == "FINISHED"
    assert runs["expert-0000"].data.tags["mlflow.parentRunId"] == runs["campaign"].info.run_id
    assert (runs["campaign"].info.run_name, runs["expert-0000"].info.run_name) == ("micro", "micro/expert-0000")


def test_a_stopped_command_kills_its_runs_and_a_resume_reopens_them(server):
    """KILLED (a stop) and RUNNING again (a resume), as the server keeps them; a job's `soma.state` tag says what
    soma status says of it at each of those moments (interrupted with KILLED, not running), and a reopened job is
    `pending` and SCHEDULED."""
    from pipelines.tracking_mlflow import MlflowSink
    from soma_cluster.trackpoints import PARENT, Feed, RunState, Source, Stage, Status

    server.wait_ready()
    feed, sink = Feed(), MlflowSink(server.uri, "status-test", "key-s", "c1", 60)  # a loaded host's server is slow
    marks = sink.open()
    points = feed.stage(Stage.LAUNCH, "running")
    points += feed.on_record(Source.EVENTS, {"event": "started", "job": "expert-0000", "t": 1.0, "attempt": 0})
    sink.write(marks.admit(points))
    sink.write(marks.admit(feed.stage(Stage.LAUNCH, "stopped")))
    runs = runs_of(server, "status-test")
    assert {n: r.info.status for n, r in runs.items()} == {"campaign": "KILLED", "expert-0000": "KILLED"}
    assert runs["expert-0000"].data.tags["soma.state"] == "interrupted"
    again = MlflowSink(server.uri, "status-test", "key-s", "c1", 60)  # a resumed driver: found again, reopened
    sent = again.open().admit([RunState(PARENT, Status.RUNNING), RunState("expert-0000", Status.KILLED)])
    assert sent == [RunState(PARENT, Status.RUNNING)]  # what the server holds already is not sent again
    again.write(sent)
    assert runs_of(server, "status-test")["campaign"].info.status == "RUNNING"
    ended = {"event": "finished", "job": "expert-0000", "t": 2.0, "attempt": 1, "step": 12}
    reopened = {"event": "reopened", "job": "expert-0000", "t": 3.0, "step": 12, "reason": "extended"}
    again.write(feed.on_record(Source.EVENTS, ended) + feed.on_record(Source.EVENTS, reopened))
    run = runs_of(server, "status-test")["expert-0000"]
    assert (run.data.tags["soma.state"], run.info.status) == ("pending", "SCHEDULED")


def launch_killing_the_server(campaign: str, server: MlflowServer) -> subprocess.CompletedProcess:
    """`soma launch`, with the tracking server killed once the first expert heartbeat is in events.jsonl."""
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled", "COLUMNS": "200"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipelines.cli", "launch", campaign, "--no-progress"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    events = Path(campaign) / "events.jsonl"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        text = events.read_text() if events.exists() else ""
        if any('"event": "heartbeat"' in x and '"job": "expert-' in x for x in text.splitlines()):
            break
        time.sleep(0.05)
    server.kill()
    out, err = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.slow  # ~62 s; outage and backfill: test_tracking_tb.py (a campaign), test_tracking.py (the rules)
def test_tiny_campaign_tracked_through_an_outage_and_backfilled(server, micro_yaml, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server.uri)
    campaign = str(tmp_path / "c")
    sets = ["--set", "tracking.backends=[mlflow,tensorboard]", "--set", "tracking.drain_s=15", "--set", "name=tracked"]
    assert soma("prepare", campaign, "--config", micro_yaml, *sets).returncode == 0
    server.wait_ready()
    p = soma("seed", campaign, "--no-progress")
    assert p.returncode == 0, p.stderr
    store = Store(campaign)
    runs = runs_of(server, "tracked")  # live: the seed stage, the campaign's parameters
    assert [s for s, _ in steps_values(server, runs["seed"], "train_loss")] == [
        r["step"] for r in read_curve(store, "seed")
    ]
    assert runs["campaign"].data.params["train.updates"] == "12" and "config_digest" in runs["campaign"].data.params
    assert runs["campaign"].data.tags["soma.stage.seed"] == "finished"
    assert runs["campaign"].info.status == "FINISHED" and runs["seed"].info.status == "FINISHED"  # not RUNNING on
    assert runs["campaign"].data.tags["soma.url"] == campaign and runs["campaign"].info.run_name == "c"
    assert runs["seed"].info.run_name == "c/seed" and runs["seed"].data.params["seed_stage.updates"] == "6"

    t0 = time.monotonic()
    p = launch_killing_the_server(campaign, server)
    launch_s = time.monotonic() - t0
    assert p.returncode == 0, p.stderr  # training finished, the tracker down
    assert "tracking: mlflow missed" in p.stderr and f"soma track {campaign}" in p.stderr, p.stderr
    gaps = [json.loads(x) for x in (Path(campaign) / "tracking" / "gaps.jsonl").read_text().splitlines()]
    assert any(g["backend"] == "mlflow" and g["dropped"] > 0 for g in gaps)
    assert not any(g["backend"] == "tensorboard" for g in gaps)  # the other tracker lost nothing
    from support.tbloaders import shown

    key = store.read_json("tracking/key.json")["key"]
    for loader, tb in shown(str(Path(campaign) / "tensorboard")).items():  # as TensorBoard's own loaders show it
        assert set(tb) == {f"c-{key}/{r}" for r in ("campaign", "seed", "expert-0000", "expert-0001")}, loader
        for e in ("expert-0000", "expert-0001"):  # one run per expert: their train_loss curves overlay
            curve = [(int(r["step"]), r["train_loss"]) for r in read_curve(store, e)]
            got = tb[f"c-{key}/{e}"]["train_loss"]
            assert [s for s, _ in got] == [s for s, _ in curve], loader  # each step once, in order
            assert [v for _, v in got] == pytest.approx([v for _, v in curve], rel=1e-6)

    p = soma("eval", campaign)  # with the server still down: eval's own points miss it too
    assert p.returncode == 0, p.stderr
    server.start()  # back up (the same database); only `soma track` can close the gap now
    server.wait_ready()
    p = soma("track", campaign, "--json")
    assert p.returncode == 0, p.stderr
    filled = json.loads(p.stdout)["backends"]
    missed = {run for g in gaps if g["backend"] == "mlflow" for run in g["runs"]}  # what the launch reported
    # a batch the server stored just before it died is reported missed yet found whole by the backfill (it reads
    # what the tracker holds first), so the backfill fills a part of what was reported, never a run outside it
    assert filled["mlflow"]["points"] > 0 and missed and set(filled["mlflow"]["runs"]) <= missed

    runs = runs_of(server, "tracked")
    assert set(runs) == {"campaign", "seed", "expert-0000", "expert-0001"}
    for job in ("seed", "expert-0000", "expert-0001"):
        curve = [(int(r["step"]), r["train_loss"]) for r in read_curve(store, job)]
        got = sorted(steps_values(server, runs[job], "train_loss"))
        assert [s for s, _ in got] == [s for s, _ in curve]  # the gap is closed, nothing twice
        assert [v for _, v in got] == pytest.approx([v for _, v in curve], rel=1e-6)
        assert runs[job].data.tags["soma.state"] == "finished" and runs[job].info.status == "FINISHED"
    for e in (0, 1):  # a child run carries what trained it and its shard's size
        params = runs[f"expert-000{e}"].data.params
        assert params["expert"] == str(e) and params["train.updates"] == "12" and int(params["shard.train_rows"]) > 0
    parent = runs["campaign"]
    assert parent.info.status == "FINISHED"  # the campaign ended, its eval too: no longer RUNNING
    m = store.read_json("eval/metrics.json")
    assert parent.data.metrics["eval/ensemble_nats_per_byte"] == pytest.approx(m["ensemble"]["nats_per_byte"])
    assert parent.data.metrics["eval/seed_ci95_hi"] == pytest.approx(m["seed"]["ci95"][1])
    arts = {a.path for a in client(server).list_artifacts(parent.info.run_id)}
    assert arts >= {"report.md", "curves.png", "metrics.json"}
    assert {parent.data.tags[f"soma.stage.{s}"] for s in ("prepare", "seed", "launch", "eval")} == {"finished"}

    again = json.loads(soma("track", campaign, "--json").stdout)["backends"]
    assert again["mlflow"]["points"] == 0 and again["tensorboard"]["points"] == 0

    child = str(tmp_path / "fork")  # a fork's run names its parent's
    assert soma("fork", campaign, child).returncode == 0
    p = soma("track", child, "--backend", "mlflow", "--json")
    assert p.returncode == 0, p.stderr
    forked = runs_of(server, "tracked")
    (fork_run,) = [r for r in client(server).search_runs([forked["campaign"].info.experiment_id]) if
                   r.info.run_name == "fork"]  # fmt: skip
    assert fork_run.data.tags["soma.forked_from"] == campaign
    assert fork_run.data.tags["soma.forked_from_run"] == parent.info.run_id
    print(
        f"\nparent run: status {parent.info.status}, name {parent.info.run_name!r}, tags "
        f"{ {k: v for k, v in parent.data.tags.items() if k.startswith('soma.')} }; expert-0000: status "
        f"{runs['expert-0000'].info.status}, name {runs['expert-0000'].info.run_name!r}, params "
        f"{dict(sorted(runs['expert-0000'].data.params.items()))}; fork: "
        f"{ {k: v for k, v in fork_run.data.tags.items() if k.startswith('soma.fork')} }"
    )
    print(
        f"\nlaunch with the tracker killed: {launch_s:.1f} s; backfill sent {filled['mlflow']['points']} points; "
        f"runs {sorted(runs)}; parent metrics {sorted(parent.data.metrics)}; artifacts {sorted(arts)}; "
        f"expert-0000 metrics {sorted(runs['expert-0000'].data.metrics)}"
    )


def test_ledger_status_and_trackers_tell_the_same_story(server, trained, tmp_path, monkeypatch):
    """A trained campaign whose expert-0000 is retrained at a price (its other records stay unpriced), then forked
    warm (the fork carries what the parent spent, dollars included): in each, `soma status --json`, the MLflow
    server's runs and TensorBoard's scalars (its Python loader) hold the ledger's GPU-hours and dollars by category,
    their totals and the unpriced GPU-hours; every job's run holds the state soma status gives the job, and the run
    status that state means."""
    import shutil

    from conftest import soma_here
    from support.tbloaders import python_loader

    from soma_cluster.jobs import CATEGORIES, JobState
    from soma_cluster.ledger import Ledger
    from soma_cluster.trackpoints import job_status

    monkeypatch.setenv("MLFLOW_TRACKING_URI", server.uri)
    parent, child = tmp_path / "parent", tmp_path / "child"
    shutil.copytree(trained.camp, parent)
    p = soma("resume", parent, "--retrain", "expert-0000", "--set", "prices.cpu_hour=0.5", "--no-progress")
    assert p.returncode == 0, p.stderr[-2000:]
    assert soma_here("fork", parent, child, "--warm").returncode == 0
    server.wait_ready()
    spent = {}
    for camp in (parent, child):
        monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", camp.name)  # both are named micro: an experiment each
        p = soma_here("track", camp, "--backend", "mlflow", "--backend", "tensorboard", "--json")
        assert p.returncode == 0, p.stderr[-2000:]
        led = Ledger(Store(str(camp))).totals()
        want = {f"gpu_hours/{c}": led.gpu_seconds[c] / 3600.0 for c in CATEGORIES}
        want |= {f"usd/{c}": led.usd[c] for c in CATEGORIES} | {"usd_total": sum(led.usd.values())}
        want |= {"gpu_hours_total": led.gpu_hours, "unpriced_gpu_hours": led.unpriced_gpu_seconds / 3600.0}
        spent[camp.name] = want
        snap = json.loads(soma_here("status", camp, "--json").stdout)
        shown = {f"gpu_hours/{c}": h for c, h in snap["gpu_hours"].items()} | {
            f"usd/{c}": v for c, v in snap["usd"].items()
        }
        shown |= {k: snap[k] for k in ("usd_total", "gpu_hours_total", "unpriced_gpu_hours")}
        assert shown == pytest.approx(want, rel=1e-9), camp.name
        runs = runs_of(server, camp.name)
        assert {k: runs["campaign"].data.metrics[k] for k in want} == pytest.approx(want, rel=1e-9), camp.name
        (folder,) = {r.split("/")[0] for r in python_loader(str(camp / "tensorboard"))}
        tb = python_loader(str(camp / "tensorboard"))[f"{folder}/campaign"]
        assert {k: tb[k][-1][1] for k in want} == pytest.approx(want, rel=1e-5), camp.name  # float32 scalars
        for job in snap["jobs"]:
            if job["job"] in runs:  # a job with no event has no run yet
                run = runs[job["job"]]
                got = (run.data.tags["soma.state"], run.info.status)
                assert got == (job["state"], job_status(JobState(job["state"]))), (camp.name, job["job"], got)
    assert spent["parent"]["usd/expert_training"] > 0 and spent["parent"]["unpriced_gpu_hours"] > 0
    # the fork carries the parent's expert dollars (none of them lost to an unpriced carried record)
    assert spent["child"]["usd/expert_training"] == pytest.approx(spent["parent"]["usd/expert_training"], rel=1e-9)
    assert spent["child"]["usd/wasted"] == pytest.approx(spent["parent"]["usd/wasted"], rel=1e-9)
    print(f"\nparent {spent['parent']}\nchild {spent['child']}")
