"""The campaign's ETA, a stated estimator (docs/cli.md): no Ray, no clock of its own (times come with the records).

What it models. The driver's jobs run in lanes: floor(GPUs / resources.num_gpus) actors at once, each of
resources.experts_per_actor experts. A job in a lane takes a start-up, from the moment
its lane is free to its first heartbeat (Ray's hand-over of the slot, the process and its imports, loading the data
and model, the first update, which is one: measured before a chunk is promised), then its other updates; the ETA is
when the last lane is done.

What it measures, from the records (the events the driver writes, in its own time):
- start-up: for each attempt, its first heartbeat's time less the time its lane was free: when it was queued, or,
  if it waited, the oldest lane freed (a job's end, a failure, a preemption) not yet taken, whichever is later.
  Frees and first heartbeats are paired in order, so which job took which lane may be wrong but the mean is not.
  The figure is the samples' mean, each decayed by exp(-age / TAU_S); an idle actor's (reuse_actors) apart.
- seconds per update: every heartbeat after an attempt's first gives the span since the previous one over the
  updates it made. The campaign's figure is their ratio of sums, each term decayed the same way, so it follows the
  machine (validations, checkpoints and warm-ups included, weighed by the time they took); each job keeps its own
  ratio too, begun as if it had made PRIOR_UPDATES at the campaign's speed: a job on a slow node is seen as slow.
Before any sample, a prior stands in (the plan's: soma_cluster/costmodel.py writes it; none, no ETA); the first
sample replaces it. A driver that resumes a campaign replays its history first (`restart`), so it starts from what
the last driver learned.

Time left: each running job past its first heartbeat ends after its updates left (those its budget affords) at its
own speed, less the time since that heartbeat; a lane whose job is starting (one freed or never used, not yet
followed by a first heartbeat) ends its start-up at its free time plus the start-up, then runs its job's updates;
every other job waits for the first lane that frees and takes a start-up (an idle actor's, with
resources.reuse_actors) plus its updates (the campaign's figures). resources.max_actors holds back only the jobs not
yet asked of Ray, as the driver does (soma set lowering it withdraws no actor already queued).

Checked against what happened (tests/test_eta.py, benchmarks/bench_eta.py): replayed over the events of real
tiny-preset launches and given the start-up and speed the machine then gave, the model ends within 3% of the real
end at N = 256 (experts of 60 updates, 4 lanes; twice) and within 6% at N = 4, from 10% to 95% of the updates. The
ETA itself can only follow the speed it has measured: on the shared 2-core host those runs come from, Ray's workers
(niceness 15) went up to 2.5 times slower and faster again as other work came and went, and the ETA with them
(median error 11% at N = 256, 16% at N = 4; within +-20% for 69% and 90% of the two N = 256 launches).

What it replaced: (1) a trailing-window rate (every job's updates over the last 60 s), which swung: 20:44, 8:06,
5:28, 4:59, 5:04 in five minutes of a BPTT run; (2) per-job speeds without start-up, which at N = 256 said 8:05 for
a launch of 16.5 minutes and 183 s left against 502 s into a resume (replayed on the recorded N = 256 launch: 55 to
70% short throughout): start-up and Ray's hand-over were half of every lane's time, and a new driver knew nothing.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from soma_cluster.jobs import ENDS, Event

TAU_S = 120.0  # the decay's time constant: a change in speed shows in the ETA within a few minutes
PRIOR_UPDATES = 50.0  # the weight of the campaign's speed in a job's own figure, in updates: five tiny-preset chunks
# (10: a job's noisy chunks move its ETA 1.8 times as much on the BPTT trace; 300: N = 4's median error 21%, not 16%)
FREES = frozenset((*ENDS, Event.FAILED, Event.PREEMPTED))  # the events after which a job's lane is free


@dataclass(frozen=True)
class Prior:
    """What stands in before any sample (the plan's prediction for one actor of this stage)."""

    startup_s: float  # wall seconds from a free lane to the job's first heartbeat, on a new actor
    update_s: float  # wall seconds per update after it
    reused_s: float | None = None  # the same on an idle actor (resources.reuse_actors); None: as a new one

    @staticmethod
    def of_plan(plan: Mapping, stage: str) -> Prior | None:
        """The plan's (plan/plan.json, soma_cluster/costmodel.py) for `stage` (seed, experts); None from a plan
        made before it said."""
        got = (plan.get("actor") or {}).get(stage)
        if not got:
            return None
        reused = got.get("reused_s")
        return Prior(float(got["startup_s"]), float(got["update_s"]), None if reused is None else float(reused))


@dataclass
class Decayed:
    """A ratio of two sums, each term decayed by exp(-age / tau_s) in the records' time: a recent mean."""

    tau_s: float
    num: float = 0.0
    den: float = 0.0
    t: float = -math.inf

    def add(self, t: float, num: float, den: float) -> None:
        if t > self.t:
            if self.den > 0:
                f = math.exp(-(t - self.t) / self.tau_s)
                self.num, self.den = self.num * f, self.den * f
            self.t = t
        self.num, self.den = self.num + num, self.den + den

    @property
    def value(self) -> float | None:
        return self.num / self.den if self.den > 0 else None


@dataclass
class Eta:
    """The estimator: fed the records as they are written (`record`), asked the time left (`seconds_left`)."""

    tau_s: float = TAU_S
    prior: Prior | None = None
    own: dict[str, Decayed] = field(default_factory=dict)  # job -> its own seconds per update
    update: Decayed = field(init=False)  # the campaign's seconds per update
    startup: Decayed = field(init=False)  # the campaign's start-up on a new actor, s
    reused: Decayed = field(init=False)  # ... on an idle actor (resources.reuse_actors), s
    _last: dict[str, tuple[int, float, int]] = field(default_factory=dict)  # job -> (attempt, t, step) last beat
    # job -> (attempt, t, on an idle actor) of its open attempt, asked of Ray (or given an idle actor) at t
    _queued: dict[str, tuple[int, float, bool]] = field(default_factory=dict)
    _frees: list[float] = field(default_factory=list)  # heap: times lanes were freed, not yet taken
    _first: set[str] = field(default_factory=set)  # jobs whose open attempt has made its first heartbeat
    samples: list[tuple[str, float, float, float]] | None = None  # if a list: every sample, (kind, t, num, den)

    def __post_init__(self) -> None:
        self.update, self.startup, self.reused = Decayed(self.tau_s), Decayed(self.tau_s), Decayed(self.tau_s)

    # -- what happened ----------------------------------------------------------------------------
    def record(self, rec: Mapping) -> None:
        """An event record (events.jsonl, or the driver's as it writes it): queued, heartbeat and ends count."""
        event, job, t = rec["event"], rec["job"], float(rec["t"])
        if event == Event.QUEUED:
            self.queued(job, int(rec.get("attempt") or 0), t, bool(rec.get("reused")))
        elif event == Event.HEARTBEAT:
            self.beat(job, int(rec.get("attempt") or 0), t, int(rec["step"]))
        elif event in FREES:
            self.ended(job, t)

    def queued(self, job: str, attempt: int, t: float, reused: bool = False) -> None:
        """An attempt of `job` was asked of Ray at `t` (`reused`: given an idle actor instead)."""
        self._queued[job] = (attempt, t, reused)
        self._first.discard(job)

    def ended(self, job: str, t: float) -> None:
        """The open attempt of `job` ended at `t` (finished, failed, preempted...): its lane is free."""
        if self._queued.pop(job, None) is not None:  # once per attempt (a failure then failed_permanently: one)
            heapq.heappush(self._frees, t)
        self._first.discard(job)

    def beat(self, job: str, attempt: int, t: float, step: int) -> None:
        """A heartbeat of `job`'s attempt at wall time `t` (s) that reached `step`."""
        prev = self._last.get(job)
        self._last[job] = (attempt, t, step)
        if prev is None or prev[0] != attempt:
            self._started(job, attempt, t)
            return
        if step <= prev[2] or t <= prev[1]:
            return  # a restart from a checkpoint, or a clock step back
        span, n = t - prev[1], step - prev[2]
        campaign = self.update.value
        self.update.add(t, span, n)
        if self.samples is not None:
            self.samples.append(("update", t, span, n))
        own = self.own.get(job)
        if own is None:  # a job new to the estimate starts as if it had made PRIOR_UPDATES at the campaign's speed
            own = self.own[job] = Decayed(self.tau_s)
            if campaign is not None:
                own.add(prev[1], PRIOR_UPDATES * campaign, PRIOR_UPDATES)
        own.add(t, span, n)

    def _started(self, job: str, attempt: int, t: float) -> None:
        """An attempt's first heartbeat: a start-up sample, from when its lane was free."""
        self._first.add(job)
        q = self._queued.get(job)
        queued_t = q[1] if q is not None and q[0] == attempt else None
        freed = heapq.heappop(self._frees) if self._frees and self._frees[0] <= t else None
        known = [x for x in (queued_t, freed) if x is not None]
        if known and max(known) <= t:
            kind = "reused" if q is not None and q[2] else "startup"
            getattr(self, kind).add(t, t - max(known), 1.0)
            if self.samples is not None:
                self.samples.append((kind, t, t - max(known), 1.0))

    def restart(self) -> None:
        """A new driver: what the history taught (speeds, start-ups) stays; its lanes and attempts are gone."""
        self._last.clear()
        self._queued.clear()
        self._frees.clear()
        self._first.clear()

    # -- what is left ---------------------------------------------------------------------------------
    def figures(self) -> tuple[float | None, float, float]:
        """(seconds per update, start-up s on a new actor, on an idle one) of a job yet to start: the samples',
        else the prior's; a reused start-up never seen nor planned is taken as a new one."""
        upd = self.update.value
        if upd is None and self.prior is not None:
            upd = self.prior.update_s
        start = self.startup.value
        if start is None:
            start = self.prior.startup_s if self.prior is not None else 0.0
        reused = self.reused.value
        if reused is None:
            reused = self.prior.reused_s if self.prior is not None and self.prior.reused_s is not None else start
        return upd, start, reused

    def speed(self, job: str, campaign: float) -> float:
        """The job's seconds per update: its own figure, else the campaign's."""
        own = self.own.get(job)
        return own.value if own is not None and own.value is not None else campaign

    def seconds_left(
        self,
        left: Mapping[str, int],
        running: set[str],
        lanes: int,
        now: float,
        caps_s: Mapping[str, float | None] | None = None,
        share: float = 1.0,
        most: int | None = None,
        reuse: bool = False,
    ) -> float | None:
        """Seconds from `now` until the last of the jobs in `left` (job -> updates to go, in the order they will
        start) ends, the `running` ones first, `lanes` at once; 0 with nothing left, None with no figure yet.
        `caps_s`: GPU-seconds a job may still spend (None: no cap), at `share` GPU-seconds per wall second: it stops
        at the update it cannot afford (the worker's rule), at its speed. `most`: jobs at once for those not yet
        asked of Ray (resources.max_actors: the driver asks for no more, and withdraws none already asked).
        `reuse`: a job that waits for a lane gets its idle actor (resources.reuse_actors)."""
        upd, start, reused = self.figures()
        if upd is not None and caps_s:
            left = {
                j: n if caps_s.get(j) is None else min(n, int(max(0.0, caps_s[j]) / (self.speed(j, upd) * share)))
                for j, n in left.items()
            }
        todo = {j: n for j, n in left.items() if n > 0}
        if not todo:
            return 0.0
        if upd is None:
            return None
        lanes = max(1, lanes)
        going = [j for j in todo if j in running and j in self._first]
        busy = sorted(max(0.0, todo[j] * self.speed(j, upd) - max(0.0, now - self._last[j][1])) for j in going)
        while len(busy) > lanes:  # more running than lanes: the first to end free none
            busy.pop(0)
        # the others: those asked of Ray (their set-up reported first), then those not yet asked
        asked = sorted((j for j in todo if j not in going and j in self._queued), key=lambda j: j not in running)
        later = [j for j in todo if j not in going and j not in self._queued]
        idle, frees = lanes - len(busy), sorted(self._frees)
        for k, j in enumerate(asked[:idle]):  # a lane in start-up since it was free, or since its job was queued
            q = self._queued[j]
            free_at = max(q[1], frees[k] if k < len(frees) else -math.inf)
            busy.append(max(0.0, free_at + (reused if q[2] else start) - now) + (todo[j] - 1) * upd)
        busy += [0.0] * (lanes - len(busy))  # lanes idle now: a job not yet asked of Ray starts in one at once
        heapq.heapify(busy)
        for j in asked[idle:] + later:  # each takes the first lane that frees; one not yet asked, within `most`
            while j in later and most is not None and len(busy) > max(1, most):
                heapq.heappop(busy)
            heapq.heappush(busy, heapq.heappop(busy) + (reused if reuse else start) + (todo[j] - 1) * upd)
        return max(busy)


# -- checked against what happened ---------------------------------------------------------------------------------
# what a trace keeps of events.jsonl (`launched`, at its actor's first instruction, for soma_cluster.costmodel)
TRACE_EVENTS = frozenset((Event.QUEUED, Event.LAUNCHED, Event.STARTED, Event.HEARTBEAT, *FREES))
RESTART = "driver"  # a trace's row for a driver (re)starting: `soma resume` after a lost driver


def trace_rows(events: list[Mapping], restarts: list[float] = ()) -> list[dict]:
    """A stage's events reduced to what the estimator reads, in time order: (t, event, job, attempt, step), with t
    in seconds from the first; `restarts`: when drivers (re)started (wall time), as RESTART rows."""
    rows = [
        {
            "t": float(e["t"]),
            "event": str(e["event"]),
            "job": e["job"],
            "attempt": int(e.get("attempt") or 0),
            "step": int(e.get("step") or 0),
        }
        for e in events
        if e["event"] in TRACE_EVENTS
    ]
    rows += [{"t": float(t), "event": RESTART, "job": "", "attempt": 0, "step": 0} for t in restarts]
    rows.sort(key=lambda r: r["t"])
    t0 = rows[0]["t"] if rows else 0.0
    return [{**r, "t": round(r["t"] - t0, 3)} for r in rows]


class Tick(NamedTuple):
    """The ETA at one moment of a replay."""

    t: float  # s from the trace's start
    eta_s: float | None  # what the driver would have shown
    left_s: float  # the truth: until the last job's end
    done: float  # progress, as the progress bar counts it: updates made over updates to make
    hindsight_s: float | None  # the same model given the start-up and speed of what came after (the machine's future)


def replay(
    rows: list[Mapping], target: int, lanes: int, tick_s: float, prior: Prior | None = None, reuse: bool = False
) -> list[Tick]:
    """The ETA the driver would have shown every `tick_s` over a trace (trace_rows), `lanes` at once, every job
    training to `target` updates (`reuse`: resources.reuse_actors), until the last job's end; and beside it the
    model's own error, apart from the machine's changes of speed: the same lanes with the mean start-up and seconds
    per update measured after."""
    end = max(r["t"] for r in rows if r["event"] in ENDS)
    jobs = list(dict.fromkeys(r["job"] for r in rows if r["job"]))  # in the order they start
    future = Eta(samples=[])
    for r in rows:
        future.restart() if r["event"] == RESTART else future.record(r)
    eta, step, running, ended = Eta(prior=prior), {}, set(), set()
    i, t, out = 0, 0.0, []
    while t < end:
        while i < len(rows) and rows[i]["t"] <= t:
            r = rows[i]
            if r["event"] == RESTART:
                eta.restart()
                running.clear()
            elif r["event"] == Event.STARTED:
                running.add(r["job"])
            elif r["event"] in FREES:
                running.discard(r["job"])
                ended.update([r["job"]] if r["event"] in ENDS else [])
            if r["event"] in (Event.STARTED, Event.HEARTBEAT):
                step[r["job"]] = r["step"]
            eta.record(r)
            i += 1
        left = {j: 0 if j in ended else target - step.get(j, 0) for j in jobs}
        done = sum(target - n for n in left.values()) / (target * len(jobs))
        got = eta.seconds_left(left, running, lanes, t, reuse=reuse)
        out.append(Tick(t, got, end - t, done, _hindsight(eta, future.samples, left, running, lanes, t)))
        t += tick_s
    return out


def _hindsight(eta: Eta, samples: list, left: dict, running: set, lanes: int, t: float) -> float | None:
    """What `eta` would say at `t` with the mean start-ups and speed of the samples after `t` (its lanes as they
    are; a figure with no sample after `t`: its own)."""
    sums = {"update": [0.0, 0.0], "startup": [0.0, 0.0], "reused": [0.0, 0.0]}
    for kind, at, num, den in samples:
        if at > t:
            sums[kind][0] += num
            sums[kind][1] += den
    if not sums["update"][1]:
        return None
    seer = Eta(tau_s=eta.tau_s, _last=eta._last, _queued=eta._queued, _frees=eta._frees, _first=eta._first)
    _, start, reused = eta.figures()
    seer.update.add(t, *sums["update"])
    seer.startup.add(t, *(sums["startup"] if sums["startup"][1] else (start, 1.0)))
    seer.reused.add(t, *(sums["reused"] if sums["reused"][1] else (reused, 1.0)))
    return seer.seconds_left(left, running, lanes, t, reuse=bool(sums["reused"][1]))
