"""Checkpoints: safetensors for tensors, JSON for metadata, a `latest.json` pointer written last.

    <dir>/step-000500.safetensors   body, head, Adam moments
    <dir>/step-000500.json          step, data cursor, eps/lr schedule, probe-seed inputs, sha256 of the tensors
    <dir>/latest.json               {"step": 500, "name": "step-000500"}
Never pickle, never torch.load.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from soma_cluster.errors import ChecksumError, SomaError
from soma_cluster.storage import Store, sha256
from soma_cluster.trainer import TrainState


@dataclass
class Checkpoint:
    name: str
    meta: dict
    tensors: dict[str, torch.Tensor]

    def state(self, device: torch.device) -> TrainState:
        return TrainState.restore(self.tensors, self.meta["state"], device)


def save_checkpoint(store: Store, directory: str, state: TrainState, extra: dict | None = None) -> str:
    name = f"step-{state.step:06d}"
    blob = st_save(state.tensors())
    store.write_bytes(f"{directory}/{name}.safetensors", blob)
    store.write_json(f"{directory}/{name}.json", {"state": state.scalars(), "tensors_sha256": sha256(blob), **(extra or {})})
    store.write_json(f"{directory}/latest.json", {"step": state.step, "name": name})
    return name


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
    return sorted(int(n[5:-5]) for n in names if n.startswith("step-") and n.endswith(".json") and f"{n[:-5]}.safetensors" in names)


def has_checkpoint(store: Store, directory: str) -> bool:
    return store.exists(f"{directory}/latest.json")


def load_checkpoint(store: Store, directory: str, name: str | None = None) -> Checkpoint:
    if name is None:
        name = store.read_json(f"{directory}/latest.json")["name"]
    meta = store.read_json(f"{directory}/{name}.json")
    where = f"{store.url}/{directory}/{name}.safetensors"
    try:
        blob = store.read_bytes(f"{directory}/{name}.safetensors")
    except FileNotFoundError:
        raise SomaError(f"checkpoint {where} is missing; restore it or delete {directory}/latest.json to restart that expert") from None
    if sha256(blob) != meta["tensors_sha256"]:
        raise ChecksumError(f"checkpoint {where} fails its checksum (truncated or corrupt); restore it or delete {directory}/latest.json to restart that expert")
    try:
        tensors = st_load(blob)
    except SafetensorError:
        raise ChecksumError(f"checkpoint {where} is not a safetensors file; restore it") from None
    return Checkpoint(name, meta, tensors)
