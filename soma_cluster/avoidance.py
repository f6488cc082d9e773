"""Which nodes a new actor should rather not be placed on. No Ray here: the driver hands the set to the worker's
start (workers/__init__.py), which turns it into Ray's soft node-label preference.

A node where an attempt was lost because it could not reach the campaign's store (cause storage_unreachable: a
route cut, a firewall, a broken DNS on that host) is likely to fail the next attempt placed there too, while Ray
would place that retry on any node with a free GPU share, that one included. So:

- such a loss on node X (its process reported from X, or its error says where it was raised) marks X avoided;
- every actor started while X is avoided (the retry, and any other job's attempt) prefers the other nodes. The
  preference is soft: Ray places it on X when no other node has room for it now, so a cluster of one node, or one
  whose other GPUs are all busy, is never held up by it;
- X stays avoided until it shows it reaches the store again (an attempt on it reports its set-up, which read the
  store, or a checkpoint it wrote) or for AVOID_S, whichever comes first. Then it takes work as before: a route that
  stayed cut fails the next attempt there, uncounted (an infrastructure failure), and X is avoided again.

The set lives in the driver only: a new driver (soma resume) starts with none avoided.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from soma_cluster.jobs import Cause

AVOID_S = 120.0  # how long a node that could not reach the store is avoided, at most (the scheduler's clock)
AVOIDED = frozenset({Cause.STORAGE_UNREACHABLE})  # the causes that say a node, not the job, is at fault


@dataclass
class Avoidance:
    clock: Callable[[], float]
    ttl_s: float = AVOID_S
    since: dict[str, float] = field(default_factory=dict)  # node id -> when an attempt there was last lost so

    def lost(self, node: str | None, cause: Cause | None) -> bool:
        """An attempt on `node` was lost for `cause`: whether the node is avoided for it."""
        if node is None or cause not in AVOIDED:
            return False
        self.since[node] = self.clock()
        return True

    def reached(self, node: str | None) -> None:
        """An attempt on `node` read or wrote the store (its set-up, a checkpoint): the node is fine again."""
        if node is not None:
            self.since.pop(node, None)

    def nodes(self) -> frozenset[str]:
        """The nodes an actor started now should rather not be placed on."""
        now = self.clock()
        for node in [n for n, t in self.since.items() if now - t >= self.ttl_s]:
            del self.since[node]
        return frozenset(self.since)
