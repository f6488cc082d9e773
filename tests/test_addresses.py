"""Every command that takes a Ray address, with every form of address an operator gives by mistake (generated from
the CLI's own command list): each is one `error:` line naming the address and the fix, exit 2, within a bounded
time, with nothing written. The servers are real and on 127.0.0.1: an HTTP server (what answers on the
dashboard's port), a listener that accepts and never answers, and ports nothing listens at."""

from __future__ import annotations

import http.server
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import typer.main
from conftest import micro_config
from support.rayhead import free_port
from typer.testing import CliRunner

from pipelines.cli import app
from pipelines.rayaddress import PROBE_S, Form, parse, ray_address
from soma_cluster.config import to_yaml_text
from soma_cluster.errors import SomaError

BOUND_S = PROBE_S + 8  # the probe's bound, the CLI's start-up and a loaded 2-core host


def refused_at_once_s(argv: list[str]) -> float:
    """How long the same command takes on this host now to be refused at once (an address with nothing listening):
    its start-up and checks without the probe's wait. A bound made of it holds however loaded the host is."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]  # nothing listens once the socket is closed
    t0 = time.monotonic()
    subprocess.run(
        [sys.executable, "-m", "pipelines.cli", *argv],
        capture_output=True,
        timeout=120,
        env={**os.environ, "RAY_ADDRESS": f"127.0.0.1:{closed}", "COLUMNS": "300"},
    )
    return time.monotonic() - t0


def address_commands() -> dict[str, list[str]]:
    """Command name -> its positional arguments, for every command with an --address option."""
    group = typer.main.get_command(app)
    return {
        name: [p.name for p in cmd.params if p.param_type_name == "argument" and p.required]
        for name, cmd in group.commands.items()
        if any("--address" in getattr(p, "opts", ()) for p in cmd.params)
    }


class QuietHandler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:  # the probe's requests are expected: no log line each
        pass


class QuietServer(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:  # a probe that hangs up early is not an error
        pass


@pytest.fixture(scope="module")
def servers():
    """An HTTP server and a silent listener, both on loopback, for the module."""
    web = QuietServer(("127.0.0.1", 0), QuietHandler)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    yield {"http": web.server_address[1], "silent": silent.getsockname()[1]}
    web.shutdown()
    web.server_close()
    silent.close()


def forms(servers) -> dict[str, tuple[str, str]]:
    """Name -> (address, a word the error line must hold)."""
    http_port, silent_port, nobody = servers["http"], servers["silent"], free_port()
    return {
        "jobs-url": (f"http://127.0.0.1:{http_port}", "ray job submit"),
        "jobs-url-tls": (f"https://127.0.0.1:{http_port}", "ray job submit"),
        "dashboard-port": (f"127.0.0.1:{http_port}", "HTTP server"),
        "silent-port": (f"127.0.0.1:{silent_port}", "does not answer"),
        "nothing-listens": (f"127.0.0.1:{nobody}", "cannot reach"),
        "ray-client": (f"ray://127.0.0.1:{nobody}", "Ray Client"),
        "ray-client-uppercase": (f"RAY://127.0.0.1:{nobody}", "Ray Client"),
        "host-too-long": ("a" * 300 + ":6379", "cannot reach"),
        "fullwidth-port": ("127.0.0.1:６３７９", "not a Ray address"),
        "no-port": ("127.0.0.1", "not a Ray address"),
        "port-out-of-range": ("127.0.0.1:70000", "not a Ray address"),
        "other-scheme": ("s3://bucket:1", "not a Ray address"),
        "spaces": ("my head node", "not a Ray address"),
    }


# soma serve takes a dashboard's http(s):// and Ray Client: it probes them (nothing there, or a web server that is
# not Ray's dashboard) where every other command refuses them by their text
SERVE_NEEDLES = {
    "jobs-url": "not a Ray dashboard",
    "jobs-url-tls": "not a Ray dashboard",
    "ray-client": "cannot reach",
    "ray-client-uppercase": "cannot reach",
}


def quiet(name: str) -> list[str]:
    cmd = typer.main.get_command(app).commands[name]
    return ["--no-progress"] if any("--no-progress" in getattr(p, "opts", ()) for p in cmd.params) else []


def positional(arg: str, tmp_path) -> str:
    values = {"campaign": str(tmp_path / "camp"), "directory": str(tmp_path / "exp"), "name": "variance"}
    assert arg in values, f"a command takes a new argument {arg!r}: give it a value here"
    return values[arg]


def tree(root) -> list[tuple[str, int]]:
    return sorted(
        (os.path.relpath(os.path.join(d, f), root), os.stat(os.path.join(d, f)).st_size)
        for d, _, files in os.walk(root)
        for f in files
    )


def refuse(argv, env, case):
    """Run one command in-process (typer's runner: the same entry point, without a new interpreter's start-up)."""
    before = tree(case)
    t0 = time.monotonic()
    result = CliRunner().invoke(app, argv, env={"COLUMNS": "300", **env})
    took = time.monotonic() - t0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.exit_code == 2 and len(errors) == 1, (argv, env, result.stderr[-1500:], result.exception)
    assert tree(case) == before, argv  # nothing written, not even a directory
    return errors[0], took


def test_every_address_command_refuses_every_wrong_address_fast_and_writes_nothing(tmp_path, servers):
    commands = address_commands()
    assert {"prepare", "seed", "launch", "resume", "plan", "demo", "experiment"} <= commands.keys()
    rows = []
    for name, args in commands.items():
        for form, (address, needle) in forms(servers).items():
            needle = SERVE_NEEDLES.get(form, needle) if name == "serve" else needle
            if form == "silent-port":
                continue  # the same probe for every command, 10 s each: one command below
            for via in ("--address", "RAY_ADDRESS"):
                case = tmp_path / f"{name}-{form}-{via}"
                (case / "camp").mkdir(parents=True)
                (case / "camp" / "campaign.yaml").write_text(to_yaml_text(micro_config()))
                argv = [name, *(positional(a, case) for a in args), *quiet(name)]
                env = {"RAY_ADDRESS": address} if via == "RAY_ADDRESS" else {"RAY_ADDRESS": None}
                line, took = refuse(argv if via == "RAY_ADDRESS" else [*argv, "--address", address], env, case)
                shown = address.split()[0][:60]
                assert needle in line and shown.lower() in line.lower() and via in line, (name, form, via, line)
                assert took < BOUND_S, (name, form, via, took)
                rows.append((took, name, form, via))
    print(f"\n{len(rows)} refusals, slowest {max(rows)}")


def test_an_address_that_accepts_and_never_answers_is_refused_within_the_probe_bound(tmp_path, servers):
    """The real CLI process, RAY_ADDRESS set to a listener that never speaks (a wrong port behind a firewall or
    proxy): Ray would wait for minutes."""
    (tmp_path / "camp").mkdir()
    (tmp_path / "camp" / "campaign.yaml").write_text(to_yaml_text(micro_config()))
    address = f"127.0.0.1:{servers['silent']}"
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "pipelines.cli", "seed", str(tmp_path / "camp"), "--no-progress"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "RAY_ADDRESS": address, "COLUMNS": "300"},
    )
    took = time.monotonic() - t0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"RAY_ADDRESS={address}" in errors[0] and "does not answer" in errors[0], errors[0]
    if took >= BOUND_S:  # a loaded host: the probe's bound on top of what this command costs here now
        at_once = refused_at_once_s(["seed", str(tmp_path / "camp"), "--no-progress"])
        assert took < PROBE_S + 1.5 * at_once + 4, (took, at_once)
    assert sorted(p.name for p in (tmp_path / "camp").iterdir()) == ["campaign.yaml"]


@pytest.mark.parametrize(
    "text,form",
    [
        (None, Form.LOCAL),
        ("", Form.LOCAL),
        ("local", Form.LOCAL),
        ("  auto ", Form.AUTO),
        ("10.0.0.5:6379", Form.GCS),
        ("head.svc.cluster.local:6379", Form.GCS),
        ("[fd00::1]:6379", Form.GCS),
        ("ray://head:10001", Form.CLIENT),
        ("RAY://head:10001", Form.CLIENT),
        ("  ", Form.LOCAL),
        ("10.0.0.5:006379", Form.GCS),
    ],
)
def test_the_forms_ray_accepts_parse(text, form):
    assert parse(text, {}).form is form
    assert parse(None, {"RAY_ADDRESS": text} if text is not None else {}).form is form


@pytest.mark.parametrize(
    "text", ["http://h:8265", "HTTPS://h", "h", "h:0", "h:65536", ":6379", "h:63a", "a b:1", "x://h:1", "h:６３７９"]
)
def test_other_forms_are_refused_by_their_text(text):
    with pytest.raises(SomaError, match="address"):
        parse(text, {})


def test_a_gcs_and_a_ray_client_port_each_given_in_the_other_form_are_named(tmp_path):
    """A real head with its Ray Client server: ray:// for the GCS port (Ray waited 30 s for a client handshake,
    then blamed the token) and the client port as a GCS address are one line each, saying which form fits; both
    right forms pass the probe. A client server the head fails to start is tried again, then named as such."""
    from support.rayhead import RayHead

    from pipelines.rayaddress import probe

    client = free_port()
    # the head gives each Ray Client connection's server no time to start: every connection fails as one does on a
    # busy head (CI, 2026-12-07), which soma serve tries again, then names
    slow = {"RAY_CLIENT_SERVER_CHECK_CHANNEL_TIMEOUT_S": "0"}
    with RayHead(slow, ("--num-cpus=1", f"--ray-client-server-port={client}")) as head:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # bounded: the client server starts just after the head
            try:
                socket.create_connection(("127.0.0.1", client), timeout=1).close()
                break
            except OSError:
                time.sleep(0.5)
        for text in (head.address, f"ray://127.0.0.1:{client}"):
            probe(parse(text, {}))  # each answers as its form says (the CLI then refuses Ray Client itself)
        with pytest.raises(SomaError, match=rf"give it as {head.address} \(no ray://\)"):
            probe(parse(f"ray://{head.address}", {}))
        with pytest.raises(SomaError, match=r"the Ray Client server answers there, not the GCS"):
            probe(parse(f"127.0.0.1:{client}", {}))
        with pytest.raises(SomaError, match=r"Ray Client address; soma's driver cannot run over Ray Client"):
            ray_address(f"ray://127.0.0.1:{client}")
        code = (
            "import sys; import pipelines.raysession as rs; from pipelines.rayaddress import parse; "
            "from soma_cluster.errors import SomaError\n"
            "rs.CLIENT_RETRY_S, rs.CLIENT_TRIES = 0.1, 2\n"  # one try again is the mechanism, at a third of the cost
            f"try: rs._connect(parse('ray://127.0.0.1:{client}', {{}}, serve=True))\n"
            "except SomaError as e: print(e); sys.exit(2)"
        )
        env = {**os.environ, "RAY_CLIENT_RECONNECT_GRACE_PERIOD": "0"}  # else each failed try waits 30 s more
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert "did not start a Ray Client server for this connection in 2 tries (" in proc.stdout, proc.stdout
        assert "RAY_CLIENT_SERVER_CHECK_CHANNEL_TIMEOUT_S on the head" in proc.stdout, proc.stdout
        assert proc.stderr.count("did not start this connection's client server") == 1, proc.stderr[-2000:]
        assert "trying again (2 of 2)" in proc.stderr


def test_an_empty_or_blank_address_means_a_local_ray_and_overrides_ray_address(monkeypatch):
    for address, env in (("", "bogus"), (" ", None), (None, " \t")):
        if env is None:
            monkeypatch.delenv("RAY_ADDRESS", raising=False)
        else:
            monkeypatch.setenv("RAY_ADDRESS", env)
        assert ray_address(address).form is Form.LOCAL
        assert "RAY_ADDRESS" not in os.environ  # ray.init and Ray Data must not read it again


def test_auto_with_no_ray_on_this_machine_is_one_line(tmp_path, monkeypatch):
    from ray._private.services import find_gcs_addresses

    # auto falls back to any GCS process on the machine (Ray's own lookup): another suite's or user's Ray, on a
    # shared host, is one, and the premise of the test does not hold there (as on a developer's host, 2026-12-06)
    if find_gcs_addresses():
        pytest.skip("a Ray runs on this machine (not this test's): auto finds it, so 'no Ray' cannot be tried here")
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))  # where Ray looks for a running cluster's address
    with pytest.raises(SomaError, match="no Ray runs on this machine"):
        ray_address("auto")


@pytest.mark.parametrize(
    "text,url",
    [
        ("http://h:8265", "http://h:8265"),
        ("HTTPS://h", "https://h:443"),
        ("http://h", "http://h:80"),
        ("http://[fd00::1]:8265/", "http://[fd00::1]:8265"),
        (" http://10.0.0.5:08265 ", "http://10.0.0.5:8265"),
    ],
)
def test_soma_serve_takes_a_dashboard_address(text, url):
    """soma serve deploys through Serve's REST API at a dashboard (RAY_ADDRESS=http://HOST:8265, as operators set it
    for ray job submit); every other command refuses that form by its text, as before."""
    addr = parse(text, {}, serve=True)
    assert addr.form is Form.DASHBOARD and addr.text == url
    assert parse(None, {"RAY_ADDRESS": text}, serve=True).named() == f"RAY_ADDRESS={url}"
    with pytest.raises(SomaError, match="Ray Jobs"):
        parse(text, {})


@pytest.mark.parametrize("text", ["http://h:8265/dash", "http://:8265", "http://h:0", "https://h:65536", "http://a b"])
def test_a_dashboard_address_soma_serve_cannot_use_is_one_line(text):
    with pytest.raises(SomaError, match="not a dashboard address"):
        parse(text, {}, serve=True)


def test_ray_client_is_soma_serve_s_alone():
    """A Serve application's actors are started by Serve's controller, not by the driver: over Ray Client the driver
    only deploys (tests/test_serve.py deploys that way), so soma serve takes ray://; every other command refuses it."""
    from pipelines.rayaddress import check_form

    addr = parse("ray://head:10001", {}, serve=True)
    check_form(addr, serve=True)
    with pytest.raises(SomaError, match="cannot run over Ray Client"):
        check_form(addr)


def test_a_dashboard_address_with_nothing_there_is_one_line_within_the_probe_bound():
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(SomaError, match=rf"--address http://127.0.0.1:{port} is not a Ray dashboard"):
        ray_address(f"http://127.0.0.1:{port}", serve=True)
    assert time.monotonic() - t0 < PROBE_S + 5


@pytest.mark.parametrize(
    "text,reason",
    [
        (
            "Initialization failure from server:\nTraceback (most recent call last):\n  File x\nRuntimeError: cause",
            "RuntimeError: cause",
        ),
        ("Failed to connect to the GCS at h:6379", "Failed to connect to the GCS at h:6379"),
        ("first line\nsecond line", "first line"),
        ("Initialization failure from server:\n", "Initialization failure from server:"),
        ("", "ConnectionError"),
    ],
)
def test_a_connection_error_is_named_by_its_cause(text, reason):
    """Ray's client puts the head's traceback after its first line: the error names the traceback's last line."""
    from pipelines.raysession import _reason

    assert _reason(ConnectionError(text)) == reason
