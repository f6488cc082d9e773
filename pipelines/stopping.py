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

import os
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
        self._early = True
        self._saved: dict[int, object] = {}  # the handlers found before the first install

    def install(self, early: bool = False) -> None:
        """(Re)install the handlers; only the main thread can, and only it needs to. `early`: while the CLI is still
        importing, before a command has begun anything, a signal ends the process at once with one line."""
        import threading

        self._early = early
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                previous = signal.signal(s, self._on_signal)
                if previous != self._on_signal:
                    self._saved.setdefault(s, previous)

    def finish(self, exiting: bool) -> None:
        """The command's outcome is decided. `exiting` (the process is the CLI, about to exit): later signals are
        ignored (SIG_IGN, which the interpreter keeps while it shuts down, where it would reset a Python handler to
        the default and a late SIGTERM would kill it mid-exit). Else (a command run in-process, e.g. by a test) the
        handlers found before are put back."""
        import threading

        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                signal.signal(s, signal.SIG_IGN if exiting else self._saved.get(s, signal.SIG_DFL))
        self.requested = None

    def _on_signal(self, signum: int, frame) -> None:
        if self._early:
            print(
                f"soma: received {signal.Signals(signum).name} while starting; nothing was done",
                file=sys.stderr,
                flush=True,
            )
            os._exit(128 + signum)
        if self.requested is not None:
            print(
                f"soma: {signal.Signals(signum).name} again: already stopping (bounded; the next command cleans up "
                f"whatever a SIGKILL leaves)",
                file=sys.stderr,
                flush=True,
            )
            return
        self.requested = signum
        print(
            f"soma: received {signal.Signals(signum).name}: stopping (no new work; final status, then exit "
            f"{128 + signum})",
            file=sys.stderr,
            flush=True,
        )
        if not self._cooperative:
            raise Stopped(signum)

    def check(self) -> None:
        if self.requested is not None:
            raise Stopped(self.requested)

    @contextmanager
    def cooperative(self) -> Iterator[None]:
        """Inside, a signal only sets `requested`: the caller checks it where stopping is safe."""
        with self.deferred():
            yield
        self.check()

    @contextmanager
    def deferred(self) -> Iterator[None]:
        """Inside, a signal only sets `requested` and nothing checks it: cleanup that must run whole (the local Ray's
        shutdown, the lease's release) whether the command stops or ends."""
        self._cooperative += 1
        try:
            yield
        finally:
            self._cooperative -= 1


STOP = StopSignals()
