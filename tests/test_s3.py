"""The campaign store on s3:// through s3fs, against a real moto_server process on 127.0.0.1."""
import json
import os
import subprocess
import sys

import pytest
import yaml

from conftest import MICRO
from s3server import s3  # noqa: F401  (fixture)
from soma_cluster.errors import ChecksumError, SomaError
from soma_cluster.storage import Store, put_file, sha256, storage_options_from_env


def test_store_basics_on_s3(s3, tmp_path):  # noqa: F811
    store = Store(s3.url("basics/camp"), s3.storage_options())
    other = Store(s3.url("basics/camp"), s3.storage_options())     # a second process's view (own s3fs cache)
    assert store.listdir("") == [] and not store.exists("a.json")
    assert other.listdir("") == [] and not other.exists("a.json")   # both have now listed/probed the root
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
    names = store.listdir("events.jsonl.d")
    assert len(names) == 6
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
    assert open(path, "rb").read() == b"x" * 100_000
    open(path, "wb").write(b"stale")                                 # a stale cache entry is fetched again
    assert open(other.local_copy("shards/expert-0000/train-00000.arrow", str(tmp_path / "cache"), want), "rb").read() == b"x" * 100_000
    with pytest.raises(FileNotFoundError):
        other.read_bytes("nope.bin")
    assert s3.secret not in repr(store)


def test_storage_options_from_env_never_carry_credentials():
    env = {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "AWS_ENDPOINT_URL": "http://127.0.0.1:1"}
    assert storage_options_from_env("s3://b/p", env) == {"client_kwargs": {"endpoint_url": "http://127.0.0.1:1"}}
    assert storage_options_from_env("s3://b/p", {**env, "SOMA_S3_ENDPOINT": "http://127.0.0.1:2"}) == {"client_kwargs": {"endpoint_url": "http://127.0.0.1:2"}}
    assert storage_options_from_env("s3://b/p", {}) == {}
    assert storage_options_from_env("/tmp/x", env) == {}
