"""Experiment specs: the paper's comparisons as data (soma_cluster/presets/experiments/*.yaml).

An experiment is a set of *arms*, each an ordinary campaign (a preset plus overrides) run through the
same machinery as any other: prepare or fork, seed, launch, eval. An arm can fork another (same router,
shards, test windows and seed model) or take the width that matches another arm's total parameter count.
Each scale (`small` for 2 CPU cores, `paper` for a GPU cluster) names a preset and overrides for all arms.
"""

from __future__ import annotations

from importlib import resources
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from soma_cluster.config import CampaignConfig, merge_trees, preset_tree, resolve, set_dotted
from soma_cluster.errors import SomaError
from soma_cluster.model import campaign_param_count


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ScaleSpec(_Spec):
    preset: str
    set: dict[str, Any] = Field(default_factory=dict)  # dotted overrides applied to every arm
    seeds: list[int] | None = None  # replaces the experiment's seeds at this scale
    pack_all: bool = False  # one actor trains all of an arm's experts (resources.experts_per_actor = N):
    # every arm then holds the same single (logical) GPU, a fair share of a small host


class ArmSpec(_Spec):
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9-]*$")
    label: str = ""  # for tables and plots; N and d are added from the resolved config
    set: dict[str, Any] = Field(default_factory=dict)
    fork: str | None = None  # start from this arm's data and seed model (soma fork)
    match_params: str | None = None  # model.d chosen so the total parameter count matches this arm's


class Expectation(_Spec):
    better: str  # the arm the paper finds lower in test loss
    worse: str
    paper: str  # what the paper reports, in words and numbers


class VarianceSpec(_Spec):
    params: int = Field(4096, ge=16)  # M of the fixed separable objective
    blocks: list[int] = Field(default_factory=lambda: [2, 4, 8])
    draws: int = Field(4000, ge=10)  # single-probe estimates per measurement
    model_arm: str | None = None  # also measure on this arm's real experts (seed-initialised)
    model_draws: int = Field(128, ge=4)


class ExperimentSpec(_Spec):
    name: str
    title: str
    question: str
    kind: Literal["arms", "variance"] = "arms"
    reference: str | None = None  # arm every other arm is compared with, paired
    seeds: list[int] = Field(default_factory=lambda: [0])
    scales: dict[str, ScaleSpec]
    arms: list[ArmSpec] = Field(default_factory=list)
    expect: list[Expectation] = Field(default_factory=list)
    variance: VarianceSpec | None = None
    curve_points: int = Field(12, ge=1)  # checkpoints evaluated per arm for its curve (each a full test eval)

    @model_validator(mode="after")
    def _arms_known(self) -> "ExperimentSpec":
        names = [a.name for a in self.arms]
        if len(set(names)) != len(names):
            raise ValueError("arm names must be unique")
        for ref in (
            [self.reference]
            + [a.fork for a in self.arms]
            + [a.match_params for a in self.arms]
            + [x for e in self.expect for x in (e.better, e.worse)]
            + [self.variance.model_arm if self.variance else None]
        ):
            if ref is not None and ref not in names:
                raise ValueError(f"{ref!r} names no arm of this experiment")
        return self

    def scale(self, name: str) -> ScaleSpec:
        if name not in self.scales:
            raise SomaError(f"experiment {self.name} has no scale {name!r}; choose one of {', '.join(self.scales)}")
        return self.scales[name]

    def seeds_at(self, scale: str) -> list[int]:
        return self.scale(scale).seeds or self.seeds

    def ordered_arms(self) -> list[ArmSpec]:
        """Arms that others fork or size themselves by come first."""
        done: list[ArmSpec] = []
        todo = list(self.arms)
        while todo:
            ready = [
                a for a in todo if all(dep is None or dep in {d.name for d in done} for dep in (a.fork, a.match_params))
            ]
            if not ready:
                raise SomaError(f"experiment {self.name}: arms fork or match each other in a cycle; fix its YAML")
            done += ready
            todo = [a for a in todo if a not in ready]
        return done


def experiment_names() -> list[str]:
    root = resources.files("soma_cluster") / "presets" / "experiments"
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".yaml"))


def load_spec(name: str) -> ExperimentSpec:
    path = resources.files("soma_cluster") / "presets" / "experiments" / f"{name}.yaml"
    if not path.is_file():
        raise SomaError(f"unknown experiment {name!r}; choose one of {', '.join(experiment_names())}")
    try:
        return ExperimentSpec.model_validate(yaml.safe_load(path.read_text()))
    except ValidationError as exc:
        first = exc.errors()[0]
        raise SomaError(
            f"experiment {name}: {'.'.join(str(p) for p in first['loc'])}: {first['msg']}; fix its YAML"
        ) from None


def set_tree(dotted: dict[str, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for key, value in dotted.items():
        set_dotted(tree, key, value)
    return tree


def width_for(n_experts: int, total: int, embed_dim: int, depth: int) -> int:
    """The body width d whose N-expert campaign is closest to `total` parameters (d == embed_dim shares one
    frozen head; any other width has its own head and projections: docs/config.md, model.head)."""
    from soma_cluster.config import ModelConfig

    def count(d: int) -> int:
        head = "shared_frozen" if d == embed_dim else "own"
        return campaign_param_count(ModelConfig(d=d, embed_dim=embed_dim, depth=depth, head=head), n_experts)

    return min(range(4, 4096), key=lambda d: (abs(count(d) - total), d))


def arm_configs(
    spec: ExperimentSpec, scale: str, seed: int, user: dict[str, Any] | None = None
) -> dict[str, CampaignConfig]:
    """The resolved campaign config of every arm: preset <- scale overrides <- arm overrides <- user overrides."""
    sc = spec.scale(scale)
    _refuse_fixed(spec, sc.pack_all, user or {})
    out: dict[str, CampaignConfig] = {}
    trees: dict[str, dict[str, Any]] = {}
    for arm in spec.ordered_arms():
        # a fork starts from its parent arm's settings (it shares that arm's data and seed model)
        base = trees[arm.fork] if arm.fork else set_tree(sc.set)
        tree = merge_trees(merge_trees(base, set_tree(arm.set)), user or {})
        n = tree.get(
            "n_experts", preset_tree(sc.preset).get("n_experts", CampaignConfig.model_fields["n_experts"].default)
        )
        if arm.match_params:
            ref = out[arm.match_params]
            d = width_for(n, campaign_param_count(ref.model, ref.n_experts), ref.model.embed_dim, ref.model.depth)
            tree = merge_trees(
                tree, {"model": {"d": d, "head": "shared_frozen" if d == ref.model.embed_dim else "own"}}
            )
        if sc.pack_all:
            tree = merge_trees(tree, {"resources": {"experts_per_actor": n}})
        trees[arm.name] = tree
        out[arm.name] = resolve(sc.preset, {**tree, "seed": seed, "name": f"{spec.name}-{arm.name}-s{seed}"})
    return out


def _leaf_paths(tree: dict[str, Any], prefix: str = "") -> list[str]:
    paths = []
    for key, value in tree.items():
        paths += _leaf_paths(value, f"{prefix}{key}.") if isinstance(value, dict) else [f"{prefix}{key}"]
    return paths


def _refuse_fixed(spec: ExperimentSpec, pack_all: bool, user: dict[str, Any]) -> None:
    """Settings the experiment chooses for each arm itself would be silently replaced: refuse them instead."""
    fixed = {"seed": "one campaign per seed of the scale", "name": "each arm's campaign is named after it"}
    if any(a.match_params for a in spec.arms):
        fixed["model.d"] = fixed["model.head"] = "an arm's width is matched to another arm's parameter count"
    if pack_all:
        fixed["resources.experts_per_actor"] = "one actor trains all of an arm's experts at this scale"
    for leaf in _leaf_paths(user):
        path = next((f for f in fixed if leaf == f or leaf.startswith(f"{f}.")), None)
        if path is not None:
            raise SomaError(
                f"--set {path}: experiment {spec.name} sets {path} itself ({fixed[path]}); leave it out, or run the "
                f"arm as a campaign of its own (soma prepare ... --set {path}=...)"
            )
