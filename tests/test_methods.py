"""The training-method registry: one entry per train.method choice, and the recipes look methods up there."""

from typing import get_args

import pytest
import torch

from soma_cluster.config import TrainConfig, resolve
from soma_cluster.errors import SomaError
from soma_cluster.jobs import SEED_JOB, Job
from soma_cluster.methods import METHODS, SEED_METHOD, method_named
from soma_cluster.recipes import expert_start, training_method
from soma_cluster.trainer import SPSA, Backprop, Eggroll


def test_every_configurable_method_is_registered_and_nothing_else():
    assert set(METHODS) == set(get_args(TrainConfig.model_fields["method"].annotation))
    assert SEED_METHOD in METHODS
    assert all(name == m.name and m.label for name, m in METHODS.items())
    with pytest.raises(SomaError, match="unknown training method 'adam'"):
        method_named("adam")


@pytest.mark.parametrize(
    "method, estimator, eps, lr",
    [
        ("spsa", SPSA(), 1e-3, 2e-3),
        ("eggroll", Eggroll(rank=3), 5e-3, 2e-3),
        ("bptt", Backprop(grad_clip=0.5), 1e-3, 4e-3),
    ],
)
def test_an_expert_trains_and_starts_its_schedule_by_its_method(method, estimator, eps, lr):
    cfg = resolve(
        "tiny",
        {
            "train": {"method": method},
            "spsa": {"eps": 1e-3, "lr": 2e-3},
            "eggroll": {"sigma": 5e-3, "rank": 3},
            "bptt": {"lr": 4e-3, "grad_clip": 0.5},
        },
    )
    assert training_method(cfg, Job(0)).estimator(cfg) == estimator
    assert training_method(cfg, SEED_JOB).name == "spsa"  # the seed stage is SPSA whatever train.method says
    state = expert_start(cfg, torch.zeros(3), torch.zeros(2, 2))
    assert (state.schedule.eps, state.schedule.lr) == (eps, lr)
    assert METHODS[method].zero_order == (method != "bptt")
