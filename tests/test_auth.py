"""A Ray head with token authentication on 127.0.0.1 (started and stopped by this test only): a campaign
runs through `--address` with the token in the environment, and without it `soma` ends with one error line
naming the address and the auth variables, instead of a 30-line traceback or a silent switch to no auth."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import pytest
from conftest import micro_config
from support.rayhead import RayHead, free_port

from pipelines.prepare import prepare
from soma_cluster.config import to_yaml_text
from soma_cluster.events import history
from soma_cluster.storage import Store


def cli(*args, env):
    return subprocess.run(
        [sys.executable, "-m", "pipelines.cli", *args], env=env, capture_output=True, text=True, timeout=300
    )


def client_env(**auth) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH") and k != "RAY_ADDRESS"}
    return {**env, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "COLUMNS": "200", **auth}


@pytest.fixture(scope="module")
def token_head():
    token = uuid.uuid4().hex
    with RayHead({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}, ("--num-cpus=2", "--num-gpus=2")) as head:
        yield head, token


def one_error(out) -> str:
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    lines = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    return lines[0]


def test_campaign_through_a_token_cluster_with_the_token(token_head, tmp_path, text_corpus):
    head, token = token_head
    cfg = micro_config(corpus={"source": str(text_corpus)})
    store = Store(str(tmp_path / "camp"))
    prepare(store, cfg)
    env = client_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    for cmd in ("seed", "launch"):
        out = cli(cmd, store.url, "--address", head.address, "--no-progress", env=env)
        assert out.returncode == 0, (cmd, out.stderr[-3000:])
    hist = history(store)
    assert all(hist[f"expert-{e:04d}"].state == "finished" for e in range(cfg.n_experts))


def test_without_the_token_one_line_names_the_address_and_the_variables(token_head, tmp_path):
    head, _ = token_head
    store = Store(str(tmp_path / "camp"))
    store.write_new("campaign.yaml", to_yaml_text(micro_config()).encode())
    for auth in ({}, {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "wrong"}):  # no token; a wrong one
        t0 = time.monotonic()
        out = cli("seed", store.url, "--address", head.address, "--no-progress", env=client_env(**auth))
        took = time.monotonic() - t0
        line = one_error(out)
        assert head.address in line and "RAY_AUTH_MODE=token" in line and "RAY_AUTH_TOKEN" in line, line
        # refused by one GCS call before ray.init, which retried for 20 s with a warning each second
        assert took < 15 and out.stderr.count("\n") <= 3, (took, out.stderr[-2000:])
    assert not store.exists("events.jsonl")  # nothing was started or written


def test_an_address_nothing_listens_at_fails_fast_in_one_line(tmp_path):
    store = Store(str(tmp_path / "camp"))
    store.write_new("campaign.yaml", to_yaml_text(micro_config()).encode())
    address = f"127.0.0.1:{free_port()}"
    line = one_error(cli("launch", store.url, "--address", address, "--no-progress", env=client_env()))
    assert address in line and "--address" in line, line
