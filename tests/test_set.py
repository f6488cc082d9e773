"""soma set on a real local Ray: an extension trains on from the checkpoints and ends bitwise where a campaign given
the total from the start ends; a running driver obeys a lowered budget at the next chunk and a raised one lets the
stopped experts train on; the ledger stays exact; the commands' lines."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import assert_one_line_error, micro_config, soma

from pipelines.campaign import Driver, launch
from pipelines.prepare import prepare
from soma_cluster.checkpoint import load_checkpoint
from soma_cluster.config import to_yaml_text
from soma_cluster.events import history
from soma_cluster.jobs import Job, expert_jobs
from soma_cluster.ledger import Ledger
from soma_cluster.revisions import config_in_force, record
from soma_cluster.storage import Store

EXPERTS = 2


@pytest.fixture(scope="module")
def seeded(tmp_path_factory, text_corpus, ray_local):
    root = tmp_path_factory.mktemp("seeded") / "c"
    cfg = micro_config(corpus={"source": str(text_corpus)}, n_experts=EXPERTS)
    prepare(Store(str(root)), cfg)
    assert Driver(Store(str(root)), cfg, [Job(None)], show_progress=False).run() == {"seed": "finished"}
    return root, cfg


def clone(seeded, dest: Path, **sections) -> tuple[Store, object]:
    root, base = seeded
    shutil.copytree(root, dest)
    cfg = micro_config(corpus={"source": base.corpus.source}, n_experts=EXPERTS, **sections)
    (dest / "campaign.yaml").write_text(to_yaml_text(cfg))
    return Store(str(dest)), cfg


def finals(store: Store) -> dict[int, tuple[dict, dict]]:
    out = {}
    for e in range(EXPERTS):
        ck = load_checkpoint(store, f"experts/expert-{e:04d}")
        sched = {k: ck.meta["state"][k] for k in ("step", "eps", "lr", "best_val", "since_best")}
        out[e] = (ck.tensors, sched)
    return out


def test_an_extension_ends_bitwise_where_the_total_from_the_start_ends(seeded, tmp_path, ray_local):
    """5 updates (off the validation grid of 6), then train.updates=12, against 12 from the start."""
    whole, cfg = clone(seeded, tmp_path / "whole")
    assert launch(whole, cfg, show_progress=False) == dict.fromkeys(["expert-0000", "expert-0001"], "finished")
    ext, short = clone(seeded, tmp_path / "ext", train={"updates": 5})
    launch(ext, short, show_progress=False)
    assert {h.step for n, h in history(ext).items() if n != "seed"} == {5}
    rev = record(ext, short, ["train.updates=12"], driver_running=False)
    assert launch(ext, config_in_force(ext), show_progress=False) == dict.fromkeys(whole_names(), "finished")
    got, want = finals(ext), finals(whole)
    for e in range(EXPERTS):
        assert got[e][1] == want[e][1]  # step, the lr/eps schedule and its plateau counter
        for name, t in want[e][0].items():
            assert torch.equal(got[e][0][name], t), (e, name)
    events = ext.read_log("events.jsonl")
    revised = [ev for ev in events if ev["event"] == "config_revised"]
    assert [r["rev"] for r in revised] == [rev.rev] and revised[0]["set"] == {"train.updates": 12}
    reopened = [ev for ev in events if ev["event"] == "reopened"]
    assert {ev["job"] for ev in reopened} == set(whole_names()) and {ev["reason"] for ev in reopened} == {"extended"}
    a, b = Ledger(ext).totals(), Ledger(whole).totals()
    assert a.forwards["expert_training"] == b.forwards["expert_training"] and a.forwards.get("wasted", 0) == 0
    assert a.gpu_seconds.get("wasted", 0.0) == 0.0  # the extension's start-ups are training, not waste
    # a second resume applies nothing twice and reopens nothing
    launch(ext, config_in_force(ext), show_progress=False)
    assert len([ev for ev in ext.read_log("events.jsonl") if ev["event"] in ("config_revised", "reopened")]) == len(
        revised
    ) + len(reopened)


def whole_names() -> list[str]:
    return [j.name for j in expert_jobs(EXPERTS)]


def test_a_running_driver_obeys_soma_set(seeded, tmp_path):
    """A launch in its own process; soma set lowers the per-expert budget under what has been spent: the experts
    stop at their next chunk, budget_exhausted, with a checkpoint. Raising it again (no driver left) and soma resume
    trains them on to the end, from those checkpoints."""
    store, cfg = clone(seeded, tmp_path / "live", train={"updates": 600, "checkpoint_every": 30, "val_every": 30})
    camp = str(tmp_path / "live")
    env_cmd = [sys.executable, "-m", "pipelines.cli", "launch", camp, "--no-progress"]
    import os

    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.Popen(env_cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:  # until both experts have trained some updates
            steps = {n: h.step for n, h in history(store).items() if n.startswith("expert-")}
            if len(steps) == EXPERTS and min(steps.values()) >= 6:
                break
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.5)
        r = soma("set", camp, "budget.expert_gpu_hours=1e-7", "--wait", "60", "--json")
        assert r.returncode == 0, r.stderr[-2000:]
        doc = json.loads(r.stdout)
        assert doc["applied"] is True and doc["driver"].startswith("soma launch"), doc
        print(f"\nsoma set --wait: applied after {doc['applied_after_s']:.2f} s (APPLY_BOUND_S 1.5 s of loop time)")
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    past = history(store)
    stopped = {n: past[n] for n in whole_names()}
    assert {h.state for h in stopped.values()} == {"budget_exhausted"} and all(h.step < 600 for h in stopped.values())
    for n, h in stopped.items():  # each stopped with a checkpoint of its last update
        assert load_checkpoint(store, f"experts/{n}").meta["state"]["step"] == h.step
    assert "config revision 1 applied" in err
    status = json.loads(soma("status", camp, "--json").stdout)
    assert status["budget"]["expert_gpu_hours"] == 1e-7
    # raised while no driver runs: recorded, and the next resume trains them on from their checkpoints
    assert_one_line_error(soma("set", camp, "train.updates=600"), "train.updates already is as given")
    r = soma("set", camp, "budget.expert_gpu_hours=null")
    assert r.returncode == 0 and "soma resume" in r.stdout and "2 ended expert(s) will train on" in r.stdout, r.stdout
    r = soma("resume", camp, "--no-progress", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    past = history(store)
    assert {past[n].state for n in whole_names()} == {"finished"} and {past[n].step for n in whole_names()} == {600}
    totals = Ledger(store).totals()
    assert totals.forwards["expert_training"] == EXPERTS * 600 * 2 * cfg.spsa.n_pert  # exact after the changes
    assert_one_line_error(soma("set", camp, "model.d=64"), "model.d cannot change")


def test_retrain_chosen_experts_and_a_warm_fork(seeded, tmp_path, ray_local):
    """--retrain from a checkpoint ends where the first run ended (same recipe, bitwise) and keeps the old
    checkpoints and records; from the seed with a new lr it trains anew. A warm fork with train.updates=24 trains on
    from the parent's checkpoints and ends bitwise where a campaign given 24 from the start ends."""
    from pipelines.fork import fork
    from pipelines.reopen import reopen_retrain

    store, cfg = clone(seeded, tmp_path / "a")
    launch(store, cfg, show_progress=False)
    first = finals(store)
    before = Ledger(store).totals().forwards["expert_training"]
    launch(store, cfg, show_progress=False, retrain=["1"], from_step=6)
    again = finals(store)
    for name, t in first[1][0].items():
        assert torch.equal(again[1][0][name], t), name
    assert (tmp_path / "a" / "experts" / "expert-0001" / "retired-1" / "step-000012.safetensors").exists()
    per_update = 2 * cfg.spsa.n_pert
    assert Ledger(store).totals().forwards["expert_training"] == before + 6 * per_update  # what was spent stays
    retrain = [ev for ev in store.read_log("events.jsonl") if ev.get("reason") == "retrain"]
    assert [(ev["job"], ev["step"], ev["was"]) for ev in retrain] == [("expert-0001", 6, "finished")]
    with pytest.raises(Exception, match="no checkpoint of that step"):
        reopen_retrain(store, expert_jobs(cfg.n_experts), ["0"], 5)
    # a warm fork
    long_cfg = micro_config(corpus={"source": cfg.corpus.source}, n_experts=EXPERTS, train={"updates": 24})
    child = Store(str(tmp_path / "warm"))
    fork(store, child, long_cfg, warm=True)
    launch(child, long_cfg, show_progress=False)
    whole, _ = clone(seeded, tmp_path / "whole24", train={"updates": 24})
    launch(whole, long_cfg, show_progress=False)
    got, want = finals(child), finals(whole)
    for e in range(EXPERTS):
        assert got[e][1] == want[e][1]
        for name, t in want[e][0].items():
            assert torch.equal(got[e][0][name], t), (e, name)
    a, b = Ledger(child).totals(), Ledger(whole).totals()
    # the child's ledger holds the parent's spend on the checkpoints it continued from, and its own
    assert a.forwards["expert_training"] == b.forwards["expert_training"] + 6 * per_update
