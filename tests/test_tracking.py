"""Experiment tracking without Ray or a server: where a campaign is tracked (config over environment), the points
a campaign's records make, that no step is sent twice or out of order (resume, retry), that a gap is filled
by a backfill, the bounded queue and its counted drops, and TensorBoard's files as its own loaders show them."""

from __future__ import annotations

import os
import threading
import time

import pytest
import yaml
from conftest import assert_one_line_error, micro_config, soma

from pipelines.common import claim_campaign, open_store
from pipelines.tracking import MODULES, SinkThread, require_packages
from soma_cluster.config import from_yaml_text, resolve, to_yaml_text
from soma_cluster.errors import SomaError
from soma_cluster.trackpoints import (
    PARENT,
    Artifact,
    Backend,
    Feed,
    Marks,
    Metric,
    Params,
    RunState,
    Source,
    Status,
    Tag,
    merged,
    resolve_target,
)


def cfg_with(**tracking):
    return micro_config(tracking=tracking)


# -- where --------------------------------------------------------------------------------------------------
def test_config_wins_over_environment_and_environment_fills_the_rest(tmp_path):
    env = {"MLFLOW_TRACKING_URI": "http://env:5000", "MLFLOW_EXPERIMENT_NAME": "from-env", "TENSORBOARD_LOGDIR": "/e"}
    both = ["mlflow", "tensorboard"]
    t = resolve_target(cfg_with(backends=both), str(tmp_path), env)
    assert (t.mlflow_uri, t.experiment, t.tensorboard_dir) == ("http://env:5000", "from-env", "/e")
    mine = cfg_with(backends=both, mlflow_uri="http://cfg:1", experiment="mine", tensorboard_dir="/c")
    t = resolve_target(mine, str(tmp_path), env)
    assert (t.mlflow_uri, t.experiment, t.tensorboard_dir) == ("http://cfg:1", "mine", "/c")
    t = resolve_target(cfg_with(backends=["tensorboard"]), str(tmp_path), {})
    assert t.tensorboard_dir == str(tmp_path / "tensorboard") and t.experiment == "micro"
    assert resolve_target(cfg_with(), str(tmp_path), {}).backends == ()
    t = resolve_target(cfg_with(), str(tmp_path), {"SOMA_TRACKING_BACKENDS": "tensorboard, mlflow", **env})
    assert t.backends == (Backend.TENSORBOARD, Backend.MLFLOW)


@pytest.mark.parametrize("logdir", ["~/tb", "tb", "./tb/runs", "../tb"])
def test_a_new_campaign_s_tensorboard_dir_is_absolute_and_an_old_one_still_loads(logdir, tmp_path, monkeypatch):
    """campaign.yaml keeps tracking.tensorboard_dir: relative (or a literal ~, which no shell expands inside
    --set) each later command would place the run under its own working directory. Refused for a new campaign,
    naming an absolute path; a campaign.yaml written with one before loads as it is."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SomaError) as info:
        resolve("tiny", {"tracking": {"tensorboard_dir": logdir}})
    line = str(info.value)
    example = os.path.abspath(os.path.expanduser(logdir))  # what the user meant, from here
    assert "not an absolute path" in line and line.endswith(f"--set tracking.tensorboard_dir={example}"), line
    assert ("~ is not expanded" in line) == logdir.startswith("~"), line
    assert resolve("tiny", {"tracking": {"tensorboard_dir": str(tmp_path / "tb")}}).tracking.tensorboard_dir
    cfg = cfg_with()
    old = cfg.model_copy(update={"tracking": cfg.tracking.model_copy(update={"tensorboard_dir": logdir})})
    assert from_yaml_text(to_yaml_text(old), "campaign.yaml").tracking.tensorboard_dir == logdir
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "tracking, env, local, needle",
    [
        ({"backends": ["mlflow"]}, {}, True, "MLFLOW_TRACKING_URI"),
        ({"backends": ["tensorboard"]}, {}, False, "TENSORBOARD_LOGDIR"),
        ({}, {"SOMA_TRACKING_BACKENDS": "wandb"}, True, "SOMA_TRACKING_BACKENDS names wandb"),
        ({"backends": ["mlflow"], "mlflow_uri": "/tmp/mlruns"}, {}, True, "a file store"),
        ({"backends": ["mlflow"]}, {"MLFLOW_TRACKING_URI": "file:///tmp/mlruns"}, True, "a file store"),
        ({"backends": ["tensorboard"]}, {"TENSORBOARD_LOGDIR": "s3://b/tb"}, False, "not a local directory"),
    ],
)
def test_unresolvable_targets_are_refused_with_the_fix(tmp_path, tracking, env, local, needle):
    with pytest.raises(SomaError, match=needle):
        resolve_target(cfg_with(**tracking), str(tmp_path) if local else None, env)


def test_a_missing_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(MODULES, Backend.MLFLOW, "no_such_tracking_package")
    with pytest.raises(SomaError, match=r"pip install 'soma-cluster\[tracking\]'"):
        require_packages((Backend.MLFLOW,))


def test_tracking_is_not_part_of_what_a_campaign_is():
    """Like prepare.engine, how a campaign is watched is left out of its digest (its id), and a campaign.yaml
    written before the section existed loads as it did."""
    plain, tracked = cfg_with(), cfg_with(backends=["mlflow"], mlflow_uri="http://x:1")
    assert plain.digest() == tracked.digest()
    tree = yaml.safe_load(to_yaml_text(plain).split("\n", 5)[5])
    del tree["tracking"]
    assert from_yaml_text(yaml.safe_dump(tree), "old.yaml").tracking.backends == []
    with pytest.raises(SomaError, match="tracking.backends"):
        resolve("tiny", {"tracking": {"backends": ["wandb"]}})


# -- what ---------------------------------------------------------------------------------------------------
def hb(job, attempt, step, t, loss=2.0, val=None):
    return {"event": "heartbeat", "job": job, "t": t, "attempt": attempt, "step": step, "loss": loss, "val": val,
            "eps": 0.01, "lr": 0.001, "gpu_seconds": 1.0}  # fmt: skip


def led(expert, category, gpu_s, t, seq):
    return {"id": f"{category}/{expert}/0/{seq}", "category": category, "expert": expert, "gpu_seconds": gpu_s, "t": t}


def retried_campaign():
    """expert-0000: steps 3, 6, 9 in attempt 0, a failure after 9 (checkpoint at 6), the retry's 9, 12, then its
    end. The ledger: 36 s of training, 9 s wasted, preprocessing 72 s."""
    events = [hb("expert-0000", 0, s, 10.0 + s) for s in (3, 6, 9)]
    events += [{"event": "failed", "job": "expert-0000", "t": 20.0, "attempt": 0, "step": 9, "reason": "x"}]
    events += [{"event": "started", "job": "expert-0000", "t": 21.0, "attempt": 1}]
    events += [hb("expert-0000", 1, s, 22.0 + s, val=1.5 if s == 12 else None) for s in (9, 12)]
    events += [{"event": "finished", "job": "expert-0000", "t": 40.0, "attempt": 1, "step": 12}]
    ledger = [led(None, "preprocessing", 72.0, 1.0, 0)]
    ledger += [led(0, "expert_training", 12.0, 10.0 + s, s) for s in (3, 6, 9)]
    ledger += [led(0, "wasted", 9.0, 20.0, 100), led(0, "expert_training", 12.0, 34.0, 101)]
    return events, ledger


def replay(events, ledger):
    feed, points = Feed(), []
    for source, rec in merged(events, ledger):
        points += feed.on_record(source, rec)
    return points


def series(points, run, key):
    return [(p.step, p.value) for p in points if isinstance(p, Metric) and p.run == run and p.key == key]


def test_a_retried_expert_logs_each_step_once_in_order_and_its_end():
    points = Marks().admit(replay(*retried_campaign()))
    assert [s for s, _ in series(points, "expert-0000", "train_loss")] == [3, 6, 9, 12]
    assert series(points, "expert-0000", "val_loss") == [(12, 1.5)]
    # GPU-hours so far at each heartbeat (the ledger record of the chunk comes first)
    assert [round(v * 3600) for _, v in series(points, "expert-0000", "gpu_hours")] == [12, 24, 36, 57]
    assert series(points, "expert-0000", "retries") == [(12, 1.0)]
    assert series(points, "expert-0000", "gpu_hours/wasted") == [(12, 9.0 / 3600)]
    assert series(points, PARENT, "gpu_hours/preprocessing") == [(6, 72.0 / 3600)]  # step: the 6 ledger records
    assert series(points, PARENT, "jobs_ended") == [(1, 1.0)]
    assert not [p for p in points if isinstance(p, Metric) and p.key.startswith("usd")]  # an unpriced campaign
    assert RunState("expert-0000", Status.FINISHED) in points
    assert Tag("expert-0000", "soma.state", "finished") in points


def test_a_resumed_driver_continues_after_what_the_tracker_holds():
    """The first driver's tracker got steps up to 9; the second driver replays the whole record: only 12 and the
    end go out, and a gap below the high water stays for the backfill, which fills it."""
    events, ledger = retried_campaign()
    first = Marks()
    sent_first = first.admit(replay(events[:3], ledger[:4]))
    held = {k: v for k, v in first.high.items()}
    second = Marks(high=dict(held))
    sent = second.admit(replay(events, ledger))
    assert [s for s, _ in series(sent, "expert-0000", "train_loss")] == [12]
    assert not set(series(sent, "expert-0000", "train_loss")) & set(series(sent_first, "expert-0000", "train_loss"))
    # a backfill that knows every step the tracker holds (here: all but 6) sends 6 alone; with 6, nothing
    every = {}
    for p in replay(events, ledger):
        if isinstance(p, Metric):
            every.setdefault((p.run, p.key), set()).add(p.step)
    known = {k: v - {6} if k[0] == "expert-0000" else set(v) for k, v in every.items()}
    fill = Marks(high=dict(second.high), known=known).admit(replay(events, ledger))
    assert {p.step for p in fill if isinstance(p, Metric)} == {6}
    assert series(fill, "expert-0000", "train_loss") == [(6, 2.0)]
    full = Marks(high=dict(second.high), known=every)
    assert [p for p in full.admit(replay(events, ledger)) if isinstance(p, Metric)] == []


def test_tags_params_and_artifacts_are_sent_once_each_value():
    m = Marks()
    assert len(m.admit([Tag("a", "k", "1"), Tag("a", "k", "1"), Tag("a", "k", "2")])) == 2
    assert m.admit([Params({"x": "1"}), Params({"x": "2", "y": "3"})]) == [Params({"x": "1"}), Params({"y": "3"})]
    assert len(m.admit([Artifact("r.md", b"a"), Artifact("r.md", b"a"), Artifact("r.md", b"b")])) == 2


def test_eval_points_go_to_the_evaluations_count():
    feed = Feed()
    feed.on_record(Source.LEDGER, led(None, "evaluation", 0.0, 1.0, 5))
    m = {"ensemble": {"nats_per_byte": 2.5, "ci95": [2.4, 2.6]}, "seed": {"nats_per_byte": 2.9, "ci95": [2.8, 3.0]}}
    pts = feed.evaluation({**m, "uniform": {"nats_per_byte": 5.545}}, 1.0)
    assert {p.key: (p.step, p.value) for p in pts}["eval/ensemble_ci95_hi"] == (1, 2.6)
    assert {p.key for p in pts} >= {"eval/seed_nats_per_byte", "eval/uniform_nats_per_byte"}


# -- the queue ----------------------------------------------------------------------------------------------
class GatedSink:
    """A tracker that answers only when `gate` is set (or fails while `down`): records what it got."""

    name = "gated"

    def __init__(self, down: bool = False):
        self.gate, self.down, self.got, self.calls = threading.Event(), down, [], 0

    def open(self) -> Marks:
        return Marks()

    def write(self, points) -> None:
        self.calls += 1
        if self.down:
            raise ConnectionRefusedError("tracker down")
        self.gate.wait(10)
        self.got += points

    def close(self) -> None:
        pass


def metric_points(n, run="expert-0000"):
    return [Metric(run, "train_loss", s, 1.0, 0.0) for s in range(n)]


def test_a_slow_tracker_never_blocks_the_driver_and_drops_past_the_bound():
    sink = GatedSink()
    thread = SinkThread(sink, cap=50, retries=0)
    thread.start([])
    t0 = time.perf_counter()
    for i in range(200):  # the sink blocks; the driver's puts must not
        thread.put([Metric("expert-0001", "train_loss", i, 1.0, 0.0)])
    assert time.perf_counter() - t0 < 0.5
    sink.gate.set()
    out = thread.close(10)
    assert out.sent + out.gap.dropped == 200 and out.gap.dropped >= 150 - 1
    assert len({p.step for p in sink.got}) == out.sent  # each sent once
    assert out.gap.runs["expert-0001"][1] == 199


def test_a_failing_tracker_is_retried_a_bounded_number_of_times_then_counted():
    sink = GatedSink(down=True)
    thread = SinkThread(sink, cap=1000, retries=2)
    thread.start(metric_points(5))
    out = thread.close(20)
    assert sink.calls == 3 and out.sent == 0 and out.gap.dropped == 5
    assert "ConnectionRefusedError" in out.error
    assert "expert-0000 steps 0-4" in out.gap.line("gated", "/c")


def test_close_is_bounded_by_its_wait_and_counts_what_is_left():
    sink = GatedSink()  # never opens its gate
    thread = SinkThread(sink, cap=1000, retries=0)
    thread.start(metric_points(3))
    thread.put(metric_points(4, "seed"))
    t0 = time.monotonic()
    out = thread.close(0.5)
    # bounded by its wait, not by the gate that never opens; the slack is the host's (a loaded 2-core one)
    assert time.monotonic() - t0 < 10 and out.gap.dropped == 7 and out.sent == 0


def test_a_tracker_that_stays_down_is_tried_less_often_and_closing_does_not_wait_on_it():
    sink = GatedSink(down=True)
    thread = SinkThread(sink, cap=100_000, retries=0, cooldown_s=0.3, cooldown_max_s=1.2)
    thread.start([])
    t0, n = time.monotonic(), 0
    while time.monotonic() - t0 < 4 and n < 1000:  # bounded: 4 s of a point every ~10 ms
        thread.put([Metric("expert-0000", "train_loss", n, 1.0, 0.0)])
        n += 1
        time.sleep(0.01)
    tries = sink.calls  # tried at ~0, 0.3, 0.9, 2.1, 3.3 s (cool-downs 0.3, 0.6, 1.2, 1.2)
    assert 3 <= tries <= 6, tries  # a fixed 0.3 s cool-down would have tried ~13 times in these 4 s
    assert thread.cooldown == 1.2
    t1 = time.monotonic()
    out = thread.close(20)  # wakes the thread from its cool-down: one more try, then the rest is missed
    assert time.monotonic() - t1 < 10 and sink.calls == tries + 1  # not the 20 s it was given (slack: a loaded host)
    assert out.sent == 0 and out.gap.dropped == n and out.gap.runs == {"expert-0000": [0, n - 1]}


def test_the_cool_down_starts_over_once_the_tracker_is_back():
    sink = GatedSink(down=True)
    sink.gate.set()
    thread = SinkThread(sink, cap=1000, retries=0, cooldown_s=0.1, cooldown_max_s=5.0)
    thread.start(metric_points(3))
    deadline = time.monotonic() + 30  # a loaded host's margin: the loop ends as soon as the cool-down doubled twice
    while thread.cooldown < 0.4 and time.monotonic() < deadline:  # bounded: two failed batches double it twice
        thread.put(metric_points(1, "seed"))
        time.sleep(0.05)
    assert thread.cooldown >= 0.4
    sink.down = False
    thread.put([Metric("seed", "train_loss", 7, 1.0, 0.0)])
    while not sink.got and time.monotonic() < deadline + 30:  # bounded: the next try after the cool-down
        time.sleep(0.05)
    assert sink.got and thread.cooldown == 0.1
    out = thread.close(5)
    assert out.sent == len(sink.got) >= 1 and out.gap.dropped >= 3  # the prologue's batch failed, counted


# -- TensorBoard, read back with its own loaders --------------------------------------------------------------
def test_tensorboard_resume_and_backfill_as_tensorboard_shows_them(tmp_path):
    """Its data server drops a tag's points at or past a step that goes back (a restart), its Python loader draws
    them in file order: a gap filled by appending hid steps 9 and 12 in the one and put 6 last in the other."""
    pytest.importorskip("tensorboard")
    from support.tbloaders import shown

    from pipelines.track import _fill
    from pipelines.tracking_tb import TensorBoardSink

    events, ledger = retried_campaign()
    points = replay(events, ledger)
    first = TensorBoardSink(str(tmp_path), "k1", "micro")
    marks = first.open()
    sent = marks.admit([p for p in points if not (isinstance(p, Metric) and p.step == 6)])  # step 6 missed
    first.write(sent[: len(sent) // 2])  # the driver dies halfway
    first.close()
    second = TensorBoardSink(str(tmp_path), "k1", "micro")  # a resumed driver, to a file of its own
    second.write(second.open().admit(points))
    second.close()
    for loader, runs in shown(str(tmp_path)).items():
        steps = [s for s, _ in runs["micro-k1/expert-0000"]["train_loss"]]
        assert steps == [3, 9, 12], loader  # in order, once each; the gap stays
    store = open_store(str(tmp_path / "c"))  # the backfill's own step (pipelines/track.py) records what it filled
    target = resolve_target(cfg_with(backends=["tensorboard"], tensorboard_dir=str(tmp_path)), None)
    report = _fill(TensorBoardSink(str(tmp_path), "k1", "micro", full=True), points, target, store, retries=0)
    assert (report["points"], report["metrics"], report["runs"]) == (4, 4, ["expert-0000"])  # 4 metrics of step 6
    whole = {(f"micro-k1/{p.run}", p.key): [] for p in points if isinstance(p, Metric)}
    for p in Marks().admit(points):  # each step's first value, in step order: the campaign's curves
        if isinstance(p, Metric):
            whole[(f"micro-k1/{p.run}", p.key)].append((p.step, p.value))
    for loader, runs in shown(str(tmp_path)).items():  # float32 in an event: equal to 1e-7, one run per job
        got = {(run, t): pts for run, tags in runs.items() for t, pts in tags.items()}
        assert {k: [s for s, _ in pts] for k, pts in got.items()} == {
            k: [s for s, _ in pts] for k, pts in whole.items()
        }, loader
        for k, pts in whole.items():
            assert [v for _, v in got[k]] == pytest.approx([v for _, v in pts], rel=1e-6), (loader, k)
    assert report["replaced"] == [f"expert-0000/events.out.tfevents.soma-0000000{n}" for n in (1, 2)]
    sizes = {x.name: x.stat().st_size for x in (tmp_path / "micro-k1" / "expert-0000").iterdir()}
    assert [n for n, size in sorted(sizes.items()) if size] == ["events.out.tfevents.soma-00000003"]  # the rest: empty
    again = _fill(TensorBoardSink(str(tmp_path), "k1", "micro", full=True), points, target, store, retries=0)
    assert (again["points"], again["replaced"]) == (0, [])  # in order already: nothing sent or rewritten


@pytest.mark.parametrize("name", ["../../escape", "team/exp 1", "..", "a/../b", "mü-κ 実験", "実" * 200, "é" * 200])
def test_a_campaign_name_never_places_its_run_outside_the_log_dir(tmp_path, name):
    pytest.importorskip("tensorboard")
    from pipelines.tracking_tb import TensorBoardSink

    logdir = tmp_path / "tb"
    logdir.mkdir()
    sink = TensorBoardSink(str(logdir), "k1", name)
    sink.write(sink.open().admit(replay(*retried_campaign())))
    sink.close()
    runs = [p for p in logdir.iterdir()]
    assert len(runs) == 1 and runs[0].is_dir() and runs[0].name.endswith("-k1") and "/" not in runs[0].name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tb"]  # nothing beside the log dir


def test_a_directory_named_like_an_event_file_is_not_read_as_one(tmp_path):
    pytest.importorskip("tensorboard")
    from pipelines.tracking_tb import TensorBoardSink, run_dir_name

    points = replay(*retried_campaign())
    run = tmp_path / run_dir_name("micro", "k1") / "expert-0000"
    (run / "events.out.tfevents.soma-00000009").mkdir(parents=True)  # a user's (or a sync tool's) directory
    sink = TensorBoardSink(str(tmp_path), "k1", "micro")
    sink.write(sink.open().admit(points))
    sink.close()
    again = TensorBoardSink(str(tmp_path), "k1", "micro")
    assert again.open().admit(points) == []  # what the first wrote is read back whole: nothing to send
    assert (run / "events.out.tfevents.soma-00000009").is_dir()


def test_a_record_torn_by_a_killed_driver_is_written_again_by_the_next(tmp_path):
    """A driver SIGKILLed mid-write leaves a record cut short, where every reader stops in that file: the next
    driver reads what is whole, sends the rest to a new file, and TensorBoard shows every step once."""
    pytest.importorskip("tensorboard")
    from support.tbloaders import shown

    from pipelines.tracking_tb import TensorBoardSink

    points = replay(*retried_campaign())
    first = TensorBoardSink(str(tmp_path), "k1", "micro")
    first.write(first.open().admit(points))
    first.close()
    (f,) = (tmp_path / "micro-k1" / "campaign").iterdir()
    f.write_bytes(f.read_bytes()[:-7])  # the last event (the campaign's totals at the job's end) cut short
    second = TensorBoardSink(str(tmp_path), "k1", "micro")
    resent = [p for p in second.open().admit(points) if isinstance(p, Metric)]
    assert resent and {p.run for p in resent} == {PARENT}
    second.write(resent)
    second.close()
    want = sorted((p.step, p.value) for p in points if isinstance(p, Metric) and p.key == "jobs_ended")
    for loader, runs in shown(str(tmp_path)).items():
        assert runs["micro-k1/campaign"]["jobs_ended"] == want, loader
        assert [s for s, _ in runs["micro-k1/expert-0000"]["train_loss"]] == [3, 6, 9, 12], loader


def test_a_tensorboard_run_is_in_order_only_when_every_tag_rises_in_read_order():
    from soma_cluster.tbrun import Rec, appends_in_order, event_file, held, in_order, next_seq, read_order, seq_of

    ours = [event_file(n) for n in (1, 2, 10)]
    theirs = ["events.out.tfevents.1796489499.vm.23000.0", "notes.txt", ".soma-rewrite-3", "events.out.tfevents.x"]
    assert read_order(ours[::-1] + theirs) == [theirs[0], *ours, theirs[3]]  # by name; no temp file, no notes
    assert [seq_of(n) for n in ours + theirs] == [1, 2, 10, None, None, None, None] and next_seq(ours) == 11
    assert next_seq(theirs) == 1

    def recs(file, tag, *steps):
        return [Rec(file, tag, s, float(s), float(s)) for s in steps]

    a, b = ours[0], ours[1]
    assert in_order(recs(a, "x/loss", 3, 6) + recs(b, "x/loss", 9) + recs(b, "y/loss", 1))
    assert not in_order(recs(a, "x/loss", 3, 9) + recs(b, "x/loss", 6))  # a gap filled by appending
    assert not in_order(recs(a, "x/loss", 3, 6) + recs(b, "x/loss", 6))  # a step twice (a rewrite cut short)
    assert not in_order(recs(theirs[0], "x/loss", 3) + recs(a, "x/loss", 6))  # another writer's points, not ours
    assert in_order(recs(theirs[0], "x/loss", 3) + recs(a, "x/loss", 3, 6))  # ... copied into ours by a rewrite
    run = held(recs(a, "x/loss", 3, 9) + recs(b, "x/loss", 6) + [Rec(b, "x/loss", 9, 0.0, -1.0)])
    assert [(r.step, r.value) for r in run["x/loss"]] == [(3, 3.0), (6, 6.0), (9, 9.0)]  # a step's first value
    assert appends_in_order(run, [("x/loss", 10), ("x/loss", 11), ("z/new", 0)])
    assert not appends_in_order(run, [("x/loss", 11), ("x/loss", 10)]) and not appends_in_order(run, [("x/loss", 9)])


# -- the command --------------------------------------------------------------------------------------------
def test_soma_track_refusals_and_a_tensorboard_backfill(tmp_path):
    store = open_store(str(tmp_path / "c"))
    claim_campaign(store, micro_config())
    assert_one_line_error(soma("track", store.url), "names no tracker", "--backend mlflow")
    assert_one_line_error(soma("track", store.url, "--backend", "wandb"), "--backend 'wandb'")
    proc = soma("track", store.url, "--backend", "tensorboard", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = yaml.safe_load(proc.stdout)
    assert doc["backends"]["tensorboard"]["where"] == str(tmp_path / "c" / "tensorboard")
    assert doc["backends"]["tensorboard"]["points"] > 0
    again = yaml.safe_load(soma("track", store.url, "--backend", "tensorboard", "--json").stdout)
    assert again["backends"]["tensorboard"]["points"] == 0 and again["key"] == doc["key"]


def test_a_replay_tells_a_tracker_each_tag_and_end_at_its_last_value_once():
    from soma_cluster.trackpoints import settled

    points = settled(replay(*retried_campaign()))
    states = [p.value for p in points if isinstance(p, Tag) and p.key == "soma.state"]
    assert states == ["finished"]  # not running, retrying, running, finished
    m = Marks(known={})
    assert m.admit(points) and m.admit(points) == []  # a second backfill sends nothing
    held = Marks(tags={("expert-0000", "soma.state"): "finished", ("expert-0000", ""): Status.FINISHED})
    assert not [p for p in held.admit(points) if isinstance(p, (Tag, RunState)) and p.run == "expert-0000" and
                getattr(p, "key", "soma.state") == "soma.state"]  # fmt: skip


def test_an_experiments_arms_share_one_tracker_experiment(monkeypatch):
    from pipelines.experiment import _tracked_as
    from soma_cluster.experimentspecs import load_spec

    spec = load_spec("zo-compare")
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    assert _tracked_as(cfg_with(backends=["mlflow"]), spec).tracking.experiment == "soma-zo-compare"
    assert _tracked_as(cfg_with(experiment="mine"), spec).tracking.experiment == "mine"
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "from-env")
    assert _tracked_as(cfg_with(), spec).tracking.experiment is None  # the environment's, at resolve time


# -- statuses, parameters, names ----------------------------------------------------------------------------
def test_runs_take_the_status_the_campaign_reached_and_reopen_on_resume():
    """A job's run is RUNNING from its start, FINISHED or FAILED at its end; a command that stops leaves the runs of
    its jobs in flight KILLED, and the campaign's run FINISHED, FAILED (an expert failed permanently) or KILLED;
    a resume starts them again (RUNNING)."""
    from soma_cluster.trackpoints import Stage

    feed = Feed()
    ev = [{"event": "started", "job": j, "t": 1.0, "attempt": 0} for j in ("expert-0000", "expert-0001")]
    ev += [{"event": "finished", "job": "expert-0000", "t": 2.0, "attempt": 0, "step": 3}]
    points = [p for e in ev for p in feed.on_record(Source.EVENTS, e)] + feed.stage(Stage.LAUNCH, "stopped")
    status = {p.run: p.status for p in settled_states(points)}
    assert status == {"expert-0000": Status.FINISHED, "expert-0001": Status.KILLED, PARENT: Status.KILLED}
    resumed = feed.stage(Stage.LAUNCH, "running")
    resumed += feed.on_record(Source.EVENTS, {"event": "started", "job": "expert-0001", "t": 3.0, "attempt": 1})
    assert {p.run: p.status for p in settled_states(resumed)} == {PARENT: Status.RUNNING, "expert-0001": Status.RUNNING}
    end = {"event": "failed_permanently", "job": "expert-0001", "t": 4.0, "attempt": 1, "step": 2}
    done = feed.on_record(Source.EVENTS, end) + feed.stage(Stage.LAUNCH, "finished")
    assert {p.run: p.status for p in settled_states(done)} == {PARENT: Status.FAILED, "expert-0001": Status.FAILED}
    assert feed.stage(Stage.EVAL, "finished")[1] == RunState(PARENT, Status.FAILED)  # what the campaign reached


def settled_states(points):
    from soma_cluster.trackpoints import settled

    return [p for p in settled(points) if isinstance(p, RunState)]


def test_a_job_s_run_carries_its_parameters_and_its_shard():
    from soma_cluster.trackpoints import job_params

    cfg = micro_config(n_experts=2)
    params = job_params(cfg, {"train_rows": [10, 12], "val_rows": [1, 2]})
    feed = Feed(params=params)
    assert not [p for p in feed.on_record(Source.EVENTS, {"event": "started", "job": "expert-0001", "t": 1.0,
                                                          "attempt": 0}) if isinstance(p, Params)]  # fmt: skip
    got = feed.on_record(Source.EVENTS, hb("expert-0001", 0, 3, 2.0))  # with its first points, once
    assert not [p for p in feed.on_record(Source.EVENTS, hb("expert-0001", 0, 6, 3.0)) if isinstance(p, Params)]
    (p,) = [p for p in got if isinstance(p, Params)]
    assert p.run == "expert-0001" and p.values["shard.train_rows"] == "12" and p.values["expert"] == "1"
    assert p.values["train.updates"] == str(cfg.train.updates) and "spsa.n_pert" in p.values
    assert "corpus.paths" not in p.values and "seed_stage.updates" in params["seed"]
    m = Marks()  # the campaign's parameters and a job's are kept apart: one key, two runs
    assert len(m.admit([Params({"seed": "0"}), Params({"seed": "0"}, "expert-0001")])) == 2


def test_tags_and_names_are_for_people(tmp_path, monkeypatch):
    """soma.url absolute (an s3:// URL as it is); a fork's run names its parent; the experiment is the campaign's
    name when a person gave one, else its directory's, never only the preset's."""
    from soma_cluster.trackpoints import Fork, campaign_points, default_experiment, dir_name

    monkeypatch.chdir(tmp_path)
    tags = {p.key: p.value for p in campaign_points(micro_config(), "k", "runs/c1", {}) if isinstance(p, Tag)}
    assert tags["soma.url"] == str(tmp_path / "runs" / "c1") and tags["soma.dir"] == "c1"
    assert "soma.forked_from" not in tags
    fork = Fork("runs/c0", "parent-key")
    tags = {
        p.key: p.value for p in campaign_points(micro_config(), "k", "s3://b/p/c2/", {}, fork) if isinstance(p, Tag)
    }
    assert tags["soma.url"] == "s3://b/p/c2" and tags["soma.forked_from"] == str(tmp_path / "runs" / "c0")
    assert tags["soma.forked_from_campaign"] == "parent-key" and dir_name("s3://b/p/c2/") == "c2"
    tiny = micro_config(name="tiny", preset="tiny")
    assert (
        default_experiment(tiny, "runs/c1") == "c1" and default_experiment(micro_config(name="sweep"), "c1") == "sweep"
    )
    t = resolve_target(cfg_with(backends=["mlflow"], mlflow_uri="http://x:1"), None, {}, url="runs/c9")
    assert t.experiment == "micro"  # micro_config's own name
