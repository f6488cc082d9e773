"""Writers killed mid-file: each `soma` command that writes a campaign (or an export) is SIGKILLed at random moments,
in a real process, and what it left is listed. Nothing may remain but data and the store's own staged names
(".tmp-<host>-<pid>-*", ".soma-scratch-*", ".soma-staging", an export's ".<name>.soma-export-*"), which no listing
shows; after the same command runs again to the end, none of those remain either.

The moments are drawn from a seeded generator (printed with -s) within the command's own measured run time; the
cheap cells kill prepare, eval and export a few times each; `SOMA_SLOW=1` adds launch and more kills."""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import soma

# what a killed writer may leave: the store's staged names, never shown by a listing (soma_cluster/storage.py)
STAGED = re.compile(r"^(\.tmp-.+|\.soma-scratch-.+|\.soma-staging|\..+\.soma-export-\d+-[0-9a-f]{8})$")
ENV = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled", "COLUMNS": "200"}


def staged(root: Path) -> list[str]:
    """The staged names anywhere under `root` (the outermost of nested ones)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            if STAGED.match(name):
                found.append(os.path.relpath(os.path.join(dirpath, name), root))
        dirnames[:] = [d for d in dirnames if not STAGED.match(d)]
    return sorted(found)


def stray(root: Path) -> list[str]:
    """Hidden names that are neither staged nor the campaign's own hidden files (lock files): what a reader might
    take for data, or what nothing would ever remove."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            if name.startswith(".") and not STAGED.match(name) and not name.endswith(".lock"):
                out.append(os.path.relpath(os.path.join(dirpath, name), root))
        dirnames[:] = [d for d in dirnames if not STAGED.match(d)]
    return out


def kill_at(args: list[str], after_s: float) -> int:
    """Run `soma ARGS`, SIGKILL it `after_s` seconds in (if it still runs); its exit status."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipelines.cli", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
        env=ENV,
        start_new_session=True,  # its own group: a killed command's children (Ray's, if any) go with it
    )
    try:
        proc.wait(after_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    return proc.wait(30)


def timed(args: list[str]) -> float:
    t0 = time.monotonic()
    proc = soma(*args, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return time.monotonic() - t0


def kill_and_rerun(name: str, root: Path, args: list[str], kills: int, seed: int, reset=None) -> list[list[str]]:
    """Kill `soma ARGS` `kills` times at moments drawn within its own run time, then run it to the end; each kill's
    leftovers (asserted staged), and none after the rerun."""
    full_s = timed(args)  # once whole: its run time, and a campaign (or export) to kill the next runs in
    rng = random.Random(seed)
    left = []
    for _ in range(kills):
        if reset is not None:
            reset()
        after = rng.uniform(0.2, full_s)
        rc = kill_at(args, after)
        names = staged(root)
        print(f"\n{name}: killed at {after:.2f} s of {full_s:.1f} (rc {rc}): {names or 'nothing staged'}")
        assert not stray(root), stray(root)
        left.append(names)
    assert timed(args) > 0
    assert staged(root) == [] and not stray(root), (staged(root), stray(root))
    return left


def test_killed_prepare_leaves_only_staged_files_and_the_rerun_removes_them(tmp_path, text_corpus, micro_yaml):
    camp = tmp_path / "c"
    args = ["prepare", str(camp), "--config", micro_yaml, "--corpus", str(text_corpus)]

    def fresh() -> None:  # each kill lands in a prepare that writes (one that finds the campaign prepared skips)
        shutil.rmtree(camp / "shards", ignore_errors=True)

    kill_and_rerun("prepare", camp, args, kills=3, seed=40, reset=fresh)
    fresh()
    assert timed(args) > 0 and (camp / "shards" / "manifest.json").exists()


def test_a_kept_staged_shard_is_removed_by_the_next_command(tmp_path, text_corpus, micro_yaml):
    """The issue's case made certain: a prepare killed while a shard is staged (a file of its dead pid beside the
    shard, as a SIGKILL leaves it) is cleaned by the rerun, which also finds the campaign whole."""
    camp = tmp_path / "c"
    args = ["prepare", str(camp), "--config", micro_yaml, "--corpus", str(text_corpus)]
    assert soma(*args).returncode == 0
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(30)
    import socket

    expert = next((camp / "shards").glob("expert-*"))
    leftover = expert / f".tmp-{socket.gethostname()}-{dead.pid}-abc123.arrow"
    leftover.write_bytes(b"\0" * 4096)
    proc = soma(*args)
    assert proc.returncode == 0, proc.stderr
    assert not leftover.exists() and staged(camp) == []


def test_killed_eval_leaves_only_staged_files(tmp_path, trained_campaign):
    """(soma export killed at random moments: tests/test_export.py.)"""
    camp = tmp_path / "c"
    shutil.copytree(trained_campaign, camp)
    kill_and_rerun("eval", camp, ["eval", str(camp)], kills=2, seed=41)


@pytest.mark.slow
def test_killed_resume_and_eval_many_times(tmp_path, trained_campaign):
    """More kills, and a driver with Ray and actors writing checkpoints: each rerun finishes, nothing staged left."""
    camp = tmp_path / "c"
    shutil.copytree(trained_campaign, camp)
    kill_and_rerun("eval", camp, ["eval", str(camp)], kills=6, seed=44)
    kill_and_rerun("resume", camp, ["resume", str(camp), "--no-progress"], kills=4, seed=43)
