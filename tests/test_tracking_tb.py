"""A tiny campaign tracked in TensorBoard only, as TensorBoard's own loaders (tests/support/tbloaders.py) show it:
its log directory (a tmpfs) read-only at the start of `soma launch` (training finishes, the driver drops what it cannot
write, writes on once the directory is back, reports and records the gap), then `soma track` filling the gap
below points written after it, twice (the second sends and rewrites nothing). Needs root for the mount."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import soma

from soma_cluster.jobcurves import read_curve
from soma_cluster.storage import Store

pytest.importorskip("tensorboard")


def _mount(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["mount", *args], capture_output=True, text=True)


def _remount(path: Path, mode: str) -> None:
    """`mode` is ro or rw; a remount to ro is refused while a file there is open for writing (the sink opens its
    file for each batch only): tried again, bounded."""
    for _ in range(100):
        if _mount("-o", f"remount,{mode}", str(path)).returncode == 0:
            return
        time.sleep(0.02)
    raise AssertionError(f"remount,{mode} of {path} kept failing")


def expert_heartbeats(campaign: str) -> int:
    events = Path(campaign) / "events.jsonl"
    text = events.read_text() if events.exists() else ""
    return sum('"event": "heartbeat"' in x and '"job": "expert-' in x for x in text.splitlines())


def launch_with_an_outage(campaign: str, tb: Path) -> subprocess.CompletedProcess:
    """`soma launch` with its TensorBoard directory read-only until just after the first expert heartbeat: the
    sink's first write (of that heartbeat's points, within SINK_POLL_S) fails and is dropped (retries=0), and while it
    cools down (COOLDOWN_S) the later heartbeats queue up, to be written once the directory is back."""
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled", "COLUMNS": "200"}
    cmd = [sys.executable, "-m", "pipelines.cli", "launch", campaign, "--no-progress"]
    _remount(tb, "ro")
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        deadline = time.monotonic() + 180
        while expert_heartbeats(campaign) < 1 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)
    finally:
        _remount(tb, "rw")
    out, err = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def assert_shows_the_campaign(tb: Path, store: Store, jobs: list[str]) -> None:
    from support.tbloaders import shown

    for loader, runs in shown(str(tb)).items():
        (folder,) = {name.split("/")[0] for name in runs}  # the campaign's, holding one run per job
        assert set(runs) == {f"{folder}/{job}" for job in ["campaign", *jobs]}, loader
        for name, run in runs.items():
            for tag, pts in run.items():
                steps = [s for s, _ in pts]
                assert steps == sorted(set(steps)), (loader, name, tag, steps)  # each step once, in step order
        for job in jobs:
            curve = [(int(r["step"]), r["train_loss"]) for r in read_curve(store, job)]
            got = runs[f"{folder}/{job}"]["train_loss"]
            assert [s for s, _ in got] == [s for s, _ in curve], (loader, job)
            assert [v for _, v in got] == pytest.approx([v for _, v in curve], rel=1e-6), (loader, job)


def test_an_outage_in_the_middle_is_filled_as_tensorboard_shows_it(tmp_path, micro_yaml):
    tb = tmp_path / "tb"
    tb.mkdir()
    proc = _mount("-t", "tmpfs", "-o", "size=20m", "tmpfs", str(tb))
    if proc.returncode != 0:
        pytest.skip(f"mount tmpfs refused ({proc.stderr.strip()[:120]}): needs root")
    try:
        campaign = str(tmp_path / "c")
        sets = ["--set", "tracking.backends=[tensorboard]", "--set", f"tracking.tensorboard_dir={tb}"]
        sets += ["--set", "tracking.retries=0"]  # a batch that fails once is dropped: the outage leaves a gap
        sets += ["--set", "spsa.n_pert=64"]  # an expert's heartbeats ~0.3 s apart: later ones come after the outage
        assert soma("prepare", campaign, "--config", micro_yaml, *sets).returncode == 0
        assert soma("seed", campaign, "--no-progress").returncode == 0
        p = launch_with_an_outage(campaign, tb)
        assert p.returncode == 0, p.stderr  # training finished, the tracker's directory read-only meanwhile
        assert "tracking: tensorboard missed" in p.stderr, p.stderr
        gaps = [json.loads(x) for x in (Path(campaign) / "tracking" / "gaps.jsonl").read_text().splitlines()]
        assert any(g["backend"] == "tensorboard" and g["dropped"] > 0 for g in gaps)
        store = Store(campaign)
        jobs = ["seed", "expert-0000", "expert-0001"]

        t0 = time.monotonic()
        p = soma("track", campaign, "--json")
        track_s = time.monotonic() - t0
        assert p.returncode == 0, p.stderr
        assert_shows_the_campaign(tb, store, jobs)
        doc = json.loads(p.stdout)["backends"]["tensorboard"]
        assert doc["points"] > 0 and doc["replaced"], doc  # replaced: some point fell below a tag's last step
        again = json.loads(soma("track", campaign, "--json").stdout)["backends"]["tensorboard"]
        assert again["points"] == 0 and again["replaced"] == [], again
        assert_shows_the_campaign(tb, store, jobs)
        print(f"\nbackfill: {doc['points']} points, {len(doc['replaced'])} files replaced, {track_s:.1f} s")
    finally:
        subprocess.run(["umount", "-l", str(tb)], check=False, capture_output=True)
