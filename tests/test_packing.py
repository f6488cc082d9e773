"""G experts packed into one actor (resources.experts_per_actor) on a real local Ray: the same per-expert
accounting, checkpoints and retries as one actor per expert; a failure of one packed expert leaves the
other untouched, and an actor killed mid-pack is retried bitwise."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from test_chaos import clone, config, events, final_tensors, run_in_thread, wait_for

from pipelines.campaign import Driver, Job, expert_jobs
from pipelines.prepare import prepare
from soma_cluster.checkpoint import load_checkpoint, save_checkpoint
from soma_cluster.ledger import Ledger
from soma_cluster.storage import Store

N = 4


def packed(pack: int, resources: dict | None = None, **extra):
    return config(
        n_experts=N,
        resources={"experts_per_actor": pack, "num_gpus": 1.0, "num_cpus": 0.0, **(resources or {})},
        **extra,
    )


@pytest.fixture(scope="module")
def seeded4(tmp_path_factory, text_corpus, ray_local):
    root = tmp_path_factory.mktemp("seeded4") / "c"
    cfg = packed(2, corpus={"source": str(text_corpus)})
    store = Store(str(root))
    prepare(store, cfg)
    assert Driver(store, cfg, [Job(None)], show_progress=False).run() == {"seed": "finished"}
    return root, cfg


@pytest.fixture(scope="module")
def packed_reference(seeded4, tmp_path_factory, ray_local):
    store, cfg = clone(seeded4, tmp_path_factory.mktemp("pref") / "c")
    assert set(Driver(store, cfg, expert_jobs(cfg.n_experts), show_progress=False).run().values()) == {"finished"}
    return store, cfg


def test_packed_campaign_accounts_per_expert_and_matches_unpacked(seeded4, packed_reference, tmp_path, ray_local):
    store, cfg = packed_reference
    actors = {e["actor"] for e in events(store, kind="launched") if e["job"] != "seed"}
    assert actors == {"expert-0000+1", "expert-0002+1"}  # two actors, two experts each
    assert {e["num_gpus"] for e in events(store, kind="launched") if e["job"] != "seed"} == {0.5}
    totals = Ledger(store).totals()
    assert totals.forwards["expert_training"] == N * cfg.train.updates * 2 * cfg.spsa.n_pert
    per = totals.per_expert_gpu_seconds
    assert all(per[e] > 0 for e in range(N)) and totals.gpu_seconds["wasted"] == 0
    # the pair's time is split evenly while both train (they stop together here)
    assert per[0] == pytest.approx(per[1], rel=1e-6) and per[2] == pytest.approx(per[3], rel=1e-6)
    # one actor per expert, same seeds: the same result up to float reassociation in the shared passes
    single, one = clone(seeded4, tmp_path / "single", packed(1, corpus={"source": cfg.corpus.source}))
    assert set(Driver(single, one, expert_jobs(one.n_experts), show_progress=False).run().values()) == {"finished"}
    for e in range(N):
        a, b = final_tensors(store, e)["body"], final_tensors(single, e)["body"]
        assert torch.allclose(a, b, atol=1e-4), (e, (a - b).abs().max())


def test_killed_pack_is_retried_bitwise(seeded4, packed_reference, tmp_path, ray_local):
    ref, _ = packed_reference
    store, cfg = clone(seeded4, tmp_path / "c")
    thread, result = run_in_thread(store, cfg)
    wait_for(lambda: [x for x in events(store, "expert-0000", "checkpointed") if x["attempt"] == 0], what="checkpoint")
    os.kill(events(store, "expert-0000", "started")[0]["pid"], signal.SIGKILL)
    thread.join(timeout=300)
    assert not thread.is_alive() and set(result.values()) == {"finished"}
    for job in ("expert-0000", "expert-0001"):  # both packed experts failed and came back
        failed = events(store, job, "failed")
        assert len(failed) == 1 and failed[0]["reason"].startswith("actor_died")
        assert events(store, job, "started")[-1]["resumed"] is True
    assert not events(store, "expert-0002", "failed") and not events(store, "expert-0003", "failed")
    for e in range(N):
        a, b = final_tensors(store, e), final_tensors(ref, e)
        for k in a:
            assert torch.equal(a[k], b[k]), (e, k)


def test_nan_expert_in_a_pack_fails_alone(seeded4, tmp_path, ray_local):
    store, cfg = clone(seeded4, tmp_path / "c")
    state = load_checkpoint(store, "seed").state(torch.device("cpu"))
    state.body.fill_(float("nan"))
    save_checkpoint(store, "experts/expert-0001", state)
    result = Driver(store, cfg, expert_jobs(cfg.n_experts), show_progress=False).run()
    assert result == {
        "expert-0000": "finished",
        "expert-0001": "failed_permanently",
        "expert-0002": "finished",
        "expert-0003": "finished",
    }
    failed = events(store, "expert-0001", "failed")
    assert len(failed) == cfg.retry.max_retries + 1 and all("NonFiniteLoss" in f["reason"] for f in failed)
    assert not events(store, "expert-0000", "failed")  # its pack-mate trained on, untouched
    assert len(events(store, "expert-0000", "launched")) == 1
    assert load_checkpoint(store, "experts/expert-0000").meta["state"]["step"] == cfg.train.updates


def test_reused_actor_takes_the_next_pack_and_accounts_every_second(seeded4, packed_reference, tmp_path, ray_local):
    ref, base = packed_reference
    one_slot = packed(2, corpus={"source": base.corpus.source}, resources={"num_gpus": 4.0, "reuse_actors": True})
    store, cfg = clone(seeded4, tmp_path / "c", one_slot)
    assert set(Driver(store, cfg, expert_jobs(cfg.n_experts), show_progress=False).run().values()) == {"finished"}
    launched = [e for e in events(store, kind="launched")]
    assert [e["reused"] for e in launched if e["job"] != "seed"] == [False, False, True, True]
    assert (
        len({e["pid"] for e in events(store, kind="started") if e["job"] != "seed"}) == 1
    )  # one process did both packs
    for e in range(N):  # same probes, data and pack composition: the same bits
        a, b = final_tensors(store, e), final_tensors(ref, e)
        for k in a:
            assert torch.equal(a[k], b[k]), (e, k)
    # the experts' GPU-seconds add up to the actor's lifetime x 4 GPUs (nothing between the packs is lost)
    totals = Ledger(store).totals()
    start = min(e["t"] for e in launched if e["job"] != "seed")
    end = max(e["t"] for e in events(store, kind="finished") if e["job"] != "seed")
    spent = sum(totals.per_expert_gpu_seconds[e] for e in range(N))
    # (the events' timestamps are taken a moment after the clocks they bracket: a few ms of slack)
    assert spent <= (end - start + 0.02) * 4.0
    assert spent >= (end - start) * 4.0 * 0.8  # the actor start is counted as held, too
