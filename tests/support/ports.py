"""One free loopback port for a server a test starts, and never one that Ray takes by default.

A port the kernel hands out for `bind(("127.0.0.1", 0))` comes from the ephemeral range (32768-60999 on Linux),
which holds Ray's fixed dashboard agent port 52365: a Ray head given `--port=52365` refuses to start ("port
number 52365 that is used by other components"), and a test server on it takes the agent's port from any Ray on
the machine. Ports handed out earlier in this process are not handed out again, so two calls in one test never
give one port twice."""

from __future__ import annotations

import socket

from ray._private import ray_constants

RAY_CLIENT_SERVER_PORT = 10001  # `ray start --ray-client-server-port`'s default
RAY_WORKER_PORTS = range(10002, 20000)  # `ray start --min-worker-port/--max-worker-port`'s defaults
RAY_FIXED_PORTS = frozenset(
    {
        ray_constants.DEFAULT_PORT,
        ray_constants.DEFAULT_DASHBOARD_PORT,
        ray_constants.DEFAULT_DASHBOARD_AGENT_LISTEN_PORT,
        RAY_CLIENT_SERVER_PORT,
    }
)
TRIES = 64

_given: set[int] = set()


def free_port() -> int:
    for _ in range(TRIES):  # bounded: the kernel rarely hands out a refused port twice in a row
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in RAY_FIXED_PORTS and port not in RAY_WORKER_PORTS and port not in _given:
            _given.add(port)
            return port
    raise RuntimeError(f"no free loopback port outside Ray's in {TRIES} tries")
