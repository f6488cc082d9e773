"""Every format `prepare` reads (soma_cluster.formats.FORMATS) against a table of malformations generated from it:
each case is read as the expected documents, or is one error naming the file (and its line, column or row group)
and the fix. Most cases run the corpus reader itself (no Ray, no subprocess); a sample runs on S3 (the moto server)
and through `soma prepare`. A format added to FORMATS gets every row of the table, or test_every_format_has_a_table
fails."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import os
import random
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest
from conftest import assert_one_line_error, soma
from support.s3server import s3  # noqa: F401

from soma_cluster.config import CorpusConfig
from soma_cluster.corpus import SKIP_HIDDEN, SKIP_SEEN, is_test_doc, shown, text_doc_id, user_documents
from soma_cluster.errors import SomaError
from soma_cluster.formats import FORMATS, Format, Layout

MAX_BYTES = 1_000_000  # corpus.max_bytes of every case: the huge record is larger
DOC_BYTES = 256_000  # corpus.document_bytes's default
COMPRESS: dict[str | None, Callable[[bytes], bytes]] = {
    None: lambda b: b,
    "gzip": lambda b: gzip.compress(b, mtime=0),
    "bz2": bz2.compress,
    "xz": lzma.compress,
    "lzma": lambda b: lzma.compress(b, format=lzma.FORMAT_ALONE),  # the legacy container `lzma` writes
}
TEXTS = ["The first document, long enough to be one. " * 4, "A second one, café and naïve. " * 5, "Third. " * 30]


@dataclass(frozen=True)
class Read:
    """The corpus reads as these (doc_id, bytes), in order."""

    docs: list[tuple[str, bytes]]


@dataclass(frozen=True)
class Fails:
    """One error whose line holds the file's shown name and every needle."""

    needles: tuple[str, ...]


@dataclass
class Case:
    # name -> content, or "fifo", "loop", "dangling", "->TARGET" (a symbolic link to TARGET)
    files: dict[bytes, bytes | str] = field(default_factory=dict)
    expect: Read | Fails = Read([])
    name: bytes = b""  # the file the outcome is about
    root_only: bool = False  # root reads what chmod 000 hides
    settings: dict = field(default_factory=dict)  # corpus.* besides source and max_bytes
    skipped: dict[str, list[str]] | None = None  # what the reader reports left out, by reason (None: not checked)


# -- the malformations: (format, file name) -> Case ------------------------------------------------------------
def _table(fmt: Format, columns: dict[str, pa.Array], row_group: int = 2) -> bytes:
    table = pa.table(columns)
    sink = pa.BufferOutputStream()
    if fmt.name == "parquet":
        pq.write_table(table, sink, row_group_size=row_group)
    else:
        with ipc.new_file(sink, table.schema) as w:
            for batch in table.to_batches(max_chunksize=row_group):
                w.write_batch(batch)
    return sink.getvalue().to_pybytes()


def _records(fmt: Format, rows: list, raw_lines: list[bytes] | None = None) -> bytes:
    """JSONL lines of `rows` (or raw lines), compressed as the format is."""
    lines = raw_lines if raw_lines is not None else [json.dumps(r).encode() for r in rows]
    return COMPRESS[fmt.compression](b"".join(line + b"\n" for line in lines))


def _good(fmt: Format, texts: list[str], name: str) -> tuple[bytes, Read]:
    """A well-formed file of `texts` in the format, and what reading it gives."""
    if fmt.layout is Layout.TABLE:
        return _table(fmt, {"id": pa.array(range(len(texts))), "text": pa.array(texts)}), Read(
            [(f"{name}:{i}", t.encode()) for i, t in enumerate(texts)]
        )
    if fmt.layout is Layout.LINES:
        return _records(fmt, [{"text": t} for t in texts]), Read(
            [(f"{name}:{i}", t.encode()) for i, t in enumerate(texts)]
        )
    body = "\n\n".join(texts).encode()
    return COMPRESS[fmt.compression](body), Read([(name, body)])


def _fails(*needles: str) -> Fails:
    return Fails(needles)


def _no_text(why: str) -> Fails:
    return Fails(("holds no text", f"{why} 1", "point corpus.source"))


def empty(fmt: Format, name: str) -> Case:
    return Case({name.encode(): b""}, Fails(("holds no text", "empty 1", name, "point corpus.source")))


def empty_content(fmt: Format, name: str) -> Case:
    """Compressed nothing, a table of no rows, JSONL of blank lines: skipped as empty, named."""
    if fmt.layout is Layout.TABLE:
        return Case({name.encode(): _table(fmt, {"text": pa.array([], pa.string())})}, _no_text("empty"))
    body = b"\n\n\n" if fmt.layout is Layout.LINES else b""
    return Case({name.encode(): COMPRESS[fmt.compression](body)}, _no_text("empty"))


def truncated(fmt: Format, name: str) -> Case:
    """Cut at 60%: mid-record, mid compressed stream, mid Parquet footer."""
    data, good = _good(fmt, TEXTS * 3, name)
    cut = data[: len(data) * 6 // 10]
    if fmt.layout is Layout.TABLE:
        return Case({name.encode(): cut}, _fails(f"is not readable {fmt.name}", "replace it"))
    if fmt.compression:
        return Case({name.encode(): cut}, _fails(f"truncated {fmt.compression} stream", "replace it"))
    if fmt.layout is Layout.LINES:
        line = cut.count(b"\n") + 1
        return Case({name.encode(): cut}, _fails(f"line {line} is not JSON", "fix or remove that line"))
    return Case({name.encode(): cut}, Read([(name, cut)]))  # plain text: what is there is the document


def garbage(fmt: Format, name: str) -> Case:
    junk = random.Random(1).randbytes(20_000)
    if fmt.layout is Layout.TABLE:
        return Case({name.encode(): junk}, _fails(f"is not readable {fmt.name}", "replace it"))
    if fmt.compression:
        return Case({name.encode(): junk}, _fails(f"is not valid {fmt.compression} data", f"without {fmt.suffix}"))
    return Case({name.encode(): junk}, _no_text("not text (NUL bytes)"))


def garbage_tail(fmt: Format, name: str) -> Case:
    """A good file with junk appended (a botched concatenation)."""
    data, good = _good(fmt, TEXTS, name)
    tail = b"\n\x01\x02\xfe\xff junk"
    if fmt.layout is Layout.TABLE:
        return Case({name.encode(): data + tail}, _fails(f"is not readable {fmt.name}"))
    if fmt.compression == "gzip":
        return Case({name.encode(): data + tail}, _fails("is not valid gzip data", "replace it"))
    if fmt.compression:  # bz2 and xz stop at their stream's end marker: the junk after it is never read
        return Case({name.encode(): data + tail}, good)
    if fmt.layout is Layout.LINES:
        return Case({name.encode(): data + tail}, _fails(f"line {len(TEXTS) + 2} is not JSON"))
    return Case({name.encode(): data + tail}, Read([(name, good.docs[0][1] + tail)]))


def _bom(fmt: Format, name: str, encode: Callable[[str], bytes], table_prefix: bytes) -> Case:
    if fmt.layout is Layout.TABLE:  # an encoding marker has no place in a binary format: the file is corrupt
        data, _ = _good(fmt, TEXTS, name)
        return Case({name.encode(): table_prefix + data}, _fails("is not readable"))
    if fmt.layout is Layout.LINES:
        raw = "".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in TEXTS)
        expect = Read([(f"{name}:{i}", t.encode()) for i, t in enumerate(TEXTS)])
    else:
        raw = "\n\n".join(TEXTS)
        expect = Read([(name, raw.encode())])
    return Case({name.encode(): COMPRESS[fmt.compression](encode(raw))}, expect)


def utf8_bom(fmt: Format, name: str) -> Case:
    return _bom(fmt, name, lambda s: b"\xef\xbb\xbf" + s.encode(), b"\xef\xbb\xbf")


def utf16_bom(fmt: Format, name: str) -> Case:
    return _bom(fmt, name, lambda s: s.encode("utf-16"), b"\xff\xfe")


def utf16be_bom(fmt: Format, name: str) -> Case:
    return _bom(fmt, name, lambda s: b"\xfe\xff" + s.encode("utf-16-be"), b"\xfe\xff")


def not_utf8(fmt: Format, name: str) -> Case:
    """Latin-1 text: bytes >= 0x80 that are not UTF-8 are kept as they are, in every format."""
    texts = [t.encode("latin-1") for t in TEXTS]
    if fmt.layout is Layout.TABLE:
        col = pa.array(texts, pa.binary()).view(pa.string())  # a string column holding invalid UTF-8
        expect = Read([(f"{name}:{i}", t) for i, t in enumerate(texts)])
        return Case({name.encode(): _table(fmt, {"text": col})}, expect)
    if fmt.layout is Layout.LINES:
        lines = [b'{"text": "' + t + b'"}' for t in texts]
        expect = Read([(f"{name}:{i}", t) for i, t in enumerate(texts)])
        return Case({name.encode(): _records(fmt, [], lines)}, expect)
    body = b"\n\n".join(texts)
    return Case({name.encode(): COMPRESS[fmt.compression](body)}, Read([(name, body)]))


def _field_case(fmt: Format, name: str, rows: list, column: pa.Array | None, expect: Read | Fails) -> Case:
    """Records of `rows` (JSONL), a table with `column` as 'text', or, for plain text, the JSONL as text."""
    if fmt.layout is Layout.TABLE:
        return Case({name.encode(): _table(fmt, {"id": pa.array(range(len(column))), "text": column})}, expect)
    data = _records(fmt, rows)
    if fmt.layout is Layout.TEXT:  # JSON in a plain file is text
        raw = b"".join(json.dumps(r).encode() + b"\n" for r in rows)
        return Case({name.encode(): data}, Read([(name, raw)]))
    return Case({name.encode(): data}, expect)


def wrong_field(fmt: Format, name: str) -> Case:
    rows = [{"content": t, "id": i} for i, t in enumerate(TEXTS)]
    if fmt.layout is Layout.TABLE:
        data = _table(fmt, {"content": pa.array(TEXTS), "id": pa.array(range(3))})
        return Case({name.encode(): data}, _fails("has no column 'text'", "corpus.text_field", "'content'"))
    return _field_case(
        fmt, name, rows, None, _fails("no text in 'text' in any of its 3 records", "corpus.text_field", "content")
    )


def missing_some(fmt: Format, name: str) -> Case:
    """Some records lack the field or hold null: they give no document, the others are read."""
    rows = [{"text": TEXTS[0]}, {"other": 1}, {"text": None}, {"text": TEXTS[2]}]
    col = pa.array([TEXTS[0], None, None, TEXTS[2]])
    ids = [0, 3] if fmt.layout is Layout.LINES else [0, 1]  # JSONL: by line; a table: by row with text
    return _field_case(
        fmt, name, rows, col, Read([(f"{name}:{ids[0]}", TEXTS[0].encode()), (f"{name}:{ids[1]}", TEXTS[2].encode())])
    )


def all_null(fmt: Format, name: str) -> Case:
    rows = [{"text": None}] * 3
    needles = (
        "null in all its 3 rows" if fmt.layout is Layout.TABLE else "in any of its 3 records",
        "corpus.text_field",
    )
    return _field_case(fmt, name, rows, pa.array([None] * 3, pa.string()), _fails(*needles))


def _typed(fmt: Format, name: str, value, column: pa.Array, json_type: str) -> Case:
    needles = (
        (f"column 'text' is {str(column.type).split('<')[0]}", "not text", "corpus.text_field")
        if fmt.layout is Layout.TABLE
        else (f"line 1: 'text' is {json_type}", "corpus.text_field", "id, text")
    )
    return _field_case(fmt, name, [{"id": 0, "text": value}], column, _fails(*needles))


def int_field(fmt: Format, name: str) -> Case:
    return _typed(fmt, name, 5, pa.array([5]), "a number")


def list_field(fmt: Format, name: str) -> Case:
    return _typed(fmt, name, ["a", "b"], pa.array([["a", "b"]]), "an array")


def dict_field(fmt: Format, name: str) -> Case:
    return _typed(fmt, name, {"en": "x"}, pa.array([{"en": "x"}]), "an object")


def bool_field(fmt: Format, name: str) -> Case:
    return _typed(fmt, name, True, pa.array([True]), "a boolean")


def binary_field(fmt: Format, name: str) -> Case:
    """Bytes as text: a binary (or dictionary-encoded) column is read as its bytes; JSON's escaped NUL too."""
    if fmt.layout is Layout.TABLE:
        values = [b"\x00\x01raw bytes" * 10, "dictionary-encoded text".encode()]
        col = pa.array(values, pa.binary())
        data = _table(fmt, {"text": col, "d": pa.array(["x", "y"]).dictionary_encode()})
        return Case({name.encode(): data}, Read([(f"{name}:{i}", v) for i, v in enumerate(values)]))
    rows = [{"text": "nul \u0000 inside"}]
    return _field_case(fmt, name, rows, None, Read([(f"{name}:0", b"nul \x00 inside")]))


def dictionary_text(fmt: Format, name: str) -> Case:
    """A dictionary-encoded text column (what pandas' category dtype writes) reads as its values."""
    if fmt.layout is not Layout.TABLE:
        data, good = _good(fmt, TEXTS, name)
        return Case({name.encode(): data}, good)
    data = _table(fmt, {"text": pa.array(TEXTS[:2] * 2).dictionary_encode()})
    return Case({name.encode(): data}, Read([(f"{name}:{i}", t.encode()) for i, t in enumerate(TEXTS[:2] * 2)]))


def other_framing(fmt: Format, name: str) -> Case:
    """The same content framed another valid way: compressed members one after another (what `cat a.gz b.gz`
    gives), an Arrow IPC stream (what Hugging Face datasets write as .arrow); all of it is read."""
    if fmt.layout is Layout.TABLE:
        data, good = _good(fmt, TEXTS, name)
        if fmt.name == "arrow":
            sink, table = pa.BufferOutputStream(), pa.table({"text": TEXTS})
            with ipc.new_stream(sink, table.schema) as w:
                for batch in table.to_batches(max_chunksize=1):
                    w.write_batch(batch)
            data = sink.getvalue().to_pybytes()
        return Case({name.encode(): data}, good)
    first, second = _good(fmt, TEXTS[:1], name), _good(fmt, TEXTS[1:], name)
    if fmt.layout is Layout.LINES:
        expect = Read([(f"{name}:{i}", t.encode()) for i, t in enumerate(TEXTS)])
    else:
        expect = Read([(name, "\n\n".join(TEXTS[:1]).encode() + "\n\n".join(TEXTS[1:]).encode())])
    return Case({name.encode(): first[0] + second[0]}, expect)


def unnamed(fmt: Format, name: str) -> Case:
    """A file whose name says no format (`data`, `.json`): read as plain text unless corpus.format names its
    format, then read in it."""
    data, good = _good(fmt, TEXTS, "data")
    return Case({b"data": data}, good, b"data", settings={"format": fmt.name})


def format_setting_wrong(fmt: Format, name: str) -> Case:
    """corpus.format names a format of another layout than the file's: the error says that setting chose it."""
    other = "jsonl" if fmt.layout is Layout.TABLE else "parquet"
    data, _ = _good(fmt, TEXTS, name)
    return Case({name.encode(): data}, _fails(f"read as {other}", "corpus.format"), settings={"format": other})


def not_object(fmt: Format, name: str) -> Case:
    """A JSONL line that is an array or a bare string; a table whose column is a list of strings."""
    if fmt.layout is Layout.TABLE:
        return _typed(fmt, name, None, pa.array([["x"]], pa.list_(pa.large_string())), "")
    data = _records(fmt, [], [b'{"text": "fine"}', b'["a", "list"]'])
    if fmt.layout is Layout.TEXT:
        return Case(
            {name.encode(): COMPRESS[fmt.compression](b'{"text": "fine"}\n["a", "list"]\n')},
            Read([(name, b'{"text": "fine"}\n["a", "list"]\n')]),
        )
    return Case({name.encode(): data}, _fails("line 2 is an array, not a JSON object", "corpus.text_field"))


def deep_nesting(fmt: Format, name: str) -> Case:
    """JSON nested deeper than Python's stack; a table column of lists of lists."""
    if fmt.layout is Layout.TABLE:
        col = pa.array([[["deep"]]])
        return _typed(fmt, name, None, col, "")
    raw = b"[" * 100_000 + b"]" * 100_000
    if fmt.layout is Layout.TEXT:
        return Case({name.encode(): COMPRESS[fmt.compression](raw)}, Read([(name, raw)]))
    return Case({name.encode(): _records(fmt, [], [raw])}, _fails("line 1 is not JSON"))


def lone_surrogate(fmt: Format, name: str) -> Case:
    r"""A JSON \ud800 escape, which no UTF-8 encodes: U+FFFD in its place."""
    if fmt.layout is not Layout.LINES:
        data, good = _good(fmt, TEXTS, name)
        return Case({name.encode(): data}, good)
    data = _records(fmt, [], [b'{"text": "half \\ud800 a pair"}'])
    return Case({name.encode(): data}, Read([(f"{name}:0", "half \ufffd a pair".encode())]))


def crlf(fmt: Format, name: str) -> Case:
    """Windows line ends: JSONL lines end in \r\n, plain text keeps them."""
    if fmt.layout is Layout.TABLE:
        data, good = _good(fmt, [t + "\r\n" for t in TEXTS], name)
        return Case({name.encode(): data}, good)
    if fmt.layout is Layout.LINES:
        lines = [json.dumps({"text": t}).encode() + b"\r" for t in TEXTS]
        return Case(
            {name.encode(): _records(fmt, [], lines)}, Read([(f"{name}:{i}", t.encode()) for i, t in enumerate(TEXTS)])
        )
    body = "\r\n\r\n".join(TEXTS).encode()
    return Case({name.encode(): COMPRESS[fmt.compression](body)}, Read([(name, body)]))


def huge_record(fmt: Format, name: str) -> Case:
    """One record of 3 MB, over corpus.max_bytes: a JSONL or table record is kept whole (the document that
    reaches the cap is kept), a plain file is cut into documents of corpus.document_bytes until the cap."""
    text = "".join(f"word{i} " for i in range(400_000))[:3_000_000]
    assert len(text) > MAX_BYTES
    data, good = _good(fmt, [text], name)
    if fmt.layout is not Layout.TEXT:
        return Case({name.encode(): data}, good)
    raw, docs, at = text.encode(), [], 0
    while at < MAX_BYTES:  # no blank line: cut at document_bytes (ASCII: every byte starts a character)
        docs.append((text_doc_id(name, at), raw[at : at + DOC_BYTES]))
        at += DOC_BYTES
    return Case({name.encode(): data}, Read(docs))


def not_utf8_name(fmt: Format, name: str) -> Case:
    """A POSIX file name that is not UTF-8: read, named by its bytes (surrogateescape) everywhere."""
    raw = b"caf\xe9-\xff" + name.encode()
    data, good = _good(fmt, TEXTS, name)
    weird = os.fsdecode(raw)
    docs = [(doc_id.replace(name, weird, 1), text) for doc_id, text in good.docs]
    return Case({raw: data}, Read(docs), raw)


def _special(kind: str, needles: tuple[str, ...]) -> Callable[[Format, str], Case]:
    def make(fmt: Format, name: str) -> Case:
        data, good = _good(fmt, TEXTS, "a-good" + fmt.suffix)
        return Case({b"a-good" + fmt.suffix.encode(): data, name.encode(): kind}, _fails(*needles), name.encode())

    make.__name__ = kind
    return make


def hidden(fmt: Format, name: str) -> Case:
    """Hidden copies (a dot file, a file in a dot directory): left out unopened, reported by name, a hidden directory
    once; the good file beside them is read."""
    data, good = _good(fmt, TEXTS, "a-good" + fmt.suffix)
    files = {
        b"a-good" + fmt.suffix.encode(): data,
        b"." + name.encode(): b"\x00junk",
        b".git/objects/" + name.encode(): data,
    }
    files[b"sub/.#" + name.encode()] = "fifo"  # never opened: a hidden FIFO does not block
    return Case(files, good, skipped={SKIP_HIDDEN: [".git/", "." + name, "sub/.#" + name]})


def linked(fmt: Format, name: str) -> Case:
    """A file reached through a link (into a hidden store, as Hugging Face's cache and git-annex lay files out) is
    read under the link's name; a second link to a directory already read is left out, reported."""
    data, good = _good(fmt, TEXTS, name)
    files = {b".blobs/0123": data, name.encode(): "->.blobs/0123", b"d/inner.txt": b"inner text\n" * 9, b"e": "->d"}
    docs = [("d/inner.txt", b"inner text\n" * 9), *good.docs]
    return Case(files, Read(docs), skipped={SKIP_HIDDEN: [".blobs/"], SKIP_SEEN: ["e/"]})


def upper_case_name(fmt: Format, name: str) -> Case:
    """A name in capitals (X.PARQUET, X.JSONL.GZ: made on Windows, or by a tool that shouts): read in its format,
    as a .ZIP is refused in any case, not taken for plain text or skipped as not text."""
    upper = name.upper()
    data, good = _good(fmt, TEXTS, upper)
    return Case({upper.encode(): data}, good, upper.encode())


def dir_named_like_file(fmt: Format, name: str) -> Case:
    """A directory called x.parquet (or x.jsonl.gz) holds files: they are read in their own formats."""
    return Case(
        {f"{name}/inner.txt".encode(): b"inside the directory\n" * 5},
        Read([(f"{name}/inner.txt", b"inside the directory\n" * 5)]),
    )


def unreadable(fmt: Format, name: str) -> Case:
    data, good = _good(fmt, TEXTS, name)
    if os.geteuid() == 0:  # root reads through chmod 000
        return Case({name.encode(): data}, good, name.encode(), root_only=True)
    return Case({name.encode(): data}, _fails("cannot be read (PermissionError)"), name.encode(), root_only=True)


def duplicate_field(fmt: Format, name: str) -> Case:
    """Two text fields of one name: a table cannot say which is the text (refused); a JSON object keeps the last
    (JSON's rule); plain text is text."""
    if fmt.layout is Layout.TABLE:
        table = pa.Table.from_arrays([pa.array(TEXTS), pa.array(TEXTS[::-1])], names=["text", "text"])
        sink = pa.BufferOutputStream()
        if fmt.name == "parquet":
            pq.write_table(table, sink)
        else:
            with ipc.new_file(sink, table.schema) as w:
                w.write_table(table)
        data = sink.getvalue().to_pybytes()
        return Case({name.encode(): data}, _fails("has 2 columns named 'text'", "corpus.text_field", name))
    raw = [b'{"text": "%s", "text": "%s"}' % (t.encode(), u.encode()) for t, u in zip(TEXTS, TEXTS[::-1], strict=True)]
    data = _records(fmt, [], raw)
    if fmt.layout is Layout.TEXT:
        plain = b"".join(line + b"\n" for line in raw)
        return Case({name.encode(): COMPRESS[fmt.compression](plain)}, Read([(name, plain)]))
    return Case({name.encode(): data}, Read([(f"{name}:{i}", u.encode()) for i, u in enumerate(TEXTS[::-1])]))


MALFORMATIONS: tuple[Callable[[Format, str], Case], ...] = (
    empty,
    empty_content,
    truncated,
    garbage,
    garbage_tail,
    utf8_bom,
    utf16_bom,
    utf16be_bom,
    not_utf8,
    wrong_field,
    duplicate_field,
    missing_some,
    all_null,
    int_field,
    list_field,
    dict_field,
    bool_field,
    binary_field,
    dictionary_text,
    other_framing,
    unnamed,
    format_setting_wrong,
    not_object,
    deep_nesting,
    lone_surrogate,
    crlf,
    huge_record,
    not_utf8_name,
    _special("fifo", ("is a FIFO", "remove it from the corpus directory")),
    _special("loop", ("is a symbolic link loop", "remove it")),
    _special("dangling", ("is a broken symbolic link", "remove it or point it at a file")),
    dir_named_like_file,
    upper_case_name,
    unreadable,
    hidden,
    linked,
)


def file_name(fmt: Format) -> str:
    return "x" + (fmt.suffix or ".txt")


CASES = [(fmt, m) for fmt in FORMATS for m in MALFORMATIONS]


# -- running a case ------------------------------------------------------------------------------------------
def write_case(root: Path, case: Case) -> None:
    root.mkdir(parents=True)
    for name, content in case.files.items():
        path = os.path.join(os.fsencode(root), name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if content == "fifo":
            os.mkfifo(path)
        elif content == "loop":
            os.symlink(name, path)
        elif content == "dangling":
            os.symlink(b"gone" + name, path)
        elif isinstance(content, str) and content.startswith("->"):
            os.symlink(content[2:], path)
        else:
            with open(path, "wb") as fh:
                fh.write(content)
            if case.root_only:
                os.chmod(path, 0)


def read_corpus(source: str, skipped: dict | None = None, **settings) -> list[tuple[str, bytes]]:
    cfg = CorpusConfig(source=source, max_bytes=MAX_BYTES, **settings)
    return [(d.doc_id, d.data) for d in user_documents(cfg, skipped)]


def check(case: Case, source: str, shown_name: str) -> None:
    if isinstance(case.expect, Read):
        skipped: dict[str, list[str]] = {}
        assert read_corpus(source, skipped, **case.settings) == case.expect.docs
        assert case.skipped is None or skipped == case.skipped, skipped
        assert all(is_test_doc(doc_id, 0.5, 0) in (True, False) for doc_id, _ in case.expect.docs)  # any name hashes
        return
    with pytest.raises(SomaError) as info:
        read_corpus(source, **case.settings)
    line = str(info.value)
    assert "\n" not in line and line.isprintable(), line
    for needle in (shown_name, *case.expect.needles):
        assert needle in line, (needle, line)


@pytest.mark.parametrize("fmt,malformation", CASES, ids=[f"{f.name}-{m.__name__}" for f, m in CASES])
def test_malformation(tmp_path, fmt, malformation):
    name = file_name(fmt)
    case = malformation(fmt, name)
    write_case(tmp_path / "corpus", case)
    check(case, str(tmp_path / "corpus"), shown(os.fsdecode(case.name or name.encode())))
    assert sorted(os.listdir(tmp_path)) == ["corpus"]  # reading wrote nothing beside it


def test_every_format_has_a_table():
    """A format added to FORMATS gets every malformation: each one builds a case for it (a new layout or
    compression that a generator does not know fails here)."""
    for fmt in FORMATS:
        for m in MALFORMATIONS:
            case = m(fmt, file_name(fmt))
            assert case.files and isinstance(case.expect, (Read, Fails)), (fmt.name, m.__name__)
    assert {f.name for f, _ in CASES} == {f.name for f in FORMATS}
    assert len(CASES) == len(FORMATS) * len(MALFORMATIONS)
    assert set(COMPRESS) >= {f.compression for f in FORMATS}
    print(f"\n{len(FORMATS)} formats x {len(MALFORMATIONS)} malformations = {len(CASES)} cases")


# -- the same table on S3 (a sample: special files and non-UTF-8 names do not exist there) ------------------
S3_SAMPLE = [
    ("jsonl", utf8_bom),
    ("jsonl", wrong_field),
    ("jsonl.gz", truncated),
    ("jsonl", not_utf8),
    ("parquet", truncated),
    ("parquet", int_field),
    ("arrow", all_null),
    ("text.gz", huge_record),
    ("text.xz", garbage),
    ("text", empty),
    ("text.lzma", truncated),
    ("jsonl.lzma", utf16_bom),
    ("jsonl", hidden),
]


@pytest.mark.parametrize("fmt_name,malformation", S3_SAMPLE, ids=[f"{f}-{m.__name__}" for f, m in S3_SAMPLE])
def test_malformation_on_s3(s3, monkeypatch, fmt_name, malformation):  # noqa: F811
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    fmt = next(f for f in FORMATS if f.name == fmt_name)
    name = file_name(fmt)
    case = malformation(fmt, name)
    prefix = f"{fmt_name}-{malformation.__name__}"
    fs = s3.fs()
    for rel, content in case.files.items():  # a special file is an object like any other on S3
        fs.pipe(f"{s3.bucket}/{prefix}/{rel.decode()}", content if isinstance(content, bytes) else b"special")
    check(case, s3.url(prefix), name)
    assert sorted(s3.objects(prefix)) == sorted(f"{s3.bucket}/{prefix}/{rel.decode()}" for rel in case.files)


# -- plain text is cut into documents (corpus.document_bytes) ------------------------------------------------
def _paragraphs(n: int, seed: int = 0) -> bytes:
    rng = random.Random(seed)
    words = ["soma", "expert", "router", "shard", "naïve", "日本語", "corpus", "byte", "café"]
    return b"\n\n".join(" ".join(rng.choices(words, k=rng.randint(5, 400))).encode() for _ in range(n))


def test_a_large_plain_file_is_cut_at_blank_lines_whatever_the_reads(tmp_path, monkeypatch):
    import soma_cluster.corpus as corpus

    body = _paragraphs(3000)
    (tmp_path / "big.txt").write_bytes(body)
    (tmp_path / "big.txt.gz").write_bytes(gzip.compress(body))
    (tmp_path / "small.txt").write_bytes(body[:5000])
    cfg = CorpusConfig(source=str(tmp_path), max_bytes=10**9, document_bytes=20_000)
    docs = [(d.doc_id, d.data) for d in user_documents(cfg)]
    by_file = {n: [(i, b) for i, b in docs if i.split("#")[0] == n] for n in ("big.txt", "big.txt.gz", "small.txt")}
    assert by_file["small.txt"] == [("small.txt", body[:5000])]  # a file within document_bytes stays whole
    big = by_file["big.txt"]
    assert len(big) > len(body) // 20_000 and all(10_000 <= len(b) <= 20_000 for _, b in big[:-1])
    assert b"\n\n".join(b for _, b in big) == body  # cut at blank lines only: the packer's separator restores them
    offsets = [int(i.split("#")[1]) if "#" in i else 0 for i, _ in big]
    assert all(body[o:].startswith(b) for o, (_, b) in zip(offsets, big, strict=True))  # named by their offset
    assert [b for _, b in by_file["big.txt.gz"]] == [b for _, b in big]  # gzip'd: the same documents
    monkeypatch.setattr(corpus, "BLOCK_BYTES", 777)  # however the bytes arrive, the same cuts
    assert [(d.doc_id, d.data) for d in user_documents(cfg)] == docs


def test_text_without_blank_lines_is_cut_at_character_boundaries(tmp_path):
    body = ("日本語のテキスト" * 20_000).encode()  # 3-byte characters, no blank line
    (tmp_path / "a.txt").write_bytes(body)
    docs = list(user_documents(CorpusConfig(source=str(tmp_path), max_bytes=10**9, document_bytes=4096)))
    assert b"".join(d.data for d in docs) == body and len(docs) == -(-len(body) // 4095)
    assert all(len(d.data) <= 4096 and d.data.decode() for d in docs)  # every document is valid UTF-8


# -- through `soma prepare` ------------------------------------------------------------------------------------
def test_one_large_plain_file_is_prepared_with_a_held_out_set(tmp_path, micro_yaml):
    """One 1.4 MB text file: cut into documents, the error's fix (a smaller corpus.document_bytes) works. The text
    is generated from a seed, not read from this machine's files: which of its 6 documents is held out depends on
    where they are cut, so the same bytes must reach every machine."""
    rng = random.Random(7)
    words = ["the", "shard", "expert", "router", "byte", "model", "of", "and", "a", "budget", "trains", "on"]
    paragraphs = (" ".join(rng.choices(words, k=rng.randint(20, 400))) + "." for _ in range(100_000))
    one = tmp_path / "one.txt"
    body = b""
    for p in paragraphs:
        if len(body) >= 1_400_000:
            break
        body += p.encode() + b"\n\n"
    one.write_bytes(body)
    camp = tmp_path / "camp"
    proc = soma("prepare", str(camp), "--config", micro_yaml, "--corpus", str(one))
    assert_one_line_error(proc, f"corpus {one}", "held-out documents (of 6)", "lower corpus.document_bytes to ")
    assert not camp.exists()
    size = re.search(r"corpus.document_bytes to (\d+)", proc.stderr).group(1)
    proc = soma(
        "prepare", str(camp), "--config", micro_yaml, "--corpus", str(one), "--set", f"corpus.document_bytes={size}"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    corpus = json.loads((camp / "shards" / "manifest.json").read_text())["corpus"]
    assert corpus["documents"] > 50 and corpus["test_documents"] >= 1 and corpus["test_windows"] >= 1, corpus


def test_cli_reads_any_file_name_and_names_bad_records_escaped(tmp_path, text_corpus, micro_yaml):
    corpus = tmp_path / "corpus"
    shutil.copytree(text_corpus, corpus)
    weird = os.path.join(os.fsencode(corpus), b"caf\xe9-\xff.jsonl")
    with open(weird, "wb") as fh:  # a BOM and a name that is not UTF-8: both read
        fh.write(b"\xef\xbb\xbf" + b"".join(json.dumps({"text": t * 20}).encode() + b"\n" for t in TEXTS))
    camp = tmp_path / "camp"
    proc = soma("prepare", str(camp), "--config", micro_yaml, "--corpus", str(corpus))
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = json.loads((camp / "shards" / "manifest.json").read_text())
    assert manifest["corpus"]["sources"]["jsonl"] == sum(len(t.encode()) * 20 for t in TEXTS)
    bad = os.path.join(os.fsencode(corpus), b"a-\xff.jsonl")  # first: within corpus.max_bytes
    with open(bad, "wb") as fh:
        fh.write(b'{"body": "text under another key"}\n')
    proc = soma("prepare", str(tmp_path / "camp2"), "--config", micro_yaml, "--corpus", str(corpus))
    assert_one_line_error(proc, "a-\\xff.jsonl has no text in 'text'", "set corpus.text_field", "its fields: body")
    assert not (tmp_path / "camp2").exists()


def test_a_part_with_any_file_name_survives_the_ray_engine_spec(tmp_path):
    """The Ray engine ships each part to its worker as JSON: names that are not UTF-8 come back as they were."""
    from dataclasses import asdict

    from pipelines.prepare_ray import _part
    from soma_cluster.corpus import part_documents, plan_parts

    with open(os.path.join(os.fsencode(tmp_path), b"\xff\xfe-name.txt"), "wb") as fh:
        fh.write(b"text in a file whose name is not UTF-8 " * 10)
    cfg = CorpusConfig(source=str(tmp_path))
    (part,) = plan_parts(cfg, 1 << 20)
    shipped = _part(json.dumps({"index": part.index, "files": [asdict(f) for f in part.files]}))
    assert shipped == part
    assert [d.doc_id for d in part_documents(cfg, shipped)] == [os.fsdecode(b"\xff\xfe-name.txt")]
