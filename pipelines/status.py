"""`soma status`: a table of every job, rebuilt from the campaign directory (works while the driver runs)."""
from __future__ import annotations

from rich.table import Table

from pipelines.events import history
from soma_cluster.config import CampaignConfig
from soma_cluster.ledger import Ledger
from soma_cluster.shards import expert_name
from soma_cluster.storage import Store


def status_table(store: Store, cfg: CampaignConfig) -> Table:
    hist = history(store)
    totals = Ledger(store).totals()
    budget = cfg.budget.expert_gpu_hours
    table = Table(title=f"{store.url} — {cfg.name} (preset {cfg.preset}), {totals.gpu_hours:.4f} GPU-hours spent"
                        + (f" of {cfg.budget.campaign_gpu_hours}" if cfg.budget.campaign_gpu_hours else ""))
    for col in ("job", "state", "step", "expert-val nats", "GPU-hours", "retries", "last error"):
        table.add_column(col)
    names = ["seed"] + [expert_name(e) for e in range(cfg.n_experts)]
    for name in names:
        h = hist.get(name)
        e = None if name == "seed" else int(name.split("-")[1])
        spent = totals.gpu_seconds["seed"] / 3600 if e is None else totals.per_expert_gpu_seconds.get(e, 0.0) / 3600
        table.add_row(name, h.state if h else "pending", str(h.step if h else 0),
                      f"{h.val:.4f}" if h and h.val is not None else "-",
                      f"{spent:.4f}" + (f" / {budget}" if budget and e is not None else ""),
                      str(max(0, h.attempts - 1)) if h else "0", (h.last_error or "")[:60] if h else "")
    return table
