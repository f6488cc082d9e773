"""Named sources of real text: the built-in corpus and the machine's own text.

`builtin` is fixed bytes that ship in the package (soma_cluster/data/builtin-corpus.tar.xz: Python's
reference topics and standard library, license texts, the Linux man-pages and GNU manuals, each file
verbatim with its notice; provenance and licences in soma_cluster/data/BUILTIN-CORPUS.md). Its sha256 is
pinned here, so every machine trains on the same bytes and `make demo` prints the same numbers.

`machine` is the text this machine happens to have (Python's docs and sources, license texts, man/info
pages and package docs): larger, but different from machine to machine. A user names it on purpose
(corpus.source=machine); the suite and the demo never read it.

Both give documents the same way: each source's files in a machine-independent order (the sha1 of the
path relative to the source's root), mixed by bytes (the next document comes from the source with the
fewest bytes so far) up to a cap, a document cut at MAX_DOC_BYTES so a few huge files (info manuals,
changelogs) cannot crowd out the rest.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import io
import re
import sysconfig
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

from soma_cluster.errors import SomaError

MIN_DOC_BYTES = 64
MAX_DOC_BYTES = 256_000

BUILTIN = "builtin"
MACHINE = "machine"
NAMED_SOURCES = (BUILTIN, MACHINE)  # corpus.source values that are not paths (a path named so: ./builtin)

DATA = Path(__file__).resolve().parent / "data"
BUILTIN_ARCHIVE = DATA / "builtin-corpus.tar.xz"
# the archive's sha256: a different file (edited, truncated, another version) is refused, naming it
BUILTIN_SHA256 = "ef1faff6a1ce0d8225f828cce15cdd0b6545ce0e24d11e49fad993f4b89df340"


@dataclass(frozen=True)
class Document:
    doc_id: str  # stable name (path, topic, row) used for the test split and the bootstrap
    source: str  # which named source or user file it came from
    data: bytes


def stable_order(root: Path, paths: Iterable[Path]) -> list[Path]:
    """A machine-independent shuffle of a file list, so a capped corpus mixes its sources' topics: keyed by the path
    relative to its source's root, so a source under the venv (licenses) gives the same order wherever it lives."""
    return sorted(paths, key=lambda p: hashlib.sha1(str(p.relative_to(root)).encode()).digest())


def read_maybe_gz(path: Path) -> bytes:
    raw = path.read_bytes()
    return gzip.decompress(raw) if path.suffix == ".gz" else raw


_TROFF = re.compile(rb"\\f[BIRP]|\\\(..|\\[-e&|^]|\\s[-+]?\d")


def clean_troff(data: bytes) -> bytes:
    """Man pages are troff: drop comments and macro names, keep the words."""
    out = []
    for line in data.split(b"\n"):
        if line.startswith(b'.\\"') or line.startswith(b"'\\\""):
            continue
        if line.startswith(b"."):
            line = line.split(b" ", 1)[1] if b" " in line else b""
        out.append(_TROFF.sub(b"", line))
    return b"\n".join(out)


def _plain(data: bytes) -> bytes:
    return data


CLEANERS: dict[str, Callable[[bytes], bytes]] = {"man-pages": clean_troff}  # raw file bytes -> document text


@dataclass(frozen=True)
class RawFile:
    """One file of a source before cleaning: its name relative to the source's root (the document's id) and its
    bytes, decompressed (what the built-in archive holds verbatim, notices included)."""

    source: str
    name: str
    raw: bytes

    def document(self) -> Document | None:
        data = CLEANERS.get(self.source, _plain)(self.raw)
        return Document(f"{self.source}:{self.name}", self.source, data) if len(data) >= MIN_DOC_BYTES else None


def local_files(
    source: str, root: Path, pattern: str, skip: Callable[[Path], bool] = lambda rel: False
) -> Iterator[RawFile]:
    """The files of `root` matching `pattern`, in stable order; `skip` sees the path relative to the root (so a root
    under a folder named `tests` is not itself skipped). A .gz file is named without its suffix."""
    if not root.is_dir():
        return
    found = (p for p in root.glob(pattern) if p.is_file() and not p.is_symlink() and not skip(p.relative_to(root)))
    for path in stable_order(root, found):
        try:
            raw = read_maybe_gz(path)
        except (OSError, EOFError, gzip.BadGzipFile):
            continue
        rel = path.relative_to(root)
        yield RawFile(source, str(rel.with_suffix("") if rel.suffix == ".gz" else rel), raw)


def pydoc_topics() -> Iterator[RawFile]:
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return
    for name in sorted(topics):
        yield RawFile("pydoc-topics", name, topics[name].encode())


def _skip_tests(rel: Path) -> bool:
    return "test" in rel.parts or "tests" in rel.parts or "site-packages" in rel.parts


def machine_files() -> dict[str, Iterator[RawFile]]:
    """Every source of real text this machine has; missing ones simply yield nothing."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    purelib = Path(sysconfig.get_paths()["purelib"])
    return {
        "pydoc-topics": pydoc_topics(),
        "python-stdlib": local_files("python-stdlib", stdlib, "**/*.py", _skip_tests),
        "licenses": local_files("licenses", purelib, "*.dist-info/**/LICENSE*"),
        "common-licenses": local_files("common-licenses", Path("/usr/share/common-licenses"), "*"),
        "man-pages": local_files("man-pages", Path("/usr/share/man"), "man[1-8]/*.gz"),
        "info-pages": local_files("info-pages", Path("/usr/share/info"), "*.gz"),
        "package-docs": local_files("package-docs", Path("/usr/share/doc"), "*/*"),
    }


def mix(
    sources: dict[str, Iterator[RawFile]], max_bytes: int, counts: dict[str, int] | None = None
) -> Iterator[tuple[RawFile, Document]]:
    """Mix the sources by bytes (next document from the source with the fewest bytes so far) until max_bytes;
    `counts` receives the bytes taken per source. Each document comes with the raw file it was cleaned from."""
    live = dict(sources)
    taken = dict.fromkeys(live, 0)
    total = 0
    while live and total < max_bytes:
        name = min(live, key=lambda n: taken[n])
        raw = next(live[name], None)
        if raw is None:
            del live[name]
            continue
        doc = raw.document()
        if doc is None:
            continue
        data = doc.data[: min(MAX_DOC_BYTES, max_bytes - total)]
        taken[name] += len(data)
        total += len(data)
        yield raw, Document(doc.doc_id, doc.source, data)
    if counts is not None:
        counts.update({k: v for k, v in taken.items() if v})


def machine_documents(max_bytes: int, counts: dict[str, int] | None = None) -> Iterator[Document]:
    """The machine's own text (corpus.source=machine), mixed up to max_bytes."""
    for _, doc in mix(machine_files(), max_bytes, counts):
        yield doc


# -- the built-in corpus: fixed bytes in the package ----------------------------------------------------------
def _builtin_error(what: str) -> SomaError:
    return SomaError(
        f"built-in corpus {BUILTIN_ARCHIVE} {what}; reinstall soma-cluster (pip install --force-reinstall) or "
        "restore the file from the repository (git checkout -- soma_cluster/data)"
    )


@functools.lru_cache(maxsize=1)
def builtin_files() -> tuple[RawFile, ...]:
    """The built-in archive's files, in its order (each source's files in stable order), after checking its
    sha256 against the pinned one. Read once per process (about 8 MB)."""
    try:
        blob = BUILTIN_ARCHIVE.read_bytes()
    except OSError as exc:
        raise _builtin_error(f"cannot be read ({exc.strerror or exc})") from None
    digest = hashlib.sha256(blob).hexdigest()
    if digest != BUILTIN_SHA256:
        raise _builtin_error(f"has sha256 {digest[:16]}..., not the pinned {BUILTIN_SHA256[:16]}...")
    out = []
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:xz") as tar:
        for member in tar:
            if not member.isfile():
                continue
            source, _, name = member.name.partition("/")
            fh = tar.extractfile(member)
            assert fh is not None
            out.append(RawFile(source, name, fh.read()))
    return tuple(out)


def builtin_sources() -> dict[str, Iterator[RawFile]]:
    """The built-in corpus's sources, each its files in the archive's order."""
    grouped: dict[str, list[RawFile]] = {}
    for f in builtin_files():
        grouped.setdefault(f.source, []).append(f)
    return {name: iter(files) for name, files in grouped.items()}


def builtin_documents(max_bytes: int, counts: dict[str, int] | None = None) -> Iterator[Document]:
    """The built-in corpus (the same bytes on every machine), mixed up to max_bytes."""
    for _, doc in mix(builtin_sources(), max_bytes, counts):
        yield doc


@functools.lru_cache(maxsize=1)
def builtin_bytes() -> int:
    """Every byte the built-in corpus can give (its documents' bytes after cleaning and the per-document cut)."""
    return sum(len(doc.data) for doc in builtin_documents(1 << 62))


def named_documents(source: str, max_bytes: int, counts: dict[str, int] | None = None) -> Iterator[Document]:
    """The documents of a named source (NAMED_SOURCES)."""
    if source == BUILTIN:
        return builtin_documents(max_bytes, counts)
    if source == MACHINE:
        return machine_documents(max_bytes, counts)
    raise ValueError(f"not a named source: {source!r}")
