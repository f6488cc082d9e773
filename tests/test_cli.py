"""The `soma` CLI end to end on a small real-text corpus, and its one-line errors (exit 2) on bad input."""

import hashlib
import json
import shutil

import pytest
from conftest import assert_one_line_error, soma


def test_end_to_end(tmp_path, text_corpus, trained):
    """prepare, seed and launch are the session's `trained` campaign (the CLI in its own processes, what they printed
    kept); eval, status, resume and the rest run on a copy of it."""
    camp = str(tmp_path / "camp")
    shutil.copytree(trained.camp, camp)
    procs = dict(trained.runs)
    for args in (["eval", camp, "--json"], ["status", camp]):
        proc = procs[args[0]] = soma(*args)
        assert proc.returncode == 0, (args, proc.stdout[-2000:], proc.stderr[-4000:])
    metrics = json.loads((tmp_path / "camp" / "eval" / "metrics.json").read_text())
    assert metrics["ensemble"]["nats_per_byte"] < metrics["uniform"]["nats_per_byte"] - 1.0
    assert metrics["scored_bytes"] == metrics["windows"] * 768
    # data on stdout, logs on stderr: the status table is on stdout; without a bar the driver logs summary lines
    assert "expert-0001" in proc.stdout and "finished" in proc.stdout and "expert-0001" not in proc.stderr
    # the log line counts the experts apart from the seed (never "4 finished" for 3 experts and the seed)
    assert "experts 3/3 ended (3 finished) | seed finished |" in procs["launch"].stderr, procs["launch"].stderr
    assert json.loads(procs["eval"].stdout)["ensemble"] == metrics["ensemble"]  # eval --json: one document
    snap = json.loads(soma("status", camp, "--json").stdout)
    assert snap["source"] == "driver" and snap["final"] and snap["counts"] == {"finished": 4}
    assert [(r["job"], r["step"], r["target"]) for r in snap["jobs"]] == [
        ("seed", 6, 6),
        ("expert-0000", 12, 12),
        ("expert-0001", 12, 12),
        ("expert-0002", 12, 12),
    ]
    curve = (tmp_path / "camp" / "curves" / "expert-0001.csv").read_text().splitlines()
    assert curve[0] == "step,attempt,train_loss,val_loss,gpu_seconds,eps,lr,t" and curve[-1].startswith("12,0,")
    assert (tmp_path / "camp" / "eval" / "curves.png").exists() and "curves.png" in (
        tmp_path / "camp" / "eval" / "report.md"
    ).read_text()
    report = (tmp_path / "camp" / "eval" / "report.md").read_text()
    assert "not" in report and "backprop" in report
    # preparing again with the same config is a no-op; `resume` on a finished campaign retrains nothing
    assert soma("prepare", camp, "--config", str(trained.config), "--corpus", str(text_corpus)).returncode == 0
    events = (tmp_path / "camp" / "events.jsonl").read_text().count("\n")
    assert soma("resume", camp, "--no-progress").returncode == 0
    assert (tmp_path / "camp" / "events.jsonl").read_text().count("\n") == events
    # paired comparison on the same windows: against itself the difference is exactly zero
    proc = soma("eval", camp, "--compare", camp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cmp = json.loads((tmp_path / "camp" / "eval" / "metrics.json").read_text())["compare"]
    assert cmp["this_minus_other"] == {"nats_per_byte": 0.0, "ci95": [0.0, 0.0]}
    # long-document mode on the user's own text files: every byte after a document's first scored once
    proc = soma("eval", camp, "--text", str(text_corpus), "--stride", "768")
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = json.loads(next((tmp_path / "camp" / "eval").glob("text-*.json")).read_text())
    assert text["scored_bytes"] > 0 and text["ensemble"]["nats_per_byte"] < 5.0 and text["stride"] == 768
    # ... and its record: every segment's route read only bytes before those it scores (a document's first bytes
    # re-routed as they are read), in a file whose sha256 the metrics give
    routes = (tmp_path / "camp" / text["routing"]["routes_file"]).read_bytes()
    assert (
        hashlib.sha256(routes).hexdigest() == text["routing"]["routes_sha256"] and text["routing"]["rule"] == "causal/1"
    )
    segments = [json.loads(line) for line in routes.splitlines()]
    assert len(segments) == text["routing"]["segments"] and {s["kind"] for s in segments} >= {"growing", "window"}
    assert all(s["router_read"][1] <= s["scored"][0] for s in segments)
    assert sum(s["scored"][1] - s["scored"][0] for s in segments) == text["scored_bytes"]
    assert_one_line_error(soma("eval", camp, "--text", str(text_corpus), "--stride", "5000"), "--stride")
    # a corrupt or missing router is an error naming the file, and the metrics already there stay as they were
    metrics_before = (tmp_path / "camp" / "eval" / "metrics.json").read_bytes()
    vocab = tmp_path / "camp" / "router" / "vocabulary.json"
    vocab.write_bytes(vocab.read_bytes().replace(b'"', b"'", 1))
    assert_one_line_error(soma("eval", camp), "router/vocabulary.json", "checksum")
    vocab.unlink()
    assert_one_line_error(soma("eval", camp), "router/vocabulary.json", "missing")
    assert (tmp_path / "camp" / "eval" / "metrics.json").read_bytes() == metrics_before


def test_missing_corpus_path(tmp_path, micro_yaml):
    assert_one_line_error(
        soma("prepare", str(tmp_path / "c"), "--config", micro_yaml, "--corpus", str(tmp_path / "nope")),
        "corpus path",
        "not found",
    )
    assert not (tmp_path / "c").exists()


def test_empty_corpus(tmp_path, micro_yaml):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_bytes(b"")
    assert_one_line_error(
        soma("prepare", str(tmp_path / "c"), "--config", micro_yaml, "--corpus", str(tmp_path / "empty")),
        "holds no text",
    )


def test_more_experts_than_sequences(tmp_path, text_corpus, micro_yaml):
    proc = soma(
        "prepare", str(tmp_path / "c"), "--config", micro_yaml, "--corpus", str(text_corpus), "--experts", "5000"
    )
    assert_one_line_error(proc, "n_experts=5000", "lower n_experts")
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").iterdir())


def test_directory_with_a_different_campaign_is_never_overwritten(tmp_path, text_corpus, micro_yaml):
    camp = tmp_path / "c"
    assert soma("prepare", str(camp), "--config", micro_yaml, "--corpus", str(text_corpus)).returncode == 0
    before = {p: p.read_bytes() for p in camp.rglob("*") if p.is_file()}
    proc = soma("prepare", str(camp), "--config", micro_yaml, "--corpus", str(text_corpus), "--experts", "3")
    assert_one_line_error(proc, "different campaign", "new campaign URL")
    assert {p: p.read_bytes() for p in camp.rglob("*") if p.is_file()} == before


def test_foreign_directory_and_bad_config(tmp_path, text_corpus, micro_yaml):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    assert_one_line_error(
        soma("prepare", str(foreign), "--config", micro_yaml, "--corpus", str(text_corpus)), "not empty"
    )
    assert (foreign / "notes.txt").read_text() == "keep me" and len(list(foreign.iterdir())) == 1
    bad = tmp_path / "bad.yaml"
    bad.write_text("spsa: {n_pert: -3}\n")
    assert_one_line_error(soma("prepare", str(tmp_path / "c"), "--config", str(bad)), "spsa.n_pert")
    assert_one_line_error(soma("eval", str(tmp_path / "nothing")), "run soma prepare")
    assert_one_line_error(soma("prepare", str(tmp_path / "c"), "--set", "spsa.n_pert"), "key=value")


def test_corrupt_shard_stops_that_expert_at_once_with_its_name(tmp_path, text_corpus, micro_yaml):
    camp = tmp_path / "camp"
    for args in (
        ["prepare", str(camp), "--config", micro_yaml, "--corpus", str(text_corpus)],
        ["seed", str(camp), "--no-progress"],
    ):
        assert soma(*args).returncode == 0
    shard = sorted((camp / "shards" / "expert-0001").glob("train-*.arrow"))[0]
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # one flipped byte
    shard.write_bytes(bytes(raw))
    proc = soma("launch", str(camp), "--no-progress")
    assert_one_line_error(proc, "expert-0001", shard.name, "checksum")
    events = [json.loads(line) for line in (camp / "events.jsonl").read_text().splitlines()]
    failed = [e for e in events if e["job"] == "expert-0001" and e["event"] == "failed"]
    assert len(failed) == 1  # not retried: no retry can fix bad input
    assert any(e["job"] == "expert-0000" and e["event"] == "finished" for e in events)  # the other expert trained on
    assert bytes(raw) == shard.read_bytes()  # and nothing was rewritten


def test_binary_special_and_empty_files_in_a_corpus(tmp_path, text_corpus, micro_yaml):
    """Files that are not text are skipped and counted, a FIFO is refused at once (opening it would block),
    Latin-1 text is kept byte for byte, and a corpus with no text at all is refused naming its files."""
    import os
    import random
    import time

    corpus = tmp_path / "corpus"
    shutil.copytree(text_corpus, corpus)
    rng = random.Random(0)
    # (names sort before doc-*.txt: the micro corpus's max_bytes stops the reading at about the copied corpus)
    for name in ("a-photo.jpg", "a-archive.txt"):  # random bytes, whatever the name says
        (corpus / name).write_bytes(rng.randbytes(50_000))
    latin1 = "Café crème brûlée, déjà vu à la française: naïve façade. ".encode("latin-1") * 40
    (corpus / "a-latin1.txt").write_bytes(latin1)
    (corpus / "a-empty.txt").write_bytes(b"")
    os.mkfifo(corpus / "queue")
    t0 = time.monotonic()
    proc = soma("prepare", str(tmp_path / "c"), "--config", micro_yaml, "--corpus", str(corpus), timeout=120)
    assert time.monotonic() - t0 < 60  # refused at once, not read forever
    assert_one_line_error(proc, f"{corpus / 'queue'} is a FIFO", "remove it")
    assert not (tmp_path / "c").exists()
    (corpus / "queue").unlink()  # the suggested fix
    proc = soma("prepare", str(tmp_path / "c"), "--config", micro_yaml, "--corpus", str(corpus))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = " ".join((proc.stdout + proc.stderr).split())
    assert "skipped 3 files: not text (NUL bytes) 2 (a-archive.txt, a-photo.jpg), empty 1 (a-empty.txt)" in out, out
    manifest = json.loads((tmp_path / "c" / "shards" / "manifest.json").read_text())
    assert manifest["corpus"]["skipped_files"] == {"not text (NUL bytes)": 2, "empty": 1}
    from soma_cluster.config import CorpusConfig
    from soma_cluster.corpus import user_documents

    docs = {d.doc_id: d.data for d in user_documents(CorpusConfig(source=str(corpus), max_bytes=10**9))}
    assert docs["a-latin1.txt"] == latin1  # bytes kept as they are
    assert not {"a-photo.jpg", "a-archive.txt", "a-empty.txt"} & set(docs)
    # nothing but binary files: refused, naming them, and nothing written
    junk = tmp_path / "junk"
    junk.mkdir()
    for i in range(5):
        (junk / f"blob-{i}.dat").write_bytes(rng.randbytes(20_000))
    proc = soma("prepare", str(tmp_path / "d"), "--config", micro_yaml, "--corpus", str(junk))
    assert_one_line_error(
        proc,
        "holds no text",
        "not text (NUL bytes) 5 (blob-0.dat, blob-1.dat, blob-2.dat, ...)",
        "point corpus.source at text files",
    )
    assert not (tmp_path / "d").exists()
    # a FIFO as the corpus path itself: refused without opening it (a config is read from one: test_config_inputs)
    os.mkfifo(tmp_path / "fifo")
    assert_one_line_error(
        soma("prepare", str(tmp_path / "d"), "--config", micro_yaml, "--corpus", str(tmp_path / "fifo"), timeout=60),
        "is a FIFO",
        "pass a text file or a directory",
    )
    assert not (tmp_path / "d").exists()


def test_checked_options_version_and_json_on_stdout(tmp_path):
    """--version and presets print data on stdout only; bad option values are one `error:` line (exit 2) naming
    the option."""
    proc = soma("--version")
    assert (
        proc.returncode == 0
        and proc.stdout.startswith("soma-cluster ")
        and "torch" in proc.stdout
        and proc.stderr == ""
    )
    doc = json.loads(soma("presets", "--json").stdout)
    assert doc["schema"] == 1 and "tiny" in [p["name"] for p in doc["presets"]] and "variance" in doc["experiments"]
    listing = soma("presets").stdout.splitlines()  # a line per preset with its sizes (docs/cli.md promises them)
    tiny = next(line for line in listing if line.startswith("tiny:"))
    assert "N = 4 experts" in tiny and "139,904 parameters" in tiny and "300 updates" in tiny, listing
    camp = str(tmp_path / "c")
    assert_one_line_error(soma("prepare", camp, "--preset", "tinyy"), "--preset 'tinyy'", "choose one of", "tiny")
    assert_one_line_error(soma("prepare", camp, "-n", "0"), "--experts/-n 0", "pass e.g. -n 4")
    assert_one_line_error(
        soma("experiment", "variance", str(tmp_path / "e"), "--scale", "big"), "--scale 'big'", "small, paper"
    )
    assert_one_line_error(soma("launch", camp, "--log-every", "0"), "--log-every 0", "positive")
    assert not (tmp_path / "c").exists() and not (tmp_path / "e").exists()


def test_campaign_yaml_records_the_versions(tmp_path, text_corpus, micro_yaml):
    from soma_cluster.config import recorded_versions, versions

    camp = tmp_path / "c"
    assert soma("prepare", str(camp), "--config", micro_yaml, "--corpus", str(text_corpus)).returncode == 0
    got = recorded_versions((camp / "campaign.yaml").read_text())
    assert got == {k: v.replace(" ", "_") for k, v in versions().items()} and got["ray"] and got["torch"]


def test_the_demo_line_compares_routing_with_what_it_must_beat():
    """soma demo prints the routed ensemble against the seed, the uniform mixture and the best single expert, each
    with the paired difference, within 80 columns, and says which it did not beat."""
    from pipelines.demo import summary_lines

    def base(nats, lo, hi):
        return {"nats_per_byte": nats, "ensemble_minus_this": {"nats_per_byte": (lo + hi) / 2, "ci95": [lo, hi]}}

    m = {
        "ensemble": {"nats_per_byte": 2.9685},
        "uniform": {"nats_per_byte": 5.5452},
        "top_k": 1,
        "n_experts": 4,
        "windows": 251,
        "baselines": {
            "all_windows": True,
            "seed": base(3.0671, -0.11, -0.09),
            "uniform_mixture": base(2.9932, -0.04, -0.01),
            "best_single": base(2.9987, -0.05, 0.002),
        },
    }
    lines = summary_lines(m, 57.0)
    assert all(len(line) <= 80 for line in lines), lines
    text = "\n".join(lines)
    assert "routed ensemble 2.9685" in text and "top-1 of 4 experts" in text
    for name in ("seed model (N = 1)", "uniform mixture", "best single expert", "uniform over bytes"):
        assert name in text
    last = lines[-1]
    assert last.startswith("not beaten") and "best single expert" in last and "uniform mixture" not in last
    m["baselines"]["best_single"] = base(2.9987, -0.05, -0.01)
    assert not any(line.startswith("not beaten") for line in summary_lines(m, 57.0))


@pytest.mark.slow
def test_make_demo_prints_what_the_readme_quotes(tmp_path):
    """The built-in corpus is fixed bytes and training is seeded: `soma demo --preset tiny` prints, on every machine,
    the numbers the README quotes (all but the seconds)."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    quoted = readme.split("demo finished in", 1)[1].split("```", 1)[0]
    proc = soma("demo", str(tmp_path / "demo"), "--preset", "tiny", timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = proc.stdout.split("demo finished in", 1)[1].split("report:", 1)[0]
    drop_seconds = lambda text: re.sub(r"^\d+ s", "", text.strip())  # noqa: E731
    assert drop_seconds(printed) == drop_seconds(quoted)
