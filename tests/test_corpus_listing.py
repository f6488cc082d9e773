"""Which files a corpus directory gives and how much of one record is held: hidden names left out and reported,
symbolic links followed once (loops and second names reported, never walked in circles), archives refused, a record
over MAX_RECORD_BYTES refused while reading holds a bounded amount of it. Real files, links and mounts; S3 through the
moto server; a sample through `soma prepare`."""

from __future__ import annotations

import gzip
import json
import lzma
import os
import subprocess
import sys
import tracemalloc
import zipfile
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest
from conftest import assert_one_line_error, soma
from support.s3server import s3  # noqa: F401

import soma_cluster.corpus as corpus
import soma_cluster.textsources as textsources
from soma_cluster.config import CorpusConfig
from soma_cluster.corpus import (
    MAX_RECORD_BYTES,
    SKIP_HIDDEN,
    SKIP_LOOP,
    SKIP_SEEN,
    describe_skipped,
    plan_parts,
    user_documents,
)
from soma_cluster.errors import SomaError

TEXT = b"A line of text long enough to be a document of its own.\n" * 3


def read(source: str, **settings) -> tuple[list[tuple[str, bytes]], dict[str, list[str]]]:
    skipped: dict[str, list[str]] = {}
    cfg = CorpusConfig(source=source, max_bytes=10**12, **settings)
    return [(d.doc_id, d.data) for d in user_documents(cfg, skipped)], skipped


def error_of(source: str, **settings) -> str:
    with pytest.raises(SomaError) as info:
        read(source, **settings)
    line = str(info.value)
    assert "\n" not in line and line.isprintable(), line
    return line


def tree(root: Path, spec: dict[str, bytes | str]) -> Path:
    """Files (bytes) and symbolic links ("->TARGET") under root, made in the order given."""
    for rel, content in spec.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, str):
            os.symlink(content[2:], path)
        else:
            path.write_bytes(content)
    return root


# -- hidden names ------------------------------------------------------------------------------------------------
def test_hidden_names_are_left_out_unopened_and_reported(tmp_path):
    root = tree(
        tmp_path / "c",
        {
            "a.txt": TEXT,
            ".DS_Store": b"\x00\x00\x00\x01Bud1",
            **{f".git/objects/{i:02x}/obj": TEXT for i in range(30)},  # one name, however many files
            "sub/.notes.txt.swp": TEXT,
            "sub/b.txt": TEXT,
            os.fsdecode(b".caf\xe9"): TEXT,  # a hidden name that is not UTF-8: shown escaped
        },
    )
    os.mkfifo(root / "sub" / ".socket-like")  # never opened: a hidden FIFO does not block
    docs, skipped = read(str(root))
    assert [d for d, _ in docs] == ["a.txt", "sub/b.txt"]
    hidden = [".DS_Store", os.fsdecode(b".caf\xe9"), ".git/", "sub/.notes.txt.swp", "sub/.socket-like"]
    assert skipped == {SKIP_HIDDEN: sorted(hidden)}
    line = describe_skipped(skipped, 3)
    assert line == "; skipped 5 files: hidden (name starts with a dot) 5 (.DS_Store, .caf\\xe9, .git/, ...)", line


def test_a_directory_of_only_hidden_files_holds_no_text_and_says_why(tmp_path):
    root = tree(tmp_path / "c", {".a.txt": TEXT, ".cache/b.txt": TEXT})
    line = error_of(str(root))
    assert "holds no text; skipped 2 files: hidden (name starts with a dot) 2 (.a.txt, .cache/)" in line, line
    assert "point corpus.source" in line


def test_hidden_keys_on_s3_are_left_out_once_per_hidden_part(s3, monkeypatch):  # noqa: F811
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    fs = s3.fs()
    keys = ["a.txt", ".git/HEAD", ".git/objects/ab/cd", "d/.cache/x/y.txt", "d/.hid.txt", "d/b.txt", "d/.cache/z"]
    for key in keys:
        fs.pipe(f"{s3.bucket}/hid/{key}", TEXT)
    docs, skipped = read(s3.url("hid"))
    assert [d for d, _ in docs] == ["a.txt", "d/b.txt"]
    assert skipped == {SKIP_HIDDEN: [".git/", "d/.cache/", "d/.hid.txt"]}


# -- symbolic links ----------------------------------------------------------------------------------------------
LINKED = {
    "ext/e.txt": TEXT,  # outside the corpus root, reached through links
    "ext/inner/f.txt": TEXT,
    "ext2/g.txt": TEXT,
    "far/f.txt": TEXT,
    "c/a.txt": TEXT,
    "c/sub/b.txt": TEXT,
    "c/sub/self": "->.",  # a loop: the directory it is in
    "c/up": "->..",  # a loop: above the root
    "c/top": "->/",  # a loop: never a walk of the whole filesystem
    "c/zz": "->sub",  # a second name of a directory read: left out
    "c/alias.txt": "->sub/b.txt",  # a second name of a file: its real name wins, though it sorts first
    "c/data": "->../ext",  # a directory outside: read under the link's name
    "c/c1": "->c2",  # a chain of links to another directory outside
    "c/c2": "->../ext2",
    "c/far.txt": "->../far/f.txt",  # a file outside
}


def test_links_are_followed_once_and_named_by_their_path(tmp_path):
    tree(tmp_path, LINKED)
    docs, skipped = read(str(tmp_path / "c"))
    assert docs == [(n, TEXT) for n in ["a.txt", "c1/g.txt", "data/e.txt", "data/inner/f.txt", "far.txt", "sub/b.txt"]]
    assert skipped == {SKIP_SEEN: ["alias.txt", "c2/", "zz/"], SKIP_LOOP: ["sub/self/", "top/", "up/"]}


def test_the_order_is_that_of_the_paths_whatever_the_walk(tmp_path):
    """The same tree made in the opposite order (another directory order on disk) reads the same documents in the
    same order; the skipped names too."""
    tree(tmp_path / "one", LINKED)
    tree(tmp_path / "two", dict(reversed(list(LINKED.items()))))
    assert read(str(tmp_path / "one" / "c")) == read(str(tmp_path / "two" / "c"))
    names = [f.name for p in plan_parts(CorpusConfig(source=str(tmp_path / "one" / "c")), 1 << 20) for f in p.files]
    assert names == sorted(names)


def test_a_broken_link_in_a_linked_directory_is_an_error_naming_it(tmp_path):
    tree(tmp_path, {"ext/e.txt": TEXT, "ext/gone.txt": "->nowhere.txt", "c/a.txt": TEXT, "c/data": "->../ext"})
    line = error_of(str(tmp_path / "c"))
    assert f"{tmp_path / 'c' / 'data' / 'gone.txt'} is a broken symbolic link" in line, line
    assert "remove it or point it at a file" in line


def test_a_link_to_a_fifo_or_a_device_is_refused_unopened(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    tree(tmp_path, {"c/a.txt": TEXT, "c/q.txt": "->../fifo"})
    line = error_of(str(tmp_path / "c"))
    assert f"{tmp_path / 'c' / 'q.txt'} is a symbolic link to a FIFO" in line and "remove it" in line, line
    (tmp_path / "c" / "q.txt").unlink()
    os.symlink("/dev/zero", tmp_path / "c" / "z.txt")  # would never end
    assert "z.txt is a symbolic link to a character device" in error_of(str(tmp_path / "c"))


def test_a_bind_mount_of_the_root_inside_it_is_a_loop(tmp_path):
    root = tree(tmp_path / "c", {"a.txt": TEXT, "mnt/keep": TEXT})
    proc = subprocess.run(["mount", "--bind", str(root), str(root / "mnt")], capture_output=True, text=True)
    if proc.returncode:
        pytest.skip(f"mount --bind refused: {proc.stderr.strip()}")
    try:
        docs, skipped = read(str(root))
    finally:
        subprocess.run(["umount", str(root / "mnt")], check=True)
    assert [d for d, _ in docs] == ["a.txt"] and skipped == {SKIP_LOOP: ["mnt/"]}


# -- archives ------------------------------------------------------------------------------------------------------
def test_a_zip_is_refused_before_anything_is_read(tmp_path):
    root = tree(tmp_path / "c", {"a.txt": TEXT, ".old.zip": b"PK\x03\x04 hidden: left out"})
    with zipfile.ZipFile(root / "b.ZIP", "w") as z:
        z.writestr("inside.txt", TEXT)
    for settings in ({}, {"format": "text"}):
        line = error_of(str(root), **settings)
        assert f"corpus file {root / 'b.ZIP'} is a zip archive" in line and "unzip it" in line, line
    line = error_of(str(root / "b.ZIP"))  # the corpus path itself
    assert "is a zip archive" in line and "unzip it" in line, line


# -- .lzma: the legacy LZMA-alone container ------------------------------------------------------------------------
def test_lzma_files_in_either_container_and_broken_ones(tmp_path):
    alone = lzma.compress(TEXT, format=lzma.FORMAT_ALONE)
    root = tree(tmp_path / "c", {"a.lzma": alone, "b.lzma": lzma.compress(TEXT), "c.jsonl.lzma": b""})
    docs, skipped = read(str(root))
    assert docs == [("a.lzma", TEXT), ("b.lzma", TEXT)] and skipped == {"empty": ["c.jsonl.lzma"]}
    (root / "d.lzma").write_bytes(b"\xff" + alone[1:])  # properties byte out of range: not an LZMA header
    line = error_of(str(root))
    assert "d.lzma is not valid lzma data" in line and "rename it without .lzma" in line, line
    (root / "d.lzma").write_bytes(alone[:-3])
    assert "d.lzma ends early (a truncated lzma stream)" in error_of(str(root))


# -- records and their cap -----------------------------------------------------------------------------------------
def _jsonl_gz(path: Path, text_bytes: int, after: bytes = b"") -> None:
    """One JSONL record whose line is 12 + text_bytes bytes long, written 1 MiB at a time."""
    with gzip.open(path, "wb", compresslevel=1) as fh:
        fh.write(b'{"text": "')
        for at in range(0, text_bytes, 1 << 20):
            fh.write(b"a" * min(1 << 20, text_bytes - at))
        fh.write(b'"}\n' + after)


def test_a_jsonl_line_at_the_cap_is_read_and_one_byte_more_is_refused(tmp_path):
    _jsonl_gz(tmp_path / "a.jsonl.gz", MAX_RECORD_BYTES - 12, b'{"text": "after"}\n')
    docs, _ = read(str(tmp_path))
    assert [(d, len(b)) for d, b in docs] == [("a.jsonl.gz:0", MAX_RECORD_BYTES - 12), ("a.jsonl.gz:1", 5)]
    _jsonl_gz(tmp_path / "a.jsonl.gz", MAX_RECORD_BYTES - 11)
    line = error_of(str(tmp_path))
    assert f"a.jsonl.gz line 1 is {MAX_RECORD_BYTES + 1:,} bytes, more than the 67,108,864 (64 MiB)" in line, line
    assert "split it into records of at most that size" in line and "or remove it" in line


def test_the_cap_holds_for_a_last_line_without_newline_and_counts_a_crlf(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus, "MAX_RECORD_BYTES", 100)  # the rule at a size that makes the edges cheap
    (tmp_path / "a.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "' + b"x" * 88 + b'"}')  # line 2: 100 bytes
    assert read(str(tmp_path))[0] == [("a.jsonl:0", b"ok"), ("a.jsonl:1", b"x" * 88)]
    (tmp_path / "a.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "' + b"x" * 300 + b'"}')
    assert "a.jsonl line 2 is 312 bytes, more than the 100" in error_of(str(tmp_path))
    (tmp_path / "a.jsonl").write_bytes(b'{"text": "' + b"x" * 88 + b'"}\r\n')  # the \r is the line's: 101 bytes
    assert "a.jsonl line 1 is 101 bytes" in error_of(str(tmp_path))


def _peak_python_bytes(run) -> int:
    tracemalloc.start()
    try:
        run()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_huge_line_is_read_in_bounded_memory(tmp_path):
    """A 128 MiB JSONL line is refused holding about the cap of it; a 128 MiB line of plain text is cut into
    documents holding about one of them."""
    size = 128 << 20
    (tmp_path / "j").mkdir()
    _jsonl_gz(tmp_path / "j" / "a.jsonl.gz", size)
    line = ""

    def refuse() -> None:
        nonlocal line
        line = error_of(str(tmp_path / "j"))

    peak = _peak_python_bytes(refuse)
    assert f"line 1 is {size + 12:,} bytes" in line, line
    assert peak < MAX_RECORD_BYTES + (8 << 20), peak  # the old reader joined the whole line: 128 MiB and more
    (tmp_path / "t").mkdir()
    with gzip.open(tmp_path / "t" / "one-line.gz", "wb", compresslevel=1) as fh:
        for _ in range(size >> 20):
            fh.write(b"word " * ((1 << 20) // 5) + b"w" * ((1 << 20) % 5))  # 1 MiB without a newline
    n_docs = total = 0

    def cut() -> None:
        nonlocal n_docs, total
        for doc in user_documents(CorpusConfig(source=str(tmp_path / "t"), max_bytes=10**12)):
            n_docs, total = n_docs + 1, total + len(doc.data)

    peak = _peak_python_bytes(cut)
    assert total == size and n_docs == -(-size // 256_000)
    assert peak < 8 << 20, peak


def _table(path: Path, texts: list[bytes], row_group: int) -> None:
    table = pa.table({"id": pa.array(range(len(texts))), "text": pa.array(texts, pa.binary())})
    if path.suffix == ".parquet":
        pq.write_table(table, path, row_group_size=row_group)
    else:
        with ipc.new_file(str(path), table.schema) as w:
            for batch in table.to_batches(max_chunksize=row_group):
                w.write_batch(batch)


@pytest.mark.parametrize("suffix", [".parquet", ".arrow"])
def test_a_table_value_over_the_cap_is_refused_naming_its_row(tmp_path, monkeypatch, suffix):
    monkeypatch.setattr(corpus, "MAX_RECORD_BYTES", 1000)  # the rule, not its size: 64 MiB rows are slow to write
    texts = [b"x" * 1000, b"y" * 10, None, b"z" * 1001]
    _table(tmp_path / f"t{suffix}", texts, row_group=2)
    line = error_of(str(tmp_path))
    assert f"t{suffix} row 4 is 1,001 bytes, more than the 1,000" in line, line
    assert "split its text into rows of at most that size" in line
    _table(tmp_path / f"t{suffix}", texts[:3], row_group=2)
    assert read(str(tmp_path))[0] == [(f"t{suffix}:0", texts[0]), (f"t{suffix}:1", texts[1])]


def test_parquet_long_texts_are_decoded_a_few_rows_at_a_time(tmp_path):
    """One row group of 48 texts of 1 MiB: the old reader made all 48 MiB into Python bytes at once."""
    texts = [bytes([65 + i % 26]) * (1 << 20) for i in range(48)]
    _table(tmp_path / "long.parquet", texts, row_group=48)
    seen = []
    docs = lambda: user_documents(CorpusConfig(source=str(tmp_path), max_bytes=10**12))  # noqa: E731
    peak = _peak_python_bytes(lambda: seen.extend((d.doc_id, d.data[:1], len(d.data)) for d in docs()))
    assert seen == [(f"long.parquet:{i}", t[:1], len(t)) for i, t in enumerate(texts)]
    assert peak < corpus.BATCH_BYTES + (8 << 20), peak


ANON_PEAK = """
import sys
from soma_cluster.config import CorpusConfig
from soma_cluster.corpus import user_documents
def anon():  # resident memory that no file backs, in MiB
    return next(int(ln.split()[1]) for ln in open("/proc/self/status") if ln.startswith("RssAnon")) / 1024
base, peak, n = anon(), 0.0, 0
for doc in user_documents(CorpusConfig(source=sys.argv[1], max_bytes=10**12)):
    n, peak = n + len(doc.data), max(peak, anon())
print(n, peak - base)
"""


def test_a_large_arrow_batch_is_mapped_not_copied(tmp_path):
    """One Arrow record batch of 96 MiB (its writer's choice): read from the file's mapped pages, the reader's
    anonymous memory grows by about a slice of BATCH_BYTES, not by the batch (140 MiB when read through a file
    object). Measured in a fresh process, whose memory holds nothing else."""
    texts = [bytes([65 + i % 26]) * (1 << 20) for i in range(96)]
    _table(tmp_path / "one.arrow", texts, row_group=len(texts))
    del texts
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH")])),
    }
    out = subprocess.run(
        [sys.executable, "-c", ANON_PEAK, str(tmp_path)], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr[-2000:]
    n, peak = out.stdout.split()
    assert int(n) == 96 << 20 and float(peak) < 72, out.stdout


# -- the Ray engine ships parts as JSON ------------------------------------------------------------------------------
def test_names_left_out_travel_with_their_part_to_a_worker(tmp_path):
    from dataclasses import asdict

    from pipelines.prepare_ray import _part
    from soma_cluster.corpus import part_documents

    tree(tmp_path, {".git/HEAD": TEXT, "a.txt": TEXT, "z": "->."})
    cfg = CorpusConfig(source=str(tmp_path))
    (part,) = plan_parts(cfg, 1 << 20)
    shipped = _part(json.dumps({"index": part.index, "files": [asdict(f) for f in part.files]}))
    assert shipped == part
    skipped: dict[str, list[str]] = {}
    assert [d.doc_id for d in part_documents(cfg, shipped, None, skipped)] == ["a.txt"]
    assert skipped == {SKIP_HIDDEN: [".git/"], SKIP_LOOP: ["z/"]}


# -- through `soma prepare` ------------------------------------------------------------------------------------------
def test_prepare_reads_links_reports_names_left_out_and_refuses_what_it_cannot_read(tmp_path, text_corpus, micro_yaml):
    corpus_dir = tmp_path / "corpus"
    corpus_dir.mkdir()
    docs = sorted(text_corpus.iterdir())
    os.symlink(text_corpus, corpus_dir / "data")  # the user's data directory, linked in
    # (a-loop sorts before data/: names past corpus.max_bytes are neither read nor reported)
    tree(corpus_dir, {".DS_Store": b"\x00junk", ".git/HEAD": b"ref: refs/heads/main\n", "a-loop": "->."})
    camp = tmp_path / "camp"
    proc = soma("prepare", str(camp), "--config", micro_yaml, "--corpus", str(corpus_dir))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = " ".join((proc.stdout + proc.stderr).split())
    assert "hidden (name starts with a dot) 2 (.DS_Store, .git/)" in out, out
    assert "link loop (to a directory above it) 1 (a-loop/)" in out, out
    manifest = json.loads((camp / "shards" / "manifest.json").read_text())["corpus"]
    assert manifest["skipped_files"] == {SKIP_HIDDEN: 2, SKIP_LOOP: 1}
    assert manifest["documents"] > len(docs) // 2
    # a record over the cap, first in path order: one line, nothing written
    _jsonl_gz(corpus_dir / "a-huge.jsonl.gz", MAX_RECORD_BYTES)
    proc = soma("prepare", str(tmp_path / "camp2"), "--config", micro_yaml, "--corpus", str(corpus_dir))
    assert_one_line_error(proc, "a-huge.jsonl.gz line 1 is 67,108,876 bytes", "split it into records")
    assert not (tmp_path / "camp2").exists()
    (corpus_dir / "a-huge.jsonl.gz").unlink()
    with zipfile.ZipFile(corpus_dir / "more.zip", "w") as z:
        z.writestr("x.txt", TEXT)
    proc = soma("prepare", str(tmp_path / "camp3"), "--config", micro_yaml, "--corpus", str(corpus_dir))
    assert_one_line_error(proc, f"{corpus_dir / 'more.zip'} is a zip archive", "unzip it")
    assert not (tmp_path / "camp3").exists()


def test_a_machine_source_is_the_same_wherever_its_root_lives(tmp_path):
    """The machine's `licenses` source reads the venv's site-packages: two clones' venvs hold the same files at other
    paths, and must give the same documents in the same order, with the same ids (the test split hashes them)."""
    docs = {}
    for place in ("a", "b/tests/deeper"):  # a root under a folder named tests: skip judges the relative path only
        root = tmp_path / place / "site-packages"
        for i in range(12):
            lic = root / f"pkg{i}-1.0.dist-info" / "LICENSE"
            lic.parent.mkdir(parents=True)
            lic.write_bytes(f"license text of package {i}\n".encode() * 20)
        found = textsources.local_files("x", root, "*.dist-info/**/LICENSE*", textsources._skip_tests)
        docs[place] = [(d.doc_id, d.data) for d in (f.document() for f in found)]
    assert docs["a"] == docs["b/tests/deeper"] and len(docs["a"]) == 12
    assert docs["a"][0][0].startswith("x:pkg") and str(tmp_path) not in docs["a"][0][0]
    assert [i for i, _ in docs["a"]] != sorted(i for i, _ in docs["a"])  # still a shuffle, not name order
