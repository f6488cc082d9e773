"""A Ray head this test owns, started with `ray start --head --block` on 127.0.0.1, and stopped by killing
only the processes it started: every one of them (the head's, and the nodes an autoscaler adds) carries a
marker in its environment, which is how `stop` finds them. Never Ray's own stop command, which kills every Ray on the
machine."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from support.ports import free_port

MARKER = "SOMA_TEST_RAY_HEAD"


def marked_pids(marker: str) -> list[int]:
    needle = f"{MARKER}={marker}".encode()
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                if needle in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                    out.append(int(pid))
            except OSError:
                pass
    return out


class RayHead:
    def __init__(self, env: dict[str, str] | None = None, args: tuple[str, ...] = (), home: str | None = None):
        self.port = free_port()
        self.root = tempfile.mkdtemp(prefix="soma-head-", dir="/tmp")
        self.marker = uuid.uuid4().hex
        self.address = f"127.0.0.1:{self.port}"
        self.env = {
            **os.environ,
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
            "RAY_USAGE_STATS_ENABLED": "0",
            "HOME": home or self.root,
            MARKER: self.marker,
            **(env or {}),
        }
        ray = os.path.join(os.path.dirname(sys.executable), "ray")
        self.cmd = [
            ray,
            "start",
            "--head",
            f"--port={self.port}",
            f"--temp-dir={self.root}/ray",
            "--include-dashboard=false",
            "--dashboard-port=0",
            "--block",
            *args,
        ]
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "RayHead":
        self.log = open(f"{self.root}/head.log", "w")
        self.proc = subprocess.Popen(
            self.cmd, env=self.env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:  # bounded: the GCS port answers
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"ray start exited {self.proc.returncode}: {Path(self.log.name).read_text()[-2000:]}"
                )
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    break
            except OSError:
                time.sleep(0.5)
        else:
            raise RuntimeError("the Ray head did not come up in 90 s")
        time.sleep(2)  # the raylet registers just after the GCS
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # the GCS and raylet end at once; `ray start --block`
            try:  # and one helper linger ~20 s: they are killed below
                self.proc.wait(timeout=3)
            except subprocess.TimeoutExpired:
                pass
        for _ in range(20):  # bounded: whatever the head left, ours only
            pids = marked_pids(self.marker)
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.25)
        self.log.close()
        shutil.rmtree(self.root, ignore_errors=True)
