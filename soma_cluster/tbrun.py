"""A campaign's TensorBoard run directory (<logdir>/<name>-<key>/), the decisions without TensorBoard: which event
files are ours (by name), the order TensorBoard reads them in, and when a run must be rewritten.

TensorBoard reads a run's event files in filename order. Its default loader (the data server, `--load_fast=auto`)
takes a step that goes back within a tag for a restart from a checkpoint: a record at step s drops the tag's
records at steps >= s read before it. Its Python loader (`--load_fast=false`) keeps every record in the order
read. So a point appended below a tag's last step (a backfilled gap) hides the tag's later points in the one and
draws the curve backwards in the other. Both show the campaign's curves when, read in filename order, every tag's
steps strictly increase: the live driver keeps that (it appends only steps past a tag's highest, to a file that
sorts after the others), and a backfill that fills a gap rewrites the run: one fresh file in step order, renamed
in after the others, then the old ones emptied.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

PREFIX = "events.out.tfevents.soma-"  # ours, by name: "tfevents" (what both loaders look for), then a sequence
DIGITS = 8
TMP_PREFIX = ".soma-rewrite-"  # a fresh file being written: no "tfevents" in its name, so no loader reads it yet
INFIX = "tfevents"  # an event file, for both loaders


def event_file(seq: int) -> str:
    """Our event file number `seq`: fixed width, so filename order is write order (and after any name TensorBoard's
    own writers give, `events.out.tfevents.<seconds>...`, since "s" sorts after the digits)."""
    return f"{PREFIX}{seq:0{DIGITS}d}"


def seq_of(name: str) -> int | None:
    """The sequence of one of our event files; None for a file we did not write."""
    rest = name[len(PREFIX) :] if name.startswith(PREFIX) else ""
    return int(rest) if len(rest) == DIGITS and rest.isdigit() else None


def next_seq(names: Iterable[str]) -> int:
    return 1 + max((s for s in map(seq_of, names) if s is not None), default=0)


def read_order(names: Iterable[str]) -> list[str]:
    """A run directory's event files in the order both loaders read them (by name: code point order is UTF-8's
    byte order, the data server's)."""
    return sorted(n for n in names if INFIX in n and not n.startswith(TMP_PREFIX))


@dataclass(frozen=True)
class Rec:
    """One summary value read from a run: a scalar's float, or a value kept as read (the config's text)."""

    file: str
    tag: str
    step: int
    t: float  # wall clock (s)
    value: object


def held(recs: Iterable[Rec]) -> dict[str, list[Rec]]:
    """Each tag's records, one per step (the first read: a step's first value is the campaign's, as `Marks` sends
    it), in step order: what the run holds, and what a rewrite writes."""
    first: dict[str, dict[int, Rec]] = {}
    for r in recs:
        first.setdefault(r.tag, {}).setdefault(r.step, r)
    return {tag: [steps[s] for s in sorted(steps)] for tag, steps in first.items()}


def in_order(recs: Iterable[Rec]) -> bool:
    """Whether both loaders show the run as it is held: our files, in read order, raise every tag's step each
    record, and hold every (tag, step) of the other files there (those sort first, and a rewrite's file ends
    their effect: the data server drops a tag's records at or past its first step, the Python loader drops all
    at its second session start). `recs` in read order."""
    last: dict[str, int] = {}
    ours: set[tuple[str, int]] = set()
    other: set[tuple[str, int]] = set()
    for r in recs:
        if seq_of(r.file) is None:
            other.add((r.tag, r.step))
            continue
        if r.step <= last.get(r.tag, -1):
            return False
        last[r.tag] = r.step
        ours.add((r.tag, r.step))
    return other <= ours


def appends_in_order(runs: dict[str, list[Rec]], new: Iterable[tuple[str, int]]) -> bool:
    """Whether (tag, step) points appended after the held run keep every tag's steps rising (else: a rewrite)."""
    high = {tag: recs[-1].step for tag, recs in runs.items() if recs}
    for tag, step in new:
        if step <= high.get(tag, -1):
            return False
        high[tag] = step
    return True
