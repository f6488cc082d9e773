"""The campaign's S3 store unreachable during a launch's preparations, before its driver's loop runs (the lease, the
sweeps, the history, the driver's set-up): waited out for up to retry.infra_wait_s, as the loop's own writes wait
it out; past that, exit 4 with one `error:` line naming the store, and `soma resume` once it is back finishes.
A missing bucket stays bad input, refused at once. The outage is a TCP forwarder in front of moto, killed and
restarted (tests/tcpproxy.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
from conftest import micro_config
from support.s3server import Proxy, s3  # noqa: F401  (fixture)

from pipelines.campaign import preparing
from pipelines.campaign_lease import hold
from pipelines.prepare import prepare
from soma_cluster.campaignfile import CONFIG_FILE
from soma_cluster.errors import SomaError, StoppedByEnvironment
from soma_cluster.events import history
from soma_cluster.lease import LEASE
from soma_cluster.storage import TIMEOUT_ENV, Store

TIMEOUT_S = 1.0  # SOMA_S3_TIMEOUT_S here: one storage call gives up after this
WAIT_S = 6.0  # retry.infra_wait_s of the CLI's campaign


@pytest.fixture
def proxy(s3):  # noqa: F811
    p = Proxy(s3.server.port).start()
    yield p
    p.kill()


def _store(s3, proxy, prefix: str, **kw) -> Store:  # noqa: F811
    opts = s3.storage_options(
        f"http://127.0.0.1:{proxy.port}", connect_timeout=1, read_timeout=1, retries={"max_attempts": 1}
    )
    return Store(s3.url(prefix), opts, timeout_s=TIMEOUT_S, **kw)


def _keys(s3, prefix: str) -> set[str]:  # noqa: F811
    return {k.split(f"{prefix}/", 1)[1] for k in s3.objects(prefix)}


def test_the_lease_waits_out_a_short_outage_and_stops_past_the_bound(s3, proxy):  # noqa: F811
    """`hold` (the lease's check, write and sweep) under `preparing`, with the store away from the start: back
    within the bound, the lease is taken and released; away past it, StoppedByEnvironment, and nothing written."""
    s3.fs().pipe(f"{s3.bucket}/prep/short/{CONFIG_FILE}", b"name: x\n")
    store = _store(s3, proxy, "prep/short")
    proxy.kill()
    back = threading.Timer(3.0, proxy.start)
    back.start()
    t0 = time.monotonic()
    with preparing(store, 20.0), hold(store, "soma launch") as lease:
        took = time.monotonic() - t0
        assert lease.generation == 1
    back.join()
    assert store.outage_wait is None
    assert json.loads(Store(s3.url("prep/short"), s3.storage_options()).read_bytes(LEASE))["released"] is True
    print(f"\nstore away 3.0 s before the lease: taken after {took:.1f} s")
    assert 3.0 <= took < 15.0

    s3.fs().pipe(f"{s3.bucket}/prep/long/{CONFIG_FILE}", b"name: x\n")
    store = _store(s3, proxy, "prep/long")
    proxy.kill()
    t0 = time.monotonic()
    try:
        with pytest.raises(StoppedByEnvironment) as stop, preparing(store, 2.0), hold(store, "soma launch"):
            pass
    finally:
        proxy.start()
    took = time.monotonic() - t0
    line = str(stop.value)
    print(f"store away for good: stopped after {took:.1f} s: {line}")
    assert "storage unreachable" in line and s3.url("prep/long") in line and "soma resume" in line
    assert took < 2.0 + 3 * TIMEOUT_S + 5.0
    assert _keys(s3, "prep/long") == {CONFIG_FILE}  # no lease, no probe object


def test_a_missing_bucket_is_refused_at_once(s3, proxy):  # noqa: F811
    store = Store("s3://soma-no-such-bucket/camp", _store(s3, proxy, "x").storage_options, timeout_s=TIMEOUT_S)
    t0 = time.monotonic()
    with pytest.raises(SomaError, match="does not exist"), preparing(store, 30.0), hold(store, "soma launch"):
        pass  # a SomaError, so not StoppedByEnvironment (exit 4): bad input, exit 2
    assert time.monotonic() - t0 < 5.0


# -- the CLI: soma launch with the store cut as its lease is written ------------------------------------------
def _soma(args: list[str], env: dict, log) -> subprocess.Popen:
    env = {
        **os.environ,
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_AUTH_MODE": "disabled",
        "COLUMNS": "200",
        TIMEOUT_ENV: str(TIMEOUT_S),
        **env,
    }
    return subprocess.Popen(
        [sys.executable, "-m", "pipelines.cli", *args, "--no-progress"],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=env,
        text=True,
    )


def _until(pred, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(0.05)


@pytest.mark.slow  # ~46 s; the lease through an outage: above; a campaign through one: test_s3_outage.py
def test_launch_outage_in_its_preparations(s3, proxy, text_corpus, tmp_path):  # noqa: F811
    """Cut once the lease is written (before Ray starts): past retry.infra_wait_s, exit 4 with one `error:` line
    and nothing half-written; then `soma resume` with the store cut again as it takes the lease, and back while a
    preparation waits (an outage longer than SOMA_S3_TIMEOUT_S, shorter than the bound), finishes."""
    cfg = micro_config(corpus={"source": str(text_corpus)}, retry={"infra_wait_s": WAIT_S})
    url, direct = s3.url("prep/cli"), Store(s3.url("prep/cli"), s3.storage_options())
    t0 = time.monotonic()
    prepare(direct, cfg)
    env = s3.env(f"http://127.0.0.1:{proxy.port}")
    with open(tmp_path / "seed.log", "w") as log:
        assert _soma(["seed", url], env, log).wait(timeout=300) == 0, (tmp_path / "seed.log").read_text()[-3000:]
    print(f"\nprepared and seeded on S3 in {time.monotonic() - t0:.1f} s")
    before = _keys(s3, "prep/cli")
    gen0 = json.loads(direct.read_bytes(LEASE))["generation"]

    def lease_taken(generation: int):
        def taken() -> bool:
            try:
                return json.loads(direct.read_bytes(LEASE))["generation"] > generation
            except Exception:  # a read racing the write: try again
                return False

        return taken

    # 1. the store stays away: exit 4
    out = tmp_path / "launch.log"
    with open(out, "w") as log:
        driver = _soma(["launch", url], env, log)
        try:
            _until(lambda: lease_taken(gen0)() or driver.poll() is not None, 120, "the lease")
            proxy.kill()
            cut = time.monotonic()
            rc = driver.wait(timeout=120)
            stopped = time.monotonic() - cut
        finally:
            if driver.poll() is None:
                driver.kill()
            proxy.start()
    text = out.read_text()
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    print(f"launch: store cut after its lease was written, exit {rc} after {stopped:.1f} s: {errors}")
    assert rc == 4, text[-3000:]
    assert len(errors) == 1 and url in errors[0] and "storage unreachable" in errors[0], text[-3000:]
    assert f"soma resume {url}" in errors[0]
    assert stopped < WAIT_S + 4 * TIMEOUT_S + 10.0
    after = _keys(s3, "prep/cli")
    assert after == before, (after - before, before - after)  # the lease rewritten in place, nothing added
    hist = history(direct)
    assert not [ev for n, h in hist.items() for ev in h.events if ev["event"] == "queued" and n != "seed"]

    # 2. soma resume, the store away while it prepares, back within the bound: it finishes
    gen1 = json.loads(direct.read_bytes(LEASE))["generation"]
    out = tmp_path / "resume.log"
    with open(out, "w") as log:
        driver = _soma(["resume", url], env, log)
        try:
            _until(lambda: lease_taken(gen1)() or driver.poll() is not None, 120, "the lease")
            proxy.kill()
            cut = time.monotonic()
            # back once a preparation has given up its own retries and waits (failures.waiting says so)
            _until(lambda: "trying again in" in out.read_text() or driver.poll() is not None, 60, "a wait")
            time.sleep(1.0)
            proxy.start()
            down = time.monotonic() - cut
            rc = driver.wait(timeout=300)
        finally:
            if driver.poll() is None:
                driver.kill()
    text = out.read_text()
    print(f"resume: store away {down:.1f} s during its preparations, exit {rc}")
    assert rc == 0, text[-3000:]
    assert down > TIMEOUT_S  # longer than a call's own retries: waited out (it began after the cut, as Ray started)
    assert "error:" not in text
    hist = history(direct)
    states = {n: h.state for n, h in hist.items() if n != "seed"}
    assert states == {"expert-0000": "finished", "expert-0001": "finished"}
    assert not [ev for h in hist.values() for ev in h.events if ev["event"] == "failed"]
    print(f"total {time.monotonic() - t0:.1f} s")
