"""The driver's metrics reach a local Ray's Prometheus endpoint and carry what the ledger holds.

Needs Ray's metrics agent, i.e. `ray[default]` (pyproject's `metrics` extra: aiohttp_cors, opencensus,
prometheus_client, ...); skipped where it is not installed. Ray on loopback only (docs/cluster.md)."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
import urllib.request

import pytest

for mod in ("aiohttp_cors", "opencensus", "prometheus_client"):
    pytest.importorskip(mod, reason="the metrics endpoint needs ray[default] (pip install '.[metrics]')")

from support.ports import free_port  # noqa: E402
from test_chaos import config  # noqa: E402

from pipelines.campaign import Driver  # noqa: E402
from pipelines.prepare import prepare  # noqa: E402
from soma_cluster.jobs import SEED_JOB, expert_jobs  # noqa: E402
from soma_cluster.ledger import Ledger  # noqa: E402
from soma_cluster.storage import Store  # noqa: E402


@pytest.fixture(scope="module")
def ray_with_metrics():
    import ray

    port = free_port()
    tmp = tempfile.mkdtemp(prefix="soma-ray-m-", dir="/tmp")
    ray.init(
        num_gpus=4,
        num_cpus=2,
        include_dashboard=False,
        _temp_dir=tmp,
        log_to_driver=False,
        logging_level="WARNING",
        _metrics_export_port=port,
        _system_config={"metrics_report_interval_ms": 500},
    )
    yield port
    ray.shutdown()
    shutil.rmtree(tmp, ignore_errors=True)


def scrape(port: int) -> dict[tuple[str, str], float]:
    """(metric name, labels text) -> value for every soma metric on the endpoint."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for m in re.finditer(r"^(ray_soma_\w+)\{([^}]*)\} ([0-9.eE+-]+)$", text, flags=re.M):
        out[(m.group(1), m.group(2))] = float(m.group(3))
    return out


def value(metrics: dict, name: str, **labels) -> float | None:
    for (n, lab), v in metrics.items():
        if n == name and all(f'{k}="{w}"' in lab for k, w in labels.items()):
            return v
    return None


def test_metrics_endpoint_carries_the_ledgers_values(tmp_path, text_corpus, ray_with_metrics):
    cfg = config(n_experts=2, name="metrics-test", corpus={"source": str(text_corpus)})
    store = Store(str(tmp_path / "c"))
    prepare(store, cfg)
    assert Driver(store, cfg, [SEED_JOB], show_progress=False).run() == {"seed": "finished"}
    assert set(Driver(store, cfg, expert_jobs(cfg.n_experts), show_progress=False).run().values()) == {"finished"}
    totals = Ledger(store).totals()
    want = totals.gpu_seconds["expert_training"] / 3600
    deadline, got = time.monotonic() + 60, {}
    while time.monotonic() < deadline:  # the metrics agent exports what the driver set within a few intervals
        got = scrape(ray_with_metrics)
        v = value(got, "ray_soma_gpu_hours", campaign_name="metrics-test", category="expert_training")
        if v is not None and abs(v - want) <= 1e-9 + 1e-6 * want and value(got, "ray_soma_jobs", state="finished") == 3:
            break
        time.sleep(1.0)
    assert (
        abs(value(got, "ray_soma_gpu_hours", campaign_name="metrics-test", category="expert_training") - want)
        <= 1e-6 * want
    ), got
    assert abs(value(got, "ray_soma_gpu_hours", category="seed") - totals.gpu_seconds["seed"] / 3600) <= 1e-6 * want
    assert value(got, "ray_soma_jobs", state="finished") == 3 and value(got, "ray_soma_jobs", state="running") == 0
    assert value(got, "ray_soma_job_step", soma_job="expert-0001") == cfg.train.updates
    assert value(got, "ray_soma_expert_val_loss", soma_job="expert-0000") > 0
    assert value(got, "ray_soma_eta_seconds") is not None
    assert os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") == "0"  # loopback only
