"""`soma score`, `soma sample` and `soma export`: the commands over soma_cluster.inference (docs/inference.md)."""

from __future__ import annotations

import base64
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import fsspec

from pipelines.common import console, open_store
from pipelines.evaluate import in_progress
from soma_cluster.campaignfile import CONFIG_FILE
from soma_cluster.ensemble import load_models
from soma_cluster.errors import SomaError
from soma_cluster.inference.export import DTYPES, EXPORT_FILE, check_license, check_target, export
from soma_cluster.inference.generation import GenerationConfig
from soma_cluster.inference.lm import READ_BYTES, RoutedLM
from soma_cluster.jobs import expert_name
from soma_cluster.revisions import config_in_force
from soma_cluster.storage import Store, storage_options_from_env

STDIN = "-"


def load(url: str, device: str | None, step: int | None = None, threads: int | None = None) -> RoutedLM:
    """The ensemble of a campaign or an export, with what qualifies it said on stderr (say_notes)."""
    store = open_store(url)
    lm = RoutedLM.load(url, device=device, step=step, storage_options=store.storage_options, threads=threads)
    say_notes(store, lm.substituted, lm.n_experts, lm.experts)
    return lm


def say_notes(store: Store, substituted: dict, n_experts: int, present) -> None:
    """On stderr: the experts the seed model stands in for, and a campaign still being trained (its latest
    checkpoints are what is read)."""
    if substituted:
        subs = ", ".join(f"{expert_name(s.expert)} ({s.end})" for s in list(substituted.values())[:8])
        console.print(
            f"note: the seed model stands in for {len(substituted)} of {n_experts} experts with no checkpoint: "
            f"{subs}{', ...' if len(substituted) > 8 else ''}",
            markup=False,
            soft_wrap=True,
        )
    if store.exists(EXPORT_FILE):
        return
    running = in_progress(store, n_experts, present)
    if running["experts"] or running["driver"]:
        by = f"; {running['driver']} holds it" if running["driver"] else ""
        console.print(
            f"note: {store.url} is still being trained ({len(running['experts'])} expert(s) not ended{by}): "
            "their latest checkpoints are used",
            markup=False,
            soft_wrap=True,
        )


# -- soma score ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Source:
    """One input of soma score: a file (local or remote) or standard input."""

    name: str  # as the user wrote it, or the path found under a directory they named
    url: str | None  # None: standard input

    def chunks(self) -> Iterator[bytes]:
        if self.url is None:
            while piece := sys.stdin.buffer.read(READ_BYTES):
                yield piece
            return
        if "://" not in self.url:  # a local file, a FIFO or a process substitution (/dev/fd/N) alike
            with open(self.url, "rb") as f:
                while piece := f.read(READ_BYTES):
                    yield piece
            return
        fs, path = fsspec.core.url_to_fs(self.url, **storage_options_from_env(self.url))
        with fs.open(path, "rb") as f:
            while piece := f.read(READ_BYTES):
                yield piece


def sources(inputs: list[str]) -> list[Source]:
    """Every input checked before anything is scored: files as they are (FIFOs too), directories as the files under
    them (sorted; names under them that are hidden left out; links to files followed, links to directories not), -
    as standard input (once)."""
    if not inputs:
        if sys.stdin is None or sys.stdin.isatty():
            raise SomaError("no input: pass FILE ... (files or directories) or - to read standard input")
        inputs = [STDIN]
    if inputs.count(STDIN) > 1:
        raise SomaError("- (standard input) given more than once; it can be read once")
    out = []
    for name in inputs:
        if name == STDIN:
            out.append(Source(STDIN, None))
        elif not name.strip():
            raise SomaError("an input is empty; pass a file, a directory or -")
        elif "://" in name:
            out += _remote(name)
        else:
            out += _local(name)
    return out


def _local(name: str) -> list[Source]:
    try:
        if os.path.isdir(name):
            found, skipped = [], []
            for top, dirs, files in os.walk(name, onerror=_raise):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                for f in sorted(files):
                    path = os.path.join(top, f)
                    if f.startswith("."):
                        continue
                    (found if os.path.isfile(path) else skipped).append(path)  # a dangling or looping link: not
            if skipped:
                console.print(
                    f"note: {len(skipped)} name(s) under {name} lead to no file (dangling or looping links), skipped: "
                    + ", ".join(skipped[:3]),
                    markup=False,
                    soft_wrap=True,
                )
            if not found:
                raise SomaError(f"{name} is a directory with no files to score; pass files or a directory of them")
            return [Source(p, p) for p in found]
        if os.path.exists(name):
            return [Source(name, name)]
        if os.path.lexists(name):
            raise SomaError(f"{name} is a link that leads to no file; pass the file it should name")
        raise SomaError(f"{name} not found; pass an existing file or directory (or - for standard input)")
    except PermissionError:
        raise SomaError(f"{name} cannot be read (permission denied); check its permissions") from None
    except OSError as exc:
        raise SomaError(f"{name} cannot be listed ({exc.strerror or exc}); pass files or a directory of them") from None


def _raise(exc: OSError) -> None:
    raise exc


def _remote(name: str) -> list[Source]:
    fs, path = fsspec.core.url_to_fs(name, **storage_options_from_env(name))
    if fs.isdir(path):
        found = sorted(p for p in fs.find(path) if not any(x.startswith(".") for x in p[len(path) :].split("/")))
        if not found:
            raise SomaError(f"{name} is a directory with no files to score; pass files or a directory of them")
        return [Source(fs.unstrip_protocol(p), fs.unstrip_protocol(p)) for p in found]
    if fs.isfile(path):
        return [Source(name, name)]
    raise SomaError(f"{name} not found; pass an existing file or directory (or - for standard input)")


class Lines:
    """The lines of a stream as documents, each an iterator of its chunks (without its newline, \n or \r\n): a
    line of any length is read in bounded memory, as a whole file is. Each line must be read to its end before the
    next (score_streams does)."""

    def __init__(self, chunks: Iterator[bytes]):
        self.pieces, self.buf, self.done = iter(chunks), b"", False

    def _fill(self) -> bool:
        piece = next(self.pieces, None)
        if piece is None:
            self.done = True
            return False
        self.buf += piece
        return True

    def __iter__(self) -> Iterator[Iterator[bytes]]:
        while self.buf or (not self.done and self._fill()):
            line = self._line()
            yield line
            for _ in line:  # a line left unread is skipped to its end
                pass

    def _line(self) -> Iterator[bytes]:
        while True:
            i = self.buf.find(b"\n")
            if i >= 0:
                piece, self.buf = self.buf[:i], self.buf[i + 1 :]
                yield piece.removesuffix(b"\r")
                return
            hold = 1 if self.buf.endswith(b"\r") else 0  # maybe the \r of a \r\n split between two chunks
            if len(self.buf) > hold:
                yield self.buf[: len(self.buf) - hold]
                self.buf = self.buf[len(self.buf) - hold :]
            if not self._fill():
                yield self.buf.removesuffix(b"\r")
                self.buf = b""
                return


@dataclass(frozen=True)
class Listed:
    """What soma score's records list besides the totals and the routing summary."""

    per_byte: bool = False  # each scored byte's nats
    routes: bool = False  # every segment's route


def score(
    url: str, inputs: list[str], lines: bool, device: str | None, step: int | None, listed: Listed, threads=None
) -> dict:
    """JSON Lines on stdout, one record per document as soon as it is scored; the totals returned (for stderr)."""
    srcs = sources(inputs)
    lm = load(url, device, step, threads)
    docs: list[tuple[str, int | None]] = []

    def documents() -> Iterator[Iterator[bytes]]:
        for src in srcs:
            if lines:
                for n, line in enumerate(Lines(src.chunks()), start=1):
                    docs.append((src.name, n))
                    yield line
            else:
                docs.append((src.name, None))
                yield src.chunks()

    nats = scored = total = count = 0
    for i, s in enumerate(lm.score_streams(documents(), per_byte=listed.per_byte, routes=listed.routes)):
        name, line = docs[i]
        rec = {"source": name, **({"line": line} if line is not None else {}), **s.as_dict()}
        if listed.per_byte:
            rec["per_byte"] = s.per_byte.tolist()
        sys.stdout.write(json.dumps(rec) + "\n")
        sys.stdout.flush()
        nats, scored, total, count = nats + s.nats, scored + s.scored_bytes, total + s.bytes, count + 1
    return {"documents": count, "bytes": total, "scored_bytes": scored, "nats": nats}


# -- soma sample --------------------------------------------------------------------------------------------------
def prompts(given: list[str], prompt_file: str | None) -> list[bytes]:
    """--prompt (each one a prompt) or --prompt-file (the file, or standard input with -, is one prompt)."""
    if prompt_file is None:
        return [p.encode("utf-8", "surrogateescape") for p in given] or [b""]
    if prompt_file == STDIN:
        return [sys.stdin.buffer.read()]
    if not os.path.exists(prompt_file) or os.path.isdir(prompt_file):
        raise SomaError(f"--prompt-file {prompt_file} is not a file; pass a file (or - for standard input)")
    try:
        with open(prompt_file, "rb") as f:
            return [f.read()]
    except OSError as exc:
        raise SomaError(f"--prompt-file {prompt_file} cannot be read ({exc.strerror}); check it") from None


def sample(lm: RoutedLM, texts: list[bytes], config: GenerationConfig, as_json: bool, write_bytes) -> None:
    """One prompt without --json: its bytes streamed to stdout as they are drawn. Several, or --json: one JSON line
    per prompt once the batch is done."""
    for t in texts:
        kept = lm.prompt_kept(t)
        if len(t) > len(kept):
            console.print(
                f"note: a prompt of {len(t):,} bytes is longer than the model's context; generation reads its last "
                f"{len(kept):,} bytes",
                markup=False,
                soft_wrap=True,
            )
    if len(texts) == 1 and not as_json:
        for piece in lm.stream(texts[0], config):
            write_bytes(piece)
        return
    outs = lm.generate(texts, config)
    for t, o in zip(texts, outs, strict=True):
        rec = {
            "prompt": t.decode("utf-8", "replace"),
            "text": o.decode("utf-8", "replace"),
            "base64": base64.b64encode(o).decode(),
            "bytes": len(o),
            "prompt_bytes_read": len(lm.prompt_kept(t)) if t else 0,
            "route": lm.route(lm.prompt_kept(t)).as_dict(),
        }
        sys.stdout.write(json.dumps(rec) + "\n")
        sys.stdout.flush()


# -- soma export --------------------------------------------------------------------------------------------------
def export_campaign(url: str, directory: str, dtype: str, license: str = "other") -> dict:
    """The campaign's latest checkpoints as an export directory (soma_cluster.inference.export); `license`: its
    model card's."""
    if dtype not in DTYPES:
        raise SomaError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    check_license(license)
    src = open_store(url)
    if src.exists(EXPORT_FILE):
        raise SomaError(f"{url} is an export already; soma export reads a campaign (soma prepare makes one)")
    if not src.exists(CONFIG_FILE):
        raise SomaError(f"{url} is not a campaign (soma prepare makes one, soma launch trains it)")
    if not directory.strip() or (directory.startswith("/") and not directory.strip("/")):
        raise SomaError(f"{directory!r} is not a directory an export can be (the root, or empty); pass a new one")
    dest = Store(directory, storage_options_from_env(directory))
    if _inside(src, dest):
        raise SomaError(f"{directory} is inside the campaign {url}; pass a directory outside it to soma export")
    check_target(dest)  # before the checkpoints are read
    cfg = config_in_force(src)
    models = load_models(src, cfg.n_experts)
    say_notes(src, models.substituted, cfg.n_experts, models.checkpoints)
    return export(src, cfg, models, dest, dtype, license)


def _inside(src: Store, dest: Store) -> bool:
    if not (src.local and dest.local):
        return dest.url.rstrip("/").startswith(src.url.rstrip("/") + "/")
    a, b = os.path.realpath(src.root), os.path.realpath(dest.root)
    return b == a or b.startswith(a + os.sep)
