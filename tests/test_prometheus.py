"""What an operator's real clients see: a Ray head with token auth, its dashboard and a metrics export port; the
driver submitted as a Ray Job with Ray's own `ray job submit`, RAY_ADDRESS set to the http address as
docs/cluster.md says; a real Prometheus (Debian's package) scraping Ray through Ray's service-discovery file.
Every PromQL expression of deploy/grafana-dashboard.json is run against it: legends resolve to what they name,
values equal `soma status --json`, and a campaign with a failed expert still shows it after its driver has gone.
All on 127.0.0.1; the head, Prometheus and their files are this test's own and are stopped by pid."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from conftest import micro_config
from support.promserver import BINARY, SKIP_REASON, Prometheus
from support.rayhead import RayHead, free_port

from pipelines.prepare import prepare
from soma_cluster.storage import Store

pytestmark = pytest.mark.skipif(BINARY is None, reason=SKIP_REASON)
for mod in ("aiohttp_cors", "opencensus", "prometheus_client"):
    pytest.importorskip(mod, reason="Ray's metrics agent needs ray[default] (pip install '.[metrics]')")

ROOT = Path(__file__).resolve().parents[1]
# past the time Ray drops a dead process's metrics: Ray 2.60's OpenTelemetry recorder keeps a gauge for twice the
# report interval (20 s by default; 2 s on this module's head, RAY_metrics_report_interval_ms=1000), then a scrape
GONE_S = 10


def dashboard_queries() -> list[tuple[str, str, str]]:
    """(panel title, PromQL, legend) of every target of the Grafana dashboard, $campaign left for the caller."""
    board = json.loads((ROOT / "deploy" / "grafana-dashboard.json").read_text())
    return [(p["title"], t["expr"], t.get("legendFormat", "")) for p in board["panels"] for t in p.get("targets", [])]


@pytest.fixture(scope="module")
def cluster():
    token, dport, mport = uuid.uuid4().hex, free_port(), free_port()
    env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token, "RAY_metrics_report_interval_ms": "1000"}
    args = (
        "--num-cpus=2",
        "--num-gpus=2",
        "--include-dashboard=true",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dport}",
        f"--metrics-export-port={mport}",
    )
    with RayHead(env, args) as head:
        sd = Path(head.root) / "ray" / "session_latest" / "prom_metrics_service_discovery.json"
        deadline = time.monotonic() + 60
        while not sd.exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert sd.exists(), f"Ray wrote no service-discovery file at {sd}"
        with Prometheus(str(sd)) as prom:
            yield head, prom, token, f"http://127.0.0.1:{dport}"


def submit(http: str, token: str, entrypoint: str) -> subprocess.CompletedProcess:
    """`ray job submit` (Ray's own Jobs client) with the token and RAY_ADDRESS=http://..., as docs/cluster.md."""
    ray = os.path.join(os.path.dirname(sys.executable), "ray")
    env = {**os.environ, "RAY_ADDRESS": http, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}
    argv = [ray, "job", "submit", "--", "bash", "-c", entrypoint]  # Ray quotes each word: one shell runs the chain
    for _ in range(30):  # bounded: a new head's job agent takes a few seconds to register
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
        if "No available agent" not in proc.stdout + proc.stderr:
            return proc
        time.sleep(2)
    raise AssertionError(f"the head's job agent never came up: {proc.stderr[-2000:]}")


def status_json(camp: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "pipelines.cli", "status", camp, "--json"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def test_the_dashboard_sees_the_campaign_as_status_does_and_keeps_it_after_the_driver(cluster, tmp_path, text_corpus):
    head, prom, token, http = cluster
    camp = str(tmp_path / "camp")
    cfg = micro_config(corpus={"source": str(text_corpus)}, retry={"max_retries": 0})
    prepare(Store(camp), cfg)
    cli = f"{sys.executable} -m pipelines.cli"
    seed = submit(http, token, f"{cli} seed {camp} --no-progress")
    assert seed.returncode == 0 and "succeeded" in seed.stdout + seed.stderr, seed.stderr[-3000:]
    manifest = Path(camp) / "shards" / "expert-0001" / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"rows"', '"rows "', 1))  # expert-0001's shard is corrupt
    job = submit(http, token, f"{cli} launch {camp} --no-progress")
    ended = time.monotonic()
    said = job.stdout + job.stderr
    assert job.returncode != 0 and re.search(r"failed|FAILED", said), said[-4000:]
    status = status_json(camp)
    assert status["counts"].get("failed_permanently") == 1, (status["counts"], (job.stdout + job.stderr)[-4000:])
    sel = re.escape(camp).replace("\\", "\\\\")  # a regex, inside a PromQL string: backslashes doubled

    def run(expr: str) -> list[dict]:
        return prom.query(expr.replace("$campaign", sel))

    # the driver's last values reach Prometheus; then every dashboard query resolves
    prom.wait_for(f'ray_soma_campaign_ended{{campaign="{camp}"}}', lambda r: r and float(r[0]["value"][1]) == 1.0)
    results = {}
    for title, expr, legend in dashboard_queries():
        if ">= 0" in expr and "budget" in expr and all(r["budget_left_gpu_hours"] is None for r in status["jobs"]):
            assert not run(expr), title  # no job has a budget: the panel is empty, not a row of -1
            continue
        rows = prom.wait_for(expr.replace("$campaign", sel), bool, 30)  # a rate needs two scrapes
        for key in re.findall(r"\{\{(\w+)\}\}", legend):  # a legend names a label every series carries
            assert all(r["metric"].get(key) for r in rows), (title, key, rows)
            if key == "soma_job":
                assert {r["metric"][key] for r in rows} <= {"seed", "expert-0000", "expert-0001"}, rows
        results[title] = (legend, rows)
    by_state = {r["metric"]["state"]: float(r["value"][1]) for r in results["Jobs by state"][1]}
    assert {s: n for s, n in by_state.items() if n} == {s: float(n) for s, n in status["counts"].items()}
    by_cat = {r["metric"]["category"]: float(r["value"][1]) for r in results["GPU-hours by category"][1]}
    for cat, hours in status["gpu_hours"].items():
        assert by_cat[cat] == pytest.approx(hours, rel=1e-6, abs=1e-9), cat
    steps = {r["metric"]["soma_job"]: float(r["value"][1]) for r in results["Step per job"][1]}
    assert steps == {row["job"]: float(row["step"]) for row in status["jobs"]}
    assert float(results["Failed permanently"][1][0]["value"][1]) == 1.0
    assert float(results["ETA"][1][0]["value"][1]) == 0.0  # the campaign ended: not -1
    # soma's labels are not Prometheus's: the target's `job` stays the scrape job, nothing is renamed
    raw = run(f'ray_soma_job_step{{campaign="{camp}"}}')
    assert all(r["metric"]["job"] == "ray" and "exported_job" not in r["metric"] for r in raw), raw

    # the driver has gone: past the time Ray drops a dead process's metrics, the campaign is still there
    time.sleep(max(0.0, GONE_S - (time.monotonic() - ended)))
    failed = run('sum(ray_soma_jobs{campaign=~"$campaign",state="failed_permanently"})')
    assert failed and float(failed[0]["value"][1]) == 1.0, failed
    up = prom.wait_for(f'ray_soma_driver_up{{campaign="{camp}"}}', lambda r: r and float(r[0]["value"][1]) == 0.0)
    print(f"\n{len(results)} dashboard queries answered, as the dashboard reads them:")
    for title, (legend, rows) in results.items():
        shown = {re.sub(r"\{\{(\w+)\}\}", lambda m, r=r: r["metric"][m.group(1)], legend): r["value"][1] for r in rows}
        print(f"  {title}: {shown}")
    print(f"{GONE_S} s after the driver: failed permanently {failed[0]['value'][1]}, driver_up {up[0]['value'][1]}")
