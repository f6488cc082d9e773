"""How N experts spread, for the views that cannot give N rows or N lines (the evaluation report and eval/curves.png at
N = 256 or 1,024): the quantiles of a per-expert number, its top and bottom few, and per-step quantile bands of the
experts' curves with the experts that lie furthest outside them. No plotting and no storage here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# the quantiles a spread is told by: the extremes, the 5-95% and 25-75% bands, the median
QUANTILES = {"min": 0.0, "p5": 0.05, "p25": 0.25, "median": 0.5, "p75": 0.75, "p95": 0.95, "max": 1.0}
ROWS_MAX = 16  # at most this many experts, a view lists every one; past it, their spread and extremes


def quantiles(values: list[float]) -> dict[str, float | int | None]:
    """{n, mean, min, p5, p25, median, p75, p95, max} of the finite values (NaN and None left out and not
    counted); every statistic None when none is left."""
    v = np.asarray([x for x in values if x is not None and np.isfinite(x)], dtype=np.float64)
    if v.size == 0:
        return {"n": 0, "mean": None, **{k: None for k in QUANTILES}}
    qs = np.quantile(v, list(QUANTILES.values()))
    return {"n": int(v.size), "mean": float(v.mean()), **{k: float(q) for k, q in zip(QUANTILES, qs, strict=True)}}


def extremes(values: dict[str, float], k: int) -> tuple[list[str], list[str]]:
    """The k names of the lowest values (lowest first) and the k of the highest (highest first), ties by name; the
    two lists never share a name (with fewer than 2k values, the highest take what the lowest left)."""
    ranked = sorted((v, name) for name, v in values.items() if v is not None and np.isfinite(v))
    low = [name for _, name in ranked[:k]]
    high = [name for _, name in reversed(ranked[len(low) :])][:k]
    return low, high


@dataclass(frozen=True)
class Bands:
    """Per-step quantiles of N curves: `steps` (G,) and, for each key of QUANTILES, (G,) values over the curves that
    reach that step (NaN where none does); `count` (G,) how many do."""

    steps: np.ndarray
    q: dict[str, np.ndarray]
    count: np.ndarray


def last_per_step(points: list[tuple[float, float]]) -> tuple[np.ndarray, np.ndarray]:
    """A curve as sorted steps and values, one per step: where a retry or a resume wrote a step again, the last."""
    by_step = {}
    for step, value in points:
        if step is not None and value is not None and np.isfinite(value):
            by_step[float(step)] = float(value)
    steps = np.array(sorted(by_step), dtype=np.float64)
    return steps, np.array([by_step[s] for s in steps], dtype=np.float64)


def bands(curves: dict[str, list[tuple[float, float]]], points: int = 200) -> Bands:
    """Quantile bands of the curves on `points` evenly spaced steps from the first step any curve has to the last;
    each curve counts between its own first and last step (interpolated linearly), not past its end."""
    cleaned = [last_per_step(c) for c in curves.values()]
    cleaned = [(s, v) for s, v in cleaned if s.size]
    if not cleaned:
        empty = np.zeros(0)
        return Bands(empty, {k: empty for k in QUANTILES}, np.zeros(0, dtype=int))
    lo, hi = min(s[0] for s, _ in cleaned), max(s[-1] for s, _ in cleaned)
    grid = np.linspace(lo, hi, points) if hi > lo else np.array([lo])
    at = np.full((len(cleaned), grid.size), np.nan)  # (N, G)
    for i, (s, v) in enumerate(cleaned):
        inside = (grid >= s[0]) & (grid <= s[-1])
        at[i, inside] = np.interp(grid[inside], s, v)
    count = np.isfinite(at).sum(axis=0)
    q = {k: np.full(grid.size, np.nan) for k in QUANTILES}
    reached = count > 0
    if reached.any():
        values = np.nanquantile(at[:, reached], list(QUANTILES.values()), axis=0)  # (Q, G')
        for k, row in zip(QUANTILES, values, strict=True):
            q[k][reached] = row
    return Bands(grid, q, count)


def outliers(finals: dict[str, float], k: int = 3) -> list[tuple[str, str]]:
    """The experts whose final value lies outside the 5-95% range of all the finals, at most k on each side, the
    furthest out first: [(name, 'high' | 'low')]."""
    q = quantiles(list(finals.values()))
    if q["n"] < 2:
        return []
    high = sorted(((v, n) for n, v in finals.items() if v is not None and v > q["p95"]), reverse=True)[:k]
    low = sorted((v, n) for n, v in finals.items() if v is not None and v < q["p5"])[:k]
    return [(n, "high") for _, n in high] + [(n, "low") for _, n in low]
