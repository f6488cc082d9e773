"""`soma experiment` end to end at micro size: every arm a real campaign on a local Ray (prepare or fork, seed,
launch under a GPU-hour budget, eval with its curve), then the report, its figures and the README section."""

import json
from pathlib import Path

import pytest
from conftest import assert_one_line_error, soma

MICRO_SETS = [
    "corpus.max_bytes=1500000",
    "router.max_features=5000",
    "router.min_df=3",
    "router.svd_dim=16",
    "router.sample_chunks=2000",
    "router.kmeans_iters=10",
    "shards.min_train_seqs=16",
    "spsa.n_pert=4",
    "spsa.batch=4",
    "spsa.seq_len=64",
    "spsa.pert_chunk=4",
    "seed_stage.updates=6",
    "train.chunk_updates=3",
    "train.checkpoint_every=6",
    "train.val_every=6",
    "train.val_batches=1",
    "eval.max_windows=24",
    "eval.bootstrap=200",
    "eval.batch=8",
]


# zo-compare binds each arm on its campaign budget, seed stage and actor start-ups included: wall seconds on this
# host. Measured on a shared 2-core host, load average 10-17 (other suites beside it): the small scale's
# train.threads=2 slows an update 5-20x there (OpenMP threads contend), and bptt ended at step 1 (2 curve points, the
# test wants 3) at 0.01 GPU-hours and at 0.02; 0.003 was spent by the seed alone. One thread each at 0.02: every arm
# ran 430-895 steps. At 0.01 with one thread and two busy loops beside it, mono-spsa's seed stage (start-up included)
# spent all 36 GPU-seconds. The test checks the machinery, not the preset's speed: one thread, 0.02 GPU-hours
# (with the two busy loops: seed stages 26-28 GPU-s, every arm 6 curve points or more). Four arms bound by 72
# GPU-seconds each on one logical GPU are five minutes of wall time (314 s of a 42-minute suite on 2026-12-06), so the
# test is slow: SOMA_SLOW=1 runs it. The experiment machinery stays in make test through the variance experiment
# below, forks through test_fork_cli_..., and the zo-compare spec's arms (match_params, forks) in
# tests/test_experimentspecs.py.
BUDGET_H = 0.02
ZO_SETS = ("train.threads=1", f"budget.campaign_gpu_hours={BUDGET_H}")


def sets(*extra):
    return [a for s in (*MICRO_SETS, *extra) for a in ("--set", s)]


@pytest.mark.slow
def test_zo_compare_runs_every_baseline_through_the_campaign_machinery(tmp_path):
    out = tmp_path / "zo"
    proc = soma(
        "experiment",
        "zo-compare",
        str(out),
        "--no-progress",
        *sets(*ZO_SETS),
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads((out / "results.json").read_text())
    arms = res["seeds"]["0"]
    assert set(arms) == {"soma", "bptt", "mono-spsa", "eggroll"}
    assert [arms[a]["method"] for a in ("soma", "bptt", "mono-spsa", "eggroll")] == ["spsa", "bptt", "spsa", "eggroll"]
    assert (
        arms["mono-spsa"]["n_experts"] == 1
        and abs(arms["mono-spsa"]["parameters"] / arms["soma"]["parameters"] - 1) < 0.01
    )
    for name, r in arms.items():
        # matched GPU-hours: each arm's campaign budget bound it (seed included), within the stated overrun bound;
        # a job stops once its next chunk (its cost measured on this host, under its load) no longer fits its share
        # of what is left, so a loaded host can leave up to a chunk per concurrent job unspent
        assert set(r["outcomes"]) == {"budget_exhausted"}, (name, r["outcomes"])
        assert BUDGET_H / 2 < r["gpu_hours"] < BUDGET_H + 4 * 5.5 / 3600, (name, r["gpu_hours"])
        steps = [p["step"] for p in r["curve"]]
        assert steps[0] == 0 and steps == sorted(steps) and len(steps) >= 3
        fw = [p["forwards"] for p in r["curve"]]
        assert fw == sorted(fw) and fw[-1] == r["forwards"]
        if name != "soma":  # paired against SOMA on the same test windows
            assert r["vs_reference"] is not None
            assert (
                abs(
                    r["vs_reference"]["nats_per_byte"]
                    - (r["ensemble"]["nats_per_byte"] - arms["soma"]["ensemble"]["nats_per_byte"])
                )
                < 1e-9
            )
    # forks share the parent's data and seed model byte for byte, and carry its seed cost
    for child, parent in (("bptt", "soma"), ("eggroll", "mono-spsa")):
        c, p = out / "s0" / child, out / "s0" / parent
        for rel in (
            "seed/latest.json",
            "test/part-00000.arrow",
            "test/manifest.json",
            "shards/expert-0000/val-00000.arrow",
            "router/router.json",
        ):
            if (p / rel).exists():
                assert (c / rel).read_bytes() == (p / rel).read_bytes(), (child, rel)
        assert arms[child]["gpu_hours_by_category"]["seed"] == arms[parent]["gpu_hours_by_category"]["seed"] > 0
    report = (out / "report.md").read_text()
    assert "matched forward passes" in report and "not backpropagation" in report
    assert all(f"**{e['better']} vs {e['worse']}**" in report for e in res["expect"])
    for png in ("loss_vs_gpu_hours.png", "loss_vs_forwards.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the same command again resumes: nothing is retrained, the results are the same campaigns
    events = (out / "s0" / "soma" / "events.jsonl").read_text()
    again = soma(
        "experiment",
        "zo-compare",
        str(out),
        "--no-progress",
        *sets(*ZO_SETS),
        timeout=600,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert (out / "s0" / "soma" / "events.jsonl").read_text() == events
    # another experiment (or other overrides) in the same directory is refused, nothing touched
    assert_one_line_error(
        soma(
            "experiment", "zo-compare", str(out), *sets("train.threads=1", f"budget.campaign_gpu_hours={2 * BUDGET_H}")
        ),
        "holds experiment zo-compare",
    )
    assert (out / "s0" / "soma" / "events.jsonl").read_text() == events


def test_variance_experiment_and_readme_section(tmp_path):
    out = tmp_path / "var"
    proc = soma("experiment", "variance", str(out), "--no-progress", *sets(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    v = json.loads((out / "results.json").read_text())["seeds"]["0"]
    for r in v["fixed"]:
        assert abs(r["reduction"] / r["predicted_reduction"] - 1) < 0.15, r
    assert v["model"]["n_blocks"] == 4 and v["model"]["reduction"] > 1.5  # real experts: far less variance alone
    readme = tmp_path / "README.md"
    readme.write_text("# soma\n\n## Layout\n")
    proc = soma("report", str(out), "--readme", str(readme))
    assert proc.returncode == 0, proc.stderr
    text = readme.read_text()
    assert "<!-- results:begin -->" in text and "real experts (seed init.)" in text and text.endswith("## Layout\n")
    assert Path(out / "variance.png").exists()


def test_experiment_bad_input_is_one_line(tmp_path):
    assert_one_line_error(soma("experiment", "nope", str(tmp_path / "x")), "unknown experiment 'nope'")
    assert_one_line_error(
        soma("experiment", "summed", str(tmp_path / "x"), "--scale", "huge"),
        "--scale 'huge'",
        "choose one of small, paper",
    )
    assert_one_line_error(
        soma("experiment", "summed", str(tmp_path / "x"), "--set", "spsa.objective=bogus"), "spsa.objective"
    )
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    assert_one_line_error(soma("experiment", "variance", str(foreign)), "not empty")
    assert (foreign / "keep.txt").read_text() == "mine"
    assert not (tmp_path / "x").exists()


@pytest.mark.slow  # ~41 s; a fork of a trained campaign: test_set.py (warm fork); its refusals: test_refusals.py
def test_fork_cli_shares_data_and_seed_and_refuses_what_it_cannot_share(tmp_path, text_corpus, micro_yaml):
    parent, child = str(tmp_path / "parent"), str(tmp_path / "child")
    assert soma("prepare", parent, "--config", micro_yaml, "--corpus", str(text_corpus)).returncode == 0
    assert_one_line_error(soma("fork", parent, child, "--set", "train.method=bptt"), "no finished seed model")
    assert soma("seed", parent, "--no-progress").returncode == 0
    assert_one_line_error(soma("fork", parent, child, "--set", "model.depth=3"), "cannot change model")
    proc = soma("fork", parent, child, "--set", "train.method=bptt", "--set", "train.updates=6")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (
        soma("fork", parent, child, "--set", "train.method=bptt", "--set", "train.updates=6").returncode == 0
    )  # no-op
    assert_one_line_error(soma("fork", parent, child, "--set", "train.method=eggroll"), "different campaign")
    proc = soma("launch", child, "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = [json.loads(line) for line in (tmp_path / "child" / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events if e["job"] == "expert-0000"][-1] == "finished"
    assert any(e["event"] == "forked" for e in events)
    assert not (tmp_path / "parent" / "experts").exists()  # the parent is untouched
    ledger = [json.loads(line) for line in (tmp_path / "child" / "ledger" / "ledger.jsonl").read_text().splitlines()]
    assert any(r["category"] == "seed" for r in ledger) and any(
        r["category"] == "expert_training" and r["forwards"] > 0 for r in ledger
    )
