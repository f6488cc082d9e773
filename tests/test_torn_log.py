"""A driver killed mid-append can leave a log (events, ledger) ending in a partial line. Readers skip it; the
first append after cuts it off (as a write-ahead log does) instead of gluing a record onto it, so status and
resume keep working. Checked at every byte offset of the last record, then through the CLI."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import micro_config
from support.inprocess import InProcess

from pipelines.prepare import prepare
from soma_cluster.events import history
from soma_cluster.jobs import SEED_JOB, expert_jobs
from soma_cluster.ledger import Ledger
from soma_cluster.storage import Store

LOGS = ("events.jsonl", "ledger/ledger.jsonl")


def records_and_last(path: Path) -> tuple[bytes, bytes]:
    data = path.read_bytes()
    cut = data[:-1].rfind(b"\n") + 1
    return data[:cut], data[cut:]


@pytest.mark.parametrize("log", LOGS)
def test_every_truncation_of_the_last_record_is_cut_off_before_the_next_append(tmp_path, log):
    root = tmp_path / "c"
    store = Store(str(root))
    for i in range(3):
        store.append(log, {"event": "heartbeat", "job": "expert-0000", "i": i, "note": "x" * 40})
    whole, last = records_and_last(root / log)
    for offset in range(len(last)):  # every byte of the last record, its newline included
        (root / log).write_bytes(whole + last[:offset])
        fresh = Store(str(root))
        assert [r["i"] for r in fresh.read_log(log)] == [0, 1]  # readers skip the fragment
        fresh.append(log, {"event": "heartbeat", "job": "expert-0000", "i": 9, "note": ""})
        for _ in range(2):
            assert [r["i"] for r in Store(str(root)).read_log(log)] == [0, 1, 9], offset
        assert (root / log).read_bytes() == whole + (root / log).read_bytes()[
            len(whole) :
        ]  # nothing before was touched


def test_a_corrupt_record_before_the_last_is_still_refused(tmp_path):
    from soma_cluster.errors import ChecksumError

    root = tmp_path / "c"
    store = Store(str(root))
    for i in range(3):
        store.append("events.jsonl", {"event": "heartbeat", "job": "seed", "i": i})
    lines = (root / "events.jsonl").read_bytes().split(b"\n")
    lines[1] = lines[1][:20]
    (root / "events.jsonl").write_bytes(b"\n".join(lines))
    with pytest.raises(ChecksumError, match="line 2"):
        Store(str(root)).read_log("events.jsonl")


@pytest.fixture(scope="module")
def finished(tmp_path_factory, text_corpus):
    root = tmp_path_factory.mktemp("torn") / "c"
    cfg = micro_config(corpus={"source": str(text_corpus)})
    store = Store(str(root))
    prepare(store, cfg)
    assert InProcess(store, cfg, [SEED_JOB]).run() == {SEED_JOB: "finished"}
    assert set(InProcess(store, cfg, expert_jobs(cfg.n_experts)).run().values()) == {"finished"}
    return root, cfg


def cli(*args):
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled", "COLUMNS": "200"}
    env.pop("RAY_ADDRESS", None)
    return subprocess.run(
        [sys.executable, "-m", "pipelines.cli", *args], env=env, capture_output=True, text=True, timeout=300
    )


# Each cell is a `soma resume` (a Ray start, about 10 s): make test runs one tear of each log; the other two run with
# SOMA_SLOW=1. Every byte offset of either log is cut off without Ray above.
TEARS = [
    pytest.param("middle", "events.jsonl", marks=pytest.mark.slow),
    ("middle", "ledger/ledger.jsonl"),
    ("before its newline", "events.jsonl"),
    pytest.param("before its newline", "ledger/ledger.jsonl", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("where,log", TEARS)
def test_resume_and_status_after_a_torn_last_line(finished, tmp_path, log, where):
    root = tmp_path / "c"
    shutil.copytree(finished[0], root)
    whole, last = records_and_last(root / log)
    (root / log).write_bytes(whole + last[: len(last) // 2 if where == "middle" else len(last) - 1])
    out = cli("resume", str(root), "--no-progress")
    assert out.returncode == 0, out.stderr[-3000:]
    if log == "ledger/ledger.jsonl":  # resume had nothing to write: eval is the next append
        out = cli("eval", str(root))
        assert out.returncode == 0, out.stderr[-3000:]
    assert "unterminated last record" in out.stderr
    for _ in range(2):
        status = cli("status", str(root))
        assert status.returncode == 0, status.stderr[-2000:]
    store = Store(str(root))
    assert all(h.state == "finished" for name, h in history(store).items() if name.startswith("expert-"))
    # an unacknowledged ledger record is lost with its crash (its work stays done); a lost event costs nothing
    lost = json.loads(last)["forwards"] if log.startswith("ledger") else 0
    assert Ledger(store).totals().forwards["expert_training"] == 2 * 12 * 2 * 4 - lost
