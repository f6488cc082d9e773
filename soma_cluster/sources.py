"""Sources as researchers organise them: the label each document of a user corpus is reported under, and the source x
expert table of the train sequences that `soma prepare` writes into shards/manifest.json.

A document's source, the first that applies (docs/prepare.md, "Sources"):
1. its row's own label, corpus.source_column without a manifest (JSONL, Parquet, Arrow; soma_cluster.corpus reads it);
2. its file's row in the table corpus.source_manifest;
3. the first of corpus.source_patterns whose glob matches its path relative to the corpus root (soma_cluster.globs);
4. its first folder under the corpus root, or for a file directly under it its file type (corpus.default_source).
2 and 3 are resolved here, once, by the driver, before any file is read (label_parts): each file's label travels with
its part (CorpusFile.label) to whichever engine reads it. The named corpora (builtin, machine) keep their own source
names.

A label changes only reporting: the test split hashes a document's name, the packing its bytes, and neither reads the
label, so the shards and the test windows are the same bytes whatever the labels (tests/test_sources.py checks it).
"""

from __future__ import annotations

import csv
import io
import json
import os
import posixpath
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass, replace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from soma_cluster.config import CorpusConfig
from soma_cluster.corpus import Part, clean_label, corpus_fs, is_text_type, shown
from soma_cluster.errors import SomaError
from soma_cluster.formats import FORMATS, Layout
from soma_cluster.globs import compile_glob
from soma_cluster.storage import transient_errors

MANIFEST_PATH = "path"  # the source manifest's column of file paths, relative to the corpus root
MANIFEST_LABEL = "source"  # its column of labels when corpus.source_column is null
MANIFEST_SUFFIXES = (".csv", ".jsonl", ".parquet")  # and .csv/.jsonl compressed (.gz, .bz2, .xz)
SHOWN_NAMES = 3  # names a note lists, the rest counted


# -- labels a setting gives ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Labelled:
    """The parts with each file's label from the settings, and what prepare says about them (one line each)."""

    parts: list[Part]
    notes: list[str]


def label_parts(cfg: CorpusConfig, parts: list[Part]) -> Labelled:
    """Each file's label from corpus.source_manifest, else the first of corpus.source_patterns that matches its path
    ("": the default, corpus.default_source). A manifest that is missing, unreadable or lacks its columns is one
    SomaError naming it and the fix; patterns that label no file and manifest rows that name no file are notes."""
    if not cfg.source_patterns and cfg.source_manifest is None:
        return Labelled(parts, [])
    globs = [(compile_glob(p), clean_label(label) or "text") for p, label in cfg.source_patterns.items()]
    listed = read_manifest(cfg) if cfg.source_manifest is not None else {}
    hits = [0] * len(globs)
    found: set[str] = set()
    unlisted: list[str] = []
    roots = _root_forms(cfg.source)

    def label(name: str) -> str:
        # as the corpus names it, or with the corpus root before it (a manifest made by `find CORPUS -type f`)
        for key in (name, *(f"{r}/{name}" for r in roots), *(r for r in roots if posixpath.basename(r) == name)):
            if key in listed:
                found.add(key)
                return listed[key]
        if cfg.source_manifest is not None:
            unlisted.append(name)
        for i, (glob, text) in enumerate(globs):
            if glob.matches(name):
                hits[i] += 1
                return text
        return ""

    out = [Part(p.index, tuple(f if f.skip else replace(f, label=label(f.name)) for f in p.files)) for p in parts]
    n_files = sum(1 for p in parts for f in p.files if not f.skip)
    notes = [
        f"corpus.source_patterns: {glob.pattern!r} labels none of the {n_files} files read (it matches none, or an "
        "earlier pattern matched them first)"
        for (glob, _), n in zip(globs, hits, strict=True)
        if not n
    ]
    if cfg.source_manifest is not None:
        notes += _manifest_notes(cfg, listed, found, unlisted, n_files)
    return Labelled(out, notes)


def rows_note(cfg: CorpusConfig, formats: dict[str, int]) -> str | None:
    """A note when corpus.source_column names a column of the rows and no file read had rows (formats: bytes per
    format read): the setting then labelled nothing."""
    if cfg.source_column is None or cfg.source_manifest is not None:
        return None
    layouts = {f.name: f.layout for f in FORMATS}
    if any(layouts.get(f) is not Layout.TEXT for f in formats):
        return None
    return (
        f"corpus.source_column={cfg.source_column!r} labels the rows of JSONL, Parquet and Arrow files, and this "
        "corpus gave text files only: its sources are their folders (or file types); label files with "
        "corpus.source_patterns or corpus.source_manifest"
    )


def _manifest_notes(cfg: CorpusConfig, listed: dict, found: set, unlisted: list[str], n_files: int) -> list[str]:
    where = f"corpus.source_manifest {shown(cfg.source_manifest)}"
    notes = []
    absent = sorted(set(listed) - found)
    if absent:
        paths = "1 path that is not a file" if len(absent) == 1 else f"{len(absent):,} paths that are not files"
        notes.append(
            f"{where} lists {paths} read from the corpus ({_some(absent)}): paths are relative to the corpus root; a "
            "file past corpus.max_bytes, hidden or skipped is not read"
        )
    if unlisted:
        fallback = "the first matching corpus.source_patterns, else " if cfg.source_patterns else ""
        notes.append(
            f"{where} does not list {len(unlisted):,} of the {n_files} files read ({_some(unlisted)}): they are "
            f"named by {fallback}their folder (or file type)"
        )
    return notes


def _some(names: list[str]) -> str:
    return ", ".join(shown(n) for n in names[:SHOWN_NAMES]) + (", ..." if len(names) > SHOWN_NAMES else "")


def read_manifest(cfg: CorpusConfig) -> dict[str, str]:
    """corpus.source_manifest as {path relative to the corpus root: label}: a CSV (header row), JSONL or Parquet table
    with the columns `path` and corpus.source_column (default `source`); a null or empty label leaves the file to the
    patterns. Missing, unreadable, without those columns, or a path given two labels: one SomaError."""
    where = cfg.source_manifest or ""
    column = cfg.source_column or MANIFEST_LABEL
    what = f"corpus.source_manifest {shown(where)}"
    base = where.lower()
    for z in (".gz", ".bz2", ".xz"):
        base = base.removesuffix(z)
    if not base.endswith(MANIFEST_SUFFIXES) or (base.endswith(".parquet") and base != where.lower()):
        raise SomaError(
            f"{what} is not a .csv, .jsonl or .parquet file; write the table of each file's {MANIFEST_PATH!r} and "
            f"{column!r} in one of those formats"
        )
    try:
        fs, path = corpus_fs(cfg, where)
        with fs.open(path, "rb", compression="infer") as fh:
            raw = fh.read()
    except FileNotFoundError:
        raise SomaError(
            f"{what} not found; pass an existing table of each file's {MANIFEST_PATH!r} and {column!r}"
        ) from None
    except (OSError, EOFError, *transient_errors()) as exc:
        raise SomaError(
            f"{what} cannot be read ({type(exc).__name__}); fix its path or permissions (for s3://, the endpoint "
            "SOMA_S3_ENDPOINT and the credentials)"
        ) from None
    reader = _parquet_rows if base.endswith(".parquet") else _jsonl_rows if base.endswith(".jsonl") else _csv_rows
    columns, paths, labels = reader(raw, what, column)
    for c, fix in (
        (MANIFEST_PATH, f"name the column of file paths (relative to the corpus root) {MANIFEST_PATH!r}"),
        (column, "set corpus.source_column to the column of labels" + (" (null: 'source')" * (column == "source"))),
    ):
        if c not in columns:
            names = ", ".join(map(shown, columns)) or "none"
            raise SomaError(f"{what} has no column {c!r} (its columns: {names}); {fix}")
    return _mapping(paths, labels, what, column)


# a manifest's (columns, paths, labels): the values of its path and label columns, row by row (None where absent)
Columns = tuple[list[str], list, list]


def _csv_rows(raw: bytes, what: str, column: str) -> Columns:
    # surrogateescape: a path that is not UTF-8 matches the corpus's name for it (os.fsdecode's)
    text = raw.decode("utf-8", "surrogateescape").removeprefix("\ufeff")
    try:
        rows = [r for r in csv.reader(io.StringIO(text, newline="")) if r]
    except csv.Error as exc:
        raise SomaError(f"{what} is not readable CSV ({exc}); fix it (a header row, then one row a file)") from None
    columns = rows[0] if rows else []

    def values(c: str) -> list:
        if c not in columns:
            return []
        i = columns.index(c)
        return [r[i] if i < len(r) else None for r in rows[1:]]

    return columns, values(MANIFEST_PATH), values(column)


def _jsonl_rows(raw: bytes, what: str, column: str) -> Columns:
    columns, paths, labels = {}, [], []
    for i, line in enumerate(raw.decode("utf-8", "surrogateescape").splitlines()):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            raise SomaError(f"{what}: line {i + 1} is not JSON; fix or remove that line") from None
        if not isinstance(row, dict):
            raise SomaError(f"{what}: line {i + 1} is not a JSON object; write one object a file per line") from None
        columns.update(dict.fromkeys(row))
        paths.append(row.get(MANIFEST_PATH))
        labels.append(row.get(column))
    return list(columns), paths, labels


def _parquet_rows(raw: bytes, what: str, column: str) -> Columns:
    try:
        pf = pq.ParquetFile(pa.BufferReader(raw))
        columns = pf.schema_arrow.names
        wanted = [c for c in (MANIFEST_PATH, column) if c in columns]
        for c in wanted:
            if not is_text_type(pf.schema_arrow.field(c).type):
                raise SomaError(
                    f"{what}: column {c!r} is {pf.schema_arrow.field(c).type}, not text; write the paths and labels "
                    "as strings"
                )
        table = pf.read(columns=wanted)
    except (pa.ArrowException, OSError) as exc:
        raise SomaError(f"{what} is not readable Parquet ({exc}); replace it") from None
    data = {c: table.column(c).to_pylist() for c in wanted}
    return columns, data.get(MANIFEST_PATH, []), data.get(column, [])


def _mapping(paths: list, labels: list, what: str, column: str) -> dict[str, str]:
    """{relative path: label} from the manifest's columns (row i + 1 in an error: the i-th row of data)."""
    out: dict[str, str] = {}
    first: dict[str, int] = {}
    cleaned: dict = {}  # label as written -> clean_label's: a manifest of a million files has a few labels
    for i, (path, label) in enumerate(zip(paths, labels, strict=True)):
        if path is None or label is None:
            continue  # no path, or no label: the file is left to the patterns
        if not isinstance(path, (str, bytes)) or not isinstance(label, (str, bytes)):
            name, value = (MANIFEST_PATH, path) if not isinstance(path, (str, bytes)) else (column, label)
            raise SomaError(
                f"{what}: row {i + 1}: {name!r} is {type(value).__name__}, not text; write the paths and labels as "
                "strings"
            )
        text = cleaned[label] if label in cleaned else cleaned.setdefault(label, clean_label(label))
        if not path or text is None:
            continue
        key = _normal(path)
        if out.setdefault(key, text) != text:
            raise SomaError(
                f"{what} gives {shown(key)} two sources, {out[key]!r} (row {first[key]}) and {text!r} (row {i + 1}); "
                "keep one row a file"
            )
        first.setdefault(key, i + 1)
    return out


def _normal(path: str | bytes) -> str:
    """A manifest path, '/'-separated, without './' or '//' (posixpath.normpath)."""
    text = (path.decode("utf-8", "surrogateescape") if isinstance(path, bytes) else path).strip()
    if "\\" in text or "//" in text or "./" in text or text.endswith("/") or text == ".":
        return posixpath.normpath(text.replace("\\", "/"))
    return text


def _root_forms(source: str) -> list[str]:
    """The corpus root as a manifest may write it before each path: as corpus.source gives it, and (local) absolute."""
    forms = [_normal(source.rstrip("/"))]
    if "://" not in source:
        forms.append(_normal(os.path.abspath(source)))
    return list(dict.fromkeys(forms))


# -- the source x expert table ---------------------------------------------------------------------------------------
def merge_tables(n_experts: int, parts: Iterable[tuple[list[str], np.ndarray]]) -> dict[str, np.ndarray]:
    """{source: (N,) counts} from each part's (labels, (S_p, N) counts), largest source first (ties by name)."""
    out: dict[str, np.ndarray] = {}
    for labels, table in parts:
        for label, row in zip(labels, table, strict=True):
            out[label] = out.get(label, np.zeros(n_experts, np.int64)) + row
    return dict(sorted(out.items(), key=lambda kv: (-int(kv[1].sum()), kv[0])))


def table_json(table: dict[str, np.ndarray]) -> list[dict]:
    """As shards/manifest.json keeps it: [{source, sequences, experts {index: count}}] (non-zero counts only, so 10,000
    sources at N = 1,024 stay as small as the sequences they count), largest source first."""
    return [
        {"source": s, "sequences": int(row.sum()), "experts": {str(e): int(row[e]) for e in np.flatnonzero(row)}}
        for s, row in table.items()
    ]


def table_from_json(rows: list[dict], n_experts: int) -> dict[str, np.ndarray]:
    out = {}
    for r in rows:
        row = np.zeros(n_experts, np.int64)
        for e, c in r["experts"].items():
            row[int(e)] = c
        out[r["source"]] = row
    return out


SHOWN_SOURCES = 20  # a source table lists this many sources, the largest; the rest are counted in one line
FULL_EXPERTS = 8  # up to this N a table has a column per expert; beyond, each source's top experts
TOP_EXPERTS = 3


def table_lines(table: dict[str, np.ndarray], unit: str = "seqs") -> list[str]:
    """A source x expert table in at most SHOWN_SOURCES + 2 lines of at most 80 columns: each source's count and
    the share of it each expert holds (N <= FULL_EXPERTS), or its TOP_EXPERTS experts by share; the rest counted.
    Expert e is `e<e>` (expert-0007: e7)."""
    n = len(next(iter(table.values()))) if table else 0
    shown_rows = list(table.items())[:SHOWN_SOURCES]
    if n <= FULL_EXPERTS:
        head = f"  {'source':<18} {unit:>9}" + "".join(f"{'e' + str(e):>6}" for e in range(n))
    else:
        head = f"  {'source':<18} {unit:>9}  top {TOP_EXPERTS} experts (share of the source's {unit})"
    lines = [head]
    for s, row in shown_rows:
        total = max(int(row.sum()), 1)
        if n <= FULL_EXPERTS:
            cells = "".join(f"{100 * c / total:5.0f}%" for c in row)
        else:
            top = np.argsort(-row, kind="stable")[:TOP_EXPERTS]
            cells = "  " + ", ".join(f"e{e} {100 * row[e] / total:.0f}%" for e in top if row[e])
            others = int((row > 0).sum()) - int((row[top] > 0).sum())
            if others:
                cells += f" +{100 * (total - row[top].sum()) / total:.0f}% in {others} more"
        lines.append(f"  {_cell(s, 18)} {int(row.sum()):>9,}" + cells)
    rest = list(table.values())[SHOWN_SOURCES:]
    if rest:
        lines.append(f"  ... and {len(rest):,} more sources of {int(sum(r.sum() for r in rest)):,} {unit}")
    return lines


def _cell(label: str, width: int) -> str:
    """A label cut to `width` terminal columns (the cut marked), padded: a CJK character takes two, a combining mark
    none."""
    if _columns(label) > width:
        cut = ""
        for ch in label:
            if _columns(cut + ch) > width - 1:
                break
            cut += ch
        label = cut + "\u2026"
    return label + " " * (width - _columns(label))


def _columns(text: str) -> int:
    return sum(0 if unicodedata.combining(ch) else 2 if unicodedata.east_asian_width(ch) in "WF" else 1 for ch in text)
