"""Per-job training curves as CSV files anyone can open: `<campaign>/curves/<job>.csv`, one row per heartbeat
(step, attempt, mean train loss of the chunk, expert-validation loss when measured, the attempt's cumulative
GPU-seconds, eps, lr, wall-clock time), rebuilt from the events log, so they are complete after retries and
resumes. Written by the driver when a stage ends; `soma eval` plots them (eval/curves.png).
"""

from __future__ import annotations

import csv
import io

from soma_cluster.events import JobHistory
from soma_cluster.jobs import Event
from soma_cluster.storage import Store

COLUMNS = ("step", "attempt", "train_loss", "val_loss", "gpu_seconds", "eps", "lr", "t")
DIR = "curves"


def curve_rows(h: JobHistory) -> list[dict]:
    return [
        {
            "step": ev.get("step"),
            "attempt": ev.get("attempt"),
            "train_loss": ev.get("loss"),
            "val_loss": ev.get("val"),
            "gpu_seconds": ev.get("gpu_seconds"),
            "eps": ev.get("eps"),
            "lr": ev.get("lr"),
            "t": ev.get("t"),
        }
        for ev in h.events
        if ev["event"] == Event.HEARTBEAT
    ]


def to_csv(rows: list[dict]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=COLUMNS, lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: "" if r[k] is None else r[k] for k in COLUMNS})
    return buf.getvalue()


def write_curves(store: Store, hist: dict[str, JobHistory], jobs: list[str]) -> list[str]:
    """One CSV per job that has heartbeats; returns the paths written."""
    written = []
    for name in jobs:
        rows = curve_rows(hist[name]) if name in hist else []
        if rows:
            store.write_bytes(f"{DIR}/{name}.csv", to_csv(rows).encode())
            written.append(f"{DIR}/{name}.csv")
    return written


def read_curve(store: Store, name: str) -> list[dict]:
    """A curve back as floats (None where a value was not measured)."""
    text = store.read_bytes(f"{DIR}/{name}.csv").decode()
    return [{k: (float(v) if v != "" else None) for k, v in row.items()} for row in csv.DictReader(io.StringIO(text))]
