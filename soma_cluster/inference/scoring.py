"""Documents as soma eval reads them: cut into windows, each window's nats totalled into its document's Score.

No torch: the model's part (the nats of a window's bytes) is RoutedLM.forward's; this module decides which windows a
document is read in, which of their predictions count, and how they add up. `soma serve`'s router cuts and totals
here while its expert replicas run the forward (pipelines/serve_app.py).

Windows of eval.window_bytes (1,025) bytes start every window_bytes - 1 - eval.context_bytes (768) bytes; a byte
t >= 1 is scored in the first window that predicts it (prediction i of a window starting at s is for byte s + i + 1),
so every byte after the first is scored exactly once. A prefix is read and routed on, not scored.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

LN2 = math.log(2)
Text = str | bytes | bytearray | memoryview


def as_bytes(text: Text) -> bytes:
    """Text as the model reads it: a str as UTF-8; bytes as they are (any bytes are valid input to a byte model)."""
    if isinstance(text, str):
        return text.encode("utf-8", errors="surrogateescape")
    if isinstance(text, (bytes, bytearray, memoryview)):
        return bytes(text)
    raise TypeError(f"text must be str or bytes, not {type(text).__name__}")


@dataclass(frozen=True)
class Score:
    """A document's log-loss under the routed ensemble. nats is -sum log p over the scored bytes (FP64)."""

    bytes: int  # the document's length
    scored_bytes: int  # bytes predicted: all but the first (and but the prefix's, when one was given)
    nats: float
    windows: int  # windows it was read in (module docstring: the context each byte saw)
    experts: tuple[int, ...]  # every expert a window of it was routed to, in order of first use
    seed_fallback: tuple[int, ...] = ()  # of those, the ones the seed model stood in for
    per_byte: np.ndarray | None = field(default=None, compare=False, repr=False)  # (scored_bytes,) nats, if asked

    @property
    def nats_per_byte(self) -> float | None:
        return self.nats / self.scored_bytes if self.scored_bytes else None

    @property
    def bits_per_byte(self) -> float | None:
        return None if self.nats_per_byte is None else self.nats_per_byte / LN2

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


@dataclass
class Tally:
    """A document's running totals while its windows are scored; `score()` once every window is in."""

    bytes: int = 0  # the document's length (its prefix's included)
    nats: float = 0.0
    scored: int = 0
    windows: int = 0
    experts: dict[int, None] = field(default_factory=dict)  # in order of first use
    parts: list[np.ndarray] = field(default_factory=list)  # each window's per-byte nats, when they are kept

    def add(self, nats: np.ndarray, experts: Iterable[int], per_byte: bool) -> None:
        """One scored window: the nats of its scored bytes and the experts it was routed to."""
        self.add_total(float(nats.sum()), len(nats), experts)
        if per_byte:
            self.parts.append(nats)

    def add_total(self, total: float, count: int, experts: Iterable[int]) -> None:
        """add() from a window's summed nats and scored bytes (what crosses the network when no per-byte nats are
        asked for)."""
        self.nats += total
        self.scored += count
        self.windows += 1
        for e in experts:
            self.experts.setdefault(int(e), None)

    def score(self, substituted: Iterable[int], per_byte: bool) -> Score:
        """The Score of the totals; `substituted`: the experts the seed model stands in for."""
        experts = tuple(self.experts)
        missing = set(substituted)
        return Score(
            self.bytes,
            self.scored,
            self.nats,
            self.windows,
            experts,
            tuple(e for e in experts if e in missing),
            np.concatenate(self.parts) if per_byte and self.parts else (np.zeros(0) if per_byte else None),
        )


WindowResult = np.ndarray | tuple[float, int]  # a window's nats (per byte), or their (sum, count)


@dataclass(frozen=True)
class Cut:
    """Documents, each read after its prefix, cut into windows: each window's bytes, its first scored prediction
    and the document it came from. What `soma serve`'s router sends to the expert replicas, and totals after."""

    windows: list[bytes]
    firsts: list[int]
    owner: list[int]
    sizes: list[int]  # each document's bytes, its prefix's included

    @classmethod
    def of(cls, docs: Sequence[bytes], prefixes: Sequence[bytes], window: int, stride: int) -> Cut:
        windows, firsts, owner = [], [], []
        for d, (p, t) in enumerate(zip(prefixes, docs, strict=True)):
            for data, first, _ in windows_of([p + t], window, stride, len(p)):
                windows.append(data)
                firsts.append(first)
                owner.append(d)
        return cls(windows, firsts, owner, [len(p) + len(t) for p, t in zip(prefixes, docs, strict=True)])

    def scores(
        self, experts: np.ndarray, results: Sequence[WindowResult], substituted: Iterable[int], per_byte: bool
    ) -> list[Score]:
        """Each document's Score from its windows' `results` (in the order of `windows`) and the experts each window
        was routed to, `experts` (n, k)."""
        tallies = [Tally(size) for size in self.sizes]
        for r, res in enumerate(results):
            if per_byte:
                tallies[self.owner[r]].add(res, experts[r], per_byte)
            else:
                tallies[self.owner[r]].add_total(res[0], res[1], experts[r])
        subs = tuple(substituted)
        return [t.score(subs, per_byte) for t in tallies]
