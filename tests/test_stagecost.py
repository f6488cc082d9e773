"""soma_cluster.stagecost: the task clock (off unless asked for), the even-division figures and the Amdahl
projection benchmarks/bench_prepare.py reports."""

from __future__ import annotations

import os
import time

import pytest

from soma_cluster.stagecost import (
    TASK_TIMES_ENV,
    Projection,
    TaskClock,
    makespan,
    parallel_wall,
    power_fit,
    read_task_times,
    spread,
)


def test_task_clock_records_nothing_unless_asked(tmp_path, monkeypatch):
    monkeypatch.delenv(TASK_TIMES_ENV, raising=False)
    clock = TaskClock("embed", 3)
    clock.done(lambda: pytest.fail("the node is asked for only when recording"))
    assert os.listdir(tmp_path) == []


def test_task_clock_records_the_task_own_cpu_and_wall(tmp_path, monkeypatch):
    monkeypatch.setenv(TASK_TIMES_ENV, str(tmp_path))
    clock = TaskClock("embed", 3)
    t = time.thread_time()
    while time.thread_time() - t < 0.05:  # busy: this thread's CPU (the process's grows faster than wall while
        pass  # Ray's and gRPC's threads run, and would end the loop before 0.05 s of wall)
    time.sleep(0.1)  # idle: wall only
    clock.done(lambda: "node-a")
    TaskClock("read", 3).done(lambda: "node-b")
    got = read_task_times(str(tmp_path))
    assert [(x.stage, x.part, x.node, x.pid) for x in got] == [("embed", 3, "node-a", os.getpid())] + [
        ("read", 3, "node-b", os.getpid())
    ]
    embed = got[0]
    # the process's CPU counts every thread of it (in a long pytest run, Ray's and gRPC's too): only a lower bound;
    # the task's own thread spent its busy loop and slept the rest
    assert embed.cpu_s >= 0.04 and embed.wall_s >= 0.15
    assert 0.04 <= embed.thread_cpu_s < embed.wall_s and embed.thread_cpu_s <= embed.cpu_s + 0.01


def test_spread_and_makespan():
    sp = spread([1.0, 1.0, 1.0, 5.0])
    assert (sp.tasks, sp.mean_s, sp.max_s) == (4, 2.0, 5.0) and sp.ratio == 2.5
    assert spread([]).ratio == 1.0
    assert makespan([3.0, 3.0, 3.0], 2) == 6.0  # three equal tasks on two workers: two waves
    assert makespan([4.0, 1.0, 1.0, 1.0, 1.0], 2) == 4.0  # the big one first: the rest fit beside it
    assert makespan([1.0, 1.0, 1.0, 1.0, 4.0], 2) == 6.0  # the big one last: it is the tail
    assert makespan([2.0], 0) == 2.0


def test_power_fit_recovers_a_power_law():
    f = power_fit([1e4, 2e4, 4e4, 8e4], [3.0 * x**1.3 for x in (1e4, 2e4, 4e4, 8e4)])
    assert f.b == pytest.approx(1.3) and f.a == pytest.approx(3.0) and f(1e5) == pytest.approx(3.0 * 1e5**1.3)
    with pytest.raises(ValueError):
        power_fit([1.0], [1.0])


def test_projection_is_amdahl():
    p = Projection(serial_s=600.0, cpu_s_per_mb=0.1)
    assert p.seconds(1e6, 32) == pytest.approx(600 + 1e5 / 32)
    assert p.hours(1e6, 128) == pytest.approx((600 + 1e5 / 128) / 3600)
    assert p.seconds(1e6, 1e9) == pytest.approx(600.0, rel=1e-3)  # no cores make the serial part shorter


def test_parallel_wall_is_bound_by_workers_or_cores():
    assert parallel_wall(100.0, 120.0, 1, 2.0) == 100.0  # one worker: its tasks' CPU
    assert parallel_wall(100.0, 120.0, 2, 2.0) == 60.0  # two workers on two cores: all processes share them
    assert parallel_wall(100.0, 120.0, 2, 1.5) == 80.0  # others took half a core


def test_stage_hooks_see_every_stage_of_a_local_prepare_in_order(tmp_path):
    from conftest import micro_config

    from pipelines import prepare as prep
    from soma_cluster.storage import Store

    seen: list[str] = []
    prep.STAGE_HOOKS.append(seen.append)
    try:
        summary = prep.prepare(Store(str(tmp_path / "camp")), micro_config())
    finally:
        prep.STAGE_HOOKS.remove(seen.append)
    assert seen == ["setup", "read", "sample", "fit", "embed", "refit", "count", "write"]
    assert list(summary["stage_seconds"]) == seen[1:]  # the manifest's stages are the hooks' (setup is not one)


def test_task_clock_never_fails_the_task_it_times(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(TASK_TIMES_ENV, str(tmp_path / "not-there"))  # a node without the directory
    TaskClock("write", 7).done(lambda: "node-a")
    assert "could not record a write task" in capsys.readouterr().err
    assert not (tmp_path / "not-there").exists()


def test_power_fit_refuses_points_a_log_cannot_take():
    for xs, ys in (([1.0, 2.0], [0.0, 1.0]), ([0.0, 2.0], [1.0, 1.0]), ([1.0, 2.0], [-1.0, 1.0])):
        with pytest.raises(ValueError, match="positive"):
            power_fit(xs, ys)
