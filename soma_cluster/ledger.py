"""Append-only GPU-second ledger: one record per heartbeat or stage, totals derived from it alone.

GPU-seconds = wall seconds x GPUs held (fractional allowed), counted from the moment an actor holds
its GPU. Categories stay apart, and so do GPU-seconds, wall seconds and forward counts: `wasted` is work
lost to failures (and the start-up of the retries they cause), `preempted` the same for preemptions (a
node reclaimed or drained), which are no fault of the campaign. Each record names the device its
seconds ran on: "cuda", or "cpu" where a GPU share was logical (a local Ray, or resources.allow_cpu).
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

from soma_cluster.jobs import CATEGORIES, EXPERT_SPEND, Category
from soma_cluster.messages import Usage
from soma_cluster.storage import Store

__all__ = ["CATEGORIES", "EXPERT_SPEND", "LOG", "Ledger", "Totals", "hours_unit"]
LOG = "ledger/ledger.jsonl"


@dataclass
class Totals:
    """Sums of the ledger by category, expert and device: replayed from the records (`Ledger.totals`), or kept
    live by the scheduler as it writes them (soma_cluster/accounting.py), with the same `add`."""

    gpu_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0.0))
    wall_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0.0))
    forwards: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    per_expert_gpu_seconds: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    per_expert_largest: dict[int, float] = field(
        default_factory=lambda: defaultdict(float)
    )  # its largest single record
    devices: dict[str, float] = field(default_factory=lambda: defaultdict(float))  # device -> GPU-seconds on it
    least_startup: float | None = None  # GPU-seconds of the cheapest expert start-up (records with seq 0)
    usd: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0.0))  # at each record's price
    per_expert_usd: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    unpriced_gpu_seconds: float = 0.0  # GPU-seconds of records written without a price
    priced_gpu_seconds: float = 0.0  # and of records written with one (at $0 too)

    def add(
        self,
        category: Category,
        u: Usage,
        *,
        expert: int | None,
        seq: int,
        device: str | None,
        usd_per_hour: float | None = None,
    ) -> None:
        """One record's amounts."""
        if usd_per_hour is None:
            self.unpriced_gpu_seconds += u.gpu_seconds
        else:
            self.priced_gpu_seconds += u.gpu_seconds
            usd = u.gpu_seconds / 3600.0 * usd_per_hour
            self.usd[category] += usd
            if expert is not None and category in EXPERT_SPEND:
                self.per_expert_usd[expert] += usd
        self.gpu_seconds[category] += u.gpu_seconds
        self.wall_seconds[category] += u.wall_seconds
        self.forwards[category] += u.forwards
        self.tokens[category] += u.tokens
        if expert is not None and category in EXPERT_SPEND:
            self.per_expert_gpu_seconds[expert] += u.gpu_seconds
            self.per_expert_largest[expert] = max(self.per_expert_largest[expert], u.gpu_seconds)
        if device and u.gpu_seconds:
            self.devices[device] += u.gpu_seconds
        if expert is not None and seq == 0 and u.gpu_seconds > 0:
            self.least_startup = min(self.least_startup or math.inf, u.gpu_seconds)

    @property
    def usd_priced(self) -> bool:
        """Whether any record carried a price (then the campaign's cost is shown in dollars too, and the GPU-hours
        of records without one as unpriced)."""
        return self.priced_gpu_seconds > 0 or any(v != 0.0 for v in self.usd.values())

    @property
    def gpu_hours(self) -> float:
        return sum(self.gpu_seconds.values()) / 3600.0

    @property
    def unit(self) -> str:
        """What these hours are: real GPU-hours, or logical GPU shares held on a CPU."""
        return hours_unit(self.devices)

    def as_dict(self) -> dict:
        return {
            "gpu_hours_total": self.gpu_hours,
            "gpu_hours": {k: v / 3600.0 for k, v in self.gpu_seconds.items()},
            "wall_seconds": self.wall_seconds,
            "forwards": self.forwards,
            "tokens": self.tokens,
            "per_expert_gpu_hours": {str(k): v / 3600.0 for k, v in sorted(self.per_expert_gpu_seconds.items())},
            "gpu_hours_by_device": {k: v / 3600.0 for k, v in sorted(self.devices.items())},
            "unit": self.unit,
            "usd": dict(self.usd),
            "usd_total": sum(self.usd.values()),
            "unpriced_gpu_hours": self.unpriced_gpu_seconds / 3600.0,
        }


def hours_unit(devices: dict[str, float]) -> str:
    """ "GPU-hours" only where every GPU-second ran on a GPU; else say what they were."""
    used = {d for d, s in devices.items() if s > 0}
    if not used or used == {"cuda"}:
        return "GPU-hours"
    if used == {"cpu"}:
        return "logical GPU-hours on cpu"
    cpu = devices.get("cpu", 0.0) / max(sum(devices.values()), 1e-12)
    return f"GPU-hours ({cpu:.0%} logical, on cpu)"


class Ledger:
    def __init__(self, store: Store, observe: Callable[[dict], None] | None = None):
        self.store = store
        self.observe = observe  # handed each record written (the experiment tracker's feed), after the append

    def record(
        self,
        *,
        category: Category,
        gpu_seconds: float,
        wall_seconds: float,
        expert: int | None = None,
        attempt: int = 0,
        seq: int = 0,
        forwards: int = 0,
        tokens: int = 0,
        step: int | None = None,
        note: str = "",
        device: str | None = None,
        usd_per_hour: float | None = None,
    ) -> None:
        """One record; `usd_per_hour` is the price its GPU-seconds cost (soma_cluster/prices.py), kept with it."""
        if category not in CATEGORIES:
            raise ValueError(f"unknown ledger category {category!r}")
        rid = f"{category}/{expert if expert is not None else '-'}/{attempt}/{seq}"
        rec = {
            "id": rid,
            "category": category,
            "expert": expert,
            "attempt": attempt,
            "seq": seq,
            "gpu_seconds": float(gpu_seconds),
            "wall_seconds": float(wall_seconds),
            "forwards": int(forwards),
            "tokens": int(tokens),
            "step": step,
            "note": note,
            "device": device,
            "t": time.time(),
        }
        if usd_per_hour is not None:  # only then: records of an unpriced campaign stay as they always were
            rec["usd_per_hour"] = float(usd_per_hour)
        self.store.append(LOG, rec)
        if self.observe is not None:
            self.observe(rec)

    def records(self) -> list[dict]:
        """Records in write order, a repeated id (a replayed write) counted once."""
        seen, out = set(), []
        for rec in self.store.read_log(LOG):
            if rec["id"] not in seen:
                seen.add(rec["id"])
                out.append(rec)
        return out

    def totals(self) -> Totals:
        t = Totals()
        for rec in self.records():
            u = Usage.from_record(rec)
            t.add(
                rec["category"],
                u,
                expert=rec["expert"],
                seq=rec.get("seq"),
                device=rec.get("device"),
                usd_per_hour=rec.get("usd_per_hour"),
            )
        return t
