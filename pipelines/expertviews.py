"""The experts in `soma eval`'s report and in eval/curves.png, at any N: up to spread.ROWS_MAX experts, a row and a
curve each; past it (N = 256 gave a 256-row table and 256 merged curves), the spread of each per-expert number, the
best and worst few, and quantile bands of the curves with their outliers named. Every row stays in eval/metrics.json
(`per_expert`, `expert_test_nats`)."""

from __future__ import annotations

import io
import math

import numpy as np

from soma_cluster.config import CampaignConfig
from soma_cluster.jobcurves import DIR as CURVES
from soma_cluster.jobcurves import read_curve
from soma_cluster.jobs import expert_name
from soma_cluster.spread import ROWS_MAX, Bands, bands, extremes, last_per_step, outliers, quantiles
from soma_cluster.storage import Store

EXTREMES = 5  # best and worst experts the report names past ROWS_MAX
UNROUTED_NAMED = 8  # experts routed no window, named before the count of the rest
# a per-expert number of the report: its key in expert_spread, its label, and its format
SPREAD_ROWS = (
    ("own_val_nats", "own-shard val nats/byte", ".4f"),
    ("test_nats_alone", "test nats/byte, alone", ".4f"),
    ("routed_windows", "windows routed to it", ".0f"),
    ("updates", "updates", ".0f"),
)


def expert_spread(m: dict) -> dict:
    """The quantiles over the experts of each per-expert number (spread.quantiles), and the experts routed no test
    window: what metrics.json's `expert_spread` holds."""
    per, alone = m["per_expert"], m.get("expert_test_nats") or {}
    return {
        "own_val_nats": quantiles([v["own_val_nats"] for v in per.values()]),
        "test_nats_alone": quantiles(list(alone.values())),
        "routed_windows": quantiles([v["routed_windows"] for v in per.values()]),
        "updates": quantiles([v["step"] for v in per.values()]),
        "unrouted": [name for name, v in per.items() if v["routed_windows"] == 0],
    }


def _row(name: str, v: dict, alone: dict) -> str:
    return (
        f"| {name} | {v['step']} | {v['own_val_nats']:.4f} | {alone.get(name, math.nan):.4f} | {v['routed_windows']} |"
    )


HEAD = (
    "| expert | updates | own-shard val nats/byte | test nats/byte, alone | windows routed to it |\n"
    "|---|---|---|---|---|"
)


def expert_lines(m: dict) -> str:
    """The report's experts: every row up to ROWS_MAX experts; past it, the spread of each number, who got no window,
    and the EXTREMES best and worst by own-shard validation loss."""
    per, alone = m["per_expert"], m.get("expert_test_nats") or {}
    if len(per) <= ROWS_MAX:
        return HEAD + "\n" + "\n".join(_row(name, v, alone) for name, v in per.items()) + "\n"
    spread = m.get("expert_spread") or expert_spread(m)
    rows = "\n".join(f"| {label} | {spread[k]['n']} | {_cells(spread[k], fmt)} |" for k, label, fmt in SPREAD_ROWS)
    low, high = extremes({name: v["own_val_nats"] for name, v in per.items()}, EXTREMES)
    named = "\n".join(
        [f"| best {i + 1} {_row(name, per[name], alone)}" for i, name in enumerate(low)]
        + [f"| worst {i + 1} {_row(name, per[name], alone)}" for i, name in enumerate(high)]
    )
    unrouted = spread["unrouted"]
    idle = (
        f"{len(unrouted)} of {len(per)} experts were routed no test window: "
        + ", ".join(unrouted[:UNROUTED_NAMED])
        + (f" and {len(unrouted) - UNROUTED_NAMED} more" if len(unrouted) > UNROUTED_NAMED else "")
        + ".\n\n"
        if unrouted
        else ""
    )
    return f"""### The {len(per)} experts

Over the {len(per)} experts (every row in `metrics.json`: `per_expert`, `expert_test_nats`), the spread of each
number; test loss alone is on the baselines' windows, for the experts scored there.

| per expert | experts | min | 5% | 25% | median | 75% | 95% | max | mean |
|---|---|---|---|---|---|---|---|---|---|
{rows}

{idle}The {len(low)} best and the {len(high)} worst experts by own-shard validation loss:

| rank {HEAD.replace("|---|", "|---|---|", 1)}
{named}
"""


QUANTILE_KEYS = ("min", "p5", "p25", "median", "p75", "p95", "max", "mean")


def _cells(q: dict, fmt: str) -> str:
    return " | ".join("-" if q[k] is None else f"{q[k]:{fmt}}" for k in QUANTILE_KEYS)


def capped(rows: list[str], what: str) -> tuple[list[str], str]:
    """A report table's rows, at most ROWS_MAX of them, and a line saying how many more `what` holds (or '')."""
    if len(rows) <= ROWS_MAX:
        return rows, ""
    return rows[:ROWS_MAX], f"\n\nThe first {ROWS_MAX} of {len(rows)}; all of them in `metrics.json`'s `{what}`."


# -- eval/curves.png ----------------------------------------------------------------------------------------------
def read_curves(store: Store, cfg: CampaignConfig) -> dict[str, tuple[list, list]]:
    """expert name -> ([(step, train loss)], [(step, expert-val loss)]), for the experts with a curve CSV."""
    out = {}
    for e in range(cfg.n_experts):
        name = expert_name(e)
        if store.exists(f"{CURVES}/{name}.csv"):
            rows = read_curve(store, name)
            out[name] = (
                [(r["step"], r["train_loss"]) for r in rows if r["train_loss"] is not None],
                [(r["step"], r["val_loss"]) for r in rows if r["val_loss"] is not None],
            )
    return out


def final_losses(curves: dict[str, tuple[list, list]]) -> dict[str, float]:
    """Each expert's last expert-validation loss, or its last training loss where it never validated."""
    out = {}
    for name, (train, val) in curves.items():
        steps, values = last_per_step(val or train)
        if values.size:
            out[name] = float(values[-1])
    return out


def plot_curves(store: Store, cfg: CampaignConfig) -> tuple[str | None, list[dict]]:
    """eval/curves.png from curves/*.csv, and the experts it names as outliers ([{expert, side, final_loss}]). Up to
    ROWS_MAX experts, each one's train loss (a line) and expert-validation loss (dots); past it, the median and the
    25-75%, 5-95% and min-max bands over the experts at each step, with the outliers' own curves named. (None, [])
    when no curve was written (a campaign from before the CSVs)."""
    curves = read_curves(store, cfg)
    if not curves:
        return None, []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    named = []
    if cfg.n_experts <= ROWS_MAX:  # as the report's caption decides (curves_caption)
        _each(ax, plt, curves)
        ax.set_title(f"{cfg.name}: per-expert train (lines) and expert-val (dots) loss")
    else:
        finals = final_losses(curves)
        named = [{"expert": n, "side": side, "final_loss": finals[n]} for n, side in outliers(finals)]
        _bands(ax, bands({n: t for n, (t, _) in curves.items()}), "tab:blue", "train")
        _bands(ax, bands({n: v for n, (_, v) in curves.items()}), "tab:orange", "expert-val", dots=True)
        for o, color in zip(named, plt.cm.tab10(np.linspace(0.2, 0.9, max(1, len(named)))), strict=False):
            steps, values = last_per_step(curves[o["expert"]][0])
            ax.plot(
                steps,
                values,
                lw=0.8,
                color=color,
                label=f"{o['expert']} (final val {o['final_loss']:.3f}, {o['side']})",
            )
        ax.set_title(f"{cfg.name}: {len(curves)} experts' loss, median and quantile bands", fontsize=10)
        ax.legend(fontsize=6, ncol=2)
    ax.set_xlabel("update (step)")
    ax.set_ylabel("nats/byte")
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    store.write_bytes("eval/curves.png", buf.getvalue())
    return "eval/curves.png", named


def _each(ax, plt, curves: dict[str, tuple[list, list]]) -> None:
    colors = plt.cm.viridis(np.linspace(0, 0.9, len(curves)))
    for (name, (train, val)), color in zip(curves.items(), colors, strict=True):
        if train:
            ax.plot(*zip(*train, strict=True), lw=0.8, color=color, alpha=0.6)
        if val:
            ax.plot(*zip(*val, strict=True), "o", ms=3, color=color, label=name)
    ax.legend(fontsize=6, ncol=2)


def _bands(ax, b: Bands, color: str, what: str, dots: bool = False) -> None:
    """The median (a line, or dots for sparse validation points), 25-75% and 5-95% shaded, min-max dotted."""
    if not b.steps.size:
        return
    q = b.q
    ax.fill_between(b.steps, q["p5"], q["p95"], color=color, alpha=0.15, lw=0, label=f"{what} 5-95%")
    ax.fill_between(b.steps, q["p25"], q["p75"], color=color, alpha=0.35, lw=0, label=f"{what} 25-75%")
    ax.plot(b.steps, q["min"], ":", color=color, lw=0.6)
    ax.plot(b.steps, q["max"], ":", color=color, lw=0.6, label=f"{what} min-max")
    ax.plot(b.steps, q["median"], "--" if dots else "-", color=color, lw=1.4, label=f"{what} median")


def curves_caption(m: dict, n_experts: int) -> str:
    """The report's words for eval/curves.png ('' when there is none)."""
    if not m.get("curves_figure"):
        return ""
    if n_experts <= ROWS_MAX:
        return "Training curves (from `curves/*.csv`, one per expert):\n\n![per-expert curves](curves.png)\n"
    named = m.get("curves_outliers") or []
    who = ", ".join(f"{o['expert']} ({o['side']}, {o['final_loss']:.4f})" for o in named) or "none"
    return (
        f"Training curves (from `curves/*.csv`): over the experts at each step, the median and the 25-75%"
        " and 5-95% bands of the train (blue) and expert-validation (orange) loss, min-max dotted; drawn and named,"
        f" the experts whose final expert-validation loss lies outside 5-95%: {who}.\n\n"
        "![per-expert curves, in bands](curves.png)\n"
    )
