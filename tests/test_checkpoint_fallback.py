"""Finding the newest checkpoint that verifies, and falling back to it (soma_cluster.checkpoint)."""

import json

import pytest
import torch

from soma_cluster.checkpoint import check_checkpoints, fall_back, has_checkpoint, load_checkpoint, save_checkpoint
from soma_cluster.errors import ChecksumError, SomaError
from soma_cluster.storage import Store
from soma_cluster.trainer import TrainState

D = "experts/expert-0001"


@pytest.fixture
def store(tmp_path):
    store = Store(str(tmp_path))
    state = TrainState.fresh(torch.arange(8, dtype=torch.float32), torch.ones(4, 2), False, 1e-3, 1e-3)
    for step in (5, 10, 15):
        state.step = step
        save_checkpoint(store, D, state)
    return store


def test_all_good_changes_nothing(store, tmp_path):
    before = (tmp_path / D / "latest.json").read_bytes()
    c = fall_back(store, D)
    assert c.ok and c.valid == c.latest == "step-000015" and c.step == 15 and not c.bad
    assert (tmp_path / D / "latest.json").read_bytes() == before
    assert check_checkpoints(store, "experts/expert-0002").ok  # nothing there at all: nothing to do


def test_truncated_final_checkpoint_falls_back_to_the_newest_valid_one(store, tmp_path):
    blob = tmp_path / D / "step-000015.safetensors"
    blob.write_bytes(blob.read_bytes()[:-10])
    meta = tmp_path / D / "step-000010.json"
    meta.write_text(meta.read_text().replace('"step": 10', '"step": 11'))  # an edited metadata file
    with pytest.raises(ChecksumError, match="step-000015.safetensors fails its checksum.*run soma resume"):
        load_checkpoint(store, D)
    c = fall_back(store, D)
    assert not c.ok and c.latest == "step-000015" and (c.valid, c.step) == ("step-000005", 5)
    assert c.bad == (
        ("step-000015", "tensors fail their checksum (truncated or corrupt)"),
        ("step-000010", "metadata corrupt"),
    )
    assert load_checkpoint(store, D).meta["state"]["step"] == 5
    assert check_checkpoints(store, D).ok


def test_a_missing_pointer_is_restored_and_nothing_verifying_removes_it(store, tmp_path):
    (tmp_path / D / "latest.json").unlink()
    c = fall_back(store, D)
    assert c.bad == (("latest.json", "missing"),) and c.valid == "step-000015"
    assert json.loads((tmp_path / D / "latest.json").read_text())["name"] == "step-000015"
    for f in (tmp_path / D).glob("step-*.safetensors"):
        f.write_bytes(b"junk")
    c = fall_back(store, D)
    assert c.valid is None and [n for n, _ in c.bad] == ["step-000015", "step-000010", "step-000005"]
    assert not has_checkpoint(store, D)  # training starts from the beginning


def test_an_unreachable_store_is_never_taken_for_a_bad_checkpoint(store, tmp_path, monkeypatch):
    def gone(self, rel):
        raise SomaError(f"storage {self.url}: read {rel} failed after 3 tries in 10.0 s (EndpointConnectionError)")

    monkeypatch.setattr(Store, "read_bytes", gone)
    with pytest.raises(SomaError, match="EndpointConnectionError"):
        fall_back(store, D)
    monkeypatch.undo()
    assert check_checkpoints(store, D).ok


def test_an_older_checkpoint_written_late_does_not_become_the_latest(store, tmp_path):
    """A process declared lost, still running behind its retry, writes step 10 again after step 15 exists:
    latest.json stays at 15. An unreadable latest.json, or a fall-back, still lets a checkpoint be latest."""
    state = load_checkpoint(store, D, "step-000010").state(torch.device("cpu"))
    save_checkpoint(store, D, state)
    assert load_checkpoint(store, D).name == "step-000015"
    (tmp_path / D / "latest.json").write_text("{trunc")
    save_checkpoint(store, D, state)
    assert load_checkpoint(store, D).name == "step-000010"
    blob = tmp_path / D / "step-000015.safetensors"
    blob.write_bytes(b"junk")
    (tmp_path / D / "latest.json").unlink()
    assert fall_back(store, D).valid == "step-000010"
    state.step = 12
    save_checkpoint(store, D, state)  # retraining after the fall-back moves it on
    assert load_checkpoint(store, D).name == "step-000012"


def test_a_checkpoint_of_a_later_attempt_is_not_overwritten_by_an_earlier_one(tmp_path):
    store = Store(str(tmp_path))
    state = TrainState.fresh(torch.arange(8, dtype=torch.float32), torch.ones(4, 2), False, 1e-3, 1e-3)
    state.step = 6
    usage = lambda f: {"forwards": f, "gpu_seconds": 1.0, "wall_seconds": 1.0, "tokens": 0}  # noqa: E731
    save_checkpoint(store, D, state, {"attempt": 2, "config_digest": "abc", "usage": usage(16)})
    save_checkpoint(store, D, state, {"attempt": 1, "config_digest": "abc", "usage": usage(48)})  # the zombie, late
    assert load_checkpoint(store, D).meta["attempt"] == 2 and load_checkpoint(store, D).meta["usage"]["forwards"] == 16
    save_checkpoint(
        store, D, state, {"attempt": 1, "config_digest": "other", "usage": usage(48)}
    )  # another config: written
    assert load_checkpoint(store, D).meta["attempt"] == 1
    save_checkpoint(
        store, D, state, {"attempt": 3, "config_digest": "other", "usage": usage(8)}
    )  # a later attempt: written
    assert load_checkpoint(store, D).meta["attempt"] == 3
