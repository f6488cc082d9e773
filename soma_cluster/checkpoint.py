"""Checkpoints: safetensors for tensors, JSON for metadata, a `latest.json` pointer written last.

    <dir>/step-000500.safetensors   body, head, Adam moments
    <dir>/step-000500.json          step, data cursor, eps/lr schedule, probe-seed inputs, sha256 of the tensors
    <dir>/latest.json               {"step": 500, "name": "step-000500"}
Never pickle, never torch.load.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from soma_cluster.config import CampaignConfig, ModelConfig
from soma_cluster.diskerrors import MARGIN_BYTES
from soma_cluster.errors import ChecksumError, SomaError
from soma_cluster.jobs import SEED_JOB
from soma_cluster.model import body_param_count, head_param_count
from soma_cluster.storage import Store, parse_checked_json, sha256
from soma_cluster.trainer import TrainState


@dataclass
class Checkpoint:
    name: str
    meta: dict
    tensors: dict[str, torch.Tensor]

    def state(self, device: torch.device) -> TrainState:
        return TrainState.restore(self.tensors, self.meta["state"], device)


def save_checkpoint(store: Store, directory: str, state: TrainState, extra: dict | None = None) -> str:
    """Write the checkpoint, then point latest.json at it unless it already points at a later step: a process
    the driver declared lost may still be running behind the retry that replaced it (between Ray's kill and the
    process's end, or on a node cut off from the head), and its older checkpoint must not become the expert's
    latest. (Only `fall_back` moves latest.json back, on purpose.) Such a process does not overwrite a checkpoint
    of the same step that a later attempt of the same campaign wrote either: the tensors are the same, but its
    metadata carries that attempt's usage, which settles the attempt's losses."""
    name = f"step-{state.step:06d}"
    if _written_later(store, f"{directory}/{name}.json", extra or {}):
        return name
    blob = st_save(state.tensors())
    store.write_bytes(f"{directory}/{name}.safetensors", blob)
    store.write_json(
        f"{directory}/{name}.json", {"state": state.scalars(), "tensors_sha256": sha256(blob), **(extra or {})}
    )
    if (_latest_step(store, directory) or 0) <= state.step:
        store.write_json(f"{directory}/latest.json", {"step": state.step, "name": name})
    return name


def _written_later(store: Store, rel: str, extra: dict) -> bool:
    """A checkpoint `rel` exists, readable, written for the same config by a later attempt than extra's."""
    if "attempt" not in extra:
        return False
    try:
        meta = _read_checked(store, rel)
    except (FileNotFoundError, ChecksumError):
        return False
    attempt = meta.get("attempt")  # null in a checkpoint a warm fork copied from its parent
    return (
        meta.get("config_digest") == extra.get("config_digest")
        and (attempt if attempt is not None else -1) > extra["attempt"]
    )


def _latest_step(store: Store, directory: str) -> int | None:
    """The step latest.json points at; None when it is absent or unreadable (then any checkpoint may replace it)."""
    try:
        return int(_read_checked(store, f"{directory}/latest.json")["step"])
    except (FileNotFoundError, ChecksumError, KeyError, TypeError, ValueError):
        return None


def latest_meta(store: Store, directory: str) -> dict | None:
    """The latest checkpoint's metadata (its scalars under "state", and what the worker added: attempt,
    usage), without reading its tensors; None if there is none."""
    if not has_checkpoint(store, directory):
        return None
    name = store.read_json(f"{directory}/latest.json")["name"]
    return store.read_json(f"{directory}/{name}.json")


def checkpoint_steps(store: Store, directory: str) -> list[int]:
    """Steps of every checkpoint kept under `directory` (all are kept: a training curve can be re-evaluated)."""
    names = store.listdir(directory)
    return sorted(
        int(n[5:-5])
        for n in names
        if n.startswith("step-") and n.endswith(".json") and f"{n[:-5]}.safetensors" in names
    )


def has_checkpoint(store: Store, directory: str) -> bool:
    return store.exists(f"{directory}/latest.json")


def _fix(store: Store, directory: str) -> str:
    """The command that recovers from a bad checkpoint in `directory` (see `fall_back`)."""
    cmd = "soma seed" if directory == SEED_JOB.model_dir else "soma resume"
    return (
        f"run {cmd} {store.url}: it falls back to the newest checkpoint of {directory} that verifies "
        f"and retrains the updates after it"
    )


def load_checkpoint(store: Store, directory: str, name: str | None = None) -> Checkpoint:
    try:
        if name is None:
            name = _read_checked(store, f"{directory}/latest.json")["name"]
        meta = _read_checked(store, f"{directory}/{name}.json")
    except FileNotFoundError as exc:
        raise SomaError(f"{store.url}/{exc.args[0]} is missing; {_fix(store, directory)}") from None
    except ChecksumError as exc:
        raise ChecksumError(f"{exc}".split("; ")[0] + f"; {_fix(store, directory)}") from None
    where = f"{store.url}/{directory}/{name}.safetensors"
    try:
        blob = store.read_bytes(f"{directory}/{name}.safetensors")
    except FileNotFoundError:
        raise SomaError(f"checkpoint {where} is missing; {_fix(store, directory)}") from None
    if sha256(blob) != meta["tensors_sha256"]:
        raise ChecksumError(f"checkpoint {where} fails its checksum (truncated or corrupt); {_fix(store, directory)}")
    try:
        tensors = st_load(blob)
    except SafetensorError:
        raise ChecksumError(f"checkpoint {where} is not a safetensors file; {_fix(store, directory)}") from None
    return Checkpoint(name, meta, tensors)


# -- verification and fallback ------------------------------------------------------------------------------
@dataclass(frozen=True)
class CheckpointCheck:
    """What a checkpoint directory holds that can be trusted.

    latest: the name latest.json points at (None: no latest.json, or it is unreadable)
    valid:  the newest checkpoint that verifies, no newer than `latest` (None: none does)
    step:   valid's step (None with it)
    bad:    (name, why) of a missing or unreadable latest.json, then of every newer checkpoint that failed,
            newest first: the work they held is lost
    """

    directory: str
    latest: str | None
    valid: str | None
    step: int | None
    bad: tuple[tuple[str, str], ...] = ()

    @property
    def ok(self) -> bool:
        """latest.json points at a checkpoint that verifies (or there is no checkpoint at all, nor a trace of one)."""
        return self.latest == self.valid and not self.bad


def _read_checked(store: Store, rel: str) -> dict:
    """A checksummed JSON artifact; FileNotFoundError(rel) if absent, ChecksumError if corrupt. A store that
    cannot be reached raises its own SomaError: an outage is never taken for a bad checkpoint."""
    try:
        raw = store.read_bytes(rel)
    except FileNotFoundError:
        raise FileNotFoundError(rel) from None
    return parse_checked_json(raw, f"{store.url}/{rel}")


def verify(store: Store, directory: str, name: str) -> str | None:
    """Why checkpoint `name` cannot be loaded (metadata or tensors missing, unreadable, failing a checksum), or None."""
    try:
        meta = _read_checked(store, f"{directory}/{name}.json")
    except FileNotFoundError:
        return "metadata missing"
    except ChecksumError:
        return "metadata corrupt"
    try:
        blob = store.read_bytes(f"{directory}/{name}.safetensors")
    except FileNotFoundError:
        return "tensors missing"
    if sha256(blob) != meta.get("tensors_sha256"):
        return "tensors fail their checksum (truncated or corrupt)"
    try:
        st_load(blob)
    except SafetensorError:
        return "tensors are not a safetensors file"
    return None


def check_checkpoints(store: Store, directory: str) -> CheckpointCheck:
    """Verify the checkpoint latest.json points at and, if it fails, each older one until one verifies.
    Without a readable latest.json every step-*.json/.safetensors present is a candidate. Read-only."""
    names = store.listdir(directory)
    steps = {int(n[5:11]) for n in names if re.fullmatch(r"step-\d{6}\.(json|safetensors)", n)}
    latest, bad = None, []
    if "latest.json" in names:
        try:
            latest = _read_checked(store, f"{directory}/latest.json")["name"]
        except (FileNotFoundError, ChecksumError, KeyError):
            bad.append(("latest.json", "unreadable"))
    elif steps:
        bad.append(("latest.json", "missing"))
    if latest is not None and re.fullmatch(r"step-\d{6}", latest):  # newer files were never published
        steps = {s for s in steps if s <= int(latest[5:])} | {int(latest[5:])}
    for step in sorted(steps, reverse=True):
        name = f"step-{step:06d}"
        why = verify(store, directory, name)
        if why is None:
            return CheckpointCheck(directory, latest, name, step, tuple(bad))
        bad.append((name, why))
    return CheckpointCheck(directory, latest, None, None, tuple(bad))


def fall_back(store: Store, directory: str) -> CheckpointCheck:
    """Make latest.json point at the newest checkpoint that verifies (or remove it when none does, so training
    starts from the beginning); the checks are returned as they were found. Nothing changes when all is well.
    Training resumed from there is bitwise what it would have been (docs/scheduling.md), so the lost updates are
    simply retrained."""
    check = check_checkpoints(store, directory)
    if check.ok:
        return check
    if check.valid is not None:
        store.write_json(f"{directory}/latest.json", {"step": check.step, "name": check.valid})
    elif "latest.json" in store.listdir(directory):
        store.remove(f"{directory}/latest.json")
    return check


def checkpoint_bytes(model: ModelConfig) -> int:
    """One checkpoint of one job (soma_cluster.trainer.TrainState.tensors): body, head and their Adam moments,
    float32 (4 bytes each), plus its JSON metadata (< 64 KiB)."""
    return 3 * 4 * (body_param_count(model) + head_param_count(model)) + (64 << 10)


def training_bytes(cfg: CampaignConfig, jobs: int) -> int:
    """The space a training command (seed, launch, resume) asks for before it starts Ray: the first checkpoint
    of each of `jobs` jobs and the logs. A lower bound (every checkpoint is kept: a whole run writes one per
    train.checkpoint_every updates), so no campaign that could finish is refused."""
    return jobs * checkpoint_bytes(cfg.model) + MARGIN_BYTES
