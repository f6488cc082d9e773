"""The S3 endpoint stays away longer than a storage call's retries (SOMA_S3_TIMEOUT_S): the workers' and the
driver's writes fail with StorageUnreachable, the infrastructure's failure. Shorter than retry.infra_wait_s, the
campaign waits it out without spending a retry and finishes exactly; longer, it stops (exit 4's exception)."""

import os
import threading
import time

import pytest
from conftest import micro_config
from support.s3server import Proxy, s3  # noqa: F401  (fixture)

from pipelines.campaign import Driver, Job, run_driver
from pipelines.prepare import prepare
from soma_cluster.errors import StoppedByEnvironment
from soma_cluster.events import history
from soma_cluster.ledger import Ledger
from soma_cluster.storage import TIMEOUT_ENV, Store


@pytest.fixture(scope="module")
def short_timeout():
    """Storage calls give up after 2 s, here and in the module's Ray workers (started after this: they inherit it)."""
    old = os.environ.get(TIMEOUT_ENV)
    os.environ[TIMEOUT_ENV] = "2"
    yield
    if old is None:
        os.environ.pop(TIMEOUT_ENV)
    else:
        os.environ[TIMEOUT_ENV] = old


@pytest.fixture
def proxy(s3):  # noqa: F811
    p = Proxy(s3.server.port).start()
    yield p
    p.kill()


def outage(proxy, trigger, down_s: float, log: list) -> threading.Thread:  # noqa: F811
    def run():
        deadline = time.monotonic() + 120
        while not trigger() and time.monotonic() < deadline:  # bounded
            time.sleep(0.05)
        t0 = time.monotonic()
        proxy.kill()
        time.sleep(down_s)
        proxy.start()
        log.append(time.monotonic() - t0)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("down_s,wait_s", [(8.0, 60.0), pytest.param(30.0, 4.0, marks=pytest.mark.slow)])
def test_store_unreachable_past_its_retries(
    short_timeout,
    s3,  # noqa: F811 (the fixture imported above)
    proxy,
    text_corpus,
    ray_local,
    down_s,
    wait_s,
):
    cfg = micro_config(
        corpus={"source": str(text_corpus)},
        retry={"infra_wait_s": wait_s, "max_retries": 1, "backoff_max_s": 1.0},
        train={"updates": 36, "chunk_updates": 3, "checkpoint_every": 3, "val_every": 6},
    )
    url = s3.url(f"unreach{int(down_s)}/camp")
    store = Store(
        url,
        s3.storage_options(
            f"http://127.0.0.1:{proxy.port}", connect_timeout=1, read_timeout=2, retries={"max_attempts": 1}
        ),
    )
    prepare(store, cfg)
    assert Driver(store, cfg, [Job(None)], show_progress=False).run() == {"seed": "finished"}
    direct, root = s3.fs(), f"{s3.bucket}/unreach{int(down_s)}/camp"

    def checkpointed() -> bool:
        direct.invalidate_cache()
        return bool(direct.exists(f"{root}/experts/expert-0000/latest.json"))

    log: list = []
    t = outage(proxy, checkpointed, down_s, log)
    driver = Driver(store, cfg, [Job(e) for e in range(cfg.n_experts)], show_progress=False)
    t0 = time.monotonic()
    try:
        outcome, stopped = run_driver(driver), None
    except StoppedByEnvironment as exc:
        outcome, stopped = None, str(exc)
    took = time.monotonic() - t0
    t.join(timeout=120)
    assert log, "the outage never began"
    hist = history(Store(url, store.storage_options))
    failed = [ev for h in hist.values() for ev in h.events if ev["event"] == "failed"]
    print(
        f"\nS3 down {down_s:g} s, infra_wait_s {wait_s:g}: driver {took:.1f} s, {len(failed)} failed attempts "
        f"{sorted({(ev.get('cause'), ev.get('counted', True)) for ev in failed})}; stopped: {stopped}"
    )
    assert all(ev.get("cause") == "storage_unreachable" and ev["counted"] is False for ev in failed), failed
    assert all(h.failures == 0 for h in hist.values())
    if down_s < wait_s:
        assert outcome == {"expert-0000": "finished", "expert-0001": "finished"}
        totals = Ledger(Store(url, store.storage_options)).totals()
        assert totals.forwards["expert_training"] == cfg.n_experts * 36 * 2 * cfg.spsa.n_pert
    else:
        assert stopped and "storage unreachable" in stopped and "soma resume" in stopped
        assert took < down_s  # it stopped while the store was still away
