"""The driver lease (soma_cluster/lease.py) held for a command: acquired on entry, renewed by a thread,
fencing every write of the campaign's Store, released on the way out however the command ends.

Re-entrant within a process: `soma demo` runs prepare, seed and launch under one lease, and a pipeline
function that takes the lease itself (for library callers such as `soma experiment`) reuses the one its CLI
command already holds.
"""

from __future__ import annotations

import errno
import functools
import inspect
import os
import sys
from contextlib import contextmanager
from typing import Iterator

import psutil

from pipelines.common import contents
from pipelines.stopping import STOP
from soma_cluster.campaignfile import CONFIG_FILE
from soma_cluster.diskerrors import MARGIN_BYTES, storage_error
from soma_cluster.errors import SomaError, StorageUnreachable
from soma_cluster.lease import LEASE, Lease
from soma_cluster.storage import STAGING, Store
from soma_cluster.targets import occupied

STALE_TEMP_S = 3600.0  # another host's staged file unchanged this long (by the filesystem's clock) is a dead writer's
_held: dict[str, tuple[Lease, int]] = {}  # campaign URL -> (its lease, how many holders in this process)


@contextmanager
def hold(store: Store, command: str, take_over: bool = False, need_bytes: int = MARGIN_BYTES) -> Iterator[Lease]:
    """Hold `store`'s campaign for `command` (LeaseHeld if another live driver holds it; with take_over, wait up
    to its ttl for its lease to lapse). The first holder checks first that the place takes writes and has
    `need_bytes` free (Store.check_writable), so a command need not check again."""
    lease, count = _held.get(store.url, (None, 0))
    empty, created, made_from = False, False, None
    if lease is None:
        if store.local and os.path.isdir(store.root):
            _refuse_foreign(store)  # by reading: before the probe write of check_writable changes the directory
        store.check_writable(need_bytes)  # a full, read-only or missing place is named before anything is made there
        _refuse_foreign(store)
        created = store.local and not os.path.isdir(store.root)
        made_from = _first_missing(store.root) if created else None  # parents the lease's write makes too
        empty = created or not contents(store)
        lease = Lease(store, command)
        try:
            lease.acquire(take_over)
        except OSError as exc:
            # worded as the commands' own disk checks word it (soma_cluster/diskerrors.py), naming the campaign
            err = storage_error(exc, store.root if store.local else store.url, f"taking its driver lease, {LEASE}")
            if err is not None:
                raise err from None
            raise SomaError(
                f"cannot take the driver lease {store.url}/{LEASE}: {_why(exc)}; a command that writes the "
                f"campaign needs a writable directory with free space"
            ) from None
        lease.start_renewing()
        _sweep(store)
    _held[store.url] = (lease, count + 1)
    before = store.fence
    store.fence = lease.check
    try:
        yield lease
    finally:
        with STOP.deferred():  # a signal now waits: the lease is released whole, however the command ends
            store.fence = before
            lease, count = _held[store.url]
            if count == 1:
                del _held[store.url]
                _release(store, lease)
                if empty and not contents(store):  # refused or undone where there was no campaign: leave no lease
                    lease.forget(remove_dir=created)
                    if made_from is not None:
                        _remove_empty_parents(store.root, made_from)
            else:
                _held[store.url] = (lease, count - 1)


def refuse_held(store: Store, command: str, take_over: bool = False) -> None:
    """A campaign another live driver holds is refused first, by reading its lease (nothing written), before the
    command's own checks: that driver is what the user needs to hear of (a prepare still running is why there is no
    seed yet). With take_over, or where this process holds it already, hold() decides."""
    if take_over or held(store.url) is not None:
        return
    Lease(store, command).refuse_if_held()


def _release(store: Store, lease: Lease) -> None:
    """Release the lease on the way out; a store still unreachable then (the command stops for it) leaves it to
    lapse: the command's own error says what happened, and the next driver on this host takes it at once (its
    holder is gone), elsewhere after its ttl."""
    try:
        lease.release()
    except StorageUnreachable as exc:
        print(
            f"warning: the driver lease {store.url}/{LEASE} was not released ({str(exc).split('; ')[0]}); it lapses "
            f"{lease.ttl_s:g} s after its last renewal",
            file=sys.stderr,
            flush=True,
        )


def _sweep(store: Store) -> None:
    """This driver is the campaign's only writer now: remove what killed writers left in it. This host's dead
    processes' staged files and scratch at once; another host's (and unattributed ones) once the filesystem's own
    clock dates them STALE_TEMP_S before the lease it just wrote; a Ray prepare's staging, which only a running
    prepare (a holder of this lease) keeps."""
    removed = []
    if store.local:
        stale_before = os.lstat(store.full(LEASE)).st_mtime - STALE_TEMP_S
        removed = store.sweep_leftovers(psutil.pid_exists, stale_before)
    if store.listdir(STAGING):
        store.remove_tree(STAGING)
        removed.append(STAGING)
    if removed:
        shown = ", ".join(removed[:3]) + (f" and {len(removed) - 3} more" if len(removed) > 3 else "")
        print(f"soma: removed what killed commands left in {store.url}: {shown}", file=sys.stderr, flush=True)


def _first_missing(path: str) -> str:
    """The outermost directory of `path` that does not exist yet."""
    path = os.path.abspath(path)
    while not os.path.isdir(os.path.dirname(path)) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def _remove_empty_parents(root: str, made_from: str) -> None:
    """Undo the parents a refused command created for its lease (only empty ones, up to `made_from`)."""
    path = os.path.dirname(os.path.abspath(root))
    while path == made_from or path.startswith(made_from + os.sep):
        try:
            os.rmdir(path)
        except OSError:  # not empty (something else made a file there meanwhile), or gone: leave it
            return
        path = os.path.dirname(path)


def _refuse_foreign(store: Store) -> None:
    """A lease goes only into a campaign, or a directory that is empty or new: never among someone else's files."""
    if not store.exists(CONFIG_FILE) and (names := contents(store)):
        raise occupied(store.url, names, CONFIG_FILE)


def held(url: str) -> Lease | None:
    """This process's lease on the campaign at `url`, if it holds one."""
    entry = _held.get(url.rstrip("/"))
    return entry[0] if entry else None


def _why(exc: OSError) -> str:
    name = errno.errorcode.get(exc.errno or 0, "")
    return f"{os.strerror(exc.errno)} ({name})" if exc.errno else str(exc)


def holding(command: str, store_arg: str = "store"):
    """A pipeline function that writes a campaign holds its lease while it runs (re-entrant, see `hold`): the
    function's argument `store_arg` names the campaign."""

    def wrap(fn):
        params = inspect.signature(fn)

        @functools.wraps(fn)
        def held_call(*args, **kwargs):
            with hold(params.bind(*args, **kwargs).arguments[store_arg], command):
                return fn(*args, **kwargs)

        return held_call

    return wrap
