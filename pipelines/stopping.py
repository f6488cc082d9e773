"""SIGINT and SIGTERM to a driver: stop submitting, leave a final snapshot that says why, release the lease,
exit 128 + the signal's number (130, 143), with soma's own last line instead of Ray's stack dump.

Ray installs its own SIGTERM handler (sys.exit) in ray.init, so `install()` runs again after it. Where a loop
checks `requested` itself (the driver's loop, between two results), the signal only sets it: the loop ends
where its state is consistent. Anywhere else it raises Stopped at once, which unwinds through every `finally`
(actors killed, Ray shut down, the lease released). A second signal while stopping is noted and ignored; the
cleanup is bounded (a job system's SIGKILL after its grace period is the last resort, and the next command
cleans what a SIGKILL leaves).
"""
from __future__ import annotations

import signal
import sys
from contextlib import contextmanager
from typing import Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(BaseException):
    """The driver was told to stop. A BaseException, like KeyboardInterrupt: no `except Exception` on the way
    mistakes it for a failure to log and carry on from."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class StopSignals:
    def __init__(self) -> None:
        self.requested: int | None = None
        self._cooperative = 0

    def install(self) -> None:
        """(Re)install the handlers; only the main thread can, and only it needs to."""
        import threading
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                signal.signal(s, self._on_signal)

    def _on_signal(self, signum: int, frame) -> None:
        if self.requested is not None:
            print(f"soma: {signal.Signals(signum).name} again: already stopping (bounded; the next command cleans up "
                  f"whatever a SIGKILL leaves)", file=sys.stderr, flush=True)
            return
        self.requested = signum
        print(f"soma: received {signal.Signals(signum).name}: stopping (no new work; final status, then exit "
              f"{128 + signum})", file=sys.stderr, flush=True)
        if not self._cooperative:
            raise Stopped(signum)

    def check(self) -> None:
        if self.requested is not None:
            raise Stopped(self.requested)

    @contextmanager
    def cooperative(self) -> Iterator[None]:
        """Inside, a signal only sets `requested`: the caller checks it where stopping is safe."""
        self._cooperative += 1
        try:
            yield
        finally:
            self._cooperative -= 1
        self.check()


STOP = StopSignals()
