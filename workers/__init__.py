"""Ray actors. `workers` imports `soma_cluster`; nothing here imports `pipelines`."""

from __future__ import annotations

import ray
from ray.util.scheduling_strategies import NodeLabelSchedulingStrategy, NotIn

from soma_cluster.messages import Incarnation
from workers.expert_worker import ExpertWorker

RemoteExpertWorker = ray.remote(ExpertWorker)


NAMESPACE = "soma"
# resources.placement -> Ray's scheduling_strategy. "DEFAULT" packs actors onto nodes that already hold
# work (fewer nodes busy, so idle nodes can be scaled away); "SPREAD" places them across nodes in turn.
SCHEDULING = {"pack": "DEFAULT", "spread": "SPREAD"}
NODE_ID_LABEL = "ray.io/node-id"  # the label Ray 2.60 gives every node: its node id


def avoiding(nodes: frozenset[str]) -> NodeLabelSchedulingStrategy | None:
    """Ray's soft preference for any node but `nodes` (node ids; soma_cluster/avoidance.py decides which), or None.
    Soft: among the nodes that have room now, Ray takes one that is not listed; if only listed ones have room, one
    of them. It replaces resources.placement for that actor."""
    if not nodes:
        return None
    return NodeLabelSchedulingStrategy({}, soft={NODE_ID_LABEL: NotIn(*sorted(nodes))})


def actor_name(campaign_id: str, job: str, attempt: int) -> str:
    return f"{campaign_id}/{job}/{attempt}"


def start_worker(
    *,
    campaign_url: str,
    storage_options: dict,
    experts: list[int | None],
    attempts: list[int],
    num_gpus: float,
    num_cpus: float,
    name: str | None = None,
    placement: str = "pack",
    requested_at: float | None = None,
    granted: bool = False,
    previous: tuple[Incarnation, ...] = (),
    lease_generation: int | None = None,
    avoid_nodes: frozenset[str] = frozenset(),
):
    """One actor per job (or per pack of experts): its own GPU share, an explicit CPU share (Ray defaults to
    1 CPU), no restarts (the driver owns retries, from the checkpoint). `requested_at` (wall clock) and
    `granted` (the GPUs present had room for it then) tell the actor when it began holding its share;
    `previous` are killed processes of the same jobs it must outlive on its node. `name` lets operators
    (and tests) find it. `lease_generation`: the starting driver's lease (soma_cluster/lease.py); the actor writes
    nothing once another driver holds the campaign. `avoid_nodes`: nodes it should rather not be placed on."""
    return RemoteExpertWorker.options(
        num_gpus=num_gpus,
        num_cpus=num_cpus,
        max_restarts=0,
        max_task_retries=0,
        scheduling_strategy=avoiding(avoid_nodes) or SCHEDULING[placement],
        name=name,
        namespace=NAMESPACE if name else None,
    ).remote(
        campaign_url=campaign_url,
        storage_options=storage_options,
        experts=experts,
        attempts=attempts,
        num_gpus=num_gpus,
        requested_at=requested_at,
        granted=granted,
        previous=previous,
        lease_generation=lease_generation,
    )


__all__ = ["NAMESPACE", "SCHEDULING", "avoiding", "ExpertWorker", "RemoteExpertWorker", "actor_name", "start_worker"]
