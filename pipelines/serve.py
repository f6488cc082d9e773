"""soma serve: deploy a campaign or an export as a Ray Serve application (docs/serving.md).

On a cluster (`--address`), the application outlives the command with `--detach`; deploying again to the same
cluster is a rolling update (Serve replaces the replicas a few at a time; requests in flight finish). Without an
address, a local Ray starts on 127.0.0.1 and the command serves until SIGINT or SIGTERM, then removes the
application (and the local Ray) and exits 130 or 143, as every command stopped by a signal.

Before Ray starts, the command loads what every replica will load (checked_source): the router a router replica
reads and the weights an expert replica reads, every file against its checksum, the step asked for; so a damaged
export or a missing checkpoint is one line naming the file, not a deployment that fails. The cluster is reached
as its address says (pipelines/rayaddress.py): the GCS (HOST:6379) or Ray Client (ray://HOST:10001) through Serve's
Python API, or a dashboard (http://HOST:8265) through Serve's REST API with the same Serve config that --dry-run
prints (pipelines/dashboard.py).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from pipelines.common import emit_json
from pipelines.dashboard import Dashboard, others, remove
from pipelines.rayaddress import Address, Form, ray_address
from pipelines.raysession import ray_session
from soma_cluster.config import CampaignConfig
from soma_cluster.corpus import shown
from soma_cluster.errors import SomaError
from soma_cluster.inference.routing import Routing, open_source
from soma_cluster.inference.serveinput import APP_NAME, ROUTE_PREFIX, ServeSettings
from soma_cluster.inference.servestate import AppState, Verdict, notes, verdict

REMOVE_TIMEOUT_S = 30.0
POLL_DEPLOY_S = 0.5  # Serve's status is read this often while the application deploys
APPEAR_S = 30.0  # an application deployed is listed by Serve within this long, or it is reported gone


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
    """What the replicas will load, loaded here before anything starts, as they load it: a router replica's Routing
    and an expert replica's RoutedLM (on the CPU; every file against its checksum, each expert's checkpoint, the
    step asked for). A wrong source, an unreachable store, a damaged file, a step without checkpoints and a
    campaign with no trained expert are one line here."""
    from soma_cluster.inference.lm import RoutedLM

    def experts() -> None:  # what SomaExperts.__init__ loads; then freed
        RoutedLM.load(settings.source, device="cpu", step=settings.step)

    export = open_source(settings.source).is_export
    if export:  # every file against the manifest first: a damaged one is named with an export's fix (export again)
        experts()
    routing = Routing.load(settings.source)
    if not routing.trained:
        raise SomaError(
            f"{routing.source} has no trained expert (no checkpoint yet), only the seed model; soma launch trains them"
        )
    if not export:
        experts()
    return routing


def absolute(source: str) -> str:
    """A local source as an absolute path: the replicas (and a Serve config file) resolve it elsewhere than in this
    command's directory. URLs (s3://) as given."""
    return source if "://" in source or not source.strip() else os.path.abspath(source)


def check_fits(settings: ServeSettings, cfg: CampaignConfig, addr: Address) -> None:
    """A local Ray has the campaign's resources.local_gpus GPUs and this machine's CPUs, and no autoscaler: replicas
    that ask for more would wait for them forever. A replica's device=cuda needs CUDA here too. (A cluster may
    add nodes for what it lacks: its replicas are waited for, with Serve's own note of what they wait for.)"""
    if addr.remote:
        return
    gpus = settings.replicas * settings.gpus_per_replica
    cpus = settings.replicas * settings.cpus_per_replica + settings.router_replicas * settings.router_cpus
    have_cpus = os.cpu_count() or 1
    if gpus > cfg.resources.local_gpus + 1e-9:
        raise SomaError(
            f"{settings.replicas} replica(s) of {settings.gpus_per_replica:g} GPU(s) need {gpus:g} GPUs; a local Ray "
            f"has {cfg.resources.local_gpus:g} (the campaign's resources.local_gpus): lower --gpus-per-replica or "
            "--replicas, or pass --address of a cluster"
        )
    if cpus > have_cpus + 1e-9:
        raise SomaError(
            f"the replicas need {cpus:g} CPUs (replicas x cpus_per_replica + router_replicas x router_cpus); this "
            f"machine has {have_cpus}: lower them (--set cpus_per_replica=0.5), or pass --address of a cluster"
        )
    if settings.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SomaError(
                "--set device=cuda: this machine has no CUDA device, and without --address the replicas run here; "
                "leave device auto (or pass --address of a cluster with GPUs)"
            )


def serve_config(settings: ServeSettings, host: str, port: int) -> dict:
    """The Serve config file that deploys the same application (`serve deploy`, KubeRay's serveConfigV2): the
    settings that differ from their defaults as the application's args."""
    try:
        settings.source.encode("utf-8")
    except UnicodeEncodeError:
        raise SomaError(
            f"{shown(settings.source)}: a Serve config file is UTF-8 text and this path is not; rename the directory, "
            "or serve it with soma serve through the GCS or Ray Client (without --dry-run, and not through an http:// "
            "dashboard address)"
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


def serve_campaign(
    settings: ServeSettings, address: str | None, host: str, port: int, detach: bool, show: Callable[[Served], None]
) -> Served:
    """Check the address and the source, connect to (or start) Ray, deploy, report with `show(Served)`; then, unless
    detached, serve until a signal and remove the application."""
    addr = ray_address(address, serve=True)
    if detach and not addr.remote:
        raise SomaError("--detach needs --address of a running cluster: a local Ray ends with this command")
    routing = checked_source(settings)
    check_fits(settings, routing.config, addr)
    if addr.form is Form.DASHBOARD:
        return _serve_through_dashboard(settings, routing, addr, host, port, detach, show)
    with ray_session(routing.config, addr):
        from ray import serve

        from pipelines.serve_app import build

        return _hold(
            lambda: _deploy(serve, build(settings.model_dump()), host, port),
            lambda: _remove(serve, addr.remote),
            settings,
            routing,
            detach,
            show,
        )


def _serve_through_dashboard(
    settings: ServeSettings,
    routing: Routing,
    addr: Address,
    host: str,
    port: int,
    detach: bool,
    show: Callable[[Served], None],
) -> Served:
    """Deploy with the REST API, wait until it runs, report; then, unless detached, serve until a signal and remove
    the application (the other applications' configs sent alone)."""
    api = Dashboard(addr)
    details = api.details()
    kept = others(details, addr)
    http = details.get("http_options") or {}
    if details.get("proxies") and http.get("port") is not None:  # Serve runs: it keeps its proxies' options
        running = (str(http.get("host", host)), int(http["port"]))
        if running != (host, port):
            proxy_moved(running, (host, port))
        host, port = running
    config = serve_config(settings, host, port)
    config["applications"] = kept + config["applications"]
    api.call("PUT", config)

    def deployed() -> tuple[str, int]:
        wait_deployed(api.app_state)
        return host, port

    return _hold(deployed, lambda: remove(api, config, kept), settings, routing, detach, show)


def _hold(
    deploy: Callable[[], tuple[str, int]],
    undeploy: Callable[[], None],
    settings: ServeSettings,
    routing: Routing,
    detach: bool,
    show: Callable[[Served], None],
) -> Served:
    """The deployment both ways share: `deploy` (it returns the host and port served), undone by `undeploy` if it
    fails unless detached; report with `show(Served)`; then, unless detached, serve until a signal (Stopped unwinds
    from the sleep) and `undeploy`."""
    try:
        host, port = deploy()
    except SomaError:
        if not detach:
            undeploy()
        raise
    served = served_as(settings, routing, host, port, detach)
    show(served)
    if detach:
        return served
    try:
        while True:
            time.sleep(1.0)
    finally:
        undeploy()


def served_as(settings: ServeSettings, routing: Routing, host: str, port: int, detach: bool) -> Served:
    return Served(  # shown: a path that is not UTF-8, escaped (--json is text)
        f"http://{host}:{port}{ROUTE_PREFIX}",
        APP_NAME,
        shown(routing.source),
        routing.config.n_experts,
        settings.replicas,
        detach,
    )


def _deploy(serve, app, host: str, port: int) -> tuple[str, int]:
    """Serve's proxies on host:port, then the application, waited for until it runs; a proxy that cannot bind (the
    port is taken) or a replica that cannot load its models is one line, not a traceback. The (host, port) Serve's
    proxies listen on: a Serve already running on the cluster keeps its own, said on stderr."""
    from ray.exceptions import RayError
    from ray.serve.api import RunTarget
    from ray.serve.exceptions import RayServeException

    try:
        serve.start(http_options={"host": host, "port": port})
    except (RayError, RayServeException, RuntimeError, TimeoutError) as exc:
        raise SomaError(
            f"Serve's HTTP proxy did not start on {host}:{port}: {_cause(exc)}; pass another --port (or --host)"
        ) from None
    host, port = running_proxy(host, port)
    try:
        serve.run_many([RunTarget(app, name=APP_NAME, route_prefix=ROUTE_PREFIX)], wait_for_applications_running=False)
    except (RayError, RayServeException, RuntimeError, TimeoutError) as exc:
        raise SomaError(f"the application did not deploy: {_cause(exc)}") from None
    wait_deployed(lambda: _app_state(serve))
    return host, port


def running_proxy(host: str, port: int) -> tuple[str, int]:
    """Where the cluster's Serve proxies really listen: a Serve started earlier keeps the HTTP options it started
    with (Serve ignores new ones with a log line), so the URL printed is its own, and stderr says so."""
    try:
        from ray.serve.context import _get_global_client

        http = _get_global_client().http_config
        running = (str(http.host), int(http.port))
    except Exception:  # noqa: BLE001 - a private API of Serve's: without it, the options given are reported
        return host, port
    if running != (host, port):
        proxy_moved(running, (host, port))
    return running


def proxy_moved(running: tuple[str, int], asked: tuple[str, int]) -> None:
    print(
        f"soma serve: Serve already runs on this cluster with its proxies on {running[0]}:{running[1]}; it keeps "
        f"them (--host/--port {asked[0]}:{asked[1]} apply only to a Serve that starts now)",
        file=sys.stderr,
    )


def _app_state(serve) -> AppState | None:
    app = serve.status().applications.get(APP_NAME)
    if app is None:
        return None
    deps = {n: (str(d.status.value), d.message) for n, d in app.deployments.items()}
    return AppState.of(str(app.status.value), app.message, deps)


def wait_deployed(read) -> None:
    """Until `read()` (the application's AppState) says it runs; one SomaError line when it fails, at a replica's
    first soma error (servestate.py). No time limit, as Serve's own `serve.run` has none (a cluster may be adding
    the nodes the replicas need); what Serve notes meanwhile is printed once, and a signal stops the wait."""
    said: set[str] = set()
    listed_by = time.monotonic() + APPEAR_S
    while True:
        app = read()
        if app is None and time.monotonic() < listed_by:  # a config Serve has taken but not listed yet
            time.sleep(POLL_DEPLOY_S)
            continue
        listed_by = 0.0  # listed once: gone later is a deletion
        state, why = verdict(app)
        if state is Verdict.RUNNING:
            return
        if state is Verdict.FAILED:
            raise SomaError(f"the application did not deploy: {why}")
        for note in notes(app):
            if note not in said:
                said.add(note)
                print(f"soma serve: {note}", file=sys.stderr, flush=True)
        time.sleep(POLL_DEPLOY_S)


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
