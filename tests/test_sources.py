"""Sources as researchers organise them (soma_cluster/sources.py, globs.py; the row labels of corpus.py; the routing
by source of breakdown.py): a source is the first folder, else the file type; patterns, a manifest or a row column
set it; a bad setting is one error before anything is written; labels never change the data; the source x expert
tables stay a screen at 10,000 sources; the routing-load warning allows for the test windows' own mix."""

from __future__ import annotations

import csv
import hashlib
import json
import os
import unicodedata
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import assert_one_line_error, micro_config, soma_here
from support.s3server import s3  # noqa: F401

from soma_cluster import breakdown as bd
from soma_cluster.config import CorpusConfig
from soma_cluster.corpus import default_source, file_type, part_documents, plan_parts
from soma_cluster.errors import SomaError
from soma_cluster.globs import compile_glob
from soma_cluster.sources import label_parts, merge_tables, rows_note, table_from_json, table_json, table_lines
from soma_cluster.storage import Store
from soma_cluster.textsources import builtin_documents

TEXT = b"A line of text long enough to be a document of its own.\n" * 3


def tree(root: Path, spec: dict[str, bytes]) -> Path:
    for rel, content in spec.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
    return root


def sources_of(source: str, **settings) -> dict[str, str]:
    """doc id -> source, as prepare reads the corpus (labels from the settings first)."""
    cfg = CorpusConfig(source=source, max_bytes=10**12, **settings)
    out = {}
    for part in label_parts(cfg, plan_parts(cfg, 1 << 62)).parts:
        out.update({d.doc_id: d.source for d in part_documents(cfg, part)})
    return out


def refusal(source: str, **settings) -> str:
    with pytest.raises(SomaError) as info:
        sources_of(source, **settings)
    line = str(info.value)
    assert "\n" not in line and line.isprintable(), line
    return line


# -- the default: the first folder, else the file type ---------------------------------------------------------------
def test_the_issue_examples_name_their_folder_or_their_type():
    assert default_source("perl/usr__share__perl__5.36.0__CPAN.pm") == "perl"  # was "36.0__CPAN.pm"
    assert default_source("man/man7/exec.5.gz") == "man"  # was "5.gz"
    assert default_source("usr__share__perl__5.36.0__CPAN.pm") == "pm"  # flat: the type, not the name's tail
    assert [file_type(n) for n in ("a.txt.gz", "B.JSONL.XZ", "README", "x.", ".gz", "exec.5")] == [
        "txt",
        "jsonl",
        "text",
        "text",
        "text",
        "5",
    ]
    assert default_source(os.fsdecode(b"caf\xe9/x.txt")) == "caf\\xe9"  # a folder name that is not UTF-8, escaped
    assert default_source("a\nb/x.txt") == "a\\nb"  # one line, whatever the name


def test_a_folder_corpus_and_a_one_file_corpus(tmp_path):
    root = tree(tmp_path / "c", {"perl/a/CPAN.pm": TEXT, "man/ls.1": TEXT, "top.md": TEXT})
    assert sources_of(str(root)) == {"man/ls.1": "man", "perl/a/CPAN.pm": "perl", "top.md": "md"}
    assert sources_of(str(root / "perl" / "a" / "CPAN.pm")) == {"CPAN.pm": "pm"}  # a corpus that is one file


# -- patterns ------------------------------------------------------------------------------------------------------
GLOBS = [  # pattern, path, matches
    ("*.pm", "perl/a/CPAN.pm", True),
    ("perl", "x/perl/a.pm", True),  # no "/": a name at any depth, a folder's files with it
    ("/perl", "x/perl/a.pm", False),  # a leading "/": from the root
    ("perl/", "perl", False),  # a trailing "/": folders only
    ("perl/**", "perl/a/b/c.pm", True),
    ("docs/**/*.md", "docs/a.md", True),
    ("docs/**/*.md", "docs/x/y/a.txt", False),
    ("man[1-8]", "man3/ls.3", True),
    ("[!a]*", "a.txt", False),
    ("a?c", "a/c", False),  # never across a "/"
]


@pytest.mark.parametrize("pattern,path,matches", GLOBS)
def test_globs_follow_gits_rules(pattern, path, matches):
    assert compile_glob(pattern).matches(path) is matches


@pytest.mark.parametrize("pattern", ["", "a//b", "../x", "[abc", "a**b", "[z-a]"])
def test_a_bad_pattern_is_refused_naming_it(pattern):
    with pytest.raises(ValueError, match="pattern|empty"):
        compile_glob(pattern)


def test_patterns_first_match_wins_and_the_rest_fall_back_to_their_folder(tmp_path, capsys):
    root = tree(tmp_path / "c", {"perl/a.pm": TEXT, "perl/t/b.t": TEXT, "man/ls.1": TEXT, "x.txt": TEXT})
    patterns = {"perl/t/**": "perl-tests", "*.pm": "perl-code", "perl": "never", "nothing/**": "none"}
    got = sources_of(str(root), source_patterns=patterns)
    assert got == {"man/ls.1": "man", "perl/a.pm": "perl-code", "perl/t/b.t": "perl-tests", "x.txt": "txt"}
    cfg = CorpusConfig(source=str(root), source_patterns=patterns)
    notes = label_parts(cfg, plan_parts(cfg, 1 << 62)).notes
    assert len(notes) == 2 and "'perl' labels none of the 4 files" in notes[0] and "'nothing/**'" in notes[1]


def test_bad_patterns_are_refused_by_the_config(tmp_path):
    with pytest.raises(Exception, match="no closing"):
        CorpusConfig(source=str(tmp_path), source_patterns={"[ab": "x"})
    with pytest.raises(Exception, match="1 to 200 characters"):
        CorpusConfig(source=str(tmp_path), source_patterns={"a/**": "x" * 201})
    with pytest.raises(Exception, match="names its own sources"):
        CorpusConfig(source="builtin", source_patterns={"a/**": "x"})
    with pytest.raises(Exception, match="is corpus.text_field"):
        CorpusConfig(source=str(tmp_path), source_column="text")


# -- a manifest ------------------------------------------------------------------------------------------------------
def _manifest(path: Path, rows: list[dict]) -> Path:
    if path.suffix == ".csv":
        with open(path, "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.mark.parametrize("suffix", [".csv", ".jsonl", ".parquet"])
def test_a_manifest_labels_its_files_and_says_what_it_misses(tmp_path, suffix):
    root = tree(tmp_path / "c", {"a/1.txt": TEXT, "a/2.txt": TEXT, "b/3.txt": TEXT, "4.md": TEXT})
    rows = [
        {"path": "a/1.txt", "source": "en"},
        {"path": f"{root}/a/2.txt", "source": "de"},  # with the corpus root before it (find CORPUS -type f)
        {"path": "./4.md", "source": "en"},
        {"path": "gone.txt", "source": "fr"},  # not in the corpus
        {"path": "b/3.txt", "source": None},  # no label: the folder
    ]
    if suffix == ".csv":
        rows[-1]["source"] = ""
    m = _manifest(tmp_path / f"m{suffix}", rows)
    got = sources_of(str(root), source_manifest=str(m), source_patterns={"b/**": "bee"})
    assert got == {"4.md": "en", "a/1.txt": "en", "a/2.txt": "de", "b/3.txt": "bee"}
    cfg = CorpusConfig(source=str(root), source_manifest=str(m))
    notes = label_parts(cfg, plan_parts(cfg, 1 << 62)).notes
    assert "lists 1 path that is not a file read from the corpus (gone.txt)" in notes[0], notes
    assert "does not list 1 of the 4 files read (b/3.txt)" in notes[1], notes


def test_a_manifest_that_cannot_be_used_is_one_error_naming_it(tmp_path):
    root = tree(tmp_path / "c", {"a/1.txt": TEXT})
    assert "not found" in refusal(str(root), source_manifest=str(tmp_path / "none.csv"))
    assert "not a .csv, .jsonl or .parquet" in refusal(str(root), source_manifest=str(tmp_path / "m.xlsx"))
    bad = _manifest(tmp_path / "cols.csv", [{"file": "a/1.txt", "source": "x"}])
    assert "has no column 'path' (its columns: file, source)" in refusal(str(root), source_manifest=str(bad))
    bad = _manifest(tmp_path / "lang.csv", [{"path": "a/1.txt", "source": "x"}])
    line = refusal(str(root), source_manifest=str(bad), source_column="lang")
    assert "has no column 'lang'" in line and "corpus.source_column" in line
    twice = _manifest(
        tmp_path / "twice.jsonl", [{"path": "a/1.txt", "source": "x"}, {"path": "a/1.txt", "source": "y"}]
    )
    assert "gives a/1.txt two sources, 'x' (row 1) and 'y' (row 2)" in refusal(str(root), source_manifest=str(twice))
    ints = _manifest(tmp_path / "ints.parquet", [{"path": "a/1.txt", "source": 3}])
    assert "column 'source' is int64, not text" in refusal(str(root), source_manifest=str(ints))
    (tmp_path / "junk.parquet").write_bytes(b"PAR1 not really")
    assert "not readable Parquet" in refusal(str(root), source_manifest=str(tmp_path / "junk.parquet"))
    (tmp_path / "junk.jsonl").write_text('{"path": "a/1.txt"}\n[1, 2]\n')
    assert "line 2 is not a JSON object" in refusal(str(root), source_manifest=str(tmp_path / "junk.jsonl"))


def test_a_manifest_and_a_corpus_on_s3(s3, monkeypatch, tmp_path):  # noqa: F811
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    fs = s3.fs()
    for key in ("en/a.txt", "de/b.txt"):
        fs.pipe(f"{s3.bucket}/lab/{key}", TEXT)
    fs.pipe(f"{s3.bucket}/meta/m.csv", f"path,source\n{s3.url('lab')}/en/a.txt,english\n".encode())
    got = sources_of(s3.url("lab"), source_manifest=s3.url("meta/m.csv"))
    assert got == {"de/b.txt": "de", "en/a.txt": "english"}
    assert "not found" in refusal(s3.url("lab"), source_manifest=s3.url("meta/none.csv"))


# -- a column of the rows ------------------------------------------------------------------------------------------
def test_row_labels_of_jsonl_and_parquet_with_nulls_fall_back_to_the_file(tmp_path):
    rows = [{"text": "one " * 20, "lang": "en"}, {"text": "two " * 20, "lang": None}, {"text": "three " * 20}]
    root = tree(tmp_path / "c", {"j/x.jsonl": "".join(json.dumps(r) + "\n" for r in rows).encode(), "t/y.txt": TEXT})
    pq.write_table(
        pa.table({"text": ["p" * 80, "q" * 80], "lang": pa.array(["fr", None]).dictionary_encode()}), root / "z.parquet"
    )
    got = sources_of(str(root), source_column="lang")
    assert got == {"j/x.jsonl:0": "en", "j/x.jsonl:1": "j", "j/x.jsonl:2": "j", "t/y.txt": "t", "z.parquet:0": "fr",
                   "z.parquet:1": "parquet"}  # fmt: skip
    cfg = CorpusConfig(source=str(root), source_column="lang")
    assert rows_note(cfg, {"jsonl": 10, "text": 5}) is None and "text files only" in rows_note(cfg, {"text.gz": 5})


def test_a_row_column_absent_or_not_text_is_one_error_naming_the_file(tmp_path):
    root = tree(tmp_path / "n", {"x.jsonl": b'{"text": "a b c d", "lang": 7}\n'})
    assert "x.jsonl line 1: 'lang' (corpus.source_column) is a number, not a string" in refusal(
        str(root), source_column="lang"
    )
    root = tree(tmp_path / "a", {"x.jsonl": b'{"text": "a b c d", "kind": "en"}\n'})
    line = refusal(str(root), source_column="lang")
    assert "has no field 'lang' (corpus.source_column) in any of its 1 records" in line and "kind" in line
    root = tmp_path / "p"
    root.mkdir()
    pq.write_table(pa.table({"text": ["abc " * 20], "lang": [3]}), root / "x.parquet")
    assert "column 'lang' (corpus.source_column) is int64, not text" in refusal(str(root), source_column="lang")
    assert "has no column 'langs' (corpus.source_column)" in refusal(str(root), source_column="langs")


def test_a_long_row_label_is_cut_and_control_characters_escaped(tmp_path):
    rows = [{"text": "x " * 40, "lang": "L" * 500}, {"text": "y " * 40, "lang": "a\tb|c"}]
    root = tree(tmp_path / "c", {"x.jsonl": "".join(json.dumps(r) + "\n" for r in rows).encode()})
    got = list(sources_of(str(root), source_column="lang").values())
    assert len(got[0]) == 200 and got[0].endswith("\u2026") and got[1] == "a\\tb|c"


# -- the source x expert tables --------------------------------------------------------------------------------------
def test_ten_thousand_sources_stay_a_screen_and_every_row_is_kept():
    rng = np.random.default_rng(0)
    n = 256
    # each source's sequences on a few experts (2% of the cells), as a corpus sorted by its folders shards them
    cells = lambda: (rng.random((2500, n)) < 0.02) * rng.integers(1, 9, (2500, n))  # noqa: E731
    parts = [([f"src-{i:05d}" for i in range(p, 10_000, 4)], cells()) for p in range(4)]
    table = merge_tables(n, parts)
    assert len(table) == 10_000 and list(table.values())[0].sum() >= list(table.values())[-1].sum()
    lines = table_lines(table)
    assert len(lines) <= 22 and all(len(line) <= 80 for line in lines), lines
    assert "and 9,980 more sources" in lines[-1]
    back = table_from_json(json.loads(json.dumps(table_json(table))), n)
    assert all(np.array_equal(back[s], table[s]) for s in table)
    small = table_lines(merge_tables(4, [(["perl", "日本語"], np.array([[8, 1, 1, 0], [0, 0, 4, 4]]))]))
    width = lambda s: sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in s)  # noqa: E731
    assert width(small[2][: small[2].index("8")]) == width(small[1][: small[1].index("10")]) + 1  # CJK: two columns
    assert small[1].split() == ["perl", "10", "80%", "10%", "10%", "0%"]


def test_the_concentration_warning_allows_for_the_test_mix():
    """64% of the test windows are one language whose training sequences went to expert 0: that expert's big share
    is the mix, not the router; an expert over what the mix predicts is warned about."""
    n, k = 8, 1
    train = {"perl": np.array([900, 20, 20, 20, 10, 10, 10, 10]), "man": np.full(n, 100), "c": np.full(n, 100)}
    srcs = ["perl"] * 640 + ["man"] * 200 + ["c"] * 160
    top = np.array([[0]] * 600 + [[1]] * 40 + [[e % n] for e in range(360)])
    fair = bd.routing_load(dict(enumerate(np.bincount(top.ravel(), minlength=n))), len(srcs), k, n)
    assert fair.concentrated  # the fair share alone blames the experts
    mix = bd.routing_by_source(srcs, top, n, train)
    assert mix.judged and not mix.over and mix.explained[0] == 0 and mix.warning(str) is None
    assert "the mix, not the router" in mix.note(str) and "64% of them perl" in mix.note(str)
    # the router sends the "man" windows to expert 5, which their training sequences did not go to
    top[640:840] = 5
    mix = bd.routing_by_source(srcs, top, n, train)
    assert mix.over == [5] and "beyond the test windows' mix of sources" in mix.warning(lambda e: f"e{e}")
    d = mix.as_dict()
    assert d["concentrated"] and len(d["experts"]) == n and sum(r["windows"] for r in d["sources"]) == len(srcs)
    # a source no train sequence had (all its documents held out): the shards' overall shares predict it
    assert bd.routing_by_source(["new"] * 100, np.zeros((100, 1), int), n, train).predicted["new"][0] > 0.4
    assert not bd.routing_by_source(srcs, top, n, None).judged  # a campaign prepared before the table


# -- prepare: labels never change the data ---------------------------------------------------------------------------
def _corpus(root: Path) -> Path:
    for i, doc in enumerate(builtin_documents(700_000)):
        tree(root, {f"{doc.source}/d{i:04d}.txt": doc.data})
    return root


def _data_digests(store: Store) -> dict[str, str]:
    """sha256 of every shard and window file (the data), and the windows' digest compare uses."""
    out = {
        rel: hashlib.sha256(store.read_bytes(rel)).hexdigest() for rel in store.walk("shards") if "manifest" not in rel
    }
    out.update(
        {rel: hashlib.sha256(store.read_bytes(rel)).hexdigest() for rel in store.walk("test") if rel.endswith(".arrow")}
    )
    out["windows"] = store.read_json("test/manifest.json")["sha256"]
    return out


def test_two_labelings_give_the_same_shards_and_windows_and_the_table_counts_every_sequence(tmp_path):
    from pipelines.prepare import prepare

    corpus = _corpus(tmp_path / "corpus")
    m = _manifest(tmp_path / "m.csv", [{"path": p.relative_to(corpus).as_posix(), "source": f"file-{i % 7}"}
                                         for i, p in enumerate(sorted(corpus.rglob("*.txt")))])  # fmt: skip
    labelings = {"folders": {}, "patterns": {"source_patterns": {"*licenses": "law", "*-pages/**": "manuals"}},
                 "manifest": {"source_manifest": str(m)}}  # fmt: skip
    digests, tables = {}, {}
    for name, settings in labelings.items():
        store = Store(str(tmp_path / name))
        cfg = micro_config(n_experts=3, corpus={"source": str(corpus), "max_bytes": 10**9, **settings})
        summary = prepare(store, cfg)
        digests[name] = _data_digests(store)
        tables[name] = {r["source"]: r["sequences"] for r in summary["source_experts"]}
        assert sum(tables[name].values()) == sum(summary["train_rows"]) + sum(summary["val_rows"])
        docs = json.loads(store.read_bytes("test/documents.json"))["documents"]
        assert {d["source"] for d in docs} <= set(summary["corpus"]["sources"]) | set(tables[name]), name
    assert digests["folders"] == digests["patterns"] == digests["manifest"] and len(digests["folders"]) > 4
    assert set(tables["folders"]) == {"common-licenses", "info-pages", "licenses", "man-pages", "pydoc-topics",
                                      "python-stdlib"}  # fmt: skip
    assert set(tables["patterns"]) == {"law", "manuals", "pydoc-topics", "python-stdlib"}
    assert set(tables["manifest"]) == {f"file-{i}" for i in range(7)}


def test_prepare_refuses_a_bad_manifest_before_writing_anything(tmp_path, micro_yaml):
    corpus = tree(tmp_path / "corpus", {"a/x.txt": TEXT})
    camp = tmp_path / "camp"
    manifest = tmp_path / "m.csv"
    manifest.write_text("file,source\na/x.txt,en\n")
    r = soma_here(
        "prepare", camp, "--config", micro_yaml, "--corpus", corpus, "--set", f"corpus.source_manifest={manifest}"
    )
    assert_one_line_error(r, f"corpus.source_manifest {manifest} has no column 'path'", "its columns: file, source")
    r = soma_here(
        "prepare", camp, "--config", micro_yaml, "--corpus", corpus, "--set", 'corpus.source_patterns={"[a": b}'
    )
    assert_one_line_error(r, "corpus.source_patterns", "'[' with no closing ']'")
    assert not camp.exists()


def test_the_report_section_stays_short_at_n_256_and_without_a_training_table():
    from pipelines.evaluate import mix_metrics, source_lines, source_routing_lines

    rng = np.random.default_rng(1)
    n, k, windows = 256, 4, 4096
    names = [f"lang|{i}" for i in range(50)]  # a "|" in a label: escaped in the Markdown table
    srcs = [names[i] for i in rng.integers(0, 50, windows)]
    top = np.stack([rng.choice(n, k, replace=False) for _ in range(windows)])
    train = {s: rng.integers(0, 5, n) for s in names}
    mix = bd.routing_by_source(srcs, top, n, train)
    m = mix_metrics(mix, bd.routing_load(dict(enumerate(np.bincount(top.ravel(), minlength=n))), windows, k, n))
    text = source_routing_lines(m)
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert len(rows) <= 2 + 21 + 1 + 8, len(rows)  # two headers, 20 sources and the rest, 8 experts
    assert "lang\\|" in text and "30 more sources" in text and len(m["routing_by_source"]["experts"]) == n
    loss = {"nats_per_byte": 3.0, "ci95": [2.9, 3.1]}
    groups = [{"source": s, "windows": 80, "documents": 3, "ensemble": loss, "seed": loss, "ensemble_minus_seed": loss}
              for s in names]  # fmt: skip
    per_source = source_lines({"by_source": groups, "by_document": []})
    assert (
        per_source.count("| lang\\|") == 20
        and "| 30 more sources (`by_source` in `metrics.json`) | 2400 |" in per_source
    )
    old = mix_metrics(bd.routing_by_source(srcs, top, n, None), bd.routing_load({0: windows}, windows, k, n))
    assert old["routing_warning"].startswith("routing concentrates:")  # the fair-share rule, as before the table
    assert "not recorded by this campaign's prepare" in source_routing_lines(old)


def test_the_corpus_line_names_eight_sources_and_counts_the_rest():
    from soma_cluster.corpus import describe_counts

    line = describe_counts({f"s{i}": 100 * (i + 1) for i in range(300)} | {"big": 3_100_000})
    assert line.startswith("big 3.1 MB, s299 30 kB, s298 30 kB") and line.endswith("and 293 more sources of 4.3 MB")
