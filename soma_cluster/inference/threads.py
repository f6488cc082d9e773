"""How many torch intra-op threads an inference call runs on: chosen per call from the size of its ops and the cores
that are free, or set; the caller's own setting is put back when the call returns (docs/performance.md, "Threads").

    with Threads(None).using(macs=rows * 4 * d * d):   # auto: as many as the op's size and the free cores allow
        ...one decoding step...

Why: a decoding step is a dozen small ops (a bmm of a few rows, a layer norm, a sigmoid). Each op split over
OpenMP threads waits for the slowest of them at its end, and on a host where the other cores are busy (another
process, another session's tests) a thread that was descheduled makes the op wait a scheduler slice (milliseconds)
for microseconds of work. Measured on the 2-core host with a busy loop beside it (one decoding step, d = 181, 8
experts): median 5.8 ms at 1 thread against 79 ms at 2 for 4 rows per expert, 18 ms against 117 ms for 64
(docs/results/benchmarks/bench_speed.md). An op is split only where each thread gets at least
MIN_MACS_PER_THREAD multiply-adds and there is a free core for it.

The decision reads:
- the op's multiply-adds (the caller's estimate of its largest op, e.g. rows x 4d x d for an LSTM layer);
- the ceiling: the caller's own torch.get_num_threads() (so OMP_NUM_THREADS, or torch.set_num_threads before the
  call, bounds it) and the CPUs this process may run on (os.sched_getaffinity);
- the free cores: those CPUs less the other tasks running right now (/proc/loadavg's runnable count, this thread
  excluded), at least one.
A set number (`threads=4`, `--threads 4`) is used as given, up to the CPUs this process may run on: more threads than
CPUs only wait for each other.
"""

from __future__ import annotations

import contextlib
import numbers
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from soma_cluster.errors import SomaError

# multiply-adds a thread must get before an op is split: ~50-100 us of work on one core, against the ~10 us an
# OpenMP fork and join costs where every thread is on a free core
MIN_MACS_PER_THREAD = 1 << 20
MAX_THREADS = 1024
LOAD_EVERY_S = 1.0  # the free cores are read at most this often (a file read, ~15 us)
LOADAVG = "/proc/loadavg"


def cpus() -> int:
    """The CPUs this process may run on (its affinity mask: a container's or taskset's cores, not the host's)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def runnable_others(path: str = LOADAVG) -> int:
    """Tasks running or waiting to run on the host now, this one excluded (/proc/loadavg's 4th field, 'R/total');
    0 where it cannot be read."""
    try:
        with open(path) as f:
            running = f.read().split()[3].split("/")[0]
        return max(0, int(running) - 1)
    except (OSError, IndexError, ValueError):
        return 0


def checked(threads) -> int | None:
    """A `threads` setting: None (auto) or a whole number 1..1024; one SomaError line naming it, else."""
    if threads is None:
        return None
    if not isinstance(threads, numbers.Integral) or isinstance(threads, bool) or not 1 <= threads <= MAX_THREADS:
        raise SomaError(f"threads: {threads!r} is not a whole number >= 1 and at most {MAX_THREADS}, or none (auto)")
    return int(threads)


def auto_threads(macs: int, ceiling: int, free: int) -> int:
    """Threads for an op of `macs` multiply-adds: one per MIN_MACS_PER_THREAD, at most `ceiling` and `free`, >= 1."""
    return max(1, min(ceiling, free, macs // MIN_MACS_PER_THREAD))


@dataclass
class Threads:
    """The threading of one RoutedLM: `threads` None (auto, per op) or a number; `using` sets it around a piece of
    work and puts the caller's setting back."""

    threads: int | None = None
    _free: int = 0
    _read_at: float = -1e9

    def __post_init__(self):
        self.threads = checked(self.threads)

    def free_cores(self) -> int:
        now = time.monotonic()
        if now - self._read_at > LOAD_EVERY_S:
            self._free, self._read_at = max(1, cpus() - runnable_others()), now
        return self._free

    def count(self, macs: int, caller: int) -> int:
        """The threads an op of `macs` multiply-adds runs on, the caller having `caller` threads set."""
        if self.threads is not None:
            return min(self.threads, cpus())
        return auto_threads(macs, min(caller, cpus()), self.free_cores())

    @contextlib.contextmanager
    def using(self, macs: int) -> Iterator[int]:
        """torch's intra-op threads set for the work inside (their number is yielded), the caller's put back."""
        caller = torch.get_num_threads()
        n = self.count(macs, caller)
        if n != caller:
            torch.set_num_threads(n)
        try:
            yield n
        finally:
            if n != caller:
                torch.set_num_threads(caller)
