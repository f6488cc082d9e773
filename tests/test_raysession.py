"""A local Ray's leftovers and signals: the owner file names who may clean a directory, a full /tmp is one line, a
signal inside the driver's loop only asks it to stop, elsewhere it stops at once; and with a real Ray, nothing of it
outlives a SIGKILLed command."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import fill_up

import pipelines.raysession as rs
from pipelines.stopping import Stopped, StopSignals
from soma_cluster.diskerrors import StorageError


def owned(root, name: str, pid: int, started: float):
    d = root / f"{rs.PREFIX}{name}"
    d.mkdir()
    (d / rs.OWNER).write_text(json.dumps({"pid": pid, "started": started}))
    return d


def test_leftovers_of_a_dead_owner_go_the_living_and_the_young_stay(tmp_path):
    import psutil

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(30)
    me = psutil.Process()
    gone = owned(tmp_path, "gone", dead.pid, time.time() - 5)
    mine = owned(tmp_path, "mine", me.pid, me.create_time())
    reused = owned(tmp_path, "reused", me.pid, me.create_time() - 100)  # my pid, another process's start
    young = tmp_path / f"{rs.PREFIX}young"  # no owner file (an older soma's)
    young.mkdir()
    old = tmp_path / f"{rs.PREFIX}old"
    old.mkdir()
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    removed = rs.clean_leftovers(str(tmp_path))
    assert sorted(removed) == sorted([str(gone), str(reused), str(old)])
    assert mine.exists() and young.exists() and not gone.exists() and not old.exists()


def test_a_full_tmp_is_one_line_naming_it(tmp_path, monkeypatch):
    mnt = tmp_path / "tmp"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        fill_up(mnt)
        monkeypatch.setattr(rs, "RAY_TMP", str(mnt))
        with pytest.raises(StorageError, match=f"{mnt}: no space left.*sockets and logs"):
            rs._own_temp_dir()
        assert [p.name for p in mnt.iterdir()] == ["filler"]
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_entrypoint_that_is_not_utf8_is_sent_as_utf8():
    name = "soma launch " + os.fsdecode(b"/data/camp-\xff")
    assert rs._utf8(name).encode("utf-8") == b"soma launch /data/camp-\\xff"
    assert rs._utf8("plain") == "plain"


def test_a_signal_inside_the_loop_asks_outside_it_stops(monkeypatch):
    stop = StopSignals()
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        stop.install()
        with pytest.raises(Stopped) as got, stop.cooperative():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)  # the handler runs here and only sets `requested`
            assert stop.requested == signal.SIGTERM
        assert got.value.exit_code == 143 and got.value.name == "SIGTERM"
        fresh = StopSignals()
        fresh.install()
        with pytest.raises(Stopped) as got:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
        assert got.value.exit_code == 130
        os.kill(os.getpid(), signal.SIGINT)  # a second signal while stopping is noted, not raised
        time.sleep(0.05)
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


def _sigterm_disposition() -> str:
    with open("/proc/self/status") as fh:
        bits = {line[:6]: int(line.split()[1], 16) for line in fh if line.startswith(("SigCgt", "SigIgn"))}
    return "caught" if bits["SigCgt"] & (1 << 14) else "ignored" if bits["SigIgn"] & (1 << 14) else "default"


def test_sigterm_stays_caught_while_a_local_ray_starts_and_stops():
    """Ray sets SIGTERM to handlers of its own in ray.init and back to the default action while ray.shutdown stops its
    core worker (then stops its processes for a second more): a job system's SIGTERM in that second killed the command
    before it released its lease. Watched every 2 ms from a thread, the default action now lasts milliseconds at most
    (between Ray's reset and the start of its processes' stop, where ours are installed again; was ~1 s)."""
    import inspect

    code = (
        "import sys; sys.path.insert(0, sys.argv[1])\nimport threading, time\n"
        + inspect.getsource(_sigterm_disposition)
        + "d = _sigterm_disposition\n"
        "from pipelines.stopping import STOP\nSTOP.install()\nfrom pipelines.raysession import ray_session\n"
        "from soma_cluster.config import resolve\nlog, done = [], False\n"
        "def watch():\n    while not done:\n        log.append((time.monotonic(), d())); time.sleep(0.002)\n"
        "threading.Thread(target=watch, daemon=True).start()\n"
        "with ray_session(resolve('tiny')):\n    pass\ndone = True\ntime.sleep(0.01)\n"
        "print(sum(b[0] - a[0] for a, b in zip(log, log[1:]) if a[1] == 'default'), sorted({s for _, s in log}))\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-c", code, root],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    default_s, states = proc.stdout.strip().splitlines()[-1].split(" ", 1)
    print(f"\nSIGTERM at its default action for {float(default_s) * 1000:.1f} ms of the session; states seen {states}")
    assert float(default_s) < 0.05 and "ignored" not in states


def test_a_sigkilled_command_leaves_nothing_of_its_local_ray(tmp_path, trained):
    """`soma resume` SIGKILLed while its local Ray trains: Ray's own fate-sharing ends the GCS and raylet at once, but
    its agents ran on for a minute (62 s here, waiting on the dead GCS); the watchdog (pipelines/raywatch.py) ends
    every process of that Ray and removes its directory within seconds. Bounded: 180 s for the expert to start
    training (it has 100,000 updates to make), 30 s after the kill."""
    import shutil

    import psutil

    camp = tmp_path / "camp"
    shutil.copytree(trained.camp, camp)
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled", "RAY_ADDRESS": ""}
    retrain = ["--retrain", "0", "--set", "train.updates=100000", "--no-progress"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipelines.cli", "resume", str(camp), *retrain],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    kids: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            kids = psutil.Process(proc.pid).children(recursive=True)
            names = {k.name() for k in kids if k.is_running()}
            if {"ray::DashboardAgent", "ray::RuntimeEnvAgent"} <= names and any(
                n.startswith("ray::") and n not in ("ray::DashboardAgent", "ray::RuntimeEnvAgent", "ray::IDLE")
                for n in names
            ):
                break  # the node is up and the expert's actor trains
            time.sleep(0.5)
        else:
            pytest.fail(f"soma resume never trained on a local Ray (exit {proc.poll()})")
        ray_dir = next(k.environ()["SOMA_RAY_DIR"] for k in kids if k.name() == "raylet")
        t0 = time.monotonic()
        proc.kill()
        proc.wait(30)
        while time.monotonic() - t0 < 30 and (any(_running(k) for k in kids) or os.path.exists(ray_dir)):
            time.sleep(0.2)
        left = [k.name() for k in kids if _running(k)]
        print(
            f"\nafter SIGKILL: {len(kids) - len(left)} of {len(kids)} processes gone in {time.monotonic() - t0:.1f} s"
        )
        assert not left and not os.path.exists(ray_dir), (left, ray_dir)
    finally:
        proc.kill()
        for k in kids:
            if _running(k):
                k.kill()


def _running(p) -> bool:
    import psutil

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
