"""Whose failure is it (soma_cluster/failures.py), and what the Scheduler does about each, on a fake clock without
Ray: the expert's own failures spend its retries; the infrastructure's are waited out for retry.infra_wait_s and
then stop the campaign, spending none; --retry-failed gives a failed job its retries back."""

from __future__ import annotations

import errno
import os
import pickle

import pytest
from test_schedule import PER_UPDATE, beat, by, scheduler, started

from soma_cluster.errors import ChecksumError, SomaError, StorageUnreachable
from soma_cluster.events import RETRY_FAILED, emit, history
from soma_cluster.failures import actor_death_cause, exception_cause, select_failed, stop_line
from soma_cluster.jobs import INFRA, Cause, Job, LossKind
from soma_cluster.ledger import Ledger
from soma_cluster.messages import ChunkReport
from soma_cluster.schedule import Chunk, Lost, Stop
from soma_cluster.storage import retrying
from soma_cluster.trainer import NonFiniteLoss


def oserror(code: int, path: str = "/c/experts/expert-0000/.tmp-x") -> OSError:
    return OSError(code, os.strerror(code), path)


# -- classification ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "exc,cause",
    [
        (oserror(errno.ENOSPC), Cause.DISK_FULL),
        (oserror(errno.EDQUOT), Cause.DISK_FULL),
        (oserror(errno.EROFS), Cause.READ_ONLY),
        (PermissionError(errno.EACCES, "Permission denied", "/c/ledger"), Cause.PERMISSION),
        (oserror(errno.EPERM), Cause.PERMISSION),
        (
            StorageUnreachable("storage s3://b/c: write x failed after 4 tries in 15.0 s (ConnectionError); ..."),
            Cause.STORAGE_UNREACHABLE,
        ),
        (OSError("IOError: No space left on device"), Cause.DISK_FULL),  # pyarrow's: text only, no errno
        (RuntimeError("write failed: [Errno 30] Read-only file system"), Cause.READ_ONLY),
        (ChecksumError("shard x fails its checksum"), Cause.BAD_INPUT),
        (SomaError("checkpoint y is missing"), Cause.BAD_INPUT),
        (NonFiniteLoss("loss is nan", [0]), Cause.NON_FINITE),
        (RuntimeError("boom"), Cause.EXCEPTION),
        (
            FileNotFoundError(errno.ENOENT, "No such file", "/c/x"),
            Cause.EXCEPTION,
        ),  # a vanished file: not a condition to wait out
        (MemoryError(), Cause.EXCEPTION),  # the expert's own allocation
        (oserror(errno.EIO), Cause.EXCEPTION),
    ],
)
def test_exceptions_are_classified_by_errno_type_and_text(exc, cause):
    assert exception_cause(exc) == cause
    assert exception_cause(pickle.loads(pickle.dumps(exc))) == cause  # as it crosses Ray (pickled)
    assert cause.infra == (cause in INFRA)


def test_a_wrapped_errno_is_found_along_the_chain():
    try:
        try:
            raise oserror(errno.ENOSPC)
        except OSError as inner:
            raise RuntimeError("checkpoint failed") from inner
    except RuntimeError as outer:
        assert exception_cause(outer) == Cause.DISK_FULL
    try:
        try:
            raise oserror(errno.EROFS)
        except OSError:
            raise ValueError("during handling")  # noqa: B904 (the implicit context is what this tests)
    except ValueError as outer:
        assert exception_cause(outer) == Cause.READ_ONLY


def test_storage_retrying_raises_storage_unreachable_a_soma_error():
    def refuse():
        raise ConnectionRefusedError(errno.ECONNREFUSED, "refused")

    with pytest.raises(StorageUnreachable) as info:
        retrying(refuse, "storage s3://b/c: read x", 0.3, 0.1, "check the endpoint", max_tries=2)
    assert isinstance(info.value, SomaError) and exception_cause(info.value) == Cause.STORAGE_UNREACHABLE


def test_actor_death_node_died_is_infrastructure_a_killed_process_is_not():
    node = (
        "The actor died unexpectedly before finishing this task.\n\tclass_name: ExpertWorker\n"
        "The actor died because its node has died. Node Id: 3f2a..."
    )
    killed = (
        "The actor died unexpectedly before finishing this task.\n\tclass_name: ExpertWorker\n\tpid: 4242\n"
        "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR"
    )
    assert actor_death_cause(node) == Cause.NODE_LOST
    assert actor_death_cause(killed) == Cause.CRASH and not Cause.CRASH.infra
    assert actor_death_cause("The actor is dead because it was killed by `ray.kill`.") == Cause.CRASH


def test_stop_line_names_the_condition_and_the_fix():
    line = stop_line(Cause.DISK_FULL, "[Errno 28] No space left on device", "expert-0001", 12.4, 10, "/runs/c")
    assert "disk full" in line and "retry.infra_wait_s=10" in line and "free space" in line
    assert line.endswith("then run soma resume /runs/c") and "\n" not in line


def test_select_failed_all_or_named():
    states = {"expert-0000": "finished", "expert-0001": "failed_permanently", "expert-0002": "failed_permanently"}
    names = ["expert-0000", "expert-0001", "expert-0002", "expert-0003"]
    assert select_failed(states, names) == ["expert-0001", "expert-0002"]
    assert select_failed(states, names, ["2", "expert-0001", "0002", "expert-1"]) == ["expert-0002", "expert-0001"]
    with pytest.raises(SomaError, match="expert-0000 is finished, not failed_permanently"):
        select_failed(states, names, ["0"])
    with pytest.raises(SomaError, match="expert-0003 is pending"):
        select_failed(states, names, ["expert-0003"])
    for bad in ("7", "expert-7", "", "-1", "expert-0004", "1.0", "expert-", "e1"):
        with pytest.raises(SomaError, match="names no expert of this campaign .expert-0000 to expert-0003."):
            select_failed(states, names, [bad])
    with pytest.raises(SomaError, match="soma seed CAMPAIGN --retry-failed"):
        select_failed(states, names, ["seed"])


# -- the scheduler's decisions ----------------------------------------------------------------------------
def disk_full(job="expert-0000") -> Lost:
    return Lost(
        Cause.DISK_FULL,
        f"exception: OSError: [Errno 28] No space left on device: '/c/experts/{job}/.tmp-x'",
        Cause.DISK_FULL,
    )


def run_one(s, clock, gpu_s=1.0):
    """Start the job that is due (sleeping the fake clock to its retry), report its setup; the unit."""
    if not s.pending and s.retries.at:
        clock[0] = max(clock[0], min(s.retries.at.values()))
    (start,) = s.requests(1)
    s.on_setup(start.unit.id, started([0], gpu_s=gpu_s))
    return start.unit


def test_infrastructure_failures_spend_no_retry_and_stop_the_campaign_after_the_bound(tmp_path):
    clock = [0.0]
    s = scheduler(
        tmp_path,
        clock,
        n_experts=1,
        retry={"max_retries": 1, "backoff_s": 1.0, "backoff_max_s": 4.0, "infra_wait_s": 20.0},
    )
    s.restore({})
    tries = []
    for _ in range(50):  # bounded: ~7 tries fit in 20 s
        unit = run_one(s, clock)
        clock[0] += 0.5
        s.on_lost(unit.id, disk_full())
        tries.append(clock[0])
        if s.stopped:
            break
    assert s.stopped is not None and s.stopped.cause == Cause.DISK_FULL and s.stopped.job == "expert-0000"
    assert len(tries) >= 5 and Job(0) not in s.outcome  # max_retries 1: an expert failure would have ended it
    assert 20.0 <= s.stopped.waited_s <= 20.0 + 0.5 + 1e-9  # the bound plus one try, never later
    assert s.retries.failures.get(Job(0), 0) == 0 and history(s.store)["expert-0000"].failures == 0
    delays = [e["delay_s"] for e in s.store.read_log("events.jsonl") if e["event"] == "retry_scheduled"]
    assert all(
        e["counted"] is False and e["cause"] == "disk_full"
        for e in s.store.read_log("events.jsonl")
        if e["event"] in ("retry_scheduled", "failed")
    )
    assert delays[2] > delays[0] and max(delays) <= 4.0  # backed off, capped at backoff_max_s
    assert s.requests(4) == [] and s.finished  # stopped: nothing more is started
    wasted = Ledger(s.store).totals().gpu_seconds["wasted"]
    # every retry's start-up (the first start is the job's own cost) and every try's unreported 0.5 s
    assert wasted == pytest.approx((len(tries) - 1) * 1.0 + len(tries) * 0.5)
    line = s.stopped.line(s.cfg.retry.infra_wait_s, s.store.url)
    assert "disk full" in line and "soma resume" in line


def test_a_checkpoint_clears_the_condition_and_expert_failures_still_count(tmp_path):
    clock = [0.0]
    s = scheduler(tmp_path, clock, n_experts=1, retry={"max_retries": 1, "backoff_s": 1.0, "infra_wait_s": 5.0})
    s.restore({})
    unit = run_one(s, clock)
    clock[0] += 4.0
    s.on_lost(unit.id, disk_full())  # streak starts at t = 4
    unit = run_one(s, clock)
    acts = s.on_chunk(
        unit.id, ChunkReport({0: beat(6, 3.0, 6 * PER_UPDATE, checkpoint="step-000006", ckpt_step=6)}, 3.0)
    )
    assert by(acts, Chunk) and Job(0) not in s.retries.infra_since  # space came back: a checkpoint was written
    clock[0] += 30.0
    s.on_lost(unit.id, disk_full())  # a new streak, not 30 s old
    assert s.stopped is None and Job(0) in s.retries.at
    unit = run_one(s, clock)
    s.on_lost(unit.id, Lost("exception", "RuntimeError: boom", Cause.EXCEPTION))
    assert s.retries.failures[Job(0)] == 1 and s.stopped is None  # the expert's own: counted
    unit = run_one(s, clock)
    s.on_lost(unit.id, Lost("actor_died", "ActorDiedError: worker died", Cause.CRASH))
    assert s.outcome == {Job(0): "failed_permanently"}  # max_retries 1: the second one ends it
    failed = [e for e in s.store.read_log("events.jsonl") if e["event"] == "failed"]
    assert [e.get("counted", True) for e in failed] == [False, False, True, True]
    assert history(s.store)["expert-0000"].failures == 2


def test_zero_wait_stops_at_the_first_and_the_stop_settles_every_open_attempt(tmp_path):
    clock = [0.0]
    s = scheduler(tmp_path, clock, n_experts=3, retry={"infra_wait_s": 0.0})
    s.restore({})
    a, b, c = s.requests(3)
    for unit, e in ((a, 0), (b, 1)):
        s.on_setup(unit.unit.id, started([e]))
    clock[0] = 2.0
    s.on_lost(a.unit.id, disk_full())
    assert s.stopped is not None and s.stopped.waited_s == 0.0
    acts = s.requests(3)
    assert sorted(x.unit.id for x in by(acts, Stop)) == sorted([b.unit.id, c.unit.id]) and s.finished
    ev = s.store.read_log("events.jsonl")
    assert [e["job"] for e in ev if e["event"] == "preempted"] == ["expert-0001", "expert-0002"]
    assert not s.outcome  # nothing ended: `soma resume` goes on
    again = scheduler(tmp_path, [0.0], n_experts=3)
    again.restore(history(again.store))
    assert sorted(j.expert for j in again.pending) == [0, 1, 2] and not again.retries.failures.get(Job(0))
    assert again.cause[Job(1)] == "preempted" and again.cause[Job(0)] == "retry"
    t = Ledger(s.store).totals()
    assert t.gpu_seconds["preempted"] == pytest.approx(2.0) and t.gpu_seconds["wasted"] == pytest.approx(2.0)


def test_reopened_for_retry_failed_gives_the_retries_back_and_keeps_the_end(tmp_path):
    clock = [0.0]
    s = scheduler(tmp_path, clock, n_experts=1, retry={"max_retries": 0})
    s.restore({})
    unit = run_one(s, clock)
    s.on_lost(unit.id, Lost("exception", "RuntimeError: boom", Cause.EXCEPTION))
    h = history(s.store)["expert-0000"]
    assert h.state == "failed_permanently" and h.failures == 1
    emit(s.store, "reopened", "expert-0000", reason=RETRY_FAILED, was="failed_permanently", step=0, checkpoint=None)
    h = history(s.store)["expert-0000"]
    assert h.last_event == "reopened" and not h.terminal and h.failures == 0 and h.ended(0) == "failed_permanently"
    again = scheduler(tmp_path, clock, n_experts=1, retry={"max_retries": 0})
    again.restore(history(again.store))
    assert list(again.pending) == [Job(0)] and again.next_attempt[Job(0)] == 1 and again.cause[Job(0)] == "retry"
    assert not again.retries.failures.get(Job(0))


def test_reopen_failed_writes_one_event_per_job_and_nothing_on_a_refusal(tmp_path):
    from pipelines.reopen import reopen_failed
    from soma_cluster.jobs import SEED_JOB
    from soma_cluster.storage import Store

    store = Store(str(tmp_path / "c"))
    for job, end in (
        ("seed", "failed_permanently"),
        ("expert-0000", "finished"),
        ("expert-0001", "failed_permanently"),
    ):
        emit(store, "queued", job, attempt=0)
        emit(store, "failed", job, attempt=0, reason="exception: RuntimeError: boom")
        emit(store, end, job, attempt=0)
    jobs = [Job(0), Job(1)]
    before = len(store.read_log("events.jsonl"))
    with pytest.raises(SomaError, match="expert-0000 is finished"):
        reopen_failed(store, jobs, ["1", "0"])
    assert len(store.read_log("events.jsonl")) == before  # refused before anything was written
    assert reopen_failed(store, jobs, []) == ["expert-0001"]
    assert reopen_failed(store, [SEED_JOB], []) == ["seed"]
    h = history(store)
    assert (h["seed"].last_event, h["seed"].failures) == ("reopened", 0) and h["expert-0000"].state == "finished"
    assert (h["expert-0001"].last_event, h["expert-0001"].failures) == ("reopened", 0)
    assert reopen_failed(store, jobs, []) == []  # nothing failed any more


def test_ray_errors_map_to_losses_without_a_running_ray():
    """The driver's Ray shell: what each of Ray's errors becomes (built here as Ray builds them, no cluster needed)."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError, NodeDiedError, OutOfMemoryError, RayTaskError

    from pipelines.campaign import lost_actor, lost_task

    def task_error(cause):
        return RayTaskError("ExpertWorker.run_chunk", "Traceback (most recent call last):\n  ...", cause)

    for cause, kind, why in (
        (oserror(errno.ENOSPC), LossKind.INFRA, Cause.DISK_FULL),
        (
            StorageUnreachable("storage s3://b/c: write x failed after 3 tries"),
            LossKind.INFRA,
            Cause.STORAGE_UNREACHABLE,
        ),
        (ChecksumError("shard file x fails its checksum"), LossKind.BAD_INPUT, Cause.BAD_INPUT),
        (RuntimeError("boom"), LossKind.FAILURE, Cause.EXCEPTION),
        (NonFiniteLoss("loss is nan"), LossKind.FAILURE, Cause.NON_FINITE),
    ):
        lost = lost_task(task_error(cause))
        assert (lost.kind, lost.cause) == (kind, why), cause
        assert lost.reason.startswith(f"{why}: exception: " if kind == LossKind.INFRA else "exception: "), lost.reason
    for exc, kind, why in (
        (
            OutOfMemoryError("Task was killed due to the node running low on memory."),
            LossKind.INFRA,
            Cause.OUT_OF_MEMORY,
        ),
        (NodeDiedError("node 3f2a died"), LossKind.INFRA, Cause.NODE_LOST),
        (ActorUnavailableError("connection lost", None), LossKind.INFRA, Cause.NODE_LOST),
        (ActorDiedError(), LossKind.FAILURE, Cause.CRASH),
    ):
        lost = lost_actor(exc)
        assert (lost.kind, lost.cause) == (kind, why), exc
    assert lost_actor(ActorDiedError()).reason.startswith("actor_died")  # the expert's crash reads as it always did


def test_a_packed_actor_lost_to_the_infrastructure_spends_no_retry_of_either_expert(tmp_path):
    clock = [0.0]
    s = scheduler(
        tmp_path, clock, n_experts=2, resources={"experts_per_actor": 2}, retry={"max_retries": 0, "infra_wait_s": 30.0}
    )
    s.restore({})
    (start,) = s.requests(1)
    s.on_setup(start.unit.id, started([0, 1]))
    clock[0] = 1.0
    s.on_lost(start.unit.id, Lost(Cause.NODE_LOST, "ActorDiedError: its node has died", Cause.NODE_LOST))
    assert sorted(j.expert for j in s.retries.at) == [0, 1] and not s.outcome and not s.retries.failures
    clock[0] = max(s.retries.at.values())
    (again,) = s.requests(1)
    assert sorted(j.expert for j in again.unit.jobs) == [0, 1]  # retried together, as a pack again
    failed = [e for e in s.store.read_log("events.jsonl") if e["event"] == "failed"]
    assert [(e["job"], e["cause"], e["counted"]) for e in failed] == [
        ("expert-0000", "node_lost", False),
        ("expert-0001", "node_lost", False),
    ]


def test_a_storage_error_from_a_check_is_classified_by_its_condition():
    """diskerrors.StorageError (a SomaError, so bad input by type) names a disk condition: full, read-only and denied
    are the infrastructure's, a file where a directory must be is not."""
    from soma_cluster.diskerrors import DiskCondition, StorageError
    from soma_cluster.failures import exception_cause
    from soma_cluster.jobs import Cause

    assert exception_cause(StorageError("/c", DiskCondition.FULL)) is Cause.DISK_FULL
    assert exception_cause(StorageError("/c", DiskCondition.READ_ONLY)) is Cause.READ_ONLY
    assert exception_cause(StorageError("/c", DiskCondition.DENIED)) is Cause.PERMISSION
    assert exception_cause(StorageError("/c", DiskCondition.NOT_A_DIRECTORY)) is Cause.BAD_INPUT
