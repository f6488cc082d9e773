"""Chaos on a real local Ray: SIGKILL, ray.kill, NaN, a hang (SIGSTOP), budgets. Each expert is
independent; a retried expert must end bitwise identical to the same expert trained without a fault."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import micro_config

from pipelines.campaign import Driver, Job, expert_jobs
from pipelines.prepare import prepare
from soma_cluster.budget import BudgetBook
from soma_cluster.checkpoint import load_checkpoint, save_checkpoint
from soma_cluster.events import history
from soma_cluster.ledger import Ledger
from soma_cluster.storage import Store
from workers import NAMESPACE, actor_name

# 96 updates (about 2 s of training on 2 cores) so a fault aimed after an expert's first checkpoint lands
# before it finishes: with 24 (0.3 s after the first checkpoint) a loaded CI host saw experts end unharmed
CHAOS = dict(
    spsa={"n_pert": 4, "batch": 6, "seq_len": 160, "pert_chunk": 4},
    train={"updates": 96, "chunk_updates": 3, "checkpoint_every": 6, "val_every": 6, "val_batches": 1},
    retry={"max_retries": 2, "backoff_s": 0.2, "heartbeat_timeout_s": 60},
)


def config(**extra):
    sections = {k: dict(v) for k, v in CHAOS.items()}
    for key, value in extra.items():
        sections[key] = {**sections.get(key, {}), **value} if isinstance(value, dict) else value
    return micro_config(**sections)


@pytest.fixture(scope="module")
def seeded(tmp_path_factory, text_corpus, ray_local):
    """A prepared campaign with a finished seed, copied by each test (so they never share state)."""
    root = tmp_path_factory.mktemp("seeded") / "c"
    cfg = config(corpus={"source": str(text_corpus)})
    store = Store(str(root))
    prepare(store, cfg)
    assert Driver(store, cfg, [Job(None)], show_progress=False).run() == {"seed": "finished"}
    return root, cfg


def clone(seeded, dest: Path, cfg=None):
    root, base = seeded
    shutil.copytree(root, dest)
    cfg = cfg or base
    if cfg is not base:  # a test's own budget/retry settings: rewrite the resolved config
        from soma_cluster.config import to_yaml_text

        (dest / "campaign.yaml").write_text(to_yaml_text(cfg))
    return Store(str(dest)), cfg


def events(store, job=None, kind=None):
    out = store.read_log("events.jsonl")  # the campaign's own reader: skips a last line still being appended
    return [e for e in out if (job is None or e["job"] == job) and (kind is None or e["event"] == kind)]


def wait_for(pred, timeout=120.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:  # bounded in time
        value = pred()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def run_in_thread(store, cfg):
    result = {}
    t = threading.Thread(
        target=lambda: result.update(Driver(store, cfg, expert_jobs(cfg.n_experts), show_progress=False).run()),
        daemon=True,
    )
    t.start()
    return t, result


def final_tensors(store, e):
    return load_checkpoint(store, f"experts/expert-{e:04d}").tensors


@pytest.fixture(scope="module")
def reference(seeded, tmp_path_factory, ray_local):
    store, cfg = clone(seeded, tmp_path_factory.mktemp("ref") / "c")
    assert set(Driver(store, cfg, expert_jobs(cfg.n_experts), show_progress=False).run().values()) == {"finished"}
    return store


def assert_bitwise(store, reference, experts):
    for e in experts:
        a, b = final_tensors(store, e), final_tensors(reference, e)
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), (e, k)


def test_sigkill_and_ray_kill_are_retried_bitwise(seeded, reference, tmp_path, ray_local):
    store, cfg = clone(seeded, tmp_path / "c")
    thread, result = run_in_thread(store, cfg)
    # both run at once: each is killed as soon as its own first checkpoint is seen, whichever comes first
    # (waiting for one before watching the other lets a fast host finish the other meanwhile)
    kills = {
        "expert-0000": lambda: os.kill(
            events(store, "expert-0000", "started")[0]["pid"], signal.SIGKILL
        ),  # a real SIGKILL
        "expert-0001": lambda: ray_local.kill(
            ray_local.get_actor(actor_name(cfg.digest()[:8], "expert-0001", 0), namespace=NAMESPACE)
        ),
    }

    def kill_checkpointed():
        for job in [j for j in kills if any(x["attempt"] == 0 for x in events(store, j, "checkpointed"))]:
            kills.pop(job)()
        return not kills

    wait_for(kill_checkpointed, what="both experts' first checkpoints")
    thread.join(timeout=300)
    assert not thread.is_alive()
    assert result == {"expert-0000": "finished", "expert-0001": "finished"}
    for e in (0, 1):
        failed = events(store, f"expert-{e:04d}", "failed")
        assert len(failed) == 1 and failed[0]["reason"].startswith("actor_died")
        assert events(store, f"expert-{e:04d}", "started")[-1]["resumed"] is True
    assert_bitwise(store, reference, [0, 1])
    mine, ref = Ledger(store).totals(), Ledger(reference).totals()
    assert mine.forwards["expert_training"] == ref.forwards["expert_training"]  # lost work moved to wasted
    # work billed (a heartbeat) past the checkpoint a retry resumed from is wasted; a kill that lands before the
    # next heartbeat after a checkpoint loses none (seen on a fast host), so the test asks for exactly that
    lost = [
        hb
        for e in (0, 1)
        for hb in events(store, f"expert-{e:04d}", "heartbeat")
        if hb["attempt"] == 0 and hb["step"] > events(store, f"expert-{e:04d}", "started")[-1]["step"]
    ]
    assert (mine.forwards["wasted"] > 0) == bool(lost)
    # the GPU-seconds wasted hold those forwards' seconds and, lost forwards or not, each retry's start-up
    # (AttemptCause.RETRY's start-up category): never nothing after a kill
    retry_startups = [r for r in Ledger(store).records() if r["category"] == "wasted" and r["attempt"] == 1]
    assert {r["expert"] for r in retry_startups} == {0, 1} and all(r["forwards"] == 0 for r in retry_startups)
    assert mine.gpu_seconds["wasted"] >= sum(r["gpu_seconds"] for r in retry_startups) > 0


def test_nan_expert_fails_after_retries_while_others_finish(seeded, tmp_path, ray_local):
    store, cfg = clone(seeded, tmp_path / "c")
    state = load_checkpoint(store, "seed").state(torch.device("cpu"))
    state.body.fill_(float("nan"))
    save_checkpoint(store, "experts/expert-0001", state)  # a valid checkpoint of NaN weights
    result = Driver(store, cfg, expert_jobs(cfg.n_experts), show_progress=False).run()
    assert result == {"expert-0000": "finished", "expert-0001": "failed_permanently"}
    failed = events(store, "expert-0001", "failed")
    assert len(failed) == cfg.retry.max_retries + 1
    assert all("NonFiniteLoss" in f["reason"] for f in failed)
    assert history(store)["expert-0000"].step == cfg.train.updates


def freeze_until_driver_ends(store, thread, timeout):
    """SIGSTOP expert-0000's worker (alive but silent) until the driver thread ends; SIGKILL it after."""
    pid = events(store, "expert-0000", "started")[0]["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        thread.join(timeout=timeout)
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not thread.is_alive()


def test_hung_expert_is_killed_and_retried(seeded, reference, tmp_path, ray_local):
    store, cfg = clone(seeded, tmp_path / "c", config(retry={"heartbeat_timeout_s": 3.0}))
    thread, result = run_in_thread(store, cfg)
    wait_for(lambda: [x for x in events(store, "expert-0000", "checkpointed") if x["attempt"] == 0], what="checkpoint")
    freeze_until_driver_ends(store, thread, 300)  # alive but silent: a hang
    assert result == {"expert-0000": "finished", "expert-0001": "finished"}
    assert events(store, "expert-0000", "failed")[0]["reason"].startswith("hang")
    assert not events(store, "expert-0001", "failed")
    assert_bitwise(store, reference, [0, 1])


def test_expert_budget_stops_cleanly_within_the_bound(seeded, tmp_path, ray_local):
    cap_s = 10.0  # the actor's start-up (2-7 s on a loaded 2-core host) is part of what it spends
    store, cfg = clone(
        seeded,
        tmp_path / "c",
        config(budget={"expert_gpu_hours": cap_s / 3600, "grace_gpu_seconds": 2.0}, train={"updates": 100000}),
    )
    result = Driver(store, cfg, expert_jobs(cfg.n_experts), show_progress=False).run()
    assert set(result.values()) == {"budget_exhausted"}
    totals = Ledger(store).totals()
    hard = cfg.budget.grace_gpu_seconds + 0.5 * cfg.resources.num_gpus  # the driver's hard stop
    over = BudgetBook(cfg.budget).overruns(totals.per_expert_gpu_seconds, totals.per_expert_largest)
    for e in range(cfg.n_experts):
        spent = totals.per_expert_gpu_seconds[e]
        print(
            f"\nexpert budget: expert {e} spent {spent:.2f} GPU-s of a {cap_s} cap (overrun {over[e].gpu_s:+.2f}, "
            f"derived bound {over[e].bound_s:.2f}: its largest chunk or start-up; hard stop {hard:.2f})"
        )
        assert over[e].gpu_s == pytest.approx(spent - cap_s)
        assert cap_s * 0.5 < spent and over[e].within, (e, spent, over[e])
        ck = load_checkpoint(store, f"experts/expert-{e:04d}")  # the clean stop left a checkpoint
        assert ck.meta["state"]["step"] == history(store)[f"expert-{e:04d}"].step


def test_campaign_budget_is_shared_and_never_launches_past_it(seeded, tmp_path, ray_local):
    root, base = seeded
    seed_s = Ledger(Store(str(root))).totals().gpu_hours * 3600
    extra_s = 5.0
    cfg = config(
        budget={"campaign_gpu_hours": (seed_s + extra_s) / 3600, "grace_gpu_seconds": 2.0}, train={"updates": 100000}
    )
    store, cfg = clone(seeded, tmp_path / "c", cfg)
    outcome = Driver(store, cfg, expert_jobs(cfg.n_experts), show_progress=False).run()
    assert set(outcome.values()) == {"budget_exhausted"}
    spent = Ledger(store).totals().gpu_hours * 3600
    bound = (cfg.budget.grace_gpu_seconds + 0.5) * cfg.n_experts
    print(
        f"\ncampaign budget: spent {spent - seed_s:.2f} GPU-s of {extra_s} after the seed "
        f"(overrun {spent - seed_s - extra_s:+.2f}, bound {bound:.2f})"
    )
    assert seed_s + extra_s * 0.5 < spent <= seed_s + extra_s + bound
    # the budget is now spent: nothing more is launched
    launched = len(events(store, kind="launched"))
    store2 = Store(str(tmp_path / "c"))
    Driver(store2, cfg, expert_jobs(cfg.n_experts), show_progress=False).run()
    assert len(events(store2, kind="launched")) == launched


@pytest.mark.slow
def test_driver_sigkill_then_resume_finishes_without_double_counting(seeded, reference, tmp_path):
    """The driver (with the local Ray it started) is SIGKILLed mid-campaign; `soma resume` finishes it. With SOMA_SLOW=1
    (25 s): tests/test_driver_lease.py SIGKILLs a training driver and resumes it in make test, with the same checks
    (bitwise, training forwards equal to the unfaulted run's, no ledger record twice); here its Ray dies with it."""
    import subprocess
    import sys

    store, cfg = clone(seeded, tmp_path / "c")
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, "-m", "pipelines.cli", "launch", str(tmp_path / "c"), "--no-progress"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for(
            lambda: events(store, "expert-0000", "checkpointed") or proc.poll() is not None, what="first checkpoint"
        )
        assert proc.poll() is None, "driver ended before it could be killed"
        os.killpg(proc.pid, signal.SIGKILL)  # driver and its local Ray, at once
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    before = {e["job"] for e in events(store) if e["event"] == "finished"}
    out = subprocess.run(
        [sys.executable, "-m", "pipelines.cli", "resume", str(tmp_path / "c"), "--no-progress"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    hist = history(store)
    assert all(hist[f"expert-{e:04d}"].state == "finished" for e in range(cfg.n_experts))
    for job in before:  # finished experts were not retrained
        assert hist[job].attempts == 1
    raw = [json.loads(line)["id"] for line in Path(store.full("ledger/ledger.jsonl")).read_text().splitlines()]
    assert len(raw) == len(set(raw))  # no GPU-second record written twice
    assert_bitwise(store, reference, range(cfg.n_experts))
    mine, ref = Ledger(store).totals(), Ledger(reference).totals()
    assert (
        mine.forwards["expert_training"]
        <= ref.forwards["expert_training"] + 2 * cfg.spsa.n_pert * cfg.train.chunk_updates * cfg.n_experts
    )


def test_launch_refuses_a_budget_already_spent(seeded, tmp_path):
    from pipelines.campaign import launch
    from soma_cluster.errors import SomaError

    root, _ = seeded
    seed_h = Ledger(Store(str(root))).totals().gpu_hours
    store, cfg = clone(seeded, tmp_path / "c", config(budget={"campaign_gpu_hours": seed_h / 2}))
    with pytest.raises(SomaError, match="already spent"):
        launch(store, cfg, show_progress=False)
    assert not events(store, kind="launched") or all(e["job"] == "seed" for e in events(store, kind="launched"))


def test_unspent_budget_of_a_failed_expert_is_granted_to_the_others(seeded, tmp_path, ray_local):
    cap_s = 15.0  # expert-0001 must get past its start-up (billed from the grant; 2-10 s on a loaded host) to fail
    store, cfg = clone(
        seeded,
        tmp_path / "c",
        config(
            budget={"expert_gpu_hours": cap_s / 3600, "grace_gpu_seconds": 2.0, "pool_policy": "even"},
            train={"updates": 100000},
            retry={"max_retries": 0},
        ),
    )
    state = load_checkpoint(store, "seed").state(torch.device("cpu"))
    state.body.fill_(float("nan"))
    save_checkpoint(store, "experts/expert-0001", state)
    result = Driver(store, cfg, expert_jobs(cfg.n_experts), show_progress=False).run()
    assert result == {"expert-0000": "budget_exhausted", "expert-0001": "failed_permanently"}
    grants = events(store, "expert-0000", "budget_granted")
    assert len(grants) == 1 and grants[0]["source"] == "expert-0001"
    spent = Ledger(store).totals().per_expert_gpu_seconds
    assert grants[0]["gpu_seconds"] == pytest.approx(cap_s - spent[1], abs=1e-6)
    assert cap_s < spent[0] <= cap_s + grants[0]["gpu_seconds"] + cfg.budget.grace_gpu_seconds + 0.5


def test_driver_hard_stops_an_actor_that_overruns_past_the_grace(seeded, tmp_path, ray_local):
    """A worker that stops reporting while holding its GPU (SIGSTOP) cannot spend past cap + grace."""
    cap_s, grace = 10.0, 1.0  # room for the actor's start-up, so it is still training when it is frozen
    store, cfg = clone(
        seeded,
        tmp_path / "c",
        config(
            budget={"expert_gpu_hours": cap_s / 3600, "grace_gpu_seconds": grace},
            train={"updates": 100000},
            retry={"heartbeat_timeout_s": 120},
        ),
    )
    thread, result = run_in_thread(store, cfg)
    wait_for(lambda: events(store, "expert-0000", "checkpointed"), what="checkpoint")
    freeze_until_driver_ends(store, thread, 120)
    assert result["expert-0000"] == "budget_exhausted"
    assert events(store, "expert-0000", "failed")[0]["reason"].startswith("budget_exhausted: hard stop")
    spent = Ledger(store).totals().per_expert_gpu_seconds[0]
    bound = grace + 0.5 * cfg.resources.num_gpus
    print(
        f"\nhard stop: expert-0000 spent {spent:.2f} GPU-s of a {cap_s} cap "
        f"(overrun {spent - cap_s:+.2f}, bound {bound:.2f})"
    )
    assert spent <= cap_s + bound + 0.1


def test_sigterm_is_a_preemption_checkpointed_and_rescheduled_bitwise(seeded, reference, tmp_path, ray_local):
    """SIGTERM (a spot notice, a drain) mid-chunk: the worker checkpoints and leaves, the driver records
    `preempted` (not a failure, no retry spent), and the expert ends bitwise equal to an undisturbed run."""
    store, cfg = clone(seeded, tmp_path / "c", config(retry={"max_retries": 0}))
    thread, result = run_in_thread(store, cfg)
    wait_for(
        lambda: [x for x in events(store, "expert-0000", "heartbeat") if x["attempt"] == 0 and x["step"] >= 4],
        what="training",
    )
    os.kill(events(store, "expert-0000", "started")[0]["pid"], signal.SIGTERM)
    thread.join(timeout=300)
    assert not thread.is_alive()
    assert result == {"expert-0000": "finished", "expert-0001": "finished"}  # max_retries 0, yet it came back
    pre = events(store, "expert-0000", "preempted")
    assert len(pre) == 1 and not events(store, "expert-0000", "failed") and history(store)["expert-0000"].failures == 0
    ckpts = [x["step"] for x in events(store, "expert-0000", "checkpointed") if x["attempt"] == 0]
    again = events(store, "expert-0000", "started")[-1]
    assert again["attempt"] == 1 and again["resumed"] and again["step"] == ckpts[-1] == pre[0]["step"]  # nothing lost
    assert_bitwise(store, reference, [0, 1])
    mine, ref = Ledger(store).totals(), Ledger(reference).totals()
    assert mine.forwards["expert_training"] == ref.forwards["expert_training"]
    assert mine.gpu_seconds["preempted"] > 0 and mine.gpu_seconds["wasted"] == 0 and mine.forwards["wasted"] == 0
    print(
        f"\npreempted at step {pre[0]['step']} (checkpoint {ckpts[-1]}); "
        f"preempted {mine.gpu_seconds['preempted']:.2f} GPU-s, "
        f"wasted {mine.gpu_seconds['wasted']:.2f}, training forwards {mine.forwards['expert_training']} = fault-free"
    )


def test_a_gpu_share_without_cuda_is_an_error_naming_the_node(seeded, tmp_path, ray_local):
    store, cfg = clone(seeded, tmp_path / "c", config(resources={"allow_cpu": False}))
    driver = Driver(store, cfg, expert_jobs(cfg.n_experts), show_progress=False)
    assert set(driver.run().values()) == {"failed_permanently"}
    why = driver.bad_input["expert-0000"]
    assert "node 127.0.0.1" in why and "no CUDA device" in why and "resources.allow_cpu=true" in why
    assert len(events(store, "expert-0000", "failed")) == 1  # no retry can fix the node


def test_launch_exits_3_when_an_expert_fails_permanently_and_its_traceback_reaches_the_driver(seeded, tmp_path):
    import subprocess
    import sys

    store, cfg = clone(seeded, tmp_path / "c")
    state = load_checkpoint(store, "seed").state(torch.device("cpu"))
    name = save_checkpoint(store, "experts/expert-0001", state)
    meta = store.read_json(f"experts/expert-0001/{name}.json")
    del meta["state"]["history"]  # a metadata file a bug could write
    store.write_json(f"experts/expert-0001/{name}.json", meta)
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    out = subprocess.run(
        [sys.executable, "-m", "pipelines.cli", "launch", str(tmp_path / "c"), "--no-progress"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 3, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "expert-0001" in errors[0] and "KeyError" in errors[0], errors
    assert "Traceback" in out.stderr and "expert_worker.py" in out.stderr  # the worker's traceback, in the driver's log
    failed = events(store, "expert-0001", "failed")
    assert len(failed) == cfg.retry.max_retries + 1 and all("KeyError" in f["traceback"] for f in failed)
    assert history(store)["expert-0000"].state == "finished"
