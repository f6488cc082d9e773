"""`soma plan`: the cost model's arithmetic (no Ray, no clocks), and the command on a prepared micro campaign."""

from __future__ import annotations

import json

import pytest
from conftest import micro_config, soma

from soma_cluster.costmodel import _list_schedule, actor_times, predict, stop_step

CAL = {
    "device": "cuda",
    "threads": None,
    "experts_per_actor": 1,
    "updates_timed": 3,
    "packed_update_s": 0.1,
    "val_s": 0.0,
    "checkpoint_s": 0.0,
    "load_s": 1.0,
    "startup_s": 4.0,
    "poll_s": 0.5,
    "seed_load_s": 2.0,
    "seed_update_s": 0.2,
}


def test_stop_step_follows_the_workers_rule():
    cost = lambda s: 10.0 + s * 1.0  # noqa: E731  10 GPU-s start-up, 1 GPU-s per update
    assert stop_step(100, 10, cost, 1.0, None) == 100
    # first chunk is one update; then chunks of 10 while the next one fits:
    # 11 + 10 <= 40 ... 21 + 10 <= 40, 31 + 10 > 40
    assert stop_step(100, 10, cost, 1.0, 40.0) == 21
    assert stop_step(100, 10, cost, 1.0, 5.0) == 0  # start-up alone is past the cap
    assert stop_step(15, 10, cost, 1.0, 1e9) == 15  # the last chunk is cut at the target


def test_list_schedule():
    assert _list_schedule([5, 5, 5, 5], 2) == 10 and _list_schedule([5, 1, 1, 1], 2) == 5 and _list_schedule([], 3) == 0


def test_prediction_gpu_hours_wall_and_budget():
    cfg = micro_config(
        n_experts=4, train={"updates": 100, "chunk_updates": 10, "val_every": 50, "checkpoint_every": 50}
    )
    p = predict(cfg, CAL, gpus=2, cores=2, spent={"preprocessing": 36.0}, seed_done=False)
    per_expert_s = 4.0 + 1.0 + 100 * 0.1  # start-up + load + updates, one GPU each
    # the first two are granted at once (billed from their request); the other two wait in Ray's queue, billed
    # from their first instruction: their process start and imports (4 s each) are on no one's bill
    assert abs(p["gpu_hours"]["expert_training"] - (4 * per_expert_s - 2 * 4.0) / 3600) < 1e-12
    assert abs(p["unbilled_gpu_hours"] - 2 * 4.0 / 3600) < 1e-12
    assert p["actor_starts"] == {"granted": 2, "queued": 2, "reused": 0}
    assert abs(p["gpu_hours"]["seed"] - (4.0 + 2.0 + 6 * 0.2) / 3600) < 1e-12
    assert p["gpu_hours"]["preprocessing"] == 0.01 and p["slots"] == 2
    assert abs(p["wall_seconds"]["experts"] - 2 * per_expert_s) < 1e-9  # two waves of two actors
    assert p["actor"]["experts"] == {"startup_s": 4.0 + 1.0 + 0.1, "reused_s": 1.0 + 0.1, "update_s": 0.1}  # ETA
    # only what fits asked of Ray (max_pending 0): each later actor is asked when a slot frees, granted, billed
    fits = micro_config(n_experts=4, train=cfg.train.model_dump(), resources={"max_pending": 0})
    p = predict(fits, CAL, gpus=2, cores=2, spent={}, seed_done=True)
    assert abs(p["gpu_hours"]["expert_training"] - 4 * per_expert_s / 3600) < 1e-12 and p["unbilled_gpu_hours"] == 0
    # reused actors: one process per slot; the later units only load (billed and in the wall time)
    reuse = micro_config(n_experts=4, train=cfg.train.model_dump(), resources={"reuse_actors": True})
    p = predict(reuse, CAL, gpus=2, cores=2, spent={}, seed_done=True)
    assert p["actor_starts"] == {"granted": 2, "queued": 0, "reused": 2}
    assert abs(p["wall_seconds"]["experts"] - (2 * per_expert_s - 4.0)) < 1e-9
    assert abs(p["gpu_hours"]["expert_training"] - (4 * per_expert_s - 2 * 4.0) / 3600) < 1e-12
    # max_actors below the GPUs: fewer at once, every one granted
    few = micro_config(n_experts=4, train=cfg.train.model_dump(), resources={"max_actors": 1})
    p = predict(few, CAL, gpus=2, cores=2, spent={}, seed_done=True)
    assert p["slots"] == 1 and abs(p["wall_seconds"]["experts"] - 4 * per_expert_s) < 1e-9
    assert p["budget"]["experts_stopped"] == 0 and p["budget"]["worst_overrun_gpu_seconds"] is None
    # a per-expert budget of 10 GPU-s: start-up 5 s, then 0.1 s per update -> stops before passing 10
    capped = micro_config(
        n_experts=4,
        train={"updates": 100, "chunk_updates": 10, "val_every": 50, "checkpoint_every": 50},
        budget={"expert_gpu_hours": 10 / 3600, "grace_gpu_seconds": 2.0},
    )
    p = predict(capped, CAL, gpus=4, cores=2, spent={}, seed_done=True)
    assert p["budget"]["experts_stopped"] == 4 and {x["step"] for x in p["experts"]} == {41}
    assert p["budget"]["worst_overrun_gpu_seconds"] == {"per_expert": 2.5, "campaign": 10.0}
    # packed: two experts per actor share its start-up and its updates; logical GPUs on a CPU share its cores
    packed = micro_config(
        n_experts=4,
        resources={"experts_per_actor": 2, "num_gpus": 1.0},
        train={"updates": 100, "chunk_updates": 10, "val_every": 50, "checkpoint_every": 50, "threads": 1},
    )
    p = predict(packed, {**CAL, "device": "cpu", "experts_per_actor": 2}, gpus=4, cores=1, spent={}, seed_done=True)
    assert p["actors"] == 2 and p["slots"] == 4 and p["cpu_contention"] == 2.0
    assert abs(p["wall_seconds"]["experts"] - (5.0 + 100 * 0.1) * 2.0) < 1e-9  # start-up contends too


def test_a_cpu_host_is_slowed_as_the_concurrent_probe_measured():
    """On a CPU host the probe's times (that many actors at once, at Ray's workers' niceness) replace the
    threads-over-cores guess; a plan for another number of actors rescales them by that guess's ratio."""
    cal = {**CAL, "device": "cpu", "packed_update_s": 0.05, "val_s": 0.01, "checkpoint_s": 0.02}
    guess, c = actor_times(cal, 4, 1, 2)
    assert c == 2.0 and guess.update_s == 0.1 and guess.boot_s == 8.0 and guess.checkpoint_s == 0.02
    probed = {**cal, "concurrent": {"actors": 4, "niceness": 15, "boot_s": 9.0, "load_s": 1.5, "update_s": 0.15}}
    times, c = actor_times(probed, 4, 1, 2)
    assert (times.boot_s, times.load_s, times.update_s) == (9.0, 1.5, 0.15)
    assert c == pytest.approx(3.0) and times.val_s == pytest.approx(0.03)
    times, c = actor_times(probed, 8, 1, 2)  # twice the actors on the same cores: twice as slow again
    assert (times.boot_s, times.update_s, c) == pytest.approx((18.0, 0.3, 6.0))
    gpu, c = actor_times({**CAL, "concurrent": probed["concurrent"]}, 4, 1, 2)  # each actor has its own GPU
    assert c == 1.0 and gpu.update_s == 0.1 and gpu.boot_s == 4.0


def test_soma_plan_on_a_prepared_campaign(tmp_path, text_corpus, micro_yaml):
    camp = str(tmp_path / "camp")
    assert soma("prepare", camp, "--config", micro_yaml, "--corpus", str(text_corpus)).returncode == 0
    proc = soma("plan", camp, "--gpus", "2", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    p = json.loads(proc.stdout)
    assert p["schema"] == 1 and p["gpus"] == 2 and p["calibration"]["packed_update_s"] > 0 and not p["seed_trained"]
    probe = p["calibration"]["concurrent"]  # two actors at once on this CPU host, timed together
    assert probe["actors"] == 2 and probe["niceness"] == 15 and probe["update_s"] > 0 and probe["boot_s"] > 0
    assert {"seed", "expert_training", "training_total"} <= set(p["gpu_hours"]) and p["wall_seconds"]["total"] > 0
    assert (tmp_path / "camp" / "plan" / "calibration.json").exists() and (
        tmp_path / "camp" / "plan" / "plan.json"
    ).exists()
    text = soma("plan", camp)  # reuses the calibration; human lines on stdout
    assert text.returncode == 0 and "wall time" in text.stdout and "worst-case" not in text.stdout
    bad = soma("plan", camp, "--gpus", "0.5")
    assert bad.returncode == 2 and bad.stderr.startswith("error: --gpus 0.5")


@pytest.mark.slow  # ~74 s on 2 cores: a Ray head and a worker (test_soma_plan_on_a_prepared_campaign: local)
def test_soma_plan_calibrates_on_a_worker_of_the_cluster(tmp_path, text_corpus, micro_yaml, monkeypatch):
    """With --address the calibration is a Ray task holding an actor's resources (a KubeRay head has no GPU to
    time), reused only for cluster plans; GPUs default to the cluster's; a cluster without them is an error."""
    from support.rayhead import RayHead

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    camp, strict = str(tmp_path / "camp"), str(tmp_path / "strict")
    assert soma("prepare", camp, "--config", micro_yaml, "--corpus", str(text_corpus)).returncode == 0
    assert (
        soma(
            "prepare",
            strict,
            "--config",
            micro_yaml,
            "--corpus",
            str(text_corpus),
            "--set",
            "resources.allow_cpu=false",
        ).returncode
        == 0
    )
    cal_path = tmp_path / "camp" / "plan" / "calibration.json"
    with RayHead(args=("--num-cpus=2", "--num-gpus=2")) as head:
        proc = soma("plan", camp, "--address", head.address, "--json")
        assert proc.returncode == 0, proc.stderr[-3000:]
        p = json.loads(proc.stdout)
        c = p["calibration"]
        assert (
            p["gpus"] == 2
            and c["where"] == "cluster"
            and c["node"] == "127.0.0.1"
            and c["cores"] >= 1
            and c["packed_update_s"] > 0
        )
        measured = json.loads(cal_path.read_text())["measured_at"]
        text = soma("plan", camp, "--address", head.address, "--gpus", "4")  # reuses the cluster's calibration
        assert text.returncode == 0 and "on 4 GPUs" in text.stdout and "on 127.0.0.1" in text.stdout, text.stderr[
            -2000:
        ]
        assert json.loads(cal_path.read_text())["measured_at"] == measured
        no_cuda = soma("plan", strict, "--address", head.address)  # a GPU share without CUDA
        assert no_cuda.returncode == 2 and no_cuda.stderr.startswith(
            "error: node 127.0.0.1 gave the calibration 1 GPU"
        ), no_cuda.stderr[-2000:]
        assert "resources.allow_cpu=true" in no_cuda.stderr and "Traceback" not in no_cuda.stderr
    local = soma("plan", camp, "--json")  # here again: measured here
    assert local.returncode == 0 and json.loads(local.stdout)["calibration"]["where"] == "local"
    assert "node" not in json.loads(cal_path.read_text())
    with RayHead(args=("--num-cpus=2", "--num-gpus=0")) as head:  # scales from zero GPUs
        none = soma("plan", camp, "--address", head.address)
        assert none.returncode == 2 and none.stderr.startswith(
            f"error: the cluster at {head.address} has 0 GPUs now"
        ), none.stderr[-2000:]
        assert "--gpus K" in none.stderr
        stuck = soma("plan", camp, "--address", head.address, "--gpus", "2", "--wait", "3", "--recalibrate")
        assert stuck.returncode == 2 and stuck.stderr.startswith(
            "error: no Ray worker could hold an expert actor's resources"
        ), stuck.stderr[-2000:]


def test_the_times_a_run_took_from_its_events():
    """costmodel.times_of_run: a queued actor's boot from the slot it waited for; where none waited (reused
    actors, or N within the lanes), the first wave's start-up less the load; seconds per update over the updates
    each job made (a budget-stopped one: fewer)."""
    from soma_cluster.costmodel import times_of_run

    def job(name, queued, launched, started, end, steps, how="finished"):
        return [
            {"t": queued, "event": "queued", "job": name, "attempt": 0, "step": 0},
            {"t": launched, "event": "launched", "job": name, "attempt": 0, "step": 0},
            {"t": started, "event": "started", "job": name, "attempt": 0, "step": 0},
            {"t": end, "event": how, "job": name, "attempt": 0, "step": steps},
        ]

    # two lanes; c and d waited in Ray's queue: 3 s from a's and b's ends to their first instruction, 1 s to load
    rows = job("a", 0, 0, 5, 15, 10) + job("b", 0, 0, 5, 16, 10) + job("c", 0, 18, 19, 29, 10)
    rows += job("d", 0, 19, 20, 30, 10, "budget_exhausted")
    got = times_of_run(sorted(rows, key=lambda r: r["t"]), 2)
    assert got["boot_s"] == pytest.approx(3.0) and got["load_s"] == pytest.approx(1.0)
    assert got["update_s"] == pytest.approx((10 + 11 + 10 + 10) / 40)
    # reused: c and d begin on a's and b's actors at once (`launched` = when they were queued), nothing waited
    reused = job("a", 0, 0, 5, 15, 10) + job("b", 0, 0, 5, 16, 10) + job("c", 15, 15, 15.5, 25, 10)
    reused += job("d", 16, 16, 16.5, 26, 10)
    got = times_of_run(sorted(reused, key=lambda r: r["t"]), 2)
    assert got["load_s"] == pytest.approx(0.5) and got["boot_s"] == pytest.approx(5.0 - 0.5)
