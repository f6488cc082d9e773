"""The formats a corpus file is read in: the one list that the reader (soma_cluster.corpus), the config
(corpus.format), the docs and the tests (tests/test_corpus_formats.py generates its malformation table from it)
share. A leaf module: soma_cluster.config imports it."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Literal


class Layout(Enum):
    """How a format's bytes become documents."""

    TEXT = "text"  # a plain file: cut at blank lines into documents of about corpus.document_bytes
    LINES = "jsonl"  # one JSON object a line: its corpus.text_field is a document
    TABLE = "table"  # Parquet / Arrow IPC: a row's corpus.text_field is a document


@dataclass(frozen=True)
class Format:
    name: str  # as the docs and the errors call it
    suffix: str  # a file name ending so is read in this format ("": any name no other format claims)
    layout: Layout
    compression: str | None = None  # fsspec's codec name


# decompressed while read, by name; "lzma" (fsspec's lzma.LZMAFile, which detects the container) reads both the
# legacy LZMA-alone files that `lzma`/`xz --format=lzma` write and .xz data under that name
COMPRESSIONS = ((".gz", "gzip"), (".bz2", "bz2"), (".xz", "xz"), (".lzma", "lzma"))
# Every format `prepare` reads, first match wins: the one source of truth for the reader, the docs and the tests
# (tests/test_corpus_formats.py generates its malformation table from it).
FORMATS: tuple[Format, ...] = (
    Format("parquet", ".parquet", Layout.TABLE),
    Format("arrow", ".arrow", Layout.TABLE),
    Format("jsonl", ".jsonl", Layout.LINES),
    *(Format(f"jsonl{s}", f".jsonl{s}", Layout.LINES, c) for s, c in COMPRESSIONS),
    *(Format(f"text{s}", s, Layout.TEXT, c) for s, c in COMPRESSIONS),
    Format("text", "", Layout.TEXT),
)


# Names `prepare` refuses before reading anything, with the fix: an archive is many files in one, which the reader does
# not open (reading a zip's members would make one file many, each with its own format, encoding and skip reasons).
REFUSED: tuple[tuple[str, str, str], ...] = (
    (".zip", "is a zip archive, which prepare does not open", "unzip it into the corpus directory and remove the .zip"),
)


def refused(name: str) -> tuple[str, str] | None:
    """(what the file is, the fix) if a corpus file of this name is refused, else None."""
    return next(((what, fix) for suffix, what, fix in REFUSED if name.lower().endswith(suffix)), None)


def format_of(name: str, setting: str = "auto") -> Format:
    """The format a corpus file is read in: by its name, in any case (`PART-0.PARQUET`, `A.JSONL.GZ`, as a
    .ZIP is refused in any case), or corpus.format's (`setting`) when not auto."""
    if setting != "auto":
        return next(f for f in FORMATS if f.name == setting)
    return next(f for f in FORMATS if name.lower().endswith(f.suffix))


FormatSetting = Literal[("auto", *(f.name for f in FORMATS))]  # corpus.format's choices
