"""One campaign URL (local path or s3://bucket/prefix) behind fsspec, with atomic writes and checksums.

Object stores cannot append or rename, so every write here is a single whole-object PUT (local files:
temp name + rename), and an "append-only log" is a local JSONL file or, on object stores, a sequence
of small ordered objects that readers list and merge.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import queue
import re
import shutil
import socket
import tempfile
import threading
import time
import uuid
from contextlib import contextmanager
from functools import partial
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Iterator, TypeVar
from urllib.parse import urlsplit

import fsspec

from soma_cluster.diskerrors import (
    MARGIN_BYTES,
    DiskCondition,
    condition_of,
    require_temp_dir,
    require_writable_dir,
    with_path,
)
from soma_cluster.envvars import value as env_value
from soma_cluster.errors import ChecksumError, SomaError, StorageUnreachable
from soma_cluster.targets import missing_file

T = TypeVar("T")
# how a caller has a write tried: retry(write, what) calls write() until it succeeds or the caller gives up (raises)
Retry = Callable[[Callable[[], None], str], None]
log = logging.getLogger(__name__)
_SAFE_PART = re.compile(r"^[A-Za-z0-9._=-]+$")
# Names the store itself makes beside artifacts: in-flight writes (".tmp-*") and private scratch and probes
# (".soma-*"). Listings leave them out, so a campaign that holds only them is still an empty one.
_PRIVATE = (".tmp-", ".soma-")  # (TEMP, and SCRATCH and STAGING hidden)
_UMASK_LOCK = threading.Lock()

# Errors that mean "this artifact is not there / not yours / not ours": retrying cannot help.
_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError, SomaError)
_TRANSIENT: tuple[type[BaseException], ...] | None = None
SCRATCH = "soma-scratch-"  # Store.scratch's directories: <.>soma-scratch-<host>-<pid>-<random>
# Every file the store stages before a rename: .tmp-<host>-<pid>-<random><suffix>, beside its target. The host and
# pid tell a later command whether its writer is gone (Store.sweep_leftovers); the leading dot keeps it out of
# listings, so no reader ever takes it for data.
TEMP = ".tmp-"
_MADE_BY = re.compile(rf"^(?:{re.escape(TEMP)}|\.{SCRATCH})(?P<host>.+)-(?P<pid>\d+)-[^-]+$")
STAGING = ".soma-staging"  # the Ray engine's prepare stages under it (pipelines.prepare_ray), only while it runs
_CAS_LOCK = threading.Lock()  # Store.write_if on a filesystem, between this process's threads
# OSErrors (a local disk's, e.g. a download into a full temp dir) that a retry within seconds cannot fix
_DISK_PERMANENT = (
    DiskCondition.FULL,
    DiskCondition.NO_INODES,
    DiskCondition.READ_ONLY,
    DiskCondition.NOT_A_DIRECTORY,
    DiskCondition.IS_A_DIRECTORY,
    DiskCondition.CROSS_DEVICE,
)

# Where an s3:// endpoint may come from (first set wins); credentials are never read from here.
ENDPOINT_ENV = ("SOMA_S3_ENDPOINT", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
# How long one storage call may keep retrying an object store it cannot reach before it reports it (seconds).
TIMEOUT_ENV = "SOMA_S3_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 15.0
CONNECT_TIMEOUT_S = 5.0  # per attempt (s3fs's own default, stated so the deadline can count on it)


def transient_errors() -> tuple[type[BaseException], ...]:
    """What an object store restarting or a dropped connection surfaces as, through s3fs/aiobotocore.

    s3fs turns S3 error responses into OSError subclasses, but a refused or reset connection comes out
    as botocore's own ConnectionError/HTTPClientError (not OSError) once botocore's retries are spent.
    """
    global _TRANSIENT
    if _TRANSIENT is None:
        found: list[type[BaseException]] = [OSError]
        try:
            from botocore.exceptions import ConnectionError as BotoConnectionError
            from botocore.exceptions import HTTPClientError

            found += [BotoConnectionError, HTTPClientError]
        except ImportError:  # pragma: no cover - s3fs pulls botocore in
            pass
        try:
            from aiohttp import ClientError

            found.append(ClientError)
        except ImportError:  # pragma: no cover
            pass
        try:
            from fsspec.exceptions import FSTimeoutError

            found.append(FSTimeoutError)
        except ImportError:  # pragma: no cover
            pass
        _TRANSIENT = tuple(found)
    return _TRANSIENT


def storage_options_from_env(url: str, environ: dict[str, str] | None = None) -> dict[str, Any]:
    """fsspec options for `url` taken from the environment (what the CLI uses).

    For s3:// only an endpoint is taken, from SOMA_S3_ENDPOINT, else AWS_ENDPOINT_URL_S3, else
    AWS_ENDPOINT_URL. Credentials are deliberately left out: botocore finds them itself on every
    machine (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, instance or pod roles), so they
    are never part of options that travel to workers or could be written anywhere.
    """
    env = os.environ if environ is None else environ
    if not url.startswith(("s3://", "s3a://")):
        return {}
    endpoint = next((env[k] for k in ENDPOINT_ENV if env.get(k)), None)
    return {"client_kwargs": {"endpoint_url": endpoint}} if endpoint else {}


def storage_timeout_s(environ: dict[str, str] | None = None) -> float:
    """SOMA_S3_TIMEOUT_S, else 15 s: the bound on one storage call's retries against an unreachable store."""
    value = env_value(TIMEOUT_ENV, environ)  # bounds and wording: the registry's
    if value is None:
        return DEFAULT_TIMEOUT_S
    return value


def with_s3_defaults(
    url: str, options: dict[str, Any], botocore_attempts: int, connect_timeout_s: float = CONNECT_TIMEOUT_S
) -> dict[str, Any]:
    """fsspec options for `url` with botocore's timeouts and retry count stated, where the caller did not.

    There is one retry layer per reader: a Store retries in `retrying` (so botocore makes one attempt,
    botocore_attempts=1), a corpus read lets botocore's standard mode retry (a few attempts). Stacked
    layers multiply: botocore's legacy 5 attempts inside 6 Store tries took ~50 s to report a refused port.
    """
    if not url.startswith(("s3://", "s3a://")):
        return dict(options)
    config = dict(options.get("config_kwargs") or {})
    config.setdefault("connect_timeout", connect_timeout_s)
    config.setdefault("retries", {"total_max_attempts": botocore_attempts, "mode": "standard"})
    return {**options, "config_kwargs": config}


def endpoint_of(options: dict[str, Any]) -> str:
    """The endpoint a client talks to, for messages: host and port only (never a user:password@ part)."""
    url = (options.get("client_kwargs") or {}).get("endpoint_url") or options.get("endpoint_url")
    if not url:
        return "the default AWS S3 endpoint"
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname}" + (f":{parts.port}" if parts.port else "")


def retrying(
    fn: Callable[[], T],
    what: str,
    timeout_s: float,
    attempt_s: float,
    hint: str,
    max_tries: int | None = None,
    on_retry: Callable[[], None] = lambda: None,
) -> T:
    """fn(), with transient remote errors (an object store restarting, a dropped or refused connection)
    retried with backoff 0.2 s, 0.4 s, ... 5 s for at most `timeout_s` in all: an attempt starts only
    while it can still time out (`attempt_s`, the connect timeout) within that bound. Then one StorageUnreachable
    (a SomaError: a command's one `error:` line; a campaign's worker waits for the store, soma_cluster/failures.py)."""
    t0 = time.monotonic()
    last_start = t0 + timeout_s - attempt_s
    delay, tries = 0.2, 0
    while True:
        tries += 1
        try:
            return fn()
        except _PERMANENT:
            raise
        except transient_errors() as exc:  # refused/reset/timed-out connection, 5xx (OSError via s3fs)
            if condition_of(exc) in _DISK_PERMANENT:  # a local disk condition: no retry fixes it in seconds
                raise
            now = time.monotonic()
            if now >= last_start or (max_tries is not None and tries >= max_tries):
                n = f"{tries} tries" if tries > 1 else "1 try"
                raise StorageUnreachable(
                    f"{what} failed after {n} in {now - t0:.1f} s ({type(exc).__name__}); {hint}"
                ) from None
            wait = min(delay, last_start - now)
            # the type only: messages and storage options are never logged (they can name credentials)
            log.warning("%s failed (%s), retry %d in %.1f s", what, type(exc).__name__, tries, wait)
            time.sleep(wait)
            delay = min(delay * 2, 5.0)
            on_retry()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def safe_relpath(rel: str) -> str:
    """Reject anything that could escape the campaign root (absolute, '..', odd characters)."""
    parts = PurePosixPath(rel).parts
    if not parts or rel.startswith("/") or any(p in ("..", ".") or not _SAFE_PART.match(p) for p in parts):
        raise SomaError(f"refusing path {rel!r}: campaign paths are relative names of [A-Za-z0-9._=-] only")
    return "/".join(parts)


class VersionConflict(Exception):
    """A compare-and-swap (Store.write_if) found another version than the one it was given."""


class Store:
    """Reads and writes artifacts under one campaign root. `fence`, when set (the driver's lease check), is called
    before every write, so a driver that lost the campaign to another writes nothing more."""

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        retries: int | None = None,
        timeout_s: float | None = None,
    ):
        """`retries` caps the retries of one call (none: only the time bound); `timeout_s` is that bound
        (default: SOMA_S3_TIMEOUT_S, else 15 s). Both matter only for remote stores."""
        self.url = url.rstrip("/")
        self.storage_options = dict(storage_options or {})  # as given: what workers are handed
        remote = "://" in self.url and not self.url.startswith("file://")
        self.timeout_s = timeout_s if timeout_s is not None else storage_timeout_s() if remote else DEFAULT_TIMEOUT_S
        # a connect timeout of at most a third of the bound leaves room for retries within it
        options = with_s3_defaults(self.url, self.storage_options, 1, min(CONNECT_TIMEOUT_S, self.timeout_s / 3))
        self.fs, root = fsspec.core.url_to_fs(self.url, **options)
        self.root = root.rstrip("/")
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        self.local = "file" in protocols
        if "s3" in protocols:
            self.fs.retries = 1  # s3fs's own loop (timeouts, resets) would stack under `retrying` too
        self.retries = retries
        self.connect_timeout_s = float((options.get("config_kwargs") or {}).get("connect_timeout", CONNECT_TIMEOUT_S))
        self._endpoint = endpoint_of(options)
        self._log_cache: dict[str, dict[str, list[dict[str, Any]]]] = {}  # remote logs: object name -> its records
        self._batch: dict[str, list[str]] | None = None  # appends held back inside `batch()`: log -> lines
        self._writer: _LogWriter | None = None  # the background writer of a `batch(background=True)`
        self._tails_checked: set[str] = set()  # local logs whose unterminated last record was cut off
        self.fence: Callable[[], None] | None = None
        # set while a command prepares (pipelines/campaign.py `preparing`): outage_wait(call, what) runs each remote
        # call, waiting out an unreachable store for longer than one call's retries (SOMA_S3_TIMEOUT_S)
        self.outage_wait: Callable[[Callable[[], Any], str], Any] | None = None
        # a local campaign directory seen to exist is never silently re-created: one that vanishes while a
        # command runs is an error (ENOENT naming it), not a fresh half-campaign
        self._root_seen = self.local and os.path.isdir(self.root)

    def __repr__(self) -> str:  # never the storage options: they may hold credentials
        return f"Store({self.url!r})"

    # -- plumbing -----------------------------------------------------------------------------------------
    def full(self, rel: str, root_ok: bool = False) -> str:
        """Absolute path of `rel` under the root ('' names the root itself only where root_ok)."""
        return self.root if (rel == "" and root_ok) else f"{self.root}/{safe_relpath(rel)}"

    def ensure_dir(self, directory: str) -> str:
        """Make `directory` (an absolute local path under the root) and its parents, but never the root again
        once it was seen: a campaign removed while the command runs raises FileNotFoundError naming it."""
        if not os.path.isdir(self.root) and self._root_seen:
            raise FileNotFoundError(errno.ENOENT, "campaign directory removed while the command ran", self.root)
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as exc:
            raise with_path(exc, directory) from exc
        self._root_seen = True
        return directory

    def check_writable(self, need_bytes: int = MARGIN_BYTES) -> None:
        """Before a command writes: a local campaign is (or can be made) a writable directory with need_bytes
        free (a probe write, statvfs); a remote one's bucket exists and takes a small object (PUT, DELETE). What
        this host's killed writers left in a local one goes first (it may be what fills the disk)."""
        if self.local:
            self.sweep_leftovers(pid_alive)
            require_writable_dir(self.root, need_bytes, "the campaign directory")
            return
        self.require_bucket()
        probe = f".soma-probe-{uuid.uuid4().hex[:12]}"
        try:
            self.write_bytes(probe, b"probe")
        except PermissionError:
            raise SomaError(
                f"{self.url}: access denied writing there with these credentials; use credentials that may "
                f"write it (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE), or a writable campaign URL"
            ) from None
        self.remove(probe)

    @contextmanager
    def scratch(self, need_bytes: int = MARGIN_BYTES) -> Iterator[str]:
        """A private local directory for intermediate files, removed however the block ends. A local campaign's
        is hidden inside it (".soma-scratch-*", left out of listings): on the campaign's own filesystem, so a
        file moves into place with an atomic rename, and never in a temp dir the campaign does not need. A
        remote campaign's is in the temp dir (uploads start from a local file), checked for need_bytes first."""
        base = self.ensure_dir(self.root) if self.local else require_temp_dir(need_bytes)
        # the host and pid in its name tell a later command whether its maker is gone (sweep_scratch)
        path = tempfile.mkdtemp(
            prefix=f"{'.' if self.local else ''}{SCRATCH}{socket.gethostname()}-{os.getpid()}-", dir=base
        )
        try:
            yield path
        except OSError as exc:
            # a disk condition met in the scratch is the campaign's (or the temp dir's): name that, not a
            # hidden directory that is gone by the time the operator reads the message
            if condition_of(exc) is not None and str(exc.filename or "").startswith(path):
                raise OSError(exc.errno, exc.strerror, base) from exc
            raise
        finally:
            shutil.rmtree(path, ignore_errors=True)

    def sweep_scratch(self, alive: Callable[[int], bool]) -> list[str]:
        """The campaign's top-level scratch directories of this host's processes that are gone (see sweep_leftovers)."""
        return [n for n in self.sweep_leftovers(alive) if "/" not in n and n.startswith(f".{SCRATCH}")]

    def sweep_leftovers(self, alive: Callable[[int], bool], stale_before: float | None = None) -> list[str]:
        """Remove what killed writers left anywhere in the local campaign: staged files (".tmp-*") and scratch
        directories (".soma-scratch-*") whose maker, a process of this host, is gone (`alive(pid)` says). Another
        host's pids mean nothing here: theirs, and unattributed ".tmp-*" of older versions, go only when
        `stale_before` is given (by the lease's holder, the campaign's only writer) and the filesystem's own clock
        dates their last change before it. Returns the relative paths removed."""
        if not self.local or not os.path.isdir(self.root):
            return []
        here, removed = socket.gethostname(), []
        for dirpath, dirnames, filenames in os.walk(self.root):
            for name in [*dirnames, *filenames]:
                if not name.startswith((TEMP, f".{SCRATCH}")):
                    continue
                path = os.path.join(dirpath, name)
                m = _MADE_BY.match(name)
                if m and m["host"] == here:
                    gone = not alive(int(m["pid"]))
                else:
                    gone = stale_before is not None and _mtime(path) < stale_before
                if gone and os.path.isdir(path):
                    shutil.rmtree(path, ignore_errors=True)
                elif gone:
                    _unlink(path)
                if gone:
                    removed.append(os.path.relpath(path, self.root))
            dirnames[:] = [d for d in dirnames if not d.startswith((TEMP, f".{SCRATCH}"))]  # never into a live one
        return removed

    def stage_file(self, rel: str, suffix: str = "", scratch: str | None = None) -> "StagedFile":
        """A local file to write `rel`'s bytes into, then publish() (see StagedFile)."""
        return StagedFile(self, rel, suffix, scratch)

    def _retry(self, what: str, fn: Callable[[], T]) -> T:
        """fn() through `retrying` (the only retry layer: botocore is told to make one attempt)."""
        if self.local:
            return fn()
        hint = (
            f"check that {self._endpoint} is up and reachable from here (SOMA_S3_ENDPOINT), "
            f"or allow longer with {TIMEOUT_ENV} (now {self.timeout_s:g})"
        )
        # a listing cached before an outage may be stale after it
        what = f"storage {self.url}: {what}"
        tries = None if self.retries is None else self.retries + 1

        def call() -> T:
            return retrying(fn, what, self.timeout_s, self.connect_timeout_s, hint, tries, self.fs.invalidate_cache)

        return call() if self.outage_wait is None else self.outage_wait(call, what)

    def require_bucket(self) -> None:
        """On s3://, the bucket exists and answers: checked before work that ends in writing to it."""
        if self.local:
            return
        bucket = self.root.split("/", 1)[0]
        try:
            self._retry(f"check bucket {bucket}", lambda: self.fs.info(bucket, refresh=True))
        except FileNotFoundError:
            raise SomaError(
                f"bucket {bucket} of {self.url} does not exist at {self._endpoint}; create it "
                f"(e.g. aws s3 mb s3://{bucket}) or choose a campaign URL in an existing bucket"
            ) from None
        except PermissionError:
            raise SomaError(
                f"bucket {bucket} of {self.url}: access denied with these credentials; use credentials "
                f"that may write there (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE)"
            ) from None

    # -- whole objects ------------------------------------------------------------------------------------
    def exists(self, rel: str) -> bool:
        if self.local:
            return self.fs.exists(self.full(rel))
        path = self.full(rel)

        def probe() -> bool:
            # Not fs.exists: s3fs answers that from its listing cache (stale once another process
            # wrote here) and turns any error, an unreachable endpoint included, into False.
            try:
                self.fs.info(path, refresh=True)
                return True
            except FileNotFoundError:
                return False

        return self._retry(f"exists {rel}", probe)

    def read_bytes(self, rel: str) -> bytes:
        return self._retry(f"read {rel}", lambda: self.fs.cat_file(self.full(rel)))

    def _fenced(self) -> None:
        if self.fence is not None:
            self.fence()

    def write_bytes(self, rel: str, data: bytes) -> None:
        """Atomic: readers see the old object or the new one, never a torn write."""
        self._fenced()
        path = self.full(rel)
        if self.local:
            directory = self.ensure_dir(os.path.dirname(path))
            try:
                _replace_local(path, data)
            except OSError as exc:
                raise with_path(exc, directory) from exc
        else:
            self._retry(f"write {rel}", lambda: self.fs.pipe_file(path, data))

    def remove_if(self, rel: str, version: str, rmdir: bool = False) -> bool:
        """Delete `rel` if it is still at `version`; returns whether it did. On a filesystem its lock file goes too,
        and with `rmdir` its directory if that is left empty (a command that found no directory leaves none). S3 has no
        conditional delete for general buckets: the ETag is compared, then the object deleted; a writer that
        changed it in between finds it gone at its next compare-and-swap (for the lease: it stops, fenced)."""
        path = self.full(rel)
        if not self.local:
            found = self.read_versioned(rel)
            if found is None or found[1] != version:
                return False
            self._retry(f"remove {rel}", lambda: self.fs.rm_file(path))
            self.fs.invalidate_cache(path)
            return True
        with _cas_locked(path, self.ensure_dir) as lockpath:
            found = self.read_versioned(rel)
            if found is None or found[1] != version:
                return False
            os.unlink(path)
            os.unlink(lockpath)  # lockers check that the file they locked is still this path's
        if rmdir:
            try:
                os.rmdir(os.path.dirname(path))
            except OSError:
                pass  # not empty: someone else's now
        return True

    # -- compare-and-swap (the driver lease) ---------------------------------------------------------------
    def read_versioned(self, rel: str) -> tuple[bytes, str] | None:
        """(bytes, version) of `rel`, None when absent. The version is what write_if compares: the content's
        sha256 on a filesystem, the object's ETag on S3 (read before the body: a change in between makes the
        compare-and-swap fail, never pass wrongly)."""
        path = self.full(rel)
        if self.local:
            try:
                with open(path, "rb") as fh:
                    data = fh.read()
            except FileNotFoundError:
                return None
            return data, sha256(data)

        def get() -> tuple[bytes, str] | None:
            try:
                etag = self.fs.info(path, refresh=True)["ETag"]
                return self.fs.cat_file(path), etag
            except FileNotFoundError:
                return None

        return self._retry(f"read {rel}", get)

    def write_if(self, rel: str, data: bytes, version: str | None) -> str:
        """Write `rel` only if it is still at `version` (None: only if it does not exist); VersionConflict if not.
        Returns the new version. Not fenced: this is how the fence itself is kept. On a filesystem a lock file
        (POSIX lockf, which NFSv4 honours) holds the check and the rename together; on S3 the PUT is conditional
        (If-None-Match: * / If-Match: ETag)."""
        path = self.full(rel)
        if self.local:
            with _cas_locked(path, self.ensure_dir):
                found = self.read_versioned(rel)
                if (found[1] if found else None) != version:
                    raise VersionConflict(rel)
                _replace_local(path, data)
            return sha256(data)

        def put() -> str:
            match = {"IfMatch": version} if version is not None else {"IfNoneMatch": "*"}
            try:
                self.fs.pipe_file(path, data, **match)
            except (FileExistsError, OSError) as exc:
                if not _precondition_failed(exc):
                    raise
                found = self.read_versioned(rel)  # our own PUT may have landed before a retry: then it is ours
                if found is None or found[0] != data:
                    raise VersionConflict(rel) from None
            return self.fs.info(path, refresh=True)["ETag"]

        return self._retry(f"write {rel}", put)

    def write_new(self, rel: str, data: bytes) -> None:
        """Write once: refuse to replace an existing artifact (data that was there is never lost)."""
        if self.exists(rel):
            raise SomaError(f"{self.url}/{rel} already exists; it is never overwritten (use a new campaign URL)")
        self.write_bytes(rel, data)

    def remove(self, rel: str) -> None:
        """Delete one artifact (absent already: nothing to do). Used only to retract a pointer such as latest.json."""
        self._fenced()
        path = self.full(rel)
        if self.local:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            return

        def rm() -> None:
            try:
                self.fs.rm_file(path)
            except FileNotFoundError:
                pass
            self.fs.invalidate_cache(path)

        self._retry(f"remove {rel}", rm)

    def remove_tree(self, rel: str) -> None:
        """Delete rel and everything under it (absent already: nothing to do). Used for prepare's staging and to
        undo a failed prepare in a campaign it found empty."""
        self._fenced()
        path = self.full(rel)
        if self.local:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                self.remove(rel)
            return

        def rm() -> None:
            try:
                self.fs.rm(path, recursive=True)
            except FileNotFoundError:
                pass
            self.fs.invalidate_cache(path)

        self._retry(f"remove {rel}", rm)

    def write_json(self, rel: str, obj: dict[str, Any]) -> None:
        body = dict(obj)
        body.pop("checksum", None)
        body["checksum"] = sha256(canonical_json(body))
        self.write_bytes(rel, json.dumps(body, indent=1, sort_keys=True).encode())

    def read_json(self, rel: str) -> dict[str, Any]:
        try:
            raw = self.read_bytes(rel)
        except FileNotFoundError:
            raise SomaError(missing_file(self.url, rel)) from None
        return parse_checked_json(raw, f"{self.url}/{rel}")

    def listdir(self, rel: str) -> list[str]:
        """Names (not paths) directly under rel; empty when rel does not exist."""
        path = self.full(rel, root_ok=True)

        def ls() -> list[str]:
            try:
                names = (
                    PurePosixPath(p).name for p in self.fs.ls(path, detail=False, refresh=True) if p.rstrip("/") != path
                )
                return sorted(n for n in names if not n.startswith(_PRIVATE))
            except FileNotFoundError:
                return []

        return self._retry(f"list {rel}", ls)

    def walk(self, rel: str) -> list[str]:
        """Paths (relative to the root) of every file under rel, sorted; empty when rel does not exist.
        The store's private names (writes in flight ".tmp-*", scratch ".soma-*") are left out."""
        base = self.full(rel)

        def find() -> list[str]:
            try:
                return sorted(self.fs.find(base))  # s3fs lists a whole prefix from the server, never its cache
            except FileNotFoundError:
                return []

        paths = [p[len(self.root) + 1 :] for p in self._retry(f"list {rel}", find)]
        return [p for p in paths if not any(part.startswith(_PRIVATE) for part in PurePosixPath(p).parts)]

    def local_copy(self, rel: str, cache_dir: str, sha: str | None = None) -> str:
        """A local filesystem path to the artifact (itself when local; a cached download otherwise).

        The cache is keyed by campaign URL; a cached file whose sha256 is not `sha` is fetched again."""
        if self.local:
            return self.full(rel)
        target = Path(cache_dir) / sha256(self.url.encode())[:16] / safe_relpath(rel)
        if target.exists() and (sha is None or file_sha256(str(target)) == sha):
            return str(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f"{temp_prefix()}{uuid.uuid4().hex[:8]}")
        try:
            self._retry(f"download {rel}", lambda: self.fs.get_file(self.full(rel), str(tmp)))
            os.replace(tmp, target)
        finally:
            if tmp.exists():
                tmp.unlink()
        return str(target)

    # -- append-only logs ---------------------------------------------------------------------------------
    def append(self, log: str, record: dict[str, Any]) -> None:
        """Append one record to the log `log` (e.g. 'events.jsonl'); inside `batch()` it lands at the batch's end."""
        body = dict(record)
        body["checksum"] = sha256(canonical_json(body))
        line = json.dumps(body, sort_keys=True)
        if self._batch is not None:
            self._batch.setdefault(log, []).append(line)
        else:
            self._write_lines(log, [line])

    @contextmanager
    def batch(self, background: bool = False, retry: Retry | None = None) -> Iterator[None]:
        """Hold appends back and write each log's records together: one fdatasync (local) or one object
        (remote) per log and flush instead of one per record. With `background`, `flush(wait=False)` hands
        the held records to one writer thread (in order), so the caller's loop does not wait on the disk or
        the store. A crash inside loses the records not yet written, as a crash just before them would; reads
        inside see them (they are written first). The batch's end writes and waits for everything. `retry`, when
        given, runs each background write as retry(write, what): the driver's waits out a write that fails for the
        disk or the store (full, read-only, unreachable: soma_cluster/failures.py's `waiting`), in order, before it
        counts as failed."""
        if self._batch is not None:  # nested: the outer batch writes
            yield
            return
        self._batch = {}
        self._writer = _LogWriter(self._write_lines, retry) if background else None
        try:
            yield
        finally:
            try:
                self.flush()
            finally:
                if self._writer is not None:
                    self._writer.close()
                self._batch, self._writer = None, None

    def flush(self, wait: bool = True) -> None:
        """Write the held records; wait=False (in a background batch) only hands them to the writer. A failed
        background write is raised here, at the next flush that waits."""
        if self._batch:
            held, self._batch = self._batch, {}
            if self._writer is not None:
                self._writer.submit(held)
            else:
                for log, lines in held.items():
                    self._write_lines(log, lines)
        if wait and self._writer is not None:
            self._writer.drain()

    def _write_lines(self, log: str, lines: list[str]) -> None:
        data = "".join(line + "\n" for line in lines).encode()
        if self.local:
            self._fenced()
            path = self.full(log)
            self.ensure_dir(os.path.dirname(path))
            if log not in self._tails_checked:
                _cut_torn_tail(path, f"{self.url}/{log}")
                self._tails_checked.add(log)
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)  # the umask decides, as for open()
            try:
                _append_whole(fd, data)
            except OSError as exc:
                raise with_path(exc, path) from exc
            finally:
                os.close(fd)
        else:
            # one object per batch of records (JSON lines); the name is fixed before the first try, so a
            # retried PUT that had in fact landed rewrites the same object instead of adding a duplicate
            name = f"{time.time_ns():020d}-{uuid.uuid4().hex[:8]}.jsonl"
            self.write_bytes(f"{log}.d/{name}", data)
            self._log_cache.setdefault(log, {})[name] = _parse_lines(data, f"{self.url}/{log}.d/{name}")

    def read_log(self, log: str) -> list[dict[str, Any]]:
        self.flush()
        return list(self._iter_log(log))

    def _iter_log(self, log: str) -> Iterator[dict[str, Any]]:
        where = f"{self.url}/{log}"
        if self.local:
            path = self.full(log)
            if not os.path.exists(path):
                return
            lines = Path(path).read_bytes().split(b"\n")
            torn = lines[-1]  # no trailing newline: a write interrupted by a crash, never acknowledged
            for i, raw in enumerate(lines[:-1]):
                yield parse_checked_json(raw, f"{where} line {i + 1}")
            if torn.strip():
                return
        else:
            # record objects are written once and never change, so each is fetched once per Store
            # (in parallel); only the listing is repeated
            cache = self._log_cache.setdefault(log, {})
            names = [n for n in self.listdir(f"{log}.d") if not n.startswith(".")]
            missing = [n for n in names if n not in cache]
            for a in range(0, len(missing), 256):
                batch = {self.full(f"{log}.d/{n}"): n for n in missing[a : a + 256]}
                blobs = self._retry(f"read {log}", partial(self.fs.cat, list(batch), on_error="raise"))
                for path, n in batch.items():
                    cache[n] = _parse_lines(blobs[path], f"{where}.d/{n}")
            for n in names:
                for rec in cache[n]:
                    yield dict(rec)


class _LogWriter:
    """One thread that writes handed-over log records in order; its first error is kept and raised by drain().
    Each write runs through `retry` (Store.batch), if given: the driver waits out its disk as its workers do."""

    def __init__(self, write: Callable[[str, list[str]], None], retry: Retry | None = None):
        self.write, self.error, self.retry = write, None, retry
        self.queue: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="soma-log-writer", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            held = self.queue.get()
            try:
                if held is None:
                    return
                if self.error is None:
                    for log, lines in held.items():
                        self._write_waiting(log, lines)
            except BaseException as exc:  # kept for the caller: records are never dropped silently
                self.error = exc
            finally:
                self.queue.task_done()

    def _write_waiting(self, name: str, lines: list[str]) -> None:
        if self.retry is None:
            self.write(name, lines)
        else:
            self.retry(lambda: self.write(name, lines), f"writing {name}")

    def submit(self, held: dict[str, list[str]]) -> None:
        self._raise()
        self.queue.put(held)

    def drain(self) -> None:
        self.queue.join()
        self._raise()

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join()

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error


def _cut_torn_tail(path: str, where: str) -> None:
    """Before the first append to a local log, cut off an unterminated last record: a write a crash
    interrupted, never acknowledged (readers already skip it). As a write-ahead log does, so the next
    record starts on a line of its own instead of being glued onto the fragment."""
    try:
        # a missing log is not an error: only the open is guarded, and `with fh` below closes it
        fh = open(path, "rb+")  # noqa: SIM115
    except FileNotFoundError:
        return
    with fh:
        size = fh.seek(0, os.SEEK_END)
        end, block = size, 1 << 16
        while end > 0:  # the last newline, read backwards a block at a time
            start = max(0, end - block)
            fh.seek(start)
            nl = fh.read(end - start).rfind(b"\n")
            if nl >= 0:
                end = start + nl + 1
                break
            end = start
        if end < size:
            fh.truncate(end)
            fh.flush()
            os.fsync(fh.fileno())
            log.warning(
                "%s: cut off an unterminated last record (%d bytes) left by an interrupted write", where, size - end
            )


def file_mode() -> int:
    """The mode open() gives a new file under this process's umask (0666 & ~umask). Files written whole go through
    mkstemp, which makes them 0600 whatever the umask: a teammate on a shared disk could not read the campaign.
    The umask is read from /proc (reading it with os.umask means setting it, racing other threads)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    with _UMASK_LOCK:
        mask = os.umask(0o022)
        os.umask(mask)
    return 0o666 & ~mask


def temp_prefix() -> str:
    """The name every staged file starts with: its maker's host and pid, for Store.sweep_leftovers."""
    return f"{TEMP}{socket.gethostname()}-{os.getpid()}-"


def _mtime(path: str) -> float:
    try:
        return os.lstat(path).st_mtime
    except FileNotFoundError:
        return float("inf")


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:  # gone already, or a read-only campaign: the sweep is best effort
        pass


def pid_alive(pid: int) -> bool:
    """A process `pid` runs on this host (another user's included)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _replace_local(path: str, data: bytes) -> None:
    """Write `path` whole: a temporary name beside it, fsync, rename (readers see the old file or the new one). Its
    directory exists already (Store.ensure_dir)."""
    directory = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=temp_prefix())
    try:
        os.fchmod(fd, file_mode())
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


@contextmanager
def _cas_locked(path: str, ensure_dir: Callable[[str], str]) -> Iterator[str]:
    """Hold `path`'s lock file (`.<name>.lock` beside it) exclusively. POSIX lockf excludes other processes only (its
    locks are the process's, and closing any of its descriptors drops them), so threads of this one take _CAS_LOCK
    first. A lock file unlinked by remove_if while this waited is not the lock any more: take the new one."""
    import fcntl

    lockpath = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.lock")
    with _CAS_LOCK:
        while True:
            ensure_dir(os.path.dirname(path))  # never re-creates a campaign directory removed under the command
            with open(lockpath, "a+b") as lock:
                fcntl.lockf(lock, fcntl.LOCK_EX)
                try:
                    try:
                        current = os.path.samestat(os.fstat(lock.fileno()), os.stat(lockpath))
                    except FileNotFoundError:
                        current = False
                    if current:
                        yield lockpath
                        return
                finally:
                    fcntl.lockf(lock, fcntl.LOCK_UN)


def _precondition_failed(exc: BaseException) -> bool:
    """s3fs turns a 412 into FileExistsError (If-None-Match) or an EINVAL OSError (If-Match)."""
    return isinstance(exc, FileExistsError) or "precondition" in str(exc).lower().replace("-", "")


def _append_whole(fd: int, data: bytes) -> None:
    """Append all of `data` or nothing: write(2) may write part of it and stop (a disk that fills meanwhile);
    the part is cut off again, so a log never holds half a record with the next one glued onto it."""
    start = os.fstat(fd).st_size
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view) :]
        _datasync(fd)
    except OSError:
        os.ftruncate(fd, start)
        raise


def _datasync(fd: int) -> None:
    """Durable append: fdatasync flushes the data and the new file size (what a reader needs), skipping
    the timestamps fsync also writes; ~10x cheaper per heartbeat (0.2 vs 1.8 ms measured here)."""
    (getattr(os, "fdatasync", None) or os.fsync)(fd)


def _parse_lines(raw: bytes, where: str) -> list[dict[str, Any]]:
    """A remote log object: one record (older '.json' objects) or JSON lines, each with its own checksum."""
    return [
        parse_checked_json(line, f"{where} line {i + 1}") for i, line in enumerate(raw.splitlines()) if line.strip()
    ]


def parse_checked_json(raw: bytes, where: str) -> dict[str, Any]:
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ChecksumError(f"{where} is not valid JSON (truncated or corrupt); restore or delete it") from None
    if not isinstance(obj, dict) or "checksum" not in obj:
        raise ChecksumError(f"{where} carries no checksum; it was not written by soma-cluster")
    want = obj.pop("checksum")
    if sha256(canonical_json(obj)) != want:
        raise ChecksumError(f"{where} fails its checksum (corrupt or edited); restore or delete it")
    return obj


def file_sha256(path: str, block: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(block):
            h.update(chunk)
    return h.hexdigest()


class StagedFile:
    """A local file being written for the artifact `rel`. publish() puts it there atomically: a local store's file
    is made in rel's own directory under a hidden ".tmp-*" name and renamed (same filesystem, so the rename is
    atomic wherever the campaign lives); a remote store's is made in `scratch` (else the checked temp dir) and
    uploaded in one PUT. Used as a context manager, a file not published is removed, and a disk condition met
    while writing (pyarrow's errors name no file) is raised naming the directory it was written in."""

    def __init__(self, store: Store, rel: str, suffix: str = "", scratch: str | None = None):
        self.store, self.rel, self.target = store, rel, store.full(rel)
        directory = store.ensure_dir(os.path.dirname(self.target)) if store.local else (scratch or require_temp_dir())
        try:
            fd, self.path = tempfile.mkstemp(dir=directory, prefix=temp_prefix(), suffix=suffix)
        except OSError as exc:
            raise with_path(exc, directory) from exc
        os.close(fd)
        self.published = False

    def publish(self) -> None:
        self.store._fenced()
        if self.store.local:
            os.chmod(self.path, file_mode())
            os.replace(self.path, self.target)
        else:
            self.store._retry(f"upload {self.rel}", lambda: self.store.fs.put_file(self.path, self.target))
            os.unlink(self.path)
        self.published = True

    def discard(self) -> None:
        if not self.published and os.path.exists(self.path):
            os.unlink(self.path)

    def __enter__(self) -> "StagedFile":
        return self

    def __exit__(self, kind, exc, tb) -> None:
        self.discard()
        if isinstance(exc, OSError) and not exc.filename:
            raise with_path(exc, os.path.dirname(self.path)) from exc


def put_file(store: Store, local_path: str, rel: str) -> None:
    """Move a finished local file into the campaign (rename locally; one upload remotely). A local file on
    another filesystem than the campaign is copied beside the target first, so the last step is still an
    atomic rename (StagedFile avoids the copy by writing there in the first place)."""
    if not store.local:
        store._fenced()  # (locally, StagedFile.publish fences the rename)
        store._retry(f"upload {rel}", lambda: store.fs.put_file(local_path, store.full(rel)))
        os.unlink(local_path)
        return
    with store.stage_file(rel) as staged:
        try:
            os.replace(local_path, staged.path)
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise
            shutil.copyfile(local_path, staged.path)
            os.unlink(local_path)
        staged.publish()
