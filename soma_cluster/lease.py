"""One driver per campaign: a lease in the campaign store, renewed while the driver runs, with a generation
that fences a driver (and its workers) out once another driver has taken the campaign over.

The lease is one small JSON object, `<campaign>/driver-lease.json`, changed only by compare-and-swap
(Store.write_if: a lock file around the check and the rename on a filesystem, If-None-Match / If-Match on
S3). It names its holder (host, pid, the process's start time, the host's boot id, the command) and when it
was last renewed. Every acquisition writes generation + 1.

A candidate may take the campaign over when the lease was released, when its holder's host says the pid is
gone (same host and boot: a SIGKILLed or crashed driver is replaced at once), or when it expired: the candidate
saw the lease file unchanged for `ttl_s`, measured on its own monotonic clock. The `renewed_at` a holder writes
is its host's wall clock, which may be an hour ahead or behind this one (or jump during a run), so it never
frees a lease by itself: a lease renewed recently by it is refused at once (HELD), and one that looks lapsed or
renewed in the future (SUSPECT) is watched for a ttl before it is taken. The holder, for its part, writes only
within `ttl_s - margin_s` of the start of its last successful renewal by its own monotonic clock (a paused
process's clock runs on), and renews in place (a compare-and-swap) before writing past that, so two drivers
never write the same campaign whatever the hosts' wall clocks say, as long as their clocks *rates* agree within
`margin_s` per ttl (ttl_s / 3). The remaining window is one write already past its check when the process is
paused.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass, replace
from enum import StrEnum
from typing import Callable

from soma_cluster.diskerrors import describe
from soma_cluster.envvars import value as env_value
from soma_cluster.errors import SomaError
from soma_cluster.storage import Store, VersionConflict

LEASE = "driver-lease.json"
LEASE_FILES = (LEASE, f".{LEASE}.lock")  # the lease and its lock file (Store.write_if): not campaign content
TTL_ENV = "SOMA_LEASE_TTL_S"
DEFAULT_TTL_S = 30.0
RENEWALS_PER_TTL = 6  # a renewal every ttl_s / 6 (5 s by default): five may fail before the lease lapses
WORKER_CHECK_S = 1.0  # a worker re-reads the lease at most this often (once per checkpoint in practice)
TAKE_OVER_SLACK_S = 5.0  # --take-over waits the holder's ttl and this long for its lease to lapse


class LeaseHeld(SomaError):
    """Another live driver holds the campaign (CLI: exit 2, one line naming it and how to take over)."""


class LeaseLost(SomaError):
    """This driver (or worker) no longer holds the campaign: another driver took it over while this one was
    paused or cut off. It stops and writes nothing more (CLI: exit 4)."""

    exit_code = 4


class Verdict(StrEnum):
    """What a candidate may do with the lease it found."""

    FREE = "free"  # no lease yet
    RELEASED = "released"  # its holder ended and said so
    DEAD = "dead"  # its holder's host is this host, and the holder's process is gone
    EXPIRED = "expired"  # seen unchanged for its ttl by this host's monotonic clock
    HELD = "held"  # renewed within its ttl by this host's wall clock: refuse (or watch it, with take-over)
    SUSPECT = "suspect"  # renewed more than a ttl ago, or in the future, by this host's wall clock: watch it


FUTURE_TOLERANCE_S = 5.0  # a renewal this far ahead of this host's wall clock is ordinary skew, not a wrong clock


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    started: float  # the process's start time (wall clock): a reused pid is another process
    boot_id: str  # the host's boot: a pid of an earlier boot is gone
    command: str

    @staticmethod
    def here(command: str) -> "Holder":
        return Holder(socket.gethostname(), os.getpid(), _process_start(os.getpid()) or 0.0, boot_id(), command)

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host} ({self.command!r}, started {_clock(self.started)})"


@dataclass(frozen=True)
class LeaseRecord:
    generation: int
    token: str  # this acquisition's own id: a renewal or release must find it unchanged
    holder: Holder
    acquired_at: float
    renewed_at: float
    ttl_s: float
    released: bool = False

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True, indent=1).encode()

    @staticmethod
    def from_bytes(raw: bytes, where: str) -> "LeaseRecord":
        try:
            d = json.loads(raw)
            return LeaseRecord(**{**d, "holder": Holder(**d["holder"])})
        except (ValueError, TypeError, KeyError):
            raise SomaError(
                f"{where} is not a soma driver lease (corrupt or edited); if no driver runs on this campaign, "
                f"delete it and run the command again"
            ) from None


def judge(rec: LeaseRecord | None, now: float, here: Holder, alive: Callable[[int, float], bool]) -> Verdict:
    """What `here` may do with the lease `rec` at this host's wall time `now`, on one reading. `alive(pid, started)`
    asks this host whether that process runs; it is consulted only for a holder on this host and boot. A reading
    never says EXPIRED: the holder's `renewed_at` is its own host's clock (see Sighting)."""
    if rec is None:
        return Verdict.FREE
    if rec.released:
        return Verdict.RELEASED
    h = rec.holder
    if h.host == here.host and h.boot_id == here.boot_id and not alive(h.pid, h.started):
        return Verdict.DEAD
    if -FUTURE_TOLERANCE_S <= now - rec.renewed_at <= rec.ttl_s:
        return Verdict.HELD
    return Verdict.SUSPECT


@dataclass(frozen=True)
class Sighting:
    """A lease file as this host saw it: its version (content hash or ETag) and when, on this host's monotonic
    clock, that version was first seen. Only a lease unchanged for its ttl by this clock has expired: no other
    host's wall clock (nor this one's, which may jump) enters the decision."""

    version: str | None
    since: float  # monotonic seconds

    def after(self, version: str | None, now: float) -> "Sighting":
        """The sighting after reading `version` at monotonic `now`: the same one while the file is unchanged."""
        return self if version == self.version else Sighting(version, now)

    def lapsed(self, now: float, ttl_s: float) -> bool:
        return now - self.since > ttl_s


def lease_ttl_s(environ: dict[str, str] | None = None) -> float:
    ttl = env_value(TTL_ENV, environ)  # bounds and wording: the registry's
    return DEFAULT_TTL_S if ttl is None else ttl


class Lease:
    """This process's hold on a campaign. `acquire()`, then `store.fence = lease.check` fences every write the
    store makes; a thread renews it every ttl_s / RENEWALS_PER_TTL; `release()` at the end."""

    def __init__(
        self,
        store: Store,
        command: str,
        ttl_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self.store, self.command = store, command
        self.ttl_s = lease_ttl_s() if ttl_s is None else ttl_s
        self.margin_s = self.ttl_s / 3
        self.clock, self.wall, self.sleep = clock, wall, sleep
        self.record: LeaseRecord | None = None
        self._version: str | None = None
        self._renewed = -float("inf")  # monotonic start of the last successful renewal
        self._lost: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def generation(self) -> int:
        return self.record.generation if self.record else 0

    def _read(self) -> tuple[LeaseRecord | None, str | None]:
        found = self.store.read_versioned(LEASE)
        if found is None:
            return None, None
        raw, version = found
        return LeaseRecord.from_bytes(raw, f"{self.store.url}/{LEASE}"), version

    def acquire(self, take_over: bool = False) -> LeaseRecord:
        """Take the campaign, or raise LeaseHeld. A lease that looks live is refused at once, or with take_over
        watched; one that looks lapsed or renewed in the future (another host's clock) is watched either way. A
        watched lease is taken once this host has seen it unchanged for its ttl, and refused if it changes within its
        ttl and a few seconds: it is never broken while its holder renews it."""
        here = Holder.here(self.command)
        deadline, seen = None, None
        while True:
            rec, version = self._read()
            verdict = judge(rec, self.wall(), here, process_alive)
            seen = Sighting(version, self.clock()) if seen is None else seen.after(version, self.clock())
            if verdict in (Verdict.HELD, Verdict.SUSPECT) and seen.lapsed(self.clock(), rec.ttl_s):
                verdict = Verdict.EXPIRED
            if verdict not in (Verdict.HELD, Verdict.SUSPECT):
                if self._take(rec, version, verdict, here):
                    return self.record
                continue  # another candidate won this round: judge its lease
            if verdict is Verdict.HELD and not take_over:
                raise LeaseHeld(self._held_message(rec))
            if deadline is None:
                waited_s = rec.ttl_s + TAKE_OVER_SLACK_S
                deadline = self.clock() + waited_s
                print(f"soma: {self._watching(rec, waited_s)}", file=sys.stderr, flush=True)
            left = deadline - self.clock()
            if left <= 0:
                raise LeaseHeld(self._held_message(rec, waited_s=waited_s))
            self.sleep(min(1.0, left))

    def refuse_if_held(self) -> None:
        """LeaseHeld if, on one reading, a live driver holds the campaign (what acquire() refuses at once without
        take_over); writes nothing. A lease that only looks lapsed is left to acquire(), which watches it."""
        rec, _ = self._read()
        if judge(rec, self.wall(), Holder.here(self.command), process_alive) is Verdict.HELD:
            raise LeaseHeld(self._held_message(rec))

    def _take(self, rec: LeaseRecord | None, version: str | None, verdict: Verdict, here: Holder) -> bool:
        """Write generation + 1 over `rec` (at `version`); False if another candidate changed it first."""
        start = self.clock()
        now = self.wall()
        mine = LeaseRecord((rec.generation if rec else 0) + 1, uuid.uuid4().hex, here, now, now, self.ttl_s)
        try:
            self._version = self.store.write_if(LEASE, mine.to_bytes(), version)
        except VersionConflict:
            return False
        self.record, self._renewed = mine, start
        if rec is not None and verdict in (Verdict.DEAD, Verdict.EXPIRED):
            why = (
                f"had expired (unchanged for {rec.ttl_s:.0f} s by this host's clock)"
                if verdict is Verdict.EXPIRED
                else "was left by a process that is gone"
            )
            print(
                f"soma: took over {self.store.url} from {rec.holder.describe()}: its lease {why} "
                f"(generation {rec.generation} -> {mine.generation})",
                file=sys.stderr,
                flush=True,
            )
        return True

    def _watching(self, rec: LeaseRecord, waited_s: float) -> str:
        skew = self.wall() - rec.renewed_at
        if skew < -FUTURE_TOLERANCE_S:
            why = f"its last renewal is dated {-skew:.0f} s in this host's future (its host's clock is ahead)"
        elif skew > rec.ttl_s:
            why = (
                f"its last renewal is dated {skew:.0f} s ago by this host's clock "
                "(its holder is gone, or its clock is behind)"
            )
        else:
            why = f"it lapses {rec.ttl_s:.0f} s after its last renewal"
        return (
            f"{self.store.url} is held by {rec.holder.describe()}; {why}: watching its lease up to {waited_s:.0f} s, "
            f"taking it if it is not renewed for {rec.ttl_s:.0f} s"
        )

    def _held_message(self, rec: LeaseRecord, waited_s: float = 0.0) -> str:
        age = max(0.0, self.wall() - rec.renewed_at)
        lapse = max(0.0, rec.ttl_s - age)
        if waited_s > 0:
            return (
                f"{self.store.url} is being run by another driver: {rec.holder.describe()} renewed its lease within "
                f"the {waited_s:.0f} s this command watched it, so it is alive; wait for it to end, or stop it first "
                f"(kill {rec.holder.pid} on {rec.holder.host})"
            )
        return (
            f"{self.store.url} is being run by another driver: {rec.holder.describe()}, "
            f"lease renewed {age:.0f} s ago; wait for it to end, or stop it (kill {rec.holder.pid} on "
            f"{rec.holder.host}); if that driver is stuck or its host is gone, run this command again with "
            f"--take-over (it waits for the lease to lapse, {lapse:.0f} s from now, and never displaces a driver "
            "that still renews it)"
        )

    def renew(self) -> None:
        """Compare-and-swap the lease with a new renewal time; LeaseLost if another driver has taken it."""
        with self._lock:
            if self._lost is not None:
                raise LeaseLost(self._lost)
            start, now = self.clock(), self.wall()
            new = replace(self.record, renewed_at=now)
            try:
                self._version = self.store.write_if(LEASE, new.to_bytes(), self._version)
            except VersionConflict:
                self._lose()
                raise LeaseLost(self._lost) from None
            self.record, self._renewed = new, start

    def _lose(self) -> None:
        try:
            rec, _ = self._read()
            who = rec.holder.describe() if rec is not None else "nobody (its lease file was deleted)"
        except SomaError:
            rec, who = None, "nobody (its lease file was overwritten with something else)"
        gen = f" (generation {rec.generation})" if rec is not None else ""
        after = (
            f"follow that driver with soma status {self.store.url}"
            if rec is not None and not rec.released
            else f"once no other driver runs on it, soma resume {self.store.url} continues "
            f"(delete a damaged {LEASE} first)"
        )
        self._lost = (
            f"this driver lost {self.store.url} to {who}{gen}: it stopped without writing anything more; {after}"
        )

    def check(self, now: bool = False) -> None:
        """The fence, called before every write the store makes: past ttl_s - margin_s since the last renewal (a
        paused process, a store that stopped answering), renew first, which fails if the campaign was taken. With
        `now`, renew at once (a worker found the lease changed: the driver's own compare-and-swap decides)."""
        if self._lost is not None:
            raise LeaseLost(self._lost)
        if now or self.clock() - self._renewed > self.ttl_s - self.margin_s:
            self.renew()

    def start_renewing(self) -> None:
        self._thread = threading.Thread(target=self._renew_loop, name="soma-lease", daemon=True)
        self._thread.start()

    def _renew_loop(self) -> None:
        every = self.ttl_s / RENEWALS_PER_TTL
        while not self._stop.wait(every):
            try:
                self.renew()
            except LeaseLost:
                return  # check() raises it in the writer's thread
            except Exception as exc:  # the store is down: check() renews before the next write
                print(
                    f"warning: could not renew the driver lease on {self.store.url}: {describe(exc)}",
                    file=sys.stderr,
                    flush=True,
                )

    def release(self) -> None:
        """Mark the lease released (a compare-and-swap: a lease taken over meanwhile is left to its new holder)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.ttl_s)
        with self._lock:
            if self._lost is not None or self.record is None:
                return
            try:
                self._version = self.store.write_if(
                    LEASE, replace(self.record, released=True, renewed_at=self.wall()).to_bytes(), self._version
                )
            except VersionConflict:
                self._version = None

    def forget(self, remove_dir: bool = False) -> None:
        """Delete the released lease (a command that leaves nothing behind where there was no campaign), unless another
        driver took it meanwhile; with remove_dir, the local directory too if nothing else is in it."""
        with self._lock:
            if self._version is not None and self._lost is None:
                self.store.remove_if(LEASE, self._version, rmdir=remove_dir)


class WorkerFence:
    """A worker's fence: before it writes (a checkpoint, its pointer), the lease still has the generation of the
    driver that started it. Read at most every WORKER_CHECK_S."""

    def __init__(self, store: Store, generation: int, clock: Callable[[], float] = time.monotonic):
        self.store, self.generation, self.clock = store, generation, clock
        self._checked = -float("inf")

    def __call__(self) -> None:
        if self.clock() - self._checked < WORKER_CHECK_S:
            return
        found = self.store.read_versioned(LEASE)
        try:
            rec = LeaseRecord.from_bytes(found[0], f"{self.store.url}/{LEASE}") if found else None
        except SomaError:
            rec = None  # overwritten with something else: no driver can show it holds the campaign
        if rec is None or rec.generation != self.generation:
            now = rec.generation if rec else "none"
            raise LeaseLost(
                f"{self.store.url}: the driver that started this worker (lease generation {self.generation}) "
                f"no longer holds the campaign (generation now {now}); this worker writes nothing more"
            )
        self._checked = self.clock()


def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def _process_start(pid: int) -> float | None:
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def process_alive(pid: int, started: float) -> bool:
    """The process `pid` runs on this host and is the one that started at `started` (not a reused pid)."""
    import psutil

    try:
        p = psutil.Process(pid)
        return abs(p.create_time() - started) < 1.0 and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:  # another user's live process
        return True


def _clock(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(t)) if t else "at an unknown time"
