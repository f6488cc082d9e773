"""`soma status`: a table of every job, rebuilt from the campaign directory (works while the driver runs)."""
from __future__ import annotations

from rich.table import Table

from soma_cluster.config import CampaignConfig
from soma_cluster.events import history
from soma_cluster.ledger import Ledger
from soma_cluster.schedule import SEED_JOB, expert_jobs
from soma_cluster.storage import Store


def status_table(store: Store, cfg: CampaignConfig) -> Table:
    hist = history(store)
    totals = Ledger(store).totals()
    budget = cfg.budget.expert_gpu_hours
    unit = totals.unit
    table = Table(title=f"{store.url} — {cfg.name} (preset {cfg.preset}), {totals.gpu_hours:.4f} {unit} spent"
                        + (f" of {cfg.budget.campaign_gpu_hours}" if cfg.budget.campaign_gpu_hours else ""))
    for col in ("job", "state", "step", "expert-val nats", unit, "retries", "last error"):
        table.add_column(col)
    for job in [SEED_JOB] + expert_jobs(cfg):
        h = hist.get(job.name)
        spent = (totals.gpu_seconds["seed"] if job.expert is None else totals.per_expert_gpu_seconds.get(job.expert, 0.0)) / 3600
        table.add_row(job.name, h.state if h else "pending", str(h.step if h else 0),
                      f"{h.val:.4f}" if h and h.val is not None else "-",
                      f"{spent:.4f}" + (f" / {budget}" if budget and job.expert is not None else ""),
                      str(h.failures) if h else "0", (h.last_error or "")[:60] if h else "")
    return table
