"""Experiment specs resolve to valid campaigns; the report's verdicts and README section are what was measured."""

import math

import pytest

from pipelines.report import BEGIN, END, mean_interval, readme_section, update_readme, verdicts
from soma_cluster.config import resolve
from soma_cluster.errors import SomaError
from soma_cluster.experimentspecs import arm_configs, experiment_names, load_spec, width_for
from soma_cluster.model import campaign_param_count
from soma_cluster.variance import separable_ratio


def test_shipped_experiments_resolve_at_both_scales():
    assert set(experiment_names()) >= {"variance", "summed", "zo-compare", "scaling"}
    for name in experiment_names():
        spec = load_spec(name)
        assert set(spec.scales) == {"small", "paper"}
        for scale in spec.scales:
            cfgs = arm_configs(spec, scale, seed=spec.seeds_at(scale)[0])
            assert set(cfgs) == {a.name for a in spec.arms}
            for arm in spec.arms:
                cfg = cfgs[arm.name]
                if arm.match_params:  # the same total size as the arm it is matched to, within 1%
                    ref = cfgs[arm.match_params]
                    want = campaign_param_count(ref.model, ref.n_experts)
                    assert abs(campaign_param_count(cfg.model, cfg.n_experts) - want) / want < 0.01
                    assert cfg.model.head == ("shared_frozen" if cfg.model.d == ref.model.embed_dim else "own")
                if arm.fork:  # a fork may change training only: same data, model and seed stage
                    parent = cfgs[arm.fork]
                    for key in ("n_experts", "seed", "corpus", "router", "shards", "model", "seed_stage"):
                        assert getattr(cfg, key) == getattr(parent, key), (name, arm.name, key)
                if spec.scales[scale].pack_all:
                    assert cfg.resources.experts_per_actor == cfg.n_experts


def test_paper_scale_uses_the_paper_shapes():
    zo = arm_configs(load_spec("zo-compare"), "paper", 0)
    assert zo["soma"].n_experts == 2 and zo["soma"].model.d == 361 and zo["soma"].spsa.n_pert == 64
    assert (
        zo["eggroll"].train.method == "eggroll" and zo["eggroll"].n_experts == 1 and zo["bptt"].train.method == "bptt"
    )
    sc = arm_configs(load_spec("scaling"), "paper", 0)
    assert sc["narrow"].n_experts == 256 and sc["n8"].model.d in (180, 181)


def test_width_solver_and_summed_control_needs_one_pack():
    assert width_for(8, 139_904, 32, 2) == 16  # 8 x (32*16^2 + 69*16 + 8192) = 139,904 exactly
    assert width_for(4, 139_904, 32, 2) == 32
    with pytest.raises(SomaError, match="experts_per_actor=4"):
        resolve("tiny", {"spsa": {"objective": "summed"}})
    assert (
        resolve("tiny", {"spsa": {"objective": "summed"}, "resources": {"experts_per_actor": 4}}).spsa.objective
        == "summed"
    )


def test_unknown_experiment_and_scale_are_one_line_errors():
    with pytest.raises(SomaError, match="unknown experiment 'nope'; choose one of"):
        load_spec("nope")
    with pytest.raises(SomaError, match="has no scale 'huge'"):
        arm_configs(load_spec("summed"), "huge", 0)


def test_variance_ratio_tracks_the_prediction_on_a_fixed_objective():
    for n in (2, 4):
        r = separable_ratio(params=1024, n_blocks=n, draws=3000, probe="rademacher", seed=1)
        assert abs(r.ratio / r.predicted_ratio - 1) < 0.1, r.as_dict()
        assert abs(r.rel_var_independent / (1024 / n - 1) - 1) < 0.1  # V = m - 1 for m coordinates
    t = separable_ratio(params=1024, n_blocks=4, draws=3000, probe="ternary", seed=1)
    assert abs(t.ratio * 4 - 1) < 0.1


def _arm(nats, diff=None, lo=None, hi=None, method="spsa"):
    v = {"nats_per_byte": nats, "ci95": [nats - 0.01, nats + 0.01]}
    d = None if diff is None else {"nats_per_byte": diff, "ci95": [lo, hi]}
    return {"ensemble": v, "vs_reference": d, "method": method}


def test_verdicts_say_where_the_sign_matches_and_where_not():
    res = {
        "reference": "soma",
        "expect": [
            {"better": "soma", "worse": "mono", "paper": "1.76 vs 2.00"},
            {"better": "bptt", "worse": "soma", "paper": "1.05 vs 1.83"},
        ],
        "seeds": {
            "0": {"soma": _arm(2.0), "mono": _arm(2.1, +0.1, 0.05, 0.15), "bptt": _arm(2.3, +0.3, 0.2, 0.4, "bptt")}
        },
    }
    soma_mono, bptt_soma = verdicts(res)
    assert (
        "soma minus mono = -0.1000" in soma_mono
        and "matches the paper's sign" in soma_mono
        and "excludes zero" in soma_mono
    )
    assert "bptt minus soma = +0.3000" in bptt_soma and "does NOT match" in bptt_soma


def test_mean_interval_across_seeds():
    m, lo, hi = mean_interval([1.0, 2.0, 3.0])
    assert m == 2.0 and math.isclose(hi - m, 4.303 * 1.0 / math.sqrt(3), rel_tol=1e-4) and math.isclose(m - lo, hi - m)
    assert mean_interval([1.5]) == (1.5, 1.5, 1.5)
    # t_{0.975} from the printed tables: df = 10 is 2.228 (a table that stopped at df = 9 used 1.96 there),
    # df = 30 2.042
    for n, t in ((11, 2.228), (31, 2.042), (121, 1.980)):
        values = [0.0, 2.0] * (n // 2) + [1.0]  # mean 1, sample sd known exactly
        sd = math.sqrt(sum((v - 1.0) ** 2 for v in values) / (n - 1))
        m, lo, hi = mean_interval(values)
        assert math.isclose(hi - m, t * sd / math.sqrt(n), rel_tol=5e-4), (n, (hi - m) * math.sqrt(n) / sd)


def test_readme_results_block_is_replaced_and_nothing_else(tmp_path):
    res = {
        "title": "T",
        "scale": "small",
        "kind": "variance",
        "question": "Q?",
        "seeds": {
            "0": {
                "fixed": [
                    {
                        "probe": "rademacher",
                        "n_blocks": 2,
                        "params": 64,
                        "rel_var_independent": 31.0,
                        "rel_var_shared": 63.0,
                        "reduction": 2.03,
                        "predicted_reduction": 2.03,
                    }
                ]
            }
        },
    }
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\nintro\n\n## Layout\n\nend\n")
    update_readme(str(readme), readme_section([("runs/v", res)]))
    first = readme.read_text()
    assert first.index(BEGIN) < first.index("## Layout") and "| 0 | fixed separable | rademacher | 2 | 64 |" in first
    update_readme(str(readme), readme_section([("runs/v2", res)]))
    second = readme.read_text()
    assert (
        second.count(BEGIN) == 1
        and second.count(END) == 1
        and "runs/v2/report.md" in second
        and "runs/v/report" not in second
    )
    assert second.startswith("# x\n\nintro\n") and second.endswith("## Layout\n\nend\n")
