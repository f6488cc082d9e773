"""The test servers' port helper never hands out a port Ray takes by default, nor one port twice."""

from __future__ import annotations

import socket

from support.ports import RAY_FIXED_PORTS, RAY_WORKER_PORTS, free_port


def test_free_ports_are_distinct_bindable_and_not_rays() -> None:
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert not set(ports) & RAY_FIXED_PORTS
    assert not any(p in RAY_WORKER_PORTS for p in ports)
    for port in ports[:20]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
