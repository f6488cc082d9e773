"""Append-only GPU-second ledger: one record per heartbeat or stage, totals derived from it alone.

GPU-seconds = wall seconds x GPUs held (fractional allowed), counted from the moment an actor holds
its GPU. Categories stay apart, and so do GPU-seconds, wall seconds and forward counts.
"""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

from soma_cluster.storage import Store

CATEGORIES = ("preprocessing", "seed", "expert_training", "wasted", "evaluation")
LOG = "ledger/ledger.jsonl"


@dataclass
class Totals:
    gpu_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0.0))
    wall_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0.0))
    forwards: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    per_expert_gpu_seconds: dict[int, float] = field(default_factory=lambda: defaultdict(float))

    @property
    def gpu_hours(self) -> float:
        return sum(self.gpu_seconds.values()) / 3600.0

    def as_dict(self) -> dict:
        return {"gpu_hours_total": self.gpu_hours,
                "gpu_hours": {k: v / 3600.0 for k, v in self.gpu_seconds.items()},
                "wall_seconds": self.wall_seconds, "forwards": self.forwards, "tokens": self.tokens,
                "per_expert_gpu_hours": {str(k): v / 3600.0 for k, v in sorted(self.per_expert_gpu_seconds.items())}}


class Ledger:
    def __init__(self, store: Store):
        self.store = store

    def record(self, category: str, gpu_seconds: float, wall_seconds: float, *, expert: int | None = None,
               attempt: int = 0, seq: int = 0, forwards: int = 0, tokens: int = 0, step: int | None = None, note: str = "") -> None:
        if category not in CATEGORIES:
            raise ValueError(f"unknown ledger category {category!r}")
        rid = f"{category}/{expert if expert is not None else '-'}/{attempt}/{seq}"
        self.store.append(LOG, {"id": rid, "category": category, "expert": expert, "attempt": attempt, "seq": seq,
                                "gpu_seconds": float(gpu_seconds), "wall_seconds": float(wall_seconds),
                                "forwards": int(forwards), "tokens": int(tokens), "step": step, "note": note, "t": time.time()})

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
            c = rec["category"]
            t.gpu_seconds[c] += rec["gpu_seconds"]
            t.wall_seconds[c] += rec["wall_seconds"]
            t.forwards[c] += rec["forwards"]
            t.tokens[c] += rec["tokens"]
            if rec["expert"] is not None and c in ("expert_training", "wasted"):
                t.per_expert_gpu_seconds[rec["expert"]] += rec["gpu_seconds"]
        return t
