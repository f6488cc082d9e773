"""Disk conditions without Ray: errno -> DiskCondition -> one line, the pre-flight probes on real mounts (a full
tmpfs, a read-only bind mount, a file in the way, a missing TMPDIR), and staging across filesystems."""

import errno
import os
import pickle
import subprocess
from contextlib import contextmanager

import pytest
from conftest import fill_up

from soma_cluster.checkpoint import training_bytes
from soma_cluster.diskerrors import (
    MARGIN_BYTES,
    DiskCondition,
    StorageError,
    condition_of,
    describe,
    require_temp_dir,
    require_writable_dir,
    storage_error,
    what_happened,
    with_path,
)
from soma_cluster.failures import exception_cause, stop_line
from soma_cluster.jobs import Cause
from soma_cluster.storage import Store, put_file


def _mount(*args: str) -> None:
    proc = subprocess.run(["mount", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"mount {' '.join(args)} refused here ({proc.stderr.strip()[:120]}): needs root")


@contextmanager
def tmpfs(path, size: str = "4m"):
    path.mkdir(parents=True, exist_ok=True)
    _mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path))
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.mark.parametrize(
    "code,cond",
    [
        (errno.ENOSPC, DiskCondition.FULL),
        (errno.EDQUOT, DiskCondition.FULL),
        (errno.EROFS, DiskCondition.READ_ONLY),
        (errno.EACCES, DiskCondition.DENIED),
        (errno.EPERM, DiskCondition.DENIED),
        (errno.ENOENT, DiskCondition.MISSING),
        (errno.ENOTDIR, DiskCondition.NOT_A_DIRECTORY),
        (errno.EXDEV, DiskCondition.CROSS_DEVICE),
        (errno.EIO, DiskCondition.IO_ERROR),
        (errno.EISDIR, DiskCondition.IS_A_DIRECTORY),
    ],
)
def test_errno_maps_to_one_condition_and_one_line(code, cond):
    exc = OSError(code, os.strerror(code), "/data/camp/x.json")
    assert condition_of(exc) is cond
    err = storage_error(exc)
    assert isinstance(err, StorageError) and err.condition is cond and err.path == "/data/camp/x.json"
    assert "\n" not in str(err) and str(err).startswith("/data/camp/x.json: ") and "; needs " in str(err)
    back = pickle.loads(pickle.dumps(err))  # Ray ships it from a worker
    assert (back.path, back.condition, str(back)) == (err.path, err.condition, str(err))


def test_what_is_not_a_disk_condition_stays_itself():
    assert condition_of(ValueError("x")) is None
    assert condition_of(OSError("no errno")) is None
    assert condition_of(OSError(errno.ECONNREFUSED, "refused")) is None
    assert storage_error(OSError(errno.ENOSPC, "full")) is None  # no path to name
    named = with_path(OSError(errno.ENOSPC, "No space left on device"), "/data/camp")
    assert isinstance(named, OSError) and named.filename == "/data/camp" and named.errno == errno.ENOSPC
    missing = with_path(OSError(errno.ENOENT, "gone"), "/x")
    assert isinstance(missing, FileNotFoundError)  # the same errno, the same subclass


def test_probe_finds_full_read_only_file_in_the_way_and_missing_tmpdir(tmp_path, monkeypatch):
    with tmpfs(tmp_path / "full", "1m") as full:
        fill_up(full)
        with pytest.raises(StorageError) as info:
            require_writable_dir(str(full / "camp"))  # not there yet: its parent is probed
        assert (
            info.value.condition is DiskCondition.FULL
            and info.value.path == str(full)
            and "needs at least" in str(info.value)
        )
        os.unlink(full / "filler")
        require_writable_dir(str(full / "camp"))  # fixed: passes
    src, ro = tmp_path / "src", tmp_path / "ro"
    src.mkdir()
    ro.mkdir()
    (src / "keep").write_text("mine")
    _mount("--bind", str(src), str(ro))
    try:
        _mount("-o", "remount,bind,ro", str(ro))
        for target in (ro, ro / "new" / "deeper"):
            with pytest.raises(StorageError) as info:
                require_writable_dir(str(target))
            assert info.value.condition is DiskCondition.READ_ONLY and info.value.path == str(ro)
        assert sorted(os.listdir(ro)) == ["keep"]  # the probe left nothing
    finally:
        subprocess.run(["umount", "-l", str(ro)], check=False)
    with pytest.raises(StorageError) as info:
        require_writable_dir(str(src / "keep" / "camp"))
    assert info.value.condition is DiskCondition.NOT_A_DIRECTORY and info.value.path == str(src / "keep")
    monkeypatch.setenv("TMPDIR", str(tmp_path / "absent"))
    with pytest.raises(StorageError) as info:
        require_temp_dir()
    assert info.value.condition is DiskCondition.MISSING and "TMPDIR" in str(info.value)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    assert require_temp_dir() == str(tmp_path)


def test_staging_lands_atomically_on_another_filesystem(tmp_path, monkeypatch):
    """The EXDEV of issue 27: a campaign on a tmpfs, the temp dir elsewhere; and a campaign that vanishes."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    with tmpfs(tmp_path / "disk") as disk:
        store = Store(str(disk / "camp"))
        with store.stage_file("shards/expert-0000/a.arrow") as staged:
            with open(staged.path, "wb") as fh:
                fh.write(b"abc")
            assert os.path.dirname(staged.path) == str(disk / "camp" / "shards" / "expert-0000")
            staged.publish()
        src = tmp_path / "elsewhere.bin"  # put_file from the temp dir's filesystem: copied, renamed
        src.write_bytes(b"xyz")
        put_file(store, str(src), "shards/expert-0000/b.arrow")
        assert (disk / "camp/shards/expert-0000/a.arrow").read_bytes() == b"abc"
        assert (disk / "camp/shards/expert-0000/b.arrow").read_bytes() == b"xyz" and not src.exists()
        with store.scratch() as scratch:
            assert os.path.dirname(scratch) == str(disk / "camp")
            assert store.listdir("") == ["shards"]  # the scratch is private: an empty campaign stays empty
        assert sorted(os.listdir(disk / "camp")) == ["shards"]
        with store.stage_file("x.bin"):  # not published: removed
            pass
        assert sorted(os.listdir(disk / "camp")) == ["shards"]
        subprocess.run(["rm", "-rf", str(disk / "camp")], check=True)
        with pytest.raises(FileNotFoundError) as info:  # a campaign removed under a command is not re-created
            store.write_json("status.json", {"a": 1})
        assert info.value.filename == str(disk / "camp") and not (disk / "camp").exists()


def test_training_estimate_is_a_checkpoint_per_job():
    from conftest import micro_config

    cfg = micro_config()
    one = training_bytes(cfg, 1) - MARGIN_BYTES
    assert training_bytes(cfg, 4) - MARGIN_BYTES == 4 * one
    from soma_cluster.model import body_param_count, head_param_count

    assert one >= 12 * (body_param_count(cfg.model) + head_param_count(cfg.model))


def test_a_full_temp_dir_never_fails_a_shard_read(tmp_path, s3):  # noqa: F811
    """An s3:// shard is cached in the temp dir to be memory-mapped; with the cache's disk full it is read into
    memory instead (the same rows), and a corrupt object is still refused."""
    import numpy as np
    import pyarrow as pa

    from soma_cluster.errors import ChecksumError
    from soma_cluster.shards import open_shard, write_rows

    store = Store(s3.url("cache/camp"), s3.storage_options())
    rows = pa.array([bytes([i]) * 8 for i in range(40)], pa.binary(8))
    with store.scratch() as scratch:
        entry = write_rows(store, "shards/expert-0000/train-00000-00.arrow", rows, scratch)
    store.write_json(
        "shards/expert-0000/manifest.json",
        {"expert": 0, "seq_bytes": 8, "train": [entry], "val": [], "train_rows": 40, "val_rows": 0},
    )
    with tmpfs(tmp_path / "cache", "1m") as cache:
        fill_up(cache)
        shard = open_shard(store, 0, str(cache / "soma-cache"))
        assert shard.n_train == 40 and np.array_equal(
            shard.gather(np.array([3, 39])), np.array([[3] * 8, [39] * 8], np.uint8)
        )
        store.write_bytes("shards/expert-0000/train-00000-00.arrow", b"not arrow")
        with pytest.raises(ChecksumError, match="fails its checksum"):
            open_shard(store, 0, str(cache / "soma-cache"))


from support.s3server import s3  # noqa: E402,F401  (fixture)


def test_inode_exhaustion_is_named_as_inodes_not_space(tmp_path):
    """ENOSPC with megabytes free: the filesystem ran out of inodes. The line says so, with the bytes free, and
    names the directory, not a staged file that is gone by then."""
    mnt = tmp_path / "few"
    mnt.mkdir()
    _mount("-t", "tmpfs", "-o", "size=20m,nr_inodes=16", "tmpfs", str(mnt))
    try:
        camp = mnt / "c"
        camp.mkdir()
        with pytest.raises(OSError):
            for i in range(64):
                (mnt / f"f{i}").write_bytes(b"")
        with pytest.raises(StorageError) as err:
            require_writable_dir(str(camp), 1 << 20, "the campaign directory")
        assert err.value.condition is DiskCondition.NO_INODES and "no inodes left" in str(err.value)
        assert "MiB free" in str(err.value), str(err.value)
        with pytest.raises(OSError) as raw:
            Store(str(camp)).write_bytes("x.json", b"{}")
        named = storage_error(raw.value)
        assert named.condition is DiskCondition.NO_INODES and named.path == str(camp), named
        # every other place an ENOSPC is worded: an export's line, a warning, a worker's failure, the stop line
        assert what_happened(raw.value).startswith("no inodes left"), what_happened(raw.value)
        assert "no inodes left" in describe(raw.value) and "MiB free" in describe(raw.value), describe(raw.value)
        assert exception_cause(raw.value) is Cause.NO_INODES and Cause.NO_INODES.infra
        line = stop_line(Cause.NO_INODES, describe(raw.value), "expert-0000's retries", 60.0, 600.0, str(camp))
        assert "no inodes left" in line and "disk full" not in line and "delete files" in line, line
        print(f"\n{err.value}\n{named}\n{line}")
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
