"""The campaign store on s3:// through s3fs, against a real moto_server process on 127.0.0.1."""

import glob
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import MICRO, assert_one_line_error
from support.s3server import s3  # noqa: F401  (fixture)

from soma_cluster.errors import ChecksumError, SomaError
from soma_cluster.storage import Store, put_file, sha256, storage_options_from_env


def test_store_basics_on_s3(s3, tmp_path):  # noqa: F811
    store = Store(s3.url("basics/camp"), s3.storage_options())
    other = Store(s3.url("basics/camp"), s3.storage_options())  # a second process's view (own s3fs cache)
    assert store.listdir("") == [] and not store.exists("a.json")
    assert other.listdir("") == [] and not other.exists("a.json")  # both have now listed/probed the root
    store.write_json("a.json", {"x": 1})
    assert other.exists("a.json") and other.read_json("a.json") == {"x": 1}
    assert other.listdir("") == ["a.json"]
    with pytest.raises(SomaError, match="already exists"):
        other.write_new("a.json", b"{}")
    # append-only logs: one object per record, listed and merged in order by any reader
    for i in range(5):
        store.append("events.jsonl", {"i": i})
    assert [r["i"] for r in other.read_log("events.jsonl")] == list(range(5))
    other.append("events.jsonl", {"i": 5})
    assert [r["i"] for r in store.read_log("events.jsonl")] == list(range(6))
    with store.batch():  # a batch of records is one object
        for i in range(6, 9):
            store.append("events.jsonl", {"i": i})
    assert [r["i"] for r in other.read_log("events.jsonl")] == list(range(9))
    names = store.listdir("events.jsonl.d")
    assert len(names) == 7
    # a corrupt record is named, not skipped
    fs = s3.fs()
    fs.pipe_file(f"{store.root}/events.jsonl.d/{names[2]}", b'{"i": 2, "checksum": "bad"}')
    with pytest.raises(ChecksumError, match=names[2]):
        Store(s3.url("basics/camp"), s3.storage_options()).read_log("events.jsonl")
    # shard-style files: put_file uploads and removes the local file; local_copy caches by URL and checksum
    src = tmp_path / "f.bin"
    src.write_bytes(b"x" * 100_000)
    put_file(store, str(src), "shards/expert-0000/train-00000.arrow")
    assert not src.exists() and other.exists("shards/expert-0000/train-00000.arrow")
    want = sha256(b"x" * 100_000)
    path = other.local_copy("shards/expert-0000/train-00000.arrow", str(tmp_path / "cache"), want)
    assert Path(path).read_bytes() == b"x" * 100_000
    Path(path).write_bytes(b"stale")  # a stale cache entry is fetched again
    again = other.local_copy("shards/expert-0000/train-00000.arrow", str(tmp_path / "cache"), want)
    assert Path(again).read_bytes() == b"x" * 100_000
    with pytest.raises(FileNotFoundError):
        other.read_bytes("nope.bin")
    assert s3.secret not in repr(store)


def test_storage_options_from_env_never_carry_credentials():
    env = {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "AWS_ENDPOINT_URL": "http://127.0.0.1:1"}
    assert storage_options_from_env("s3://b/p", env) == {"client_kwargs": {"endpoint_url": "http://127.0.0.1:1"}}
    assert storage_options_from_env("s3://b/p", {**env, "SOMA_S3_ENDPOINT": "http://127.0.0.1:2"}) == {
        "client_kwargs": {"endpoint_url": "http://127.0.0.1:2"}
    }
    assert storage_options_from_env("s3://b/p", {}) == {}
    assert storage_options_from_env("/tmp/x", env) == {}


def soma_s3(s3, *args, timeout=300, env=None):  # noqa: F811
    """The `soma` CLI with credentials only in the standard AWS variables and the endpoint in SOMA_S3_ENDPOINT."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") and not k.startswith("SOMA_S3_")}
    env = {
        **base,
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_AUTH_MODE": "disabled",
        "COLUMNS": "200",
        **s3.env(),
        **(env or {}),
    }
    return subprocess.run(
        [sys.executable, "-m", "pipelines.cli", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def _holds(path: str, needle: bytes) -> bool:
    try:
        with open(path, "rb") as fh:
            return needle in fh.read(64 << 20)
    except OSError:  # a socket or a file Ray removed meanwhile
        return False


def test_cli_campaign_on_s3_and_no_credentials_anywhere(s3, tmp_path, text_corpus):  # noqa: F811
    ray_dirs_before = set(glob.glob("/tmp/soma-ray-*"))
    fs = s3.fs()
    corpus = s3.url("corpora/micro")
    fs.put(str(text_corpus) + "/", f"{s3.bucket}/corpora/micro/", recursive=True)
    cfg = tmp_path / "micro.yaml"
    cfg.write_text(yaml.safe_dump(MICRO))
    camp = s3.url("runs/camp")
    out = []
    for args in (
        ["prepare", camp, "--config", str(cfg), "--corpus", corpus],
        ["seed", camp, "--no-progress"],
        ["launch", camp, "--no-progress"],
        ["eval", camp],
        ["status", camp],
    ):
        # the local Ray's files are kept (SOMA_KEEP_RAY_LOGS) so that they can be searched for the secret below
        proc = soma_s3(s3, *args, env={"SOMA_KEEP_RAY_LOGS": "1"})
        out.append(proc.stdout + proc.stderr)
        assert proc.returncode == 0, (args, proc.stdout[-2000:], proc.stderr[-4000:])
    assert "expert-0001" in out[-1] and "finished" in out[-1]
    objects = s3.objects("runs/camp")
    root = f"{s3.bucket}/runs/camp"
    metrics = json.loads(objects[f"{root}/eval/metrics.json"])
    assert metrics["ensemble"]["nats_per_byte"] < metrics["uniform"]["nats_per_byte"] - 1.0
    assert metrics["scored_bytes"] == metrics["windows"] * 768
    for e in range(2):
        assert f"{root}/experts/expert-{e:04d}/latest.json" in objects
        assert f"{root}/shards/expert-{e:04d}/manifest.json" in objects
    assert any(p.startswith(f"{root}/events.jsonl.d/") for p in objects)
    assert any(p.startswith(f"{root}/ledger/ledger.jsonl.d/") for p in objects)
    camp_yaml = yaml.safe_load(objects[f"{root}/campaign.yaml"])
    assert camp_yaml["corpus"]["source"] == corpus and camp_yaml["corpus"]["storage_options"] == {}
    # the secret is in no object of the bucket, in no CLI output, in no file of this test's Ray sessions
    secret = s3.secret.encode()
    leaks = [p for p, data in s3.objects().items() if secret in data]
    assert not leaks, leaks
    assert not [o for o in out if s3.secret in o]
    ray_files = [
        p
        for d in set(glob.glob("/tmp/soma-ray-*")) - ray_dirs_before
        for p in glob.glob(f"{d}/**/*", recursive=True)
        if os.path.isfile(p) and not os.path.islink(p)
    ]
    assert ray_files  # the local Ray sessions of `seed` and `launch`
    assert not [p for p in ray_files if _holds(p, secret)]
    for d in set(glob.glob("/tmp/soma-ray-*")) - ray_dirs_before:
        shutil.rmtree(d, ignore_errors=True)
    # resume on a finished S3 campaign retrains nothing and adds no event
    n_events = sum(p.startswith(f"{root}/events.jsonl.d/") for p in objects)
    assert soma_s3(s3, "resume", camp, "--no-progress").returncode == 0
    assert sum(p.startswith(f"{root}/events.jsonl.d/") for p in s3.objects("runs/camp")) == n_events


def test_unprepared_s3_campaign_is_one_line_error(s3):  # noqa: F811
    proc = soma_s3(s3, "status", s3.url("nothing"), timeout=120)
    assert proc.returncode == 2 and "run soma prepare" in proc.stderr, proc.stderr
    assert s3.secret not in proc.stdout + proc.stderr


def test_unreachable_endpoint_is_a_clear_bounded_error(s3):  # noqa: F811
    from support.s3server import free_port

    opts = s3.storage_options(
        f"http://127.0.0.1:{free_port()}", connect_timeout=1, read_timeout=1, retries={"max_attempts": 1}
    )
    store = Store(s3.url("gone"), opts, retries=1)
    with pytest.raises(
        SomaError, match="failed after 2 tries in .* s .*check that http://127.0.0.1:.* is up and reachable"
    ) as err:
        store.write_json("a.json", {"x": 1})
    assert s3.secret not in str(err.value)
    with pytest.raises(SomaError, match="is up and reachable"):
        store.exists("a.json")  # never a silent False while the store cannot be reached


def _manifests(read, n_experts: int) -> dict:
    """Everything prepare decided about the data (what it measured about itself, wall time, left out)."""
    top = json.loads(read("shards/manifest.json"))
    top.pop("wall_seconds"), top.pop("stage_seconds"), top.pop("checksum")
    out = {"shards": top, "test": json.loads(read("test/manifest.json"))}
    for e in range(n_experts):
        out[f"expert-{e:04d}"] = json.loads(read(f"shards/expert-{e:04d}/manifest.json"))
    return out


def test_missing_bucket_then_one_corpus_from_two_locations(s3, tmp_path, text_corpus):  # noqa: F811
    """A missing bucket is found before the corpus is read (and creating it is the fix); then one corpus prepared
    from the S3 server and from a local directory of another name gives the same test set and shards."""
    import shutil
    import time

    cfg = tmp_path / "micro.yaml"
    cfg.write_text(yaml.safe_dump(MICRO))
    bucket = f"{s3.bucket}-new"
    camp = f"s3://{bucket}/runs/c"
    s3.fs().put(str(text_corpus) + "/", f"{s3.bucket}/corpora/same/", recursive=True)
    t0 = time.monotonic()
    proc = soma_s3(s3, "prepare", camp, "--config", str(cfg), "--corpus", s3.url("corpora/same"), timeout=120)
    assert_one_line_error(
        proc, f"bucket {bucket} of {camp} does not exist", f"create it (e.g. aws s3 mb s3://{bucket})"
    )
    assert time.monotonic() - t0 < 30 and "corpus:" not in proc.stdout + proc.stderr  # before any data was read
    assert "Traceback" not in proc.stderr and s3.secret not in proc.stdout + proc.stderr
    assert bucket not in [b.rstrip("/") for b in s3.fs().ls("", refresh=True)]  # nothing was written
    s3.fs().mkdir(bucket)  # the suggested fix
    proc = soma_s3(s3, "prepare", camp, "--config", str(cfg), "--corpus", s3.url("corpora/same"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the same files elsewhere on local disk, under another name
    local_corpus = tmp_path / "elsewhere" / "my-copy"
    shutil.copytree(text_corpus, local_corpus)
    local_camp = tmp_path / "local-camp"
    proc = soma_s3(s3, "prepare", str(local_camp), "--config", str(cfg), "--corpus", str(local_corpus))
    assert proc.returncode == 0, proc.stderr[-3000:]
    fs = s3.fs()
    on_s3 = _manifests(lambda rel: fs.cat_file(f"{bucket}/runs/c/{rel}"), MICRO["n_experts"])
    local = _manifests(lambda rel: (local_camp / rel).read_bytes(), MICRO["n_experts"])
    assert on_s3 == local
    print(
        "manifests equal:",
        json.dumps({k: v for k, v in local["shards"]["corpus"].items()}),
        "train rows",
        local["shards"]["train_rows"],
        "val rows",
        local["shards"]["val_rows"],
        "test",
        local["test"],
    )


def test_unreachable_endpoint_is_reported_within_the_bound(s3):  # noqa: F811
    import time

    from support.s3server import free_port

    gone = f"http://127.0.0.1:{free_port()}"
    for limit, env in ((15.0, {}), (3.0, {"SOMA_S3_TIMEOUT_S": "3"})):
        t0 = time.monotonic()
        proc = soma_s3(s3, "status", s3.url("gone"), env={"SOMA_S3_ENDPOINT": gone, **env}, timeout=120)
        wall = time.monotonic() - t0
        assert_one_line_error(
            proc, "failed after", f"check that {gone} is up and reachable", f"SOMA_S3_TIMEOUT_S (now {limit:g})"
        )
        took = float(re.search(r"tries in ([0-9.]+) s", proc.stderr).group(1))
        print(f"SOMA_S3_TIMEOUT_S={limit:g}: reported after {took:.1f} s of retries, {wall:.1f} s wall")
        assert took <= limit and wall < limit + 10
        assert s3.secret not in proc.stdout + proc.stderr
    assert_one_line_error(
        soma_s3(s3, "status", s3.url("gone"), env={"SOMA_S3_TIMEOUT_S": "soon"}), "SOMA_S3_TIMEOUT_S='soon'"
    )
