"""The driver lease without Ray: who may take a campaign, compare-and-swap on a filesystem and on a real S3 server
process (moto), expiry and take-over, the fence on every write, and a dead holder replaced at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from dataclasses import replace

import pytest
from support.s3server import s3  # noqa: F401

from soma_cluster.errors import SomaError
from soma_cluster.lease import (
    LEASE,
    Holder,
    Lease,
    LeaseHeld,
    LeaseLost,
    LeaseRecord,
    Verdict,
    WorkerFence,
    judge,
    lease_ttl_s,
    process_alive,
)
from soma_cluster.storage import Store, VersionConflict

HERE = Holder("host-a", 100, 1000.0, "boot-1", "soma launch")


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def advancing(*clocks: Clock):
    """A sleep that moves the given clocks on (a candidate watching a lease)."""

    def sleep(s: float) -> None:
        for c in clocks:
            c.t += s

    return sleep


def record(holder=HERE, renewed_at=1000.0, ttl_s=30.0, released=False) -> LeaseRecord:
    return LeaseRecord(1, "tok", holder, renewed_at, renewed_at, ttl_s, released)


def test_judge_every_verdict():
    def alive(pid, started):
        return pid == 100

    assert judge(None, 1000.0, HERE, alive) is Verdict.FREE
    assert judge(record(released=True), 1000.0, HERE, alive) is Verdict.RELEASED
    assert judge(record(), 1010.0, HERE, alive) is Verdict.HELD
    # a reading never frees a lease by its date: lapsed, or dated in this host's future, it is watched (Sighting)
    assert judge(record(), 1031.0, HERE, alive) is Verdict.SUSPECT
    assert judge(record(), 1000.0 - 3600, HERE, alive) is Verdict.SUSPECT
    assert judge(record(), 1000.0 - 4, HERE, alive) is Verdict.HELD  # a few seconds of skew is ordinary
    dead = replace(HERE, pid=200)
    assert judge(record(dead), 1001.0, HERE, alive) is Verdict.DEAD
    # another host, or this host in an earlier boot: its pids say nothing here, only expiry frees it
    assert judge(record(replace(dead, host="host-b")), 1001.0, HERE, alive) is Verdict.HELD
    assert judge(record(replace(dead, boot_id="boot-0")), 1001.0, HERE, alive) is Verdict.HELD


def test_process_alive_tells_a_reused_pid_from_the_holder():
    me = Holder.here("x")
    assert process_alive(me.pid, me.started)
    assert not process_alive(me.pid, me.started - 100.0)
    assert not process_alive(2**22 + 7, 0.0)


@pytest.mark.parametrize("raw", ["", "abc", "nan", "-1", "2", "1e9"])
def test_lease_ttl_rejects_bad_values(raw):
    assert lease_ttl_s({}) == 30.0  # unset: the default; set but empty means nothing, and is refused
    with pytest.raises(SomaError, match="SOMA_LEASE_TTL_S"):
        lease_ttl_s({"SOMA_LEASE_TTL_S": raw})


def test_write_if_is_compare_and_swap_on_a_filesystem(tmp_path):
    store = Store(str(tmp_path / "c"))
    v1 = store.write_if("x.json", b"1", None)
    with pytest.raises(VersionConflict):
        store.write_if("x.json", b"2", None)  # create-only: it exists
    v2 = store.write_if("x.json", b"2", v1)
    with pytest.raises(VersionConflict):
        store.write_if("x.json", b"3", v1)  # stale version
    assert store.read_versioned("x.json") == (b"2", v2)


def test_write_if_has_one_winner_among_racing_threads(tmp_path):
    store = Store(str(tmp_path / "c"))
    v0 = store.write_if("x.json", b"0", None)
    wins = []

    def race(i: int) -> None:
        try:
            store.write_if("x.json", str(i).encode(), v0)
            wins.append(i)
        except VersionConflict:
            pass

    threads = [threading.Thread(target=race, args=(i,)) for i in range(1, 9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(wins) == 1 and store.read_versioned("x.json")[0] == str(wins[0]).encode()


def test_second_driver_refused_then_takes_over_after_expiry_and_fences_the_first(tmp_path):
    store_a, store_b = Store(str(tmp_path / "c")), Store(str(tmp_path / "c"))
    mono_a, wall = Clock(0.0), Clock(1000.0)
    a = Lease(store_a, "soma launch", ttl_s=30.0, clock=mono_a, wall=wall)
    a.acquire()
    store_a.fence = a.check
    store_a.write_bytes("a.txt", b"1")
    mono_b = Clock(0.0)
    b = Lease(store_b, "soma resume", ttl_s=30.0, clock=mono_b, wall=wall, sleep=advancing(mono_b, wall))
    with pytest.raises(LeaseHeld, match=f"pid {os.getpid()} on .*--take-over"):
        b.acquire()
    wall.t += 25.0
    mono_a.t += 25.0  # a renews (past ttl - margin = 20 s, its fence renews first)
    store_a.write_bytes("a.txt", b"2")
    assert a.record.renewed_at == 1025.0
    wall.t += 31.0  # a is paused: no renewal for longer than the ttl; b watches it unchanged for a ttl, then takes it
    assert b.acquire().generation == 2
    mono_a.t += 31.0  # a wakes up: its fence renews, finds generation 2, and writes nothing
    with pytest.raises(LeaseLost, match=r"lost .*\(generation 2\)"):
        store_a.write_bytes("a.txt", b"3")
    with pytest.raises(LeaseLost):
        store_a.append("events.jsonl", {"event": "x"})
    assert (tmp_path / "c" / "a.txt").read_bytes() == b"2" and not (tmp_path / "c" / "events.jsonl").exists()
    a.release()  # a lost lease is left to its new holder
    assert LeaseRecord.from_bytes(store_b.read_versioned(LEASE)[0], "").generation == 2
    b.release()
    rec = LeaseRecord.from_bytes(store_b.read_versioned(LEASE)[0], "")
    assert rec.released and rec.generation == 2
    c = Lease(Store(str(tmp_path / "c")), "soma launch", ttl_s=30.0)
    assert c.acquire().generation == 3  # a released lease is taken at once


def test_worker_fence_stops_writes_of_an_older_generation(tmp_path):
    store = Store(str(tmp_path / "c"))
    first = Lease(store, "soma launch", ttl_s=30.0)
    first.acquire()
    worker = Store(str(tmp_path / "c"))
    worker.fence = WorkerFence(worker, first.generation)
    worker.write_bytes("ok.json", b"{}")
    first.release()
    Lease(Store(str(tmp_path / "c")), "soma resume", ttl_s=30.0).acquire()
    worker.fence = WorkerFence(worker, first.generation)
    with pytest.raises(LeaseLost, match=r"generation 1\).*now 2"):
        worker.write_bytes("late.json", b"{}")
    assert not (tmp_path / "c" / "late.json").exists()


def test_a_killed_holder_on_this_host_is_replaced_at_once(tmp_path):
    code = (
        "import sys, time; from soma_cluster.storage import Store; from soma_cluster.lease import Lease;"
        "Lease(Store(sys.argv[1]), 'soma launch', ttl_s=3600.0).acquire(); print('held', flush=True); time.sleep(600)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "c")], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(LeaseHeld, match=f"pid {proc.pid}"):
            Lease(Store(str(tmp_path / "c")), "soma resume").acquire()
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert Lease(Store(str(tmp_path / "c")), "soma resume").acquire().generation == 2
    finally:
        proc.kill()
        proc.wait(10)


def test_corrupt_lease_is_one_clear_error(tmp_path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / LEASE).write_bytes(b"{not json")
    with pytest.raises(SomaError, match="not a soma driver lease .* delete it"):
        Lease(Store(str(tmp_path / "c")), "soma launch").acquire()


def test_lease_on_a_real_s3_server(s3):  # noqa: F811
    url = s3.url("lease-campaign")
    store_a, store_b = Store(url, s3.storage_options()), Store(url, s3.storage_options())
    # conditional PUTs as the server enforces them
    v1 = store_a.write_if("x.json", b"1", None)
    with pytest.raises(VersionConflict):
        store_b.write_if("x.json", b"2", None)
    v2 = store_b.write_if("x.json", b"2", v1)
    with pytest.raises(VersionConflict):
        store_a.write_if("x.json", b"3", v1)
    assert store_a.read_versioned("x.json") == (b"2", v2)
    # the lease itself: refused while held, taken after expiry, the first driver fenced
    mono_a, wall = Clock(0.0), Clock(1000.0)
    a = Lease(store_a, "soma launch", ttl_s=30.0, clock=mono_a, wall=wall)
    a.acquire()
    store_a.fence = a.check
    mono_b = Clock(0.0)
    b = Lease(store_b, "soma launch", ttl_s=30.0, clock=mono_b, wall=wall, sleep=advancing(mono_b, wall))
    with pytest.raises(LeaseHeld):
        b.acquire()
    wall.t += 40.0
    assert b.acquire().generation == 2
    mono_a.t += 40.0
    with pytest.raises(LeaseLost):
        store_a.append("events.jsonl", {"event": "late"})
    assert store_b.walk("events.jsonl.d") == []


def test_a_refused_command_leaves_no_directory_behind(tmp_path):
    from pipelines.campaign_lease import hold

    store = Store(str(tmp_path / "new"))
    with pytest.raises(SomaError), hold(store, "soma prepare"):
        raise SomaError("refused")
    assert not (tmp_path / "new").exists()
    (tmp_path / "old").mkdir()
    with hold(Store(str(tmp_path / "old")), "soma prepare"):
        pass
    assert not list((tmp_path / "old").iterdir())  # it was empty and nothing was made in it


def test_a_lease_is_never_put_among_foreign_files(tmp_path):
    from pipelines.campaign_lease import hold

    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "thesis.txt").write_text("mine")
    with (
        pytest.raises(SomaError, match="not empty and holds no campaign.yaml"),
        hold(Store(str(tmp_path / "docs")), "soma prepare"),
    ):
        pass
    assert [p.name for p in (tmp_path / "docs").iterdir()] == ["thesis.txt"]


def test_a_new_driver_sweeps_scratch_left_by_a_killed_command_of_this_host(tmp_path):
    import socket

    from pipelines.campaign_lease import hold

    camp = tmp_path / "c"
    camp.mkdir()
    (camp / "campaign.yaml").write_text("x")
    host = socket.gethostname()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(30)
    stale = camp / f".soma-scratch-{host}-{dead.pid}-abc123"
    live = camp / f".soma-scratch-{host}-{os.getpid()}-def456"
    other_host = camp / f".soma-scratch-elsewhere-{dead.pid}-ghi789"
    for d in (stale, live, other_host):
        d.mkdir()
        (d / "part.arrow").write_bytes(b"x")
    with hold(Store(str(camp)), "soma prepare"):
        pass
    assert not stale.exists() and live.exists() and other_host.exists()
    store = Store(str(camp))
    with store.scratch() as scratch:
        assert os.path.basename(scratch).startswith(f".soma-scratch-{host}-{os.getpid()}-")


def test_a_refused_command_leaves_an_empty_directory_empty_and_an_s3_prefix_bare(tmp_path, s3):  # noqa: F811
    from pipelines.campaign_lease import hold

    (tmp_path / "empty").mkdir()
    with pytest.raises(SomaError), hold(Store(str(tmp_path / "empty")), "soma prepare"):
        raise SomaError("refused")
    assert (tmp_path / "empty").is_dir() and not list((tmp_path / "empty").iterdir())
    with pytest.raises(SomaError), hold(Store(s3.url("bare"), s3.storage_options()), "soma prepare"):
        raise SomaError("refused")
    assert not s3.objects("bare")


def test_take_over_waits_for_a_silent_holder_and_never_displaces_a_renewing_one(tmp_path, capsys):
    mono, wall = Clock(0.0), Clock(1000.0)
    holder = Lease(Store(str(tmp_path / "c")), "soma launch", ttl_s=30.0, clock=mono, wall=wall)
    holder.acquire()

    def passes(renew: bool):
        def sleep(s: float) -> None:
            mono.t += s
            wall.t += s
            if renew:
                holder.renew()

        return sleep

    alive = Lease(Store(str(tmp_path / "c")), "soma resume", ttl_s=5.0, clock=mono, wall=wall, sleep=passes(True))
    with pytest.raises(LeaseHeld, match="renewed its lease within the 35 s this command watched"):
        alive.acquire(take_over=True)
    assert "watching its lease up to 35 s" in capsys.readouterr().err
    t0 = wall.t
    silent = Lease(Store(str(tmp_path / "c")), "soma resume", ttl_s=5.0, clock=mono, wall=wall, sleep=passes(False))
    assert silent.acquire(take_over=True).generation == 2  # the holder's own ttl (30 s), not the taker's
    assert 30.0 < wall.t - t0 <= 31.0


OTHER = Holder("host-b", 4242, 500.0, "boot-b", "soma launch")


def foreign_lease(camp, renewed_at: float) -> Store:
    """A lease written by a driver on host-b whose wall clock said `renewed_at`."""
    store = Store(str(camp))
    store.write_if(LEASE, LeaseRecord(7, "tok", OTHER, renewed_at, renewed_at, 30.0).to_bytes(), None)
    return store


@pytest.mark.parametrize("skew_s", [3600.0, -3600.0, -40.0], ids=["ahead", "behind", "just-lapsed"])
@pytest.mark.parametrize("take_over", [False, True])
def test_a_dead_foreign_holder_is_replaced_after_a_ttl_whatever_its_clock(tmp_path, capsys, skew_s, take_over):
    """Its host's clock an hour ahead (the lease is dated in the future) or behind: neither blocks the campaign."""
    mono, wall = Clock(0.0), Clock(10_000.0)
    store = foreign_lease(tmp_path / "c", wall.t + skew_s)
    taker = Lease(store, "soma resume", ttl_s=30.0, clock=mono, wall=wall, sleep=advancing(mono, wall))
    assert taker.acquire(take_over=take_over).generation == 8
    assert 30.0 < mono.t <= 31.0  # watched for the holder's ttl on this host's monotonic clock, no longer
    err = capsys.readouterr().err
    assert "watching its lease up to 35 s" in err and "unchanged for 30 s by this host's clock" in err
    assert ("in this host's future" in err) == (skew_s > 0)


@pytest.mark.parametrize("skew_s", [3600.0, -3600.0], ids=["ahead", "behind"])
@pytest.mark.parametrize("take_over", [False, True])
def test_a_renewing_foreign_holder_is_never_displaced_whatever_its_clock(tmp_path, skew_s, take_over):
    """Its clock an hour off either way: the old rule (renewed_at older than a ttl by this host's clock) let a second
    driver take a live one's campaign at once when its clock was behind."""
    mono, wall = Clock(0.0), Clock(10_000.0)
    holder_wall = Clock(wall.t + skew_s)
    holder = Lease(Store(str(tmp_path / "c")), "soma launch", ttl_s=30.0, clock=Clock(0.0), wall=holder_wall)
    holder.acquire()

    def sleep(s: float) -> None:
        mono.t += s
        wall.t += s
        holder_wall.t += s
        holder.renew()

    taker = Lease(Store(str(tmp_path / "c")), "soma resume", ttl_s=30.0, clock=mono, wall=wall, sleep=sleep)
    with pytest.raises(LeaseHeld, match="renewed its lease within the 35 s this command watched"):
        taker.acquire(take_over=take_over)
    assert LeaseRecord.from_bytes(Store(str(tmp_path / "c")).read_versioned(LEASE)[0], "").generation == 1


@pytest.mark.parametrize("jump_s", [3600.0, -3600.0], ids=["forward", "back"])
def test_wall_clocks_that_jump_during_a_run_neither_free_nor_block_the_lease(tmp_path, jump_s):
    """The holder's wall clock jumps mid-run (its renewals now dated an hour off): a candidate still sees it renew.
    The candidate's own wall clock jumps while it watches a silent holder: it still waits exactly a ttl."""
    mono, wall, holder_wall = Clock(0.0), Clock(10_000.0), Clock(10_000.0)
    holder = Lease(Store(str(tmp_path / "c")), "soma launch", ttl_s=30.0, clock=Clock(0.0), wall=holder_wall)
    holder.acquire()
    holder_wall.t += jump_s
    holder.renew()

    def renewing(s: float) -> None:
        mono.t += s
        wall.t += s
        holder_wall.t += s
        holder.renew()

    taker = Lease(Store(str(tmp_path / "c")), "soma resume", ttl_s=30.0, clock=mono, wall=wall, sleep=renewing)
    with pytest.raises(LeaseHeld):
        taker.acquire()
    jumped = [False]

    def silent(s: float) -> None:
        mono.t += s
        wall.t += s
        if not jumped[0]:
            wall.t += jump_s  # this host's wall clock jumps once, mid-watch
            jumped[0] = True

    start = mono.t
    taker = Lease(Store(str(tmp_path / "c")), "soma resume", ttl_s=30.0, clock=mono, wall=wall, sleep=silent)
    assert taker.acquire(take_over=True).generation == 2
    assert 30.0 < mono.t - start <= 31.0


def test_cli_takes_a_campaign_whose_dead_holder_dated_its_lease_an_hour_ahead(tmp_path, text_corpus, micro_yaml):
    """The issue's case through the real CLI: a driver on another host, its clock an hour ahead, died holding the
    campaign. The old rule refused `soma ... ` and `--take-over` alike until that hour passed."""
    import time

    from conftest import soma

    camp = tmp_path / "c"
    args = ("prepare", str(camp), "--config", micro_yaml, "--corpus", str(text_corpus))
    assert soma(*args).returncode == 0
    (camp / LEASE).write_bytes(LeaseRecord(3, "tok", OTHER, time.time(), time.time() + 3600, 3.0).to_bytes())
    t0 = time.monotonic()
    proc = soma(*args)
    took_s = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "in this host's future" in proc.stderr and "took over" in proc.stderr, proc.stderr
    assert LeaseRecord.from_bytes((camp / LEASE).read_bytes(), "").generation == 4
    print(f"\ntaken over in {took_s:.1f} s (lease ttl 3 s)")
