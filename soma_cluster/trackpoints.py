"""Experiment tracking, the decisions (no Ray, no tracker library): where a campaign is tracked, what is logged
from its records, and which points a tracker already holds.

The campaign directory is the record; a tracker (MLflow, TensorBoard) is a view of it. Every point logged is
derived from the campaign's own records (events.jsonl, the ledger, campaign.yaml, eval/), by one `Feed` that the
driver runs on the records as it writes them and `soma track` runs on the whole record afterwards: the same
records make the same points, so a backfill logs exactly what a live run could not.

A point's identity is (run, key, step): one run for the campaign (`PARENT`) and one per job. A tracker is never
sent a step it holds: `Marks` keeps, per (run, key), the highest step logged (read back from the tracker when
it opens, so a resumed driver continues the same runs in order, and a retried expert's steps up to its old high
water are not logged again) and, for a backfill, every step it holds (so a gap in the middle is filled).
"""

from __future__ import annotations

import hashlib
import os
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from soma_cluster.config import CampaignConfig
from soma_cluster.envvars import value as env_value
from soma_cluster.errors import SomaError
from soma_cluster.jobs import (
    CATEGORIES,
    ENDS,
    EXPERT_SPEND,
    IN_FLIGHT,
    SEED_JOB,
    TERMINAL,
    Category,
    Event,
    JobState,
    advance,
    expert_name,
)

PARENT = "campaign"  # the campaign's own run; each job's run is named after the job (seed, expert-0007)
TAG = "soma."  # prefix of every tag soma sets (soma.campaign finds a campaign's runs again)
SEED_SPEND = (Category.SEED, Category.WASTED, Category.PREEMPTED)  # the seed job's GPU-seconds by category
PIP_HINT = "pip install 'soma-cluster[tracking]'"


class Backend(StrEnum):
    MLFLOW = "mlflow"
    TENSORBOARD = "tensorboard"


class Source(StrEnum):
    """Which campaign log a record comes from."""

    EVENTS = "events"
    LEDGER = "ledger"


class Stage(StrEnum):
    PREPARE = "prepare"
    SEED = "seed"
    LAUNCH = "launch"
    EVAL = "eval"


# -- where ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    """Where a campaign is tracked, resolved from its config and the environment."""

    backends: tuple[Backend, ...]
    mlflow_uri: str | None
    experiment: str
    tensorboard_dir: str | None


def absolute_url(url: str) -> str:
    """A campaign's URL as a tracker's tag keeps it: a local path made absolute (a relative one, as typed, names
    nothing from another directory or machine), an object store's URL as it is."""
    if "://" in url and not url.startswith("file://"):
        return url.rstrip("/")
    return os.path.abspath(os.path.expanduser(url.removeprefix("file://")))


def dir_name(url: str) -> str:
    """The campaign directory's own name (runs/c1 and s3://b/p/c1 are both `c1`): its runs' names in a tracker."""
    return os.path.basename(absolute_url(url).rstrip("/")) or url


def named(cfg: CampaignConfig) -> bool:
    """Whether the campaign's name is its own, not only its preset's (`tiny`) or the default."""
    return cfg.name not in (cfg.preset, "campaign")


def default_experiment(cfg: CampaignConfig, url: str | None) -> str:
    """The tracker experiment a campaign goes to when nothing names one: its name when a person gave it one
    (--set name=...), else its directory's name; a preset's name would put every campaign of it in one pile."""
    return cfg.name if named(cfg) or url is None else dir_name(url)


def resolve_target(
    cfg: CampaignConfig,
    local_root: str | None,
    env: Mapping[str, str] = os.environ,
    experiment: str | None = None,
    url: str | None = None,
) -> Target:
    """A value set in the config (campaign.yaml, --set) wins; an unset one is taken from the tool's environment
    variable (MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_NAME, TENSORBOARD_LOGDIR; the backends from
    SOMA_TRACKING_BACKENDS, e.g. "mlflow,tensorboard", when tracking.backends is empty), else its default. `local_root`:
    the campaign's directory when it is local (TensorBoard's default log dir is under it), else None.
    `experiment`: the default experiment name when neither sets one (`soma experiment` names its arms'), else
    `default_experiment` of the campaign's `url`."""
    t = cfg.tracking
    names = list(t.backends) or list(env_value("SOMA_TRACKING_BACKENDS", env) or ())  # the registry checks them
    backends = tuple(dict.fromkeys(Backend(b) for b in names))
    uri = t.mlflow_uri or env.get("MLFLOW_TRACKING_URI") or None
    name = t.experiment or env.get("MLFLOW_EXPERIMENT_NAME") or experiment or default_experiment(cfg, url)
    logdir = t.tensorboard_dir or env.get("TENSORBOARD_LOGDIR") or None
    if Backend.MLFLOW in backends and not uri:
        raise SomaError(
            "tracking.backends holds mlflow but no tracking URI is set; set MLFLOW_TRACKING_URI=http://HOST:5000 "
            "or pass --set tracking.mlflow_uri=URI"
        )
    if Backend.MLFLOW in backends and (uri.startswith("file:") or "://" not in uri):
        raise SomaError(
            f"MLflow tracking URI {uri!r} is a file store, which MLflow 3 no longer writes to; run a tracking server "
            f"(mlflow server --backend-store-uri sqlite:///mlflow.db) and pass its http://HOST:PORT"
        )
    if Backend.TENSORBOARD in backends and not logdir:
        if local_root is None:
            raise SomaError(
                "tracking.backends holds tensorboard and the campaign is not local; set TENSORBOARD_LOGDIR=DIR "
                "or pass --set tracking.tensorboard_dir=DIR"
            )
        logdir = os.path.join(local_root, "tensorboard")
    if Backend.TENSORBOARD in backends and "://" in logdir:
        raise SomaError(
            f"TensorBoard log dir {logdir!r} is not a local directory; soma writes its event files on a local file "
            f"system (a rewrite renames them in place): set TENSORBOARD_LOGDIR or tracking.tensorboard_dir to a "
            f"local path, and sync it to {logdir} if TensorBoard reads from there"
        )
    return Target(backends, uri, name, logdir)


# -- what ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Metric:
    run: str
    key: str
    step: int
    value: float
    t: float  # wall clock (s) of the record it came from


@dataclass(frozen=True)
class Tag:
    run: str
    key: str
    value: str


@dataclass(frozen=True)
class Params:
    """A run's parameters (the campaign's config on its parent run; on a job's, what trains it): set once, never
    changed."""

    values: dict[str, str]
    run: str = PARENT


@dataclass(frozen=True)
class Artifact:
    """A file of the campaign attached to its parent run, under `name`."""

    name: str
    data: bytes

    @property
    def sha(self) -> str:
        return hashlib.sha256(self.data).hexdigest()


class Status(StrEnum):
    """A run's status, in MLflow's words (TensorBoard has none)."""

    SCHEDULED = "SCHEDULED"  # pending: reopened (or not started), waiting for a driver to queue it
    RUNNING = "RUNNING"
    FINISHED = "FINISHED"
    FAILED = "FAILED"
    KILLED = "KILLED"  # stopped before it ended (a signal, a lost lease, a driver that raised): resume reopens it


def job_status(state: JobState) -> Status:
    """A job's state (soma status's word for it) as its run's status, so the two never disagree: pending SCHEDULED,
    in flight RUNNING, interrupted (its driver stopped with it in flight) KILLED, failed_permanently FAILED, every
    other end FINISHED."""
    if state == JobState.FAILED_PERMANENTLY:
        return Status.FAILED
    if state in TERMINAL:
        return Status.FINISHED
    if state == JobState.INTERRUPTED:
        return Status.KILLED
    return Status.SCHEDULED if state == JobState.PENDING else Status.RUNNING


@dataclass(frozen=True)
class RunState:
    """A run's status changes: a job that starts (again: a resume, a retry after `--retry-failed`) is RUNNING, one
    that ends FINISHED or FAILED, one its driver left in flight KILLED; the campaign's run likewise per command."""

    run: str
    status: Status


Point = Metric | Tag | Params | Artifact | RunState


def flatten(tree: Mapping, prefix: str = "") -> dict[str, str]:
    """{"train": {"updates": 12}} -> {"train.updates": "12"}: a config as tracker parameters."""
    out: dict[str, str] = {}
    for k, v in tree.items():
        if isinstance(v, Mapping):
            out |= flatten(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = str(v)
    return out


@dataclass(frozen=True)
class Fork:
    """Where a forked campaign came from (its fork.json): the parent's URL and, if it was tracked, its key."""

    url: str
    key: str | None = None


def campaign_points(
    cfg: CampaignConfig, key: str, url: str, versions: Mapping[str, str], fork: Fork | None = None
) -> list[Point]:
    """The parent run's parameters (the config, its digest, versions) and the tags a person filters by; `url` is
    made absolute. A fork's run names its parent's (`soma.forked_from`: the parent campaign's URL;
    `soma.forked_from_campaign`: its key, which an MLflow sink turns into `soma.forked_from_run`)."""
    params = flatten(cfg.model_dump(mode="json", exclude={"tracking": True}))
    params |= {"config_digest": cfg.digest(), **{f"version.{k}": str(v) for k, v in versions.items()}}
    tags = {"campaign": key, "campaign_id": cfg.digest()[:8], "url": absolute_url(url), "name": cfg.name}
    tags |= {"preset": cfg.preset, "n_experts": str(cfg.n_experts), "role": "campaign", "dir": dir_name(url)}
    if fork is not None:
        tags["forked_from"] = absolute_url(fork.url)
        tags |= {"forked_from_campaign": fork.key} if fork.key else {}
    return [Params(params)] + [Tag(PARENT, TAG + k, v) for k, v in tags.items()]


def job_params(cfg: CampaignConfig, shards: Mapping | None = None) -> dict[str, dict[str, str]]:
    """Each job's run parameters: what trains it (the model, its stage's schedule and method, its budget, retries
    and resources), its expert index and, from shards/manifest.json, its shard's train and validation rows. The
    campaign's whole config stays on the parent run."""
    tree = cfg.model_dump(mode="json")
    common = {"model": tree["model"], "resources": tree["resources"], "seed": tree["seed"]}
    common["config_digest"] = cfg.digest()
    seed = flatten({**common, "seed_stage": tree["seed_stage"]})
    method = cfg.train.method  # its section: spsa, eggroll or bptt
    expert = {**common, "train": tree["train"], method: tree[method]}
    expert = flatten({**expert, "budget": tree["budget"], "retry": tree["retry"]})
    out = {SEED_JOB.name: {**seed, "job": SEED_JOB.name}}
    rows = {k: (shards or {}).get(k) or [] for k in ("train_rows", "val_rows")}
    for e in range(cfg.n_experts):
        own = {"job": expert_name(e), "expert": str(e)}
        own |= {f"shard.{k}": str(v[e]) for k, v in rows.items() if e < len(v)}
        out[expert_name(e)] = {**expert, **own}
    return out


def stage_point(stage: Stage, state: str) -> Tag:
    return Tag(PARENT, f"{TAG}stage.{stage}", state)


def campaign_status(state: str, failed: bool) -> Status:
    """The campaign run's status as a command leaves it: RUNNING while one works on it; FINISHED when it finished
    (FAILED when an expert ended failed_permanently); KILLED when it stopped before its jobs ended."""
    if state == "running":
        return Status.RUNNING
    if state == "stopped":
        return Status.KILLED
    return Status.FAILED if failed else Status.FINISHED


def job_of(rec: dict) -> str | None:
    """The job a ledger record's GPU-seconds belong to (None: the campaign's own, preprocessing or evaluation)."""
    if rec.get("expert") is not None:
        return expert_name(rec["expert"])
    return SEED_JOB.name if rec["category"] in SEED_SPEND else None


@dataclass
class Money:
    """A ledger's GPU-seconds and dollars by category, as Ledger.totals counts them: a record's dollars at the price
    it was written with; one written without a price counts in `unpriced_s`, never as $0 silently."""

    gpu_s: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    usd: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    unpriced_s: float = 0.0
    priced: bool = False  # a record carried a price: dollars are shown (and what had none, as unpriced)

    def add(self, rec: dict) -> None:
        self.gpu_s[rec["category"]] += rec["gpu_seconds"]
        price = rec.get("usd_per_hour")
        if price is None:
            self.unpriced_s += rec["gpu_seconds"]
        else:
            self.priced = True
            self.usd[rec["category"]] += rec["gpu_seconds"] / 3600.0 * price

    def values(self, categories: Iterable[str], priced: bool) -> dict[str, float]:
        """`gpu_hours/<category>`, and where the campaign is priced `usd/<category>` and `unpriced_gpu_hours`."""
        out = {f"gpu_hours/{c}": self.gpu_s[c] / 3600.0 for c in categories}
        if priced:
            out |= {f"usd/{c}": self.usd[c] for c in categories} | {"unpriced_gpu_hours": self.unpriced_s / 3600.0}
        return out


@dataclass
class Feed:
    """Campaign records in, tracker points out. Keeps what the points need from earlier records: each job's
    GPU-seconds and dollars by category, its counted failures and preemptions, its highest step, its state (folded
    through the jobs' one state machine, as soma status folds it: its tag and its run's status change together), the
    campaign's totals. `params`: each job's run parameters, sent with its first heartbeat."""

    money: dict[str, Money] = field(default_factory=lambda: defaultdict(Money))  # job -> what it spent
    totals: Money = field(default_factory=Money)
    retries: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    preemptions: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    high: dict[str, int] = field(default_factory=dict)  # job -> the highest step of its heartbeats
    params: Mapping[str, dict[str, str]] = field(default_factory=dict)  # job -> its run's parameters (job_params)
    ends: dict[str, JobState] = field(default_factory=dict)  # job -> how it last ended
    states: dict[str, JobState] = field(default_factory=dict)  # job -> where it stands (jobs.advance)
    ended: int = 0  # job ends seen: the step of jobs_ended
    last_t: float = 0.0  # wall clock (s) of the newest record seen: the time of the points no record carries
    evals: int = 0  # evaluations in the ledger: the step of the eval metrics
    _ledger_ids: set[str] = field(default_factory=set)
    _params_sent: set[str] = field(default_factory=set)  # jobs whose parameters went out (Marks drops a repeat)

    @property
    def running(self) -> set[str]:
        """Jobs in flight (queued, running, retrying, preempted): their runs are RUNNING until an end or a stop."""
        return {j for j, s in self.states.items() if s in IN_FLIGHT}

    def gpu_s(self, job: str) -> dict[str, float]:
        return self.money[job].gpu_s

    def on_record(self, source: Source, rec: dict) -> list[Point]:
        self.last_t = max(self.last_t, rec.get("t") or 0.0)
        return self._ledger(rec) if source == Source.LEDGER else self._event(rec)

    def _ledger(self, rec: dict) -> list[Point]:
        rid = rec.get("id")
        if rid in self._ledger_ids:  # a replayed write is counted once, as Ledger.records does
            return []
        self._ledger_ids.add(rid)
        job = job_of(rec)
        if job is not None:
            self.money[job].add(rec)
        self.totals.add(rec)
        if rec["category"] == Category.EVALUATION:
            self.evals += 1
        return []

    def _state(self, job: str, state: JobState) -> list[Point]:
        """The job's state tag and its run's status, together, when the state changed."""
        if self.states.get(job) == state:
            return []
        self.states[job] = state
        return [Tag(job, TAG + "state", state), RunState(job, job_status(state))]

    def _event(self, rec: dict) -> list[Point]:
        job, ev, t = rec["job"], rec["event"], rec.get("t", 0.0)
        if job == PARENT:  # the campaign's own events (forked, config_revised): no job's state
            return []
        if ev == Event.HEARTBEAT:
            return self._heartbeat(job, rec, t)
        if ev in ENDS:
            return self._end(job, JobState(ev), t)
        out = self._state(job, advance(self.states.get(job, JobState.PENDING), ev, rec.get("cause")))
        if ev == Event.FAILED:
            self.retries[job] += 1 if rec.get("counted", True) else 0
            out.append(Tag(job, TAG + "retries", str(self.retries[job])))
        if ev == Event.PREEMPTED:
            self.preemptions[job] += 1
            out.append(Tag(job, TAG + "preemptions", str(self.preemptions[job])))
        return out

    def _heartbeat(self, job: str, rec: dict, t: float) -> list[Point]:
        step = int(rec["step"])
        self.high[job] = max(self.high.get(job, -1), step)
        values = {"train_loss": rec.get("loss"), "val_loss": rec.get("val"), "eps": rec.get("eps"), "lr": rec.get("lr")}
        values["gpu_hours"] = sum(self.gpu_s(job).values()) / 3600.0
        out: list[Point] = [Metric(job, k, step, float(v), t) for k, v in values.items() if v is not None]
        if job in self.params and job not in self._params_sent:  # with its first points: one write for both
            self._params_sent.add(job)
            out.insert(0, Params(dict(self.params[job]), job))
        return out

    def _end(self, job: str, state: JobState, t: float) -> list[Point]:
        """A job's end: its GPU-hours (and dollars, where priced) by category, retries and preemptions at its highest
        step; the campaign's totals (campaign_totals)."""
        step = self.high.get(job, 0)
        cats = SEED_SPEND if job == SEED_JOB.name else EXPERT_SPEND
        values = self.money[job].values(cats, self.totals.priced)
        values |= {"retries": self.retries[job], "preemptions": self.preemptions[job], "final_step": step}
        out: list[Point] = [Metric(job, k, step, float(v), t) for k, v in values.items()]
        out += self._state(job, state)
        self.ends[job] = state
        self.ended += 1
        return out + [Metric(PARENT, "jobs_ended", self.ended, float(self.ended), t)] + self.campaign_totals(t)

    def campaign_totals(self, t: float) -> list[Point]:
        """The campaign run's GPU-hours and dollars by category, their totals and the unpriced GPU-hours, as the
        ledger's totals hold them at this record (step: the ledger records seen, so a later record's totals are a
        later step): at each job end and each command's end, so the last point of each is the ledger's total."""
        values = self.totals.values(CATEGORIES, self.totals.priced)
        values["gpu_hours_total"] = sum(self.totals.gpu_s.values()) / 3600.0
        if self.totals.priced:
            values["usd_total"] = sum(self.totals.usd.values())
        return [Metric(PARENT, k, len(self._ledger_ids), float(v), t) for k, v in values.items()]

    def interrupted(self) -> list[Point]:
        """The jobs a stopped driver left in flight: `interrupted` (as soma status shows them), their runs KILLED (a
        resume starts them again)."""
        return [p for j in sorted(self.running) for p in self._state(j, JobState.INTERRUPTED)]

    def stage(self, stage: Stage, state: str) -> list[Point]:
        """A command's stage begins (`running`) or ends (`finished`, `stopped`): its tag and the campaign run's
        status; at an end, the campaign's totals; a stop also closes the runs of the jobs it left in flight."""
        failed = any(s == JobState.FAILED_PERMANENTLY for s in self.ends.values())
        out: list[Point] = [stage_point(stage, state), RunState(PARENT, campaign_status(state, failed))]
        if state != "running" and self._ledger_ids:
            out += self.campaign_totals(self.last_t)
        return out + (self.interrupted() if state == "stopped" else [])

    def evaluation(self, m: Mapping, t: float) -> list[Point]:
        """`soma eval`'s ensemble, seed and uniform nats/byte with their 95% intervals, the baselines' nats/byte and
        the busiest expert's share of the windows, at the evaluation's count in the ledger (a later evaluation is a
        later step)."""
        values: dict[str, float] = {}
        for who in ("ensemble", "seed", "uniform"):
            s = m.get(who) or {}
            if s.get("nats_per_byte") is not None:
                values[f"eval/{who}_nats_per_byte"] = s["nats_per_byte"]
            for bound, v in zip(("lo", "hi"), s.get("ci95") or (), strict=False):
                values[f"eval/{who}_ci95_{bound}"] = v
        d = m.get("ensemble_minus_seed") or {}
        if d.get("nats_per_byte") is not None:
            values["eval/ensemble_minus_seed"] = d["nats_per_byte"]
        base = m.get("baselines") or {}  # the baselines on the same windows (soma_cluster/breakdown.py)
        for who in ("best_single", "oracle", "uniform_mixture"):
            if (base.get(who) or {}).get("nats_per_byte") is not None:
                values[f"eval/{who}_nats_per_byte"] = base[who]["nats_per_byte"]
        if (m.get("routing_load") or {}).get("max_share") is not None:
            values["eval/routing_max_share"] = m["routing_load"]["max_share"]
        step = max(self.evals, 1)
        return [Metric(PARENT, k, step, float(v), t) for k, v in values.items()]


def merged(events: Iterable[dict], ledger: Iterable[dict]) -> Iterator[tuple[Source, dict]]:
    """The two logs in the order the driver wrote them (by time; a ledger record before the event of the same
    instant, as the scheduler writes a heartbeat's record before its event)."""
    tagged = [(r.get("t", 0.0), 0, i, Source.LEDGER, r) for i, r in enumerate(ledger)]
    tagged += [(r.get("t", 0.0), 1, i, Source.EVENTS, r) for i, r in enumerate(events)]
    for _, _, _, source, rec in sorted(tagged, key=lambda x: x[:3]):
        yield source, rec


# -- what a tracker holds ------------------------------------------------------------------------------------
@dataclass
class Marks:
    """What one tracker already holds, so no point is sent twice. `high`: per (run, key) the highest step
    logged; `known`: every step logged (read for a backfill only; None: not read, only `high` counts)."""

    high: dict[tuple[str, str], int] = field(default_factory=dict)
    known: dict[tuple[str, str], set[int]] | None = None
    tags: dict[tuple[str, str], str] = field(default_factory=dict)
    params: set[tuple[str, str]] = field(default_factory=set)  # (run, key) logged
    artifacts: dict[str, str] = field(default_factory=dict)  # name -> sha256 of what was attached
    kinds: tuple[type, ...] = (Metric, Tag, Params, Artifact, RunState)  # what the tracker keeps (others: not sent)
    params_whole: set[str] | None = None  # runs that took their parameters once, as a whole (TensorBoard's text)

    def admit(self, points: Iterable[Point]) -> list[Point]:
        """The points the tracker does not hold yet, in order; they are then taken as held."""
        out: list[Point] = []
        for p in points:
            if not isinstance(p, self.kinds):
                continue
            if isinstance(p, Params):  # a tracker refuses a parameter changed: only those never logged
                if self.params_whole is not None:
                    if p.run not in self.params_whole:
                        self.params_whole.add(p.run)
                        out.append(p)
                    continue
                fresh = {k: v for k, v in p.values.items() if (p.run, k) not in self.params}
                self.params |= {(p.run, k) for k in fresh}
                out += [Params(fresh, p.run)] if fresh else []
            elif self._new(p):
                out.append(p)
        return out

    def _new(self, p: Point) -> bool:
        if isinstance(p, Metric):
            k = (p.run, p.key)
            hi = self.high.get(k, -1)
            if p.step > hi:
                self.high[k] = p.step
                if self.known is not None:
                    self.known.setdefault(k, set()).add(p.step)
                return True
            steps = self.known.get(k) if self.known is not None else None
            if steps is None or p.step in steps:
                return False
            steps.add(p.step)  # a gap below the high water: only a backfill (known read back) fills it
            return True
        if isinstance(p, Tag):
            if self.tags.get((p.run, p.key)) == p.value:
                return False
            self.tags[(p.run, p.key)] = p.value
            return True
        if isinstance(p, Artifact):
            if self.artifacts.get(p.name) == p.sha:
                return False
            self.artifacts[p.name] = p.sha
            return True
        status = (p.run, "")  # a run's status, among its tags under an empty key
        if self.tags.get(status) == p.status:
            return False
        self.tags[status] = p.status
        return True


def settled(points: list[Point]) -> list[Point]:
    """A replay's points with each tag and run status at its last value only: a tracker holding a job's `finished`
    is not told `running` again on the way (the live stream after it carries every change)."""
    last: dict[tuple, int] = {}
    for i, p in enumerate(points):
        if isinstance(p, Tag):
            last[("tag", p.run, p.key)] = i
        elif isinstance(p, RunState):
            last[("status", p.run)] = i
    keep = set(last.values())
    return [p for i, p in enumerate(points) if i in keep or not isinstance(p, (Tag, RunState))]


@dataclass
class Gap:
    """Points a tracker never got (a queue full, a batch that failed its retries): counted, and per run the
    step range they span, for the line that says what `soma track` will fill."""

    dropped: int = 0
    runs: dict[str, list[int]] = field(default_factory=dict)  # run -> [first step, last step] of its metrics

    def add(self, points: Iterable[Point]) -> None:
        for p in points:
            self.dropped += 1
            if isinstance(p, Metric):
                lo, hi = self.runs.get(p.run, [p.step, p.step])
                self.runs[p.run] = [min(lo, p.step), max(hi, p.step)]

    def line(self, backend: str, url: str) -> str:
        spans = ", ".join(f"{r} steps {lo}-{hi}" for r, (lo, hi) in sorted(self.runs.items())[:6])
        more = f" and {len(self.runs) - 6} more runs" if len(self.runs) > 6 else ""
        return (
            f"tracking: {backend} missed {self.dropped} points ({spans or 'no metrics'}{more}); the campaign's record "
            f"holds them; to fill the gap run: soma track {url}"
        )
