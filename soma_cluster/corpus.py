"""Documents in, fixed-size byte sequences out.

The named sources (soma_cluster.textsources) are `builtin`, fixed real text that ships in the package (the
same bytes on every machine), and `machine`, the text this machine has; nothing is downloaded. A user corpus is a
local or s3:// path: a file or a directory of files, each read in the format its name says (FORMATS:
plain text, JSONL, either also .gz/.bz2/.xz/.lzma, Parquet, Arrow IPC). docs/prepare.md says what a document
is in each, and which files a directory gives (hidden names left out, links followed once).
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
import zlib
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from soma_cluster.config import SOURCE_LABEL_CHARS, CorpusConfig
from soma_cluster.errors import SomaError
from soma_cluster.formats import COMPRESSIONS, FORMATS, Format, Layout, format_of, refused
from soma_cluster.storage import storage_options_from_env, transient_errors, with_s3_defaults
from soma_cluster.textsources import NAMED_SOURCES, Document, named_documents

SEPARATOR = b"\n\n"


# -- user corpora: naming and errors -------------------------------------------------------------------
def shown(path: str) -> str:
    """A path as one line of text shows it: bytes that are not UTF-8 (a POSIX name may hold any) escaped as
    \\xNN, control characters as Python escapes them, so an error line can always be printed and read."""
    return _escaped(os.fsencode(path))


def _escaped(raw: bytes) -> str:
    text = raw.decode("utf-8", "backslashreplace")
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


# -- sources: the name each document is reported under ------------------------------------------------------------
def clean_label(value: str | bytes) -> str | None:
    """A source label as tables and error lines can show it: one line of printable text (shown's
    escapes), stripped, at most SOURCE_LABEL_CHARS characters (cut with an ellipsis); None for an empty one."""
    if isinstance(value, str) and value.isprintable():  # most labels: nothing to escape (a surrogate is not printable)
        text = value.strip()
    else:
        text = _escaped(value if isinstance(value, bytes) else _to_bytes(value)).strip()
    if not text:
        return None
    return text if len(text) <= SOURCE_LABEL_CHARS else text[: SOURCE_LABEL_CHARS - 1] + "\u2026"


def file_type(base: str) -> str:
    """A file name's type, as a source: its last suffix, lower case, after a compression suffix (`a.txt.gz`: txt,
    `usr__share__perl__5.36.0__CPAN.pm`: pm); `text` for a name without one."""
    lower = base.lower()
    for suffix, _ in COMPRESSIONS:
        if lower.endswith(suffix) and len(lower) > len(suffix):
            lower = lower[: -len(suffix)]
            break
    stem, dot, ext = lower.rpartition(".")
    return (clean_label(ext) or "text") if dot and stem else "text"


def default_source(name: str) -> str:
    """A file's source when no setting gives one (corpus.source_patterns, source_manifest, source_column): the first
    folder of its path under the corpus root (`perl/usr__share__perl__5.36.0__CPAN.pm`: perl), or for a file directly
    under the root (a flat corpus, or a corpus that is one file) its file type."""
    if "/" in name:
        return clean_label(name.split("/", 1)[0]) or "text"
    return file_type(name)


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


def _text_docs(blocks: Iterator[bytes], name: str, source: str, size: int) -> Iterator[Document]:
    """A plain file's documents: the whole file if it holds at most `size` bytes, else cut by _cut; a function of
    the bytes and `size` only (not of how they arrive in blocks)."""
    buf, at, offset = bytearray(), 0, 0  # at: the current document's start in buf; offset: buf[0]'s in the file
    for block in blocks:
        del buf[:at]  # once a block, not once a document: small documents do not move the buffer each
        offset, at = offset + at, 0
        buf += block
        while len(buf) - at > size:
            end, start = _cut(buf, at, size)
            yield Document(text_doc_id(name, offset + at), source, bytes(buf[at:end]))
            at = start
    if len(buf) > at:
        yield Document(text_doc_id(name, offset + at), source, bytes(buf[at:]))


MAX_RECORD_BYTES = 64 << 20  # a JSONL line or table value longer than this is refused, so memory stays bounded


class _LongRecord(Exception):
    def __init__(self, index: int, size: int):
        self.index, self.size = index, size  # the line's index (from 0) and its length in bytes


def _lines(blocks: Iterator[bytes], limit: int) -> Iterator[tuple[int, bytes]]:
    """(index, line) of a byte stream, without the newline; a line longer than a block is joined once. A line longer
    than `limit` bytes raises _LongRecord with its full length, counted without holding more than `limit` of it."""
    pending: list[bytes] = []  # the start of a line that has not ended yet
    held = i = 0  # held: bytes in pending
    for block in blocks:
        *whole, rest = block.split(b"\n")
        if whole:
            whole[0] = b"".join([*pending, whole[0]])
            pending, held = [], 0
        for line in whole:
            if len(line) > limit:
                raise _LongRecord(i, len(line))
            yield i, line
            i += 1
        pending.append(rest)
        held += len(rest)
        if held > limit:
            raise _LongRecord(i, held + _rest_of_line(blocks))
    tail = b"".join(pending)
    if tail:
        yield i, tail


def _rest_of_line(blocks: Iterator[bytes]) -> int:
    """How many bytes the stream holds up to its next newline (or its end), read and dropped."""
    n = 0
    for block in blocks:
        end = block.find(b"\n")
        if end >= 0:
            return n + end
        n += len(block)
    return n


def _too_long(path: str, what: str, size: int, fix: str) -> SomaError:
    return corpus_error(
        path,
        f"{what} is {size:,} bytes, more than the {MAX_RECORD_BYTES:,} ({MAX_RECORD_BYTES / 2**20:g} MiB) a record "
        "may hold",
        f"{fix} (a record is never cut), or remove it",
    )


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
    blocks: Iterator[bytes],
    path: str,
    name: str,
    source: str,
    field: str,
    skipped: dict[str, list[str]],
    labels: str | None = None,
) -> Iterator[Document]:
    """A JSONL file's documents: each line an object whose `field` is a string (null or absent: no document). A
    line that is not JSON or not an object, or a `field` of another type, is an error naming the line; a file
    with records but text in none of them is an error naming corpus.text_field; one without records is skipped.
    With `labels` (corpus.source_column), a record's source is that field's string (null, absent or empty: the
    file's `source`); another type, or a file none of whose records has the field, is an error."""
    try:
        yield from _jsonl_records(blocks, path, name, source, field, skipped, labels)
    except _LongRecord as exc:
        raise _too_long(path, f"line {exc.index + 1}", exc.size, "split it into records of at most that size") from None


def _jsonl_records(
    blocks: Iterator[bytes],
    path: str,
    name: str,
    source: str,
    field: str,
    skipped: dict[str, list[str]],
    labels: str | None,
) -> Iterator[Document]:
    records, found, first, labelled = 0, 0, None, False
    for i, raw in _lines(blocks, MAX_RECORD_BYTES):
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
        labelled = labelled or (labels is not None and labels in row)
        if isinstance(text, str):
            found += bool(text)
            label = _row_label(row, labels, path, i) if labels is not None else None
            yield Document(f"{name}:{i}", label or source, _to_bytes(text))
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
    elif labels is not None and not labelled:
        raise corpus_error(
            path,
            f"has no field {labels!r} (corpus.source_column) in any of its {records} records",
            f"set corpus.source_column to the field that holds each record's source (line {first[0] + 1}, "
            f"{_fields(first[1])}), or leave it out to name sources by folder",
        )


def _row_label(row: dict, labels: str, path: str, i: int) -> str | None:
    """A JSONL record's source label: its field `labels` as text, None where it is null, absent or empty."""
    value = row.get(labels)
    if value is None or isinstance(value, str):
        return clean_label(value) if value else None
    raise corpus_error(
        path,
        f"line {i + 1}: {labels!r} (corpus.source_column) is {_JSON_TYPES[type(value)]}, not a string",
        f"write each record's source as a string, or set corpus.source_column to the field that holds it "
        f"(line {i + 1}, {_fields(row)})",
    )


def _fields(row: dict) -> str:
    names = [shown(str(k)) for k in row]
    return "its fields: " + ", ".join(names[:8]) + (", ..." if len(names) > 8 else "") if names else "it has no fields"


def is_text_type(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        return is_text_type(t.value_type)
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


def _open_table(fh, path: str, fmt: Format, field: str, labels: str | None = None):
    """(row groups or None if not known ahead, their unit's name, group(g) -> its batches of the column `field`
    (and `labels`, corpus.source_column, as the second), None past the last) of a Parquet file, an Arrow IPC file or
    an Arrow IPC stream (what Hugging Face datasets and Ray write as .arrow), checked to be text before anything is
    read."""
    columns = [field] if labels is None else [field, labels]
    try:
        if fmt.name == "parquet":
            pf = pq.ParquetFile(fh)
            schema, groups, unit = pf.schema_arrow, pf.num_row_groups, "row group"
            group = lambda g: pf.iter_batches(  # noqa: E731
                batch_size=_parquet_batch_rows(pf.metadata.row_group(g), field), columns=columns, row_groups=[g]
            )
        else:
            try:
                reader = ipc.open_file(fh)
                schema, groups, unit = reader.schema, reader.num_record_batches, "record batch"
                group = lambda g: [reader.get_batch(g).select(columns)]  # noqa: E731
            except pa.ArrowInvalid:
                fh.seek(0)
                stream = ipc.open_stream(fh)  # an IPC stream: batches one after another, no footer
                schema, groups, unit = stream.schema, None, "record batch"
                group = lambda g: _next_batch(stream, columns)  # noqa: E731
    except (pa.ArrowException, OSError) as exc:
        raise corpus_error(
            path, f"is not readable {fmt.name} ({exc})", "replace it, or remove it from the corpus"
        ) from None
    _text_column(schema, path, field, "corpus.text_field", "the text")
    if labels is not None:
        _text_column(schema, path, labels, "corpus.source_column", "each row's source")
    return groups, unit, group


def _text_column(schema: pa.Schema, path: str, column: str, setting: str, holds: str) -> None:
    """The column is in the file once, and is text (string or binary, dictionary-encoded too): else one error naming
    the file, the column and `setting`, with the file's columns."""
    named = repr(column) + ("" if setting == "corpus.text_field" else f" ({setting})")
    if column not in schema.names:
        raise corpus_error(path, f"has no column {named}", f"set {setting} to one of {schema.names}")
    if schema.names.count(column) > 1:  # Arrow allows it; which one is meant cannot be told
        raise corpus_error(
            path,
            f"has {schema.names.count(column)} columns named {named}",
            f"write the file with one column of that name, or set {setting} to another column",
        )
    kind = schema.field(column).type
    if not is_text_type(kind):
        texts = [f.name for f in schema if is_text_type(f.type)]
        raise corpus_error(
            path,
            f"column {named} is {kind}, not text (string or binary)",
            f"set {setting} to the text column that holds {holds} ({texts or 'this file has none'})",
        )


def _next_batch(stream: ipc.RecordBatchStreamReader, columns: list[str]) -> list[pa.RecordBatch] | None:
    try:
        return [stream.read_next_batch().select(columns)]
    except StopIteration:
        return None


def _table_docs(
    fh,
    path: str,
    name: str,
    source: str,
    fmt: Format,
    field: str,
    skipped: dict[str, list[str]],
    labels: str | None = None,
) -> Iterator[Document]:
    """A Parquet or Arrow IPC file's documents: the column `field` row by row (nulls give none), one row group or
    record batch at a time, so a file larger than memory streams like a JSONL one. Text comes as the stored
    bytes (never decoded, so invalid UTF-8 stays as it is). Rows only of nulls are an error naming the column.
    With `labels` (corpus.source_column), a row's source is that column's text (null or empty: the file's
    `source`)."""
    groups, unit, group = _open_table(fh, path, fmt, field, labels)
    i = rows = g = 0
    while groups is None or g < groups:
        try:
            batches = group(g)
            if batches is None:  # a stream's end
                break
            for batch in batches:
                col = _decoded(batch.column(0))
                names = _row_labels(batch.column(1)) if labels is not None else [None] * len(col)
                for value, label in zip(_values(col.cast(pa.large_binary()), path, rows), names, strict=True):
                    if value is not None:
                        yield Document(f"{name}:{i}", label or source, value)
                        i += 1
                rows += len(col)
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


def _decoded(col: pa.Array) -> pa.Array:
    return col.dictionary_decode() if pa.types.is_dictionary(col.type) else col


def _row_labels(col: pa.Array) -> list[str | None]:
    """A batch's labels, row by row (clean_label; None for a null or empty one)."""
    return [clean_label(v) if v else None for v in _decoded(col).to_pylist()]


BATCH_BYTES = 16 << 20  # about how many bytes of a table's text column become Python bytes at once


def _parquet_batch_rows(meta: pq.RowGroupMetaData, field: str) -> int:
    """Rows per batch for about BATCH_BYTES of the text column (from the row group's uncompressed size), at most
    4096: a row group of few, long texts is decoded a few rows at a time."""
    chunks = (meta.column(j) for j in range(meta.num_columns))
    size = next((c.total_uncompressed_size for c in chunks if c.path_in_schema == field), 0)
    return max(1, min(4096, BATCH_BYTES * meta.num_rows // max(1, size)))


def _values(col: pa.LargeBinaryArray, path: str, before: int) -> Iterator[bytes | None]:
    """A column's values as bytes (None for null), in slices of about BATCH_BYTES; a value longer than
    MAX_RECORD_BYTES is an error naming its row (`before`: the rows of the file before this column's first)."""
    lengths = pc.fill_null(pc.binary_length(col), 0).to_numpy(zero_copy_only=False)
    long = np.flatnonzero(lengths > MAX_RECORD_BYTES)
    if len(long):
        row = int(long[0])
        raise _too_long(
            path, f"row {before + row + 1}", int(lengths[row]), "split its text into rows of at most that size"
        )
    ends = np.cumsum(lengths, dtype=np.int64)
    start = 0
    while start < len(col):
        stop = max(start + 1, int(np.searchsorted(ends, (ends[start - 1] if start else 0) + BATCH_BYTES, "right")))
        yield from col.slice(start, stop - start).to_pylist()
        start = stop


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
    one that is not text, is skipped and listed in `skipped` by reason. Their source: the row's own label
    (corpus.source_column without a manifest), else the file's (CorpusFile.label), else default_source."""
    path, name = f.path, f.name
    base = name.rsplit("/", 1)[-1]
    source = f.label or default_source(name)
    labels = cfg.source_column if cfg.source_manifest is None else None  # a column of the rows themselves
    fmt = format_of(base, cfg.format)
    if f.size == 0:  # in every format (a 0-byte .bz2 is not even a valid empty stream)
        skipped.setdefault(SKIP_EMPTY, []).append(name)
        return
    if fmt.layout is Layout.TABLE and _is_local(fs):
        # mapped: an Arrow record batch (as large as its writer made it) is the file's pages, not a copy on the heap
        with pa.memory_map(os.fsencode(path)) as fh:
            yield from _table_docs(fh, path, name, source, fmt, cfg.text_field, skipped, labels)
        return
    with fs.open(path, "rb", compression=fmt.compression) as fh:
        if fmt.layout is Layout.TABLE:
            yield from _table_docs(fh, path, name, source, fmt, cfg.text_field, skipped, labels)
            return
        why, blocks = _sniffed(_utf8_blocks(fh))
        if why:
            skipped.setdefault(why, []).append(name)
        elif fmt.layout is Layout.LINES:
            yield from _jsonl_docs(blocks, path, name, source, cfg.text_field, skipped, labels)
        else:
            yield from _text_docs(blocks, name, source, cfg.document_bytes)


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
# Why a listed name is left out without being opened (reported with the files skipped while read: SKIP_*)
SKIP_HIDDEN = "hidden (name starts with a dot)"  # .git/, .DS_Store, editors' swap files: not text a user means
SKIP_LOOP = "link loop (to a directory above it)"  # walking it would never end
SKIP_SEEN = "read already (under another name)"  # its text is not taken twice


def _stat(path: str) -> os.stat_result:
    """os.stat of a local corpus path, links followed: a broken link or a loop of links is one error naming it."""
    try:
        return os.stat(path)
    except FileNotFoundError:
        raise corpus_error(path, "is a broken symbolic link (or vanished)", "remove it or point it at a file") from None
    except OSError as exc:
        # a bare OSError says nothing by its name (a path longer than PATH_MAX: "File name too long")
        why = type(exc).__name__ + (f": {exc.strerror}" if type(exc) is OSError and exc.strerror else "")
        what = "is a symbolic link loop" if exc.errno == errno.ELOOP else f"cannot be read ({why})"
        raise corpus_error(path, what, "fix it (its permissions, its link) or remove it") from None


def _require_regular(path: str, mode: int, root: bool = False, link: bool = False) -> None:
    """A local corpus path is a regular file, found by stat alone: opening a FIFO blocks until a writer comes,
    and a device never ends."""
    for test, kind in _SPECIAL:
        if test(mode):
            fix = "pass a text file or a directory of them" if root else "remove it from the corpus directory"
            what = f"a symbolic link to a {kind}" if link else f"a {kind}"
            raise SomaError(f"corpus path {shown(path)} is {what}, not a regular file; {fix}")


def _unreachable(source: str, exc: BaseException) -> SomaError:
    return SomaError(
        f"corpus path {shown(source)} cannot be read ({type(exc).__name__}); check the path, its permissions "
        f"and, for s3://, the endpoint (SOMA_S3_ENDPOINT) and credentials"
    )


@dataclass(frozen=True)
class Listed:
    path: str  # as the corpus's filesystem names it
    name: str  # relative to the corpus root ("/"-separated; a directory left out ends in "/")
    size: int  # on disk, in bytes
    skip: str = ""  # why it is left out unread (SKIP_HIDDEN, SKIP_LOOP, SKIP_SEEN), "" if it is read


def _corpus_files(fs: fsspec.AbstractFileSystem, source: str, root: str) -> list[Listed]:
    """Every file to read and every name left out unread, in relative-path order (the order of the documents,
    whatever the walk). A local special file (FIFO, socket, device), broken link, link loop or archive is refused
    here, before any file is opened."""
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
    if info["type"] != "directory":
        if _is_local(fs):
            _require_regular(root, _stat(root).st_mode, root=True, link=os.path.islink(root))
        files = [Listed(root, root.rstrip("/").rsplit("/", 1)[-1], int(info.get("size") or 0))]
    elif _is_local(fs):
        files = _LocalWalk(root).listing()
    else:
        files = _store_files(fs, root)
    for f in files:
        why = None if f.skip else refused(f.name.rsplit("/", 1)[-1])
        if why:
            raise corpus_error(f.path, *why)
    return files


def _store_files(fs: fsspec.AbstractFileSystem, root: str) -> list[Listed]:
    """An object store's files under `root`; a key with a hidden part (a/.cache/b) is left out, listed once by its
    first hidden part (`a/.cache/`), however many keys it holds."""
    base = root.rstrip("/")
    files, hidden = [], set()
    for p, d in fs.find(base, detail=True).items():
        parts = p[len(base) :].lstrip("/").split("/")
        dot = next((i for i, part in enumerate(parts) if part.startswith(".")), None)
        if dot is None:
            files.append(Listed(p, "/".join(parts), int(d.get("size") or 0)))
        else:
            hidden.add("/".join(parts[: dot + 1]) + ("/" if dot < len(parts) - 1 else ""))
    files += [Listed(f"{base}/{h.rstrip('/')}", h, 0, SKIP_HIDDEN) for h in hidden]
    return sorted(files, key=lambda f: f.name)


class _LocalWalk:
    """A local corpus directory's files, symbolic links followed. Every real directory is walked once (by device
    and inode): the real tree first, then the directories that links point at, in the order found, so a link to
    a directory inside the corpus is left out as read already, and one to a directory above it (or above the
    root) as a loop; a file reached by two names is read under the first, preferring its real one."""

    def __init__(self, root: str):
        real = os.path.realpath(root)
        # the root and every directory above it: a link to any of them is a loop
        self.above = frozenset(self._key(d) for d in (real, *Path(real).parents))
        self.seen = set(self.above)
        self.dirs: deque[tuple[str, str, str, frozenset]] = deque([(root, "", real, self.above)])
        self.links: deque[tuple[str, str, frozenset, tuple[int, int]]] = deque()
        self.found: list[tuple[str, str, int, str, bool]] = []  # (name, path, size, real path, via a link)
        self.left_out: list[Listed] = []

    @staticmethod
    def _key(path: str) -> tuple[int, int]:
        st = os.stat(path)
        return st.st_dev, st.st_ino

    def listing(self) -> list[Listed]:
        while self.dirs or self.links:
            if self.dirs:
                self._scan(*self.dirs.popleft())
                continue
            path, name, above, key = self.links.popleft()
            if key in above:
                self.left_out.append(Listed(path, name + "/", 0, SKIP_LOOP))
            elif key in self.seen:
                self.left_out.append(Listed(path, name + "/", 0, SKIP_SEEN))
            else:
                self.seen.add(key)
                self.dirs.append((path, name, os.path.realpath(path), above | {key}))
        first: dict[str, str] = {}  # real path -> the name it is read under: its real one first, else the lowest
        for name, _, _, real, _ in sorted(self.found, key=lambda f: (f[4], f[0])):
            first.setdefault(real, name)
        files = [
            Listed(path, name, size) if first[real] == name else Listed(path, name, 0, SKIP_SEEN)
            for name, path, size, real, _ in self.found
        ]
        return sorted(files + self.left_out, key=lambda f: f.name)

    def _scan(self, path: str, name: str, real: str, above: frozenset) -> None:
        try:
            entries = sorted(os.scandir(path), key=lambda e: e.name)
        except OSError as exc:
            raise corpus_error(
                path, f"cannot be listed ({type(exc).__name__})", "fix its permissions or remove it"
            ) from None
        for e in entries:
            sub = f"{name}/{e.name}" if name else e.name
            if e.name.startswith("."):  # never opened nor followed
                self.left_out.append(Listed(e.path, sub + "/" * _quiet_is_dir(e), 0, SKIP_HIDDEN))
                continue
            st = _stat(e.path)  # links followed: a broken one, or a loop of links, is an error here
            key = (st.st_dev, st.st_ino)
            if not stat.S_ISDIR(st.st_mode):
                link = e.is_symlink()  # then its real path names it when reached twice
                _require_regular(e.path, st.st_mode, link=link)
                self.found.append(
                    (sub, e.path, st.st_size, os.path.realpath(e.path) if link else f"{real}/{e.name}", link)
                )
            elif e.is_symlink():
                self.links.append((e.path, sub, above, key))  # followed once the real tree is walked
            elif key in self.seen:  # a bind mount of a directory walked already, or of one above it
                self.left_out.append(Listed(e.path, sub + "/", 0, SKIP_LOOP if key in above else SKIP_SEEN))
            else:
                self.seen.add(key)
                self.dirs.append((e.path, sub, f"{real}/{e.name}", above | {key}))


def _quiet_is_dir(e: os.DirEntry) -> bool:
    try:
        return e.is_dir()
    except OSError:
        return False


def _is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


def corpus_fs(cfg: CorpusConfig, url: str | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem and root path of a user corpus, or of another `url` read with the corpus's options (its
    source manifest): options from the environment and the config."""
    url = cfg.source if url is None else url
    options = with_s3_defaults(url, {**storage_options_from_env(url), **cfg.storage_options}, botocore_attempts=3)
    return fsspec.core.url_to_fs(url, **options)


# -- parts: the unit of reading, packing and sampling ---------------------------------------------------------
@dataclass(frozen=True)
class CorpusFile:
    path: str  # as the corpus's filesystem names it
    name: str  # relative to the corpus root: the key of its documents (test split, shards)
    budget: int  # document bytes it may give: corpus.max_bytes less the on-disk sizes of the files before it
    size: int = 0  # on disk, as listed
    skip: str = ""  # why it is left out unread (a hidden name, a link loop, ...): reported with the skipped files
    label: str = ""  # its source as a setting gives it (soma_cluster.sources.label_parts); "": default_source


@dataclass(frozen=True)
class Part:
    """Consecutive corpus files (relative-path order) of about prepare.part_bytes on disk, packed on their own:
    a sequence never spans two parts. No files: a named source (builtin, machine), one part, read where the driver
    runs."""

    index: int
    files: tuple[CorpusFile, ...] = ()

    @property
    def named(self) -> bool:
        return not self.files


def plan_parts(cfg: CorpusConfig, part_bytes: int) -> list[Part]:
    """The corpus's parts. corpus.max_bytes is applied file by file, the same in every engine and without
    reading anything: a file is read if the files before it hold fewer bytes on disk than the cap, and gives
    documents until their bytes reach what the cap leaves (the document that reaches it is kept whole)."""
    if cfg.source in NAMED_SOURCES:
        return [Part(0)]
    fs, root = corpus_fs(cfg)
    parts: list[Part] = []
    group: list[CorpusFile] = []
    before = grouped = 0
    for f in _corpus_files(fs, cfg.source, root):
        if before >= cfg.max_bytes:
            break
        group.append(CorpusFile(f.path, f.name, cfg.max_bytes - before, f.size, f.skip))
        if f.skip:  # read by no one: it only travels with its part to be reported
            continue
        before += f.size
        grouped += f.size
        if grouped >= part_bytes:
            parts.append(Part(len(parts), tuple(group)))
            group, grouped = [], 0
    if group and parts and all(f.skip for f in group):  # names left out after the last file: no part of their own
        parts[-1] = Part(parts[-1].index, parts[-1].files + tuple(group))
    elif group:
        parts.append(Part(len(parts), tuple(group)))
    return parts


def part_documents(
    cfg: CorpusConfig,
    part: Part,
    counts: dict[str, int] | None = None,
    skipped: dict[str, list[str]] | None = None,
    formats: dict[str, int] | None = None,
) -> Iterator[Document]:
    """The documents of one part; `counts` receives bytes per source, `formats` bytes per format a file was read
    in (soma_cluster.formats: text, jsonl, parquet, ...; user corpora only), `skipped` the files left out, by
    reason."""
    if part.named:
        yield from named_documents(cfg.source, cfg.max_bytes, counts)
        return
    fs, _ = corpus_fs(cfg)
    skipped = {} if skipped is None else skipped
    for f in part.files:
        if f.skip:
            skipped.setdefault(f.skip, []).append(f.name)
            continue
        total = 0
        fmt = format_of(f.name.rsplit("/", 1)[-1], cfg.format).name
        try:
            for doc in _forced(_user_file_docs(fs, f, cfg, skipped), cfg):
                if not doc.data:
                    continue
                total += len(doc.data)
                if counts is not None:
                    counts[doc.source] = counts.get(doc.source, 0) + len(doc.data)
                if formats is not None:
                    formats[fmt] = formats.get(fmt, 0) + len(doc.data)
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
    cfg: CorpusConfig, n_docs: int, formats: dict[str, int], window_bytes: int, read_bytes: int = 0
) -> str:
    """The fix for a corpus whose held-out documents fill no evaluation window: a fix that can work for it (formats:
    bytes per format read, part_documents')."""
    f = cfg.test_fraction
    if f == 0:
        return "set corpus.test_fraction above 0 (e.g. 0.02)"
    if read_bytes >= cfg.max_bytes:  # the cap stopped the reading: there may be documents enough past it
        return (
            f"raise corpus.max_bytes (now {cfg.max_bytes:_}: reading stopped there, after {n_docs} documents), or "
            f"eval.window_bytes (now {window_bytes}) if the documents are short"
        )
    layouts = {f.name: f.layout for f in FORMATS}
    plain = sum(v for k, v in formats.items() if layouts.get(k) is Layout.TEXT)
    if cfg.source not in NAMED_SOURCES and plain * f >= 2 * window_bytes:  # bytes enough to hold out: too few documents
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


def check_listing(cfg: CorpusConfig) -> None:
    """What the corpus's listing alone can refuse, before a command writes anything (its lease included): a path that
    is not there, a special file, a link loop, an archive, a directory with no file to read. A file that turns out to
    hold no text is found only by reading it, later."""
    if cfg.source in NAMED_SOURCES:
        return
    fs, root = corpus_fs(cfg)
    listed = _corpus_files(fs, cfg.source, root)
    if not any(not f.skip for f in listed):
        skipped: dict[str, list[str]] = {}
        for f in listed:
            skipped.setdefault(f.skip, []).append(f.name)
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
    """The corpus's documents; `counts` receives bytes per source, `skipped` the user files
    left out, by reason."""
    if cfg.source in NAMED_SOURCES:
        yield from named_documents(cfg.source, cfg.max_bytes, counts)
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


SHOWN_COUNTS = 8  # the corpus line names this many sources, the largest; the rest are counted


def describe_counts(counts: dict[str, int], names: int = SHOWN_COUNTS) -> str:
    """'perl 3.1 MB, man 1.2 MB, ... and 290 more sources of 0.4 MB': the largest `names` by name, the rest counted."""
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    text = ", ".join(f"{k} {_megabytes(v)}" for k, v in ranked[:names])
    rest = ranked[names:]
    if rest:
        text += f", and {len(rest):,} more sources of {_megabytes(sum(v for _, v in rest))}"
    return text


def _megabytes(n: int) -> str:
    """'3.1 MB', or '48 kB' below a tenth of a MB (10,000 small sources are not each '0.0 MB')."""
    return f"{n / 1e6:.1f} MB" if n >= 100_000 else f"{n / 1e3:.0f} kB" if n >= 1000 else f"{n} bytes"
