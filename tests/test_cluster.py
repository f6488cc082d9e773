"""A campaign on a real multi-node Ray cluster (head + 2 GPU worker nodes, `ray.cluster_utils.Cluster`,
loopback only), driven through the same code path as `soma seed/launch --address`."""

import os
import shutil
import tempfile

import pytest
import ray
from conftest import micro_config
from ray.cluster_utils import Cluster
from typer.testing import CliRunner

from pipelines.cli import app
from pipelines.prepare import prepare
from pipelines.raysession import ray_session
from soma_cluster.events import history
from soma_cluster.storage import Store

GPUS_PER_NODE = 2


@pytest.fixture(scope="module")
def cluster():
    tmp = tempfile.mkdtemp(prefix="soma-ray-c-", dir="/tmp")
    os.makedirs(os.path.join(tmp, "ray"))
    # Cluster writes its address file under the default temp dir: keep that (and every session) in tmp
    old, os.environ["RAY_TMPDIR"] = os.environ.get("RAY_TMPDIR"), tmp
    try:
        c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0, "include_dashboard": False})
        workers = [c.add_node(num_cpus=1, num_gpus=GPUS_PER_NODE) for _ in range(2)]
        c.wait_for_nodes(timeout=60)
        yield c, {n.node_id for n in workers}
        c.shutdown()
    finally:
        os.environ.pop("RAY_TMPDIR") if old is None else os.environ.update(RAY_TMPDIR=old)
        shutil.rmtree(tmp, ignore_errors=True)


def test_ray_session_connects_to_the_cluster_instead_of_starting_ray(cluster):
    c, _ = cluster
    assert not ray.is_initialized()
    with ray_session(micro_config(), c.address):
        assert ray.get_runtime_context().gcs_address == c.address
        assert ray.cluster_resources().get("GPU") == 2 * GPUS_PER_NODE
        assert len([n for n in ray.nodes() if n["Alive"]]) == 3
    assert not ray.is_initialized()


def test_campaign_spreads_experts_over_worker_nodes(cluster, tmp_path, text_corpus):
    c, worker_ids = cluster
    cfg = micro_config(corpus={"source": str(text_corpus)}, resources={"num_gpus": 1.0, "placement": "spread"})
    store = Store(str(tmp_path / "camp"))
    prepare(store, cfg)
    runner = CliRunner()
    for cmd in ("seed", "launch"):
        res = runner.invoke(app, [cmd, store.url, "--address", c.address, "--no-progress"])
        assert res.exit_code == 0, (cmd, res.output, res.exception)
    hist = history(store)
    experts = [f"expert-{e:04d}" for e in range(cfg.n_experts)]
    assert all(hist[name].state == "finished" and hist[name].step == cfg.train.updates for name in experts)
    started = [ev for name in experts for ev in hist[name].events if ev["event"] == "started"]
    nodes = {ev["node"] for ev in started}
    # every actor ran on a GPU worker node of this cluster (no Ray of its own), and SPREAD used both
    assert nodes <= worker_ids and len(nodes) == 2, (nodes, worker_ids)
    assert len({ev["pid"] for ev in started}) == cfg.n_experts
