"""Where a routed ensemble sends a text, and the one loader of what it is read from (a campaign or an export).

`Routing` holds what routing needs and nothing more (no expert weights): the config in force, the router and the
source. `soma serve`'s router deployment holds one; RoutedLM (lm.py) holds one beside its experts. Both load
through `open_source`, the only place that tells a campaign from an export.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from soma_cluster.campaignfile import CONFIG_FILE
from soma_cluster.checkpoint import checkpoint_steps, has_checkpoint
from soma_cluster.config import CampaignConfig
from soma_cluster.ensemble import route_windows
from soma_cluster.errors import SomaError
from soma_cluster.inference.export import EXPORT_FILE, export_config, read_manifest
from soma_cluster.inference.scoring import Cut, Rule, Text, as_bytes
from soma_cluster.jobs import Job
from soma_cluster.revisions import config_in_force
from soma_cluster.router import Router, load_router
from soma_cluster.storage import Store, storage_options_from_env


@dataclass(frozen=True)
class Route:
    """Where the router sends a text: its top-k experts, best first, and their mixture weights (they sum to 1)."""

    experts: tuple[int, ...]
    weights: tuple[float, ...]
    seed_fallback: tuple[int, ...] = ()  # those of `experts` that have no checkpoint: the seed model stands in

    def as_dict(self) -> dict:
        return {"experts": list(self.experts), "weights": list(self.weights), "seed_fallback": list(self.seed_fallback)}


@dataclass(frozen=True)
class Routes:
    """The routes of n windows, one row each, as the router gives them: experts (n, k) int64, best first, and their
    weights (n, k) float64 (each row sums to 1). What RoutedLM.forward mixes over."""

    experts: np.ndarray
    weights: np.ndarray

    def __post_init__(self) -> None:
        if self.experts.ndim != 2 or self.experts.shape != self.weights.shape:
            raise ValueError(f"routes: experts {self.experts.shape} and weights {self.weights.shape}, each (n, k)")

    def __len__(self) -> int:
        return len(self.experts)

    def take(self, rows: slice | np.ndarray | Sequence[int]) -> Routes:
        """The routes of some windows (a slice, or their indices), in that order."""
        return Routes(self.experts[rows], self.weights[rows])

    @classmethod
    def of(cls, routes: Sequence[Route]) -> Routes:
        """Routes from Route objects (all of one k)."""
        return cls(np.array([r.experts for r in routes]), np.array([r.weights for r in routes], dtype=np.float64))

    @classmethod
    def concat(cls, parts: Sequence[Routes]) -> Routes:
        return cls(np.concatenate([p.experts for p in parts]), np.concatenate([p.weights for p in parts]))

    def route(self, i: int, substituted: Sequence[int] | dict = ()) -> Route:
        """Window i's Route; `substituted`: the experts the seed model stands in for (named in seed_fallback)."""
        experts = tuple(int(e) for e in self.experts[i])
        return Route(experts, tuple(float(x) for x in self.weights[i]), tuple(e for e in experts if e in substituted))


@dataclass(frozen=True)
class Source:
    """A campaign or an export, opened: its store, its config in force, and an export's manifest (None for a
    campaign)."""

    store: Store
    config: CampaignConfig
    manifest: dict | None

    @property
    def is_export(self) -> bool:
        return self.manifest is not None

    def trained(self) -> bool:
        """Whether an expert has a checkpoint (else the seed model stands in for all of them)."""
        if self.manifest is not None:
            return bool(self.manifest["steps"])
        return any(  # stops at the first expert with a checkpoint
            has_checkpoint(self.store, Job(e).model_dir) or checkpoint_steps(self.store, Job(e).model_dir)
            for e in range(self.config.n_experts)
        )


def open_source(url: str | os.PathLike, storage_options: dict | None = None) -> Source:
    """A campaign directory or a `soma export` (local or s3://; endpoints and credentials from the environment unless
    `storage_options` are given), its config read and checked; one SomaError line naming what is wrong, else."""
    if not isinstance(url, (str, os.PathLike)):
        raise TypeError(f"url must be a path or a URL (str or os.PathLike), not {type(url).__name__}")
    url = os.fspath(url)
    if not url.strip():
        raise SomaError("url is empty; pass a campaign or an export directory (or an s3:// URL)")
    store = Store(url, storage_options_from_env(url) if storage_options is None else storage_options)
    if store.exists(EXPORT_FILE):
        manifest = read_manifest(store)
        return Source(store, export_config(store, manifest), manifest)
    if not store.exists(CONFIG_FILE):
        raise SomaError(
            f"{store.url} is neither a campaign (soma prepare makes one) nor an export (soma export makes one)"
        )
    return Source(store, config_in_force(store), None)  # with its revisions (soma set): the eval settings in force


@dataclass(frozen=True)
class Routing:
    """The config in force and the router of a campaign or an export: routes, windows and the prompt generation
    reads, without any expert weight."""

    config: CampaignConfig
    router: Router
    source: str
    trained: bool  # an expert has a checkpoint: the seed model does not stand in for all of them

    @classmethod
    def load(cls, url: str | os.PathLike, storage_options: dict | None = None) -> Routing:
        src = open_source(url, storage_options)
        return cls(src.config, load_router(src.store), src.store.url, src.trained())

    @property
    def window_bytes(self) -> int:
        return self.config.eval.window_bytes

    @property
    def stride(self) -> int:
        """Bytes between window starts: each window after the first scores this many new bytes."""
        return max(1, self.config.eval.window_bytes - 1 - self.config.eval.context_bytes)

    @property
    def rule(self) -> Rule:
        """How scoring reads and routes a document (scoring.py): windows, stride, and the bytes a route may read."""
        return Rule(self.window_bytes, self.stride, self.router.cfg.prefix_bytes)

    def routes(self, windows: Sequence[bytes]) -> Routes:
        """Each window's route from its first router.prefix_bytes bytes."""
        return self.routes_on([w[: self.router.cfg.prefix_bytes] for w in windows])

    def routes_on(self, heads: Sequence[bytes]) -> Routes:
        """The route of each text, the router reading all of it (a segment's head: scoring.Cut.heads)."""
        if not heads:  # the router's vectorizer refuses an empty batch
            k = min(self.router.cfg.top_k, self.router.n_experts)
            return Routes(np.zeros((0, k), dtype=np.int64), np.zeros((0, k)))
        return Routes(*route_windows(self.router, list(heads)))

    def kept(self, prompt: Text) -> bytes:
        """The part of a prompt generation reads: its last window_bytes - 1 bytes (b'\\n' for an empty one)."""
        return as_bytes(prompt)[-(self.window_bytes - 1) :] or b"\n"

    def prompt_route(self, prompt: Text) -> Route:
        """The route generation fixes for a prompt: the router reads the first prefix_bytes of what is kept."""
        return self.routes([self.kept(prompt)]).route(0)

    def cut(self, docs: Sequence[bytes], prefixes: Sequence[bytes]) -> Cut:
        """Documents, each read after its prefix, in the windows and segments scoring reads (scoring.py)."""
        return Cut.of(docs, prefixes, self.rule)
