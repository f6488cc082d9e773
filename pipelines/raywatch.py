"""A local Ray dies with the command that started it, however that command ends (SIGKILL and the OOM killer
included): a watchdog process, started beside the local Ray, removes what is left of it as soon as its command is
gone.

Ray fate-shares only part of a local node with its driver. The processes the driver starts (GCS, raylet, the
dashboard, monitors) get PR_SET_PDEATHSIG and die with it; the raylet's own children do not. Its agents
(`ray::DashboardAgent`, `ray::RuntimeEnvAgent`) notice the raylet gone and then report that to the GCS, which is
gone too, with a 60 s timeout (ray/_private/process_watcher.py, publish_error_to_driver): measured here, both ran on
under PID 1 for 62 s after a SIGKILL of the driver (and ray-project/ray#39092, #52385 report the same class). Their
command lines are rewritten (setproctitle), so nothing that searches by name or by the session's directory finds
them afterwards.

So the watchdog knows them by ancestry while the driver lives: it lists the driver's descendants every WATCH_POLL_S (the
agents start with the node, within a few seconds of `ray.init`), and it also knows Ray's processes by their
command line naming the session's directory and by the environment variable OWNER_ENV, which every worker inherits.
It learns of the driver's end by the end of a pipe: its standard input, whose write end only the driver holds (a
non-inheritable descriptor), reads EOF the moment the driver's process is gone, whatever killed it. A driver that
shuts its Ray down itself writes DONE first, and the watchdog leaves without touching anything.

Run as a script (`python raywatch.py DIRECTORY DRIVER_PID KEEP`): it imports only psutil, so it starts in a tenth
of a second and holds ~15 MB while the command runs. The rules (which processes, in what order) are functions here,
for the driver's own clean-up too (pipelines/raysession.py)."""

from __future__ import annotations

import os
import re
import select
import shutil
import sys
import time

import psutil

OWNER_ENV = "SOMA_RAY_DIR"  # set by the driver before ray.init: the local Ray's directory, in every worker's env
DONE = b"done\n"  # the driver shut its Ray down itself: nothing to do
RAY_PROGRAMS = ("gcs_server", "raylet")  # besides Python processes (its agents, workers): what may be killed
WATCH_POLL_S = 0.25  # how often the driver's descendants are listed while its node starts (the agents start then)
SETTLED_WATCH_POLL_S = 2.0  # and after STARTING_S, when only workers come and go (they carry OWNER_ENV)
STARTING_S = 60.0
KILL_WAIT_S = 5.0  # after SIGKILL, how long to wait for the kernel to reap (a process in D state may take a moment)


def is_ray_process(name: str) -> bool:
    return name in RAY_PROGRAMS or "python" in name or name.startswith("ray::")


def users_of(directory: str, known: dict[int, float] | None = None) -> list[psutil.Process]:
    """The local Ray's processes: those whose command line names `directory` (its GCS, raylet, monitors), those whose
    environment carries OWNER_ENV=`directory` (its workers), and `known` ones (pid -> start time: the driver's
    descendants seen while it lived, its agents among them) that still run. Never this process; a person's
    `tail -f` of its logs is not a Ray process."""
    named = re.compile(re.escape(directory) + r"(?![\w.-])")  # not a longer name it is the start of
    known = known or {}
    found = []
    for p in psutil.process_iter(["cmdline", "name", "create_time"]):
        try:
            if p.pid == os.getpid() or not is_ray_process(p.info["name"] or ""):
                continue
            seen = known.get(p.pid) == p.info["create_time"]
            if seen or any(named.search(a) for a in p.info["cmdline"] or ()) or p.environ().get(OWNER_ENV) == directory:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def kill_all(procs: list[psutil.Process], wait_s: float = KILL_WAIT_S) -> list[psutil.Process]:
    """SIGKILL each (their driver is gone: nothing of theirs is worth a clean stop), then wait until each is gone or a
    zombie (which holds no memory and no file: its reaping is its new parent's, often PID 1); the ones still alive
    after `wait_s`."""
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    deadline = time.monotonic() + wait_s
    while (alive := [p for p in procs if running(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def descendants(driver: psutil.Process, into: dict[int, float]) -> None:
    try:
        for p in driver.children(recursive=True):
            try:
                into[p.pid] = p.create_time()
            except psutil.NoSuchProcess:
                continue
    except psutil.NoSuchProcess:
        pass


def watch(directory: str, driver_pid: int, keep: bool, fd: int = 0) -> bool:
    """Until `fd` reads EOF (the driver is gone) or DONE: then, on EOF, the local Ray's processes are killed and its
    directory removed (kept with `keep`). True when it had to."""
    known: dict[int, float] = {}
    try:
        driver = psutil.Process(driver_pid)
    except psutil.NoSuchProcess:
        driver = None
    t0 = time.monotonic()
    got = b""
    while True:
        if driver is not None:
            descendants(driver, known)
        wait = WATCH_POLL_S if time.monotonic() - t0 < STARTING_S else SETTLED_WATCH_POLL_S
        if select.select([fd], [], [], wait)[0]:
            chunk = os.read(fd, 64)
            got += chunk
            if got.endswith(DONE):
                return False
            if not chunk:
                break
    kill_all(users_of(directory, known))
    if not keep:
        shutil.rmtree(directory, ignore_errors=True)
    return True


def main(argv: list[str]) -> int:
    directory, driver_pid, keep = argv[1], int(argv[2]), argv[3] == "1"
    try:
        watch(directory, driver_pid, keep)
    except KeyboardInterrupt:  # its own session: no terminal's Ctrl-C reaches it; a direct one just ends it
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
