"""The Ray address a command connects to: --address, else RAY_ADDRESS, else a Ray of the command's own. Every form
either works or is one SomaError within a bounded time: Ray itself retries an address that is wrong for minutes
(the dashboard's port given for the GCS's hangs), and raises a traceback for a Jobs address (http://).

`soma serve` takes two forms no other command does (`serve=True`): a driver that deploys a Serve application and
leaves only needs to reach Serve's controller, so Ray Client (ray://HOST:10001) works for it, and the dashboard's
HTTP address (http://HOST:8265, what RAY_ADDRESS holds for `ray job submit`) reaches Serve's REST API, which
deploys the same application as a Serve config file (`serve deploy`)."""

from __future__ import annotations

import os
import re
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from soma_cluster.errors import SomaError

PROBE_S = 10.0  # an address that does not answer as Ray fails in this long
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$")
_HOSTPORT = re.compile(r"^(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<host>[^\s/:\[\]@]+)):(?P<port>0*[0-9]{1,5})$", re.ASCII)
FORMS_HINT = (
    "use HOST:PORT (the head's GCS, port 6379 by default), auto (a Ray already running on this machine), or no "
    "address for a local Ray"
)


class Form(StrEnum):
    LOCAL = "local"  # no address, an empty one, or "local": a Ray of this command's own
    AUTO = "auto"  # a Ray already running on this machine (Ray finds it)
    GCS = "gcs"  # host:port of the head's GCS
    CLIENT = "client"  # ray://host:port, Ray Client
    DASHBOARD = "dashboard"  # http(s)://host[:port]: the dashboard's HTTP API (Jobs, Serve's REST API); serve only


@dataclass(frozen=True)
class Address:
    form: Form
    text: str = ""  # what ray.init is given
    source: str = ""  # "--address" or "RAY_ADDRESS": named in every error
    host: str = ""
    port: int = 0

    @property
    def remote(self) -> bool:
        return self.form is not Form.LOCAL

    def named(self) -> str:
        return f"--address {self.text}" if self.source == "--address" else f"RAY_ADDRESS={self.text}"


def parse(address: str | None, env: Mapping[str, str] = os.environ, serve: bool = False) -> Address:
    """The address's form from its text alone (no network). SomaError for a form soma cannot use; `serve`: the
    forms `soma serve` takes (a dashboard's http(s):// address too)."""
    source, value = ("--address", address) if address is not None else ("RAY_ADDRESS", env.get("RAY_ADDRESS"))
    text = (value or "").strip()
    named = f"--address {text!r}" if source == "--address" else f"RAY_ADDRESS={text!r}"
    if text in ("", "local"):
        return Address(Form.LOCAL, source=source)
    if text == "auto":
        return Address(Form.AUTO, text, source)
    form, rest = Form.GCS, text
    if m := _SCHEME.match(text):
        scheme, rest = m.group(1).lower(), m.group(2)
        if scheme in ("http", "https") and serve:
            return _dashboard(text, scheme, rest, source, named)
        if scheme in ("http", "https"):
            raise SomaError(
                f"{named} is a Ray Jobs (dashboard) address, for `ray job submit`; soma connects to the cluster's "
                f"GCS: pass --address HOST:6379, run the command as a job "
                f"(ray job submit --address {text} -- soma ...; inside a job Ray sets the address), "
                f"or unset RAY_ADDRESS for a local Ray"
            )
        if scheme != "ray":
            raise SomaError(f"{named} is not a Ray address (scheme {scheme}://); {_hint(serve)}")
        form, text = Form.CLIENT, f"ray://{rest}"
    m = _HOSTPORT.match(rest)
    if m is None or not 0 < int(m.group("port")) < 65536:
        raise SomaError(f"{named} is not a Ray address; {_hint(serve)}")
    return Address(form, text, source, m.group("v6") or m.group("host"), int(m.group("port")))


def _hint(serve: bool) -> str:
    serving = ", or for soma serve ray://HOST:10001 (Ray Client) or http://HOST:8265 (a dashboard)"
    return FORMS_HINT + (serving if serve else "")


_URL_HOST = re.compile(
    r"^(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<host>[^\s/:\[\]@?#]+))(?::(?P<port>0*[0-9]{1,5}))?/*$", re.ASCII
)


def _dashboard(text: str, scheme: str, rest: str, source: str, named: str) -> Address:
    """http(s)://HOST[:PORT] of a dashboard, for soma serve (a path after it, as an ingress may add, is refused:
    Serve's REST API is at the root)."""
    m = _URL_HOST.match(rest)
    default = 443 if scheme == "https" else 80
    if m is None or not 0 < int(m.group("port") or default) < 65536:
        raise SomaError(
            f"{named} is not a dashboard address: give http://HOST:8265 (the head's dashboard), ray://HOST:10001 "
            "(Ray Client) or HOST:6379 (the GCS)"
        )
    host = m.group("v6") or m.group("host")
    url = f"{scheme}://{f'[{host}]' if m.group('v6') else host}:{int(m.group('port') or default)}"
    return Address(Form.DASHBOARD, url, source, host, int(m.group("port") or default))


def probe(addr: Address, timeout_s: float = PROBE_S) -> None:
    """Fail within about timeout_s, in one line, unless something at the address speaks gRPC (Ray's GCS and Ray
    Client do; the dashboard's HTTP does not) and answers as the service its form names. auto is resolved by
    Ray's own lookup first; a local Ray is the command's own."""
    if addr.form is Form.AUTO:
        addr = _resolve_auto(addr)
    if addr.form is Form.DASHBOARD:
        return _probe_dashboard(addr, timeout_s)
    if addr.form not in (Form.GCS, Form.CLIENT):
        return
    deadline = time.monotonic() + timeout_s
    try:
        with socket.create_connection((addr.host, addr.port), timeout=timeout_s):
            pass
    except (OSError, UnicodeError, ValueError) as exc:  # UnicodeError: a host name IDNA cannot encode
        raise SomaError(
            f"cannot reach a Ray cluster at {addr.text} ({exc.__class__.__name__}: {exc}); check --address / "
            f"RAY_ADDRESS ({_expected(addr)})"
        ) from None
    if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        return  # a TLS cluster's handshake needs its certificates: ray.init checks it
    state = _grpc_state(addr, max(1.0, deadline - time.monotonic()))
    if state == "ready":
        _check_service(addr, max(1.0, deadline - time.monotonic()))
        return
    if state == "refused" and _speaks_http(addr):
        what = "an HTTP server answers there (Ray's dashboard and Jobs API listen on 8265; the GCS on 6379 by default)"
    elif state == "refused":
        what = "something accepts connections there but refuses Ray's protocol (gRPC)"
    else:
        what = f"something accepts connections there but does not answer as Ray (gRPC) within {timeout_s:.0f} s"
    raise SomaError(f"{addr.named()} is not a Ray cluster: {what}; pass {_expected(addr)}")


def _expected(addr: Address) -> str:
    """What the address should name, for its form: soma serve's ray:// names the head's Ray Client server."""
    if addr.form is Form.CLIENT:
        return "the head's Ray Client server, ray://HOST:10001 by default"
    return "the head's GCS, HOST:6379 by default"


def _probe_dashboard(addr: Address, timeout_s: float) -> None:
    """One GET of Serve's REST API (the dashboard's /api/serve/applications/), bounded: anything else at the address
    (nothing, the GCS, a web server that is not Ray's) is one line."""
    import urllib.error
    import urllib.request

    url = f"{addr.text}/api/serve/applications/"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=dashboard_headers()), timeout=timeout_s) as r:
            r.read(1 << 20)
        return
    except urllib.error.HTTPError as exc:
        what = f"HTTP {exc.code} for {url}" + (
            f": the dashboard refused this command's token; {token_hint()}" if exc.code in (401, 403) else ""
        )
    except (OSError, ValueError, UnicodeError) as exc:
        what = f"{getattr(exc, 'reason', None) or exc}"
    raise SomaError(
        f"{addr.named()} is not a Ray dashboard with Serve's API ({what}); give the head's dashboard "
        "(http://HOST:8265), ray://HOST:10001 (Ray Client) or HOST:6379 (the GCS)"
    )


def dashboard_headers() -> dict[str, str]:
    """The token header Ray's own clients send to a token-auth dashboard (none without token auth)."""
    try:
        from ray._private.authentication.http_token_authentication import get_auth_headers_if_auth_enabled
    except ImportError:  # another Ray: no header
        return {}
    return dict(get_auth_headers_if_auth_enabled({}))


def _grpc_state(addr: Address, timeout_s: float) -> str:
    """Whether an HTTP/2 (gRPC) connection to the address becomes "ready", is "refused" (at once: an HTTP/1 server
    refuses the handshake), or stays "silent" for timeout_s."""
    import threading

    import grpc

    settled, seen = threading.Event(), []

    def watch(state: grpc.ChannelConnectivity) -> None:
        if state in (grpc.ChannelConnectivity.READY, grpc.ChannelConnectivity.TRANSIENT_FAILURE):
            seen.append(state)
            settled.set()

    channel = grpc.insecure_channel(_target(addr))
    try:
        channel.subscribe(watch, try_to_connect=True)
        if not settled.wait(timeout_s):
            return "silent"
        return "ready" if seen[0] is grpc.ChannelConnectivity.READY else "refused"
    finally:
        channel.unsubscribe(watch)
        channel.close()


def _check_service(addr: Address, timeout_s: float) -> None:
    """One call of the service the form names, with the token Ray itself would send (its own loader and
    interceptor): a token-auth head refuses a missing or wrong token at once (ray.init retries for 20 s with a
    warning a second), and the GCS and Ray Client answer UNIMPLEMENTED for each other's calls (a ray:// given for
    the GCS port waited 30 s for a client handshake)."""
    import grpc

    try:
        from ray._private.authentication.grpc_authentication_client_interceptor import (
            SyncAuthenticationMetadataClientInterceptor,
        )
        from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc, ray_client_pb2, ray_client_pb2_grpc
    except ImportError:  # another Ray: ray.init decides
        return
    raw = grpc.insecure_channel(_target(addr))
    channel = grpc.intercept_channel(raw, SyncAuthenticationMetadataClientInterceptor())
    try:
        if addr.form is Form.GCS:
            stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
            stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), timeout=timeout_s)
        else:
            ray_client_pb2_grpc.RayletDriverStub(channel).ClusterInfo(
                ray_client_pb2.ClusterInfoRequest(), timeout=timeout_s
            )
    except grpc.RpcError as exc:
        code = exc.code()
        if code is grpc.StatusCode.UNAUTHENTICATED:
            raise SomaError(
                f"Ray at {addr.text} ({addr.source}) refused this command's token ({exc.details()}): the cluster uses "
                f"token authentication; {token_hint()}"
            ) from None
        if code is grpc.StatusCode.UNIMPLEMENTED:
            hostport = _target(addr)
            fix = (
                f"the Ray Client server answers there, not the GCS: give the head's GCS address "
                f"(HOST:6379 by default), not {hostport}"
                if addr.form is Form.GCS
                else f"the cluster's GCS answers there, not a Ray Client server: give it as {hostport} (no ray://)"
            )
            raise SomaError(f"{addr.named()} is not what its form says: {fix}") from None
    finally:
        raw.close()


def token_hint() -> str:
    """What to set for a token-auth cluster, and what this process has."""
    mode = os.environ.get("RAY_AUTH_MODE", "unset")
    token = "set" if os.environ.get("RAY_AUTH_TOKEN") else "not set"
    return (
        f"set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN (or ~/.ray/auth_token) to its token (here RAY_AUTH_MODE is "
        f"{mode}, RAY_AUTH_TOKEN {token})"
    )


def _target(addr: Address) -> str:
    return f"[{addr.host}]:{addr.port}" if ":" in addr.host else f"{addr.host}:{addr.port}"


def _speaks_http(addr: Address, timeout_s: float = 2.0) -> bool:
    try:
        with socket.create_connection((addr.host, addr.port), timeout=timeout_s) as s:
            s.sendall(b"GET / HTTP/1.0\r\nHost: soma\r\n\r\n")
            return s.recv(16).startswith(b"HTTP/")
    except OSError:
        return False


def _resolve_auto(addr: Address) -> Address:
    """auto: the Ray running on this machine (Ray's own lookup), as a GCS address to probe; one line if none."""
    try:
        from ray._private.services import canonicalize_bootstrap_address_or_die

        found = canonicalize_bootstrap_address_or_die("auto")
    except ImportError:  # another Ray: ray.init decides
        return addr
    except ConnectionError:
        raise SomaError(
            f"{addr.named()}: no Ray runs on this machine; start one (ray start --head), give the cluster's "
            f"address, or no address for a local Ray"
        ) from None
    host, port = found.rsplit(":", 1)
    return Address(Form.GCS, addr.text, addr.source, host.strip("[]"), int(port))


def check_form(addr: Address, serve: bool = False) -> None:
    """Refuse a form the command cannot use, from the text alone: Ray Client for every command but soma serve (a
    driver over it queues its actors and never starts them; serve's actors are Serve's, started by its controller)."""
    if addr.form is Form.CLIENT and not serve:
        raise SomaError(
            f"{addr.named()} is a Ray Client address; soma's driver cannot run over Ray Client (its actors are "
            f"queued and never start): submit the command as a Ray Job (ray job submit --address "
            f"http://HOST:8265 -- soma ...), run it on the head, or give the head's GCS address (HOST:6379)"
        )


def ray_address(address: str | None, serve: bool = False) -> Address:
    """--address, else RAY_ADDRESS: parsed and, for a cluster, probed. Commands call it before they write anything.
    Ray Client (ray://) is refused but for `serve` (soma serve), which also takes a dashboard's http(s):// URL."""
    addr = parse(address, serve=serve)
    if addr.form is Form.LOCAL:
        os.environ.pop("RAY_ADDRESS", None)  # the command decided: ray.init and Ray Data must not read it again
    check_form(addr, serve)
    probe(addr)
    return addr
