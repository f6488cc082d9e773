"""What crosses the wire between an expert actor and the driver: frozen dataclasses, shared by both sides.

An actor trains one job (the seed, or one expert) or G experts packed on the engine's expert axis; its
reports are keyed by `Job.expert` (an int, or None for the seed). Every amount is cumulative over the
attempt, measured by the actor's own clock, which starts when its process began holding its GPU share.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from soma_cluster.jobs import StopReason


@dataclass(frozen=True)
class Usage:
    """Compute spent, kept apart: GPU-seconds (wall x GPUs held), wall seconds, forwards, byte-tokens."""

    gpu_seconds: float = 0.0
    wall_seconds: float = 0.0
    forwards: int = 0
    tokens: int = 0

    def __add__(self, other: "Usage") -> "Usage":
        return Usage(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def __sub__(self, other: "Usage") -> "Usage":
        return Usage(*(getattr(self, f.name) - getattr(other, f.name) for f in fields(self)))

    def __neg__(self) -> "Usage":
        return Usage() - self

    @property
    def is_zero(self) -> bool:
        return all(getattr(self, f.name) == 0 for f in fields(self))

    @staticmethod
    def from_record(rec: dict) -> "Usage":
        """The amounts of a ledger record (soma_cluster/ledger.py)."""
        return Usage(rec["gpu_seconds"], rec["wall_seconds"], rec["forwards"], rec["tokens"])


@dataclass(frozen=True)
class Incarnation:
    """An earlier actor process of the same jobs (a hung one the driver killed): a retry that lands on the
    same node waits for it to be gone before it touches the device."""

    node: str | None
    pid: int
    created: float  # the process's start (wall clock), so a reused pid is not mistaken for it


@dataclass(frozen=True, kw_only=True)
class ExpertStart:
    """One job as its actor loaded it."""

    step: int  # the step it starts from (0, or its latest checkpoint's)
    target: int  # updates it trains to
    resumed: bool  # loaded from its own checkpoint
    forwards: int  # the model's forward count as loaded
    n_train: int  # train sequences in its shard
    usage: Usage  # its share of the actor's start-up (process start, imports, data and model loading)
    kept_by: int | None = None  # resumed: the attempt that wrote the checkpoint it loaded
    kept: Usage | None = None  # resumed: that attempt's usage as its checkpoint recorded it


@dataclass(frozen=True)
class SetupReport:
    device: str  # "cuda" or "cpu": where the jobs really train
    node_ip: str | None
    process: Incarnation  # Ray node id (None outside Ray), pid, process start
    held_from: float  # wall clock: when this actor's process began holding its GPU share for these jobs
    waited_s: float  # time spent waiting for an earlier incarnation on this node to exit
    experts: dict[int | None, ExpertStart]


@dataclass(frozen=True, kw_only=True)
class Heartbeat:
    """One job after a chunk of updates (or its end). Built by keyword: fourteen fields, several of one type."""

    step: int
    target: int
    updates: int  # updates done in this chunk
    loss: float | None  # mean train nats/byte over the chunk
    val: float | None  # expert-validation nats/byte, when measured in this chunk
    best_val: float | None
    eps: float
    lr: float
    checkpoint: str | None  # checkpoint written in this chunk (its name), if any
    checkpoint_step: int  # step of its latest checkpoint in this attempt (-1: none yet)
    usage: Usage  # cumulative over the attempt, start-up included
    sec_per_update: float | None
    reason: StopReason | None = None  # why it stopped, if it did
    error: str | None = None  # it failed inside a pack, raising this (a non-finite loss); its pack-mates train on

    @property
    def failed(self) -> bool:
        return self.error is not None

    @property
    def done(self) -> bool:
        return self.reason is not None or self.failed


@dataclass(frozen=True)
class ChunkReport:
    experts: dict[int | None, Heartbeat]
    wall_seconds: float  # the actor's clock
