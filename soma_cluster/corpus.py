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
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import fsspec
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from soma_cluster.config import CorpusConfig
from soma_cluster.errors import SomaError
from soma_cluster.storage import storage_options_from_env

MIN_DOC_BYTES = 64
MAX_DOC_BYTES = 256_000
SEPARATOR = b"\n\n"


@dataclass(frozen=True)
class Document:
    doc_id: str      # stable name (path, topic, row) used for the test split and the bootstrap
    source: str      # which built-in source or user file it came from
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


def _files(root: Path, pattern: str, reader: Callable[[Path], bytes], source: str, skip: Callable[[Path], bool] = lambda p: False) -> Iterator[Document]:
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
        "man-pages": _files(Path("/usr/share/man"), "man[1-8]/*.gz", lambda p: _clean_troff(_read_maybe_gz(p)), "man-pages"),
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
            names, batches = pf.schema_arrow.names, lambda: pf.iter_batches(batch_size=4096, columns=[field])
        else:
            reader = ipc.open_file(fh)
            names, batches = reader.schema.names, lambda: (reader.get_batch(i).select([field]) for i in range(reader.num_record_batches))
        if field not in names:
            raise SomaError(f"corpus file {where} has no column {field!r}; set corpus.text_field to one of {names}")
        yield from batches()
    except (pa.ArrowInvalid, OSError) as exc:
        raise SomaError(f"corpus file {where} is not readable {name.rsplit('.', 1)[-1]} ({exc}); replace it") from None


def _text_rows(batch: pa.RecordBatch) -> Iterator[str]:
    for value in batch.column(0).to_pylist():
        if isinstance(value, str):
            yield value
        elif isinstance(value, bytes):
            yield value.decode("utf-8", errors="ignore")


def _user_file_docs(fs: fsspec.AbstractFileSystem, path: str, field: str) -> Iterator[Document]:
    name = path.rsplit("/", 1)[-1]
    kind = name.split(".", 1)[1] if "." in name else "text"     # bytes are reported per file kind
    if name.endswith(".jsonl") or name.endswith(".jsonl.gz"):
        with fs.open(path, "rb", compression="infer") as fh:
            for i, line in enumerate(io.TextIOWrapper(fh, encoding="utf-8", errors="ignore")):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    raise SomaError(f"corpus file {path} line {i + 1} is not JSON; fix or remove that line") from None
                text = row.get(field) if isinstance(row, dict) else None
                if isinstance(text, str):
                    yield Document(f"{path}:{i}", kind, text.encode())
        return
    if name.endswith(".parquet") or name.endswith(".arrow"):
        with fs.open(path, "rb") as fh:
            i = 0
            for batch in _text_batches(fh, name, field, path):
                for text in _text_rows(batch):
                    yield Document(f"{path}:{i}", kind, text.encode())
                    i += 1
        return
    with fs.open(path, "rb", compression="infer") as fh:
        yield Document(path, kind, fh.read())


def user_documents(cfg: CorpusConfig) -> Iterator[Document]:
    fs, root = fsspec.core.url_to_fs(cfg.source, **{**storage_options_from_env(cfg.source), **cfg.storage_options})
    if not fs.exists(root):
        raise SomaError(f"corpus path {cfg.source} not found; pass an existing directory or file (or corpus.source=builtin)")
    paths = sorted(p for p in fs.find(root) if not p.rsplit("/", 1)[-1].startswith(".")) if fs.isdir(root) else [root]
    total = 0
    for path in paths:
        for doc in _user_file_docs(fs, path, cfg.text_field):
            if len(doc.data) < 1:
                continue
            total += len(doc.data)
            yield doc
            if total >= cfg.max_bytes:
                return


def documents(cfg: CorpusConfig, counts: dict[str, int] | None = None) -> Iterator[Document]:
    if cfg.source == "builtin":
        yield from builtin_documents(cfg.max_bytes, counts)
        return
    for doc in user_documents(cfg):
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
        self.owners: list[tuple[int, int]] = []   # (start offset in buf, doc index), ascending
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
