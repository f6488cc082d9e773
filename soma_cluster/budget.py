"""Budget arithmetic in GPU-seconds: per-expert caps, the campaign cap, and the pool of unspent budget.

Pure bookkeeping (no Ray, no clocks): the driver feeds it what the ledger says was spent.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from soma_cluster.config import BudgetConfig


@dataclass
class BudgetBook:
    cfg: BudgetConfig
    granted: dict[int, float] = field(default_factory=dict)  # extra GPU-seconds given to an expert from the pool
    # the caps in GPU-seconds, converted from the config's GPU-hours once: every decision works in seconds
    expert_s: float | None = field(init=False)
    campaign_s: float | None = field(init=False)

    def __post_init__(self) -> None:
        self.expert_s = None if self.cfg.expert_gpu_hours is None else self.cfg.expert_gpu_hours * 3600.0
        self.campaign_s = None if self.cfg.campaign_gpu_hours is None else self.cfg.campaign_gpu_hours * 3600.0

    @property
    def budgeted(self) -> bool:
        """Whether any cap applies (else nothing is watched against a budget)."""
        dollars = self.cfg.expert_usd is not None or self.cfg.campaign_usd is not None
        return self.expert_s is not None or self.campaign_s is not None or dollars

    def left_usd(
        self, spent_expert_usd: float, spent_campaign_usd: float, usd_per_hour: float | None, share: int = 1
    ) -> float | None:
        """GPU-seconds the dollar caps leave a job at the price in force (`usd_per_hour`): its own dollars left and
        its 1/share of the campaign's, each converted; None when no dollar cap applies (or no price does)."""
        if usd_per_hour is None or usd_per_hour <= 0:
            return None
        caps = []
        if self.cfg.expert_usd is not None:
            caps.append(self.cfg.expert_usd - spent_expert_usd)
        if self.cfg.campaign_usd is not None:
            caps.append((self.cfg.campaign_usd - spent_campaign_usd) / share)
        return min(caps) / usd_per_hour * 3600.0 if caps else None

    def expert_cap(self, expert: int) -> float | None:
        return None if self.expert_s is None else self.expert_s + self.granted.get(expert, 0.0)

    def left(self, expert: int | None, spent_expert: float, spent_campaign: float, share: int = 1) -> float | None:
        """GPU-seconds the job may still spend: min of its own cap and its 1/share of what the campaign
        has left (so concurrent jobs cannot jointly overrun it); None = unlimited."""
        caps = []
        cap = self.expert_cap(expert) if expert is not None else None
        if cap is not None:
            caps.append(cap - spent_expert)
        if self.campaign_s is not None:
            caps.append((self.campaign_s - spent_campaign) / share)
        return min(caps) if caps else None

    def release(self, expert: int, spent_expert: float, candidates: dict[int, bool]) -> dict[int, float]:
        """An expert ended early: its unspent cap goes to the pool and, per policy, to `candidates`
        (expert -> still improving on expert-val). Returns the grants made (also applied here)."""
        cap = self.expert_cap(expert)
        if cap is None or self.cfg.pool_policy == "none" or not candidates:
            return {}
        pool = max(0.0, cap - spent_expert)
        chosen = (
            [e for e, improving in candidates.items() if improving]
            if self.cfg.pool_policy == "improving"
            else list(candidates)
        )
        if pool <= 0 or not chosen:
            return {}
        grants = {e: pool / len(chosen) for e in chosen}
        for e, s in grants.items():
            self.granted[e] = self.granted.get(e, 0.0) + s
        return grants

    def worst_overrun_s(self, num_gpus: float, poll_s: float, concurrent: int) -> tuple[float, float]:
        """Bound on overrun past a cap known before any chunk has run, per expert and for the campaign: the
        driver hard-stops an actor once its GPU-seconds pass the cap by the grace, noticed within one poll. Its
        start-up counts too: the driver runs the clock from the moment the actor holds its GPU share (the
        request, when the GPUs present had room; else when Ray placed it), not from its first report."""
        per_expert = self.cfg.grace_gpu_seconds + poll_s * num_gpus
        return per_expert, per_expert * concurrent

    def overruns(self, spent: dict[int, float], largest: dict[int, float]) -> dict[int, Overrun]:
        """Each capped expert's measured overrun (`spent`: its GPU-seconds) against the bound the worker's rule
        gives. The worker starts a chunk only if what it has held plus the chunk's cost estimated from its measured
        seconds per update fits the cap, so it ends past the cap by at most what its last record cost beyond that
        estimate: at most the largest single record billed to it (`largest`: a start-up, or a chunk with its
        validations and checkpoints, none interruptible). The driver's hard stop (`worst_overrun_s`) covers a
        worker that breaks that rule. Both come from the ledger (Totals) or the scheduler, which keeps them."""
        return {
            e: Overrun(s - cap, largest.get(e, 0.0))
            for e, s in spent.items()
            if (cap := self.expert_cap(e)) is not None
        }


@dataclass
class StartCost:
    """What starting an expert costs, as measured in this campaign, in GPU-seconds: a start-up (a start-up
    hard-stopped by the driver counts for what it had held, a lower bound) and one chunk of updates. The least
    of each seen is kept, so refusing a launch on it is refusing one that no measured start would have survived."""

    startup_s: float | None = None
    update_s: float | None = None  # one update of one expert, validations and checkpoints included

    def observe_startup(self, gpu_s: float) -> None:
        self.startup_s = gpu_s if self.startup_s is None else min(self.startup_s, gpu_s)

    def observe_updates(self, gpu_s: float, updates: int) -> None:
        if updates > 0 and gpu_s > 0:
            per = gpu_s / updates
            self.update_s = per if self.update_s is None else min(self.update_s, per)

    def need_s(self, chunk_updates: int) -> float | None:
        """A start-up plus one chunk of `chunk_updates`; None until a start-up was seen (the chunk counts 0 until
        an update was)."""
        if self.startup_s is None:
            return None
        return self.startup_s + chunk_updates * (self.update_s or 0.0)


@dataclass(frozen=True)
class Overrun:
    gpu_s: float  # spent minus the cap (negative: stopped under it)
    bound_s: float  # the largest single record billed to the expert

    @property
    def within(self) -> bool:
        return self.gpu_s <= self.bound_s
