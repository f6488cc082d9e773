"""soma serve through a dashboard's address (http://HOST:8265, what RAY_ADDRESS holds for `ray job submit`): Serve's
REST API deploys the application from the Serve config that `soma serve --dry-run` prints, as `serve deploy` does
(pipelines/serve.py drives it with these calls).
No driver connects to the cluster: the cluster's own Python imports `pipelines.serve_app:build` (soma is installed
there, as for every address form).

Serve's REST API is declarative: the config it is given is every application of the cluster. So the other
applications' configs go with ours, and removing ours sends theirs alone; an application deployed by `serve.run`
has no config to send and would be deleted, so it is refused (deploy through ray://HOST:10001 or HOST:6379 then).
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request

from pipelines.rayaddress import Address, dashboard_headers
from soma_cluster.errors import SomaError
from soma_cluster.inference.serveinput import APP_NAME
from soma_cluster.inference.servestate import AppState

API = "/api/serve/applications/"
CALL_TIMEOUT_S = 30.0  # one call of the REST API (a PUT answers once Serve's controller took the config)
STATUS_POLL_S = 0.5  # Serve's status is read this often while the application goes


class Dashboard:
    """Serve's REST API at a dashboard, each call bounded and any failure one SomaError line."""

    def __init__(self, addr: Address):
        self.addr = addr

    def call(self, method: str, body: dict | None = None) -> dict | None:
        data = None if body is None else json.dumps(body).encode()
        headers = {**dashboard_headers(), **({"Content-Type": "application/json"} if data else {})}
        req = urllib.request.Request(self.addr.text + API, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=CALL_TIMEOUT_S) as r:
                raw = r.read()
        except urllib.error.HTTPError as exc:
            said = " ".join(exc.read(2000).decode("utf-8", "replace").split())[:400]
            raise SomaError(f"Serve's REST API at {self.addr.text} answered {exc.code} to {method}: {said}") from None
        except (OSError, ValueError) as exc:
            raise SomaError(
                f"Serve's REST API at {self.addr.text} did not answer {method} ({getattr(exc, 'reason', exc)})"
            ) from None
        return json.loads(raw) if raw.strip() and method == "GET" else None

    def details(self) -> dict:
        return self.call("GET") or {}

    def app_state(self) -> AppState | None:
        app = (self.details().get("applications") or {}).get(APP_NAME)
        if app is None:
            return None
        deps = {n: (d.get("status", ""), d.get("message", "")) for n, d in (app.get("deployments") or {}).items()}
        return AppState.of(app.get("status", ""), app.get("message", ""), deps)


def others(details: dict, addr: Address) -> list[dict]:
    """The configs of the cluster's other applications, to be sent with ours; one deployed by serve.run (no config)
    is refused by name."""
    out = []
    for name, app in sorted((details.get("applications") or {}).items()):
        if name == APP_NAME:
            continue
        config = app.get("deployed_app_config")
        if not config:
            raise SomaError(
                f"{addr.named()}: the cluster runs application {name!r}, deployed by serve.run; Serve's REST API would "
                f"delete it with this deploy: deploy through the GCS (--address HOST:6379) or Ray Client "
                f"(--address ray://HOST:10001) instead"
            )
        out.append(config)
    return out


def remove(api: Dashboard, config: dict, kept: list[dict]) -> None:
    """Ours out of the cluster's applications: the others' configs alone, or every application deleted when ours
    was the only one; waited for until Serve no longer lists it (bounded)."""
    try:
        if kept:
            api.call("PUT", {**config, "applications": kept})
        else:
            api.call("DELETE")
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while time.monotonic() < deadline and api.app_state() is not None:
            time.sleep(STATUS_POLL_S)
    except SomaError as exc:
        print(
            f"soma serve: the application may still be deployed ({exc}); serve delete {APP_NAME} removes it",
            file=sys.stderr,
        )
