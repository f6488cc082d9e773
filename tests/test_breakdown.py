"""The evaluation taken apart (soma_cluster/breakdown.py) on made-up arrays, then on a real micro campaign: loss per
source and document, the baselines paired on the same windows, top-k sensitivity, routing load, elapsed wall time,
and `soma compare` (with its refusal of campaigns whose test windows differ)."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
from conftest import assert_one_line_error, soma_here

from soma_cluster import breakdown as bd
from soma_cluster.ensemble import bootstrap_weights
from soma_cluster.errors import SomaError
from soma_cluster.storage import Store


def _probs(rng, n_experts=4, m=12, s=8) -> np.ndarray:
    return rng.uniform(0.01, 0.9, size=(n_experts, m, s))


def test_baselines_on_a_made_up_table():
    rng = np.random.default_rng(0)
    probs = _probs(rng)
    probs[2] *= 1.05  # expert 2 the best everywhere
    probs = np.minimum(probs, 1.0)
    w = bootstrap_weights(np.arange(12) // 2, 300, 0)
    routes = {k: (np.tile(np.arange(k), (12, 1)), np.full((12, k), 1 / k)) for k in (1, 2, 4)}
    ens = bd.mixture_nats(probs, *routes[2])
    seed = -np.log(probs.mean(axis=0) * 0.5)
    got = {b.name: b for b in bd.baselines(probs, ens, seed, w, 2)}
    expert_nats = -np.log(probs)
    assert got["best_single"].expert == int(np.argmin(expert_nats.sum(axis=(1, 2))))
    assert got["best_single"].loss.nats_per_byte == pytest.approx(expert_nats[got["best_single"].expert].mean())
    # the oracle takes each window's 2 lowest-loss experts, uniformly: by hand
    own = expert_nats.sum(axis=2)  # (N, m)
    hand = np.stack([-np.log(probs[np.argsort(own[:, i])[:2], i].mean(axis=0)) for i in range(12)])
    assert got["oracle"].loss.nats_per_byte == pytest.approx(hand.mean())
    assert got["uniform_mixture"].loss.nats_per_byte == pytest.approx(-np.log(probs.mean(axis=0)).mean())
    d = got["oracle"].ensemble_minus_this
    assert d.nats_per_byte == pytest.approx(ens.mean() - hand.mean()) and d.lo <= d.nats_per_byte <= d.hi
    sens = bd.top_k_sensitivity(probs, routes, ens, w)
    assert [t.k for t in sens] == [1, 2, 4]
    at2 = next(t for t in sens if t.k == 2)
    assert at2.router_minus_ensemble.nats_per_byte == 0.0 and at2.router.nats_per_byte == pytest.approx(ens.mean())
    assert next(t for t in sens if t.k == 4).oracle.nats_per_byte == pytest.approx(
        got["uniform_mixture"].loss.nats_per_byte
    )  # the oracle at k = N is every expert, uniformly


def test_sensitivity_ks_and_the_baselines_window_budget():
    assert bd.sensitivity_ks(1, 4) == [1]
    assert bd.sensitivity_ks(6, 4) == [1, 2, 4, 6]
    assert bd.sensitivity_ks(256, 4) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert len(bd.baseline_rows(256, 4, 4)) == 256  # the tiny preset: every expert on every window
    rows = bd.baseline_rows(2048, 256, 4)  # N = 256 on 2048 windows: the budget's 64 windows, raised to 256
    assert len(rows) == 256 and rows[0] == 0 and rows[-1] == 2047 and np.all(np.diff(rows) > 0)
    assert len(bd.baseline_rows(8192, 1024, 4)) == 256 and len(bd.baseline_rows(100, 1024, 4)) == 100
    assert len(bd.baseline_rows(20_000, 16, 1)) == 2500  # the budget, 2 x 1 x 20,000 / 16, when it is above 256


def test_routing_load_warns_when_one_expert_takes_every_window():
    # the case: top-4 of 6, one expert in every window's top-4
    load = bd.routing_load({0: 256, 1: 200, 2: 180, 3: 150, 4: 130, 5: 108}, 256, 4, 6)
    assert load.judged and load.concentrated and load.busiest == 0 and load.max_share == 1.0
    assert load.threshold == pytest.approx((1 + 4 / 6) / 2)
    assert "expert-0000 gets 256 of 256 windows" in load.warning(lambda e: f"expert-{e:04d}")
    even = bd.routing_load({e: 64 for e in range(8)}, 256, 2, 8)
    assert not even.concentrated and even.normalized_entropy == pytest.approx(1.0) and even.warning(str) is None
    skewed = bd.routing_load({0: 200, 1: 50, 2: 0, 3: 6}, 128, 2, 4)  # share 1.56 > 2 x 0.5? no: > (1 + .5)/2
    assert skewed.concentrated and skewed.idle == [2]
    few = bd.routing_load({0: 12, 1: 4}, 16, 4, 256)  # 256 experts on 16 windows: too few to judge
    assert not few.judged and not few.concentrated
    assert not bd.routing_load({0: 10, 1: 10}, 10, 2, 2).judged  # k = N: every window goes everywhere


def test_elapsed_wall_time_counts_the_clock_once():
    recs = [
        {"category": "expert_training", "t": 110.0, "wall_seconds": 10.0},  # 100-110
        {"category": "expert_training", "t": 115.0, "wall_seconds": 10.0},  # 105-115, overlaps
        {"category": "expert_training", "t": 130.0, "wall_seconds": 5.0},  # 125-130, after a gap
        {"category": "seed", "t": 50.0, "wall_seconds": 3.0},
        {"category": "seed", "t": 60.0, "wall_seconds": 0.0},
    ]
    assert bd.elapsed_seconds(recs) == {"expert_training": 20.0, "seed": 3.0}


def test_loss_per_source_and_document():
    rng = np.random.default_rng(1)
    nats = rng.uniform(1, 3, size=(6, 5))
    seed = nats + 0.5
    docs = np.array([7, 7, 8, 9, 9, 9])
    w = bootstrap_weights(docs, 200, 0)
    groups = bd.by_source(nats, seed, docs, {7: "man", 9: "man", 8: "pydoc"}, w)
    assert [(g.source, g.windows, g.documents) for g in groups] == [("man", 5, 2), ("pydoc", 1, 1)]
    assert groups[0].ensemble.nats_per_byte == pytest.approx(nats[[0, 1, 3, 4, 5]].mean())
    assert groups[0].ensemble_minus_seed.nats_per_byte == pytest.approx(-0.5)
    per_doc = bd.by_document(nats, seed, docs, {7: ("a.txt", "man")})
    assert [d.doc for d in per_doc] == sorted([7, 8, 9], key=lambda d: -nats[docs == d].mean())
    assert {d.doc: d.source for d in per_doc} == {7: "man", 8: "unknown", 9: "unknown"}


def test_compare_rows_and_baseline_choice():
    rng = np.random.default_rng(2)
    a, b = rng.uniform(1, 2, (10, 4)), rng.uniform(1, 2, (10, 4))
    w = bootstrap_weights(np.arange(10), 200, 0)
    rows = bd.compare_rows(["x", "y"], [a, b], w, 1)
    assert rows[1].minus_baseline is None and rows[0].minus_baseline.nats_per_byte == pytest.approx((a - b).mean())
    assert bd.pick_baseline(["c1", "c2/"], ["/abs/c1", "/abs/c2"], "c2") == 1
    assert bd.pick_baseline(["c1", "c2"], ["/abs/c1", "/abs/c2"], None) == 0
    with pytest.raises(SomaError, match="--baseline c3 is not one of the campaigns compared"):
        bd.pick_baseline(["c1", "c2"], ["/abs/c1", "/abs/c2"], "c3")


# -- on a real campaign ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def evaluated(trained_campaign, tmp_path_factory):
    camp = tmp_path_factory.mktemp("explain") / "c"
    shutil.copytree(trained_campaign, camp)
    r = soma_here("eval", camp, "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    return camp, json.loads(r.stdout)


def test_eval_explains_itself(evaluated):
    camp, m = evaluated
    assert json.loads((camp / "eval" / "metrics.json").read_text())["baselines"] == m["baselines"]
    # sources: the fixture's corpus is text files, so the source is the file kind; documents are named
    assert sum(g["windows"] for g in m["by_source"]) == m["windows"] and m["by_source"][0]["source"] != "unknown"
    assert len(m["by_document"]) == m["documents"] and all(d["name"] for d in m["by_document"])
    b = m["baselines"]
    assert b["all_windows"] and b["windows"] == m["windows"] and b["expert_windows"] == 3 * m["windows"]
    assert b["ensemble"]["nats_per_byte"] == pytest.approx(m["ensemble"]["nats_per_byte"])
    assert b["seed"]["nats_per_byte"] == pytest.approx(m["seed"]["nats_per_byte"])
    assert b["oracle"]["k"] == 2 and b["oracle"]["nats_per_byte"] <= b["uniform_mixture"]["nats_per_byte"] + 1e-9
    best = min(m["expert_test_nats"].values())
    assert b["best_single"]["nats_per_byte"] == pytest.approx(best)
    sens = {t["k"]: t for t in m["top_k_sensitivity"]}
    assert sorted(sens) == [1, 2, 3] and abs(sens[2]["router_minus_ensemble"]["nats_per_byte"]) < 1e-9
    assert sens[3]["router"]["nats_per_byte"] == pytest.approx(b["uniform_mixture"]["nats_per_byte"])
    load = m["routing_load"]
    assert sum(load["per_expert"].values()) == 2 * m["windows"] and load["fair_share"] == pytest.approx(2 / 3)
    # routing by source: the fixture's corpus is flat text files, one source; judged against the training table
    mix = m["routing_by_source"]
    assert mix["trained"] and [s["source"] for s in mix["sources"]] == ["txt"] and len(mix["experts"]) == 3
    assert sum(sum(s["routed"].values()) for s in mix["sources"]) == 2 * m["windows"]
    assert sum(x["windows"] for x in mix["experts"]) == 2 * m["windows"] and "routing_note" in m
    wt = m["wall_time"]
    assert wt["elapsed_seconds"]["expert_training"] <= wt["actor_seconds"]["expert_training"] + 1e-6
    report = (camp / "eval" / "report.md").read_text()
    for heading in ("Loss per source", "Baselines", "Sensitivity to top-k", "Routing load", "Routing by source"):
        assert heading in report, heading
    assert "Elapsed wall time per category" in report and "Actor-seconds per category" in report
    assert "Wall seconds per category" not in report and not math.isnan(b["seconds"])


def test_compare_pairs_campaigns_and_refuses_other_windows(evaluated, tmp_path):
    camp, _ = evaluated
    twin = tmp_path / "twin"
    shutil.copytree(camp, twin)
    r = soma_here("compare", camp, twin, "--baseline", twin, "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads(r.stdout)
    assert m["baseline"].endswith("twin") and [c["minus_baseline"] for c in m["campaigns"]] == [
        {"nats_per_byte": 0.0, "ci95": [0.0, 0.0]},
        None,
    ]
    table = soma_here("compare", camp, twin)
    assert table.returncode == 0 and "| baseline |" in table.stdout and "+0.0000 [+0.0000, +0.0000]" in table.stdout
    # other test windows: refused, one line naming both campaigns and why, nothing written
    store = Store(str(twin))  # as a campaign prepared from other documents would have it
    store.write_json("test/manifest.json", {**store.read_json("test/manifest.json"), "sha256": "0" * 64})
    before = sorted(p.stat().st_mtime_ns for p in camp.rglob("*"))
    assert_one_line_error(soma_here("compare", camp, twin), "other test windows", "soma fork")
    assert_one_line_error(soma_here("eval", camp, "--compare", twin), "other test windows")
    assert sorted(p.stat().st_mtime_ns for p in camp.rglob("*")) == before
    assert_one_line_error(soma_here("compare", camp), "two campaigns or more")
    assert_one_line_error(soma_here("compare", camp, camp, "--baseline", "elsewhere"), "--baseline elsewhere")
