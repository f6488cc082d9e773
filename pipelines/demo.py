"""`soma demo`: a whole campaign in one command, prepare -> seed -> launch -> eval, under one lease."""

from __future__ import annotations

from pipelines.campaign import launch
from pipelines.campaign_lease import hold
from pipelines.common import claim_campaign
from pipelines.evaluate import evaluate
from pipelines.prepare import check_prepare, prepare
from pipelines.rayaddress import Address
from pipelines.raysession import ray_session
from pipelines.seed import train_seed
from soma_cluster.config import CampaignConfig
from soma_cluster.storage import Store


def demo(store: Store, cfg: CampaignConfig, addr: Address, take_over: bool) -> dict:
    """Every stage of a campaign on `cfg`, on the Ray at `addr` (a local one when none); the evaluation's metrics."""
    claim_campaign(store, cfg, write=False)  # another campaign's (or anyone's) directory: before the lease
    check_prepare(store, cfg)
    with hold(store, "soma demo", take_over):
        prepare(store, cfg, addr.text or None)
        with ray_session(cfg, addr):
            train_seed(store, cfg)
            launch(store, cfg)
        return evaluate(store, cfg)
