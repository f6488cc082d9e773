"""Checks a command makes before it starts work (and Ray): a directory it will write is a writable directory
with enough free space, and the temporary directory is usable where the command needs one.

A check that fails raises one StorageError naming the path and what is needed. The space asked for is a
lower bound that any run needs (the command's own estimate, see docs/storage.md); running out later is
still reported the same way, with what the command wrote undone. No Ray.
"""

from __future__ import annotations

import os
import tempfile
import uuid

from soma_cluster.diskerrors import DiskCondition, StorageError, human_bytes, storage_error

MARGIN_BYTES = 1 << 20  # logs, snapshots and small JSON: every writing command needs at least this much free
PROBE_BYTES = 4096  # one block written and synced: a full disk, a quota and a read-only mount all show
TEMP_ENV = ("TMPDIR", "TEMP", "TMP")  # where Python's tempfile looks, in its order


def nearest_existing(path: str) -> str:
    """`path` or its closest ancestor that exists (what a command that creates `path` writes into)."""
    path = os.path.abspath(path)
    while not os.path.lexists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def free_bytes(path: str) -> int:
    """Bytes an unprivileged user may still write on path's filesystem (statvfs f_bavail, as df shows)."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _probe_write(directory: str) -> None:
    """Write PROBE_BYTES to a hidden file in `directory`, sync it, remove it: what a real write meets first."""
    probe = os.path.join(directory, f".soma-probe-{uuid.uuid4().hex[:12]}")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"\0" * PROBE_BYTES)
            os.fsync(fd)
        finally:
            os.close(fd)
    finally:
        try:
            os.unlink(probe)
        except FileNotFoundError:
            pass


def require_writable_dir(path: str, need_bytes: int = MARGIN_BYTES, what: str = "") -> None:
    """`path` is a directory (or can be created: its nearest existing ancestor is one) that this user can
    write, on a filesystem with at least need_bytes free. `what` names the role (e.g. "the temp directory
    (TMPDIR)") in the message."""
    at = nearest_existing(path)
    detail = what
    if not os.path.exists(at):
        raise StorageError(at, DiskCondition.MISSING, detail)
    if not os.path.isdir(at):
        raise StorageError(at, DiskCondition.NOT_A_DIRECTORY, detail)
    try:
        if at == os.path.abspath(path):
            _probe_write(at)
        elif not os.access(at, os.W_OK | os.X_OK):
            read_only = os.statvfs(at).f_flag & os.ST_RDONLY
            raise StorageError(at, DiskCondition.READ_ONLY if read_only else DiskCondition.DENIED, detail)
        free = free_bytes(at)
    except OSError as exc:
        err = storage_error(exc, at, detail)
        if err is None:
            raise
        if err.condition is DiskCondition.FULL:
            raise StorageError(at, DiskCondition.FULL, _space(0, need_bytes, what)) from None
        raise err from None
    if free < need_bytes:
        raise StorageError(at, DiskCondition.FULL, _space(free, need_bytes, what))


def _space(free: int, need: int, what: str) -> str:
    return ", ".join(x for x in (what, f"{human_bytes(free)} free, needs at least {human_bytes(need)}") if x)


def temp_dir() -> tuple[str, str]:
    """(the temporary directory, what names it). Python's tempfile quietly falls back to /tmp when TMPDIR names
    a directory that is missing; an operator who set TMPDIR meant that directory, so it is the one checked."""
    for name in TEMP_ENV:
        value = os.environ.get(name)
        if value:
            return os.path.abspath(value), f"the temp directory named by {name}"
    return tempfile.gettempdir(), "the temp directory"


def require_temp_dir(need_bytes: int = MARGIN_BYTES) -> str:
    """The temporary directory, checked to exist, be writable and hold need_bytes; returns its path."""
    path, what = temp_dir()
    if not os.path.isdir(path):
        raise StorageError(
            path,
            DiskCondition.MISSING if not os.path.lexists(path) else DiskCondition.NOT_A_DIRECTORY,
            f"{what}; unset it or create the directory",
        )
    require_writable_dir(path, need_bytes, what)
    return path


def checkpoint_bytes(model) -> int:
    """One checkpoint of one job (soma_cluster.trainer.TrainState.tensors): body, head and their Adam moments,
    float32 (4 bytes each), plus its JSON metadata (< 64 KiB)."""
    from soma_cluster.model import body_param_count, head_param_count

    return 3 * 4 * (body_param_count(model) + head_param_count(model)) + (64 << 10)


def training_bytes(cfg, jobs: int) -> int:
    """The space a training command (seed, launch, resume) asks for before it starts Ray: the first checkpoint
    of each of `jobs` jobs and the logs. A lower bound (every checkpoint is kept: a whole run writes one per
    train.checkpoint_every updates), so no campaign that could finish is refused."""
    return jobs * checkpoint_bytes(cfg.model) + MARGIN_BYTES
