"""A retry steered away from a node that cannot reach the store, on a real multi-node Ray
(ray.cluster_utils.Cluster): two worker nodes of one logical GPU each; every actor set-up on one of them fails as
if its store were unreachable (SOMA_TEST_STORE_UNREACHABLE in that node's environment). The expert's first attempt
is made to land there (the other node's GPU held by a placeholder until that attempt has failed, which frees it
seconds before the retry is started); its retry, asked to prefer other nodes, lands on the other one and finishes,
nothing counted against it."""

from __future__ import annotations

import time

import pytest
from conftest import micro_config

from pipelines.campaign import Driver
from pipelines.prepare import prepare
from soma_cluster.events import history
from soma_cluster.jobs import SEED_JOB, Job
from soma_cluster.storage import Store
from workers.expert_worker import UNREACHABLE_ENV


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray.cluster_utils import Cluster

    t0 = time.monotonic()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0})
    cut = c.add_node(num_cpus=1, num_gpus=1, env_vars={UNREACHABLE_ENV: "1"})  # its set-ups fail: store unreachable
    fine = c.add_node(num_cpus=1, num_gpus=1)
    ray.init(address=c.address, log_to_driver=False, logging_level="WARNING")
    c.wait_for_nodes()
    print(f"\ncluster up in {time.monotonic() - t0:.1f} s")
    yield c, cut.node_id, fine.node_id
    ray.shutdown()
    c.shutdown()


def _holding(node: str):
    """A placeholder actor holding `node`'s GPU."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_gpus=1, num_cpus=0)
    class Placeholder:
        def where(self) -> str:
            return ray.get_runtime_context().get_node_id()

    p = Placeholder.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
    assert ray.get(p.where.remote(), timeout=60) == node
    return p


def test_retry_after_storage_unreachable_lands_on_the_other_node(cluster, tmp_path, text_corpus):
    import ray

    _, cut, fine = cluster
    # the first retry waits 2-4 s (backoff_s 4, half of it jitter): the placeholder is gone by then
    cfg = micro_config(corpus={"source": str(text_corpus)}, retry={"backoff_s": 4.0, "infra_wait_s": 120})
    store = Store(str(tmp_path / "c"))
    t0 = time.monotonic()
    prepare(store, cfg)
    held = _holding(cut)  # the seed trains on the node that reaches the store
    assert Driver(store, cfg, [SEED_JOB], show_progress=False).run() == {"seed": "finished"}
    ray.kill(held)
    print(f"prepared and seeded in {time.monotonic() - t0:.1f} s")

    held = _holding(fine)  # expert-0000's first attempt can only be placed on the cut node
    driver = Driver(store, cfg, [Job(0)], show_progress=False)
    observe = driver.sched.observe
    freed: list[float] = []

    def watch(rec: dict) -> None:
        observe(rec)
        if rec["event"] == "failed" and not freed:  # the first attempt failed there: free the other node now
            ray.kill(held)
            freed.append(time.monotonic())

    driver.sched.observe = watch
    t1 = time.monotonic()
    assert driver.run() == {"expert-0000": "finished"}
    print(f"expert trained in {time.monotonic() - t1:.1f} s")
    assert freed

    events = history(store)["expert-0000"].events
    failed = [e for e in events if e["event"] == "failed"]
    starts = [e for e in events if e["event"] == "started"]
    asked = [e for e in events if e["event"] == "queued"]
    print(f"failed on {[e.get('node', '?')[:8] for e in failed]}, started on {[e['node'][:8] for e in starts]}")
    assert len(failed) == 1 and failed[0]["cause"] == "storage_unreachable" and failed[0]["counted"] is False
    assert failed[0]["node"] == cut
    assert asked[-1]["avoid"] == [cut] and asked[-1]["attempt"] == 1
    assert [e["node"] for e in starts] == [fine]
    assert history(store)["expert-0000"].failures == 0
