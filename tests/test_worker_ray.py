"""An ExpertWorker actor on a real local Ray (4 logical GPUs) trains, checkpoints and reports GPU-seconds."""

import time

import pytest
import torch
from conftest import micro_config

from pipelines.campaign import Driver, Job
from pipelines.common import claim_campaign
from pipelines.prepare import prepare
from soma_cluster.checkpoint import load_checkpoint
from soma_cluster.events import history
from soma_cluster.ledger import Ledger
from soma_cluster.storage import Store
from workers import start_worker


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, text_corpus):
    cfg = micro_config(corpus={"source": str(text_corpus)})
    store = Store(str(tmp_path_factory.mktemp("camp") / "c"))
    prepare(store, cfg)
    return store, cfg


def test_actor_trains_checkpoints_and_reports_gpu_seconds(ray_local, prepared):
    store, cfg = prepared
    t0_wall = time.time()
    actor = start_worker(
        campaign_url=store.url,
        storage_options={},
        experts=[None],
        attempts=[0],
        num_gpus=0.5,
        num_cpus=0.0,
        requested_at=time.time(),
    )
    report = ray_local.get(actor.setup.remote(), timeout=120)
    info = report.experts[None]
    assert info.step == 0 and not info.resumed and info.n_train > 0
    assert (
        report.device == "cpu" and report.held_from >= t0_wall
    )  # not granted at the request: held from its first instruction
    beats = []
    for _ in range(10):  # bounded: 6 updates in chunks of <= 3
        beats.append(ray_local.get(actor.run_chunk.remote(3), timeout=120).experts[None])
        if beats[-1].done:
            break
    assert [b.updates for b in beats] == [1, 3, 2]  # the first chunk measures one update
    wall = time.time() - report.held_from
    ray_local.kill(actor)
    assert beats[-1].done and beats[-1].step == cfg.seed_stage.updates
    assert beats[-1].checkpoint == "step-000006"
    gpu_s = beats[-1].usage.gpu_seconds
    assert 0 < gpu_s <= wall * 0.5 + 1e-6  # half a GPU held, never more than wall x 0.5
    assert gpu_s == pytest.approx(beats[-1].usage.wall_seconds * 0.5)
    assert beats[-1].usage.forwards == cfg.seed_stage.updates * (2 * cfg.spsa.n_pert + 1)
    ck = load_checkpoint(store, "seed")
    assert ck.meta["state"]["step"] == 6 and set(ck.tensors) >= {"body", "head", "body_m", "body_v", "head_m", "head_v"}
    assert torch.isfinite(ck.tensors["body"]).all()


def test_driver_runs_seed_and_experts_and_ledger_adds_up(ray_local, prepared):
    store, cfg = prepared
    assert Driver(store, cfg, [Job(None)], show_progress=False).run() == {"seed": "finished"}
    jobs = [Job(e) for e in range(cfg.n_experts)]
    outcome = Driver(store, cfg, jobs, show_progress=False).run()
    assert outcome == {"expert-0000": "finished", "expert-0001": "finished"}
    hist = history(store)
    assert all(hist[j.name].step == cfg.train.updates for j in jobs)
    totals = Ledger(store).totals()
    per_update = 2 * cfg.spsa.n_pert
    assert totals.forwards["expert_training"] == cfg.n_experts * cfg.train.updates * per_update
    assert totals.gpu_seconds["expert_training"] > 0 and totals.gpu_seconds["wasted"] == 0
    # a second run finds everything ended and retrains nothing
    before = len(Ledger(store).records())
    assert Driver(store, cfg, jobs, show_progress=False).run() == outcome
    assert len(Ledger(store).records()) == before
    # experts started from the seed body and moved away from it
    seed = load_checkpoint(store, "seed").tensors["body"]
    for e in range(cfg.n_experts):
        body = load_checkpoint(store, f"experts/expert-{e:04d}").tensors["body"]
        assert not torch.equal(body, seed)
        assert (body - seed).abs().max() < 0.1


def test_claim_refuses_a_different_campaign(prepared):
    store, cfg = prepared
    other = cfg.model_copy(update={"n_experts": 3})
    from soma_cluster.errors import SomaError

    with pytest.raises(SomaError, match="different campaign"):
        claim_campaign(store, other)
