"""`soma status`: every job's state from the snapshot the driver keeps (`status.json`, one small read even for 256
experts), or, for a campaign written before snapshots existed, rebuilt from its events log and ledger.
After a campaign that was planned (`soma plan`), predicted GPU-hours and wall time stand beside the ledger's."""

from __future__ import annotations

import io
import os
import sys
import time
from dataclasses import dataclass
from enum import StrEnum

from rich.console import Console, Group
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from pipelines.common import emit_json, load_config, out
from soma_cluster.campaignfile import CONFIG_FILE
from soma_cluster.config import CampaignConfig
from soma_cluster.costmodel import PLAN
from soma_cluster.errors import SomaError
from soma_cluster.events import history
from soma_cluster.jobs import EXPERT_SPEND, TERMINAL, Category, Event, JobState
from soma_cluster.lease import LEASE, Holder, LeaseRecord, Verdict, judge, process_alive
from soma_cluster.ledger import Ledger
from soma_cluster.revisions import revisions
from soma_cluster.snapshot import (
    SNAPSHOT,
    budget_view,
    build,
    fmt_duration,
    fmt_span,
    history_rows,
    loss_text,
    losses_of,
)
from soma_cluster.statusview import (
    CONCERNS,
    Concern,
    Flag,
    JobSelection,
    Limits,
    attention,
    experts_text,
    experts_view,
    ranges,
)
from soma_cluster.storage import Store

STALE_S = 30.0  # a driver's snapshot older than this, and not its last, means the driver is gone (or stuck)


def load_status(store: Store, cfg: CampaignConfig) -> dict:
    """The snapshot (schema in soma_cluster/snapshot.py), with `stale` and, once the campaign ended,
    `plan_vs_actual`."""
    if store.exists(SNAPSHOT):
        snap = store.read_json(SNAPSHOT)
        snap.pop("checksum", None)
        snap["campaign"] = store.url  # where it is read from now (a campaign moved or copied keeps its old URL)
    else:
        totals = Ledger(store).totals()
        rows = history_rows(cfg, history(store), totals)
        snap = build(
            cfg=cfg,
            url=store.url,
            rows=rows,
            by_category_s=totals.gpu_seconds,
            devices=totals.devices,
            usd=totals.usd if totals.usd_priced else None,
            unpriced_s=totals.unpriced_gpu_seconds,
            started_at=None,
            rate=None,
            final=False,
            source="events",
        )
        snap["eta_s"] = None
    snap["stale"] = (
        snap["source"] == "driver"
        and not snap["final"]
        and not stopped(snap)
        and time.time() - snap["written_at"] > STALE_S
    )
    snap["plan_vs_actual"] = plan_vs_actual(store, snap) if store.exists(PLAN) else None
    snap["lease"] = lease_view(store)
    # the budgets in force now (`cfg` has every revision: soma set), though the snapshot may predate the newest
    snap["budget"] = budget_view(cfg)
    snap["config_revision"] = len(revisions(store))
    snap["experts"] = experts_view(snap["jobs"])  # recounted: a snapshot written before it had none
    snap["attention"] = [f.as_dict() for f in attention(snap["jobs"], limits(cfg))]
    snap["filter"] = None
    return snap


def lease_view(store: Store) -> dict | None:
    """Who holds the campaign now (the driver lease), for the header and --json; None if no driver ever took it."""
    found = store.read_versioned(LEASE)
    if found is None:
        return None
    try:
        rec = LeaseRecord.from_bytes(found[0], f"{store.url}/{LEASE}")
    except SomaError as exc:  # a damaged lease is for the next driver to refuse; status still shows
        return {"held": False, "released": False, "damaged": str(exc)}
    here = Holder.here("soma status")
    gone = judge(rec, time.time(), here, process_alive) is not Verdict.HELD
    return {
        "held": not gone,
        "released": rec.released,
        "generation": rec.generation,
        "host": rec.holder.host,
        "pid": rec.holder.pid,
        "command": rec.holder.command,
        "renewed_at": rec.renewed_at,
        "ttl_s": rec.ttl_s,
    }


def stopped(snap: dict) -> bool:
    """The driver wrote this snapshot as it stopped before its jobs ended (a signal, its lease lost): its last word."""
    return (snap.get("driver") or {}).get("state") == "stopped"


class Watch(StrEnum):
    """What `soma status --watch` does after showing a snapshot."""

    RUNNING = "running"  # a driver holds the campaign: show the next snapshot
    WAITING = "waiting"  # no driver now, but one may still start: show the next one
    ENDED = "ended"  # every job ended: nothing more will change
    DRIVER_ENDED = "driver_ended"  # a driver that wrote after the watch began has ended or stopped
    NO_DRIVER = "no_driver"  # no driver ran for the whole wait


def watch_step(snap: dict, since: float, idle_since: float, now: float, wait_s: float) -> Watch:
    """The watch follows the driver it was started for, which may not have started yet (`ray job submit
    --no-wait`, a RayJob's cluster coming up): the seed stage's final snapshot, one from an earlier driver, or
    none at all is not the end. It ends when every job ended, when a driver that wrote after `since` ended or
    stopped, or when no driver held the campaign from `idle_since` for `wait_s`."""
    if snap["jobs"] and all(r["state"] in TERMINAL for r in snap["jobs"]):
        return Watch.ENDED
    lease = snap.get("lease") or {}
    live = lease.get("held") or (
        snap["source"] == "driver" and not snap["final"] and not stopped(snap) and not snap["stale"]
    )
    if live:
        return Watch.RUNNING
    if snap["source"] == "driver" and snap["written_at"] >= since and (snap["final"] or stopped(snap)):
        return Watch.DRIVER_ENDED
    return Watch.NO_DRIVER if now - idle_since >= wait_s else Watch.WAITING


def plan_vs_actual(store: Store, snap: dict) -> dict | None:
    """Predicted (plan/plan.json) against actual (the ledger; the drivers' wall time from the events log) once every
    expert has ended; None while the campaign runs."""
    if not all(r["state"] in TERMINAL for r in snap["jobs"]):
        return None
    plan = store.read_json(PLAN)
    totals = Ledger(store).totals()
    actual = {c: s / 3600.0 for c, s in totals.gpu_seconds.items()}
    walls = stage_walls(store)
    seed = not plan.get("seed_trained")  # a seed trained before the plan was spent, not predicted
    rows = []
    for what, key in ((("seed", Category.SEED),) if seed else ()) + (
        ("expert training", Category.EXPERT_TRAINING),
        ("wasted", Category.WASTED),
    ):
        rows.append(
            {"what": f"GPU-hours, {what}", "predicted": plan["gpu_hours"].get(key, 0.0), "actual": actual.get(key, 0.0)}
        )
    if seed:
        rows.append(
            {
                "what": "GPU-hours, seed + experts",
                "predicted": plan["gpu_hours"]["training_total"],
                "actual": sum(actual[c] for c in (Category.SEED, *EXPERT_SPEND)),
            }
        )
    for what, key in ((("seed", "seed"),) if seed else ()) + (("experts", "experts"),):
        rows.append({"what": f"wall seconds, {what}", "predicted": plan["wall_seconds"][key], "actual": walls.get(key)})
    for r in rows:
        r["error"] = None if not r["actual"] else r["predicted"] / r["actual"] - 1.0
    return {"gpus": plan["gpus"], "rows": rows}


def stage_walls(store: Store) -> dict[str, float]:
    """Wall seconds from a stage's first `queued` to its last end, from the events log."""
    walls: dict[str, list[float]] = {}
    for h in history(store).values():
        key = "seed" if h.job == "seed" else "experts"
        for ev in h.events:
            if ev["event"] == Event.QUEUED or ev["event"] in TERMINAL:
                lo, hi = walls.get(key, [ev["t"], ev["t"]])
                walls[key] = [min(lo, ev["t"]), max(hi, ev["t"])]
    return {k: hi - lo for k, (lo, hi) in walls.items()}


def _hours(v: float | None) -> str:
    return "-" if v is None else f"{v:.4f}"


def head_lines(snap: dict) -> list[str]:
    """Where the snapshot comes from, how old it is, and who holds the campaign."""
    lines = [f"{snap['campaign']} — {snap['name']} (preset {snap['preset']})"]
    if snap["source"] == "events":
        lines.append("from the events log (no status.json: a campaign from before snapshots, or never launched)")
    else:
        age = time.time() - snap["written_at"]
        if stopped(snap):
            d = snap["driver"]
            then = (
                "soma seed"
                if any(r["job"] == "seed" and r["state"] == JobState.INTERRUPTED for r in snap["jobs"])
                else "soma resume"
            )
            lines.append(
                f"the driver (pid {d['pid']} on {d['host']}) STOPPED ({d['stopped_by']}) {fmt_duration(age)} ago with "
                f"jobs unfinished; {then} {snap['campaign']} continues them"
            )
        lines.append(
            f"snapshot {age:.0f} s old"
            + (", the driver's last" if snap["final"] or stopped(snap) else "")
            + (
                f"; STALE: no driver has written it for {fmt_duration(age)} "
                f"(driver gone? soma resume {snap['campaign']})"
                if snap["stale"]
                else ""
            )
        )
    lease = snap.get("lease")
    if lease and lease.get("damaged"):
        lines.append(f"driver lease: {lease['damaged']}")
    if lease and lease["held"]:
        lines.append(
            f"driver: {lease['command']!r}, pid {lease['pid']} on {lease['host']} holds the campaign "
            f"(lease renewed {max(0.0, time.time() - lease['renewed_at']):.0f} s ago)"
        )
    return lines


def fact_lines(snap: dict) -> list[str]:
    """The counts (the seed apart from the experts), GPU-hours and dollars, updates done, elapsed time and ETA, and
    the newest losses: what every view of the campaign shows first, at any N."""
    view = snap.get("experts") or experts_view(snap["jobs"])
    seed_row = next((r for r in snap["jobs"] if r["expert"] is None), None)
    seed = f"seed {view['seed']}; " if view["seed"] else ""
    if seed_row and seed_row["state"] not in TERMINAL and seed_row["step"]:
        seed = f"seed {seed_row['state']} {seed_row['step']}/{seed_row['target']}; "
    lines = [f"{seed}experts ({view['n']}): {experts_text(view)}" if view["n"] else f"{seed}no experts"]
    spent = ", ".join(f"{k} {v:.4f}" for k, v in snap["gpu_hours"].items() if v > 0) or "nothing yet"
    b = snap["budget"]
    caps = ", ".join(f"{_cap_name(k)} cap {_cap_value(k, v)}" for k, v in b.items() if v is not None)
    notes = [caps] if caps else []
    notes += [f"config revision {snap['config_revision']}"] if snap.get("config_revision") else []
    lines.append(f"{snap['gpu_hours_total']:.4f} {snap['unit']}: {spent}" + (f" ({', '.join(notes)})" if notes else ""))
    if snap.get("usd_total") is not None:
        by = ", ".join(f"{k} ${v:,.2f}" for k, v in snap["usd"].items() if v) or "nothing yet"
        unpriced = snap.get("unpriced_gpu_hours") or 0.0
        tail = f"; {unpriced:.4f} {snap['unit']} have no price (written without one)" if unpriced > 0 else ""
        lines.append(f"${snap['usd_total']:,.2f} at the prices recorded: {by}{tail}")
    done = f"{view['updates']:,}/{view['target']:,} updates" + (
        f" ({view['updates'] / view['target']:.0%})" if view["target"] else ""
    )
    if snap["final"]:
        when = f"ended; elapsed {fmt_duration(snap['elapsed_s'])}"
    elif snap.get("stale"):
        when = "ETA - (the snapshot is stale)"
    elif snap["source"] == "driver" and not stopped(snap):
        when = f"elapsed {fmt_duration(snap['elapsed_s'])}, ETA " + (
            "-" if snap["eta_s"] is None else fmt_duration(snap["eta_s"])
        )
    else:
        when = "ETA - (no driver runs it)"
    lines.append(f"{done}; {when}; newest loss {loss_text(*losses_of(snap))}")
    return lines


def header(snap: dict) -> Text:
    return Text("\n".join(head_lines(snap) + fact_lines(snap)))


def _cap_name(key: str) -> str:
    return key.removesuffix("_gpu_hours").removesuffix("_usd")


def _cap_value(key: str, value: float) -> str:
    return f"${value:,.2f}" if key.endswith("_usd") else f"{value}"


GAP = 2  # between two columns of a borderless table: a cell's padding on each side
# a job row's columns, most needed first: job and state are never left out or cut; the rest are left out from the
# end of this list when the width is short (the last error wraps in what is left, or goes when under ERROR_MIN)
COLUMNS = ("job", "state", "step", "train", "expert-val", "GPU-h", "retries", "left GPU-h", "device", "node")
RIGHT = ("step", "train", "expert-val", "GPU-h", "left GPU-h", "retries")
ERROR_MIN = 24  # characters a wrapped `last error` needs to read as text


def _loss(v: float | None) -> str:
    return "-" if v is None else f"{v:.4f}"


def _cells(r: dict) -> dict[str, str]:
    return {
        "job": r["job"],
        "state": r["state"],
        "step": f"{r['step']}/{r['target']}",
        "train": _loss(r.get("loss")),
        "expert-val": _loss(r["val"]),
        "GPU-h": _hours(r["gpu_hours"]),
        "retries": str(r["retries"]),
        "left GPU-h": _hours(r["budget_left_gpu_hours"]),
        "device": r["device"] or "-",
        "node": r["node"] or "-",
    }


def fit_columns(rows: list[dict[str, str]], width: int | None) -> tuple[list[str], int | None]:
    """The columns that fit `width` (None: all) whole, in COLUMNS' order, and the width left for `last error`
    (None: it is left out). The first two always stay: a row without its job's name or state says nothing."""
    need = {c: max([len(c)] + [len(r[c]) for r in rows]) for c in COLUMNS}
    if width is None:
        return list(COLUMNS), max(1, max([len("last error")] + [len(r.get("error", "")) for r in rows]))
    cols, used = [], -GAP
    for c in COLUMNS:
        if len(cols) >= 2 and used + GAP + need[c] > width:
            break
        cols.append(c)
        used += GAP + need[c]
    left = width - used - GAP
    return cols, (left if left >= ERROR_MIN else None)


def job_table(
    snap: dict, width: int | None = None, wrap: bool = True, shown: int | None = None
) -> tuple[Table, list[str]]:
    """The jobs' table fitted to `width` columns (None: as wide as it needs), and the columns it left out: names
    and states are never cut (soma status --json has every field). `wrap`: a long last error wraps; else it is cut
    to one line (a watch keeps one line per row, to stay within the screen's height). `shown`: only the first rows,
    in the columns that fit every row."""
    every = [{**_cells(r), "error": r["last_error"] or ""} for r in snap["jobs"]]
    cols, error_w = fit_columns(every, width)
    rows = every[:shown]
    table = Table(box=None, pad_edge=False, show_edge=False)
    for col in cols:
        table.add_column(col, no_wrap=True, justify="right" if col in RIGHT else "left")
    if error_w is not None:
        table.add_column(
            "last error",
            overflow="fold" if wrap else "ellipsis",
            no_wrap=not wrap,
            max_width=error_w if width is not None else None,
        )
    for r in rows:
        error = r["error"] if wrap else " ".join(r["error"].split())
        table.add_row(*[r[c] for c in cols], *([Text(error)] if error_w is not None else []))
    errors = any(r["error"] for r in every)  # a column of no errors left out loses nothing: not named
    left_out = [c for c in COLUMNS if c not in cols] + (["last error"] if error_w is None and errors else [])
    return table, left_out


def comparison_table(cmp: dict) -> Table:
    table = Table(title=f"soma plan (on {cmp['gpus']} GPUs) against actual", box=None, title_justify="left")
    for col in ("", "predicted", "actual", "error"):
        table.add_column(col, no_wrap=True, justify="left" if not col else "right")
    for r in cmp["rows"]:
        table.add_row(
            r["what"],
            f"{r['predicted']:.4f}" if "GPU" in r["what"] else f"{r['predicted']:.1f}",
            "-" if r["actual"] is None else (f"{r['actual']:.4f}" if "GPU" in r["what"] else f"{r['actual']:.1f}"),
            "-" if r["error"] is None else f"{r['error']:+.1%}",
        )
    return table


def comparison_line(cmp: dict) -> str:
    """plan vs actual in one line, for the summary: 'soma plan (4 GPUs) vs actual: GPU-hours ... +82%; wall ...'."""
    parts = []
    for r in cmp["rows"]:
        if r["what"] in ("GPU-hours, expert training", "wall seconds, experts"):
            err = "-" if r["error"] is None else f"{r['error']:+.0%}"
            parts.append(f"{r['what'].split(',')[0]} {r['predicted']:.4g} vs {r['actual'] or 0:.4g} ({err})")
    return f"soma plan ({cmp['gpus']} GPUs) against actual, experts: " + "; ".join(parts) + " (--all: every row)"


def render(snap: dict, width: int | None = None, height: int | None = None, matched: str | None = None) -> Group:
    """Every job (`--all`, or those a filter chose: `matched` says which) under the header: the jobs' table fitted to
    `width` (naming what it left out) and, once ended, plan vs actual. With `height` (a watch), one line per row and
    only the rows that fit, the rest counted."""
    head = Text("\n".join(head_lines(snap) + fact_lines(snap)))
    jobs = snap["jobs"]
    table, left_out = job_table(snap, width, wrap=height is None)
    notes = [f"({len(left_out)} columns left out at {width} wide: {', '.join(left_out)}; --json has all)"] * bool(
        left_out
    ) + ([matched] if matched is not None else [])
    shown = jobs
    if height is not None:  # one line per row: as many as the screen holds below the header, the rest counted
        more = Text(f"+{len(jobs)} more rows below the screen (without --watch, all are listed)")
        fixed = _height(head, width) + 2 + sum(_height(Text(n), width) for n in notes)  # 2: a blank, the columns
        room = height - 1 - fixed
        if len(jobs) > room:
            shown = jobs[: max(0, room - _height(more, width))]
            table, _ = job_table(snap, width, wrap=False, shown=len(shown))
    parts = [head, Text("")]
    if shown:
        parts.append(table)
    if len(shown) < len(jobs):
        parts.append(Text(f"+{len(jobs) - len(shown)} more rows below the screen (without --watch, all are listed)"))
    parts += [Text(n) for n in notes]
    if snap.get("plan_vs_actual") and height is None:
        parts += [Text(""), comparison_table(snap["plan_vs_actual"])]
    return Group(*parts)


def _height(renderable, width: int | None) -> int:
    """Screen lines `renderable` takes at `width` (None: nothing wraps)."""
    scratch = Console(file=io.StringIO(), width=width or 100_000, color_system=None, highlight=False)
    return len(scratch.render_lines(renderable, scratch.options, pad=False))


MIN_WHY = 16  # columns an attention row's reason needs to say something; below it, GPU-h then step go


def attention_table(snap: dict, flags: list[Flag], width: int | None) -> Table:
    """One line per flagged expert: job, state, step, GPU-h and why, the reason cut to what `width` leaves."""
    by = {r["job"]: r for r in snap["jobs"]}
    rows = [
        {
            "job": f.job,
            "state": by[f.job]["state"],
            "step": f"{by[f.job]['step']}/{by[f.job]['target']}",
            "GPU-h": _hours(by[f.job]["gpu_hours"]),
            "why": " ".join(f.why.split()),
        }
        for f in flags
    ]
    cols = ["job", "state", "step", "GPU-h"]
    need = {c: max([len(c)] + [len(r[c]) for r in rows]) for c in cols}
    room = None
    if width is not None:
        while True:
            room = width - sum(need[c] + GAP for c in cols)
            if room >= MIN_WHY or len(cols) == 2:
                break
            cols.pop()
    table = Table(box=None, pad_edge=False, show_edge=False)
    for col in cols:
        table.add_column(col, no_wrap=True, justify="right" if col in RIGHT else "left")
    table.add_column("why", no_wrap=True)
    for r in rows:
        why = Text(r["why"])
        if room is not None:
            why.truncate(max(1, room), overflow="ellipsis")
        table.add_row(*[r[c] for c in cols], why)
    return table


def summary(snap: dict, width: int | None, height: int) -> Group:
    """The default view, within `height` lines (the prompt's line left free) and `width` columns at any N: the header
    and facts (counts, GPU-hours, ETA), then every job where all fit, else the experts that need attention, as many
    as fit, and how to list the rest."""
    budget = max(1, height - 1)
    head = Text("\n".join(head_lines(snap) + fact_lines(snap)))
    if len(snap["jobs"]) < budget and _height(whole := render(snap, width), width) <= budget:
        return whole  # every job fits: no summary needed
    if _height(head, width) + 3 > budget:  # a very short terminal: the counts, GPU-hours and ETA alone
        return Group(Text("\n".join(fact_lines(snap))))
    parts = [head]
    if snap.get("plan_vs_actual"):
        parts.append(Text(comparison_line(snap["plan_vs_actual"])))
    flags = [Flag(a["job"], Concern(a["concern"]), a["why"]) for a in snap["attention"]]
    n_experts = sum(r["expert"] is not None for r in snap["jobs"])
    kinds = ", ".join(f"{n} {c}" for c in CONCERNS if (n := sum(f.concern == c for f in flags)))
    title = f"needs attention ({len(flags)} of {n_experts} experts): {kinds}" if flags else "no expert needs attention"
    used = sum(_height(p, width) for p in parts) + 1 + _height(Text(title), width)  # 1: a blank line
    hint_room = _height(Text(_hint(snap, flags, len(flags))), width)
    fit = max(0, min(len(flags), budget - used - hint_room - 1))  # 1: the attention table's header
    hint = _hint(snap, flags, fit)
    fit = max(0, min(fit, budget - used - _height(Text(hint), width) - 1))
    parts += [Text(""), Text(title)]
    if fit:
        parts.append(attention_table(snap, flags[:fit], width))
    parts.append(Text(_hint(snap, flags, fit)))
    return Group(*parts)


def _hint(snap: dict, flags: list[Flag], shown: int) -> str:
    """How to list what the summary left out: the flagged experts not shown, every job."""
    n = len(snap["jobs"])
    if shown < len(flags):
        left = {f.job for f in flags[shown:]}
        states = sorted({_state_word(r["state"]) for r in snap["jobs"] if r["job"] in left})
        return f"+{len(left)} more: --state {','.join(states)} lists them; --all lists all {n} jobs"
    return f"more: --all ({n} jobs), --state failed,retrying, --expert 7,12-15, --json"


def _state_word(state: str) -> str:
    return "failed" if state == JobState.FAILED_PERMANENTLY else state


def table_width(console: Console, env: dict | None = None) -> int | None:
    """The width `soma status` fits its table to: the terminal's, or COLUMNS where set (piped, or a terminal that
    says otherwise); None (as wide as the content needs) when piped without it."""
    env = os.environ if env is None else env
    if env.get("COLUMNS", "").strip().isdigit() and int(env["COLUMNS"]) > 0:
        return int(env["COLUMNS"])
    return console.width if console.is_terminal else None


def print_full(console: Console, renderable, width: int | None = None) -> None:
    """Print without cutting anything: at `width` (render fitted its table to it), on a terminal as wide as it is,
    piped as wide as the content needs."""
    if width is not None:
        Console(file=console.file, width=width, highlight=False, color_system=console.color_system).print(renderable)
        return
    if console.is_terminal:
        console.print(renderable)
        return
    width = Measurement.get(console, console.options.update(width=100_000, max_width=100_000), renderable).maximum
    Console(file=console.file, width=max(width, 40), highlight=False, color_system=None).print(renderable)


def wait_prepared(store: Store, wait_s: float, interval_s: float) -> None:
    """A watch of a job that starts with soma prepare: wait up to `wait_s` for its config (load_config then says
    what is missing, if it still is)."""
    if store.exists(CONFIG_FILE):
        return
    print(f"soma: {store.url} is not prepared yet; waiting up to {fmt_span(wait_s)} for it", file=sys.stderr)
    deadline = time.monotonic() + wait_s
    while not store.exists(CONFIG_FILE) and time.monotonic() < deadline:
        time.sleep(min(interval_s, 5.0))


def screen_height(console: Console, env: dict | None = None) -> int:
    """The lines the summary fits in: LINES where set, else the terminal's height, else (piped) 24."""
    env = os.environ if env is None else env
    if env.get("LINES", "").strip().isdigit() and int(env["LINES"]) > 0:
        return int(env["LINES"])
    return console.height if console.is_terminal else SCREEN_LINES


SCREEN_LINES = 24  # a piped summary fits a 24-line terminal, as a terminal's would


@dataclass(frozen=True)
class Selection:
    """Which view: the summary (default), every job (`--all`), or the jobs `--state` and `--expert` choose."""

    states: tuple[JobState, ...] | None = None
    jobs: JobSelection | None = None
    every: bool = False

    @property
    def listing(self) -> bool:
        return self.every or self.states is not None or self.jobs is not None

    def apply(self, snap: dict, n_experts: int) -> dict:
        """The snapshot with only the chosen jobs (and their attention flags), and `filter` saying what chose them;
        the counts, GPU-hours and ETA stay the whole campaign's."""
        if self.states is None and self.jobs is None:
            return snap
        names = set(self.jobs.names(n_experts)) if self.jobs is not None else None
        jobs = [
            r
            for r in snap["jobs"]
            if (self.states is None or r["state"] in self.states) and (names is None or r["job"] in names)
        ]
        kept = {r["job"] for r in jobs}
        return {
            **snap,
            "jobs": jobs,
            "attention": [a for a in snap["attention"] if a["job"] in kept],
            "filter": {
                "state": list(self.states) if self.states is not None else None,
                "expert": sorted(names, key=_campaign_order) if names is not None else None,
                "matched": len(jobs),
                "jobs": len(snap["jobs"]),
            },
        }

    def said(self, filt: dict) -> str:
        """'3 of 257 jobs match --state failed_permanently,retrying' (or 'no job of 257 matches ...')."""
        given = []
        if filt["state"] is not None:
            given.append(f"--state {','.join(filt['state'])}")
        if filt["expert"] is not None:
            given.append(f"--expert {ranges_of(filt['expert'])}")
        if not filt["matched"]:
            return f"no job of {filt['jobs']} matches {' '.join(given)}"
        return f"{filt['matched']} of {filt['jobs']} jobs match {' '.join(given)}"


def _campaign_order(name: str) -> tuple[int, str]:
    return (0, name) if name == "seed" else (1, name)


def ranges_of(names: list[str]) -> str:
    """Job names as --expert takes them: 'seed,0-3,7'."""
    numbers = [int(n.rsplit("-", 1)[1]) for n in names if n != "seed"]
    return ",".join((["seed"] if "seed" in names else []) + ([ranges(numbers).replace(" ", "")] if numbers else []))


def limits(cfg: CampaignConfig) -> Limits:
    return Limits(
        max_retries=cfg.retry.max_retries,
        heartbeat_timeout_s=cfg.retry.heartbeat_timeout_s,
        expert_gpu_hours=cfg.budget.expert_gpu_hours,
    )


def view_of(snap: dict, sel: Selection, width: int | None, height: int, watch: bool) -> Group:
    """The text view `sel` asks for, at `width` x `height` (a watch keeps a listing within the height too)."""
    if not sel.listing:
        return summary(snap, width, height)
    matched = sel.said(snap["filter"]) if snap.get("filter") else None
    return render(snap, width, height if watch else None, matched)


def show_status(
    store: Store,
    as_json: bool,
    watch: bool,
    interval_s: float,
    count: int,
    wait_s: float,
    sel: Selection = Selection(),
) -> None:
    """`soma status`: the snapshot on stdout once, or with `watch` every `interval_s` seconds until the driver's
    last one (watch_step), `count` refreshes (0: no limit), or `wait_s` seconds without a driver. `sel`: the
    summary (default), every job, or the jobs a filter chose (--json: every field of those)."""
    if watch:
        wait_prepared(store, wait_s, interval_s)
    cfg = load_config(store)
    if sel.jobs is not None:
        sel.jobs.names(cfg.n_experts)  # an expert past the campaign's is bad input, refused before any output
    shown, since = 0, time.time()
    idle_since, told = since, False
    while True:
        whole = load_status(store, cfg)
        snap = sel.apply(whole, cfg.n_experts)
        if as_json:
            emit_json(snap, lines=watch)
        else:
            if watch and out.is_terminal:
                out.clear()
            width = table_width(out)
            print_full(out, view_of(snap, sel, width, screen_height(out), watch), width)
        shown += 1
        if not watch or (count and shown >= count):
            return
        now = time.time()
        step = watch_step(whole, since, idle_since, now, wait_s)
        if step is Watch.RUNNING:
            idle_since, told = now, False
        elif step is Watch.WAITING and not told:
            print(f"soma: no driver runs {store.url} now; waiting up to {fmt_span(wait_s)} for one", file=sys.stderr)
            told = True
        if step is Watch.NO_DRIVER:
            print(
                f"soma: no driver took {store.url} in {fmt_span(wait_s)}; start one (soma launch / soma resume "
                f"{store.url}) or watch longer (--wait)",
                file=sys.stderr,
            )
        if step not in (Watch.RUNNING, Watch.WAITING):
            return
        time.sleep(interval_s)
