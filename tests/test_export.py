"""soma export, soma score and soma sample in real processes on a real trained micro campaign: an export that
loads without the campaign and scores the same, damaged exports refused by name, a killed export that leaves
nothing behind, and the commands' outputs against the Python API."""

from __future__ import annotations

import base64
import functools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_one_line_error, fill_up, soma, soma_here
from hypothesis import HealthCheck, given, settings
from test_lm import cases, partial, rescored

from soma_cluster.errors import SomaError
from soma_cluster.inference.export import EXPORT_FILE, WEIGHTS
from soma_cluster.inference.lm import RoutedLM
from soma_cluster.storage import Store

DOCS = [b"", b"x", "naïve café\n".encode(), b"\xff\xfe\x00 not UTF-8", b"def f(x):\n    return x\n" * 80]


@pytest.fixture(scope="module")
def exported(trained_campaign, tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("exports") / "float32"
    proc = soma_here("export", str(trained_campaign), str(dest), "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout)
    assert r["experts"] == 3 and r["substituted"] == [] and r["bytes"] < r["checkpoint_bytes"]
    return dest


def test_an_export_loads_without_the_campaign_and_scores_the_same(trained_campaign, exported, tmp_path):
    moved = tmp_path / "elsewhere" / "model"
    shutil.copytree(exported, moved)  # an export copied anywhere is whole: nothing points back at the campaign
    want = RoutedLM.load(str(trained_campaign)).score_many(DOCS, per_byte=True)
    got = RoutedLM.load(str(moved)).score_many(DOCS, per_byte=True)
    for a, b in zip(want, got, strict=True):
        assert a == b and np.array_equal(a.per_byte, b.per_byte)  # float32 weights: bitwise the same scores
    names = sorted(str(p.relative_to(moved)) for p in moved.rglob("*") if p.is_file())
    assert names == sorted([EXPORT_FILE, WEIGHTS, "README.md", *(f"router/{n}" for n in os.listdir(moved / "router"))])
    card = (moved / "README.md").read_text()
    for words in ("## Data", "| source | bytes | share |", "## Training", "## Compute", "## Limits", "backpropagation"):
        assert words in card, words
    manifest = Store(str(moved)).read_json(EXPORT_FILE)
    assert manifest["version"] == 1 and set(manifest["steps"]) == {"expert-0000", "expert-0001", "expert-0002"}


def test_a_16_bit_export_is_smaller_and_close(trained_campaign, exported, tmp_path):
    dest = tmp_path / "half"
    proc = soma_here("export", str(trained_campaign), str(dest), "--dtype", "bfloat16")
    assert proc.returncode == 0 and "exported 3 experts (bfloat16)" in proc.stdout, proc.stderr[-2000:]
    assert (dest / WEIGHTS).stat().st_size < 0.6 * (exported / WEIGHTS).stat().st_size
    full, half = (RoutedLM.load(str(d)).score(DOCS[-1]) for d in (exported, dest))
    assert abs(full.nats_per_byte - half.nats_per_byte) < 0.02 * full.nats_per_byte
    assert full.ensemble_digest != half.ensemble_digest  # other weights: a score's record tells them apart


def test_damaged_exports_are_refused_naming_the_file(exported, tmp_path):
    def copy(name: str) -> Path:
        return Path(shutil.copytree(exported, tmp_path / name))

    cut = copy("cut")
    blob = (cut / WEIGHTS).read_bytes()
    (cut / WEIGHTS).write_bytes(blob[: len(blob) // 2])
    assert_one_line_error(soma_here("score", str(cut), "-", input_text="hello"), "weights.safetensors", "checksum")
    gone = copy("gone")
    (gone / "router" / "vocabulary.json").unlink()
    assert_one_line_error(soma_here("sample", str(gone), "--prompt", "a"), "vocabulary.json", "soma export")
    newer = copy("newer")
    store = Store(str(newer))
    store.write_json(EXPORT_FILE, {**store.read_json(EXPORT_FILE), "version": 99})  # a later soma's export
    assert_one_line_error(soma_here("sample", str(newer), "--prompt", "a"), "format 99", "upgrade soma-cluster")
    edited = copy("edited")
    text = (edited / EXPORT_FILE).read_text().replace('"float32"', '"float16"')
    (edited / EXPORT_FILE).write_text(text)
    assert_one_line_error(soma_here("score", str(edited), "-", input_text="x"), EXPORT_FILE)


def test_an_export_never_replaces_what_is_there(trained_campaign, exported, tmp_path):
    before = {p: p.stat().st_mtime_ns for p in exported.rglob("*")}
    assert_one_line_error(soma_here("export", str(trained_campaign), str(exported)), "already holds an export")
    assert {p: p.stat().st_mtime_ns for p in exported.rglob("*")} == before
    inside = trained_campaign / "export"
    assert_one_line_error(soma_here("export", str(trained_campaign), str(inside)), "inside the campaign")
    assert not inside.exists()
    assert_one_line_error(soma_here("export", str(exported), str(tmp_path / "again")), "is an export already")
    assert_one_line_error(soma_here("export", str(trained_campaign), str(tmp_path / "x"), "--dtype", "int8"), "--dtype")
    assert not (tmp_path / "x").exists()


def test_a_killed_export_leaves_nothing_and_the_same_command_then_succeeds(trained_campaign, tmp_path):
    """SIGKILL at random moments of `soma export`: the target is either absent or a whole export, and the next
    export removes the hidden staging directory the killed one left."""
    dest = tmp_path / "model"
    rng = random.Random(0)
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}
    argv = [sys.executable, "-m", "pipelines.cli", "export", str(trained_campaign), str(dest)]
    for _ in range(3):
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        time.sleep(rng.uniform(1.0, 4.0))  # the imports take a second or more; the writes come after
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        if dest.exists():  # it finished before the kill: whole, and loads
            RoutedLM.load(str(dest))
            shutil.rmtree(dest)
    proc = soma("export", str(trained_campaign), str(dest))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(os.listdir(tmp_path)) == ["model"]  # no staging directory of a killed export remains
    RoutedLM.load(str(dest))


def test_a_partial_campaign_exports_and_says_who_stands_in(trained_campaign, tmp_path):
    camp = partial(trained_campaign, tmp_path / "p")
    proc = soma_here("export", str(camp), str(tmp_path / "e"), "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["substituted"] == ["expert-0002"]
    assert "seed model stands in for 1 of 3 experts" in proc.stderr
    assert "Partial campaign: 1 of 3 experts" in (tmp_path / "e" / "README.md").read_text()
    assert RoutedLM.load(str(tmp_path / "e")).seed_fallback == (2,)
    proc = soma_here("score", str(tmp_path / "e"), "-", input_text="hello " * 100)
    assert proc.returncode == 0 and "seed model stands in" in proc.stderr, proc.stderr


def test_soma_score_prints_one_record_per_document(exported, tmp_path):
    files = tmp_path / "docs"
    (files / "sub").mkdir(parents=True)
    for i, d in enumerate(DOCS):
        (files / ("sub" if i % 2 else "") / f"d{i}.bin").write_bytes(d)
    (files / ".hidden").write_bytes(b"never read")
    proc = soma_here("score", str(exported), str(files))
    assert proc.returncode == 0, proc.stderr[-2000:]
    recs = [json.loads(line) for line in proc.stdout.splitlines()]
    lm = RoutedLM.load(str(exported))
    want = {f"d{i}.bin": lm.score(d) for i, d in enumerate(DOCS)}
    assert len(recs) == len(DOCS)
    for r in recs:
        s = want[Path(r["source"]).name]
        assert (r["bytes"], r["scored_bytes"], r["nats"], r["windows"]) == (s.bytes, s.scored_bytes, s.nats, s.windows)
    assert f"scored {len(DOCS)} document(s)" in proc.stderr
    lines = soma_here("score", str(exported), "--lines", "-", input_text="first line\n\nthird, no newline")
    recs = [json.loads(line) for line in lines.stdout.splitlines()]
    assert [(r["line"], r["bytes"]) for r in recs] == [(1, 10), (2, 0), (3, 17)], lines.stderr
    assert recs[1]["nats_per_byte"] is None
    assert_one_line_error(soma_here("score", str(exported), str(tmp_path / "nope")), "not found")
    assert_one_line_error(soma_here("score", str(exported), "-", "-", input_text=""), "more than once")


@settings(max_examples=6, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(case=cases())
def test_soma_score_is_causal_and_its_records_reproduce(exported, case):
    """tests/test_lm.py's property through the command (--per-byte): a document, the same with byte i changed, and
    with every byte after i changed; the bytes before i (and up to i) keep their nats, bit for bit. Each record is
    the API's, and its routes (--routes) give its nats again through the forward."""
    _, text, i, x, tail = case  # soma score reads whole documents: no prefix
    docs = [text, text[:i] + bytes([x]) + text[i + 1 :], text[: i + 1] + tail]
    with tempfile.TemporaryDirectory(prefix="soma-causal-") as tmp:
        for k, d in enumerate(docs):
            Path(tmp, f"d{k}").write_bytes(d)
        proc = soma_here("score", str(exported), tmp, "--per-byte", "--routes")
    assert proc.returncode == 0, proc.stderr[-2000:]
    base, moved, later = (json.loads(line) for line in proc.stdout.splitlines())
    assert base["per_byte"][: max(i - 1, 0)] == moved["per_byte"][: max(i - 1, 0)]
    assert base["per_byte"][:i] == later["per_byte"][:i]
    lm = exported_lm(str(exported))
    want = lm.score(text, per_byte=True, routes=True)
    assert {k: v for k, v in base.items() if k != "source"} == {**want.as_dict(), "per_byte": want.per_byte.tolist()}
    assert rescored(lm, text, want)[0] == base["nats"] and len(base["routing"]["routes"]) == base["routing"]["segments"]


@functools.lru_cache(maxsize=1)
def exported_lm(path: str) -> RoutedLM:
    return RoutedLM.load(path)


def test_soma_sample_streams_the_api_s_bytes(exported, tmp_path):
    lm = RoutedLM.load(str(exported))
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}
    argv = [sys.executable, "-m", "pipelines.cli", "sample", str(exported), "--prompt", "def ", "--seed", "3"]
    proc = subprocess.run([*argv, "--max-bytes", "300"], capture_output=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == lm.generate("def ", max_bytes=300, seed=3)  # raw bytes, UTF-8 or not
    prompt_file = tmp_path / "p.txt"
    prompt_file.write_bytes(b"\x00\xff" + b"long prompt " * 200)
    js = soma_here(
        "sample", str(exported), "--prompt-file", str(prompt_file), "--json", "--top-k", "1", "--max-bytes", "9"
    )
    (rec,) = [json.loads(line) for line in js.stdout.splitlines()]
    assert base64.b64decode(rec["base64"]) == lm.generate(prompt_file.read_bytes(), max_bytes=9, top_k=1)
    assert rec["prompt_bytes_read"] == 1024 and "longer than the model's context" in js.stderr
    two = soma_here("sample", str(exported), "--prompt", "a", "--prompt", "b", "--max-bytes", "5", "--seed", "1")
    assert [len(base64.b64decode(json.loads(x)["base64"])) for x in two.stdout.splitlines()] == [5, 5]
    assert_one_line_error(soma_here("sample", str(exported), "--prompt", "a", "--temperature", "nan"), "--temperature")
    head = subprocess.run(
        ["bash", "-c", f"{' '.join(argv)} --max-bytes 100000 | head -c 10 >/dev/null; echo rc=${{PIPESTATUS[0]}} >&2"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert "rc=141" in head.stderr and "Traceback" not in head.stderr, head.stderr[-2000:]


def test_what_a_hostile_user_tried(trained_campaign, exported, tmp_path):
    """Cases found by trying the commands as a new user would (the 2026-12-06 review), each kept."""
    lm = RoutedLM.load(str(exported))
    assert len(lm.generate("hi", max_bytes=8, temperature=1e-40, seed=1)) == 8  # no overflow at a tiny temperature
    with pytest.raises(TypeError, match="list of documents"):
        lm.score_many("hello world")
    assert lm.score("abc", prefix=None).scored_bytes == 2
    with pytest.raises(TypeError, match="str or bytes"):
        lm.generate(5)
    with pytest.raises(SomaError, match="it has 6, 12"):
        RoutedLM.load(trained_campaign, step=7)  # a path object; a step no expert has, with the ones they have
    # a seed-only campaign exports in float32 (its head is no view of the seed's any more)
    seed_only = tmp_path / "seed-only"
    shutil.copytree(trained_campaign, seed_only)
    shutil.rmtree(seed_only / "experts")
    events = seed_only / "events.jsonl"
    events.write_text("".join(x for x in events.read_text().splitlines(True) if '"expert-' not in x))
    assert soma_here("export", seed_only, tmp_path / "seed-export").returncode == 0
    assert RoutedLM.load(str(tmp_path / "seed-export")).seed_fallback == (0, 1, 2)
    # a destination under a file, the root, or empty: one line, nothing made
    (tmp_path / "afile").write_text("x")
    assert_one_line_error(soma_here("export", trained_campaign, tmp_path / "afile" / "sub"), "afile is a file")
    assert_one_line_error(soma_here("export", trained_campaign, "/"), "not a directory an export can be")
    # every file of an export is checked, the model card too; a manifest naming experts it cannot hold is refused
    card = Path(shutil.copytree(exported, tmp_path / "card"))
    (card / "README.md").write_text("edited")
    assert_one_line_error(soma_here("score", card, "-", input_text="x"), "README.md")
    odd = Path(shutil.copytree(exported, tmp_path / "odd"))
    store = Store(str(odd))
    store.write_json(EXPORT_FILE, {**store.read_json(EXPORT_FILE), "substituted": [{"expert": "expert-0009"}]})
    assert_one_line_error(soma_here("score", odd, "-", input_text="x"), "names experts it cannot hold")
    # a killed export's staging directory is swept by an export to any name beside it
    stale = tmp_path / ".gone.soma-export-999999-abcdef01"
    stale.mkdir()
    assert soma_here("export", trained_campaign, tmp_path / "other").returncode == 0 and not stale.exists()


def test_directories_links_and_lines(exported, tmp_path):
    d = tmp_path / ".cache" / "docs"  # a hidden name above the directory given hides nothing under it
    (d / "sub").mkdir(parents=True)
    (d / "sub" / "x.txt").write_bytes(b"hello\n")
    (d / ".hidden").write_bytes(b"never read")
    (d / "loop1").symlink_to(d / "loop2")
    (d / "loop2").symlink_to(d / "loop1")
    (d / "link.txt").symlink_to(d / "sub" / "x.txt")
    r = soma_here("score", exported, d)
    assert r.returncode == 0 and "2 name(s) under" in r.stderr, r.stderr
    assert sorted(Path(json.loads(x)["source"]).name for x in r.stdout.splitlines()) == ["link.txt", "x.txt"]
    lines = b"a\r\n" + b"y" * 3000 + b"\r\n\nlast"  # a long line is streamed like a file; CRLF split anywhere
    r = soma_here("score", exported, "--lines", "-", input_text=lines)
    assert [json.loads(x)["bytes"] for x in r.stdout.splitlines()] == [1, 3000, 0, 4], r.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root (CI runs as root)")
def test_an_export_onto_a_mount_point_and_onto_a_full_disk(trained_campaign, tmp_path):
    roomy, tiny = tmp_path / "roomy", tmp_path / "tiny"
    for mnt, size in ((roomy, "20m"), (tiny, "1m")):
        mnt.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], check=True)
    try:
        assert soma_here("export", trained_campaign, roomy).returncode == 0  # an empty mount point cannot be renamed
        RoutedLM.load(str(roomy))
        fill_up(tiny)
        before = sorted(os.listdir(tiny))
        assert_one_line_error(soma_here("export", trained_campaign, tiny / "model"), "cannot write the export")
        assert sorted(os.listdir(tiny)) == before  # nothing half-written, not even the staging directory
    finally:
        for mnt in (roomy, tiny):
            subprocess.run(["umount", str(mnt)], check=False)
