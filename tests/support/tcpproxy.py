"""A tiny TCP forwarder on 127.0.0.1, run as its own process: `python tcpproxy.py LISTEN_PORT TARGET_PORT`.

The S3 outage tests put it between the clients and moto and SIGKILL / restart it on the same port, so
the endpoint really goes away (in-flight connections reset, new ones refused) while moto, which
keeps its state only in memory, stays up behind it.
"""

from __future__ import annotations

import socket
import sys
import threading


def pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def serve(listen_port: int, target_port: int) -> None:
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsock.bind(("127.0.0.1", listen_port))
    lsock.listen(128)
    print("ready", flush=True)
    while True:
        client, _ = lsock.accept()
        try:
            upstream = socket.create_connection(("127.0.0.1", target_port), timeout=5)
            upstream.settimeout(None)
        except OSError:
            client.close()
            continue
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=pump, args=(a, b), daemon=True).start()


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]))
