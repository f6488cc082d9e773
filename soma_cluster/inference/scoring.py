"""Documents as soma eval reads them, routed causally: cut into windows and segments, each segment's nats totalled
into its document's Score, with the record of what produced it.

No torch: the model's part (the nats of a segment's bytes) is RoutedLM.forward's; this module decides which windows a
document is read in, which bytes each route is chosen from, which predictions count, and how they add up. `soma
serve`'s router cuts and totals here while its expert replicas run the forward (pipelines/serve_app.py).

**Windows.** Windows of eval.window_bytes (1,025) bytes start every window_bytes - 1 - eval.context_bytes (768)
bytes; a byte t >= 1 is scored in the first window that predicts it (prediction i of a window starting at s is for
byte s + i + 1), so every byte after the first is scored exactly once. A prefix is read, not scored. Each window is
read from a fresh recurrent state.

**Routes read only bytes before the ones they score** (the rule ROUTING_RULE, docs/inference.md). Let u be the
bytes of a window before its first scored byte:

- u >= router.prefix_bytes (R, 256): the router reads the window's first R bytes (`window`): soma eval's windows,
  every window after a document's first, and a text after a prefix of R bytes or more.
- the window that starts a text after a caller's shorter prefix: the router reads all u bytes before the text, the
  prefix, once, and that route scores the whole window (`context`), as generation routes once on its prompt. So the
  choices of one lm-eval question are scored under one route, chosen from the question alone.
- otherwise (a document's first window, no prefix: u = 1): the route is chosen again as the text is read, at u and
  at each power of two above it, each time from every byte before that point (`growing`), then at R on the window's
  first R bytes. Each route's experts read the window from its first byte, so no state is cut short.

A window is thus read in one or more segments: the bytes [start, end) read from a fresh state under one route, the
predictions from `first` on scored; consecutive segments the router sends to the same experts with the same weights
are read as one (merge_runs). No byte's probability depends on that byte or a later one. Each Score carries the
record of what produced it (ScoreRouting: the rule, the context read, the segments' routes and their sha256).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np

LN2 = math.log(2)
Text = str | bytes | bytearray | memoryview
ROUTING_RULE = "causal/1"  # the rule above, named and versioned in every score's record
SHORT_SHA = 16  # hex digits of the sha256 of the bytes a router read, in a segment's record


def as_bytes(text: Text) -> bytes:
    """Text as the model reads it: a str as UTF-8; bytes as they are (any bytes are valid input to a byte model)."""
    if isinstance(text, str):
        return text.encode("utf-8", errors="surrogateescape")
    if isinstance(text, (bytes, bytearray, memoryview)):
        return bytes(text)
    raise TypeError(f"text must be str or bytes, not {type(text).__name__}")


class Kind(StrEnum):
    """What a segment's router read (module docstring)."""

    WINDOW = "window"  # the window's first router.prefix_bytes, before every byte the segment scores
    CONTEXT = "context"  # the caller's prefix, shorter than prefix_bytes: routed once on it, as a prompt is
    GROWING = "growing"  # no context: every byte read before the segment's first scored byte, fewer than prefix_bytes


@dataclass(frozen=True)
class Segment:
    """Bytes [start, end) of a document (its prefix included) read from a fresh state under one route: predictions
    `first` .. end - start - 2 are scored (bytes start + first + 1 .. end - 1); the router read bytes
    [start, start + read)."""

    start: int
    end: int
    first: int
    read: int
    kind: Kind

    @property
    def scored(self) -> tuple[int, int]:
        """The bytes it scores, [a, b) offsets in the document."""
        return self.start + self.first + 1, self.end


@dataclass(frozen=True)
class Rule:
    """How documents are read and routed: windows of `window_bytes` at `stride`, routes on at most `prefix_bytes`
    bytes before what they score (module docstring)."""

    window_bytes: int
    stride: int
    prefix_bytes: int

    name = ROUTING_RULE

    def points(self, u: int) -> list[int]:
        """Where a growing route is chosen again, from u bytes read: u, each power of two above it, prefix_bytes."""
        out, p = [u], 1
        while p <= u:
            p *= 2
        while p < self.prefix_bytes:
            out.append(p)
            p *= 2
        return out + [self.prefix_bytes]

    def segments(self, size: int, first: int, start: int = 0, context: bool = False) -> list[Segment]:
        """The segments of a window of `size` bytes at offset `start` whose predictions from `first` on are scored;
        `context`: it is the window that starts a text after the caller's prefix."""
        u = first + 1
        if u >= self.prefix_bytes:
            return [Segment(start, start + size, first, self.prefix_bytes, Kind.WINDOW)]
        if context:
            return [Segment(start, start + size, first, u, Kind.CONTEXT)]
        pts = self.points(u)
        out = []
        for a, b in zip(pts, [*pts[1:], size], strict=True):
            if a >= size:
                break
            kind = Kind.WINDOW if a == self.prefix_bytes else Kind.GROWING
            out.append(Segment(start, start + min(b, size), a - 1, a, kind))
        return out

    def as_dict(self) -> dict:
        return {
            "rule": self.name,
            "window_bytes": self.window_bytes,
            "stride": self.stride,
            "prefix_bytes": self.prefix_bytes,
        }


@dataclass(frozen=True)
class RoutedSegment:
    """A segment and the route it was read under: what a score's record lists (`routes`)."""

    segment: Segment
    experts: tuple[int, ...]
    weights: tuple[float, ...]
    read_sha256: str  # of the bytes the router read, its first SHORT_SHA hex digits

    def as_dict(self) -> dict:
        s = self.segment
        return {
            "window": s.start,
            "scored": list(s.scored),
            "router_read": [s.start, s.start + s.read],
            "router_sha256": self.read_sha256,
            "kind": str(s.kind),
            "experts": list(self.experts),
            "weights": list(self.weights),
        }

    def line(self) -> bytes:
        """record_line(self.as_dict()), written out directly: a score hashes one per segment."""
        s = self.segment
        a, b = s.scored
        experts, weights = ",".join(map(str, self.experts)), ",".join(map(repr, self.weights))
        return (
            f'{{"experts":[{experts}],"kind":"{s.kind}","router_read":[{s.start},{s.start + s.read}],'
            f'"router_sha256":"{self.read_sha256}","scored":[{a},{b}],"weights":[{weights}],"window":{s.start}}}\n'
        ).encode()


@dataclass(frozen=True)
class ScoreRouting:
    """A score's record of its routing: the rule, the context read, and every segment's route (listed when asked;
    `routes_sha256` always: the sha256 of their records, one canonical JSON line each)."""

    rule: Rule
    context_sha256: str
    segments: int
    routes_sha256: str
    routes: tuple[RoutedSegment, ...] | None = None

    def as_dict(self) -> dict:
        out = {
            **self.rule.as_dict(),
            "context_sha256": self.context_sha256,
            "segments": self.segments,
            "routes_sha256": self.routes_sha256,
        }
        if self.routes is not None:
            out["routes"] = [r.as_dict() for r in self.routes]
        return out


def record_line(record: dict) -> bytes:
    """A segment's record as routes_sha256 hashes it: canonical JSON, one line."""
    return json.dumps(record, sort_keys=True, separators=(",", ":")).encode() + b"\n"


def short_sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:SHORT_SHA]


@dataclass(frozen=True)
class Score:
    """A document's log-loss under the routed ensemble. nats is -sum log p over the scored bytes (FP64)."""

    bytes: int  # the document's length
    scored_bytes: int  # bytes predicted: all but the first (and but the prefix's, when one was given)
    nats: float
    windows: int  # windows it was read in (module docstring: the context each byte saw)
    experts: tuple[int, ...]  # every expert a segment of it was routed to, in order of first use
    seed_fallback: tuple[int, ...] = ()  # of those, the ones the seed model stood in for
    per_byte: np.ndarray | None = field(default=None, compare=False, repr=False)  # (scored_bytes,) nats, if asked
    context_bytes: int = 0  # the prefix's bytes (read, not scored)
    routing: ScoreRouting | None = field(default=None, compare=False, repr=False)  # what produced it
    ensemble_digest: str = ""  # RoutedLM.digest: the weights, router and rule the numbers come from

    @property
    def nats_per_byte(self) -> float | None:
        return self.nats / self.scored_bytes if self.scored_bytes else None

    @property
    def bits_per_byte(self) -> float | None:
        return None if self.nats_per_byte is None else self.nats_per_byte / LN2

    @property
    def routes(self) -> tuple[RoutedSegment, ...] | None:
        """Every segment and its route, when the score was asked for them (routes=True)."""
        return None if self.routing is None else self.routing.routes

    def as_dict(self) -> dict:
        return {
            "bytes": self.bytes,
            "scored_bytes": self.scored_bytes,
            "nats": self.nats,
            "nats_per_byte": self.nats_per_byte,
            "bits_per_byte": self.bits_per_byte,
            "windows": self.windows,
            "experts": list(self.experts),
            "seed_fallback": list(self.seed_fallback),
            "context_bytes": self.context_bytes,
            "routing": None if self.routing is None else self.routing.as_dict(),
            "ensemble_digest": self.ensemble_digest,
        }


def windows_of(chunks: Iterable[bytes], window: int, stride: int, skip: int = 0) -> Iterator[tuple[bytes, int, int]]:
    """A document read from `chunks` -> (data, first, start) per window: its bytes (`window` of them, the last
    window shorter), the index of its first scored prediction (prediction i is for byte start + i + 1) and its
    offset. Windows start at 0, stride, 2*stride, ...; a byte t >= max(1, skip) is scored in the first window that
    predicts it; a window with nothing to score is left out. Holds at most a window and a chunk in memory."""
    buf, base, start, done, eof = bytearray(), 0, 0, 0, False  # base: offset of buf[0]; bytes < done are scored
    pieces = iter(chunks)
    while True:
        while not eof and base + len(buf) <= start + window:  # a byte past the window tells whether it is the last
            piece = next(pieces, None)
            eof = piece is None
            buf += piece or b""
        data = bytes(buf[start - base : start + window - base])
        end = start + len(data)
        first = max(done, skip, 1) - start - 1
        if first < len(data) - 1:
            yield data, first, start
        done = max(done, end)
        if eof and end >= base + len(buf):
            return
        start += stride
        drop = min(start, base + len(buf)) - base
        del buf[:drop]
        base += drop


def segments_of(chunks: Iterable[bytes], rule: Rule, skip: int = 0) -> Iterator[tuple[bytes, list[Segment]]]:
    """A document read from `chunks` (its first `skip` bytes a prefix: read, not scored) -> (bytes, segments) per
    window, in order: windows_of's windows and the segments the rule reads each in (module docstring); a segment's
    bytes are the window's first end - start."""
    for data, first, start in windows_of(chunks, rule.window_bytes, rule.stride, skip):
        context = skip > 0 and start + first + 1 == skip  # the window that starts the text, after a prefix
        yield data, rule.segments(len(data), first, start, context)


def merge_runs(
    owner: Sequence[int], segments: Sequence[Segment], experts: np.ndarray, weights: np.ndarray
) -> list[tuple[int, int]]:
    """Consecutive segments of one window routed to the same experts with the same weights (experts, weights: (n, k),
    a row per segment), as runs (first, last) of indices. A run is read as one segment, Segment(first's start,
    last's end, first's first, first's read): the numbers are the same (each segment's experts read the window
    from its first byte), the passes shorter (a growing route often comes out the same as it reads on)."""
    runs: list[tuple[int, int]] = []
    for i, seg in enumerate(segments):
        if runs:
            a, b = runs[-1]
            last = segments[b]
            if (
                owner[b] == owner[i]
                and last.start == seg.start
                and last.end == seg.scored[0]
                and np.array_equal(experts[a], experts[i])
                and np.array_equal(weights[a], weights[i])
            ):
                runs[-1] = (a, i)
                continue
        runs.append((i, i))
    return runs


def joined(segments: Sequence[Segment], a: int, b: int) -> Segment:
    """The run a..b of merge_runs as one segment."""
    head, last = segments[a], segments[b]
    return Segment(head.start, last.end, head.first, head.read, head.kind)


WindowResult = np.ndarray | tuple[float, int]  # a segment's nats (per byte), or their (sum, count)


@dataclass
class Tally:
    """A document's running totals while its segments are scored; `score()` once every segment is in."""

    bytes: int = 0  # the document's length (its prefix's included)
    nats: float = 0.0
    scored: int = 0
    windows: int = 0
    experts: dict[int, None] = field(default_factory=dict)  # in order of first use
    parts: list[np.ndarray] = field(default_factory=list)  # each segment's per-byte nats, when they are kept
    context_bytes: int = 0  # the prefix: read, not scored
    routes: list[RoutedSegment] | None = None  # each segment's route, when they are kept
    segments: int = 0
    _context: object = field(default_factory=hashlib.sha256, repr=False)
    _routes: object = field(default_factory=hashlib.sha256, repr=False)
    _window: int = -1  # the start of the last segment's window

    def read(self, piece: bytes) -> bytes:
        """A chunk of the document as it is read: counted, and hashed while it is the prefix."""
        if self.bytes < self.context_bytes:
            self._context.update(piece[: self.context_bytes - self.bytes])
        self.bytes += len(piece)
        return piece

    def add(
        self,
        result: WindowResult,
        seg: Segment,
        experts: Sequence[int],
        weights: Sequence[float],
        head: bytes,
        per_byte: bool = False,
    ) -> None:
        """One scored segment: its nats (per byte, or their sum and count), the route it was read under, and `head`,
        the bytes its router read."""
        if isinstance(result, tuple):
            total, count = float(result[0]), int(result[1])
        else:
            total, count = float(result.sum()), len(result)
            if per_byte:
                self.parts.append(result)
        self.nats += total
        self.scored += count
        self.windows += seg.start != self._window
        self._window = seg.start
        for e in experts:
            self.experts.setdefault(int(e), None)
        routed = RoutedSegment(seg, tuple(map(int, experts)), tuple(map(float, weights)), short_sha(bytes(head)))
        self.segments += 1
        self._routes.update(routed.line())
        if self.routes is not None:
            self.routes.append(routed)

    def score(self, substituted: Iterable[int], per_byte: bool, rule: Rule, digest: str = "") -> Score:
        """The Score of the totals; `substituted`: the experts the seed model stands in for; `rule` and `digest`:
        what read and routed it, for its record."""
        experts = tuple(self.experts)
        missing = set(substituted)
        routing = ScoreRouting(
            rule,
            self._context.hexdigest(),
            self.segments,
            self._routes.hexdigest(),
            None if self.routes is None else tuple(self.routes),
        )
        return Score(
            self.bytes,
            self.scored,
            self.nats,
            self.windows,
            experts,
            tuple(e for e in experts if e in missing),
            np.concatenate(self.parts) if per_byte and self.parts else (np.zeros(0) if per_byte else None),
            self.context_bytes,
            routing,
            digest,
        )


@dataclass(frozen=True)
class Cut:
    """Documents, each read after its prefix, cut into segments: each segment's bytes, its first scored prediction,
    the bytes its router reads, and the document it came from. What `soma serve`'s router routes and sends to the
    expert replicas, and totals after."""

    rule: Rule
    windows: list[bytes]  # each segment's bytes: what the forward reads
    segments: list[Segment]
    owner: list[int]
    sizes: list[int]  # each document's bytes, its prefix's included
    contexts: list[bytes]  # each document's prefix

    @classmethod
    def of(cls, docs: Sequence[bytes], prefixes: Sequence[bytes], rule: Rule) -> Cut:
        windows, segments, owner = [], [], []
        for d, (p, t) in enumerate(zip(prefixes, docs, strict=True)):
            for data, segs in segments_of([p + t], rule, len(p)):
                for seg in segs:
                    windows.append(data[: seg.end - seg.start])
                    segments.append(seg)
                    owner.append(d)
        sizes = [len(p) + len(t) for p, t in zip(prefixes, docs, strict=True)]
        return cls(rule, windows, segments, owner, sizes, list(prefixes))

    def merged(self, experts: np.ndarray, weights: np.ndarray) -> tuple[Cut, list[int]]:
        """The cut with each run of merge_runs read as one segment, and the rows of `experts` and `weights` (routed
        on `heads`) that route the merged segments."""
        runs = merge_runs(self.owner, self.segments, experts, weights)
        cut = Cut(
            self.rule,
            [self.windows[b] for _, b in runs],
            [joined(self.segments, a, b) for a, b in runs],
            [self.owner[a] for a, _ in runs],
            self.sizes,
            self.contexts,
        )
        return cut, [a for a, _ in runs]

    @property
    def firsts(self) -> list[int]:
        return [s.first for s in self.segments]

    @property
    def heads(self) -> list[bytes]:
        """The bytes each segment's router reads."""
        return [w[: s.read] for w, s in zip(self.windows, self.segments, strict=True)]

    def scores(
        self,
        experts: np.ndarray,
        weights: np.ndarray,
        results: Sequence[WindowResult],
        substituted: Iterable[int],
        per_byte: bool,
        routes: bool = False,
        digest: str = "",
    ) -> list[Score]:
        """Each document's Score from its segments' `results` (in the order of `segments`) and the route each was
        read under, `experts` and `weights` (n, k); `routes`: list every segment's route in the record."""
        tallies = []
        for size, pre in zip(self.sizes, self.contexts, strict=True):
            t = Tally(context_bytes=len(pre), routes=[] if routes else None)
            t.read(pre)
            t.bytes = size
            tallies.append(t)
        heads = self.heads
        for r, res in enumerate(results):
            tallies[self.owner[r]].add(res, self.segments[r], experts[r], weights[r], heads[r], per_byte)
        subs = tuple(substituted)
        return [t.score(subs, per_byte, self.rule, digest) for t in tallies]
