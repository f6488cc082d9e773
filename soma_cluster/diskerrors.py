"""What an OSError from a disk or a store means to the operator: errno -> one DiskCondition -> one line.

The driver (the CLI's last resort and the commands' pre-flight checks) and the workers (which tell the
infrastructure's failures from an expert's own) classify the same errnos the same way, from here. No Ray.

The pre-flight checks are here too, below the store that makes them before it stages a file: a directory a
command will write is a writable directory with enough free space, and the temporary directory is usable where
the command needs one. A check that fails raises one StorageError naming the path and what is needed. The space
asked for is a lower bound that any run needs (the command's own estimate, see docs/storage.md); running out
later is still reported the same way, with what the command wrote undone.
"""

from __future__ import annotations

import errno
import os
import tempfile
import uuid
from enum import StrEnum

from soma_cluster.errors import SomaError


class DiskCondition(StrEnum):
    """An environment condition the operator fixes (never an expert's fault); the values go into records as is."""

    FULL = "full"  # ENOSPC, EDQUOT: no space (or quota) left
    NO_INODES = "no_inodes"  # ENOSPC with bytes free: the filesystem has no inode left for a new file
    READ_ONLY = "read_only"  # EROFS: a read-only mount
    DENIED = "denied"  # EACCES, EPERM: this user may not write (or read) there
    MISSING = "missing"  # ENOENT, ESTALE: absent, or removed while the command ran
    NOT_A_DIRECTORY = "not_a_directory"  # ENOTDIR: a file where a directory must be
    IS_A_DIRECTORY = "is_a_directory"  # EISDIR: a directory where a file must be
    CROSS_DEVICE = "cross_device"  # EXDEV: a rename across filesystems (staging on the wrong disk)
    IO_ERROR = "io_error"  # EIO: the device failed


_BY_ERRNO = {
    errno.ENOSPC: DiskCondition.FULL,
    errno.EDQUOT: DiskCondition.FULL,
    errno.EROFS: DiskCondition.READ_ONLY,
    errno.EACCES: DiskCondition.DENIED,
    errno.EPERM: DiskCondition.DENIED,
    errno.ENOENT: DiskCondition.MISSING,
    errno.ESTALE: DiskCondition.MISSING,
    errno.ENOTDIR: DiskCondition.NOT_A_DIRECTORY,
    errno.EISDIR: DiskCondition.IS_A_DIRECTORY,
    errno.EXDEV: DiskCondition.CROSS_DEVICE,
    errno.EIO: DiskCondition.IO_ERROR,
}

# (what happened, what is needed), for the one `error:` line
_WORDS = {
    DiskCondition.FULL: (
        "no space left on its filesystem",
        "free space there (or a larger quota), or use a campaign on a larger disk",
    ),
    DiskCondition.NO_INODES: (
        "no inodes left on its filesystem (its file count is at its limit, although bytes are free)",
        "fewer files there (delete some, e.g. old campaigns), or a filesystem with more inodes (mkfs -N, tmpfs "
        "nr_inodes)",
    ),
    DiskCondition.READ_ONLY: (
        "it is on a read-only filesystem",
        "a writable mount (remount it read-write, or copy the campaign to a writable directory)",
    ),
    DiskCondition.DENIED: (
        "permission denied",
        "a directory this user may write (fix its owner/mode or choose another)",
    ),
    DiskCondition.MISSING: (
        "it does not exist (or was removed while the command ran)",
        "the directory back, or another path",
    ),
    DiskCondition.NOT_A_DIRECTORY: (
        "a file is where a directory must be",
        "a directory path (move the file away or choose another path)",
    ),
    DiskCondition.IS_A_DIRECTORY: (
        "a directory is where a file must be",
        "a file path (move the directory away or choose another path)",
    ),
    DiskCondition.CROSS_DEVICE: (
        "a rename crossed filesystems",
        "staging on the campaign's own filesystem (report this as a bug)",
    ),
    DiskCondition.IO_ERROR: (
        "an I/O error from the device",
        "a healthy disk (check the device and the kernel log, then rerun)",
    ),
}


def condition_of(exc: BaseException) -> DiskCondition | None:
    """The condition an OSError stands for (its errno), or None (not a disk condition: a bug, a network error...).
    Only OSError counts: a worker's wrapped error (Ray's RayTaskError(OSError)) is an OSError subclass too. ENOSPC
    on a file it names is FULL or NO_INODES as that file's filesystem says (full_condition); without a file name it
    stays FULL."""
    if not isinstance(exc, OSError) or exc.errno is None:
        return None
    cond = _BY_ERRNO.get(exc.errno)
    if cond is DiskCondition.FULL and exc.errno == errno.ENOSPC and exc.filename:
        return full_condition(str(exc.filename))
    return cond


def describe(exc: BaseException) -> str:
    """An exception as a warning line shows it: an OSError of a disk condition with that condition's words after
    its own (ENOSPC reads 'No space left on device' for a file count at its limit too), else `Type: message`."""
    cond = condition_of(exc)
    text = f"{type(exc).__name__}: {exc}"
    if cond is None:
        return text
    free = ""
    if cond is DiskCondition.NO_INODES and getattr(exc, "filename", None):
        try:
            free = f", {human_bytes(free_bytes(nearest_existing(str(exc.filename))))} free"
        except OSError:
            pass
    return f"{text} ({_WORDS[cond][0]}{free})"


class StorageError(SomaError):
    """A path the command needs is in a disk condition the operator must fix: exit 2 with one line naming the
    path, what happened and what is needed. `detail` adds numbers (bytes free and needed) or the variable that
    named the path (TMPDIR)."""

    def __init__(self, path: str, condition: DiskCondition, detail: str = ""):
        self.path, self.condition, self.detail = str(path), DiskCondition(condition), detail
        happened, needed = _WORDS[self.condition]
        super().__init__(f"{self.path}: {happened}{f' ({detail})' if detail else ''}; needs {needed}")

    def __reduce__(self):  # pickles (Ray ships it from a worker) with its own arguments, not the message
        return (StorageError, (self.path, self.condition, self.detail))


def what_happened(exc: BaseException) -> str | None:
    """The disk condition of an OSError in the words every error line uses ('no space left on its filesystem', or
    'no inodes left' where that filesystem has bytes free but no file left), or None where it is not one."""
    cond = condition_of(exc)
    return None if cond is None else _WORDS[cond][0]


def storage_error(exc: BaseException, path: str | None = None, detail: str = "") -> StorageError | None:
    """The StorageError for an OSError with a disk condition, naming `path` or else the file the error names (its
    directory, for a staged file: gone by the time the operator reads the line); None where it is not a disk
    condition or no path is known. No space with bytes free is named for what it is: no inodes."""
    cond = condition_of(exc)
    where = path or getattr(exc, "filename", None)
    if cond is None or not where:
        return None
    where = str(where)
    if path is None and os.path.basename(where).startswith((".tmp-", ".soma-")):
        where = os.path.dirname(where)
    if cond is DiskCondition.FULL:
        cond = full_condition(where)
    return StorageError(where, cond, detail)


def full_condition(path: str) -> DiskCondition:
    """FULL, or NO_INODES where path's filesystem has bytes but no inode left for an unprivileged user."""
    try:
        st = os.statvfs(nearest_existing(path))
    except OSError:
        return DiskCondition.FULL
    return DiskCondition.NO_INODES if st.f_files > 0 and st.f_favail == 0 and st.f_bavail > 0 else DiskCondition.FULL


def with_path(exc: OSError, path: str) -> OSError:
    """`exc` as it is if it names a file; else the same errno (hence the same OSError subclass) naming `path`:
    os.write and pyarrow report ENOSPC without a file name, and the operator needs to know where."""
    if exc.filename or exc.errno is None:
        return exc
    return OSError(exc.errno, exc.strerror or os.strerror(exc.errno), str(path))


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (binary units, as df -h reports them)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


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
        if err.condition is DiskCondition.NO_INODES:
            raise StorageError(at, DiskCondition.NO_INODES, _space(free_bytes(at), 0, what)) from None
        if err.condition is DiskCondition.FULL:
            raise StorageError(at, DiskCondition.FULL, _space(0, need_bytes, what)) from None
        raise err from None
    if free < need_bytes:
        raise StorageError(at, DiskCondition.FULL, _space(free, need_bytes, what))


def _space(free: int, need: int, what: str) -> str:
    needs = f", needs at least {human_bytes(need)}" if need else ""
    return ", ".join(x for x in (what, f"{human_bytes(free)} free{needs}") if x)


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
