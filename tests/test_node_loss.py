"""Node loss on a real multi-node Ray (ray.cluster_utils.Cluster): the experts on the removed node
are retried elsewhere from their checkpoints, without spending a retry (a dead node is the
infrastructure's failure), and end bitwise identical to an undisturbed run."""

from __future__ import annotations

import shutil
import threading
from functools import partial

import pytest
import torch
from conftest import micro_config
from test_chaos import CHAOS, events, wait_for

from pipelines.campaign import Driver, Job, expert_jobs
from pipelines.prepare import prepare
from soma_cluster.checkpoint import load_checkpoint
from soma_cluster.events import history
from soma_cluster.storage import Store


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0})
    nodes = [c.add_node(num_cpus=1, num_gpus=1) for _ in range(2)]
    ray.init(address=c.address, log_to_driver=False, logging_level="WARNING")
    c.wait_for_nodes()
    yield c, nodes
    ray.shutdown()
    c.shutdown()


def test_metrics_holder_lives_on_the_head_wherever_the_driver_runs(cluster):
    """A driver on a worker node opens the campaign's metrics holder: it is placed on the head (a worker's loss
    would take the campaign's last metrics with it), and a driver on the head finds that same holder."""
    import ray
    from ray._private.state import actors
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from soma_cluster.metricpoints import campaign_labels
    from workers.metrics_holder import open_holder

    alive = [n for n in ray.nodes() if n["Alive"]]
    head = next(n["NodeID"] for n in alive if "node:__internal_head__" in n["Resources"])
    worker = next(n["NodeID"] for n in alive if n["NodeID"] != head)
    # four campaigns: Ray places an actor that asks for nothing on any node, so one holder on the head may be luck
    campaigns = [campaign_labels(f"/tmp/soma-holder-placement-{i}", "micro", "c0ffee") for i in range(4)]

    @ray.remote(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(worker, soft=False))
    def driver_on_a_worker(campaigns):
        holders = [open_holder(labels) for labels in campaigns]
        ray.get([h.hold_for.remote(60.0) for h in holders])  # each removes itself a minute after this test
        return ray.get_runtime_context().get_node_id(), holders

    here, holders = ray.get(driver_on_a_worker.remote(campaigns))
    try:
        assert here == worker
        assert [actors(actor_id=h._actor_id.hex())["Address"]["NodeID"] for h in holders] == [head] * len(holders)
        assert open_holder(campaigns[0])._actor_id == holders[0]._actor_id  # the next driver, on the head, finds it
    finally:
        for h in holders:
            ray.kill(h)


def test_node_removal_retries_its_experts_bitwise(cluster, tmp_path, text_corpus):
    import ray

    c, nodes = cluster
    cfg = micro_config(corpus={"source": str(text_corpus)}, **{k: dict(v) for k, v in CHAOS.items()})
    ref = Store(str(tmp_path / "ref"))
    prepare(ref, cfg)
    assert Driver(ref, cfg, [Job(None)], show_progress=False).run() == {"seed": "finished"}
    shutil.copytree(tmp_path / "ref", tmp_path / "hit")
    assert set(Driver(ref, cfg, expert_jobs(cfg.n_experts), show_progress=False).run().values()) == {"finished"}

    hit = Store(str(tmp_path / "hit"))
    result = {}
    t = threading.Thread(
        target=lambda: result.update(Driver(hit, cfg, expert_jobs(cfg.n_experts), show_progress=False).run()),
        daemon=True,
    )
    t.start()
    for e in range(cfg.n_experts):
        wait_for(partial(events, hit, f"expert-{e:04d}", "checkpointed"), what=f"expert {e} checkpoint")
    c.remove_node(nodes[0])  # one GPU node gone, with whatever ran on it
    t.join(timeout=300)
    assert not t.is_alive()
    assert result == {"expert-0000": "finished", "expert-0001": "finished"}
    failed = events(hit, kind="failed")
    # a dead node is the infrastructure's failure: recorded, settled, retried, but none of the expert's retries
    assert len(failed) == 1 and failed[0]["reason"].startswith("node_lost") and failed[0]["cause"] == "node_lost"
    assert failed[0]["counted"] is False and history(hit)[failed[0]["job"]].failures == 0
    assert ray.cluster_resources().get("GPU") == 1.0
    for e in range(cfg.n_experts):
        a = load_checkpoint(hit, f"experts/expert-{e:04d}").tensors
        b = load_checkpoint(ref, f"experts/expert-{e:04d}").tensors
        assert all(torch.equal(a[k], b[k]) for k in a)
