"""The training methods, registered once by name (train.method): SOMA's SPSA estimator and the paper's baselines
(docs/results.md). The worker, `soma plan` and the experiments look a method up here instead of branching on its
name (torchtitan's train spec). A new method is one `register` call here, its estimator in
soma_cluster.trainer, and its name among config.TrainConfig.method's choices (tests/test_methods.py checks
that the two lists agree).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from soma_cluster.config import CampaignConfig
from soma_cluster.errors import SomaError
from soma_cluster.trainer import SPSA, Backprop, Eggroll, Estimator


@dataclass(frozen=True)
class TrainingMethod:
    name: str  # train.method's value
    label: str  # for people: tables, plots, logs
    zero_order: bool  # trains from loss values alone (no backward pass): the class SOMA competes in
    estimator: Callable[[CampaignConfig], Estimator]  # built for each trainer from the campaign's config
    # (perturbation scale, lr) an expert's eps/lr schedule starts from; the two halve together
    schedule_start: Callable[[CampaignConfig], tuple[float, float]]


METHODS: dict[str, TrainingMethod] = {}
SEED_METHOD = "spsa"  # the seed stage always trains by SPSA with the delta-rule decoder, whatever train.method


def register(method: TrainingMethod) -> TrainingMethod:
    if method.name in METHODS:
        raise ValueError(f"training method {method.name!r} is registered twice")
    METHODS[method.name] = method
    return method


def method_named(name: str) -> TrainingMethod:
    if name not in METHODS:
        raise SomaError(f"unknown training method {name!r}; choose one of {', '.join(METHODS)}")
    return METHODS[name]


register(
    TrainingMethod(
        name="spsa",
        label="SPSA",
        zero_order=True,
        estimator=lambda cfg: SPSA(),
        schedule_start=lambda cfg: (cfg.spsa.eps, cfg.spsa.lr),
    )
)
register(
    TrainingMethod(
        name="eggroll",
        label="EGGROLL",
        zero_order=True,
        estimator=lambda cfg: Eggroll(rank=cfg.eggroll.rank),
        schedule_start=lambda cfg: (cfg.eggroll.sigma, cfg.spsa.lr),  # sigma takes eps's place in the schedule
    )
)
register(
    TrainingMethod(
        name="bptt",
        label="BPTT",
        zero_order=False,
        estimator=lambda cfg: Backprop(grad_clip=cfg.bptt.grad_clip),
        schedule_start=lambda cfg: (cfg.spsa.eps, cfg.bptt.lr),  # eps is unused; it halves with lr all the same
    )
)
