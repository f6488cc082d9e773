"""The S3 endpoint goes away mid-run and comes back: writes are retried and nothing is lost.

moto keeps its state only in memory, so a restarted moto_server would be empty. The endpoint the
clients use is therefore a forwarding process (tests/support/tcpproxy.py) in front of moto: killing it
(SIGKILL) resets in-flight connections and refuses new ones, and it restarts on the same port. A
second kind of outage pauses moto itself (SIGSTOP/SIGCONT): connections hang until a read timeout.
"""

import logging
import threading
import time

import pytest
from conftest import micro_config
from support.s3server import Proxy, s3  # noqa: F401  (fixture)

from pipelines.campaign import Driver, Job
from pipelines.evaluate import evaluate
from pipelines.prepare import prepare
from soma_cluster.checkpoint import load_checkpoint
from soma_cluster.events import history
from soma_cluster.ledger import Ledger
from soma_cluster.storage import Store

OUTAGE_S = 2.5


@pytest.fixture
def proxy(s3):  # noqa: F811
    p = Proxy(s3.server.port).start()
    yield p
    p.kill()


class Outages(threading.Thread):
    """Once `trigger()` is true: the proxy down for OUTAGE_S, back, then moto paused for OUTAGE_S, resumed."""

    def __init__(self, s3, proxy, trigger, timeout_s=90.0):  # noqa: F811
        super().__init__(daemon=True)
        self.s3, self.proxy, self.trigger, self.timeout_s = s3, proxy, trigger, timeout_s
        self.windows: list[tuple[str, float, float]] = []
        self.error: BaseException | None = None
        self.finished = threading.Event()

    def run(self) -> None:
        try:
            deadline = time.monotonic() + self.timeout_s
            while not self.trigger():
                if time.monotonic() > deadline:
                    raise TimeoutError("outage trigger never fired")
                time.sleep(0.05)
            t0 = time.monotonic()
            self.proxy.kill()
            time.sleep(OUTAGE_S)
            self.proxy.start()
            self.windows.append(("proxy killed", t0, time.monotonic()))
            time.sleep(0.5)
            t0 = time.monotonic()
            self.s3.server.pause()
            time.sleep(OUTAGE_S)
            self.s3.server.resume()
            self.windows.append(("moto paused", t0, time.monotonic()))
        except BaseException as exc:  # reported by the test
            self.error = exc
            self.s3.server.resume()
        finally:
            self.finished.set()


def _fast_fail_options(s3, proxy):  # noqa: F811
    """botocore gives up at once, so the retrying is Store._retry's; short timeouts turn a hang into an error."""
    return s3.storage_options(
        f"http://127.0.0.1:{proxy.port}", connect_timeout=1, read_timeout=1, retries={"max_attempts": 1}
    )


def test_driver_like_loop_survives_endpoint_restart_and_pause(s3, proxy, caplog):  # noqa: F811
    caplog.set_level(logging.WARNING, logger="soma_cluster.storage")
    url = s3.url("outage/loop")
    store = Store(url, _fast_fail_options(s3, proxy), retries=8)
    store.write_json("campaign.json", {"n": 0})
    started = time.monotonic()
    outages = Outages(s3, proxy, lambda: time.monotonic() - started > 0.5)
    outages.start()
    slow_ops, i = [], 0
    while i < 2000 and time.monotonic() - started < 60:  # bounded in count and time
        t = time.monotonic()
        store.append("events.jsonl", {"i": i})
        store.write_json(f"ckpt/step-{i:06d}.json", {"i": i})
        store.write_json("ckpt/latest.json", {"i": i})
        assert store.read_json("ckpt/latest.json") == {"i": i}
        assert store.exists(f"ckpt/step-{i:06d}.json")
        if i % 10 == 0:
            assert [r["i"] for r in store.read_log("events.jsonl")] == list(range(i + 1))
        if time.monotonic() - t > 0.9:
            slow_ops.append(i)
        i += 1
        if outages.finished.is_set() and i > 0 and time.monotonic() - outages.windows[-1][2] > 0.5:
            break
    outages.join(timeout=30)
    assert outages.error is None, outages.error
    assert len(outages.windows) == 2 and slow_ops, (outages.windows, slow_ops)
    # everything written is there, once, readable and checksum-valid, seen by a reader talking to moto directly
    fresh = Store(url, s3.storage_options())
    assert [r["i"] for r in fresh.read_log("events.jsonl")] == list(range(i))
    assert fresh.listdir("ckpt") == sorted([f"step-{k:06d}.json" for k in range(i)] + ["latest.json"])
    assert all(fresh.read_json(f"ckpt/step-{k:06d}.json") == {"i": k} for k in range(i))
    retried = [r.getMessage() for r in caplog.records if "retry" in r.getMessage()]
    assert retried, "the outage never reached Store._retry"
    assert not [m for m in caplog.messages if s3.secret in m]


def test_campaign_with_ray_workers_survives_endpoint_restart_and_pause(s3, proxy, text_corpus, ray_local):  # noqa: F811
    cfg = micro_config(
        corpus={"source": str(text_corpus)},
        train={"updates": 36, "chunk_updates": 3, "checkpoint_every": 3, "val_every": 6},
    )
    url = s3.url("outage/camp")
    opts = s3.storage_options(
        f"http://127.0.0.1:{proxy.port}", connect_timeout=1, read_timeout=2, retries={"max_attempts": 2}
    )
    store = Store(url, opts)
    t0 = time.monotonic()
    prepare(store, cfg)
    print(f"prepare {time.monotonic() - t0:.1f} s")
    assert Driver(store, cfg, [Job(None)], show_progress=False).run() == {"seed": "finished"}
    direct = s3.fs()
    root = f"{s3.bucket}/outage/camp"

    def first_expert_checkpoint() -> bool:  # looked up on moto itself, not through the proxy
        direct.invalidate_cache()
        return bool(
            direct.exists(f"{root}/experts/expert-0000/latest.json")
            or direct.exists(f"{root}/experts/expert-0001/latest.json")
        )

    print(f"seed done {time.monotonic() - t0:.1f} s")
    outages = Outages(s3, proxy, first_expert_checkpoint)
    outages.start()
    jobs = [Job(e) for e in range(cfg.n_experts)]
    outcome = Driver(store, cfg, jobs, show_progress=False).run()
    ended = time.monotonic()
    windows = [(w, round(a - t0, 1), round(b - t0, 1)) for w, a, b in outages.windows]
    print(f"experts done {ended - t0:.1f} s, outages {windows}")
    outages.join(timeout=60)
    assert outages.error is None, outages.error
    assert outages.windows and outages.windows[0][2] < ended, (
        "the campaign ended before the endpoint came back",
        outages.windows,
    )
    assert outcome == {"expert-0000": "finished", "expert-0001": "finished"}

    fresh = Store(url, s3.storage_options())
    hist = history(fresh)
    assert not [ev for h in hist.values() for ev in h.events if ev["event"] in ("failed", "retried")], (
        "an outage cost a retry"
    )
    updates, per_chunk = cfg.train.updates, cfg.train.chunk_updates
    for job in jobs:
        h = hist[job.name]
        assert h.state == "finished" and h.step == updates and h.attempts == 1
        beats = [ev["step"] for ev in h.events if ev["event"] == "heartbeat"]
        assert beats == [1] + list(range(1 + per_chunk, updates, per_chunk)) + [
            updates
        ]  # every heartbeat, once, in order
        ck = load_checkpoint(fresh, f"experts/{job.name}")  # checksums verified
        assert ck.meta["state"]["step"] == updates
        saved = sorted(n for n in fresh.listdir(f"experts/{job.name}") if n.endswith(".safetensors"))
        assert len(saved) == len({ev["checkpoint"] for ev in h.events if ev["event"] == "checkpointed"})
        for name in saved:
            load_checkpoint(fresh, f"experts/{job.name}", name.removesuffix(".safetensors"))
    totals = Ledger(fresh).totals()
    assert (
        totals.forwards["expert_training"] == cfg.n_experts * updates * 2 * cfg.spsa.n_pert
    )  # no record lost or doubled
    heartbeats = sum(ev["event"] == "heartbeat" for h in hist.values() for ev in h.events)
    records = [r for r in Ledger(fresh).records() if r["category"] in ("seed", "expert_training")]
    assert len([r for r in records if r["seq"] > 0]) == heartbeats
    assert len([r for r in records if r["seq"] == 0]) <= len(hist)  # at most one actor-start record per job
    assert totals.gpu_seconds["wasted"] == 0
    metrics = evaluate(store, cfg)  # and the campaign evaluates
    assert metrics["ensemble"]["nats_per_byte"] < metrics["uniform"]["nats_per_byte"]
    leaks = [p for p, data in s3.objects("outage").items() if s3.secret.encode() in data]
    assert not leaks, leaks
