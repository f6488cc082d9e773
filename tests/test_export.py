"""soma export, soma score and soma sample in real processes on a real trained micro campaign: an export that
loads without the campaign and scores the same, damaged exports refused by name, a killed export that leaves
nothing behind, and the commands' outputs against the Python API."""

from __future__ import annotations

import base64
import functools
import hashlib
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
import yaml
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
    assert manifest["version"] == 2 and set(manifest["steps"]) == {"expert-0000", "expert-0001", "expert-0002"}


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


# -- an export people can host ---------------------------------------------------------------------------------------
OUTSIDE = r"""
import json, sys
import torch
import torch.nn.functional as F
from safetensors import safe_open

path, expert, window = sys.argv[1], sys.argv[2], bytes.fromhex(sys.argv[3])
with safe_open(path, "pt") as f:
    meta = f.metadata()
    t = {k: f.get_tensor(k).float() for k in f.keys()}
shape = json.loads(meta["soma.model"])
eps = float(meta["soma.layer_norm_eps"])
w = {k[len(expert) + 1 :]: v for k, v in t.items() if k.startswith(expert + ".")}
E = w.get("embed.weight", t.get("embed.weight"))


def ln(h, g):
    return F.layer_norm(h, h.shape[-1:], eps=eps) * g


lstm = torch.nn.LSTM(shape["d"], shape["d"], bias=False, batch_first=True)
x = torch.tensor(list(window[:-1]))[None]
with torch.no_grad():
    h = E[x]
    if "proj_in.weight" in w:
        h = h @ w["proj_in.weight"].T
    for b in range(shape["depth"]):
        lstm.weight_ih_l0.copy_(w[f"blocks.{b}.lstm.weight_ih"])
        lstm.weight_hh_l0.copy_(w[f"blocks.{b}.lstm.weight_hh"])
        h = h + lstm(ln(h, w[f"blocks.{b}.ln1.weight"]))[0]
        u = ln(h, w[f"blocks.{b}.ln2.weight"])
        h = h + F.gelu(u @ w[f"blocks.{b}.mlp.fc1.weight"].T) @ w[f"blocks.{b}.mlp.fc2.weight"].T
    h = ln(h, w["ln_f.weight"])
    if "proj_out.weight" in w:
        h = h @ w["proj_out.weight"].T
    logp = torch.log_softmax((h @ E.T).double(), dim=-1)[0]
assert not [m for m in sys.modules if m.split(".")[0] in ("soma_cluster", "pipelines", "workers")]
print(json.dumps(logp.tolist()))
"""


def test_the_weights_read_outside_soma_give_each_expert_s_log_probabilities(exported, tmp_path):
    """A reader with safetensors and torch alone (a process with no soma on its path) finds each expert's tensors by
    name, rebuilds its forward with torch.nn.LSTM from the card's description and the file's metadata, and gets the
    log-probabilities RoutedLM's forward gives for that expert alone (the same maths; soma's own LSTM kernel rounds
    differently, hence a tolerance)."""
    from soma_cluster.inference.routing import Routes

    lm = RoutedLM.load(str(exported), device="cpu")
    window = ("def f(x):\n    return x * 2  # " + "naïve café " * 20).encode()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for expert in range(3):
        proc = subprocess.run(
            [sys.executable, "-I", "-c", OUTSIDE, str(exported / WEIGHTS), f"expert-{expert:04d}", window.hex()],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
            env=env,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        outside = np.array(json.loads(proc.stdout))
        (want,) = lm.forward([window], Routes(np.array([[expert]]), np.array([[1.0]])), every_byte=True)
        assert outside.shape == want.shape == (len(window) - 1, 256)
        np.testing.assert_allclose(outside, want, rtol=0, atol=2e-4)
        assert (outside.argmax(-1) == want.argmax(-1)).mean() > 0.99


def test_an_export_written_before_the_tensors_had_names_still_loads_and_scores_the_same(exported, tmp_path):
    """Format 1 (flat vectors, soma-cluster before this one) is still read: exports made then load, score and serve
    as they did. Made here from the new export by the goldens' own reconstruction of format 1."""
    from support.inference_golden import flat_weights

    old = Path(shutil.copytree(exported, tmp_path / "format1"))
    blob = flat_weights(exported)
    (old / WEIGHTS).write_bytes(blob)
    store = Store(str(old))
    manifest = store.read_json(EXPORT_FILE)
    manifest["version"] = 1
    manifest["files"][WEIGHTS] = hashlib.sha256(blob).hexdigest()
    store.write_json(EXPORT_FILE, manifest)
    new, was = RoutedLM.load(str(exported)), RoutedLM.load(str(old))
    for doc in DOCS:
        assert was.score(doc, per_byte=True) == new.score(doc, per_byte=True)
    assert was.generate("def ", max_bytes=40, seed=2) == new.generate("def ", max_bytes=40, seed=2)


def test_weights_without_a_tensor_or_with_a_wrong_shape_are_one_line_naming_it(exported, tmp_path):
    from safetensors.torch import load, save

    def damaged(name: str, change) -> Path:
        d = Path(shutil.copytree(exported, tmp_path / name))
        tensors = dict(load((d / WEIGHTS).read_bytes()))
        change(tensors)
        blob = save(tensors)
        (d / WEIGHTS).write_bytes(blob)
        store = Store(str(d))
        manifest = store.read_json(EXPORT_FILE)
        manifest["files"][WEIGHTS] = hashlib.sha256(blob).hexdigest()  # a whole file, of the wrong tensors
        store.write_json(EXPORT_FILE, manifest)
        return d

    missing = damaged("missing", lambda t: t.pop("expert-0001.blocks.1.lstm.weight_hh"))
    assert_one_line_error(
        soma_here("score", missing, "-", input_text="x"), "lacks expert-0001.blocks.1.lstm.weight_hh", WEIGHTS
    )
    shape = damaged("shape", lambda t: t.update({"seed.ln_f.weight": t["seed.ln_f.weight"][:-1].clone()}))
    assert_one_line_error(soma_here("sample", shape, "--prompt", "a"), "ln_f.weight has shape (31,), not (32,)")
    stranger = damaged("stranger", lambda t: t.update({"expert-0009.ln_f.weight": t["seed.ln_f.weight"].clone()}))
    assert_one_line_error(soma_here("score", stranger, "-", input_text="x"), "expert-0009", WEIGHTS)


def test_the_model_card_is_a_hugging_face_card_with_the_eval_s_metrics(trained_campaign, tmp_path):
    """The card starts with the Hub's YAML metadata, as huggingface_hub's own ModelCard and ModelCardData parse it
    (offline: validate() asks the Hub): license, library_name, tags, datasets, and model-index with the test losses
    of the campaign's eval and the compute it cost, dollars and the GPU-hours no price covered included."""
    hub = pytest.importorskip("huggingface_hub")
    from soma_cluster.ledger import Ledger

    camp = Path(shutil.copytree(trained_campaign, tmp_path / "camp"))
    proc = soma("eval", str(camp))
    assert proc.returncode == 0, proc.stderr[-2000:]
    # a priced record, as a resume under prices.* writes it: the campaign now has dollars and unpriced hours
    Ledger(Store(str(camp))).record(
        category="expert_training", gpu_seconds=360.0, wall_seconds=360.0, expert=0, attempt=9, usd_per_hour=2.5
    )
    out = tmp_path / "card-export"
    assert soma_here("export", camp, out, "--license", "apache-2.0").returncode == 0
    text = (out / "README.md").read_text()
    assert text.startswith("---\n")
    card = hub.ModelCard.load(out / "README.md")  # a local file: no network
    data = card.data
    assert data.license == "apache-2.0" and data.library_name == "soma-cluster"
    assert {"soma", "byte-level", "mixture-of-experts"} <= set(data.tags)
    corpus = yaml.safe_load((camp / "campaign.yaml").read_text())["corpus"]["source"]
    assert data.datasets == [f"local/{Path(corpus).name}"]  # a local corpus by its name, never its path
    assert data.model_name == "micro" and card.text.lstrip().startswith("# micro: a SOMA routed ensemble")
    metrics = json.loads((camp / "eval" / "metrics.json").read_text())
    results = {(r.metric_type, r.metric_name): r for r in data.eval_results}
    test_loss = results[("nats_per_byte", "Test loss (nats/byte)")]
    assert test_loss.metric_value == metrics["ensemble"]["nats_per_byte"] and test_loss.dataset_split == "test"
    assert test_loss.task_type == "text-generation" and test_loss.metric_args["ci95"] == metrics["ensemble"]["ci95"]
    assert (
        results[("seed_nats_per_byte", "Seed model test loss (nats/byte)")].metric_value
        == (metrics["seed"]["nats_per_byte"])
    )
    totals = Ledger(Store(str(camp))).totals()
    assert results[("usd", "Cost (USD)")].metric_value == pytest.approx(0.25)  # 0.1 h at $2.50
    unpriced = [r for (kind, _), r in results.items() if kind == "unpriced_gpu_hours"]
    assert unpriced and unpriced[0].metric_value == pytest.approx(totals.unpriced_gpu_seconds / 3600)
    assert "$0.25 at the prices in force" in card.text
    # parsed again from its own metadata, the card data round-trips
    again = hub.ModelCardData(**yaml.safe_load(text.split("---\n")[1]))
    assert again.to_dict() == data.to_dict()
    # without an eval (the session's campaign) there is no model-index; --license other names the data's terms
    bare = tmp_path / "bare"
    assert soma_here("export", trained_campaign, bare).returncode == 0
    data = hub.ModelCard.load(bare / "README.md").data
    assert data.license == "other" and data.license_name == "training-data-terms" and data.eval_results is None
    assert_one_line_error(
        soma_here("export", trained_campaign, tmp_path / "x", "--license", "MIT License"), "--license"
    )
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("d,embed_dim,depth", [(48, 32, 3), (16, 64, 1)])
def test_wide_and_narrow_experts_read_outside_soma_as_soma_computes_them(tmp_path, d, embed_dim, depth):
    """The names cover every layout (proj_in and proj_out where d != embed_dim, any depth): a body of each written
    under its names (Layout.named), read back by the outside reader, gives soma's own forward (no training needed:
    an initialised body, scaled so the prediction is far from uniform)."""
    import torch
    from safetensors.torch import save

    from soma_cluster.config import ModelConfig
    from soma_cluster.model import EMBED_TENSOR, LN_EPS, Layout, body_forward, init_body, init_head

    cfg = ModelConfig(d=d, embed_dim=embed_dim, depth=depth)
    g = torch.Generator().manual_seed(1)
    layout, body, head = Layout(cfg), init_body(cfg, g) * 3, init_head(cfg, g) * 40
    assert torch.equal(layout.flat(layout.named(body)), body)
    tensors = {f"expert-0000.{k}": v.clone() for k, v in layout.named(body).items()}
    tensors[EMBED_TENSOR] = head
    meta = {"soma.model": json.dumps(cfg.model_dump(mode="json")), "soma.layer_norm_eps": repr(LN_EPS)}
    (tmp_path / WEIGHTS).write_bytes(save(tensors, metadata=meta))
    window = b"The LSTM reads one byte at a time. " * 4
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    argv = [sys.executable, "-I", "-c", OUTSIDE, str(tmp_path / WEIGHTS), "expert-0000", window.hex()]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    x = torch.tensor(list(window[:-1]), dtype=torch.uint8)[None]  # (B=1, T)
    with torch.no_grad():
        h = body_forward(cfg, body[None], head, x)[0, :, 0]  # (T, e)
        want = torch.log_softmax((h @ head.T).double(), dim=-1).numpy()
    np.testing.assert_allclose(np.array(json.loads(proc.stdout)), want, rtol=0, atol=2e-4)
