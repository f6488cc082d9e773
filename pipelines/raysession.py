"""Connect to a Ray cluster, or start a local one with logical GPUs on loopback only."""
from __future__ import annotations

import os
import socket
import tempfile
from contextlib import contextmanager
from typing import Iterator

from soma_cluster.config import CampaignConfig
from soma_cluster.errors import SomaError

# a local Ray (tests, the demo): every process on 127.0.0.1 (SPEC section 10), no token, no usage stats.
# None of this applies to a remote cluster: its own auth mode (e.g. RAY_AUTH_MODE=token) must stand
LOCAL_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
}
PROBE_S = 10.0          # an address nothing answers at fails in this long (Ray itself retries for minutes)


def _probe(address: str) -> None:
    """Fail fast, in one line, on a host:port that nothing listens at ("auto" and ray:// are Ray's to resolve)."""
    if address == "auto" or "://" in address or ":" not in address:
        return
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=PROBE_S):
            pass
    except (OSError, ValueError) as exc:
        raise SomaError(f"cannot reach a Ray cluster at {address} ({exc.__class__.__name__}: {exc}); check --address / "
                        f"RAY_ADDRESS (the head's GCS, host:6379 by default)") from None


def _connect(address: str) -> None:
    import ray

    _probe(address)
    try:
        ray.init(address=address, log_to_driver=True, logging_level="WARNING")
    except ConnectionError as exc:
        mode = os.environ.get("RAY_AUTH_MODE", "unset")
        token = "set" if os.environ.get("RAY_AUTH_TOKEN") else "not set"
        raise SomaError(f"Ray at {address} refused the connection ({str(exc).splitlines()[0][:160]}); if the cluster uses "
                        f"token authentication, set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN (or ~/.ray/auth_token) to its token "
                        f"(here RAY_AUTH_MODE is {mode}, RAY_AUTH_TOKEN {token})") from None


@contextmanager
def ray_session(cfg: CampaignConfig, address: str | None = None) -> Iterator[None]:
    """Use an already-initialised Ray as is; else connect to `address`/RAY_ADDRESS; else start a local
    Ray with `resources.local_gpus` logical GPUs, shut down on exit. Workers' output (warnings,
    tracebacks) reaches this process's stderr."""
    remote = address or os.environ.get("RAY_ADDRESS")
    if not remote:
        for key, value in LOCAL_ENV.items():
            os.environ.setdefault(key, value)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    if ray.is_initialized():
        yield
        return
    if remote:
        _connect(remote)
    else:
        tmp = tempfile.mkdtemp(prefix="soma-ray-", dir="/tmp")
        ray.init(num_gpus=cfg.resources.local_gpus, num_cpus=os.cpu_count() or 1, include_dashboard=False,
                 _temp_dir=tmp, log_to_driver=True, logging_level="WARNING")
    try:
        yield
    finally:
        ray.shutdown()
