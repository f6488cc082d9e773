"""The worker's view of its own process, with real processes and signals (no Ray): when its GPU share's
clock starts, and a retry waiting for a killed (stopped) earlier process on its node to be gone."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import psutil

from soma_cluster.messages import Incarnation
from workers.expert_worker import ExpertWorker, alive, held_from


def test_the_clock_starts_at_the_grant_never_in_rays_queue():
    assert held_from(100.0, True, 130.0) == 100.0  # the GPUs present had room: held from the request
    assert held_from(100.0, False, 130.0) == 130.0  # it waited in Ray's queue: held from its first instruction
    assert held_from(None, False, 130.0) == 130.0
    assert held_from(140.0, True, 130.0) == 130.0  # a driver clock ahead of this node's never makes it negative


def stopped_sleeper() -> tuple[subprocess.Popen, Incarnation]:
    proc = subprocess.Popen(["sleep", "60"])
    os.kill(proc.pid, signal.SIGSTOP)  # as a hung worker the driver killed: stopped, not yet reaped
    return proc, Incarnation(None, proc.pid, psutil.Process(proc.pid).create_time())


def worker_of(tmp_path, previous) -> ExpertWorker:
    return ExpertWorker(
        campaign_url=str(tmp_path), storage_options={}, experts=[0], attempts=[1], num_gpus=1.0, previous=previous
    )


def test_a_retry_waits_for_the_killed_process_on_its_node(tmp_path):
    proc, inc = stopped_sleeper()
    try:
        worker = worker_of(tmp_path, previous=(inc,))
        killer = threading.Timer(1.0, os.kill, args=(proc.pid, signal.SIGKILL))
        killer.start()
        waited = worker._outlive(bound_s=20.0)
        assert 0.9 <= waited < 20.0 and not alive(inc)  # it returned once the process was gone (a zombie is gone)
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_the_wait_is_bounded_and_a_reused_pid_is_not_the_old_process(tmp_path):
    proc, inc = stopped_sleeper()
    try:
        t = time.monotonic()
        assert worker_of(tmp_path, previous=(inc,))._outlive(bound_s=0.5) >= 0.5
        assert time.monotonic() - t < 15.0  # bounded (0.5 s, plus a loaded host's slack): it starts anyway, warned
        other = Incarnation(None, proc.pid, inc.created - 100.0)
        assert not alive(other)  # same pid, another process start: not the one it waits for
        elsewhere = worker_of(tmp_path, previous=(Incarnation("other-node", proc.pid, inc.created),))
        assert elsewhere._outlive(bound_s=5.0) < 0.5  # a process on another node shares no device with it
    finally:
        proc.kill()
        proc.wait(timeout=10)
