"""What `soma prepare` costs, measured, and what that predicts for a cluster (benchmarks/bench_prepare.py).

- TaskTime: one Ray task's own process CPU and wall seconds, written as a JSON line by the task itself when
  SOMA_TASK_TIMES names a directory (pipelines.prepare_ray); nothing is written, or computed, otherwise.
- spread: how evenly a stage's tasks divided the work (slowest task against the mean).
- Projection: the Amdahl model the runbook's hours come from: a serial part on the driver plus the parallel
  stages' CPU-seconds per MB shared by the cores that run them.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np

TASK_TIMES_ENV = "SOMA_TASK_TIMES"  # a directory: each Ray task of prepare appends its TaskTime there


@dataclass(frozen=True)
class TaskTime:
    """One task of a prepare stage, as its worker process saw it (seconds; cpu: user + system of the process
    while the task ran, which is the task's work plus whatever else that process did then)."""

    stage: str  # read, sample, embed, count, write
    part: int
    pid: int
    node: str
    cpu_s: float
    wall_s: float
    end: float  # time.time() when the task finished
    thread_cpu_s: float = 0.0  # the task's own thread alone: cpu_s less it is the process's other threads (Ray's)

    def line(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def parse(line: str) -> "TaskTime":
        return TaskTime(**json.loads(line))


class TaskClock:
    """Times one task when SOMA_TASK_TIMES is set (a no-op otherwise: one environment lookup)."""

    def __init__(self, stage: str, part: int):
        self.stage, self.part = stage, part
        self.where = os.environ.get(TASK_TIMES_ENV)
        if self.where:
            self.cpu, self.wall, self.thread = time.process_time(), time.perf_counter(), time.thread_time()

    def done(self, node: Callable[[], str]) -> None:
        """Record the task (node: asked only when recording, its Ray node id)."""
        if not self.where:
            return
        t = TaskTime(
            self.stage,
            self.part,
            os.getpid(),
            node(),
            time.process_time() - self.cpu,
            time.perf_counter() - self.wall,
            time.time(),
            time.thread_time() - self.thread,
        )
        # one file per task: appends from many processes (or nodes sharing the directory) never interleave
        path = os.path.join(self.where, f"{self.stage}-{self.part:05d}-{uuid.uuid4().hex[:8]}.json")
        try:
            with open(path, "w") as fh:
                fh.write(t.line())
        except OSError as exc:  # a measurement aid never fails the prepare it measures (a node without the directory)
            print(f"{TASK_TIMES_ENV}: could not record a {self.stage} task ({exc})", file=sys.stderr)


def read_task_times(where: str) -> list[TaskTime]:
    out = []
    for name in sorted(os.listdir(where)):
        with open(os.path.join(where, name)) as fh:
            out.append(TaskTime.parse(fh.read()))
    return out


@dataclass(frozen=True)
class Spread:
    """A stage's tasks: how many, their mean and slowest wall seconds, and slowest / mean (1 = perfectly even)."""

    tasks: int
    mean_s: float
    max_s: float

    @property
    def ratio(self) -> float:
        return self.max_s / self.mean_s if self.mean_s > 0 else 1.0


def spread(seconds: list[float]) -> Spread:
    if not seconds:
        return Spread(0, 0.0, 0.0)
    return Spread(len(seconds), float(np.mean(seconds)), float(np.max(seconds)))


def makespan(seconds: list[float], workers: int) -> float:
    """Wall seconds of tasks handed out in order to the first free of `workers` (Ray Data's task pool): the
    lower bound on a stage's wall time from how the work divides, before any overhead."""
    free = [0.0] * max(workers, 1)
    for s in seconds:
        i = int(np.argmin(free))
        free[i] += s
    return max(free)


@dataclass(frozen=True)
class PowerFit:
    """y = a * x ** b, fitted by least squares on log y against log x."""

    a: float
    b: float

    def __call__(self, x: float) -> float:
        return self.a * x**self.b


def power_fit(xs: list[float], ys: list[float]) -> PowerFit:
    if len(xs) < 2:
        raise ValueError("a power law needs two points or more")
    if min(xs) <= 0 or min(ys) <= 0:
        raise ValueError(f"a power law fits positive points only: {list(zip(xs, ys, strict=True))}")
    b, log_a = np.polyfit(np.log(xs), np.log(ys), 1)
    return PowerFit(float(math.exp(log_a)), float(b))


@dataclass(frozen=True)
class Projection:
    """Amdahl for prepare: T = serial_s + mb * cpu_s_per_mb / cores, cores = those the parallel stages get.

    serial_s: the driver's own part (gathering the sample, the router fit, the offsets' refit), which no worker
    count shortens; cpu_s_per_mb: every process's CPU-seconds per MB of corpus text in the parallel stages
    (tasks, Ray's own processes, the driver's share while they run)."""

    serial_s: float
    cpu_s_per_mb: float

    def seconds(self, mb: float, cores: float) -> float:
        return self.serial_s + mb * self.cpu_s_per_mb / cores

    def hours(self, mb: float, cores: float) -> float:
        return self.seconds(mb, cores) / 3600


def parallel_wall(task_cpu_s: float, all_cpu_s: float, workers: int, cores: float) -> float:
    """Wall seconds of the parallel stages on a host of `cores` where everything is CPU-bound: the workers
    cannot go faster than their tasks' CPU shared among them, and all the processes (tasks, Ray's own, the
    driver) cannot go faster than their CPU shared among the cores they have."""
    return max(task_cpu_s / max(workers, 1), all_cpu_s / cores)
