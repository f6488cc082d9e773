"""Autoscaling on one machine: Ray's fake multi-node provider behind a head this test starts (no GPU, a GPU
worker type with min_workers 0). The driver's queued expert actors are the demand the autoscaler sees:
it adds worker nodes, the experts spread over them and finish, and the nodes go away when idle. Nodes that
join a fixed cluster mid-campaign (`cluster_utils.Cluster.add_node`) are used at once."""

from __future__ import annotations

import threading
import time

import pytest
import ray
import yaml
from conftest import micro_config
from support.rayhead import RayHead

from pipelines.campaign import Driver, expert_jobs
from pipelines.prepare import prepare
from soma_cluster.events import history
from soma_cluster.jobs import SEED_JOB
from soma_cluster.storage import Store

GPUS_PER_NODE, MAX_NODES = 2, 3


def fake_cluster_config(gcs: str) -> dict:
    """What `ray start --autoscaling-config` needs for the fake provider (the wheel does not ship its example)."""
    return {
        "cluster_name": "soma-fake",
        "max_workers": MAX_NODES,
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": 0.1,
        "provider": {
            "type": "fake_multinode",
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
            "gcs_address": gcs,
        },
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": 1, "GPU": 0}, "node_config": {}, "max_workers": 0},
            "gpu_worker": {
                "resources": {"CPU": 2, "GPU": GPUS_PER_NODE},
                "node_config": {},
                "min_workers": 0,
                "max_workers": MAX_NODES,
            },
        },
        "head_node_type": "ray.head.default",
        "auth": {},
        "docker": {},
        "file_mounts": {},
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "rsync_exclude": [],
        "rsync_filter": [],
        "initialization_commands": [],
        "setup_commands": [],
        "head_setup_commands": [],
        "worker_setup_commands": [],
        "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
    }


class Timeline:
    """Alive worker nodes (and their GPUs) every 0.5 s, from the driver's side."""

    def __init__(self):
        self.t0, self.points, self.stop = time.monotonic(), [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(0.5):
            nodes = {n["NodeID"]: n["Resources"].get("GPU", 0.0) for n in ray.nodes() if n["Alive"]}
            workers = {k: g for k, g in nodes.items() if g > 0}
            if not self.points or self.points[-1][1] != len(workers):
                self.points.append((round(time.monotonic() - self.t0, 1), len(workers), sum(workers.values())))

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(timeout=10)


def started_nodes(store: Store, names: list[str]) -> dict[str, str]:
    hist = history(store)
    return {n: [e for e in hist[n].events if e["event"] == "started"][-1]["node"] for n in names}


def test_autoscaler_adds_nodes_for_queued_experts_and_removes_them_when_idle(tmp_path, text_corpus):
    cfg = micro_config(
        n_experts=8,
        corpus={"source": str(text_corpus)},
        resources={"num_gpus": 1.0, "num_cpus": 0.0},
        shards={"val_fraction": 0.05},
    )  # 8 shards of a 1.5 MB corpus: every one keeps a val row
    store = Store(str(tmp_path / "camp"))
    prepare(store, cfg)
    path = tmp_path / "autoscale.yaml"
    env = {"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1", "RAY_AUTH_MODE": "disabled"}
    head = RayHead(env, ("--num-cpus=1", "--num-gpus=0", f"--autoscaling-config={path}"))
    path.write_text(yaml.safe_dump(fake_cluster_config(head.address)))
    with head:
        ray.init(address=head.address, logging_level="WARNING")
        try:
            assert ray.cluster_resources().get("GPU", 0) == 0  # no GPU anywhere at the start
            with Timeline() as timeline:
                assert Driver(store, cfg, [SEED_JOB], show_progress=False).run() == {"seed": "finished"}
                outcome = Driver(store, cfg, expert_jobs(cfg.n_experts), show_progress=False).run()
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline and timeline.points[-1][1] > 0:  # bounded: idle nodes go away
                    time.sleep(1)
            head_id = ray.get_runtime_context().get_node_id()
        finally:
            ray.shutdown()
    names = [j.name for j in expert_jobs(cfg.n_experts)]
    nodes = started_nodes(store, names)
    per_node = {n: sorted(k for k, v in nodes.items() if v == n) for n in set(nodes.values())}
    print(f"\nautoscaling timeline (s, worker nodes, GPUs): {timeline.points}")
    print(
        "experts per node: "
        + "; ".join(f"{n[-6:]}: {len(v)} ({', '.join(x[-2:] for x in v)})" for n, v in per_node.items())
    )
    assert outcome == dict.fromkeys(names, "finished")
    assert max(p[1] for p in timeline.points) >= 2  # the autoscaler added worker nodes
    assert len(per_node) >= 2 and head_id not in per_node  # experts spread over them, none on the head
    assert timeline.points[-1][1] == 0  # and removed them when idle


@pytest.fixture
def small_cluster():
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0, "include_dashboard": False})
    first = c.add_node(num_cpus=1, num_gpus=1)
    ray.init(address=c.address, logging_level="WARNING")
    c.wait_for_nodes(timeout=60)
    yield c, first
    ray.shutdown()
    c.shutdown()


# With SOMA_SLOW=1 (28 s): the autoscaler test above already has queued experts start on nodes that join mid-campaign;
# this one adds the node by hand to a fixed cluster and stops the experts by budget
@pytest.mark.slow
def test_a_node_that_joins_mid_campaign_is_used_at_once(small_cluster, tmp_path, text_corpus):
    c, first = small_cluster
    # experts train until a 15 GPU-s budget stops them: the first one long enough for a node to join meanwhile
    cfg = micro_config(
        n_experts=3,
        corpus={"source": str(text_corpus)},
        train={"updates": 100_000, "chunk_updates": 3},
        budget={"expert_gpu_hours": 15 / 3600, "grace_gpu_seconds": 5.0},
    )
    store = Store(str(tmp_path / "camp"))
    prepare(store, cfg)
    assert Driver(store, cfg, [SEED_JOB], show_progress=False).run() == {"seed": "finished"}
    result = {}
    t = threading.Thread(
        target=lambda: result.update(Driver(store, cfg, expert_jobs(cfg.n_experts), show_progress=False).run()),
        daemon=True,
    )
    t.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not [
        e for e in store.read_log("events.jsonl") if e["event"] == "started" and e["job"] != "seed"
    ]:
        time.sleep(0.2)  # bounded: one expert runs on the one GPU
    joined = c.add_node(num_cpus=1, num_gpus=2)
    t.join(timeout=300)
    assert not t.is_alive() and set(result.values()) == {"budget_exhausted"}
    names = [j.name for j in expert_jobs(cfg.n_experts)]
    nodes = started_nodes(store, names)
    hist = history(store)
    on_first = [n for n in names if nodes[n] == first.node_id]
    on_new = [n for n in names if nodes[n] == joined.node_id]
    assert len(on_first) == 1 and len(on_new) == 2, nodes
    first_end = hist[on_first[0]].events[-1]["t"]
    # the queued experts started on the new node while the first still trained: they did not wait for its GPU
    assert all([e for e in hist[n].events if e["event"] == "started"][0]["t"] < first_end for n in on_new)
