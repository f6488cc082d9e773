"""What `soma status` says about N experts in one screen, whatever N is: the experts counted apart from the seed,
those that need attention and why, and the selections `--state` and `--expert` make. No Ray and no layout here
(pipelines/status.py lays it out): rows are status.json's (soma_cluster/snapshot.py).

Summarise first, list on request, as squeue (`-t/--states` and `-j/--jobs` take comma lists), `sky status`
(a table that names how many it left out) and `ray status` (counts by kind, then the demands) do.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass
from enum import StrEnum

from soma_cluster.errors import SomaError
from soma_cluster.jobs import IN_FLIGHT, SEED_JOB, STATES, TERMINAL, JobState, expert_name


class Concern(StrEnum):
    """Why an expert is on the summary's short list, most urgent first."""

    FAILED = "failed"  # failed_permanently: its retries are spent
    SILENT = "silent"  # running, but no heartbeat for a quarter of retry.heartbeat_timeout_s
    RETRYING = "retrying"  # failed (or was preempted) and is being run again
    OVER_BUDGET = "over budget"  # stopped by its budget, at its cap, or past it
    SLOW = "slow"  # running at 1.5 x the median GPU-seconds per update or more
    INTERRUPTED = "interrupted"  # its driver stopped: nothing runs it until soma resume


CONCERNS = tuple(Concern)
SLOW_FACTOR = 1.5  # GPU-seconds per update over the median that flags an expert as slow
SLOW_MIN_DONE = 0.25  # judged only past this share of its target: start-up would inflate an early rate
SLOW_MIN_MEASURED = 3  # a median of fewer experts says nothing
SILENT_SHARE = 0.25  # of retry.heartbeat_timeout_s without a heartbeat (the watchdog stops it at the whole)


@dataclass(frozen=True)
class Limits:
    """What the rules measure against: the config in force (soma_cluster/config.py)."""

    max_retries: int
    heartbeat_timeout_s: float
    expert_gpu_hours: float | None  # budget.expert_gpu_hours (None: no cap)


@dataclass(frozen=True)
class Flag:
    """One expert that needs attention: which, the rule that flagged it, and a short reason."""

    job: str
    concern: Concern
    why: str

    def as_dict(self) -> dict:
        return {"job": self.job, "concern": str(self.concern), "why": self.why}


def _experts(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r.get("expert") is not None]


def _rate(r: dict) -> float | None:
    """GPU-seconds per update (start-up and lost attempts included), once past SLOW_MIN_DONE of its target."""
    if r["step"] <= 0 or r["step"] < SLOW_MIN_DONE * r["target"]:
        return None
    return r["gpu_hours"] * 3600.0 / r["step"]


def _error(r: dict) -> str:
    return r.get("last_error") or "no error recorded"


def _flag(r: dict, lim: Limits, median: float | None) -> Flag | None:
    """The most urgent concern about one expert, or None."""
    state, job = r["state"], r["job"]
    if state == JobState.FAILED_PERMANENTLY:
        return Flag(job, Concern.FAILED, _error(r))
    age = r.get("heartbeat_age_s")
    if state == JobState.RUNNING and age is not None and age >= SILENT_SHARE * lim.heartbeat_timeout_s:
        return Flag(job, Concern.SILENT, f"silent {age:.0f} s (stopped at {lim.heartbeat_timeout_s:.0f} s)")
    if state == JobState.RETRYING:
        return Flag(job, Concern.RETRYING, f"retry {r['retries']}/{lim.max_retries}: {_error(r)}")
    if state == JobState.PREEMPTED:
        return Flag(job, Concern.RETRYING, f"rescheduled, no retry spent: {_error(r)}")
    cap = lim.expert_gpu_hours
    if state == JobState.BUDGET_EXHAUSTED:
        return Flag(job, Concern.OVER_BUDGET, "stopped by its budget")
    if cap is not None and r["gpu_hours"] > cap:
        return Flag(job, Concern.OVER_BUDGET, f"over its cap of {cap:g} GPU-h")
    if state not in TERMINAL and r.get("budget_left_gpu_hours") == 0.0:
        return Flag(job, Concern.OVER_BUDGET, f"at its cap, {r['target'] - r['step']} updates to go")
    rate = _rate(r)
    if state == JobState.RUNNING and median and rate is not None and rate >= SLOW_FACTOR * median:
        return Flag(job, Concern.SLOW, f"slow: {rate:.3g} GPU-s/update, {rate / median:.1f}x the median")
    if state == JobState.INTERRUPTED:
        return Flag(job, Concern.INTERRUPTED, "its driver stopped (soma resume)")
    return None


def attention(rows: list[dict], lim: Limits) -> list[Flag]:
    """The experts that need attention, most urgent concern first, then (slow ones) slowest first, then by name."""
    rates = [x for r in _experts(rows) if (x := _rate(r)) is not None]
    median = statistics.median(rates) if len(rates) >= SLOW_MIN_MEASURED else None
    flags = [f for r in _experts(rows) if (f := _flag(r, lim, median)) is not None]
    by_job = {r["job"]: r for r in rows}

    def order(f: Flag) -> tuple:
        rate = _rate(by_job[f.job]) if f.concern == Concern.SLOW else 0.0
        return CONCERNS.index(f.concern), -(rate or 0.0), f.job

    return sorted(flags, key=order)


def experts_view(rows: list[dict]) -> dict:
    """The experts apart from the seed: how many, `counts` by state, how many of the queued ones are `starting` (their
    actor holds its GPU share and is starting up: they take a GPU as running ones do; a retry starting stays
    `retrying`), updates done of the target, and the seed's state (None: no seed row)."""
    experts = _experts(rows)
    seed = next((r["state"] for r in rows if r["job"] == SEED_JOB.name), None)
    return {
        "n": len(experts),
        "counts": {s: n for s in STATES if (n := sum(r["state"] == s for r in experts))},
        "starting": sum(bool(r.get("starting")) and r["state"] == JobState.QUEUED for r in experts),
        "ended": sum(r["state"] in TERMINAL for r in experts),
        "updates": sum(min(r["step"], r["target"]) for r in experts),
        "target": sum(r["target"] for r in experts),
        "seed": seed,
    }


def experts_text(view: dict) -> str:
    """'4 running (1 starting), 52/256 ended (50 finished, 2 failed_permanently), 198 queued': a starting expert counts
    as running (it holds a GPU), not as queued; the seed is never among them."""
    counts, starting = dict(view["counts"]), view["starting"]
    moved = min(starting, counts.get(JobState.QUEUED, 0))
    running = counts.pop(JobState.RUNNING, 0) + moved
    counts[JobState.QUEUED] = counts.get(JobState.QUEUED, 0) - moved
    parts = [f"{running} running" + (f" ({moved} starting)" if moved else "")] if running else []
    how = ", ".join(f"{n} {s}" for s, n in counts.items() if s in TERMINAL and n)
    parts.append(f"{view['ended']}/{view['n']} ended" + (f" ({how})" if how else ""))
    parts += [f"{n} {s}" for s, n in counts.items() if s not in TERMINAL and n]
    return ", ".join(parts)


def ranges(numbers: list[int]) -> str:
    """Expert numbers as runs: [0, 1, 2, 3, 7, 12, 13] -> '0-3, 7, 12-13' (what --expert takes)."""
    out, nums = [], sorted(set(numbers))
    i = 0
    while i < len(nums):
        j = i
        while j + 1 < len(nums) and nums[j + 1] == nums[j] + 1:
            j += 1
        out.append(str(nums[i]) if i == j else f"{nums[i]}-{nums[j]}")
        i = j + 1
    return ", ".join(out)


# -- selections: --state and --expert ----------------------------------------------------------------------------
ALIASES = {
    "failed": (JobState.FAILED_PERMANENTLY,),
    "ended": TERMINAL,
    "active": IN_FLIGHT,
    "all": STATES,
}


def parse_states(text: str) -> tuple[JobState, ...]:
    """'failed,retrying' -> the states named (case-insensitive; a state's name or an alias in ALIASES), in STATES
    order. ValueError naming the first word that is neither."""
    words = [w.strip().lower().replace("-", "_") for w in text.split(",")]
    if not any(words):
        raise ValueError(f"{text!r} names no state")
    chosen: set[str] = set()
    for w in words:
        if w in ALIASES:
            chosen.update(ALIASES[w])
        elif w in STATES:
            chosen.add(w)
        else:
            raise ValueError(f"{w!r} is not a job state")
    return tuple(s for s in STATES if s in chosen)


_ONE = r"(?:expert-)?(\d{1,9})"
_ITEM = re.compile(rf"{_ONE}(?:\s*-\s*{_ONE})?")


@dataclass(frozen=True)
class JobSelection:
    """What --expert names: expert numbers as closed ranges, and the seed."""

    spans: tuple[tuple[int, int], ...]
    seed: bool = False

    def names(self, n_experts: int) -> list[str]:
        """The job names selected, in campaign order (seed first); SomaError for a number past the campaign's."""
        top = max((hi for _, hi in self.spans), default=-1)
        if top >= n_experts:
            last = expert_name(n_experts - 1) if n_experts else "none"
            raise SomaError(
                f"--expert {top}: this campaign has {n_experts} experts (0-{n_experts - 1}: expert-0000 to {last}); "
                "name one of them, e.g. --expert 0-3,7"
            )
        picked = sorted({e for lo, hi in self.spans for e in range(lo, hi + 1)})
        return ([SEED_JOB.name] if self.seed else []) + [expert_name(e) for e in picked]


def parse_jobs(text: str) -> JobSelection:
    """'7,12-15,expert-0020,seed' -> a JobSelection. ValueError naming the first item that is not a number, a range
    lo-hi with lo <= hi, an expert's name or `seed`."""
    items = [x.strip().lower() for x in text.split(",")]
    if not any(items):
        raise ValueError(f"{text!r} names no expert")
    spans, seed = [], False
    for item in items:
        if item == SEED_JOB.name:
            seed = True
            continue
        m = _ITEM.fullmatch(item)
        if m is None:
            raise ValueError(f"{item!r} is not an expert number, range or name")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if hi < lo:
            raise ValueError(f"{item!r} is a range that runs backwards")
        spans.append((lo, hi))
    return JobSelection(tuple(spans), seed)


def ranges_within(numbers: list[int], room: int) -> str:
    """ranges(numbers) in at most `room` characters: the first runs, then '+k more' for the k experts left out; where
    not even one run fits beside that, 'N experts' (or N)."""
    runs = ranges(numbers).split(", ") if numbers else []
    text = ", ".join(runs)
    if len(text) <= room:
        return text
    total = len(set(numbers))
    kept, count = [], 0
    for run in runs:
        lo, _, hi = run.partition("-")
        size = int(hi or lo) - int(lo) + 1
        if len(", ".join(kept + [run, f"+{total - count - size} more"])) > room:
            break
        kept.append(run)
        count += size
    if kept:
        return ", ".join(kept + [f"+{total - count} more"])
    return f"{total} experts" if len(f"{total} experts") <= room else str(total)
