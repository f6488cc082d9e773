"""What `soma serve` reads of Serve's status while its application deploys, decided without Ray: the application
runs, is still deploying, or failed, and then why in one line (a replica's own error, not Ray's traceback).

Serve retries a replica whose constructor raised, and gives up after 3 tries in a row (about 20 s on a loaded host);
its status then says "Failed to update the deployments", and the replica's traceback is in the deployment's message.
A replica's soma error (a SomaError, named by its module soma_cluster.*: a file that fails its checksum, a step
with no checkpoint, a store it cannot reach) is final at its first try: every try reads the same source, which
`soma serve` itself read whole before it deployed, so the replica sees something else (another node's disk,
another environment, a file changed since). It is reported at once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

RUNNING = "RUNNING"
FAILED = ("DEPLOY_FAILED", "UNHEALTHY")  # ApplicationStatus values that end a deployment
# an exception's last line in a traceback: "module.Class: message" (Ray's wrappers are skipped below)
_RAISED = re.compile(r"^(?P<cls>(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt)): (?P<msg>\S.*)$")
_WRAPPERS = ("RayTaskError", "RayActorError", "ActorDiedError")
MAX_LINE = 600  # characters of a reported error


class Verdict(StrEnum):
    RUNNING = "running"
    WAITING = "waiting"
    FAILED = "failed"


@dataclass(frozen=True)
class DeploymentState:
    name: str
    status: str  # Serve's DeploymentStatus: UPDATING, HEALTHY, UNHEALTHY, DEPLOY_FAILED, ...
    message: str = ""


@dataclass(frozen=True)
class AppState:
    """One application's status as Serve reports it (serve.status(), or the dashboard's REST API)."""

    status: str  # Serve's ApplicationStatus: NOT_STARTED, DEPLOYING, RUNNING, DEPLOY_FAILED, UNHEALTHY, DELETING
    message: str = ""
    deployments: tuple[DeploymentState, ...] = ()

    @classmethod
    def of(cls, status: str, message: str, deployments: dict[str, tuple[str, str]]) -> AppState:
        return cls(status, message or "", tuple(DeploymentState(n, s, m or "") for n, (s, m) in deployments.items()))


def raised(message: str) -> tuple[str, str] | None:
    """The innermost exception a traceback in `message` names: (qualified class, its message), or None. Ray's
    wrappers (RayTaskError(...), and the RuntimeError that carries a replica's traceback as text) are skipped."""
    found = None
    for line in message.splitlines():
        m = _RAISED.match(line.strip())
        if m is None or m.group("cls").split(".")[-1].startswith(_WRAPPERS):
            continue
        if m.group("msg").startswith("Traceback (most recent call last)"):
            continue
        found = (m.group("cls"), " ".join(m.group("msg").split()))
    return found


def soma_raised(cls: str) -> bool:
    return cls.startswith("soma_cluster.") or cls in ("SomaError", "ChecksumError", "StorageUnreachable")


def verdict(app: AppState | None) -> tuple[Verdict, str]:
    """Whether a deployment of `app` is done, goes on, or failed, and (failed) why in one line."""
    if app is None:
        return Verdict.FAILED, "the application is gone from Serve (deleted while it deployed)"
    if app.status == RUNNING:
        return Verdict.RUNNING, ""
    errors = [(d.name, e) for d in app.deployments if (e := raised(d.message)) is not None]
    soma = [(name, e) for name, e in errors if soma_raised(e[0])]
    if soma:
        name, (_, msg) = soma[0]
        return Verdict.FAILED, f"a {name} replica could not start: {msg}"[:MAX_LINE]
    if app.status in FAILED:
        if errors:
            name, (cls, msg) = errors[0]
            return Verdict.FAILED, f"a {name} replica could not start: {cls.split('.')[-1]}: {msg}"[:MAX_LINE]
        said = [d.message for d in app.deployments if d.message] + [app.message]
        return Verdict.FAILED, " ".join(next(s for s in said if s).split())[:MAX_LINE] if any(said) else app.status
    return Verdict.WAITING, ""


def notes(app: AppState | None) -> list[str]:
    """What Serve says of a deployment still in progress (a replica waiting for resources the cluster lacks), one
    line each: shown once while `soma serve` waits."""
    if app is None:
        return []
    out = []
    for d in app.deployments:
        if d.message:
            e = raised(d.message)
            said = f"a replica could not start ({e[0].split('.')[-1]}: {e[1]}); Serve tries again" if e else d.message
            out.append(f"{d.name}: {' '.join(said.split())}"[:MAX_LINE])
    return out
