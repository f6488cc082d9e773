"""Connect to a Ray cluster, or start a local one with logical GPUs on loopback only."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from typing import Iterator

import psutil

from pipelines import raywatch
from pipelines.rayaddress import FORMS_HINT, Address, Form, ray_address, token_hint
from pipelines.raywatch import OWNER_ENV, users_of
from pipelines.stopping import STOP
from soma_cluster.config import CampaignConfig
from soma_cluster.diskerrors import storage_error
from soma_cluster.envvars import value as env_value
from soma_cluster.errors import SomaError
from soma_cluster.lease import process_alive

# a local Ray (tests, the demo): every process on 127.0.0.1 (docs/cluster.md), no token, no usage stats.
# None of this applies to a remote cluster: its own auth mode (e.g. RAY_AUTH_MODE=token) must stand
LOCAL_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
}
RAY_TMP = "/tmp"  # not $TMPDIR: Ray's socket paths must stay under the 107-byte limit of a Unix socket name
PREFIX = "soma-ray-"
OWNER = "soma-owner.json"  # {pid, started} of the command whose local Ray lives here (clean_leftovers reads it)
REAP_GRACE_S = 5.0  # Ray's processes get this long to exit after ray.shutdown(), then SIGKILL
KEEP_ENV = "SOMA_KEEP_RAY_LOGS"  # =1: a local Ray's directory (its logs) stays after the command, for debugging


# A ray:// head starts one client server process per connection and waits RAY_CLIENT_SERVER_CHECK_CHANNEL_TIMEOUT_S
# (30 s by default, the head's setting) for it. A busy head can miss that once: Ray then answers "Initialization
# failure from server" with one of these reasons, or closes the connection before the answer (the client then says
# it was disconnected), and a new connection starts a fresh server. Other reasons (a runtime_env the head refuses,
# ray.init failing on the head) stand: trying again cannot change them.
CLIENT_START_FAILED = (
    "Starting Ray client server failed",
    "Proxy failed to Connect to backend",
    "in start_specific_server",
    "the Ray client has already been disconnected",
)
CLIENT_TRIES = 3
CLIENT_RETRY_S = 2.0


def _reason(exc: BaseException) -> str:
    """The line of a connection error that says why: Ray's client puts the head's traceback after its first line
    ("Initialization failure from server:"), whose last line is the cause."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    return (lines[-1] if lines[0].endswith(":") and len(lines) > 1 else lines[0])[:300]


def _connect(addr: Address) -> None:
    import ray

    for attempt in range(1, CLIENT_TRIES + 1):
        try:
            ray.init(address=addr.text, log_to_driver=True, logging_level="WARNING")
            return
        except ValueError as exc:  # a form Ray refuses (parse() lets through only what Ray accepts: belt and braces)
            raise SomaError(f"{addr.named()}: {str(exc).splitlines()[0][:200]}; {FORMS_HINT}") from None
        except ConnectionError as exc:
            if addr.form is Form.AUTO:
                raise SomaError(
                    "no Ray runs on this machine for address auto; start one (ray start --head), give the "
                    "cluster's address, or no address for a local Ray"
                ) from None
            reason = _reason(exc)
            start_failed = any(mark in str(exc) for mark in CLIENT_START_FAILED)
            if start_failed and attempt == CLIENT_TRIES:
                raise SomaError(
                    f"Ray at {addr.text} did not start a Ray Client server for this connection in {CLIENT_TRIES} "
                    f"tries ({reason}); the head is busy or short of memory: try again later, or give its client "
                    f"servers longer to start (RAY_CLIENT_SERVER_CHECK_CHANNEL_TIMEOUT_S on the head, 30 s by default)"
                ) from None
            if start_failed:
                print(
                    f"warning: Ray at {addr.text} did not start this connection's client server ({reason}); "
                    f"trying again ({attempt + 1} of {CLIENT_TRIES})",
                    file=sys.stderr,
                )
                time.sleep(CLIENT_RETRY_S * attempt)
                STOP.check()
                continue
            raise SomaError(
                f"Ray at {addr.text} refused the connection ({reason}); if the cluster uses token authentication, "
                f"{token_hint()}"
            ) from None


@contextmanager
def ray_session(cfg: CampaignConfig, address: str | Address | None = None) -> Iterator[None]:
    """Use an already-initialised Ray as is; else connect to `address`/RAY_ADDRESS (checked by ray_address unless
    the caller did); else start a local Ray with `resources.local_gpus` logical GPUs, shut down on exit. Workers'
    output (warnings, tracebacks) reaches this process's stderr."""
    addr = address if isinstance(address, Address) else ray_address(address)
    remote = addr.remote
    if not remote:
        for key, value in LOCAL_ENV.items():
            os.environ.setdefault(key, value)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    if ray.is_initialized():
        yield
        return
    tmp, watchdog, keep = None, None, bool(env_value(KEEP_ENV))
    try:
        if remote:
            with _ray_init_guard():
                _connect(addr)
        else:
            clean_leftovers()
            tmp = _own_temp_dir()
            watchdog = _start_watchdog(tmp, keep)
            os.environ[OWNER_ENV] = tmp  # every Ray process this starts inherits it: the watchdog finds its workers
            with _ray_init_guard():
                ray.init(
                    num_gpus=cfg.resources.local_gpus,
                    num_cpus=os.cpu_count() or 1,
                    include_dashboard=False,
                    _temp_dir=tmp,
                    log_to_driver=True,
                    logging_level="WARNING",
                )
        yield
    finally:
        with STOP.deferred(), _handlers_kept_through_shutdown():  # a signal now waits: the local Ray goes whole
            ray.shutdown()
            if tmp is not None:
                reap(tmp, keep=keep, spare={watchdog.pid} if watchdog else set())
                os.environ.pop(OWNER_ENV, None)
            if watchdog is not None:
                _stop_watchdog(watchdog)


def _start_watchdog(directory: str, keep: bool) -> subprocess.Popen | None:
    """The local Ray's watchdog (pipelines/raywatch.py): a process of its own session (a terminal's Ctrl-C is for
    this command, not for it) whose standard input is a pipe only this process writes, so it sees this command end
    however it ends. None where it cannot start (the command runs on; an earlier command's leftovers are still
    removed by the next one, clean_leftovers)."""
    env = {k: v for k, v in os.environ.items() if k != OWNER_ENV}
    try:
        return subprocess.Popen(
            [sys.executable, raywatch.__file__, directory, str(os.getpid()), "1" if keep else "0"],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            env=env,
        )
    except OSError as exc:
        print(
            f"warning: the local Ray's watchdog did not start ({exc}); a SIGKILL of this command would leave its "
            f"Ray's agents running for about a minute",
            file=sys.stderr,
        )
        return None


def _stop_watchdog(watchdog: subprocess.Popen) -> None:
    """Tell the watchdog this command stopped its Ray itself (DONE), and wait for it to leave."""
    try:
        watchdog.stdin.write(raywatch.DONE)
        watchdog.stdin.close()
    except OSError:  # it is gone already
        pass
    try:
        watchdog.wait(timeout=REAP_GRACE_S)
    except subprocess.TimeoutExpired:
        watchdog.kill()
        watchdog.wait()


def _own_temp_dir() -> str:
    """A local Ray's directory under RAY_TMP, with the owner file clean_leftovers reads; a full or read-only /tmp is
    one line naming it (Ray cannot start without room for its sockets and logs there)."""
    tmp = None
    try:
        tmp = tempfile.mkdtemp(prefix=PREFIX, dir=RAY_TMP)
        with open(os.path.join(tmp, OWNER), "w") as fh:
            json.dump({"pid": os.getpid(), "started": psutil.Process().create_time()}, fh)
        return tmp
    except OSError as exc:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        err = storage_error(exc, RAY_TMP, "a local Ray keeps its sockets and logs there")
        if err is None:
            raise
        raise err from None


@contextmanager
def _ray_init_guard() -> Iterator[None]:
    """Around ray.init. It installs SIGTERM handlers of its own (sys.exit(15) for the driver, kill-and-exit(1) for the
    node it starts): a job system's SIGTERM during a slow start-up would end the command with Ray's exit code and no
    final word. Ray installs them through one helper, which is a no-op here; ours stay (and are installed again
    after, in case a later Ray sets the signal some other way); ray.shutdown() in ray_session stops the node either
    way. And the driver's command line goes to the GCS as valid UTF-8 (`_utf8`)."""
    import ray._private.utils as ray_utils

    original = getattr(ray_utils, "set_sigterm_handler", None)
    entrypoint = getattr(ray_utils, "get_entrypoint_name", None)
    if original is not None:
        ray_utils.set_sigterm_handler = lambda handler: None
    if entrypoint is not None:
        ray_utils.get_entrypoint_name = lambda: _utf8(entrypoint())
    try:
        yield
    finally:
        if original is not None:
            ray_utils.set_sigterm_handler = original
        if entrypoint is not None:
            ray_utils.get_entrypoint_name = entrypoint
        STOP.install()


@contextmanager
def _handlers_kept_through_shutdown() -> Iterator[None]:
    """ray.shutdown() stops the driver's core worker, which sets SIGTERM back to the default action (measured: 0.28 s
    into a 1.3 s shutdown); a job system's SIGTERM in the second that follows, while Ray's processes are stopped,
    killed the command before it released its lease. Ours are installed again as that stopping begins
    (Node.kill_all_processes, where only milliseconds have passed since) and after it."""
    from ray._private.node import Node

    original = getattr(Node, "kill_all_processes", None)
    if original is not None:

        def kill_all_processes(node, *args, **kwargs):
            STOP.install()
            return original(node, *args, **kwargs)

        Node.kill_all_processes = kill_all_processes
    try:
        yield
    finally:
        if original is not None:
            Node.kill_all_processes = original
        STOP.install()


def _utf8(text: str) -> str:
    """Ray sends the driver's command line to the GCS as UTF-8 (the job's entrypoint, for the dashboard): a campaign
    path that is not valid UTF-8 (kept by Python as surrogate escapes) made ray.init raise UnicodeEncodeError."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def reap(directory: str, grace_s: float = REAP_GRACE_S, keep: bool = False, spare: set[int] = frozenset()) -> None:
    """After ray.shutdown(): the local Ray's processes gone (SIGKILL after `grace_s`) and its temporary directory
    removed, so nothing of this command outlives it; with `keep` (SOMA_KEEP_RAY_LOGS=1, to read Ray's own logs
    after a failure) the directory stays, marked kept so that no later command removes it. `spare`: pids left alone
    (the watchdog, whose command line names the directory too)."""
    procs = [p for p in users_of(directory) if p.pid not in spare]
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace_s)
    if keep:
        with open(os.path.join(directory, OWNER), "w") as fh:
            json.dump({"kept": True}, fh)
        print(
            f"soma: the local Ray's files are kept in {directory} ({KEEP_ENV}=1); remove it when done", file=sys.stderr
        )
        return
    shutil.rmtree(directory, ignore_errors=True)


def clean_leftovers(root: str = RAY_TMP) -> list[str]:
    """What an earlier command's local Ray left when that command was SIGKILLed (or the host lost power): its
    directories whose owner is gone, with any process still using them. A directory without an owner file (an
    older soma's) goes once nothing uses it and it is an hour old. Returns the directories removed."""
    removed = []
    for d in glob.glob(os.path.join(root, PREFIX + "*")):
        try:
            with open(os.path.join(d, OWNER)) as fh:
                owner = json.load(fh)
            gone = not owner.get("kept") and not process_alive(int(owner["pid"]), float(owner["started"]))
        except FileNotFoundError:
            gone = time.time() - os.path.getmtime(d) > 3600 and not users_of(d)
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if gone:
            reap(d, grace_s=1.0)
            removed.append(d)
    return removed
