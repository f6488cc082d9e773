"""Dollars without Ray: the price in force per device, records that keep their price (a price changed later never
rewrites the past), budgets in dollars enforced as the GPU-hour ones are, the plan and the status in dollars."""

from __future__ import annotations

import pytest
from conftest import micro_config
from test_schedule import PER_UPDATE, beat, by, scheduler, started

from soma_cluster.config import resolve
from soma_cluster.errors import SomaError
from soma_cluster.jobs import Job, JobState
from soma_cluster.ledger import Ledger
from soma_cluster.messages import ChunkReport
from soma_cluster.metricpoints import Metric, reading
from soma_cluster.prices import usd_per_hour
from soma_cluster.schedule import Chunk
from soma_cluster.snapshot import build

TABLE = {"gpu": {"H100": {"on_demand": 4.0, "spot": 1.6}, "L4": {"on_demand": 0.8}}, "accelerator": "H100"}


def test_the_price_in_force_per_device():
    cfg = resolve("tiny", {"prices": {**TABLE, "cpu_hour": 0.1}})
    assert usd_per_hour(cfg.prices, "cuda") == 4.0 and usd_per_hour(cfg.prices, "cpu") == 0.1
    assert usd_per_hour(cfg.prices, None) == 4.0
    spot = resolve("tiny", {"prices": {**TABLE, "spot": True}})
    assert usd_per_hour(spot.prices, "cuda") == 1.6 and usd_per_hour(spot.prices, "cpu") is None
    assert usd_per_hour(resolve("tiny").prices, "cuda") is None


@pytest.mark.parametrize(
    "prices,budget,words",
    [
        ({"accelerator": "A100"}, {}, "not in the price table"),
        ({**TABLE, "accelerator": "L4", "spot": True}, {}, "no spot price"),
        ({"gpu": {"H100": {"on_demand": -4}}}, {}, "prices.gpu.H100.on_demand"),
        ({"gpu": {"H100": {"spot": 1.0}}}, {}, "prices.gpu.H100.on_demand"),
        ({}, {"campaign_usd": 100.0}, "needs a price"),
        (TABLE, {"campaign_usd": -1.0}, "budget.campaign_usd"),
    ],
)
def test_a_price_table_that_cannot_hold_is_one_message(prices, budget, words):
    with pytest.raises(SomaError, match=words):
        resolve("tiny", {"prices": prices, "budget": budget})


def test_records_keep_their_price_and_a_later_price_never_rewrites_them(tmp_path):
    s = scheduler(tmp_path, n_experts=1, prices={"cpu_hour": 3600.0})  # $1 per GPU-second: easy sums
    s.restore({})
    (a,) = s.requests(1)
    by(s.on_setup(a.unit.id, started([0], gpu_s=2.0)), Chunk)
    s.on_chunk(a.unit.id, ChunkReport({0: beat(3, 5.0, 3 * PER_UPDATE)}, 5.0))
    s.revise(s.cfg.model_copy(update={"prices": s.cfg.prices.model_copy(update={"cpu_hour": 7200.0})}), [])
    s.on_chunk(a.unit.id, ChunkReport({0: beat(12, 6.0, 12 * PER_UPDATE, reason="finished")}, 6.0))
    recs = Ledger(s.store).records()
    assert [r["usd_per_hour"] for r in recs] == [3600.0, 3600.0, 7200.0]
    totals = Ledger(s.store).totals()
    assert totals.usd["expert_training"] == pytest.approx(2.0 + 3.0 + 2 * 1.0)  # each second at its own price
    assert totals.per_expert_usd[0] == pytest.approx(7.0) and totals.unpriced_gpu_seconds == 0.0
    assert s.books.totals.usd["expert_training"] == pytest.approx(7.0)  # the live totals agree with the replay


def test_an_unpriced_campaign_writes_the_records_it_always_wrote(tmp_path):
    s = scheduler(tmp_path, n_experts=1)
    s.restore({})
    (a,) = s.requests(1)
    s.on_setup(a.unit.id, started([0], gpu_s=2.0))
    (rec,) = Ledger(s.store).records()
    assert "usd_per_hour" not in rec and Ledger(s.store).totals().unpriced_gpu_seconds == 2.0


def test_a_dollar_budget_caps_like_a_gpu_hour_one(tmp_path):
    s = scheduler(tmp_path, n_experts=2, prices={"cpu_hour": 3600.0}, budget={"expert_usd": 10.0})
    s.restore({})
    a, b = s.requests(2)
    chunk = by(s.on_setup(a.unit.id, started([0], gpu_s=2.0)), Chunk)[0]
    assert chunk.caps[0] == pytest.approx(10.0)  # $10 left at $1 per GPU-second, on the worker's clock
    s.on_chunk(a.unit.id, ChunkReport({0: beat(3, 6.0, 3 * PER_UPDATE)}, 6.0))
    s.on_chunk(a.unit.id, ChunkReport({0: beat(3, 9.5, 3 * PER_UPDATE, reason="budget_exhausted")}, 9.5))
    assert s.outcome[Job(0)] == JobState.BUDGET_EXHAUSTED
    tighter = micro_config(prices={"cpu_hour": 3600.0}, budget={"expert_usd": 10.0, "expert_gpu_hours": 4 / 3600})
    s.revise(tighter, [])
    nxt = by(s.on_setup(b.unit.id, started([1], gpu_s=1.0)), Chunk)[0]
    assert nxt.caps[1] == pytest.approx(4.0)  # the GPU-hour cap binds now: the tighter of the two


def test_status_and_metrics_show_dollars_and_the_caps_in_force():
    cfg = micro_config(prices={"cpu_hour": 0.5}, budget={"campaign_usd": 20.0})
    snap = build(
        cfg=cfg,
        url="/c",
        rows={},
        by_category_s={"expert_training": 7200.0},
        devices={"cpu": 7200.0},
        started_at=None,
        rate=None,
        final=False,
        source="events",
        usd={"expert_training": 1.0},
        unpriced_s=1800.0,
    )
    assert snap["usd_total"] == 1.0 and snap["budget"]["campaign_usd"] == 20.0 and snap["unpriced_gpu_hours"] == 0.5
    points = {(p.metric, p.labels): p.value for p in reading(snap).points}
    assert points[(Metric.USD, (("category", "expert_training"),))] == 1.0
    assert points[(Metric.UNPRICED, ())] == 0.5  # what had no price is shown as such, never as $0
    from pipelines.status import header
    from soma_cluster.snapshot import summary_line

    shown = header({**snap, "stale": False}).plain
    assert "$1.00 at the prices recorded: expert_training $1.00; 0.5000 logical GPU-hours on cpu have no price" in shown
    assert "$1.00 + 0.5000 GPU-hours unpriced" in summary_line(snap)
    assert points[(Metric.BUDGET, (("cap", "campaign_usd"),))] == 20.0
    assert points[(Metric.BUDGET, (("cap", "expert_gpu_hours"),))] == -1.0


def test_a_record_priced_at_zero_is_priced_and_one_without_a_price_is_counted_apart(tmp_path):
    """A $0 price (a free CPU share) still makes the campaign priced; records with no price are unpriced GPU-hours,
    shown in the status beside the dollars, never folded into them."""
    from soma_cluster.storage import Store

    ledger = Ledger(Store(str(tmp_path)))
    ledger.record(category="expert_training", gpu_seconds=3600.0, wall_seconds=3600.0, expert=0, usd_per_hour=0.0)
    ledger.record(category="expert_training", gpu_seconds=1800.0, wall_seconds=1800.0, expert=0, seq=1)
    t = ledger.totals()
    assert t.usd_priced and t.priced_gpu_seconds == 3600.0 and t.unpriced_gpu_seconds == 1800.0
    assert t.as_dict()["unpriced_gpu_hours"] == 0.5 and t.as_dict()["usd_total"] == 0.0
