"""A Prometheus server process this test owns (the Debian package's binary, `make prometheus` installs it), on
127.0.0.1, scraping Ray's metrics through the service-discovery file Ray writes into its session directory
(what docs/cluster.md tells an operator to point Prometheus at). Stopped by its pid; its data dir is removed."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

from support.ports import free_port

BINARY = shutil.which("prometheus")
SKIP_REASON = "the prometheus binary is not installed (make prometheus: Debian's package, as .ci/run does)"


class Prometheus:
    def __init__(self, sd_file: str, scrape_s: float = 1.0):
        self.root = Path(tempfile.mkdtemp(prefix="soma-prom-"))
        self.port = free_port()
        config = {
            "global": {"scrape_interval": f"{scrape_s:g}s", "evaluation_interval": f"{scrape_s:g}s"},
            "scrape_configs": [
                {"job_name": "ray", "file_sd_configs": [{"files": [sd_file], "refresh_interval": "1s"}]},
            ],
        }
        (self.root / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
        self._log = open(self.root / "prometheus.log", "wb")  # noqa: SIM115 (closed in stop, after the process)
        self.proc = subprocess.Popen(
            [
                BINARY,
                f"--config.file={self.root / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.root / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--storage.tsdb.retention.time=1h",
            ],
            stdout=subprocess.DEVNULL,
            stderr=self._log,
        )
        self._wait(lambda: self._get("/-/ready") is not None, 60, "Prometheus to be ready")

    def _get(self, path: str):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:
                return r.read()
        except OSError:
            return None

    def _wait(self, ok, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited: {(self.root / 'prometheus.log').read_text()[-2000:]}")
            if ok():
                return
            time.sleep(0.5)
        raise TimeoutError(f"waited {timeout_s:.0f} s for {what}")

    def query(self, expr: str) -> list[dict]:
        """The instant query's result vector: [{"metric": {...}, "value": [t, "v"]}, ...]."""
        body = self._get("/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
        if body is None:
            raise RuntimeError(f"query failed: {expr}")
        doc = json.loads(body)
        assert doc["status"] == "success", doc
        return doc["data"]["result"]

    def targets_up(self) -> int:
        doc = json.loads(self._get("/api/v1/targets") or b'{"data": {"activeTargets": []}}')
        return sum(t["health"] == "up" for t in doc["data"]["activeTargets"])

    def wait_for(self, expr: str, ok, timeout_s: float = 60.0) -> list[dict]:
        seen: list[list[dict]] = []

        def check() -> bool:
            seen.append(self.query(expr))
            return bool(ok(seen[-1]))

        self._wait(check, timeout_s, f"{expr} (last: {seen[-1] if seen else None})")
        return seen[-1]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> Prometheus:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
