"""TensorBoard as a tracking sink: a folder per campaign (<logdir>/<dir>-<campaign key>) holding one run per job
(`expert-0003/`, `seed/`) and the campaign's own (`campaign/`), so the experts' `train_loss` curves overlay in one
chart; each run's parameters as a text summary (`config`).

In each run the sink writes event files of its own, in TensorBoard's record format, named so that filename order
(the order TensorBoard reads a run in) is write order (soma_cluster/tbrun.py). When it opens it reads back every
event file of every run, so a resumed driver appends only later steps, to a file of its own. A backfill (`soma
track`) whose points fall below a tag's last step rewrites that run in step order (one fresh file, renamed in,
then our old files emptied), since TensorBoard's loader would take a step going back for a restart and hide the
later ones.
Needs the tensorboard package (the `tracking` extra).
"""

from __future__ import annotations

import itertools
import os
import time

from soma_cluster.tbrun import (
    TMP_PREFIX,
    Rec,
    appends_in_order,
    event_file,
    held,
    in_order,
    next_seq,
    read_order,
    seq_of,
)
from soma_cluster.trackpoints import Marks, Metric, Params, Point

CONFIG_TEXT = "config"  # a run's parameters: the campaign's config, a job's own (soma_cluster.trackpoints.job_params)
CONFIG_TAG = f"{CONFIG_TEXT}/text_summary"  # the tag torch's add_text gives it: runs written by it read the same
FILE_VERSION = "brain.Event:2"


def read_run(path: str) -> tuple[list[Rec], float | None]:
    """Every summary value in a run directory's event files, in the order TensorBoard reads them, and the wall
    time of the run's first event (None: no event). A record cut short (a writer killed mid-write) ends its file,
    as it does for TensorBoard's loaders."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event

    recs: list[Rec] = []
    start = None
    for name in read_order(os.listdir(path)):
        if not os.path.isfile(os.path.join(path, name)):  # a directory named like an event file: not one
            continue
        for raw in RawEventFileLoader(os.path.join(path, name)).Load():
            ev = Event.FromString(raw)
            start = ev.wall_time if start is None else min(start, ev.wall_time)
            for v in ev.summary.value:
                value = v.simple_value if v.WhichOneof("value") == "simple_value" else v
                recs.append(Rec(name, v.tag, ev.step, ev.wall_time, value))
    return recs, start


def _events(recs: list[Rec]) -> list:
    """The records as events, in their order: one event per run of records at one (step, wall time), so a
    heartbeat's five scalars cost one event (grouping beyond a run could put a tag's later step first)."""
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary

    out: list = []
    for (step, t), group in itertools.groupby(recs, key=lambda r: (r.step, r.t)):
        vs = [Summary.Value(tag=r.tag, simple_value=r.value) if isinstance(r.value, float) else r.value for r in group]
        out.append(Event(wall_time=t, step=step, summary=Summary(value=vs)))
    return out


def _header(t: float, restart: bool) -> list:
    """A file's first events: its format version; for a rewrite, two session starts at step 0, which make
    TensorBoard's Python loader drop what it read before this file (it takes the first start of a run for the
    start, a later one for a restart): a TensorBoard left running shows the rewritten run, not both."""
    from tensorboard.compat.proto.event_pb2 import Event, SessionLog

    out = [Event(wall_time=t, file_version=FILE_VERSION)]
    return out + [Event(wall_time=t, step=0, session_log=SessionLog(status=SessionLog.START))] * (2 if restart else 0)


def _write_records(fh, events: list) -> None:
    from tensorboard.summary.writer.record_writer import RecordWriter

    w = RecordWriter(fh)
    for ev in events:
        w.write(ev.SerializeToString())
    fh.flush()


NAME_BYTES = 200  # of the campaign's name in its run directory's name: with "-KEY", under a file name's 255 bytes


def run_dir_name(campaign: str, key: str) -> str:
    """The run directory's name: the campaign's name with its path separators made "_" (a name may hold "/" or "..",
    which must not place the run outside the log dir), cut to NAME_BYTES of UTF-8 (200 characters of CJK are 600
    bytes, which no file system takes), then the campaign key, which keeps names unique."""
    campaign = campaign.replace("/", "_")  # POSIX's one separator (Ray's clusters run on Linux)
    while len(campaign.encode("utf-8", "surrogateescape")) > NAME_BYTES:  # a name that fits is kept as it was
        campaign = campaign[:-1]
    return f"{campaign}-{key}"


class RunDir:
    """One TensorBoard run (a job's, or the campaign's own): its directory, what it holds, the file this sink appends
    to, and a backfill's records until `finish`."""

    def __init__(self, path: str, full: bool):
        self.path, self.full = path, full
        self.file: str | None = None  # the event file this sink appends to (made at its first write)
        self.runs: dict[str, list[Rec]] = {}  # what the run holds: per tag, one record per step, in step order
        self.ordered = True  # the run as read shows each tag's steps once, in order (soma_cluster/tbrun.py)
        self.start_t: float | None = None
        self.pending: list[Rec] = []  # a backfill's records, written by finish()

    def open(self) -> dict[str, list[Rec]]:
        """Read the run back (a file written to when a write failed may end in a torn record, after which no loader
        reads on: later points go to a new file); returns what it holds."""
        self.file, self.pending = None, []
        recs, self.start_t = read_run(self.path) if os.path.isdir(self.path) else ([], None)
        self.runs, self.ordered = held(recs), in_order(recs)
        found = self.runs
        if not self.full:
            self.runs = {}  # a driver appends past the marks only: no need to keep the run in memory
        return found

    def write(self, recs: list[Rec]) -> None:
        if self.full:
            self.pending += recs  # a backfill's points may fall below a tag's last step: finish() places them
        elif recs:
            self._append(recs)

    def finish(self) -> list[str]:
        """A backfill's points into the run: appended when they keep every tag's steps rising and the run is
        in order, else the run rewritten in step order. Returns the names of our event files it replaced."""
        new, self.pending = self.pending, []
        if self.ordered and appends_in_order(self.runs, ((r.tag, r.step) for r in new)):
            if new:
                self._append(new)
                self.runs = held([r for rs in self.runs.values() for r in rs] + new)
            return []
        return self._rewrite([r for rs in self.runs.values() for r in rs] + new)

    def close(self) -> None:
        self.file, self.pending = None, []

    def _append(self, recs: list[Rec]) -> None:
        """Append to this sink's own file, opened for each batch: no descriptor held between batches (a file
        system can be remounted, the file retired by a backfill)."""
        os.makedirs(self.path, exist_ok=True)
        if self.file is None:
            seq = next_seq(os.listdir(self.path))
            name = os.path.join(self.path, event_file(seq))
            with open(name, "xb") as fh:  # never onto a file that exists: one writer per file
                _write_records(fh, _header(time.time(), restart=False))
            self.file = name
        try:
            with open(self.file, "ab") as fh:
                _write_records(fh, _events(recs))
        except BaseException:
            self.file = None  # its tail may be torn: the next batch starts a new file
            raise

    def _rewrite(self, recs: list[Rec]) -> list[str]:
        """The run in step order into one fresh file, written under a name no loader reads, synced, and renamed in
        after every other file: from that instant both loaders show the fresh file alone (the data server takes
        its steps for a restart, the Python loader drops what it read at its second session start). Then our old
        files are emptied, not deleted: TensorBoard's Python loader, left running, never moves on from an event
        file deleted under it, but it does from an empty one. Our files emptied by an earlier rewrite (long read
        past) are deleted. A crash in between leaves a run that reads right and is tidied by the next backfill."""
        os.makedirs(self.path, exist_ok=True)
        names = os.listdir(self.path)
        seq = next_seq(names)
        tmp = os.path.join(self.path, f"{TMP_PREFIX}{seq}")
        runs = held(recs)
        rows = sorted((r for rs in runs.values() for r in rs), key=lambda r: (r.step, r.t))
        try:
            with open(tmp, "wb") as fh:
                _write_records(fh, _header(self.start_t or time.time(), restart=True) + _events(rows))
                os.fsync(fh.fileno())
            os.replace(tmp, os.path.join(self.path, event_file(seq)))
        except BaseException:
            _unlink(tmp)
            raise
        _sync_dir(self.path)
        ours = {n: os.path.getsize(os.path.join(self.path, n)) for n in names if seq_of(n) is not None}
        for n in [n for n, size in ours.items() if size == 0] + [n for n in names if n.startswith(TMP_PREFIX)]:
            os.unlink(os.path.join(self.path, n))
        retired = sorted(n for n, size in ours.items() if size > 0)
        for n in retired:
            os.truncate(os.path.join(self.path, n), 0)
        self.runs, self.ordered, self.file = runs, True, None
        return retired


class TensorBoardSink:
    """One TensorBoard run per job under the campaign's folder (<logdir>/<dir>-<key>/expert-0003/), the campaign's
    own scalars in <...>/campaign/: TensorBoard overlays the experts' curves (`train_loss` of every run)."""

    name = "tensorboard"

    def __init__(self, logdir: str, key: str, campaign: str, full: bool = False):
        self.path = os.path.join(logdir, run_dir_name(campaign, key))
        self.full = full
        self.dirs: dict[str, RunDir] = {}  # run (a job, or the campaign) -> its directory

    def load(self) -> None:
        import tensorboard.backend.event_processing.event_file_loader  # noqa: F401
        import tensorboard.plugins.text.summary_v2  # noqa: F401
        import tensorboard.summary.writer.record_writer  # noqa: F401

    def open(self) -> Marks:
        self.dirs = {}
        marks = Marks(known={} if self.full else None, kinds=(Metric, Params), params_whole=set())  # no tags here
        names = sorted(os.listdir(self.path)) if os.path.isdir(self.path) else []
        for run in [n for n in names if os.path.isdir(os.path.join(self.path, n))]:
            for tag, rs in self._dir(run).open().items():
                if tag == CONFIG_TAG:
                    marks.params_whole.add(run)  # written once, as one text
                elif isinstance(rs[0].value, float):
                    marks.high[(run, tag)] = rs[-1].step
                    if self.full:
                        marks.known[(run, tag)] = {r.step for r in rs}
        return marks

    def _dir(self, run: str) -> RunDir:
        if run not in self.dirs:
            self.dirs[run] = RunDir(os.path.join(self.path, run), self.full)
        return self.dirs[run]

    def write(self, points: list[Point]) -> None:
        by_run: dict[str, list[Rec]] = {}
        for run, rec in self._recs(points):
            by_run.setdefault(run, []).append(rec)
        for run, recs in by_run.items():
            self._dir(run).write(recs)

    def finish(self) -> list[str]:
        """Each run's backfill (RunDir.finish); the replaced files as <run>/<file>."""
        return [f"{run}/{n}" for run, d in sorted(self.dirs.items()) for n in d.finish()]

    def close(self) -> None:
        for d in self.dirs.values():
            d.close()

    def _recs(self, points: list[Point]) -> list[tuple[str, Rec]]:
        from tensorboard.plugins.text.summary_v2 import text_pb

        out: list[tuple[str, Rec]] = []
        for p in points:
            if isinstance(p, Metric):
                out.append((p.run, Rec("", p.key, p.step, p.t, float(p.value))))
            elif isinstance(p, Params) and p.values:  # Marks admits a run's parameters once, as a whole
                rows = "\n".join(f"| {k} | {v} |" for k, v in sorted(p.values.items()))
                text = text_pb(CONFIG_TAG, f"| parameter | value |\n|---|---|\n{rows}").value[0]
                out.append((p.run, Rec("", CONFIG_TAG, 0, time.time(), text)))
        return out


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _sync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
