"""The campaign's state at a glance: one small JSON object, `<campaign>/status.json`, that the driver rewrites
(atomically: one whole-object PUT) every few seconds and once at its end, so `soma status` reads one object
for 256 experts instead of every log record. No Ray here: the rows come from a Scheduler or, for a campaign
written before this file existed, from its events log and ledger.

The schema (`schema: 1`) is part of the CLI's contract (`soma status --json` prints it; docs/json.md);
fields are only ever added.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from soma_cluster.config import CampaignConfig
from soma_cluster.events import JobHistory
from soma_cluster.jobs import (
    CATEGORIES,
    IN_FLIGHT,
    SEED_JOB,
    STATES,
    TERMINAL,
    Category,
    Job,
    JobState,
    JobStatus,
    JobView,
    expert_jobs,
)
from soma_cluster.ledger import Totals, hours_unit
from soma_cluster.statusview import experts_text, experts_view

if TYPE_CHECKING:
    from soma_cluster.schedule import Scheduler

__all__ = ["IN_FLIGHT", "SNAPSHOT", "STATES", "build", "history_rows", "scheduler_rows", "summary_line"]
SNAPSHOT = "status.json"
SCHEMA = 1


def target(cfg: CampaignConfig, job: Job) -> int:
    return cfg.seed_stage.updates if job.expert is None else cfg.train.updates


def _row(cfg: CampaignConfig, job: Job, s: JobStatus) -> dict:
    return {
        "job": job.name,
        "expert": job.expert,
        "state": s.state,
        "step": s.view.step,
        "target": target(cfg, job),
        "val": s.view.val,
        "loss": s.view.loss,
        "gpu_hours": s.spent_s / 3600.0,
        "budget_left_gpu_hours": None if s.left_s is None else max(0.0, s.left_s) / 3600.0,
        # s.retries counts failures against retry.max_retries; each is followed by a retry, except the one that
        # ended the job (the error line's "failed after 2 retries" is 3 failures)
        "retries": max(0, s.retries - (s.state == JobState.FAILED_PERMANENTLY)),
        "failures": s.retries,
        "node": s.view.node,
        "device": s.view.device,
        "last_error": s.view.last_error,
        "heartbeat_age_s": s.beat_age_s,
        "starting": s.starting,
    }


def scheduler_rows(sched: Scheduler) -> dict[str, dict]:
    """job name -> row, for the jobs this scheduler runs: where each stands now, by the scheduler's own state
    machine (not the last event it wrote)."""
    on_gpu = sched.on_gpu()
    return {job.name: _row(sched.cfg, job, sched.status(job, on_gpu)) for job in sched.jobs}


def history_rows(
    cfg: CampaignConfig, hist: dict[str, JobHistory], totals: Totals, jobs: list[Job] | None = None
) -> dict[str, dict]:
    """job name -> row, from the events log folded through the same state machine (no driver is running)."""
    out = {}
    for job in jobs if jobs is not None else [SEED_JOB] + expert_jobs(cfg.n_experts):
        h = hist.get(job.name)
        spent = (
            totals.gpu_seconds[Category.SEED]
            if job.expert is None
            else totals.per_expert_gpu_seconds.get(job.expert, 0.0)
        )
        status = JobStatus(
            state=h.state if h else JobState.PENDING,
            view=h.view() if h else JobView(),
            spent_s=spent,
            retries=h.failures if h else 0,
        )
        out[job.name] = _row(cfg, job, status)
    return out


def counts(rows: list[dict]) -> dict[str, int]:
    return {s: n for s in STATES if (n := sum(r["state"] == s for r in rows))}


def eta_s(rows: list[dict], rate: float | None) -> float | None:
    """Seconds to go at `rate` updates per second (every job's together, measured by the driver), or None."""
    left = sum(max(0, r["target"] - r["step"]) for r in rows if r["state"] not in TERMINAL)
    if left == 0:
        return 0.0
    return left / rate if rate else None


def build(
    *,
    cfg: CampaignConfig,
    url: str,
    rows: dict[str, dict],
    by_category_s: dict[str, float],
    devices: dict[str, float],
    started_at: float | None,
    rate: float | None,
    final: bool,
    estimate: Callable[[list[dict]], float | None] | None = None,
    source: str,
    running: set[str] | None = None,
    driver: dict | None = None,
    usd: dict[str, float] | None = None,
    unpriced_s: float = 0.0,
) -> dict:
    """The whole snapshot; `rows` in campaign order (seed first). The ETA counts the updates left of the jobs in
    `running` (the driver's own; all by default) at `rate` updates per second. `driver` says who wrote it and whether
    it stopped before its jobs ended: then the jobs it had in flight are `interrupted`. `estimate`, where given, makes
    the ETA from those rows instead (the driver's: soma_cluster/eta.py)."""
    now = time.time()
    stopped = bool(driver and driver.get("state") == "stopped")
    listed = [{**r, "state": JobState.INTERRUPTED} if stopped and r["state"] in IN_FLIGHT else r for r in rows.values()]
    mine = [r for r in listed if running is None or r["job"] in running]  # the driver's own jobs

    def _eta(mine: list[dict]) -> float | None:
        return estimate(mine) if estimate is not None else eta_s(mine, rate)

    elapsed = now - started_at if started_at is not None else 0.0
    hours = {c: by_category_s.get(c, 0.0) / 3600.0 for c in CATEGORIES}
    return {
        "schema": SCHEMA,
        "source": source,
        "campaign": url,
        "name": cfg.name,
        "preset": cfg.preset,
        "written_at": now,
        "driver_started_at": started_at,
        "elapsed_s": elapsed,
        "final": final,
        "unit": hours_unit(devices),
        "counts": counts(listed),
        "experts": experts_view(listed),
        "gpu_hours": hours,
        "gpu_hours_total": sum(hours.values()),
        "budget": budget_view(cfg),
        "usd": {c: (usd or {}).get(c, 0.0) for c in CATEGORIES} if usd is not None else None,
        "usd_total": sum(usd.values()) if usd is not None else None,
        "unpriced_gpu_hours": unpriced_s / 3600.0 if usd is not None else None,
        "eta_s": None if final or stopped else _eta(mine),
        "losses": dict(zip(("train", "val"), newest_losses(mine), strict=True)),
        "driver": driver,
        "jobs": listed,
    }


def budget_view(cfg: CampaignConfig) -> dict:
    """The caps in force (None: no cap), in GPU-hours and in dollars."""
    b = cfg.budget
    return {
        "expert_gpu_hours": b.expert_gpu_hours,
        "campaign_gpu_hours": b.campaign_gpu_hours,
        "expert_usd": b.expert_usd,
        "campaign_usd": b.campaign_usd,
    }


def newest_losses(rows: list[dict]) -> tuple[float | None, float | None]:
    """The mean over jobs of each one's newest training and expert-validation loss (nats/byte; None: none yet).
    Each job's own newest, not the newest heartbeat's: one expert's shard is not the campaign."""
    out = []
    for key in ("loss", "val"):
        vs = [r[key] for r in rows if r.get(key) is not None]
        out.append(sum(vs) / len(vs) if vs else None)
    return out[0], out[1]


def losses_of(snap: dict) -> tuple[float | None, float | None]:
    """The snapshot's newest losses: of the jobs its driver runs (`losses`), else (older snapshots) of all jobs."""
    got = snap.get("losses")
    return (got["train"], got["val"]) if got else newest_losses(snap["jobs"])


def loss_text(loss: float | None, val: float | None) -> str:
    """'train 2.3110 val 2.4002' (nats/byte), '-' for one not measured yet."""
    return " ".join(f"{k} {'-' if v is None else f'{v:.4f}'}" for k, v in (("train", loss), ("val", val)))


def summary_line(snap: dict) -> str:
    """One line for a log collector: the experts by state (a starting one counts as running: it holds a GPU; the seed
    is said apart, never among the experts), the newest losses (each job's, averaged), GPU-hours by category, ETA."""
    view = experts_view(snap["jobs"])
    c = f"experts {experts_text(view)}" if view["n"] else "no experts"
    c += f" | seed {view['seed']}" if view["seed"] else ""
    spent = ", ".join(f"{k} {v:.4f}" for k, v in snap["gpu_hours"].items() if v > 0)
    eta = snap["eta_s"]
    eta_text = "-" if eta is None else fmt_duration(eta)
    return (
        f"[soma {time.strftime('%H:%M:%S', time.localtime(snap['written_at']))}] {snap['name']}: {c} | "
        f"loss {loss_text(*losses_of(snap))} | "
        f"{snap['gpu_hours_total']:.4f} {snap['unit']} ({spent or 'none yet'}){usd_text(snap)} | "
        f"elapsed {fmt_duration(snap['elapsed_s'])} | ETA {eta_text}"
    )


def usd_text(snap: dict) -> str:
    """', $12.34' where the campaign is priced (prices.*), with what has no price ('+ 0.0120 GPU-hours unpriced'),
    else nothing."""
    if snap.get("usd_total") is None:
        return ""
    unpriced = snap.get("unpriced_gpu_hours") or 0.0
    return f", ${snap['usd_total']:,.2f}" + (f" + {unpriced:.4f} GPU-hours unpriced" if unpriced > 0 else "")


def fmt_duration(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


_SPANS = (("d", 86_400), ("h", 3_600), ("min", 60), ("s", 1))


def fmt_span(s: float) -> str:
    """A span of seconds as a person reads it, in its two largest units (the smaller rounded): '7 d', '2 h 5 min',
    '1 min 30 s'; under a minute as given ('0.5 s', '45 s')."""
    if s < 59.5:
        return f"{s:.3g} s"
    n = round(s)
    for _ in range(2):  # again when rounding carried into the next unit (86,370 s: 1 d, not 24 h)
        i = next(i for i, (_, size) in enumerate(_SPANS) if n >= size)
        (big, size), (small, step) = _SPANS[i], _SPANS[min(i + 1, len(_SPANS) - 1)]
        n = round(n / step) * step
    whole, rest = divmod(n, size)
    return f"{whole} {big}" + (f" {rest // step} {small}" if rest else "")
