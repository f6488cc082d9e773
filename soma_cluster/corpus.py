"""Documents in, fixed-size byte sequences out.

The built-in corpus is real text already on the machine (Python's own docs and sources, license
texts, man/info pages and package docs where present); nothing is downloaded. A user corpus is a
local or s3:// path: a directory of text files, or .txt/.md, .jsonl, .parquet, .arrow files.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import re
import stat
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import fsspec
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from soma_cluster.config import CorpusConfig
from soma_cluster.errors import SomaError
from soma_cluster.storage import storage_options_from_env, transient_errors, with_s3_defaults

MIN_DOC_BYTES = 64
MAX_DOC_BYTES = 256_000
SEPARATOR = b"\n\n"


@dataclass(frozen=True)
class Document:
    doc_id: str  # stable name (path, topic, row) used for the test split and the bootstrap
    source: str  # which built-in source or user file it came from
    data: bytes


def _stable_order(paths: Iterable[Path]) -> list[Path]:
    """A machine-independent shuffle of a file list, so a capped corpus mixes its sources' topics."""
    return sorted(paths, key=lambda p: hashlib.sha1(str(p).encode()).digest())


def _read_maybe_gz(path: Path) -> bytes:
    raw = path.read_bytes()
    return gzip.decompress(raw) if path.suffix == ".gz" else raw


_TROFF = re.compile(rb"\\f[BIRP]|\\\(..|\\[-e&|^]|\\s[-+]?\d")


def _clean_troff(data: bytes) -> bytes:
    """Man pages are troff: drop comments and macro names, keep the words."""
    out = []
    for line in data.split(b"\n"):
        if line.startswith(b'.\\"') or line.startswith(b"'\\\""):
            continue
        if line.startswith(b"."):
            line = line.split(b" ", 1)[1] if b" " in line else b""
        out.append(_TROFF.sub(b"", line))
    return b"\n".join(out)


def _files(
    root: Path,
    pattern: str,
    reader: Callable[[Path], bytes],
    source: str,
    skip: Callable[[Path], bool] = lambda p: False,
) -> Iterator[Document]:
    if not root.is_dir():
        return
    for path in _stable_order(p for p in root.glob(pattern) if p.is_file() and not p.is_symlink() and not skip(p)):
        try:
            data = reader(path)
        except (OSError, EOFError, gzip.BadGzipFile):
            continue
        if len(data) >= MIN_DOC_BYTES:
            yield Document(f"{source}:{path}", source, data)


def _pydoc_topics() -> Iterator[Document]:
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return
    for name in sorted(topics):
        yield Document(f"pydoc:{name}", "pydoc-topics", topics[name].encode())


def builtin_sources() -> dict[str, Iterator[Document]]:
    """Every source of real text this machine has; missing ones simply yield nothing."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    purelib = Path(sysconfig.get_paths()["purelib"])
    skip_tests = lambda p: "test" in p.parts or "tests" in p.parts or "site-packages" in p.parts  # noqa: E731
    return {
        "pydoc-topics": _pydoc_topics(),
        "python-stdlib": _files(stdlib, "**/*.py", Path.read_bytes, "python-stdlib", skip_tests),
        "licenses": _files(purelib, "*.dist-info/**/LICENSE*", Path.read_bytes, "licenses"),
        "common-licenses": _files(Path("/usr/share/common-licenses"), "*", Path.read_bytes, "common-licenses"),
        "man-pages": _files(
            Path("/usr/share/man"), "man[1-8]/*.gz", lambda p: _clean_troff(_read_maybe_gz(p)), "man-pages"
        ),
        "info-pages": _files(Path("/usr/share/info"), "*.gz", _read_maybe_gz, "info-pages"),
        "package-docs": _files(Path("/usr/share/doc"), "*/*", _read_maybe_gz, "package-docs"),
    }


def builtin_documents(max_bytes: int, counts: dict[str, int] | None = None) -> Iterator[Document]:
    """Mix the sources by bytes (next document from the source with the fewest bytes so far) until
    max_bytes; `counts` receives the bytes taken per source. Documents are capped at MAX_DOC_BYTES so
    a few huge files (info manuals, changelogs) cannot crowd out the rest."""
    live = builtin_sources()
    taken = dict.fromkeys(live, 0)
    total = 0
    while live and total < max_bytes:
        name = min(live, key=lambda n: taken[n])
        doc = next(live[name], None)
        if doc is None:
            del live[name]
            continue
        data = doc.data[: min(MAX_DOC_BYTES, max_bytes - total)]
        taken[name] += len(data)
        total += len(data)
        yield Document(doc.doc_id, doc.source, data)
    if counts is not None:
        counts.update({k: v for k, v in taken.items() if v})


# -- user corpora -----------------------------------------------------------------------------------------
def _text_batches(fh, name: str, field: str, where: str) -> Iterator[pa.RecordBatch]:
    """The column `field` of a Parquet or Arrow IPC file, one record batch (row group) at a time, so a file
    larger than memory streams like a JSONL one."""
    try:
        if name.endswith(".parquet"):
            pf = pq.ParquetFile(fh)
            names, groups, unit = pf.schema_arrow.names, pf.num_row_groups, "row group"
            batches = lambda g: pf.iter_batches(batch_size=4096, columns=[field], row_groups=[g])  # noqa: E731
        else:
            reader = ipc.open_file(fh)
            names, groups, unit = reader.schema.names, reader.num_record_batches, "record batch"
            batches = lambda g: [reader.get_batch(g).select([field])]  # noqa: E731
    except (pa.ArrowInvalid, OSError) as exc:
        raise SomaError(f"corpus file {where} is not readable {name.rsplit('.', 1)[-1]} ({exc}); replace it") from None
    if field not in names:
        raise SomaError(f"corpus file {where} has no column {field!r}; set corpus.text_field to one of {names}")
    for g in range(groups):
        try:
            yield from batches(g)
        except (pa.ArrowInvalid, OSError) as exc:
            raise SomaError(
                f"corpus file {where} {unit} {g} of {groups} is not readable ({exc}); replace the file"
            ) from None


def _text_rows(batch: pa.RecordBatch) -> Iterator[str]:
    for value in batch.column(0).to_pylist():
        if isinstance(value, str):
            yield value
        elif isinstance(value, bytes):
            yield value.decode("utf-8", errors="ignore")


SNIFF_BYTES = 8192
# C0 control bytes that text does not use (tab, newlines, form feed, backspace and escape are kept out), and DEL
_CONTROL = bytes(sorted(set(range(32)) - set(b"\t\n\v\f\r\b\x1b"))) + b"\x7f"
_NOT_CONTROL = bytes(sorted(set(range(256)) - set(_CONTROL)))
MAX_CONTROL_SHARE = 0.05
SKIP_NUL, SKIP_CONTROL, SKIP_EMPTY = "not text (NUL bytes)", "not text (control bytes)", "empty"


def not_text(head: bytes) -> str | None:
    """Why the first SNIFF_BYTES of a file say it is not text, or None if they look like text.

    A NUL byte is the mark of binary data (git's and Perl's test): 8 KiB of compressed or random bytes
    hold one with probability 1 - (255/256)^8192 > 1 - 1e-13. Failing that, more than 5% control bytes
    (random bytes without NUL: 10%; text: ~0). Bytes >= 0x80 are not counted: Latin-1, GBK or Shift-JIS
    text is text to a byte-level model even where it is not UTF-8.
    """
    if b"\x00" in head:
        return SKIP_NUL
    if head and len(head.translate(None, _NOT_CONTROL)) > MAX_CONTROL_SHARE * len(head):
        return SKIP_CONTROL
    return None


_SPECIAL = (
    (stat.S_ISFIFO, "FIFO (named pipe)"),
    (stat.S_ISSOCK, "socket"),
    (stat.S_ISCHR, "character device"),
    (stat.S_ISBLK, "block device"),
    (stat.S_ISDIR, "directory"),
)


def _require_regular(path: str, root: bool = False) -> None:
    """A local corpus path is a regular file, found by stat alone: opening a FIFO blocks until a writer comes,
    and a device never ends."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise SomaError(
            f"corpus file {path} is a broken symbolic link (or vanished); remove it or point it at a file"
        ) from None
    except OSError as exc:
        raise SomaError(
            f"corpus file {path} cannot be read ({type(exc).__name__}); fix its permissions or remove it"
        ) from None
    for test, kind in _SPECIAL:
        if test(mode):
            fix = "pass a text file or a directory of them" if root else "remove it from the corpus directory"
            raise SomaError(f"corpus path {path} is a {kind}, not a regular file; {fix}")


def _jsonl_docs(fh, path: str, name: str, kind: str, field: str) -> Iterator[Document]:
    for i, line in enumerate(io.TextIOWrapper(fh, encoding="utf-8", errors="ignore")):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise SomaError(f"corpus file {path} line {i + 1} is not JSON; fix or remove that line") from None
        text = row.get(field) if isinstance(row, dict) else None
        if isinstance(text, str):
            yield Document(f"{name}:{i}", kind, text.encode())


def _user_file_docs(
    fs: fsspec.AbstractFileSystem, path: str, name: str, field: str, skipped: dict[str, list[str]]
) -> Iterator[Document]:
    """The documents of one corpus file; `name` (its path relative to the corpus root) keys them, so the
    test split and the shards do not depend on where the corpus lives. A file that is not text is skipped
    and listed in `skipped` by reason."""
    base = name.rsplit("/", 1)[-1]
    kind = base.split(".", 1)[1] if "." in base else "text"  # bytes are reported per file kind
    if base.endswith(".parquet") or base.endswith(".arrow"):
        with fs.open(path, "rb") as fh:
            i = 0
            for batch in _text_batches(fh, base, field, path):
                for text in _text_rows(batch):
                    yield Document(f"{name}:{i}", kind, text.encode())
                    i += 1
        return
    with fs.open(path, "rb", compression="infer") as fh:
        head = fh.read(SNIFF_BYTES)
        why = SKIP_EMPTY if not head else not_text(head)
        if why:
            skipped.setdefault(why, []).append(name)
            return
        if base.endswith(".jsonl") or base.endswith(".jsonl.gz"):
            fh.seek(0)
            yield from _jsonl_docs(fh, path, name, kind, field)
        else:
            yield Document(name, kind, head + fh.read())


def _corpus_files(fs: fsspec.AbstractFileSystem, source: str, root: str) -> list[tuple[str, str, int]]:
    """(path, path relative to the corpus root, size in bytes) of every file to read, in relative-path
    order. A local special file (FIFO, socket, device) or broken link is refused here, before any file is
    opened."""
    try:
        info = fs.info(root)
    except FileNotFoundError:
        raise SomaError(
            f"corpus path {source} not found; pass an existing directory or file (or corpus.source=builtin)"
        ) from None
    except (PermissionError, *transient_errors()) as exc:
        raise SomaError(
            f"corpus path {source} cannot be read ({type(exc).__name__}); check the path, its permissions "
            f"and, for s3://, the endpoint (SOMA_S3_ENDPOINT) and credentials"
        ) from None
    is_dir = info["type"] == "directory"
    if is_dir:
        base = root.rstrip("/")
        found = fs.find(base, detail=True)
        files = [(p, p[len(base) :].lstrip("/"), int(d.get("size") or 0)) for p, d in found.items()]
        files = sorted(
            ((p, rel, n) for p, rel, n in files if not rel.rsplit("/", 1)[-1].startswith(".")), key=lambda f: f[1]
        )
    else:
        files = [(root, root.rstrip("/").rsplit("/", 1)[-1], int(info.get("size") or 0))]
    if _is_local(fs):
        if not is_dir:
            _require_regular(root, root=True)
        for path, _, _ in files:
            _require_regular(path)
    return files


def _is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


def corpus_fs(cfg: CorpusConfig) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem and root path of a user corpus (options from the environment and the config)."""
    options = with_s3_defaults(
        cfg.source, {**storage_options_from_env(cfg.source), **cfg.storage_options}, botocore_attempts=3
    )
    return fsspec.core.url_to_fs(cfg.source, **options)


# -- parts: the unit of reading, packing and sampling ---------------------------------------------------------
@dataclass(frozen=True)
class CorpusFile:
    path: str  # as the corpus's filesystem names it
    name: str  # relative to the corpus root: the key of its documents (test split, shards)
    budget: int  # document bytes it may give: corpus.max_bytes less the on-disk sizes of the files before it


@dataclass(frozen=True)
class Part:
    """Consecutive corpus files (relative-path order) of about prepare.part_bytes on disk, packed on their own:
    a sequence never spans two parts. No files: the built-in corpus, one part, read where the driver runs."""

    index: int
    files: tuple[CorpusFile, ...] = ()

    @property
    def builtin(self) -> bool:
        return not self.files


def plan_parts(cfg: CorpusConfig, part_bytes: int) -> list[Part]:
    """The corpus's parts. corpus.max_bytes is applied file by file, the same in every engine and without
    reading anything: a file is read if the files before it hold fewer bytes on disk than the cap, and gives
    documents until their bytes reach what the cap leaves (the document that reaches it is kept whole)."""
    if cfg.source == "builtin":
        return [Part(0)]
    fs, root = corpus_fs(cfg)
    parts: list[Part] = []
    group: list[CorpusFile] = []
    before = grouped = 0
    for path, name, size in _corpus_files(fs, cfg.source, root):
        if before >= cfg.max_bytes:
            break
        group.append(CorpusFile(path, name, cfg.max_bytes - before))
        before += size
        grouped += size
        if grouped >= part_bytes:
            parts.append(Part(len(parts), tuple(group)))
            group, grouped = [], 0
    if group:
        parts.append(Part(len(parts), tuple(group)))
    return parts


def part_documents(
    cfg: CorpusConfig, part: Part, counts: dict[str, int] | None = None, skipped: dict[str, list[str]] | None = None
) -> Iterator[Document]:
    """The documents of one part; `counts` receives bytes per source or file kind, `skipped` the files left
    out, by reason."""
    if part.builtin:
        yield from builtin_documents(cfg.max_bytes, counts)
        return
    fs, _ = corpus_fs(cfg)
    skipped = {} if skipped is None else skipped
    for f in part.files:
        total = 0
        try:
            for doc in _user_file_docs(fs, f.path, f.name, cfg.text_field, skipped):
                if not doc.data:
                    continue
                total += len(doc.data)
                if counts is not None:
                    counts[doc.source] = counts.get(doc.source, 0) + len(doc.data)
                yield doc
                if total >= f.budget:
                    break
        except (EOFError, zlib.error, *transient_errors()) as exc:  # OSError: permissions, a bad .gz, the store
            raise SomaError(
                f"corpus file {f.path} cannot be read ({type(exc).__name__}); fix or remove it (for s3://, "
                f"check the endpoint SOMA_S3_ENDPOINT and the credentials)"
            ) from None


def no_text_error(cfg: CorpusConfig, skipped: dict[str, list[str]]) -> SomaError:
    return SomaError(
        f"corpus {cfg.source} holds no text{describe_skipped(skipped, names=3)}; point corpus.source "
        f"at text files (.txt, .md, .jsonl, .parquet, .arrow)"
    )


def user_documents(cfg: CorpusConfig, skipped: dict[str, list[str]] | None = None) -> Iterator[Document]:
    """The documents of a user corpus, capped as plan_parts says; files that are not text (or are empty) are
    skipped and listed in `skipped` by reason. A corpus with no text is an error naming the files."""
    skipped = {} if skipped is None else skipped
    total = 0
    for part in plan_parts(cfg, part_bytes=1 << 62):
        for doc in part_documents(cfg, part, None, skipped):
            total += len(doc.data)
            yield doc
    if total == 0:
        raise no_text_error(cfg, skipped)


def describe_skipped(skipped: dict[str, list[str]], names: int = 0) -> str:
    """'; skipped 3 files: not text (NUL bytes) 2 (a.bin, b.bin), empty 1 (c.txt)', or '' if none was."""
    n = sum(len(v) for v in skipped.values())
    if not n:
        return ""
    parts = []
    for why, files in sorted(skipped.items(), key=lambda kv: -len(kv[1])):
        shown = ", ".join(files[:names]) + (", ..." if len(files) > names else "") if names else ""
        parts.append(f"{why} {len(files)}" + (f" ({shown})" if shown else ""))
    return f"; skipped {n} file{'s' if n > 1 else ''}: " + ", ".join(parts)


def documents(
    cfg: CorpusConfig, counts: dict[str, int] | None = None, skipped: dict[str, list[str]] | None = None
) -> Iterator[Document]:
    """The corpus's documents; `counts` receives bytes per source or file kind, `skipped` the user files
    left out, by reason."""
    if cfg.source == "builtin":
        yield from builtin_documents(cfg.max_bytes, counts)
        return
    for doc in user_documents(cfg, skipped):
        if counts is not None:
            counts[doc.source] = counts.get(doc.source, 0) + len(doc.data)
        yield doc


# -- splitting and packing --------------------------------------------------------------------------------
def is_test_doc(doc_id: str, fraction: float, seed: int) -> bool:
    h = int.from_bytes(hashlib.sha256(f"{seed}:{doc_id}".encode()).digest()[:8], "big")
    return h / 2**64 < fraction


class Packer:
    """Joins documents with a separator and cuts the stream into fixed-size byte chunks.

    Each chunk comes with the index of the document that owns byte `owner_at` of it (for evaluation
    windows: the first scored target), so a bootstrap can resample by document.
    """

    def __init__(self, size: int, owner_at: int = 0):
        self.size, self.owner_at = size, owner_at
        self.buf = bytearray()
        self.owners: list[tuple[int, int]] = []  # (start offset in buf, doc index), ascending
        self.n_docs = 0

    def add(self, data: bytes) -> Iterator[tuple[bytes, int]]:
        self.owners.append((len(self.buf), self.n_docs))
        self.n_docs += 1
        self.buf += data + SEPARATOR
        while len(self.buf) >= self.size:
            owner = [d for s, d in self.owners if s <= self.owner_at][-1]
            yield bytes(self.buf[: self.size]), owner
            del self.buf[: self.size]
            shifted = [(s - self.size, d) for s, d in self.owners]
            started = [d for s, d in shifted if s <= 0]
            self.owners = [(0, started[-1])] + [(s, d) for s, d in shifted if s > 0]


def describe_counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))
