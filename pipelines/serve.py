"""soma serve: deploy a campaign or an export as a Ray Serve application (docs/serving.md).

On a cluster (`--address`), the application outlives the command with `--detach`; deploying again to the same
cluster is a rolling update (Serve replaces the replicas a few at a time; requests in flight finish). Without an
address, a local Ray starts on 127.0.0.1 and the command serves until SIGINT or SIGTERM, then removes the
application (and the local Ray) and exits 130 or 143, as every command stopped by a signal.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass

from pipelines.common import emit_json
from pipelines.rayaddress import ray_address
from pipelines.raysession import ray_session
from soma_cluster.corpus import shown
from soma_cluster.errors import SomaError
from soma_cluster.inference.routing import Routing
from soma_cluster.inference.serveinput import APP_NAME, ROUTE_PREFIX, ServeSettings

REMOVE_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Served:
    """What `soma serve` deployed (its --json)."""

    url: str
    app: str
    source: str
    n_experts: int
    replicas: int
    detached: bool


IMPORT_PATH = "pipelines.serve_app:build"


def checked_source(settings: ServeSettings) -> Routing:
    """The source's config and router, read before anything starts: a wrong source, an unreachable store, a
    campaign with no trained expert are named here."""
    routing = Routing.load(settings.source)
    if not routing.trained:
        raise SomaError(
            f"{routing.source} has no trained expert (no checkpoint yet), only the seed model; soma launch trains them"
        )
    return routing


def serve_config(settings: ServeSettings, host: str, port: int) -> dict:
    """The Serve config file that deploys the same application (`serve deploy`, KubeRay's serveConfigV2): the
    settings that differ from their defaults as the application's args."""
    try:
        settings.source.encode("utf-8")
    except UnicodeEncodeError:
        raise SomaError(
            f"{shown(settings.source)}: a Serve config file is UTF-8 text and this path is not; rename the directory, "
            "or serve it with soma serve (without --dry-run)"
        ) from None
    return {
        "http_options": {"host": host, "port": port},
        "applications": [
            {
                "name": APP_NAME,
                "route_prefix": ROUTE_PREFIX,
                "import_path": IMPORT_PATH,
                "args": {"source": settings.source, **settings.model_dump(exclude_defaults=True)},
            }
        ],
    }


def serve_campaign(settings: ServeSettings, address: str | None, host: str, port: int, detach: bool, show) -> Served:
    """Check the source, connect to (or start) Ray, deploy, report with `show(Served)`; then, unless detached,
    serve until a signal and remove the application."""
    addr = ray_address(address)
    if detach and not addr.remote:
        raise SomaError("--detach needs --address of a running cluster: a local Ray ends with this command")
    routing = checked_source(settings)
    with ray_session(routing.config, addr):
        from ray import serve

        from pipelines.serve_app import build

        try:
            _deploy(serve, build(settings.model_dump()), host, port)
        except SomaError:
            if not detach:
                _remove(serve, addr.remote)
            raise
        served = Served(  # shown: a path that is not UTF-8, escaped (--json is text)
            f"http://{host}:{port}{ROUTE_PREFIX}",
            APP_NAME,
            shown(routing.source),
            routing.config.n_experts,
            settings.replicas,
            detach,
        )
        show(served)
        if detach:
            return served
        try:
            while True:  # until a signal: Stopped unwinds from the sleep
                time.sleep(1.0)
        finally:
            _remove(serve, addr.remote)


def _deploy(serve, app, host: str, port: int) -> None:
    """Serve's proxies on host:port, then the application; a proxy that cannot bind (the port is taken) or a
    replica that cannot load its models is one line, not a traceback."""
    from ray.exceptions import RayError
    from ray.serve.exceptions import RayServeException

    try:
        serve.start(http_options={"host": host, "port": port})
    except (RayError, RayServeException, RuntimeError, TimeoutError) as exc:
        raise SomaError(
            f"Serve's HTTP proxy did not start on {host}:{port}: {_cause(exc)}; pass another --port (or --host)"
        ) from None
    try:
        serve.run(app, name=APP_NAME, route_prefix=ROUTE_PREFIX, blocking=False)
    except (RayError, RayServeException, RuntimeError, TimeoutError) as exc:
        raise SomaError(f"the application did not deploy: {_cause(exc)}") from None


def _cause(exc: BaseException) -> str:
    """The line of a Ray error that says what went wrong (its last 'SomaError:' or '...Error:' line)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    said = [ln for ln in lines if "SomaError" in ln] or [ln for ln in lines if "Error:" in ln or "error" in ln.lower()]
    return (said[-1] if said else lines[0] if lines else type(exc).__name__)[:400]


def _remove(serve, remote: bool) -> None:
    """Delete the application from a cluster, waiting at most REMOVE_TIMEOUT_S (a controller that is gone, e.g.
    killed with the terminal's process group by the same Ctrl-C, must not hang the command). A local Ray needs no
    deletion: it is shut down, every process of it reaped, when the command leaves ray_session."""
    if not remote:
        return
    import threading

    failed: list[BaseException] = []

    def delete() -> None:
        try:
            serve.delete(APP_NAME)
        except Exception as exc:  # noqa: BLE001 - reported below
            failed.append(exc)

    t = threading.Thread(target=delete, name="soma-serve-delete", daemon=True)
    t.start()
    t.join(REMOVE_TIMEOUT_S)
    if t.is_alive() or failed:
        why = f"{failed[0]}" if failed else f"no answer from Serve's controller in {REMOVE_TIMEOUT_S:.0f} s"
        print(
            f"soma serve: the application may still be deployed ({why}); serve delete {APP_NAME} removes it",
            file=sys.stderr,
        )


def as_json(served: Served) -> dict:
    return {"schema": 1, **asdict(served)}


def print_serve_config(settings: ServeSettings, host: str, port: int, as_json: bool) -> None:
    """`soma serve --dry-run`: the source and settings checked, then the Serve config file that deploys them on
    stdout (YAML, or JSON with --json)."""
    import yaml

    routing = checked_source(settings)
    doc = serve_config(settings, host, port)
    if as_json:
        return emit_json({"schema": 1, **doc})
    sys.stdout.write(yaml.safe_dump(doc, sort_keys=False))
    print(f"{routing.source}: {routing.config.n_experts} experts; the config above deploys it", file=sys.stderr)
