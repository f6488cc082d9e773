"""The ETA's estimator (soma_cluster/eta.py), without Ray: its rules on made-up records, and replayed over the traces
of real runs (tests/assets/eta_trace_*.csv: the events of `soma launch`, reduced by soma_cluster.eta.trace_rows;
t in seconds from the launch's first event):
- eta_trace_bptt.csv: a tiny BPTT campaign, 6 experts on 3 logical GPUs of a loaded 2-core machine, from before
  traces kept `queued` (so no start-up is measured on it); the estimator settles where a trailing-window rate swung;
- eta_trace_n4, eta_trace_n256, eta_trace_n256b: the tiny preset at N = 4 (make demo's size, 48 s) and twice at
  N = 256 (45 MB of the machine's text, experts of 60 updates, 4 logical GPUs: start-up and Ray's hand-over are a
  third to half of each lane's time; 2,698 s while the shared host's load average went from 5 to 32, and 1,240 s
  at 4 to 15), recorded by benchmarks/bench_eta.py --record, each with what `soma plan` measured before the launch
  and the ledger's totals after it (the .json beside it)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from soma_cluster.config import resolve
from soma_cluster.costmodel import predict, times_of_run
from soma_cluster.eta import Eta, Prior, replay, trace_rows
from soma_cluster.snapshot import eta_s

ASSETS = Path(__file__).parent / "assets"
TICK_S = 5.0  # the driver's snapshot period (pipelines/campaign.py STATUS_S): when an ETA is shown


def test_start_up_is_measured_from_a_free_lane_to_the_first_heartbeat():
    eta = Eta(tau_s=60.0)
    for j in ("a", "b", "c"):
        eta.queued(j, 0, 0.0)  # all asked of Ray at once, two lanes
    eta.beat("a", 0, 4.0, 1)  # its lane was free when it was queued: 4 s of start-up (the first update inside)
    eta.beat("b", 0, 6.0, 1)
    assert eta.startup.value == pytest.approx(5.0, rel=0.01) and eta.update.value is None  # decayed a little
    assert eta.seconds_left({"a": 9, "b": 9, "c": 10}, {"a", "b"}, lanes=2, now=6.0) is None  # no speed yet
    eta.beat("a", 0, 13.0, 10)
    eta.beat("b", 0, 15.0, 10)
    assert eta.update.value == pytest.approx(1.0)
    eta.ended("a", 13.0)  # a's lane is free at 13; c took it and made its first update at 19: 6 s
    eta.record({"event": "finished", "job": "a", "t": 13.0})  # the same attempt's end again frees nothing more
    assert eta._frees == [13.0]
    # at 15: b has 0 left; c, in start-up since 13 (the free lane), ends it at 13 + 5, then makes 9 more updates
    assert eta.seconds_left({"a": 0, "b": 0, "c": 10}, {"b"}, 2, now=15.0) == pytest.approx(3.0 + 9.0, rel=0.02)
    eta.beat("c", 0, 19.0, 1)
    assert eta.startup.value == pytest.approx((4 + 6 + 6 * 1) / 3, rel=0.05)  # decayed over 19 s: near the mean
    assert eta._frees == []


def test_time_left_runs_the_lanes_a_job_on_its_own_speed_the_waiting_after_a_start_up():
    eta = Eta(prior=Prior(startup_s=2.0, update_s=1.0))
    # before any sample the prior stands in: 3 jobs of 10 updates in 2 lanes, none started, queued now
    for j in ("a", "b", "c"):
        eta.queued(j, 0, 0.0)
    assert eta.seconds_left({"a": 10, "b": 10, "c": 10}, set(), 2, now=0.0) == pytest.approx(2 * (2 + 9))
    assert eta.seconds_left({"a": 0}, set(), 1, 0.0) == 0.0 and Eta().seconds_left({"a": 1}, set(), 1, 0.0) is None
    eta.beat("a", 0, 2.0, 1)
    eta.beat("a", 0, 12.0, 11)  # 1 s per update; its own figure starts from the campaign's: the same
    eta.beat("b", 0, 2.0, 1)
    eta.beat("b", 0, 22.0, 11)  # 2 s per update: b is slow, the campaign's figure is their ratio, 1.5
    assert eta.update.value == pytest.approx(30 / 20, rel=0.05)
    assert eta.speed("b", eta.update.value) > eta.speed("a", eta.update.value)
    left = {"a": 9, "b": 9, "c": 10}
    running = {"a", "b"}
    # at 22: a has 9 s left less the 10 s since its beat at 12: 0; c starts in its lane then: 2 s + 9 x 1.5
    got = eta.seconds_left(left, running, 2, now=22.0)
    assert got == pytest.approx(max(9 * eta.speed("b", 1.5), 2.0 + 9 * eta.update.value), rel=1e-6)
    # one lane only (resources.max_actors lowered to 1 while two run): the first to end frees none; c waits for both
    one = eta.seconds_left(left, running, 1, now=22.0)
    assert one == pytest.approx(9 * eta.speed("b", 1.5) + 2.0 + 9 * eta.update.value, rel=1e-6)


def test_a_new_driver_keeps_what_the_last_one_learned_and_forgets_its_lanes():
    eta = Eta()
    eta.queued("a", 0, 0.0)
    eta.beat("a", 0, 3.0, 1)
    eta.beat("a", 0, 13.0, 11)
    eta.record({"event": "failed", "job": "a", "t": 14.0})
    learned = (eta.startup.value, eta.update.value)
    eta.restart()  # soma resume: its attempt 1 starts from the checkpoint at step 10
    assert (eta.startup.value, eta.update.value) == learned and eta._frees == [] and eta._queued == {}
    eta.queued("a", 1, 100.0)
    assert eta.seconds_left({"a": 290}, set(), 4, now=100.0) == pytest.approx(3.0 + 289 * 1.0)
    eta.beat("a", 1, 104.0, 11)  # its first heartbeat after the restart: a start-up sample, not a speed
    eta.beat("a", 1, 105.0, 12)
    assert eta.startup.value > 3.0 and eta.update.value == pytest.approx(1.0, rel=0.01)


def load(name: str) -> tuple[list[dict], dict]:
    """A recorded trace (rows as trace_rows gives them) and its facts (the .json beside it, if any)."""
    with (ASSETS / f"{name}.csv").open() as fh:
        rows = [
            {**r, "t": float(r["t"]), "attempt": int(r["attempt"]), "step": int(r["step"])} for r in csv.DictReader(fh)
        ]
    facts = ASSETS / f"{name}.json"
    return rows, json.loads(facts.read_text()) if facts.exists() else {}


RECORDED = ("eta_trace_n4", "eta_trace_n256", "eta_trace_n256b")


def test_the_model_is_within_5_percent_of_the_real_end_given_the_machine_s_speed():
    """The lanes, start-ups and updates as modelled, given the start-up and seconds per update that the machine
    then gave (the means of the samples after each moment: `hindsight_s`), end where the run ended: within +-5% (or
    two 5 s snapshots, near the end) from 10% to 95% of the updates, at N = 4 and at N = 256. The same
    lanes without start-up (the estimator before this one: every job its updates only) end far too early."""
    for name in RECORDED:
        rows, facts = load(name)
        ticks = [k for k in replay(rows, facts["target"], facts["lanes"], TICK_S) if 0.10 <= k.done <= 0.95]
        worst = max(ticks, key=lambda k: abs(k.hindsight_s / k.left_s - 1))
        print(f"\n{name}: worst {worst.hindsight_s / worst.left_s - 1:+.1%} at {worst.done:.0%} of the updates")
        assert all(abs(k.hindsight_s - k.left_s) <= max(0.05 * k.left_s, 2 * TICK_S) for k in ticks), worst
        if facts["overrides"]["n_experts"] == 256:  # at 10%: its updates alone, in its lanes, at the run's speed
            k = ticks[0]
            per_lane = (1 - k.done) * facts["target"] * facts["overrides"]["n_experts"] / facts["lanes"]
            assert per_lane * facts["measured"]["update_s"] < 0.7 * k.left_s


@pytest.mark.parametrize("name", RECORDED)
def test_the_eta_over_recorded_runs(name):
    """The ETA as the driver shows it (replayed every 5 s, with the plan's prior) against the real end, from 10% to
    95% of the updates: its median error within 20%, every mark printed. It follows the speed it measures and
    foresees no change of it: on the shared host these runs come from, Ray's workers (niceness 15) went up to 2.5
    times slower and faster again as other work came and went, and the worst errors are those (the model's own,
    in brackets, stays within a few %)."""
    rows, facts = load(name)
    ticks = replay(rows, facts["target"], facts["lanes"], TICK_S, Prior(**facts["prior"]))
    print(f"\n{name}: stage {ticks[-1].t + ticks[-1].left_s:.0f} s; error of the time left [the model's own]")
    for mark in (0.10, 0.25, 0.50, 0.75):
        k = next(k for k in ticks if k.done >= mark)
        print(f"  at {k.done:.0%} of the updates: {k.eta_s / k.left_s - 1:+.1%} [{k.hindsight_s / k.left_s - 1:+.1%}]")
    errors = sorted(abs(k.eta_s / k.left_s - 1) for k in ticks if 0.10 <= k.done <= 0.95)
    within = sum(e <= 0.20 for e in errors) / len(errors)
    print(f"  median {errors[len(errors) // 2]:.1%}, worst {errors[-1]:.1%}, within 20%: {within:.0%} of the time")
    assert errors[len(errors) // 2] <= 0.20


def test_the_eta_settles_on_a_real_run_where_the_trailing_window_swung():
    """The BPTT trace's machine slowed and sped up as other work came and went (its experts' chunks took 4 to 18 s),
    so no estimate can be exact; what is asked is that the predicted end moves with the machine, not with the
    estimator: measured, total variation 1,042 s against the trailing window's 2,304 s, largest move in 30 s 147 s
    against 320 s, median error 78 s, on a launch of 558 s."""
    rows, _ = load("eta_trace_bptt")
    target = max(r["step"] for r in rows)
    ticks = replay(rows, target, 3, TICK_S)
    step, ended, window, old = {}, set(), [], []
    for k in ticks:  # the trailing-window rate it replaced: all jobs' updates over the last 60 s
        for r in rows:
            if r["t"] <= k.t and r["event"] == "heartbeat":
                step[r["job"]] = r["step"]
            elif r["t"] <= k.t and r["event"] == "finished":
                ended.add(r["job"])
        window.append((k.t, sum(step.values())))
        while len(window) > 2 and k.t - window[1][0] >= 60.0:
            window.pop(0)
        (t0, s0), s = window[0], sum(step.values())
        jobs = [
            {"target": target, "step": step.get(j, 0), "state": "finished" if j in ended else "running"}
            for j in {r["job"] for r in rows}
        ]
        old.append(eta_s(jobs, (s - s0) / (k.t - t0) if k.t > t0 and s > s0 else None))
    total, since = ticks[-1].t + ticks[-1].left_s, 20.0
    new = swings([(k.t, k.eta_s, k.left_s) for k in ticks], since)
    was = swings([(k.t, o, k.left_s) for k, o in zip(ticks, old, strict=True)], since)
    print(f"\nlaunch {total:.0f} s: total variation, largest move in 30 s, median error: {new} (trailing window {was})")
    (tv, jump, err), (old_tv, old_jump, _) = new, was
    assert tv <= old_tv / 2 and jump <= 0.3 * total and jump < old_jump / 2, (new, was)
    assert err <= 0.2 * total, err


def swings(got: list[tuple], since: float) -> tuple[float, float, float]:
    """Of (t, ETA, true left) from `since` on: the total variation of the predicted end (t + ETA, s), its largest
    move over 30 s, and the median error of the ETA while more than a minute is left (s)."""
    ends = [(t, t + e) for t, e, _ in got if e is not None and t >= since]
    tv = sum(abs(b[1] - a[1]) for a, b in zip(ends, ends[1:], strict=False))
    jump = max(abs(b[1] - a[1]) for a, b in zip(ends, ends[int(30 / TICK_S) :], strict=False))
    errs = sorted(abs(e - left) for t, e, left in got if e is not None and t >= since and left > 60)
    return round(tv), round(jump), round(errs[len(errs) // 2])


@pytest.mark.parametrize("name", RECORDED)
def test_plan_bills_what_the_ledger_billed(name):
    """`soma plan`'s model (soma_cluster/costmodel.py) on the times the recorded run took (costmodel.times_of_run:
    each queued actor's boot from a freed slot, its load, its seconds per update; the shape of the calibration's
    concurrent probe) against the ledger's expert_training GPU-hours and the stage's wall time: within 10%. Billed
    as the model did before (every actor's start-up counted), N = 256 comes out far over, as in the issue (+82%):
    252 of its 256 actors waited in Ray's queue and are billed from their first instruction, not their imports.
    The plan as made before each launch (its calibration on this shared host, a sample of a speed that then changed
    2.5 times) is printed, not asserted."""
    rows, facts = load(name)
    cfg = resolve("tiny", facts["overrides"])
    measured = times_of_run(rows, facts["lanes"])
    assert measured == pytest.approx(facts["measured"])
    p = predict(cfg, {**facts["calibration"], "concurrent": measured}, facts["gpus"], facts["cores"], {}, True)
    hours, wall = p["gpu_hours"]["expert_training"], p["wall_seconds"]["experts"]
    actual_h, actual_wall = facts["ledger"]["expert_training"], facts["wall_s"]
    made = facts["plan_made"]
    print(
        f"\n{name}: GPU-hours {hours:.4f} against {actual_h:.4f} ({hours / actual_h - 1:+.1%}), wall {wall:.0f} s "
        f"against {actual_wall:.0f} s ({wall / actual_wall - 1:+.1%}); the plan made before the launch, on its own "
        f"calibration: {made['gpu_hours']['expert_training']:.4f} GPU-hours, {made['wall_seconds']['experts']:.0f} s"
    )
    assert abs(hours / actual_h - 1) <= 0.10 and abs(wall / actual_wall - 1) <= 0.10
    if facts["overrides"]["n_experts"] == 256:
        assert p["actor_starts"] == {"granted": 4, "queued": 252, "reused": 0}
        assert (hours + p["unbilled_gpu_hours"]) / actual_h - 1 > 0.4


def test_trace_rows_keep_what_the_estimator_reads():
    events = [
        {"event": "queued", "job": "expert-0000", "t": 100.0, "attempt": 0},
        {"event": "launched", "job": "expert-0000", "t": 100.0, "attempt": 0},
        {"event": "heartbeat", "job": "expert-0000", "t": 104.5, "attempt": 0, "step": 1, "loss": 3.0},
        {"event": "checkpointed", "job": "expert-0000", "t": 110.0, "attempt": 0, "step": 50},
        {"event": "finished", "job": "expert-0000", "t": 110.0, "attempt": 0, "step": 50},
    ]
    assert trace_rows(events, restarts=[102.0]) == [
        {"t": 0.0, "event": "queued", "job": "expert-0000", "attempt": 0, "step": 0},
        {"t": 0.0, "event": "launched", "job": "expert-0000", "attempt": 0, "step": 0},
        {"t": 2.0, "event": "driver", "job": "", "attempt": 0, "step": 0},
        {"t": 4.5, "event": "heartbeat", "job": "expert-0000", "attempt": 0, "step": 1},
        {"t": 10.0, "event": "finished", "job": "expert-0000", "attempt": 0, "step": 50},
    ]


def test_a_launch_s_own_events_feed_the_estimator(trained_campaign):
    """The session's trained micro campaign (3 experts, the real CLI): its events log, as this code writes it, gives
    a start-up per attempt and a speed, and the ETA replayed over it falls as the launch goes on."""
    from soma_cluster.storage import Store

    events = [e for e in Store(str(trained_campaign)).read_log("events.jsonl") if e["job"].startswith("expert-")]
    rows = trace_rows(events)
    eta = Eta()
    for r in rows:
        eta.record(r)
    assert eta.startup.value > 0 and eta.update.value > 0
    target = max(r["step"] for r in rows)
    from soma_cluster.jobs import ENDS

    end = max(r["t"] for r in rows if r["event"] in ENDS)
    ticks = replay(rows, target, 4, end / 20)  # twenty ticks whatever the machine's speed (a fast one: under 3 s)
    assert len(ticks) >= 20 and ticks[-1].eta_s is not None
    assert ticks[-1].eta_s < ticks[0].left_s and ticks[-1].done > ticks[0].done


def test_the_driver_takes_its_prior_from_the_plan(tmp_path, capsys):
    """plan/plan.json's `actor` figures are the ETA's prior (pipelines/campaign.py eta_prior); no plan, a plan from
    before it said, or a damaged one: no prior, and the launch goes on (a warning for the damaged one)."""
    from pipelines.campaign import eta_prior
    from soma_cluster.costmodel import PLAN
    from soma_cluster.storage import Store

    store = Store(str(tmp_path))
    assert eta_prior(store, "experts") is None
    store.write_json(PLAN, {"schema": 1})
    assert eta_prior(store, "experts") is None
    store.write_json(PLAN, {"actor": {"experts": {"startup_s": 6.0, "update_s": 0.1}, "seed": None}})
    assert eta_prior(store, "experts") == Prior(6.0, 0.1) and eta_prior(store, "seed") is None
    (tmp_path / PLAN).write_bytes(b"\xff{not json")
    assert eta_prior(store, "experts") is None and "not used for the ETA" in capsys.readouterr().err


def test_a_job_with_a_budget_stops_at_the_update_it_cannot_afford():
    eta = Eta(prior=Prior(startup_s=2.0, update_s=1.0))
    left, caps = {"a": 100, "b": 100}, {"a": 30.0, "b": None}  # a may spend 30 GPU-s more: 30 updates at 1 GPU
    assert eta.seconds_left(left, set(), 2, 0.0, caps) == pytest.approx(2.0 + 99)
    assert eta.seconds_left({"a": 100}, set(), 1, 0.0, caps) == pytest.approx(2.0 + 29)
    assert eta.seconds_left({"a": 100}, set(), 1, 0.0, caps, share=0.5) == pytest.approx(2.0 + 59)  # half a GPU
    assert eta.seconds_left({"a": 100}, set(), 1, 0.0, {"a": 0.0}) == 0.0  # it stops at its next chunk


def test_max_actors_holds_back_only_the_jobs_not_yet_asked_of_ray():
    """resources.max_actors lowered while jobs run (soma set): the driver asks Ray for no more, and withdraws none
    it already asked for, so a job already queued still takes the first free lane; one not yet asked waits until
    fewer than max_actors run."""
    eta = Eta(prior=Prior(startup_s=0.0, update_s=1.0))
    for j in ("a", "b"):
        eta.queued(j, 0, 0.0)
        eta.beat(j, 0, 0.0, 1)
    left, running = {"a": 10, "b": 20, "c": 10}, {"a", "b"}
    assert eta.seconds_left(left, running, 2, 0.0, most=1) == pytest.approx(20 + 9)  # c, not asked: after b
    eta.queued("c", 0, 0.0)
    assert eta.seconds_left(left, running, 2, 0.0, most=1) == pytest.approx(20)  # c, asked: after a, beside b


def test_a_reused_actor_s_start_up_is_its_own_figure():
    """resources.reuse_actors: an idle actor takes the next job without a new process; its start-up is measured
    apart (the `queued` event says reused) and stands for the jobs still waiting, the plan's until then."""
    eta = Eta(prior=Prior(startup_s=10.0, update_s=1.0, reused_s=0.5))
    eta.record({"event": "queued", "job": "a", "t": 0.0, "attempt": 0, "reused": False})
    eta.beat("a", 0, 12.0, 1)  # a new actor: 12 s
    assert eta.figures() == (1.0, pytest.approx(12.0), 0.5)
    assert eta.seconds_left({"a": 9, "b": 10}, {"a"}, 1, 12.0, reuse=True) == pytest.approx(9 + 0.5 + 9)
    assert eta.seconds_left({"a": 9, "b": 10}, {"a"}, 1, 12.0) == pytest.approx(9 + 12 + 9)
    eta.ended("a", 21.0)
    eta.record({"event": "queued", "job": "b", "t": 21.0, "attempt": 0, "reused": True})
    eta.beat("b", 0, 22.0, 1)
    assert eta.reused.value == pytest.approx(1.0) and eta.startup.value == pytest.approx(12.0, rel=0.01)
