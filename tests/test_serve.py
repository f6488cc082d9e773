"""soma serve on a real Ray Serve: a Ray head of this test's own, the application deployed by the CLI, real HTTP.

One application serves the module's cases in order: what it answers (equal to the in-process API, byte for byte),
what it refuses, back-pressure, an expert replica SIGKILLed under load, then a rolling update to an export through
Ray Client (ray://), and one back to the campaign through the head's dashboard (Serve's REST API): each address
form soma serve takes deploys the same application.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import assert_one_line_error, soma, soma_here
from hypothesis import HealthCheck, given, settings
from support.ports import free_port
from support.rayhead import RayHead, marked_pids
from test_lm import cases, rescored, scored_before

pytest.importorskip("ray.serve.handle", reason="ray[serve] is not installed (pip install -e '.[serve]')")

ROOT = Path(__file__).resolve().parents[1]
CLIENT_TIMEOUT_S = 60


def http(url: str, body: bytes | dict | None = None, timeout: float = CLIENT_TIMEOUT_S):
    """(status, headers (names in lower case), body bytes) of a GET (no body) or a POST."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    req = urllib.request.Request(url, data=data, method="GET" if data is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()


def score_until_done(url: str, body: dict, tries: int = 40) -> tuple[dict, int]:
    """A client that honours 503 + Retry-After: the final answer and how many 503s it saw. Any other status, or a
    connection error, is a failed request."""
    for retried in range(tries):
        status, headers, data = http(url + "v1/score", body)
        if status == 200:
            return json.loads(data), retried
        assert status == 503 and "retry-after" in headers, (status, data[:300])
        time.sleep(min(float(headers["retry-after"]), 1.0))
    raise AssertionError(f"still 503 after {tries} tries")


@pytest.fixture(scope="module")
def head():
    metrics, client, dashboard = free_port(), free_port(), free_port()
    args = (
        "--num-cpus=4",
        f"--metrics-export-port={metrics}",
        '--system-config={"metrics_report_interval_ms": 500}',
        f"--ray-client-server-port={client}",
        "--include-dashboard=true",  # overrides RayHead's false: Serve's REST API is the dashboard's
        f"--dashboard-port={dashboard}",
        "--dashboard-host=127.0.0.1",
    )
    with RayHead(args=args) as h:
        h.metrics_port, h.client_port, h.dashboard_port = metrics, client, dashboard
        yield h


def _serve(source: str | Path, head: RayHead, port: int, *extra: str, address: str | None = None, env=None) -> dict:
    where = () if address == "" else ("--address", address or head.address)
    proc = soma("serve", str(source), *where, "--port", str(port), "--detach", "--json", *extra, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {**json.loads(proc.stdout), "stderr": proc.stderr}


SETTINGS = (
    "--replicas", "2", "--set", "cpus_per_replica=0.5", "--set", "router_cpus=0.5",
    "--set", "max_ongoing_requests=4", "--set", "max_queued_requests=6", "--set", "max_batch_windows=64",
    "--set", "max_request_bytes=200000",
)  # fmt: skip


@pytest.fixture(scope="module")
def served(head, trained_campaign):
    port = free_port()
    info = _serve(trained_campaign, head, port, *SETTINGS)
    yield info
    # the application goes with the head (killed by pid); nothing else of it is left on this machine


@pytest.fixture(scope="module")
def lm(trained_campaign):
    from soma_cluster.inference.lm import RoutedLM

    return RoutedLM.load(trained_campaign, device="cpu")


DOCS = [
    "def main():\n    print('hello')\n",
    "x" * 3000,  # several windows
    "é日本語 text ünïcode " * 40,
    "ab",
]


def test_scores_over_http_equal_the_in_process_api(served, lm):
    url = served["url"]
    data, _ = score_until_done(url, {"texts": DOCS})
    assert data["source"] == served["source"]
    for got, doc in zip(data["scores"], DOCS, strict=True):
        assert got == {**lm.score(doc).as_dict()}  # every field, nats to the last bit
    # one document, a prefix (read, routed on, not scored), per-byte nats
    data, _ = score_until_done(url, {"text": DOCS[1][:1500], "prefix": DOCS[0], "per_byte": True})
    want = lm.score(DOCS[1][:1500], prefix=DOCS[0], per_byte=True)
    assert data["scores"][0]["nats"] == want.nats and data["scores"][0]["per_byte"] == want.per_byte.tolist()
    raw = bytes(range(256)) * 3  # not UTF-8: sent as base64
    data, _ = score_until_done(url, {"text": base64.b64encode(raw).decode(), "encoding": "base64"})
    assert data["scores"][0]["nats"] == lm.score(raw).nats
    latin = "caf\udce9 au lait"  # a lone surrogate escape \udce9 is the byte 0xe9, as RoutedLM reads a str
    data, _ = score_until_done(url, {"text": latin})
    assert data["scores"][0]["nats"] == lm.score(latin).nats == lm.score(b"caf\xe9 au lait").nats


@settings(max_examples=6, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(case=cases())
def test_scores_over_http_are_causal_and_say_what_produced_them(served, lm, case):
    """tests/test_lm.py's property through HTTP, its three requests sent at once: change the byte at i, every byte
    before it keeps its nats; change the bytes after i, every byte up to i keeps them, bit for bit. Each answer is
    the API's to the last bit, its record included, and the record's routes give its number again."""
    prefix, text, i, x, tail = case
    texts = [text, text[:i] + bytes([x]) + text[i + 1 :], text[: i + 1] + tail]
    bodies = [
        {"text": b64(t), "prefix": b64(prefix), "encoding": "base64", "per_byte": True, "routes": True} for t in texts
    ]
    with ThreadPoolExecutor(len(bodies)) as pool:
        base, moved, later = (d["scores"][0] for d, _ in pool.map(lambda b: score_until_done(served["url"], b), bodies))
    want = lm.score(text, prefix=prefix, per_byte=True, routes=True)
    assert base == {**want.as_dict(), "per_byte": want.per_byte.tolist()}
    k = scored_before(prefix, i)
    assert base["per_byte"][:k] == moved["per_byte"][:k]
    k = scored_before(prefix, i + 1)
    assert base["per_byte"][:k] == later["per_byte"][:k]
    assert rescored(lm, prefix + text, want)[0] == base["nats"]
    assert base["routing"]["context_sha256"] == hashlib.sha256(prefix).hexdigest()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_generation_streams_the_in_process_bytes(served, lm):
    url = served["url"]
    want = lm.generate("def ", max_bytes=120, temperature=0.9, top_k=40, seed=7)
    body = {"prompt": "def ", "max_bytes": 120, "temperature": 0.9, "top_k": 40, "seed": 7}
    req = urllib.request.Request(url + "v1/generate", data=json.dumps(body).encode(), method="POST")
    pieces = []
    with urllib.request.urlopen(req, timeout=CLIENT_TIMEOUT_S) as r:
        assert r.headers["Content-Type"] == "application/octet-stream"
        assert json.loads(r.headers["X-Soma-Route"])["experts"] == list(lm.route("def ").experts)
        while piece := r.read1(65536):
            pieces.append(piece)
    assert b"".join(pieces) == want and len(pieces) > 1  # streamed: more than one read
    status, _, data = http(url + "v1/generate", {**body, "stream": False})
    out = json.loads(data)
    assert status == 200 and base64.b64decode(out["base64"]) == want and out["bytes"] == 120
    status, _, data = http(url + "v1/generate", {"max_bytes": 0})
    assert status == 200 and data == b""


def _stream_body(url: str, body: dict, hang_up_after: int | None = None) -> bytes:
    req = urllib.request.Request(url + "v1/generate", data=json.dumps(body).encode(), method="POST")
    got = bytearray()
    with urllib.request.urlopen(req, timeout=CLIENT_TIMEOUT_S) as r:
        while piece := r.read1(65536):
            got += piece
            if hang_up_after is not None and len(got) >= hang_up_after:
                break  # the client goes away mid-stream: the connection is closed here
    return bytes(got)


def test_concurrent_streams_decode_together_each_its_own_seeded_bytes(served, lm):
    """Clients at once and one after another (joining a running batch at a step), of different lengths and options,
    one hanging up after a few bytes: every stream is the API's alone for its prompt, options and seed, and the
    replicas go on serving."""
    url = served["url"]
    cases = [
        ("def ", {"max_bytes": 150, "seed": 1}),
        ("Once upon", {"max_bytes": 40, "seed": 2, "temperature": 0.8}),
        ("", {"max_bytes": 90, "seed": 3, "top_k": 5}),
        ("x" * 2000, {"max_bytes": 60, "seed": 4}),
        ("The ", {"max_bytes": 1, "seed": 5}),
        ("é日本", {"max_bytes": 120, "seed": 6}),
    ]

    def client(i: int) -> bytes:
        time.sleep(0.1 * i)  # later ones join a batch already decoding
        prompt, opts = cases[i]
        return _stream_body(url, {"prompt": prompt, **opts})

    with ThreadPoolExecutor(len(cases) + 1) as pool:
        gone = pool.submit(_stream_body, url, {"prompt": "abc", "max_bytes": 4000, "seed": 9}, 3)
        results = list(pool.map(client, range(len(cases))))
        assert len(gone.result()) >= 3
    for (prompt, opts), got in zip(cases, results, strict=True):
        assert got == lm.generate(prompt, **opts), prompt[:10]
    assert _stream_body(url, {"prompt": "def ", "max_bytes": 150, "seed": 1}) == results[0]


BAD = [  # (body, status, field named, what the error says: its true reason); the settings of the module's application
    (b"", 400, None, "empty"),
    (b"not json", 400, None, "not JSON (Expecting value at line 1 column 1)"),
    (b"[1, 2]", 400, None, "an array, not a JSON object"),
    (b"null", 400, None, "null, not a JSON object"),
    (b'"text"', 400, None, "a string, not a JSON object"),
    (b'{"text": "caf\xe9"}', 400, None, "not UTF-8 (byte 0xe9 at offset 13)"),
    (b'\xef\xbb\xbf{"text": "ab"}', 400, None, "BOM"),
    (b'{"text": "ab",}', 400, None, "not JSON"),
    (b"[" * 100_000, 400, None, "nests too deeply"),
    ({"text": "ab", "colour": 1}, 422, "colour", "not a field of this request; its fields are text, texts"),
    ({}, 422, "text", "text: missing"),
    ({"prefix": "ab"}, 422, "text", "text: missing"),
    ({"text": None}, 422, "text", "text: null"),
    ({"texts": None}, 422, "texts", "texts: null"),
    ({"text": "ab", "texts": ["cd"]}, 422, "text", "give one of them"),
    (b'{"text": "ab", "text": "cd"}', 422, "text", "text: given twice"),
    ({"text": 5}, 422, "text", "valid string"),
    ({"text": ""}, 422, "text", "empty (a document needs 2 bytes"),
    ({"text": "", "prefix": "ab"}, 422, "text", "empty (the prefix is not scored)"),
    ({"text": "a"}, 422, "text", "text: 1 byte, and a document needs 2"),
    ({"texts": ["ab", "x"]}, 422, "texts.1", "texts.1: 1 byte"),
    ({"text": "YQ==", "encoding": "base64"}, 422, "text", "text: 1 byte"),  # base64 of one byte
    ({"texts": []}, 422, "texts", "the list is empty"),
    ({"texts": ["ok text", None]}, 422, "texts.1", "valid string"),
    ({"texts": "not a list"}, 422, "texts", "valid list"),
    ({"texts": ["abc", "def"], "prefix": ["one"]}, 422, "prefix", "1 prefix for 2 texts"),
    ({"text": "abc", "prefix": 3}, 422, "prefix", "valid string"),
    ({"text": "abc", "per_byte": "yes"}, 422, "per_byte", "valid boolean"),
    ({"text": "abc", "routes": 1}, 422, "routes", "valid boolean"),
    ({"text": "!!!", "encoding": "base64"}, 422, "text", "'!' at character 0 is not a base64 character"),
    ({"text": "YWJ", "encoding": "base64"}, 422, "text", "3 characters, not a multiple of 4"),
    ({"text": "YW Jj", "encoding": "base64"}, 422, "text", "a space or line break at character 2"),
    ({"text": "-_-_", "encoding": "base64"}, 422, "text", "URL-safe alphabet"),
    ({"text": "YQ==YQ==", "encoding": "base64"}, 422, "text", "'=' inside it"),
    (b'{"text": "\\ud800ab"}', 422, "text", "lone surrogate \\ud800 at character 0"),
    ({"text": "abc", "encoding": "latin-1"}, 422, "encoding", "'utf-8' or 'base64'"),
    ({"text": "x" * 250_000}, 413, None, "over the limit of 200000"),
    ({"texts": ["ab"] * 1025}, 413, "texts", "1025 documents, over the limit of 1024"),
]
BAD_GENERATE = [
    ({"max_bytes": 5000}, 422, "max_bytes", "5000, over the limit of 4096"),
    ({"max_bytes": -1}, 422, "max_bytes", "-1 is not a whole number"),
    ({"max_bytes": None}, 422, "max_bytes", "null is not a whole number"),
    ({"max_bytes": 1.5}, 422, "max_bytes", "1.5 is not a whole number"),
    ({"max_bytes": "10"}, 422, "max_bytes", "'10' is not a whole number"),
    ({"temperature": 0}, 422, "temperature", "0 is not a number > 0"),
    ({"temperature": -1.0}, 422, "temperature", "-1.0 is not a number > 0"),
    ({"temperature": "hot"}, 422, "temperature", "'hot' is not a number"),
    ({"temperature": 1e400}, 422, "temperature", "inf is not a number"),
    ({"top_k": 0}, 422, "top_k", "0 is not a whole number >= 1"),
    ({"top_k": 257}, 422, "top_k", "257 is not a whole number"),
    ({"seed": -1}, 422, "seed", "-1 is not a whole number"),
    ({"seed": True}, 422, "seed", "true is not a whole number"),
    ({"seed": 2**63}, 422, "seed", "is not a whole number"),
    ({"prompt": ["a"]}, 422, "prompt", "valid string"),
    ({"prompt": "!!", "encoding": "base64"}, 422, "prompt", "not base64"),
    ({"stream": "no"}, 422, "stream", "valid boolean"),
    ({"prompt": "x" * 250_000}, 413, None, "over the limit"),
]


def test_bad_requests_get_a_4xx_naming_the_field(served):
    url = served["url"]
    cases = [("v1/score", *c) for c in BAD] + [("v1/generate", *c) for c in BAD_GENERATE]
    for path, body, status, field, says in cases:
        got, _, data = http(url + path, body)
        err = json.loads(data)
        assert (got, err["field"]) == (status, field), (path, str(body)[:80], got, err)
        assert says in err["error"] and "\n" not in err["error"], (path, str(body)[:80], err["error"])
    status, _, data = http(url + "v1/score", b"x" * 300_000)  # the body itself over max_request_bytes: 413 early
    assert status == 413, data[:200]
    assert http(url + "v1/nothing", {"text": "ab"})[0] == 404


def test_health_names_what_is_served(served, trained_campaign, lm):
    status, _, data = http(served["url"] + "healthz")
    info = json.loads(data)
    assert status == 200 and info["status"] == "ok" and info["n_experts"] == 3 and info["top_k"] == 2
    assert info["experts_loaded"] == 3 and info["seed_fallback"] == [] and info["device"] == "cpu"
    assert info["source"] == served["source"] == str(trained_campaign)
    assert info["ensemble_digest"] == lm.digest  # what its scores carry


def test_metrics_reach_prometheus_through_rays_exporter(served, head):
    """Serve's own request and batch metrics and soma's, in Prometheus's text format on the node's exporter."""
    import re

    score_until_done(served["url"], {"texts": DOCS})  # something batched and scored, whatever ran before
    deadline, text = time.monotonic() + 90, ""
    want = (
        "ray_soma_serve_experts_loaded",
        "ray_serve_num_http_requests",
        "ray_serve_actual_batch_size_bucket",
        "ray_soma_serve_pass_windows_bucket",
        "ray_serve_http_request_latency_ms_bucket",
        "ray_soma_serve_windows",
    )
    while time.monotonic() < deadline:  # bounded: the exporter reports every 0.5 s here
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{head.metrics_port}/metrics", timeout=5).read().decode()
        except OSError:
            text = ""
        if all(w in text for w in want):
            break
        time.sleep(1)
    missing = [w for w in want if w not in text]
    names = sorted({ln.split("{")[0] for ln in text.splitlines() if "soma" in ln or "batch" in ln})
    assert not missing, (missing, names)
    loaded = [float(v) for v in re.findall(r"^ray_soma_serve_experts_loaded\{[^}]*\} ([0-9.]+)$", text, re.M)]
    assert loaded and set(loaded) == {3.0}, loaded  # every expert replica holds the 3 experts


def test_a_flood_gets_503_with_retry_after_and_every_request_completes(served, lm):
    """20 clients at once against max_ongoing 4 + max_queued 6 per caller: some are told to come back
    (503 + Retry-After); a client that does gets its answer, and nothing else fails."""
    url, doc = served["url"], "y" * 20_000
    want = lm.score(doc).nats
    with ThreadPoolExecutor(20) as pool:
        results = list(pool.map(lambda _: score_until_done(url, {"text": doc}), range(40)))
    assert all(r["scores"][0]["nats"] == want for r, _ in results)
    assert sum(n for _, n in results) > 0  # back-pressure was exercised


def _expert_replicas(head: RayHead) -> list[int]:
    out = []
    for pid in marked_pids(head.marker):
        try:
            if b"ServeReplica:soma:SomaExperts" in Path(f"/proc/{pid}/cmdline").read_bytes():
                out.append(pid)
        except OSError:
            pass
    return out


def _load(url: str, docs: list[str], want: dict[str, float], stop: threading.Event, failures: list, counts: list):
    """A client thread: score documents until `stop`, each answer checked; 503s retried as a client should."""
    i = 0
    while not stop.is_set() and i < 400:  # bounded
        doc = docs[i % len(docs)]
        try:
            data, retried = score_until_done(url, {"text": doc})
            if data["scores"][0]["nats"] != want[doc]:
                failures.append(("wrong answer", doc[:20]))
            counts.append(retried)
        except Exception as exc:  # noqa: BLE001 - every failure is collected and asserted on
            failures.append(repr(exc)[:300])
        i += 1


@contextmanager
def under_load(url: str, docs: list[str], want: dict[str, float], clients: int):
    """`clients` threads scoring `docs` (each answer checked against `want`) for the body of the with: yields the
    failures and the per-request 503 counts, complete once the with ends (the threads stopped and joined)."""
    stop, failures, counts = threading.Event(), [], []
    threads = [threading.Thread(target=_load, args=(url, docs, want, stop, failures, counts)) for _ in range(clients)]
    for t in threads:
        t.start()
    try:
        yield failures, counts
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)


def test_an_expert_replica_killed_under_load_loses_no_request(served, head, lm):
    url = served["url"]
    docs = [f"document {k} " * 200 for k in range(4)]
    want = {d: lm.score(d).nats for d in docs}
    before = _expert_replicas(head)
    assert len(before) == 2, before
    with under_load(url, docs, want, clients=4) as (failures, counts):
        time.sleep(2)
        os.kill(before[0], signal.SIGKILL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # bounded: Serve starts a replacement
            now = _expert_replicas(head)
            if len(now) == 2 and before[0] not in now:
                break
            time.sleep(1)
        time.sleep(2)
    assert not failures, failures[:5]
    assert len(counts) > 20, len(counts)
    now = _expert_replicas(head)
    assert len(now) == 2 and before[0] not in now, (before, now)


def test_a_rolling_update_to_an_export_fails_no_request(served, head, lm, trained_campaign, tmp_path):
    made = tmp_path / "export"
    proc = soma("export", str(trained_campaign), str(made), "--dtype", "float32")
    assert proc.returncode == 0, proc.stderr[-2000:]
    export = tmp_path / os.fsdecode(b"export-\xe9")  # a name that is not UTF-8: served, shown escaped
    made.rename(export)
    url = served["url"]
    docs = [f"update {k} " * 150 for k in range(3)]
    want = {d: lm.score(d).nats for d in docs}  # an f32 export scores as the campaign does
    with under_load(url, docs, want, clients=3) as (failures, counts):
        port = int(url.rsplit(":", 1)[1].strip("/"))
        other = free_port()  # Serve runs with its proxies on `port`: it keeps them, and the URL printed says so
        info = _serve(export, head, other, *SETTINGS, address=f"ray://127.0.0.1:{head.client_port}")
        assert info["url"] == url and f"proxies on 127.0.0.1:{port}" in info["stderr"], info
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:  # bounded: the new version takes over
            status, _, data = http(url + "healthz")
            if status == 200 and json.loads(data)["source"] == info["source"] == f"{tmp_path}/export-\\xe9":
                break
            time.sleep(1)
        time.sleep(2)
    assert json.loads(http(url + "healthz")[2])["source"] == info["source"]
    assert not failures, failures[:5]
    assert len(counts) > 10


def test_a_dashboard_address_deploys_through_serves_rest_api(served, head, lm, trained_campaign):
    """RAY_ADDRESS=http://HOST:8265 (as operators set it for ray job submit): the same application, from the Serve
    config --dry-run prints, deployed by Serve's REST API over the one a driver deployed; it answers as the API."""
    url, port = served["url"], int(served["url"].rsplit(":", 1)[1].strip("/"))
    dashboard = f"http://127.0.0.1:{head.dashboard_port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # bounded: the dashboard starts after the GCS
        try:
            urllib.request.urlopen(dashboard + "/api/serve/applications/", timeout=5).read()
            break
        except OSError:
            time.sleep(1)
    info = _serve(
        trained_campaign,
        head,
        port,
        *SETTINGS,
        "--set",
        "max_batch_windows=32",
        address="",
        env={"RAY_ADDRESS": dashboard},
    )
    assert info["url"] == url and info["source"] == str(trained_campaign)
    apps = json.loads(urllib.request.urlopen(dashboard + "/api/serve/applications/", timeout=30).read())
    soma_app = apps["applications"]["soma"]
    assert soma_app["status"] == "RUNNING" and soma_app["deployed_app_config"]["args"]["max_batch_windows"] == 32
    data, _ = score_until_done(url, {"texts": DOCS})
    assert [s["nats"] for s in data["scores"]] == [lm.score(d).nats for d in DOCS]


# -- the command itself ------------------------------------------------------------------------------------------
def test_serve_refuses_bad_input_with_one_line(tmp_path, trained_campaign):
    cases = [
        (("serve", str(tmp_path / "none")), ("neither a campaign", "soma prepare")),
        (("serve", str(trained_campaign), "--detach"), ("--detach needs --address",)),
        (("serve", str(trained_campaign), "--set", "colour=1"), ("--set colour", "max_batch_windows")),
        (("serve", str(trained_campaign), "--set", "max_batch_windows=0"), ("max_batch_windows",)),
        (("serve", str(trained_campaign), "--set", "nonsense"), ("KEY=VALUE",)),
        (("serve", str(trained_campaign), "--port", "0"), ("--port",)),
        (("serve", str(trained_campaign), "--replicas", "0"), ("--replicas",)),
    ]
    for args, needles in cases:  # in this process: each is refused before Ray or Serve is imported
        assert_one_line_error(soma_here(*args), *needles)
    # what the replicas would load, checked here first (issue 49: a damaged export started Ray and Serve, then
    # failed in the replicas after 30 s with a line that never named the file)
    export = tmp_path / "export"
    assert soma_here("export", str(trained_campaign), str(export)).returncode == 0
    damaged = Path(shutil.copytree(export, tmp_path / "damaged"))
    blob = bytearray((damaged / "weights.safetensors").read_bytes())
    blob[-100] ^= 1
    (damaged / "weights.safetensors").write_bytes(bytes(blob))
    gone = Path(shutil.copytree(export, tmp_path / "gone"))
    (gone / "router" / "vocabulary.json").unlink()
    for args, needles in [
        (("serve", str(damaged)), (f"{damaged}/weights.safetensors fails its checksum", "export again")),
        (("serve", str(gone), "--dry-run"), ("router/vocabulary.json is missing", "export again")),
        (("serve", str(export), "--step", "6"), ("is an export", "leave out step")),
        (("serve", str(trained_campaign), "--step", "999"), ("no checkpoint of step 999", "it has 6, 12")),
        (("serve", str(trained_campaign), "--gpus-per-replica", "2", "--replicas", "3"), ("need 6 GPUs", "has 4")),
        (("serve", str(trained_campaign), "--set", "device=cuda"), ("device cuda needs gpus_per_replica",)),
    ]:
        assert_one_line_error(soma_here(*args), *needles)
    camp = tmp_path / "untrained"  # as if never launched: no expert has a checkpoint, nothing to serve
    shutil.copytree(trained_campaign, camp)
    shutil.rmtree(camp / "experts")
    assert_one_line_error(soma("serve", str(camp), timeout=120), "no trained expert", "soma launch")  # a real process


@pytest.mark.slow
def test_a_taken_port_is_one_line(trained_campaign):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = soma("serve", str(trained_campaign), "--port", str(port), timeout=300)
    assert_one_line_error(proc, f"did not start on 127.0.0.1:{port}", "pass another --port")


@pytest.mark.slow
def test_a_replica_that_cannot_load_what_was_checked_is_one_line_naming_the_file(trained_campaign, tmp_path):
    """The export is whole when soma serve checks it and damaged by the time its replica loads it (as a replica on
    another node may see another file): the replica's own error, one line naming the file, at its first try (Serve
    would try 3 times, about 20 s, and say only "Failed to update the deployments")."""
    from pipelines.raysession import OWNER, PREFIX, RAY_TMP

    export = tmp_path / "export"
    assert soma("export", str(trained_campaign), str(export)).returncode == 0
    cmd = [sys.executable, "-m", "pipelines.cli", "serve", str(export), "--port", str(free_port())]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # bounded: checked, the command makes its local Ray's directory
            owners = list(Path(RAY_TMP).glob(f"{PREFIX}*/{OWNER}"))
            if any(_owned_by(p, proc.pid) for p in owners) or proc.poll() is not None:
                break
            time.sleep(0.05)
        weights = export / "weights.safetensors"
        blob = bytearray(weights.read_bytes())
        blob[-64] ^= 0xFF
        weights.write_bytes(bytes(blob))
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and out == "" and len(errors) == 1, err[-3000:]
    assert "SomaExperts replica could not start" in errors[0] and f"{weights} fails its checksum" in errors[0]


def _owned_by(owner: Path, pid: int) -> bool:
    try:
        return json.loads(owner.read_text()).get("pid") == pid
    except (OSError, ValueError):
        return False


def test_dry_run_refuses_a_path_a_config_file_cannot_hold(trained_campaign, tmp_path):
    camp = tmp_path / os.fsdecode(b"caf\xe9")
    os.symlink(trained_campaign, camp)
    assert_one_line_error(soma_here("serve", str(camp), "--dry-run"), "caf\\xe9", "UTF-8", "without --dry-run")


def test_serve_in_the_foreground_stops_on_sigterm_and_leaves_nothing(trained_campaign):
    """No address: a local Ray of its own, the URL on stdout, then SIGTERM: 143, and no process of its left."""
    port = free_port()
    cmd = [sys.executable, "-m", "pipelines.cli", "serve", str(trained_campaign), "--port", str(port)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # printed once the application is ready
        assert line.strip() == f"http://127.0.0.1:{port}/", (line, proc.stderr.read()[-2000:] if not line else "")
        status, _, data = http(line.strip() + "v1/score", {"text": DOCS[0]})
        assert status == 200 and json.loads(data)["scores"][0]["scored_bytes"] == len(DOCS[0]) - 1
        children = _descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 143
        assert "stopped: SIGTERM" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    time.sleep(1)
    assert not [p for p in children if Path(f"/proc/{p}").exists() and _not_zombie(p)], children


def _descendants(pid: int) -> list[int]:
    import psutil

    return [c.pid for c in psutil.Process(pid).children(recursive=True)]


def _not_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_dry_run_prints_a_serve_config_that_ray_accepts(trained_campaign):
    import yaml
    from ray.serve.schema import ServeDeploySchema

    from pipelines.serve_app import build

    proc = soma("serve", str(trained_campaign), "--dry-run", "--port", "9001", "--set", "max_batch_windows=512")
    assert proc.returncode == 0, proc.stderr[-2000:]
    config = ServeDeploySchema.model_validate(yaml.safe_load(proc.stdout))
    assert config.http_options.port == 9001
    (app,) = config.applications
    assert app.import_path == "pipelines.serve_app:build"
    assert app.args == {"source": str(trained_campaign), "max_batch_windows": 512}
    build(app.args)  # what `serve deploy` would build


def test_passes_coalesce_the_batches_queued_while_one_runs():
    """Serve's batches that arrive while a pass runs join the next pass, oldest first, up to max_windows; every
    caller gets its own windows' answers, or the pass's error (pipelines.serve_app.Passes, no Ray needed)."""
    import asyncio

    import numpy as np

    from pipelines.serve_app import Passes, WindowJob
    from soma_cluster.inference.routing import Routes

    def job(tag: str, n: int) -> WindowJob:
        return WindowJob("v", [tag.encode()] * n, [0] * n, Routes(np.zeros((n, 1), int), np.ones((n, 1))))

    passes: list[list[str]] = []
    release = threading.Event()

    def run(jobs: list[WindowJob]) -> list[list]:
        passes.append([j.windows[0].decode() for j in jobs])
        if len(passes) == 1:
            assert release.wait(10)  # the first pass runs until every other batch is queued
        if any(j.windows[0] == b"boom" for j in jobs):
            raise ValueError("pass failed")
        return [[(j.windows[0].decode(), i) for i in range(len(j.windows))] for j in jobs]

    async def main():
        p = Passes(run, max_windows=8)
        first = asyncio.create_task(p.submit([job("a", 2)]))
        for _ in range(100):  # bounded: until the first pass has started
            if passes:
                break
            await asyncio.sleep(0.01)
        later = [asyncio.create_task(p.submit([job(t, n)])) for t, n in (("b", 3), ("c", 1), ("d", 4), ("e", 9))]
        await asyncio.sleep(0.05)
        release.set()
        return await asyncio.wait_for(asyncio.gather(first, *later), 10)

    out = asyncio.run(main())
    # b + c fit 8 windows with each other and d would not (3 + 1 + 4 = 8 does): one pass; e (9) alone
    assert passes == [["a"], ["b", "c", "d"], ["e"]]
    assert out[0] == [[("a", 0), ("a", 1)]] and out[1] == [[("b", 0), ("b", 1), ("b", 2)]]
    assert out[3] == [[("d", i) for i in range(4)]] and len(out[4][0]) == 9

    passes.clear()
    release.set()

    async def failing():
        p = Passes(run, max_windows=8)
        return await asyncio.gather(p.submit([job("boom", 1)]), return_exceptions=True)

    assert [type(e) for e in asyncio.run(failing())] == [ValueError]
