"""Whose failure is it: the expert's own, or the infrastructure's (docs/scheduling.md). No Ray here.

An expert's own failure (its code raised, its loss went non-finite, its process died on a node that lives on,
it hung) counts against `retry.max_retries`: retrying it a few times with backoff is the right answer, and one
that keeps failing ends `failed_permanently`. A failure of the infrastructure under it (the campaign's disk full
or read-only, the store refusing access or unreachable past its retries, its node gone, the node out of memory)
says nothing about the expert: every expert fails the same way within seconds, so counting it would spend every
expert's retries at once. Those are waited out instead (retried with backoff, uncounted, for at most
`retry.infra_wait_s`), then the campaign stops and says which condition to fix before `soma resume`.

A worker SIGKILLed on a live node stays the expert's failure: the kernel's OOM killer, a segfault and an
operator's kill look the same from here, and the first two can be the expert's own doing. A dead node is not.
Ray's memory monitor (`ray.exceptions.OutOfMemoryError`) kills a worker for the node's memory pressure, not for
that worker's use alone: infrastructure. A MemoryError raised in the expert's own code is the expert's.

The errno mapping is soma_cluster/diskerrors.py's, the one the commands use to refuse bad disks up front.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Callable, TypeVar

from soma_cluster.diskerrors import DiskCondition, StorageError, condition_of, describe
from soma_cluster.errors import SomaError, StorageUnreachable
from soma_cluster.jobs import SEED_JOB, Cause, JobState, expert_name

T = TypeVar("T")
log = logging.getLogger(__name__)


# the disk conditions (soma_cluster/diskerrors.py: errno -> condition, shared with the commands' checks) that are
# the infrastructure's; the others (a missing file, a file in a directory's place) are bad input or a bug
_DISK = {
    DiskCondition.FULL: Cause.DISK_FULL,
    DiskCondition.NO_INODES: Cause.NO_INODES,
    DiskCondition.READ_ONLY: Cause.READ_ONLY,
    DiskCondition.DENIED: Cause.PERMISSION,
}
# the same conditions as they read in a message, for errors that carry no errno (pyarrow's, a C library's)
_TEXT = (
    (re.compile(r"No space left on device|Disk quota exceeded|\[Errno (28|122)\]"), Cause.DISK_FULL),
    (re.compile(r"Read-only file system|\[Errno 30\]"), Cause.READ_ONLY),
)

# what the operator does about each condition, for the line the campaign stops with ({url}: the campaign's)
FIX = {
    Cause.DISK_FULL: "free space (or raise the quota) on the filesystem that holds {url}",
    Cause.NO_INODES: "delete files (e.g. old campaigns) on the filesystem that holds {url}, or move it to one with "
    "more inodes: its bytes are not the limit",
    Cause.READ_ONLY: "make the filesystem that holds {url} writable again (remount it read-write)",
    Cause.PERMISSION: "give the user the workers run as read and write access to {url}",
    Cause.STORAGE_UNREACHABLE: (
        "bring the store of {url} back within reach of the driver and workers (endpoint, network)"
    ),
    Cause.NODE_LOST: "check the cluster's nodes (ray status) and that GPU nodes can join it",
    Cause.OUT_OF_MEMORY: "free memory on the nodes, or give each expert more (fewer actors per node)",
}
WORDS = {
    Cause.DISK_FULL: "disk full",
    Cause.NO_INODES: "no inodes left (bytes are free, files are not)",
    Cause.READ_ONLY: "read-only filesystem",
    Cause.PERMISSION: "permission denied",
    Cause.STORAGE_UNREACHABLE: "storage unreachable",
    Cause.NODE_LOST: "node lost",
    Cause.OUT_OF_MEMORY: "out of memory",
}


def _chain(exc: BaseException):
    """exc, then what it was raised from or during (bounded: a cycle of contexts ends it)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen and len(seen) < 16:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def exception_cause(exc: BaseException) -> Cause:
    """The cause of an exception raised in a worker (the original, as Ray's RayTaskError.cause carries it)."""
    for e in _chain(exc):
        if isinstance(e, StorageUnreachable):
            return Cause.STORAGE_UNREACHABLE
        cond = e.condition if isinstance(e, StorageError) else condition_of(e)
        if cond in _DISK:
            return _DISK[cond]
    for e in _chain(exc):
        for pattern, cause in _TEXT:
            if pattern.search(str(e)):
                return cause
    if isinstance(exc, SomaError):
        return Cause.BAD_INPUT
    if type(exc).__name__ == "NonFiniteLoss":
        return Cause.NON_FINITE
    return Cause.EXCEPTION


def error_cause(text: str) -> Cause:
    """The cause of an error a worker reported as text (a packed expert that failed alone: `Type: message`, as
    Heartbeat.error holds it), by the same rules as exception_cause where the text tells them."""
    if text.split(":", 1)[0].strip() == "NonFiniteLoss":
        return Cause.NON_FINITE
    return next((cause for pattern, cause in _TEXT if pattern.search(text)), Cause.EXCEPTION)


# Ray's GCS writes this into the error of every actor that died with its node (ray 2.60)
_NODE_DIED = re.compile(r"its node has died|node .* (is dead|has died|was removed)", re.I)


RAISED_ON = "soma_node"  # the attribute a worker's exception carries: the Ray node id it was raised on


def raised_on(exc: BaseException, node: str | None) -> BaseException:
    """Mark `exc` with the node it is raised on (a worker's set-up, before the driver has heard where it runs); the
    attribute travels with the exception to the driver (Ray pickles the exception, its __dict__ included)."""
    if node is not None:
        setattr(exc, RAISED_ON, node)
    return exc


def node_of(exc: BaseException) -> str | None:
    """The node a worker's exception was raised on, if it says."""
    node = getattr(exc, RAISED_ON, None)
    return node if isinstance(node, str) else None


def actor_death_cause(message: str) -> Cause:
    """An actor that died without raising (Ray's ActorDiedError): its node died, or only its process did."""
    return Cause.NODE_LOST if _NODE_DIED.search(message) else Cause.CRASH


def waiting(fn: Callable[[], T], wait_s: float, what: str, causes: frozenset[Cause] | None = None) -> T:
    """fn(), tried again with backoff (0.1 s doubling to 5 s) while it fails for the infrastructure, for up to wait_s:
    the driver's own reads and writes wait out the disk or the store as its workers do. Then the error is raised.
    `causes`: only these infrastructure causes are waited out (None: every one); any other error is raised at once."""
    deadline, delay = time.monotonic() + wait_s, 0.1
    while True:
        try:
            return fn()
        except (OSError, SomaError) as exc:
            cause = exception_cause(exc)
            waited = cause.infra and (causes is None or cause in causes)
            if not waited or time.monotonic() + delay > deadline:
                raise
            log.warning("%s failed (%s); trying again in %.1f s", what, describe(exc), delay)
            time.sleep(delay)
            delay = min(delay * 2, 5.0)


def stop_line(cause: Cause, reason: str, who: str, waited_s: float, bound_s: float, url: str) -> str:
    """The one line a campaign stopped by its environment ends with; `who` waited (e.g. "expert-0003's retries"),
    `reason` is what failed (the error, not the cause's name)."""
    return (
        f"the campaign stopped: {WORDS[cause]} ({reason}), {who} waited {waited_s:.0f} s for it "
        f"(retry.infra_wait_s={bound_s:g}); {FIX[cause].format(url=url)}, then run soma resume {url}"
    )


def expert_names(requested: list[str], names: list[str]) -> list[str]:
    """Job names for what a user typed (expert-0003, expert-3, 3), in the order given, once each; SomaError for one
    not in `names`."""
    out = []
    for raw in requested:
        name = raw.strip()
        number = re.fullmatch(r"(?:expert-)?(\d+)", name)
        if number:
            name = expert_name(int(number.group(1)))
        if name == SEED_JOB.name and name not in names:
            raise SomaError("the seed is not an expert: reopen it with soma seed CAMPAIGN --retry-failed")
        if name not in names:
            raise SomaError(
                f"{raw!r} names no {'expert' if names[-1] != SEED_JOB.name else 'job'} of this campaign "
                f"({names[0]} to {names[-1]}); name experts as expert-0003 or 3"
            )
        if name not in out:
            out.append(name)
    return out


def select_failed(states: dict[str, str], names: list[str], requested: list[str] | None = None) -> list[str]:
    """The jobs `--retry-failed` reopens: every one of `names` whose state is failed_permanently, or the
    `requested` ones, each of which must be (SomaError naming the first that is not, and its state)."""
    failed = [n for n in names if states.get(n) == JobState.FAILED_PERMANENTLY]
    if not requested:
        return failed
    chosen = expert_names(requested, names)
    for name in chosen:
        if name not in failed:
            raise SomaError(
                f"{name} is {states.get(name, JobState.PENDING)}, not failed_permanently: --retry-failed reopens only "
                f"jobs that failed permanently ({', '.join(failed) if failed else 'none here'})"
            )
    return chosen
