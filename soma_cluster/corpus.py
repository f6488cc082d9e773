"""Documents in, fixed-size byte sequences out.

The built-in corpus is real text already on the machine (Python's own docs and sources, license
texts, man/info pages and package docs where present); nothing is downloaded. A user corpus is a
local or s3:// path: a file or a directory of files, each read in the format its name says (FORMATS:
plain text, JSONL, either also .gz/.bz2/.xz, Parquet, Arrow IPC). docs/prepare.md says what a document
is in each.
"""

from __future__ import annotations

import codecs
import errno
import gzip
import hashlib
import itertools
import json
import lzma
import os
import re
import stat
import sysconfig
import zlib
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import fsspec
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from soma_cluster.config import CorpusConfig
from soma_cluster.errors import SomaError
from soma_cluster.formats import Format, Layout, format_of
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


# -- user corpora: naming and errors -------------------------------------------------------------------
def shown(path: str) -> str:
    """A path as one line of text shows it: bytes that are not UTF-8 (a POSIX name may hold any) escaped as
    \\xNN, control characters as Python escapes them, so an error line can always be printed and read."""
    text = os.fsencode(path).decode("utf-8", "backslashreplace")
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def corpus_error(path: str, what: str, fix: str) -> SomaError:
    """The one line about a corpus file: its name, what is wrong (a library's multi-line message joined), the fix."""
    return SomaError(f"corpus file {shown(path)} {' '.join(what.split())}; {fix}")


# -- user corpora: bytes to documents ---------------------------------------------------------------------
BLOCK_BYTES = 1 << 20  # read size of a streamed file
_BOMS = (  # an encoding marker at the start of a text or JSONL file: UTF-32 before UTF-16 (FF FE 00 00 starts both)
    (codecs.BOM_UTF8, None),
    (codecs.BOM_UTF32_LE, "utf-32"),
    (codecs.BOM_UTF32_BE, "utf-32"),
    (codecs.BOM_UTF16_LE, "utf-16"),
    (codecs.BOM_UTF16_BE, "utf-16"),
)


def _utf8_blocks(fh) -> Iterator[bytes]:
    """A file's bytes in blocks, an encoding marker taken off: after a UTF-8 BOM the bytes as they are (the BOM
    dropped), after a UTF-16/32 BOM the text transcoded to UTF-8 (undecodable units become U+FFFD); without one,
    the bytes as they are (Latin-1 or GBK text stays as it is)."""
    first = fh.read(BLOCK_BYTES)
    encoding = None
    for bom, enc in _BOMS:
        if first.startswith(bom):
            encoding, first = enc, (first[len(bom) :] if enc is None else first)
            break
    if encoding is None:
        block = first
        while block:
            yield block
            block = fh.read(BLOCK_BYTES)
        return
    decoder = codecs.getincrementaldecoder(encoding)("replace")  # reads (and drops) the BOM itself
    block = first
    while block:
        yield decoder.decode(block).encode("utf-8", "surrogatepass")
        block = fh.read(BLOCK_BYTES)
    yield decoder.decode(b"", final=True).encode("utf-8", "surrogatepass")


_BLANK_LINE = re.compile(rb"\n[ \t\r\f\v]*\n")


def _cut(buf: bytearray, at: int, size: int) -> tuple[int, int]:
    """Where the document at buf[at:] (longer than `size`) ends, and where the next one starts: at the last blank
    line in its second half of `size` bytes (the blank line, which the packer's separator stands for, belongs to
    neither), else at byte `size`, moved back to the start of a UTF-8 character."""
    last = deque(_BLANK_LINE.finditer(buf, at + size // 2, at + size), maxlen=1)
    if last:
        return last[0].start(), last[0].end()
    cut = at + size
    while cut > at + size - 3 and 0x80 <= buf[cut] < 0xC0:  # a UTF-8 continuation byte: not a character's start
        cut -= 1
    return cut, cut


def text_doc_id(name: str, offset: int) -> str:
    """A plain-text document's name: the file's for its first document (a file of one document is named as it
    always was), `name#OFFSET` (its first byte in the decompressed file) for the others."""
    return name if offset == 0 else f"{name}#{offset}"


def _text_docs(blocks: Iterator[bytes], name: str, kind: str, size: int) -> Iterator[Document]:
    """A plain file's documents: the whole file if it holds at most `size` bytes, else cut by _cut; a function of
    the bytes and `size` only (not of how they arrive in blocks)."""
    buf, at, offset = bytearray(), 0, 0  # at: the current document's start in buf; offset: buf[0]'s in the file
    for block in blocks:
        del buf[:at]  # once a block, not once a document: small documents do not move the buffer each
        offset, at = offset + at, 0
        buf += block
        while len(buf) - at > size:
            end, start = _cut(buf, at, size)
            yield Document(text_doc_id(name, offset + at), kind, bytes(buf[at:end]))
            at = start
    if len(buf) > at:
        yield Document(text_doc_id(name, offset + at), kind, bytes(buf[at:]))


def _lines(blocks: Iterator[bytes]) -> Iterator[tuple[int, bytes]]:
    """(index, line) of a byte stream, without the newline; a line longer than a block is joined once."""
    pending: list[bytes] = []  # the start of a line that has not ended yet
    i = 0
    for block in blocks:
        *whole, rest = block.split(b"\n")
        if whole:
            whole[0] = b"".join([*pending, whole[0]])
            pending = []
        for line in whole:
            yield i, line
            i += 1
        pending.append(rest)
    tail = b"".join(pending)
    if tail:
        yield i, tail


_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number",
               float: "a number", type(None): "null"}  # fmt: skip


_LONE_SURROGATE = re.compile("[\ud800-\udc7f\udd00-\udfff]")  # surrogates that surrogateescape does not map to a byte


def _to_bytes(text: str) -> bytes:
    """A JSON string's bytes: invalid UTF-8 of the line comes back as it was (surrogateescape); a lone surrogate
    escape (\\ud800) in the JSON, which no UTF-8 encodes, becomes U+FFFD."""
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return _LONE_SURROGATE.sub("\ufffd", text).encode("utf-8", "surrogateescape")


def _jsonl_docs(
    blocks: Iterator[bytes], path: str, name: str, kind: str, field: str, skipped: dict[str, list[str]]
) -> Iterator[Document]:
    """A JSONL file's documents: each line an object whose `field` is a string (null or absent: no document). A
    line that is not JSON or not an object, or a `field` of another type, is an error naming the line; a file
    with records but text in none of them is an error naming corpus.text_field; one without records is skipped."""
    records, found, first = 0, 0, None
    for i, raw in _lines(blocks):
        line = raw.decode("utf-8", "surrogateescape")
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, RecursionError):  # RecursionError: nesting deeper than Python's stack
            raise corpus_error(path, f"line {i + 1} is not JSON", "fix or remove that line") from None
        if not isinstance(row, dict):
            raise corpus_error(
                path,
                f"line {i + 1} is {_JSON_TYPES[type(row)]}, not a JSON object",
                f"each line must be an object holding its text in corpus.text_field ({field!r})",
            )
        records += 1
        first = (i, row) if first is None else first
        text = row.get(field)
        if isinstance(text, str):
            found += bool(text)
            yield Document(f"{name}:{i}", kind, _to_bytes(text))
        elif text is not None:
            raise corpus_error(
                path,
                f"line {i + 1}: {field!r} is {_JSON_TYPES[type(text)]}, not a string",
                f"set corpus.text_field to the field that holds the text (line {i + 1}, {_fields(row)})",
            )
    if not records:
        skipped.setdefault(SKIP_EMPTY, []).append(name)
    elif not found:
        raise corpus_error(
            path,
            f"has no text in {field!r} in any of its {records} records",
            f"set corpus.text_field to the field that holds the text (line {first[0] + 1}, {_fields(first[1])})",
        )


def _fields(row: dict) -> str:
    names = [shown(str(k)) for k in row]
    return "its fields: " + ", ".join(names[:8]) + (", ..." if len(names) > 8 else "") if names else "it has no fields"


def _is_text_type(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        return _is_text_type(t.value_type)
    return any(
        check(t)
        for check in (
            pa.types.is_string,
            pa.types.is_large_string,
            pa.types.is_binary,
            pa.types.is_large_binary,
            pa.types.is_string_view,
            pa.types.is_binary_view,
        )
    )


def _open_table(fh, path: str, fmt: Format, field: str):
    """(row groups or None if not known ahead, their unit's name, group(g) -> its batches of the column `field`,
    None past the last) of a Parquet file, an Arrow IPC file or an Arrow IPC stream (what Hugging Face datasets
    and Ray write as .arrow), checked to be text before anything is read."""
    try:
        if fmt.name == "parquet":
            pf = pq.ParquetFile(fh)
            schema, groups, unit = pf.schema_arrow, pf.num_row_groups, "row group"
            group = lambda g: pf.iter_batches(batch_size=4096, columns=[field], row_groups=[g])  # noqa: E731
        else:
            try:
                reader = ipc.open_file(fh)
                schema, groups, unit = reader.schema, reader.num_record_batches, "record batch"
                group = lambda g: [reader.get_batch(g).select([field])]  # noqa: E731
            except pa.ArrowInvalid:
                fh.seek(0)
                stream = ipc.open_stream(fh)  # an IPC stream: batches one after another, no footer
                schema, groups, unit = stream.schema, None, "record batch"
                group = lambda g: _next_batch(stream, field)  # noqa: E731
    except (pa.ArrowException, OSError) as exc:
        raise corpus_error(
            path, f"is not readable {fmt.name} ({exc})", "replace it, or remove it from the corpus"
        ) from None
    if field not in schema.names:
        raise corpus_error(path, f"has no column {field!r}", f"set corpus.text_field to one of {schema.names}")
    if schema.names.count(field) > 1:  # Arrow allows it; which one is the text cannot be told
        raise corpus_error(
            path,
            f"has {schema.names.count(field)} columns named {field!r}",
            "write the file with one text column of that name, or set corpus.text_field to another column",
        )
    kind = schema.field(field).type
    if not _is_text_type(kind):
        texts = [f.name for f in schema if _is_text_type(f.type)]
        raise corpus_error(
            path,
            f"column {field!r} is {kind}, not text (string or binary)",
            f"set corpus.text_field to a text column ({texts or 'this file has none'})",
        )
    return groups, unit, group


def _next_batch(stream: ipc.RecordBatchStreamReader, field: str) -> list[pa.RecordBatch] | None:
    try:
        return [stream.read_next_batch().select([field])]
    except StopIteration:
        return None


def _table_docs(
    fh, path: str, name: str, kind: str, fmt: Format, field: str, skipped: dict[str, list[str]]
) -> Iterator[Document]:
    """A Parquet or Arrow IPC file's documents: the column `field` row by row (nulls give none), one row group or
    record batch at a time, so a file larger than memory streams like a JSONL one. Text comes as the stored
    bytes (never decoded, so invalid UTF-8 stays as it is). Rows only of nulls are an error naming the column."""
    groups, unit, group = _open_table(fh, path, fmt, field)
    i = rows = g = 0
    while groups is None or g < groups:
        try:
            batches = group(g)
            if batches is None:  # a stream's end
                break
            for batch in batches:
                col = batch.column(0)
                col = col.dictionary_decode() if pa.types.is_dictionary(col.type) else col
                rows += len(col)
                for value in col.cast(pa.large_binary()).to_pylist():
                    if value is not None:
                        yield Document(f"{name}:{i}", kind, value)
                        i += 1
        except (pa.ArrowException, OSError) as exc:
            of = f" of {groups}" if groups is not None else ""
            raise corpus_error(
                path, f"{unit} {g}{of} is not readable ({exc})", "replace the file, or remove it"
            ) from None
        g += 1
    if not rows:
        skipped.setdefault(SKIP_EMPTY, []).append(name)
    elif not i:
        raise corpus_error(
            path, f"column {field!r} is null in all its {rows} rows", "set corpus.text_field to the text column"
        )


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


def _sniffed(blocks: Iterator[bytes]) -> tuple[str | None, Iterator[bytes]]:
    """Why a stream is not text (SKIP_*), or None and the stream whole again."""
    head = b""
    for block in blocks:
        head += block
        if len(head) >= SNIFF_BYTES:
            break
    why = SKIP_EMPTY if not head else not_text(head[:SNIFF_BYTES])
    return why, itertools.chain([head], blocks)


def _user_file_docs(
    fs: fsspec.AbstractFileSystem, f: CorpusFile, cfg: CorpusConfig, skipped: dict[str, list[str]]
) -> Iterator[Document]:
    """The documents of one corpus file, read in its format (format_of); `name` (its path relative to the corpus
    root) keys them, so the test split and the shards do not depend on where the corpus lives. An empty file, or
    one that is not text, is skipped and listed in `skipped` by reason."""
    path, name = f.path, f.name
    base = name.rsplit("/", 1)[-1]
    kind = shown(base.split(".", 1)[1] if "." in base else "text")  # bytes are reported per file kind
    fmt = format_of(base, cfg.format)
    if f.size == 0:  # in every format (a 0-byte .bz2 is not even a valid empty stream)
        skipped.setdefault(SKIP_EMPTY, []).append(name)
        return
    with fs.open(path, "rb", compression=fmt.compression) as fh:
        if fmt.layout is Layout.TABLE:
            yield from _table_docs(fh, path, name, kind, fmt, cfg.text_field, skipped)
            return
        why, blocks = _sniffed(_utf8_blocks(fh))
        if why:
            skipped.setdefault(why, []).append(name)
        elif fmt.layout is Layout.LINES:
            yield from _jsonl_docs(blocks, path, name, kind, cfg.text_field, skipped)
        else:
            yield from _text_docs(blocks, name, kind, cfg.document_bytes)


def _unreadable(path: str, fmt: Format, exc: BaseException, forced: str | None) -> SomaError:
    """The one error for a corpus file that fails while read: a cut or corrupt compressed stream, permissions,
    the store."""
    if fmt.compression and isinstance(exc, EOFError):
        return corpus_error(path, f"ends early (a truncated {fmt.compression} stream)", "replace it, or remove it")
    if (
        fmt.compression
        and isinstance(exc, (gzip.BadGzipFile, zlib.error, lzma.LZMAError))
        or (fmt.compression == "bz2" and type(exc) is OSError and not exc.errno)
    ):
        return corpus_error(
            path,
            f"is not valid {fmt.compression} data ({exc})",
            f"replace it, or rename it without {fmt.suffix}" if forced is None else "replace it",
        )
    return corpus_error(
        path,
        f"cannot be read ({type(exc).__name__})",
        "fix or remove it (for s3://, check the endpoint SOMA_S3_ENDPOINT and the credentials)",
    )


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
        raise corpus_error(path, "is a broken symbolic link (or vanished)", "remove it or point it at a file") from None
    except OSError as exc:
        what = "is a symbolic link loop" if exc.errno == errno.ELOOP else f"cannot be read ({type(exc).__name__})"
        raise corpus_error(path, what, "fix it (its permissions, its link) or remove it") from None
    for test, kind in _SPECIAL:
        if test(mode):
            fix = "pass a text file or a directory of them" if root else "remove it from the corpus directory"
            raise SomaError(f"corpus path {shown(path)} is a {kind}, not a regular file; {fix}")


def _unreachable(source: str, exc: BaseException) -> SomaError:
    return SomaError(
        f"corpus path {shown(source)} cannot be read ({type(exc).__name__}); check the path, its permissions "
        f"and, for s3://, the endpoint (SOMA_S3_ENDPOINT) and credentials"
    )


def _corpus_files(fs: fsspec.AbstractFileSystem, source: str, root: str) -> list[tuple[str, str, int]]:
    """(path, path relative to the corpus root, size in bytes) of every file to read, in relative-path
    order. A local special file (FIFO, socket, device) or broken link is refused here, before any file is
    opened."""
    try:
        info = fs.info(root)
    except FileNotFoundError:
        if _is_local(fs) and os.path.islink(root):
            raise SomaError(f"corpus path {shown(source)} is a broken symbolic link; point it at a file") from None
        raise SomaError(
            f"corpus path {shown(source)} not found; pass an existing directory or file (or corpus.source=builtin)"
        ) from None
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise _unreachable(source, exc) from None
        raise SomaError(f"corpus path {shown(source)} is a symbolic link loop; point corpus.source at a file") from None
    except transient_errors() as exc:
        raise _unreachable(source, exc) from None
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
    size: int = 0  # on disk, as listed


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
        group.append(CorpusFile(path, name, cfg.max_bytes - before, size))
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
            for doc in _forced(_user_file_docs(fs, f, cfg, skipped), cfg):
                if not doc.data:
                    continue
                total += len(doc.data)
                if counts is not None:
                    counts[doc.source] = counts.get(doc.source, 0) + len(doc.data)
                yield doc
                if total >= f.budget:
                    break
        except (EOFError, zlib.error, lzma.LZMAError, *transient_errors()) as exc:  # OSError: permissions, the store
            forced = None if cfg.format == "auto" else cfg.format
            error = _unreadable(f.path, format_of(f.name.rsplit("/", 1)[-1], cfg.format), exc, forced)
            note = f" (every file is read as {forced}: corpus.format)" if forced else ""
            raise SomaError(f"{error}{note}") from None


def _forced(docs: Iterator[Document], cfg: CorpusConfig) -> Iterator[Document]:
    """A file's documents; under a corpus.format other than auto, its errors say that setting chose the format."""
    try:
        yield from docs
    except SomaError as exc:
        if cfg.format == "auto":
            raise
        raise SomaError(f"{exc} (every file is read as {cfg.format}: corpus.format)") from None


def no_text_error(cfg: CorpusConfig, skipped: dict[str, list[str]]) -> SomaError:
    if cfg.format != "auto":
        fix = f"every file is read as {cfg.format}: set corpus.format to theirs (or auto)"
    else:
        fix = "point corpus.source at text files (.txt, .md, .jsonl, .parquet, .arrow)"
    return SomaError(f"corpus {shown(cfg.source)} holds no text{describe_skipped(skipped, names=3)}; {fix}")


MIN_DOCUMENT_BYTES = 4096  # corpus.document_bytes's lower bound (soma_cluster.config)
HELD_OUT_DOCS = 4  # held-out documents to expect for a suggested fix: none with probability e^-4 < 2%


def more_test_documents(
    cfg: CorpusConfig, n_docs: int, sources: dict[str, int], window_bytes: int, read_bytes: int = 0
) -> str:
    """The fix for a corpus whose held-out documents fill no evaluation window: a fix that can work for it."""
    f = cfg.test_fraction
    if f == 0:
        return "set corpus.test_fraction above 0 (e.g. 0.02)"
    if read_bytes >= cfg.max_bytes:  # the cap stopped the reading: there may be documents enough past it
        return (
            f"raise corpus.max_bytes (now {cfg.max_bytes:_}: reading stopped there, after {n_docs} documents), or "
            f"eval.window_bytes (now {window_bytes}) if the documents are short"
        )
    plain = sum(v for k, v in sources.items() if format_of(f"_.{k}").layout is Layout.TEXT)
    if cfg.source != "builtin" and plain * f >= 2 * window_bytes:  # bytes enough to hold out: too few documents
        size = int(plain * f / HELD_OUT_DOCS) // 1000 * 1000
        if MIN_DOCUMENT_BYTES <= size < cfg.document_bytes:
            return (
                f"lower corpus.document_bytes to {size} (now {cfg.document_bytes}: its plain text is cut into "
                "documents of at most that many bytes, each held out with probability corpus.test_fraction)"
            )
    if n_docs * 0.49 < HELD_OUT_DOCS:  # test_fraction < 0.5 cannot make it work
        return f"add documents: the test set holds out whole documents, and the corpus has {n_docs}"
    return f"raise corpus.test_fraction (now {f}, over {n_docs} documents) or add data"


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
        listed = ", ".join(map(shown, files[:names])) + (", ..." if len(files) > names else "") if names else ""
        parts.append(f"{why} {len(files)}" + (f" ({listed})" if listed else ""))
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
    # surrogateescape: a name that is not UTF-8 (a POSIX file name may be any bytes) hashes as its bytes
    h = int.from_bytes(hashlib.sha256(f"{seed}:{doc_id}".encode("utf-8", "surrogateescape")).digest()[:8], "big")
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
