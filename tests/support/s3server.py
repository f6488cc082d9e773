"""A real S3 server for the tests: `moto_server` as a subprocess on 127.0.0.1, plus an optional TCP
forwarder process in front of it that a test can kill and restart (an endpoint outage) while moto,
whose state lives only in memory, keeps the data.

Import the fixtures into a test module: `from support.s3server import s3  # noqa: F401`.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from support.ports import free_port

HERE = Path(__file__).resolve().parent
START_TIMEOUT_S = 30.0


def _answers(port: int, timeout: float = 1.0) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never an HTTP proxy
    try:
        opener.open(f"http://127.0.0.1:{port}/", timeout=timeout).read()
        return True
    except OSError:
        return False


def _wait_until(pred, what: str, proc: subprocess.Popen | None, timeout: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before answering")
        if pred():
            return
        time.sleep(0.1)
    raise RuntimeError(f"{what} did not answer within {timeout:.0f} s")


def moto_server_bin() -> str:
    here = Path(sys.executable).with_name("moto_server")
    found = str(here) if here.exists() else shutil.which("moto_server")
    if not found:
        pytest.skip("moto_server (moto[server]) is not installed")
    return found


def _stop(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    try:
        proc.send_signal(signal.SIGCONT)  # a paused server cannot die otherwise
        proc.kill()
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


class MotoServer:
    """`moto_server -H 127.0.0.1 -p PORT` in its own process."""

    def __init__(self, port: int | None = None):
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    def start(self) -> "MotoServer":
        self.proc = subprocess.Popen(
            [moto_server_bin(), "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
        )
        _wait_until(lambda: _answers(self.port), f"moto_server on 127.0.0.1:{self.port}", self.proc)
        return self

    def pause(self) -> None:
        """SIGSTOP: connections are accepted by the kernel but nothing answers (a hung server)."""
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        _stop(self.proc)


class Proxy:
    """tests/support/tcpproxy.py on 127.0.0.1:port forwarding to target_port; kill() and start() again = outage."""

    def __init__(self, target_port: int, port: int | None = None):
        self.port, self.target_port = port or free_port(), target_port
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Proxy":
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:  # the port may take a moment to be free again after a kill
            self.proc = subprocess.Popen(
                [sys.executable, str(HERE / "tcpproxy.py"), str(self.port), str(self.target_port)],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                stdin=subprocess.DEVNULL,
                text=True,
            )
            line = self.proc.stdout.readline()
            if line.strip() == "ready":
                return self
            self.proc.wait(timeout=10)
            if time.monotonic() > deadline:
                raise RuntimeError(f"proxy could not listen on 127.0.0.1:{self.port}")
            time.sleep(0.2)

    def kill(self) -> None:
        """SIGKILL: in-flight connections are reset and new ones refused until start()."""
        _stop(self.proc)

    stop = kill


@dataclass
class S3:
    """A running S3 endpoint with one bucket, and the options and environment that reach it."""

    server: MotoServer
    bucket: str
    key: str = "test"
    secret: str = field(default_factory=lambda: f"soma-secret-{uuid.uuid4().hex}")  # moto accepts any

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.port}"

    def storage_options(self, endpoint: str | None = None, **config_kwargs) -> dict:
        opts = {
            "key": self.key,
            "secret": self.secret,
            "client_kwargs": {"endpoint_url": endpoint or self.endpoint},
            "skip_instance_cache": True,
        }
        if config_kwargs:
            opts["config_kwargs"] = config_kwargs
        return opts

    def url(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix}"

    def env(self, endpoint: str | None = None) -> dict[str, str]:
        """Environment for a `soma` subprocess: standard AWS credentials, the endpoint in SOMA_S3_ENDPOINT."""
        return {
            "AWS_ACCESS_KEY_ID": self.key,
            "AWS_SECRET_ACCESS_KEY": self.secret,
            "AWS_DEFAULT_REGION": "us-east-1",
            "SOMA_S3_ENDPOINT": endpoint or self.endpoint,
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def fs(self):
        import s3fs

        return s3fs.S3FileSystem(**self.storage_options())

    def objects(self, prefix: str = "") -> dict[str, bytes]:
        """Every object under the bucket (or bucket/prefix), read afresh."""
        fs = self.fs()
        root = f"{self.bucket}/{prefix}".rstrip("/")
        paths = fs.find(root, refresh=True)
        return fs.cat(paths) if paths else {}


def start_s3() -> S3:
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")  # never ask 169.254.169.254 for anything
    server = MotoServer().start()
    s3 = S3(server, bucket=f"soma-{uuid.uuid4().hex[:8]}")
    s3.fs().mkdir(s3.bucket)  # no region / location constraint: moto rejects it
    return s3


@pytest.fixture(scope="module")
def s3():
    """moto_server on a free 127.0.0.1 port with a fresh bucket; killed at teardown."""
    s = start_s3()
    try:
        yield s
    finally:
        s.server.stop()
