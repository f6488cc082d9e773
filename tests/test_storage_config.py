import pytest
import yaml

from soma_cluster.config import parse_overrides, resolve
from soma_cluster.errors import ChecksumError, SomaError
from soma_cluster.storage import Store


@pytest.mark.parametrize("bad", ["../x", "/etc/passwd", "a/../../b", "", "a b"])
def test_paths_cannot_escape_the_campaign(tmp_path, bad):
    with pytest.raises(SomaError):
        Store(str(tmp_path)).write_bytes(bad, b"x")


def test_json_checksums_and_write_once(tmp_path):
    store = Store(str(tmp_path))
    store.write_json("a/b.json", {"x": 1})
    assert store.read_json("a/b.json") == {"x": 1}
    (tmp_path / "a" / "b.json").write_text((tmp_path / "a" / "b.json").read_text().replace("1", "2"))
    with pytest.raises(ChecksumError, match="b.json"):
        store.read_json("a/b.json")
    store.write_new("once", b"1")
    with pytest.raises(SomaError, match="never overwritten"):
        store.write_new("once", b"2")
    assert (tmp_path / "once").read_bytes() == b"1"


def test_log_ignores_a_torn_last_line_but_not_a_corrupt_middle(tmp_path):
    store = Store(str(tmp_path))
    for i in range(3):
        store.append("events.jsonl", {"i": i})
    with open(tmp_path / "events.jsonl", "ab") as fh:
        fh.write(b'{"i": 3, "check')  # a crash mid-write
    assert [r["i"] for r in store.read_log("events.jsonl")] == [0, 1, 2]
    lines = (tmp_path / "events.jsonl").read_bytes().split(b"\n")
    lines[1] = lines[1].replace(b'"i":1', b'"i":9').replace(b'"i": 1', b'"i": 9')
    (tmp_path / "events.jsonl").write_bytes(b"\n".join(lines))
    with pytest.raises(ChecksumError, match="line 2"):
        store.read_log("events.jsonl")


def test_config_layers_and_errors(tmp_path):
    cfg = resolve("tiny", parse_overrides(["spsa.n_pert=16", "n_experts=3"]))
    assert cfg.spsa.n_pert == 16 and cfg.n_experts == 3 and cfg.preset == "tiny"
    with pytest.raises(SomaError, match="spsa.n_pert"):
        resolve("tiny", parse_overrides(["spsa.n_pert=-1"]))
    with pytest.raises(SomaError, match="unknown preset"):
        resolve("nope")
    bad = tmp_path / "bad.yaml"
    bad.write_text("spsa: [1, 2\n")
    with pytest.raises(SomaError, match="not valid YAML"):
        resolve("tiny", config_file=str(bad))
    extra = tmp_path / "extra.yaml"
    extra.write_text(yaml.safe_dump({"spsa": {"bogus": 1}}))
    with pytest.raises(SomaError, match="bogus"):
        resolve("tiny", config_file=str(extra))


def test_presets_resolve():
    from soma_cluster.config import preset_names

    for name in preset_names():
        resolve(name)


def test_batched_appends_land_together_in_order(tmp_path, monkeypatch):
    import soma_cluster.storage as storage

    syncs = []
    monkeypatch.setattr(storage, "_datasync", lambda fd: syncs.append(fd))
    store = Store(str(tmp_path))
    store.append("events.jsonl", {"i": 0})
    with store.batch():
        for i in range(1, 4):
            store.append("events.jsonl", {"i": i})
            store.append("ledger/ledger.jsonl", {"i": i})
        assert len(syncs) == 1  # held back so far
        with store.batch():  # nested: the outer batch writes
            store.append("events.jsonl", {"i": 4})
        assert len(syncs) == 1
        assert [r["i"] for r in store.read_log("events.jsonl")] == [0, 1, 2, 3, 4]  # a read writes first
        store.append("events.jsonl", {"i": 5})
    assert len(syncs) == 1 + 2 + 1  # the read's flush (2 logs), then the exit's
    assert [r["i"] for r in store.read_log("events.jsonl")] == list(range(6))
    assert [r["i"] for r in store.read_log("ledger/ledger.jsonl")] == [1, 2, 3]
    with pytest.raises(RuntimeError), store.batch():
        store.append("events.jsonl", {"i": 6})
        raise RuntimeError("driver error")
    assert store.read_log("events.jsonl")[-1]["i"] == 6  # what was held is written on the way out


def test_background_batch_writes_off_the_loop_in_order_and_raises_a_failed_write(tmp_path, monkeypatch):
    import threading

    import soma_cluster.storage as storage

    writers = []
    real = storage.Store._write_lines

    def spy(self, log, lines):
        writers.append(threading.current_thread().name)
        real(self, log, lines)

    monkeypatch.setattr(storage.Store, "_write_lines", spy)
    store = Store(str(tmp_path))
    with store.batch(background=True):
        for i in range(50):
            store.append("events.jsonl", {"i": i})
            if i % 7 == 0:
                store.flush(wait=False)  # handed over; the loop goes on
        assert [r["i"] for r in store.read_log("events.jsonl")] == list(range(50))  # a read waits for the writer
        store.append("events.jsonl", {"i": 50})
    assert [r["i"] for r in store.read_log("events.jsonl")] == list(range(51))
    assert set(writers) == {"soma-log-writer"} and not any(t.name == "soma-log-writer" for t in threading.enumerate())

    def broken(self, log, lines):
        raise OSError("disk gone")

    monkeypatch.setattr(storage.Store, "_write_lines", broken)
    with pytest.raises(OSError, match="disk gone"), store.batch(background=True):
        store.append("events.jsonl", {"i": 51})
        store.flush(wait=False)
        store.flush()  # the writer's error surfaces in the loop


def test_parquet_and_arrow_corpora_stream_row_group_by_row_group(tmp_path):
    import pyarrow as pa
    import pyarrow.ipc as ipc
    import pyarrow.parquet as pq

    from soma_cluster.config import CorpusConfig
    from soma_cluster.corpus import user_documents

    texts = [f"document {i} " * (i % 7 + 1) for i in range(10_000)]
    table = pa.table({"id": list(range(len(texts))), "text": texts})
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=1000)  # ten row groups
    with ipc.new_file(str(tmp_path / "b.arrow"), table.schema) as w:
        for a in range(0, len(texts), 1000):
            w.write_batch(table.slice(a, 1000).to_batches()[0])
    docs = list(user_documents(CorpusConfig(source=str(tmp_path), max_bytes=10**9)))
    assert [d.data.decode() for d in docs] == texts + texts  # every row, in order, per file
    assert docs[0].doc_id.endswith("a.parquet:0") and docs[-1].doc_id.endswith("b.arrow:9999")
    assert {d.source for d in docs} == {"parquet", "arrow"}
    # corpus.max_bytes stops the reading inside a file
    assert len(list(user_documents(CorpusConfig(source=str(tmp_path / "a.parquet"), max_bytes=100)))) < 10
    with pytest.raises(SomaError, match="no column 'body'.*corpus.text_field"):
        list(user_documents(CorpusConfig(source=str(tmp_path / "a.parquet"), text_field="body", max_bytes=10**9)))
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(SomaError, match="bad.parquet is not readable parquet"):
        list(user_documents(CorpusConfig(source=str(tmp_path / "bad.parquet"), max_bytes=10**9)))
