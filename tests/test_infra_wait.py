"""Infrastructure failures on a real disk and a real local Ray, through the CLI: a campaign whose tmpfs mount
fills mid-launch spends no expert's retries, stops with exit 4 after retry.infra_wait_s, and `soma resume`
finishes it once space is freed; an expert that failed permanently for its own reason (a corrupt shard) is
reopened by `soma resume --retry-failed` once the shard is restored. Both end bitwise identical to a
fault-free run, with an exact ledger. Mounting needs root: skipped with the reason where it is refused."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path

import pytest
import torch
from conftest import assert_one_line_error, soma
from support.inprocess import InProcess
from test_chaos import config, events, wait_for

from pipelines.prepare import prepare
from soma_cluster.checkpoint import load_checkpoint
from soma_cluster.config import to_yaml_text
from soma_cluster.events import history
from soma_cluster.failures import waiting
from soma_cluster.jobs import SEED_JOB, expert_jobs
from soma_cluster.ledger import Ledger
from soma_cluster.storage import Store

PER_UPDATE = 2 * 4  # forwards per update: 2 signs x n_pert 4 (test_chaos.CHAOS)


def infra_config(text_corpus, **retry):
    # checkpoints every 12 of 96 updates (~0.4 MB each): the campaign fits a 24 MB tmpfs
    return config(
        corpus={"source": str(text_corpus)},
        train={"checkpoint_every": 12},
        retry={"max_retries": 1, "backoff_s": 0.2, "backoff_max_s": 1.0, **retry},
    )


@pytest.fixture(scope="module")
def seeded(tmp_path_factory, text_corpus):
    """A prepared campaign with its seed, and the same campaign's experts trained without a fault (no Ray)."""
    root = tmp_path_factory.mktemp("infra") / "c"
    cfg = infra_config(text_corpus)
    store = Store(str(root))
    prepare(store, cfg)
    assert InProcess(store, cfg, [SEED_JOB]).run() == {SEED_JOB: "finished"}
    ref = tmp_path_factory.mktemp("infra-ref") / "c"
    shutil.copytree(root, ref)
    assert set(InProcess(Store(str(ref)), cfg, expert_jobs(cfg.n_experts)).run().values()) == {"finished"}
    return root, Store(str(ref))


def clone(seeded, dest: Path, cfg) -> Store:
    shutil.copytree(seeded[0], dest)
    (dest / "campaign.yaml").write_text(to_yaml_text(cfg))
    return Store(str(dest))


def mount_tmpfs(where: Path, size: str) -> None:
    where.mkdir(parents=True)
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True, text=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip() or r.returncode}): needs root")


def unmount(where: Path) -> None:
    if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)  # a process still inside: detach it


def fill(where: Path, leave: int) -> Path:
    """Fill the filesystem of `where` until about `leave` bytes are free (less than a checkpoint, more than a few
    log records). The running launch writes beside us, so the disk may fill first: then give `leave` back."""
    filler = where / "filler"
    with open(filler, "wb", buffering=0) as fh:
        todo = os.statvfs(where).f_bavail * os.statvfs(where).f_frsize - leave
        block = b"\0" * (1 << 20)
        try:
            while todo > 0:
                todo -= fh.write(block[: min(len(block), todo)])
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
        st = os.statvfs(where)
        short = leave - st.f_bavail * st.f_frsize
        if short > 0:
            fh.truncate(max(0, fh.tell() - short))
    return filler


def assert_bitwise(store: Store, ref: Store, n: int) -> None:
    for e in range(n):
        a, b = (load_checkpoint(s, f"experts/expert-{e:04d}").tensors for s in (store, ref))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), e


def assert_exact_training(store: Store, cfg) -> None:
    """Every expert's training forwards are a fault-free run's; what lost attempts did is `wasted`, nowhere else."""
    records = Ledger(store).records()
    for e in range(cfg.n_experts):
        mine = [r for r in records if r["expert"] == e]
        assert (
            sum(r["forwards"] for r in mine if r["category"] == "expert_training") == cfg.train.updates * PER_UPDATE
        ), e
        assert all(r["category"] in ("expert_training", "wasted", "preempted") for r in mine)


def test_log_appends_are_whole_and_wait_out_a_full_disk(tmp_path):
    """The driver's own writes: a record is appended whole or not at all, and a background batch waits for space."""
    mnt = tmp_path / "mnt"
    mount_tmpfs(mnt, "1m")
    try:
        store = Store(str(mnt / "c"))
        store.append("events.jsonl", {"event": "first"})
        filler = fill(mnt, 0)
        with pytest.raises(OSError) as info, store.batch():
            for i in range(200):  # > one page of records
                store.append("events.jsonl", {"event": "x" * 100, "i": i})
        assert info.value.errno == errno.ENOSPC
        assert [r["event"] for r in store.read_log("events.jsonl")] == ["first"]  # nothing half written
        threading.Timer(0.5, filler.unlink).start()  # space comes back in 0.5 s
        t0 = time.monotonic()
        with store.batch(background=True, retry=lambda write, what: waiting(write, 10.0, what)):
            for i in range(200):
                store.append("events.jsonl", {"event": "y" * 100, "i": i})
            store.flush(wait=False)
        assert 0.4 < time.monotonic() - t0 < 10.0
        assert len(store.read_log("events.jsonl")) == 201
    finally:
        unmount(mnt)


def test_full_disk_mid_launch_spends_no_retry_stops_with_4_and_resume_finishes(seeded, tmp_path, text_corpus):
    cfg = infra_config(text_corpus, infra_wait_s=6.0)
    mnt = tmp_path / "mnt"
    mount_tmpfs(mnt, "24m")
    try:
        store = clone(seeded, mnt / "c", cfg)
        proc = subprocess.Popen(
            [sys.executable, "-m", "pipelines.cli", "launch", store.url, "--no-progress", "--log-every", "2"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"},
        )
        try:
            for e in range(cfg.n_experts):
                wait_for(
                    partial(events, store, f"expert-{e:04d}", "checkpointed"), what=f"expert {e}'s first checkpoint"
                )
            filler = fill(mnt, 160 * 1024)  # under one checkpoint (~0.4 MB) free
            t_full = time.monotonic()
            _, err = proc.communicate(timeout=240)
            stopped_after = time.monotonic() - t_full
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 4, err[-3000:]
        lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
        assert len(lines) == 1 and "disk full" in lines[0] and "retry.infra_wait_s=6" in lines[0], err[-3000:]
        assert f"soma resume {store.url}" in lines[0] and "Traceback" not in err
        failed = events(store, kind="failed")
        assert failed and all(f["cause"] == "disk_full" and f["counted"] is False for f in failed), failed
        hist = history(store)
        assert all(
            h.failures == 0 and not h.terminal for n, h in hist.items() if n != "seed"
        )  # no retry spent, none ended
        tries = len(failed)
        print(
            f"\nfull disk: {tries} uncounted failed attempts (max_retries {cfg.retry.max_retries}); "
            f"stopped {stopped_after:.1f} s after the disk filled (infra_wait_s {cfg.retry.infra_wait_s:g}); {lines[0]}"
        )
        assert stopped_after < cfg.retry.infra_wait_s + 60  # the bound, one try, the driver's exit

        filler.unlink()  # space is back
        r = soma("resume", store.url, "--no-progress", timeout=240)
        assert r.returncode == 0, r.stderr[-3000:]
        assert {n: h.state for n, h in history(store).items() if n != "seed"} == {
            "expert-0000": "finished",
            "expert-0001": "finished",
        }
        assert_exact_training(store, cfg)
        assert Ledger(store).totals().gpu_seconds["wasted"] > 0
        assert_bitwise(store, seeded[1], cfg.n_experts)
    finally:
        unmount(mnt)


@pytest.mark.slow  # ~33 s; reopen_failed and its events: tests/test_failures.py; its refusals: test_refusals.py
def test_retry_failed_reopens_an_expert_that_failed_for_its_own_reason(seeded, tmp_path, text_corpus):
    cfg = infra_config(text_corpus)
    store = clone(seeded, tmp_path / "c", cfg)
    shard = tmp_path / "c" / "shards" / "expert-0001"
    train = sorted(shard.glob("train-*.arrow"))[0]
    good = train.read_bytes()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipelines.cli", "launch", store.url, "--no-progress"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"},
    )
    try:
        wait_for(lambda: events(store, "expert-0001", "checkpointed"), what="expert 1's first checkpoint")
        bad = train.with_name("bad.tmp")  # replaced, not edited: the running worker's mapping stays intact
        bad.write_bytes(good[:100] + bytes(b ^ 0xFF for b in good[100:200]) + good[200:])
        os.replace(bad, train)
        os.kill(events(store, "expert-0001", "started")[0]["pid"], 9)  # its retry meets the corrupt shard
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2 and "fails its checksum" in err, err[-3000:]
    hist = history(store)
    assert hist["expert-0000"].state == "finished" and hist["expert-0001"].state == "failed_permanently"
    before = Ledger(store).records()
    attempts = hist["expert-0001"].attempts

    assert_one_line_error(soma("resume", store.url, "--retry-failed", "0"), "expert-0000 is finished", "expert-0001")
    assert_one_line_error(soma("resume", store.url, "3"), "--retry-failed")
    train.write_bytes(good)  # the operator restores the shard
    r = soma("resume", store.url, "--retry-failed", "expert-0001", "--no-progress", timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "reopened from step-" in r.stderr
    ev = events(store, "expert-0001")
    reopened = [e for e in ev if e["event"] == "reopened"]
    assert len(reopened) == 1 and reopened[0]["reason"] == "retry_failed" and reopened[0]["step"] > 0
    assert [e for e in ev if e["event"] == "started"][-1]["resumed"] is True
    assert history(store)["expert-0001"].state == "finished"
    after = Ledger(store).records()
    assert after[: len(before)] == before  # the failed attempts' records stay as they were
    assert all(r["expert"] == 1 and r["attempt"] >= attempts for r in after[len(before) :])
    assert_exact_training(store, cfg)
    assert_bitwise(store, seeded[1], cfg.n_experts)
