"""`soma seed`: train the N = 1 seed model (SPSA body, delta-rule decoder) as one actor."""

from __future__ import annotations

from pipelines.campaign import LOG_EVERY_S, Driver, raise_failures, run_driver
from pipelines.campaign_lease import holding
from pipelines.common import console
from pipelines.reopen import reopen_failed, reopen_unverified
from pipelines.revision_pickup import take_up
from soma_cluster.config import CampaignConfig
from soma_cluster.errors import SomaError
from soma_cluster.events import seed_done
from soma_cluster.jobs import SEED_JOB, JobState
from soma_cluster.storage import Store


def require_prepared(store: Store) -> None:
    """A campaign whose prepare did not finish (campaign.yaml without shards/manifest.json) has nothing to train on."""
    if not store.exists("shards/manifest.json"):
        raise SomaError(f"{store.url} is not prepared; run soma prepare {store.url} first")


@holding("soma seed")
def train_seed(
    store: Store,
    cfg: CampaignConfig,
    show_progress: bool = True,
    log_every_s: float = LOG_EVERY_S,
    retry_failed: bool = False,
) -> str:
    """Train the seed job; with `retry_failed` (`soma seed --retry-failed`) a seed that failed permanently is
    reopened."""
    require_prepared(store)
    if retry_failed:
        reopen_failed(store, [SEED_JOB], [])
    reopen_unverified(store, [SEED_JOB])  # done only while its last checkpoint verifies
    take_up(store, cfg, lambda line: console.print(line, markup=False))  # revisions written while no driver ran
    if seed_done(store):
        console.print("seed model already trained; skipping")
        return JobState.FINISHED
    console.print(
        f"training the seed model: {cfg.seed_stage.updates} updates at lr {cfg.seed_stage.lr}, "
        f"{cfg.spsa.n_pert} probes x 2 signs, batch {cfg.spsa.batch} x {cfg.spsa.seq_len} bytes"
    )
    driver = Driver(store, cfg, [SEED_JOB], show_progress, log_every_s=log_every_s)
    outcome = run_driver(driver).get(SEED_JOB.name)
    raise_failures(driver, "jobs")
    if outcome == JobState.BUDGET_EXHAUSTED:
        raise SomaError(
            f"the seed stopped at its budget (budget.campaign_gpu_hours {cfg.budget.campaign_gpu_hours}, "
            f"budget.campaign_usd {cfg.budget.campaign_usd}); raise it with soma set {store.url} KEY=VALUE, then "
            f"soma seed {store.url} trains it on from its checkpoint"
        )
    if outcome != JobState.FINISHED:
        raise SomaError(f"seed training ended with {outcome}; see {store.url}/events.jsonl for the reason")
    return outcome
