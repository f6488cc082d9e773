"""The experts' spread where N rows or N curves cannot be read (soma_cluster/spread.py), and the views built on it
(pipelines/expertviews.py): `soma eval`'s report and eval/curves.png at N = 256 from synthetic metrics and curves,
no training."""

from __future__ import annotations

import re

import numpy as np
from conftest import micro_config

from pipelines.evaluate import report
from pipelines.expertviews import expert_lines, expert_spread, plot_curves
from soma_cluster.jobcurves import DIR, to_csv
from soma_cluster.jobs import expert_name
from soma_cluster.spread import ROWS_MAX, bands, extremes, outliers, quantiles
from soma_cluster.storage import Store


def test_quantiles_extremes_and_outliers():
    q = quantiles([float(x) for x in range(101)] + [None, float("nan")])
    assert q["n"] == 101 and q["min"] == 0 and q["p5"] == 5 and q["median"] == 50 and q["p95"] == 95 and q["max"] == 100
    assert quantiles([])["median"] is None and quantiles([None])["n"] == 0
    values = {f"e{i}": float(i) for i in range(10)}
    assert extremes(values, 3) == (["e0", "e1", "e2"], ["e9", "e8", "e7"])
    assert extremes({"a": 1.0, "b": 2.0, "c": 3.0}, 2) == (["a", "b"], ["c"])  # never the same expert twice
    finals = {f"e{i:03d}": 3.0 + 0.001 * i for i in range(100)} | {"hot": 9.0, "cold": 1.0}
    assert outliers(finals, k=2) == [("hot", "high"), ("e099", "high"), ("cold", "low"), ("e000", "low")]
    assert outliers({"only": 1.0}) == []


def test_bands_follow_each_curve_only_over_its_own_steps():
    """A curve counts between its own first and last step: one that stopped at 100 (budget) does not drag the band
    past its end; a step written twice (a retry) counts its last value."""
    curves = {
        "a": [(0, 4.0), (100, 3.0), (200, 2.0)],
        "b": [(0, 4.0), (100, 3.0), (50, 9.0), (100, 3.0), (200, 2.0)],  # a retry from step 50: the last values win
        "c": [(0, 4.0), (100, 3.0)],  # stopped early
    }
    b = bands(curves, points=5)
    assert list(b.steps) == [0, 50, 100, 150, 200] and list(b.count) == [3, 3, 3, 2, 2]
    assert b.q["max"][1] == 9.0 and b.q["median"][2] == 3.0 and b.q["max"][4] == 2.0
    assert bands({}).steps.size == 0


def _metrics(n: int, rng: np.random.Generator) -> dict:
    """eval/metrics.json's fields that the report reads, for N experts (27 of them routed no window, as at N = 256
    with eval.max_windows = 256)."""
    val = rng.normal(3.5, 0.1, n)
    val[7], val[n // 2] = 5.17, 5.11  # the two worst, as in the N = 256 run
    per = {
        expert_name(e): {"own_val_nats": float(val[e]), "step": 300 if e % 9 else 60, "routed_windows": int(e >= 27)}
        for e in range(n)
    }
    ci = {"nats_per_byte": 3.51, "ci95": [3.49, 3.53], "bits_per_byte": 5.06}
    return {
        "windows": 2310,
        "documents": 40,
        "scored_bytes": 2310 * 768,
        "ensemble": ci,
        "seed": ci,
        "uniform": {"nats_per_byte": 5.545, "bits_per_byte": 8.0},
        "ensemble_minus_seed": {"nats_per_byte": -0.06, "ci95": [-0.07, -0.05]},
        "per_expert": per,
        "expert_test_nats": {name: float(v["own_val_nats"]) + 0.01 for name, v in per.items()},
        "parameters": 1000,
        "top_k": 4,
        "weighting": "softmax",
        "routing_time_share": 0.1,
        "byte_tokens_per_second": 1e5,
        "device": "cpu",
        "ledger": {"gpu_hours_total": 0.69, "unit": "GPU-hours", "gpu_hours": {}, "forwards": {}, "wall_seconds": {}},
        "curves_figure": "eval/curves.png",
        "curves_outliers": [{"expert": "expert-0007", "side": "high", "final_loss": 5.17}],
    }


def test_the_report_at_n_256_shows_spread_and_extremes_not_256_rows():
    rng = np.random.default_rng(0)
    for n in (256, 1024):
        m = _metrics(n, rng)
        m["expert_spread"] = expert_spread(m)
        text = report(micro_config(n_experts=n), m)
        rows = [line for line in text.splitlines() if re.match(r"\| (best|worst) \d \| expert-\d{4} \|", line)]
        assert len(rows) == 10, rows  # the 5 best and the 5 worst by own-shard validation loss
        assert rows[5].startswith("| worst 1 | expert-0007 |") and f"| worst 2 | expert-{n // 2:04d} |" in rows[6]
        for label in ("own-shard val nats/byte", "test nats/byte, alone", "windows routed to it", "updates"):
            assert re.search(rf"\| {re.escape(label)} \| {n} \|", text), label
        assert "27 of" in text and "experts were routed no test window: expert-0000" in text and "and 19 more" in text
        assert "median and the 25-75% and 5-95% bands" in text and "expert-0007 (high, 5.1700)" in text
        assert m["expert_spread"]["updates"]["min"] == 60 and len(m["expert_spread"]["unrouted"]) == 27
    small = _metrics(ROWS_MAX, rng)
    table = expert_lines(small)
    assert sum(line.startswith("| expert-") for line in table.splitlines()) == ROWS_MAX  # small N: every row stays
    assert "one per expert" in report(micro_config(n_experts=ROWS_MAX), small)


def _write_curves(store: Store, n: int, rng: np.random.Generator) -> None:
    for e in range(n):
        stop = 120 if e == 5 else 300  # one stopped by its budget
        lift = 1.5 if e == 9 else -1.0 if e == 11 else 0.0  # one far above, one far below the rest
        rows = [
            {
                "step": s,
                "attempt": 0,
                "train_loss": 5.0 - s / 150 + lift + rng.normal(0, 0.02),
                "val_loss": 5.1 - s / 150 + lift + rng.normal(0, 0.02) if s % 50 == 0 else None,
                "gpu_seconds": s * 0.1,
                "eps": 1e-3,
                "lr": 1e-3,
                "t": float(s),
            }
            for s in range(10, stop + 1, 10)
        ]
        store.write_bytes(f"{DIR}/{expert_name(e)}.csv", to_csv(rows).encode())


def test_curves_png_at_n_256_draws_bands_and_names_its_outliers(tmp_path):
    rng = np.random.default_rng(1)
    store = Store(str(tmp_path / "c"))
    _write_curves(store, 256, rng)
    path, named = plot_curves(store, micro_config(n_experts=256))
    assert path == "eval/curves.png" and (tmp_path / "c" / path).stat().st_size > 10_000
    # the furthest out first on each side: the lifted one, then the one its budget stopped at step 120 (its last
    # expert-val loss is higher); below, the lowered one; at most 3 on each side
    sides = [(o["expert"], o["side"]) for o in named]
    assert sides[:2] == [("expert-0009", "high"), ("expert-0005", "high")] and sides[3] == ("expert-0011", "low")
    assert len(named) == 6, named
    import matplotlib.image

    png = matplotlib.image.imread(str(tmp_path / "c" / path))
    assert png.shape[0] > 300 and png.shape[1] > 600  # a 7 x 4 in figure at 110 dpi
    small = Store(str(tmp_path / "s"))
    _write_curves(small, 4, rng)
    assert plot_curves(small, micro_config(n_experts=4)) == ("eval/curves.png", [])  # per-expert lines
    assert plot_curves(Store(str(tmp_path / "none")), micro_config(n_experts=4)) == (None, [])
