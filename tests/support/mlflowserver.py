"""An MLflow tracking server process this test owns: full mlflow in its own venv (`make mlflow` builds
.venv-mlflow: mlflow's server needs a pyarrow older than the one soma pins), on 127.0.0.1, a sqlite backend and
an artifact root in a temp dir, artifacts served through the server. Started in its own session and stopped (or
killed, for an outage) by its process group; a restart keeps its database. SOMA_TEST_MLFLOW names the `mlflow`
executable elsewhere (a worktree: /work/main/.venv-mlflow/bin/mlflow)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from support.ports import free_port

REPO = Path(__file__).resolve().parents[2]
BINARY = os.environ.get("SOMA_TEST_MLFLOW") or str(REPO / ".venv-mlflow" / "bin" / "mlflow")
SKIP_REASON = (
    f"no mlflow server at {BINARY} (make mlflow builds .venv-mlflow, as .ci/run does; or set SOMA_TEST_MLFLOW)"
)
START_S = 180.0  # a cold start imports all of mlflow: ~40 s on a loaded 2-core machine


def available() -> bool:
    return os.access(BINARY, os.X_OK)


class MlflowServer:
    def __init__(self):
        self.root = Path(tempfile.mkdtemp(prefix="soma-mlflow-"))
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self._log = None

    def start(self) -> MlflowServer:
        """Start the process (returns at once; `wait_ready` waits for it)."""
        self._log = open(self.root / "server.log", "ab")  # noqa: SIM115 (closed in stop)
        cmd = [BINARY, "server", "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}"]
        cmd += ["--artifacts-destination", str(self.root / "artifacts"), "--host", "127.0.0.1"]
        cmd += ["--port", str(self.port), "--workers", "1"]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=self._log, start_new_session=True, cwd=self.root)
        return self

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def wait_ready(self, timeout_s: float = START_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited: {(self.root / 'server.log').read_text()[-2000:]}")
            if self.healthy():
                return
            time.sleep(0.5)
        raise TimeoutError(f"mlflow server not ready in {timeout_s:.0f} s")

    def kill(self) -> None:
        """An outage: SIGKILL to the server and its workers; the port refuses connections from now on."""
        self._signal(signal.SIGKILL, 10)

    def stop(self) -> None:
        self._signal(signal.SIGTERM, 15)

    def _signal(self, sig: int, wait_s: float) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
                self.proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
            except ProcessLookupError:
                pass
        if self._log is not None:
            self._log.close()
            self._log = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)
