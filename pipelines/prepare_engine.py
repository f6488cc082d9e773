"""What `soma prepare`'s driver (pipelines.prepare.prepare_with) asks of an engine, and what it hands back to
one: the local engine (pipelines.prepare) and the Ray engine (pipelines.prepare_ray) both import it from here,
so neither engine imports the driver.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from soma_cluster.config import CampaignConfig
from soma_cluster.corpus import Part
from soma_cluster.parts import PartStats
from soma_cluster.router import Router
from soma_cluster.storage import Store


@dataclass(frozen=True)
class Routed:
    """The final router as the engine that counted with it holds it; the driver hands it back to that engine's
    `write`, so the shards are written by the very router the sizes were counted (and checked) with."""

    router: Router
    staged: str | None = None  # the Ray engine: the router's directory under the staging prefix, for its workers


class Engine(Protocol):
    """Runs the per-part work over every part, returning results in the order of `parts`; the driver (prepare_with)
    decides from what it returns."""

    stage: Store

    def read(self, parts: list[Part], keep_keys: int) -> list[PartStats]: ...
    def sample(self, parts: list[int], below: int) -> tuple[np.ndarray, list[bytes]]: ...
    def embed(self, router: Router, parts: list[int], below: int | None) -> tuple[np.ndarray, np.ndarray]: ...
    # each part's (S_p, N) sequences per source (its PartStats.seq_sources) and expert: its column sums are the sizes
    def count(self, router: Router, parts: list[int]) -> tuple[list[np.ndarray], Routed]: ...
    def write(
        self, store: Store, cfg: CampaignConfig, routed: Routed, parts: list[int], before: np.ndarray, val_every: int
    ) -> list[dict]: ...
