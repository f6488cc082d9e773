"""Config revisions without Ray: which settings may change and why, the config in force, two operators at once,
which ended experts a change reopens, and a scheduler that takes a revision mid-run (fake clock)."""

from __future__ import annotations

import threading

import pytest
from conftest import micro_config
from test_schedule import PER_UPDATE, beat, by, scheduler, started

from pipelines.revision_pickup import take_up
from soma_cluster.config import to_yaml_text
from soma_cluster.errors import ChecksumError, SomaError
from soma_cluster.events import EXTENDED, emit
from soma_cluster.jobs import AttemptCause, Category, Event, Job, JobState
from soma_cluster.ledger import Ledger
from soma_cluster.messages import ChunkReport
from soma_cluster.revisions import LIVE_KEYS, Rule, check, in_force, record, revisions, rule, to_reopen
from soma_cluster.schedule import Chunk, Stop
from soma_cluster.storage import Store


@pytest.fixture
def campaign(tmp_path) -> tuple[Store, object]:
    cfg = micro_config(budget={"expert_gpu_hours": 1.0})
    store = Store(str(tmp_path / "c"))
    store.write_bytes("campaign.yaml", to_yaml_text(cfg).encode())
    return store, cfg


@pytest.mark.parametrize(
    "key,value,words",
    [
        ("n_experts", "8", "cannot change"),
        ("corpus.source", "/data", "cannot change"),
        ("model.d", "64", "cannot change"),
        ("train.method", "bptt", "cannot change"),
        ("seed_stage.updates", "9", "cannot change"),
        ("budget.campaign_gpu_hours", "-1", "greater than 0"),
        ("budget.campaign_gpu_hours", ".nan", "finite"),
        ("budget.expert_gpu_hours", ".inf", "finite"),
        ("budget.campaign_gpu_hours", "lots", "budget.campaign_gpu_hours"),
        ("train.updates", "3", "can only grow"),
        ("train.updatez", "30", "did you mean train.updates"),
        ("retry.max_retries", "-2", "retry.max_retries"),
        ("budget.expert_gpu_hours", "1.0", "nothing to change"),
        ("budget", "5", "budget is a section"),
        ("prices", "{}", "prices is a section"),
        ("budget.expert_gpu_hours", "", "has no value"),
        ("prices.spot", "true", "no prices.accelerator"),
    ],
)
def test_a_change_that_cannot_be_made_is_one_message_naming_it(campaign, key, value, words):
    store, cfg = campaign
    with pytest.raises(SomaError, match=words):
        record(store, cfg, [f"{key}={value}"], driver_running=False)
    assert revisions(store) == []  # nothing written


def test_rules_cover_every_kind_of_setting():
    assert rule("budget.campaign_gpu_hours") is Rule.LIVE and rule("resources.max_actors") is Rule.LIVE
    assert rule("spsa.lr") is Rule.AT_START and rule("eval.batch") is Rule.AT_START
    assert rule("router.top_k") is Rule.FIXED and rule("name") is Rule.FIXED
    assert all(rule(k) is Rule.LIVE for k in LIVE_KEYS)


def test_at_start_settings_wait_for_no_driver(campaign):
    store, cfg = campaign
    with pytest.raises(SomaError, match="read when a driver starts"):
        check(cfg, ["spsa.lr=0.002"], driver_running=True)
    changes, new = check(cfg, ["spsa.lr=0.002", "budget.campaign_gpu_hours=2"], driver_running=False)
    assert changes == {"spsa.lr": 0.002, "budget.campaign_gpu_hours": 2.0} and new.spsa.lr == 0.002


def test_revisions_make_the_config_in_force_and_keep_who_and_what(campaign):
    store, cfg = campaign
    r1 = record(store, cfg, ["budget.campaign_gpu_hours=2", "train.updates=24"], driver_running=True)
    r2 = record(store, cfg, ["budget.campaign_gpu_hours=3"], driver_running=True)
    now, revs = in_force(store, cfg)
    assert [r.rev for r in revs] == [1, 2] and revs == [r1, r2]
    assert now.budget.campaign_gpu_hours == 3.0 and now.train.updates == 24 and now.digest() == r2.digest
    assert r2.was == {"budget.campaign_gpu_hours": 2.0} and "@" in r2.by
    assert r1.line() == "budget.campaign_gpu_hours: unset -> 2.0, train.updates: 12 -> 24"
    with open(store.root + "/config/rev-000002.json", "r+b") as f:
        f.seek(20)
        f.write(b"X")
    with pytest.raises(ChecksumError, match="rev-000002.json is damaged.*cannot be deleted"):
        in_force(store, cfg)


def test_two_operators_at_once_get_two_revisions_and_neither_is_lost(campaign):
    store, cfg = campaign
    barrier, out, errors = threading.Barrier(6), [], []

    def one(i: int) -> None:
        barrier.wait()
        try:
            out.append(record(store, cfg, [f"budget.campaign_gpu_hours={i + 1}"], driver_running=True))
        except SomaError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    revs = revisions(store)
    assert not errors and sorted(r.rev for r in out) == [1, 2, 3, 4, 5, 6] and len(revs) == 6
    # each was checked against the one before it: its `was` is what the revision before it set
    for before, after in zip(revs, revs[1:], strict=False):
        assert after.was["budget.campaign_gpu_hours"] == before.set["budget.campaign_gpu_hours"]


def test_what_a_change_reopens(campaign):
    _, cfg = campaign
    ended = {
        "expert-0000": (JobState.FINISHED, 12),
        "expert-0001": (JobState.BUDGET_EXHAUSTED, 5),
        "expert-0002": (JobState.CONVERGED, 7),
        "expert-0003": (JobState.FAILED_PERMANENTLY, 3),
    }
    more = cfg.model_copy(update={"train": cfg.train.model_copy(update={"updates": 24})})
    assert to_reopen(ended, cfg, more) == ["expert-0000", "expert-0001"]
    richer = cfg.model_copy(update={"budget": cfg.budget.model_copy(update={"expert_gpu_hours": 2.0})})
    assert to_reopen(ended, cfg, richer) == ["expert-0001"]  # finished at its target: nothing more to train
    poorer = cfg.model_copy(update={"budget": cfg.budget.model_copy(update={"expert_gpu_hours": 0.5})})
    assert to_reopen(ended, cfg, poorer) == []
    unlimited = cfg.model_copy(update={"budget": cfg.budget.model_copy(update={"expert_gpu_hours": None})})
    assert to_reopen(ended, cfg, unlimited) == ["expert-0001"]
    seed = {"seed": (JobState.BUDGET_EXHAUSTED, 3), "expert-0000": (JobState.FINISHED, 12)}
    assert to_reopen(seed, cfg, richer) == ["seed"]  # a budget-stopped seed trains on too (soma seed)


def test_a_running_scheduler_obeys_a_lowered_cap_at_the_next_chunk_and_reopens_on_a_raise(tmp_path):
    s = scheduler(tmp_path, n_experts=2, budget={"expert_gpu_hours": 1.0})
    s.restore({})
    a, b = s.requests(2)
    chunk = by(s.on_setup(a.unit.id, started([0], gpu_s=2.0)), Chunk)[0]
    assert chunk.caps == {0: 3600.0} and chunk.targets == {0: 12}
    by(s.on_setup(b.unit.id, started([1], gpu_s=2.0)), Chunk)
    lowered = s.cfg.model_copy(update={"budget": s.cfg.budget.model_copy(update={"expert_gpu_hours": 5 / 3600})})
    s.revise(lowered, [])
    nxt = by(s.on_chunk(a.unit.id, ChunkReport({0: beat(3, 4.0, 3 * PER_UPDATE)}, 4.0)), Chunk)[0]
    assert nxt.caps[0] == pytest.approx(5.0)  # the new cap on the worker's own clock: it stops before the next chunk
    stop = s.on_chunk(a.unit.id, ChunkReport({0: beat(3, 4.5, 3 * PER_UPDATE, reason="budget_exhausted")}, 4.5))
    assert by(stop, Stop) and s.outcome[Job(0)] == JobState.BUDGET_EXHAUSTED
    longer = lowered.model_copy(
        update={"budget": lowered.budget.model_copy(update={"expert_gpu_hours": 1.0}), "train": lowered.train}
    )
    s.revise(longer, [Job(0)])
    assert Job(0) not in s.outcome and s.cause[Job(0)] == AttemptCause.EXTENDED and Job(0) in s.pending
    reopened = [e for e in s.store.read_log("events.jsonl") if e["event"] == "reopened"]
    assert reopened[-1]["reason"] == "extended" and reopened[-1]["was"] == "budget_exhausted"
    (again,) = s.requests(3)
    by(s.on_setup(again.unit.id, started([0], step=3, gpu_s=1.0)), Chunk)
    assert Ledger(s.store).totals().gpu_seconds.get(Category.WASTED, 0.0) == 0.0  # an extension's start is no waste


def test_a_driver_lost_between_reopening_and_logging_applies_it_again_reopening_nothing_twice(campaign):
    store, cfg = campaign
    for name in ("expert-0000", "expert-0001"):
        emit(store, Event.FINISHED, name, step=12, attempt=0)
    record(store, cfg, ["train.updates=24"], driver_running=False)
    emit(store, Event.REOPENED, "expert-0000", step=12, reason=EXTENDED)  # the lost driver got this far
    lines = []
    assert [r.rev for r in take_up(store, in_force(store, cfg)[0], lines.append)] == [1]
    log = store.read_log("events.jsonl")
    reopened = [ev["job"] for ev in log if ev["event"] == "reopened"]
    assert reopened == ["expert-0000", "expert-0001"] and sum(ev["event"] == "config_revised" for ev in log) == 1
    assert take_up(store, in_force(store, cfg)[0], lines.append) == []  # applied: a later driver does nothing
    assert len(store.read_log("events.jsonl")) == len(log)
