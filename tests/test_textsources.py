"""The built-in corpus is fixed bytes shipped in the package: pinned, checksummed, licensed, and never the machine's."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile

import pytest

import soma_cluster.textsources as ts
from soma_cluster.errors import SomaError

# sha256 over the first 6 MB of built-in documents (ids, sources and bytes): what the tiny preset and make demo read.
# It changes only when the archive, the cleaning or the mixing changes, and then every demo number changes with it.
TINY_DOCUMENTS_SHA256 = "48a3a9db40e74c307e67618b48bc2f96a8975b35365dba5ed1212ced093d4590"


def _digest(max_bytes: int) -> tuple[str, int, dict[str, int]]:
    h, n, counts = hashlib.sha256(), 0, {}
    for doc in ts.builtin_documents(max_bytes, counts):
        h.update(f"{doc.doc_id}\0{doc.source}\0{len(doc.data)}\0".encode("utf-8", "surrogateescape"))
        h.update(doc.data)
        n += 1
    return h.hexdigest(), n, counts


def test_the_archive_is_the_pinned_one_and_matches_its_manifest():
    blob = ts.BUILTIN_ARCHIVE.read_bytes()
    assert hashlib.sha256(blob).hexdigest() == ts.BUILTIN_SHA256
    manifest = json.loads((ts.DATA / "builtin-corpus.json").read_text())
    assert manifest["sha256"] == ts.BUILTIN_SHA256
    files = ts.builtin_files()
    assert [f"{f.source}/{f.name}" for f in files] == [m["name"] for m in manifest["files"]]
    for f, m in zip(files, manifest["files"], strict=True):
        assert hashlib.sha256(f.raw).hexdigest() == m["sha256"] and len(f.raw) == m["bytes"], m["name"]


def test_every_file_names_a_licence_that_ships_beside_it():
    """Each file's origin is Python (its licence file ships), a wheel's own license text, or a Debian package whose
    copyright file ships in soma_cluster/data/licenses/."""
    manifest = json.loads((ts.DATA / "builtin-corpus.json").read_text())
    licences = ts.DATA / "licenses"
    assert (licences / "Python-LICENSE.txt").is_file()
    for m in manifest["files"]:
        origin = m["origin"]
        if origin.startswith("Python "):
            assert m["name"].split("/")[0] in ("pydoc-topics", "python-stdlib")
        elif origin.startswith("the "):
            assert m["name"].startswith("licenses/") and "LICENSE" in m["name"].upper()
        else:
            assert (licences / f"{origin.split()[0]}.copyright").is_file(), m
    assert (ts.DATA / "BUILTIN-CORPUS.md").is_file()


def test_the_tiny_preset_reads_the_same_documents_everywhere():
    digest, n, counts = _digest(6_000_000)
    assert sum(counts.values()) == 6_000_000
    assert set(counts) == {"pydoc-topics", "python-stdlib", "licenses", "common-licenses", "man-pages", "info-pages"}
    assert (digest, n) == (TINY_DOCUMENTS_SHA256, 674), "the built-in documents changed: every demo number changes"
    assert _digest(6_000_000)[0] == digest  # and again, from the cached archive


def test_the_builtin_corpus_never_reads_the_machine(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the built-in corpus read the machine's files")

    monkeypatch.setattr(ts, "local_files", refuse)
    monkeypatch.setattr(ts, "pydoc_topics", refuse)
    monkeypatch.setattr(ts, "machine_files", refuse)
    assert sum(len(d.data) for d in ts.builtin_documents(500_000)) == 500_000
    assert ts.builtin_bytes() > 7_000_000


@pytest.mark.parametrize("damage", ["flipped", "truncated", "missing"])
def test_a_damaged_archive_is_refused_naming_it(tmp_path, monkeypatch, damage):
    blob = bytearray(ts.BUILTIN_ARCHIVE.read_bytes())
    bad = tmp_path / "builtin-corpus.tar.xz"
    if damage == "flipped":
        blob[len(blob) // 2] ^= 1
        bad.write_bytes(blob)
    elif damage == "truncated":
        bad.write_bytes(blob[:1000])
    monkeypatch.setattr(ts, "BUILTIN_ARCHIVE", bad)
    ts.builtin_files.cache_clear()
    try:
        with pytest.raises(SomaError, match=str(bad)) as info:
            list(ts.builtin_documents(1000))
        assert "reinstall" in str(info.value) and len(str(info.value).splitlines()) == 1
    finally:
        ts.builtin_files.cache_clear()


def test_the_archive_holds_plain_files_named_by_source():
    """Readable by any tar: regular files only, named <source>/<path>, no absolute or parent paths."""
    with tarfile.open(fileobj=io.BytesIO(ts.BUILTIN_ARCHIVE.read_bytes()), mode="r:xz") as tar:
        members = tar.getmembers()
    assert members and all(m.isfile() for m in members)
    assert all(not m.name.startswith("/") and ".." not in m.name.split("/") for m in members)
    assert {m.name.split("/")[0] for m in members} == {f.source for f in ts.builtin_files()}
