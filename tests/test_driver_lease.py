"""One driver per campaign, and signals to it, through the real CLI with a real local Ray: a second launch or a
resume while a launch trains is refused; SIGTERM leaves a final snapshot, the lease released and no local Ray
behind; a SIGKILLed driver's leftovers go with the next command, which takes over at once; a SIGSTOPped driver
whose lease expired is replaced, and once SIGCONTed writes nothing."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import MICRO, assert_one_line_error, soma

from soma_cluster.storage import Store

# long enough to be caught training (a few seconds of updates after the actors start), short enough to finish
LONG = {
    **MICRO,
    "train": {**MICRO["train"], "updates": 240, "chunk_updates": 4, "checkpoint_every": 40, "val_every": 40},
}


def env(**extra) -> dict:
    return {
        **os.environ,
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_AUTH_MODE": "disabled",
        "COLUMNS": "200",
        **extra,
    }


def start(*args, **extra) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "pipelines.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env(**extra),
    )


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def events(camp: Path) -> list[dict]:
    """The campaign's events as its own reader gives them (a last line the driver is still appending is skipped)."""
    return Store(str(camp)).read_log("events.jsonl")


def wait_for(pred, what: str, timeout: float = 120.0, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the driver exited ({proc.returncode}) before {what}: {proc.stderr.read()[-3000:]}")
        got = pred()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def training(camp: Path) -> bool:
    return any(e["event"] == "heartbeat" and e["job"] != "seed" for e in events(camp))


def lease(camp: Path) -> dict:
    return json.loads((camp / "driver-lease.json").read_text())


def tree_digest(camp: Path) -> dict[str, str]:
    return {
        str(p.relative_to(camp)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(camp.rglob("*"))
        if p.is_file() and not p.name.startswith(".")
    }


def finished_once(camp: Path, n: int) -> None:
    ends = [e["job"] for e in events(camp) if e["event"] == "finished" and e["job"] != "seed"]
    assert sorted(ends) == [f"expert-{e:04d}" for e in range(n)], ends


def ray_dirs_of(pid: int) -> list[str]:
    found = []
    for d in glob.glob("/tmp/soma-ray-*"):
        try:
            if json.loads(Path(d, "soma-owner.json").read_text()).get("pid") == pid:  # (a kept one names none)
                found.append(d)
        except (OSError, ValueError):
            continue
    return found


@pytest.fixture(scope="module")
def seeded(tmp_path_factory, text_corpus) -> Path:
    cfg = tmp_path_factory.mktemp("cfg") / "long.yaml"
    cfg.write_text(yaml.safe_dump(LONG))
    camp = tmp_path_factory.mktemp("seeded") / "c"
    for args in (
        ["prepare", str(camp), "--config", str(cfg), "--corpus", str(text_corpus)],
        ["seed", str(camp), "--no-progress"],
    ):
        proc = soma(*args)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return camp


def clone(seeded: Path, dest: Path) -> Path:
    shutil.copytree(seeded, dest)
    return dest


@pytest.fixture(scope="module")
def reference(seeded, tmp_path_factory) -> Path:
    """The same campaign launched without any fault."""
    camp = clone(seeded, tmp_path_factory.mktemp("ref") / "c")
    proc = soma("launch", str(camp), "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return camp


def assert_as_if_never_stopped(camp: Path, reference: Path) -> None:
    """Bitwise the experts of the run that was never stopped, and the same training forwards in the ledger (what was
    lost to the stop is `wasted`, never counted twice)."""
    import torch

    from soma_cluster.checkpoint import load_checkpoint
    from soma_cluster.ledger import Ledger

    mine, ref = Store(str(camp)), Store(str(reference))
    for e in range(2):
        a, b = (load_checkpoint(s, f"experts/expert-{e:04d}").tensors for s in (mine, ref))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), e
    assert Ledger(mine).totals().forwards["expert_training"] == Ledger(ref).totals().forwards["expert_training"]


def test_second_driver_refused_while_one_trains(seeded, tmp_path):
    camp = clone(seeded, tmp_path / "c")
    first = start("launch", str(camp), "--no-progress")
    try:
        wait_for(lambda: training(camp), "training", proc=first)
        # held still (its lease stays live for its 30 s ttl) so that all three are refused however loaded the host
        os.kill(first.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        others = [start(cmd, str(camp), "--no-progress") for cmd in ("launch", "resume", "seed")]
        results = [subprocess.CompletedProcess(p.args, *finish(p, 60)) for p in others]
        os.kill(first.pid, signal.SIGCONT)
        for proc in results:
            assert_one_line_error(proc, "another driver", f"pid {first.pid}", "--take-over")
            assert "Traceback" not in proc.stderr
        assert time.monotonic() - t0 < 25, "the refusals took longer than the lease's life"
        rc, _, err = finish(first)
        assert rc == 0, err[-3000:]
    finally:
        if first.poll() is None:
            os.kill(first.pid, signal.SIGCONT)
        first.kill()
    finished_once(camp, 2)
    assert lease(camp)["released"] and lease(camp)["generation"] == 3  # prepare, seed, this launch


def test_sigterm_stops_cleanly_and_resume_finishes(seeded, reference, tmp_path):
    camp = clone(seeded, tmp_path / "c")
    driver = start("launch", str(camp), "--no-progress")
    try:
        wait_for(lambda: training(camp), "training", proc=driver)
        dirs = ray_dirs_of(driver.pid)
        assert len(dirs) == 1
        t0 = time.monotonic()
        driver.send_signal(signal.SIGTERM)
        rc, _, err = finish(driver, 60)
        stop_s = time.monotonic() - t0
    finally:
        driver.kill()
    assert rc == 143, err[-3000:]
    assert err.strip().splitlines()[-1].startswith("stopped: SIGTERM") and "Traceback" not in err, err[-3000:]
    print(f"\nSIGTERM to exit: {stop_s:.1f} s")
    snap = json.loads((camp / "status.json").read_text())
    assert snap["driver"]["state"] == "stopped" and snap["driver"]["stopped_by"] == "SIGTERM" and not snap["final"]
    assert "running" not in snap["counts"] and snap["counts"].get("interrupted", 0) >= 1, snap["counts"]
    assert lease(camp)["released"]
    assert not os.path.exists(dirs[0]), "the local Ray's temporary directory outlived the driver"
    status = soma("status", str(camp))
    assert status.returncode == 0 and "STOPPED (SIGTERM)" in status.stdout and "interrupted" in status.stdout
    proc = soma("resume", str(camp), "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    finished_once(camp, 2)
    snap = json.loads((camp / "status.json").read_text())
    assert snap["final"] and snap["driver"]["state"] == "ended" and snap["counts"] == {"finished": 3}
    assert_as_if_never_stopped(camp, reference)


def test_sigkilled_driver_is_replaced_at_once_and_its_leftovers_cleaned(seeded, reference, tmp_path):
    """The campaign's directory name is not UTF-8 (kept by Python as surrogate escapes): Ray sends the driver's
    command line as UTF-8 and pyarrow encodes str paths as UTF-8, and it trains, is killed and resumes all the same."""
    camp = clone(seeded, Path(os.fsdecode(bytes(tmp_path) + b"/camp-\xff\xfe")))
    driver = start("launch", str(camp), "--no-progress")
    try:
        wait_for(lambda: training(camp), "training", proc=driver)
        dirs = ray_dirs_of(driver.pid)
        driver.send_signal(signal.SIGKILL)
        driver.wait(30)
    finally:
        driver.kill()
    assert dirs and os.path.exists(dirs[0]) and not lease(camp)["released"]
    t0 = time.monotonic()
    proc = soma("resume", str(camp), "--no-progress")  # the lease's holder is gone on this host: no wait for expiry
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "took over" in proc.stderr and "was left by a process that is gone" in proc.stderr
    assert not os.path.exists(dirs[0])
    finished_once(camp, 2)
    assert_as_if_never_stopped(camp, reference)
    ids = [json.loads(line)["id"] for line in (camp / "ledger" / "ledger.jsonl").read_text().splitlines()]
    assert len(ids) == len(set(ids))  # no GPU-second record written twice
    print(f"\nresume after SIGKILL: {time.monotonic() - t0:.1f} s")


@pytest.mark.slow  # ~65 s on 2 cores: a SIGSTOPped driver outliving its ttl (the SIGKILL case runs in make test)
def test_paused_driver_replaced_after_expiry_writes_nothing_once_continued(seeded, reference, tmp_path):
    camp = clone(seeded, tmp_path / "c")
    ttl = {"SOMA_LEASE_TTL_S": "10"}
    old = start("launch", str(camp), "--no-progress", **ttl)
    timeline = []
    try:
        wait_for(lambda: training(camp), "training", proc=old)
        os.kill(old.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        paused_at = time.time()
        last_renewal = wait_for(lambda: lease(camp)["renewed_at"], "the lease")
        timeline.append(("SIGSTOP old driver", 0.0))
        refused = subprocess.run(
            [sys.executable, "-m", "pipelines.cli", "resume", str(camp), "--no-progress"],
            capture_output=True,
            text=True,
            timeout=300,
            env=env(**ttl),
        )
        assert time.time() - lease(camp)["renewed_at"] < 10, "the host is too slow for this test's 10 s lease"
        assert_one_line_error(refused, f"pid {old.pid}")
        timeline.append(("resume refused (lease live)", time.monotonic() - t0))
        # --take-over waits for the lease to lapse (it is not renewed while its holder is stopped), then takes over
        new = subprocess.run(
            [sys.executable, "-m", "pipelines.cli", "resume", str(camp), "--no-progress", "--take-over"],
            capture_output=True,
            text=True,
            timeout=300,
            env=env(**ttl),
        )
        timeline.append(("resume --take-over took over and finished", time.monotonic() - t0))
        assert new.returncode == 0 and "its lease had expired" in new.stderr, new.stderr[-3000:]
        assert lease(camp)["generation"] == 4 and lease(camp)["released"]
        finished_once(camp, 2)
        before = tree_digest(camp)
        os.kill(old.pid, signal.SIGCONT)
        timeline.append(("SIGCONT old driver", time.monotonic() - t0))
        rc, _, err = finish(old, 120)
        timeline.append((f"old driver exited {rc}", time.monotonic() - t0))
    finally:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(old.pid, sig)
            except ProcessLookupError:
                pass
        old.wait(30)
    print("\n" + "\n".join(f"  {t:6.1f} s  {what}" for what, t in timeline))
    assert rc == 4, err[-3000:]
    first_new = min(e["t"] for e in events(camp) if e["t"] > paused_at)
    assert first_new >= last_renewal + 10, (first_new, last_renewal)  # taken over only once the lease had lapsed
    assert "lost" in err and "Traceback" not in err, err[-3000:]
    assert tree_digest(camp) == before, "the paused driver wrote after another driver took the campaign over"
    assert_as_if_never_stopped(camp, reference)


@pytest.mark.slow  # ~46 s on 2 cores: a launch and a resume around a damaged lease file
def test_a_lease_overwritten_mid_run_stops_the_driver_and_loses_nothing(seeded, reference, tmp_path):
    """Someone overwrites (or deletes) driver-lease.json while a launch trains: no driver can show it holds the
    campaign, so the driver stops (exit 4) without failing any expert; once the damaged file is deleted, resume
    finishes."""
    camp = clone(seeded, tmp_path / "c")
    driver = start("launch", str(camp), "--no-progress")
    try:
        wait_for(lambda: training(camp), "training", proc=driver)
        (camp / "driver-lease.json").write_bytes(b'{"garbage')
        rc, _, err = finish(driver, 120)
    finally:
        driver.kill()
    assert rc == 4 and "overwritten with something else" in err and "Traceback" not in err, err[-3000:]
    assert not [e for e in events(camp) if e["event"] == "failed_permanently"]
    refused = soma("resume", str(camp), "--no-progress")
    assert_one_line_error(refused, "not a soma driver lease", "delete it")
    (camp / "driver-lease.json").unlink()
    proc = soma("resume", str(camp), "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    finished_once(camp, 2)
    assert_as_if_never_stopped(camp, reference)
