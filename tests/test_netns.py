"""A campaign on real hosts: a Ray head and two worker hosts in network namespaces (tests/support/netns.py), the
driver on the head's host as `soma launch --address` (as a Ray Job would run it), and the network failing between
them.
docs/scheduling.md ("Network partitions") states each outcome checked here.

One cluster serves the whole module (up in ~11-40 s, down in ~1 s). Ray's health checks are shortened on the head
(netns.FAST_HEALTH_CHECK: a partitioned node is declared dead after about 10 s instead of 64 s)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import micro_config
from support.netns import REPO, SUBNET, Cluster, missing
from support.s3server import moto_server_bin

from pipelines.prepare import prepare
from soma_cluster.checkpoint import load_checkpoint
from soma_cluster.events import history
from soma_cluster.ledger import Ledger
from soma_cluster.storage import Store

# long enough that a partition lands mid-launch (checkpoints every 6 of 48 updates), short enough for the suite
SECTIONS = dict(
    train={"updates": 48, "chunk_updates": 3, "checkpoint_every": 6, "val_every": 12, "val_batches": 1},
    retry={"max_retries": 2, "backoff_s": 0.2, "heartbeat_timeout_s": 120},
)
EXPERTS = ("expert-0000", "expert-0001")
LEASE_TTL_S = 10  # SOMA_LEASE_TTL_S for the driver-cut case (30 s by default)
# how soon Ray ends a driver cut from the GCS: it notices after a gRPC keepalive times out (Ray's default 120 s),
# then tries to reconnect for gcs_rpc_server_reconnect_timeout_s (60 s): 181 s measured with both defaults
CUT_DRIVER_RAY = {"RAY_grpc_client_keepalive_timeout_ms": "10000", "RAY_gcs_rpc_server_reconnect_timeout_s": "20"}
S3_IP = f"{SUBNET}.4"  # the fourth host (after head, w1, w2): an S3 server, made by the case that needs it
S3_ENV = {  # every worker's, and the driver's when the campaign is on S3
    "AWS_ACCESS_KEY_ID": "test",
    "AWS_SECRET_ACCESS_KEY": "test",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
    "SOMA_S3_ENDPOINT": f"http://{S3_IP}:5000",
    "SOMA_S3_TIMEOUT_S": "3",
}
BLIP_S = 2.0  # a partition well inside Ray's detection time with netns.FAST_HEALTH_CHECK (about 10 s)
METRICS_LOST = ("metrics disabled", "metrics update failed", "did not reach their holder")  # pipelines/metrics.py


@pytest.fixture(scope="module")
def hosts():
    reason = missing()
    if reason:
        pytest.skip(reason)
    t0 = time.monotonic()
    with Cluster(workers=2, worker_env=S3_ENV) as c:
        print(f"\nnetns cluster up in {time.monotonic() - t0:.1f} s")
        yield c
        t0 = time.monotonic()
    print(f"netns cluster down in {time.monotonic() - t0:.1f} s")


@pytest.fixture
def cluster(hosts):
    """The module's cluster, whole again (links up, no loss, every node alive) whatever the case before left."""
    hosts.ensure_healthy()
    return hosts


def soma_on(
    c: Cluster, host: str, *args, timeout: float = 600, address: bool = True, **env: str
) -> subprocess.CompletedProcess:
    """The CLI in a process on `host`, against the cluster's head (without `address`, on no Ray)."""
    return c.hosts[host].run(
        sys.executable, "-m", "pipelines.cli", *args, *(("--address", c.address, "--no-progress") if address else ()),
        capture_output=True, text=True, timeout=timeout, cwd=REPO, env=c.hosts[host].environ(**env),
    )  # fmt: skip


def launch_on(c: Cluster, host: str, camp: Path, **env: str) -> subprocess.Popen:
    with open(camp.parent / f"{camp.name}-driver.log", "w") as log:  # the child keeps its own copy of the fd
        return c.hosts[host].popen(
            sys.executable, "-m", "pipelines.cli", "launch", str(camp), "--address", c.address, "--no-progress",
            stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=c.hosts[host].environ(**env),
        )  # fmt: skip


def events(camp: Path, job=None, kind=None) -> list[dict]:
    path = camp / "events.jsonl"
    out = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [e for e in out if (job is None or e["job"] == job) and (kind is None or e["event"] == kind)]


def expert_events(camp: Path, kind: str) -> list[dict]:
    return [e for e in events(camp, kind=kind) if e["job"] in EXPERTS]


def wait_for(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:  # bounded in time
        if value := pred():
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def assert_resume_changes_nothing(c: Cluster, camp: Path) -> None:
    """`soma resume` after the fault: the campaign has ended, so it ends at once, training and billing nothing."""
    before = (len(events(camp, kind="started")), (camp / "ledger/ledger.jsonl").read_text())
    out = soma_on(c, "head", "resume", str(camp))
    assert out.returncode == 0, out.stderr[-3000:]
    assert (len(events(camp, kind="started")), (camp / "ledger/ledger.jsonl").read_text()) == before


def first_checkpoint(hosts: Cluster, camp: Path) -> tuple[dict, dict, str]:
    """The first expert checkpoint of a launch, the `started` event of its attempt, and the host it runs on."""
    first = wait_for(lambda: expert_events(camp, "checkpointed"), 300, "a first checkpoint")[0]
    started = [e for e in events(camp, first["job"], "started") if e["attempt"] == first["attempt"]][-1]
    victim = hosts.host_at(started["node_ip"])
    assert victim in ("w1", "w2"), started
    return first, started, victim


def assert_bitwise(camp: Path, ref: Path) -> None:
    for job in EXPERTS:
        a = load_checkpoint(Store(str(camp)), f"experts/{job}").tensors
        b = load_checkpoint(Store(str(ref)), f"experts/{job}").tensors
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), job


def assert_ledger_exact(camp: Path, ref: Path) -> None:
    """Every training forward billed once: the same as the unfaulted run's, any lost work in `wasted` only."""
    raw = [json.loads(line)["id"] for line in (camp / "ledger/ledger.jsonl").read_text().splitlines()]
    assert len(raw) == len(set(raw))
    mine, theirs = Ledger(Store(str(camp))).totals(), Ledger(Store(str(ref))).totals()
    assert mine.forwards["expert_training"] == theirs.forwards["expert_training"]


@pytest.fixture(scope="module")
def seeded(hosts, tmp_path_factory, text_corpus):
    """A micro campaign prepared here, seeded on the cluster, and its unfaulted launch (the reference)."""
    root = tmp_path_factory.mktemp("netns")
    cfg = micro_config(corpus={"source": str(text_corpus)}, **SECTIONS)
    prepare(Store(str(root / "seeded")), cfg)
    out = soma_on(hosts, "head", "seed", str(root / "seeded"))
    assert out.returncode == 0, out.stderr[-3000:]
    shutil.copytree(root / "seeded", root / "ref")
    t0 = time.monotonic()
    out = soma_on(hosts, "head", "launch", str(root / "ref"))
    assert out.returncode == 0, out.stderr[-3000:]
    print(f"\nunfaulted launch: {time.monotonic() - t0:.1f} s")
    return root


def test_worker_partitioned_mid_launch_is_node_lost_then_heals_and_rejoins(cluster, seeded):
    hosts = cluster
    camp = seeded / "cut"
    shutil.copytree(seeded / "seeded", camp)
    driver = launch_on(hosts, "head", camp)
    victim = None
    try:
        # the first expert to checkpoint: its host is cut off mid-launch, with the expert's actor on it
        first, started, victim = first_checkpoint(hosts, camp)
        cut_at = time.time()
        hosts.partition(victim)
        lost = wait_for(lambda: events(camp, first["job"], "failed"), 120, "the node declared lost")[0]
        print(f"\n{victim} partitioned: {first['job']} failed {lost['t'] - cut_at:.1f} s later ({lost['reason']})")
        assert driver.wait(timeout=600) == 0, (camp.parent / "cut-driver.log").read_text()[-3000:]
    finally:
        if driver.poll() is None:
            driver.kill()
        if victim is not None:
            hosts.heal(victim)
    assert lost["cause"] == "node_lost" and lost["counted"] is False, lost
    assert lost["t"] - cut_at < 60  # netns.FAST_HEALTH_CHECK: 9.2-9.8 s measured
    hist = history(Store(str(camp)))
    assert all(hist[j].state == "finished" and hist[j].failures == 0 for j in EXPERTS)
    assert events(camp, first["job"], "started")[-1]["resumed"] is True  # from its checkpoint, elsewhere
    assert events(camp, first["job"], "started")[-1]["node"] != started["node"]
    assert_bitwise(camp, seeded / "ref")
    assert_ledger_exact(camp, seeded / "ref")
    log = (camp.parent / "cut-driver.log").read_text()
    assert not any(m in log for m in METRICS_LOST), log[-2000:]  # the campaign's metrics holder is on the head
    assert_resume_changes_nothing(hosts, camp)

    # healed: the node Ray declared dead does not come back by itself (its raylet exits); restarted, it rejoins
    ip = hosts.hosts[victim].ip
    wait_for(lambda: not hosts.raylet_running(victim), 120, "the healed node's raylet to exit")
    t0 = time.monotonic()
    hosts.restart(victim)
    nodes = hosts.wait_nodes(lambda ns: sum(n["alive"] for n in ns) == 3, "the healed node rejoined")
    print(f"{victim} restarted and rejoined in {time.monotonic() - t0:.1f} s")
    assert [n["alive"] for n in nodes if n["ip"] == ip].count(False) >= 1  # the old node stays dead, a new one is up


def test_partition_shorter_than_detection_loses_nothing(cluster, seeded):
    """A worker cut off for 2 s mid-launch (Ray needs about 10 s here to declare it dead): nothing failed, nothing
    retried, nothing wasted; the checkpoints are the unfaulted run's."""
    camp = seeded / "blip"
    shutil.copytree(seeded / "seeded", camp)
    driver = launch_on(cluster, "head", camp)
    victim = None
    try:
        _, _, victim = first_checkpoint(cluster, camp)
        cluster.partition(victim)
        time.sleep(BLIP_S)
        cluster.heal(victim)
        assert driver.wait(timeout=600) == 0, (camp.parent / "blip-driver.log").read_text()[-3000:]
    finally:
        if driver.poll() is None:
            driver.kill()
        if victim is not None:
            cluster.heal(victim)
    assert expert_events(camp, "failed") == []
    assert all(len(events(camp, j, "started")) == 1 for j in EXPERTS)
    assert sum(n["alive"] for n in cluster.nodes()) == 3  # no node declared dead
    assert_bitwise(camp, seeded / "ref")
    assert_ledger_exact(camp, seeded / "ref")
    assert Ledger(Store(str(camp))).totals().forwards.get("wasted", 0) == 0


def test_lossy_and_slow_links_lose_nothing(cluster, seeded):
    """Both workers drop 10% of their packets each way (nftables) and one is capped at 2 Mbit/s (tbf) for a whole
    launch: no false death with netns.FAST_HEALTH_CHECK, nothing retried, checkpoints bitwise the unfaulted run's."""
    camp = seeded / "lossy"
    shutil.copytree(seeded / "seeded", camp)
    for w in ("w1", "w2"):
        cluster.lossy(w, 10)
    cluster.slow("w1", "2mbit")
    driver = launch_on(cluster, "head", camp)
    try:
        assert driver.wait(timeout=600) == 0, (camp.parent / "lossy-driver.log").read_text()[-3000:]
    finally:
        if driver.poll() is None:
            driver.kill()
        for w in ("w1", "w2"):
            cluster.clear(w)
    assert expert_events(camp, "failed") == []
    assert sum(n["alive"] for n in cluster.nodes()) == 3
    assert_bitwise(camp, seeded / "ref")
    assert_ledger_exact(camp, seeded / "ref")


@pytest.mark.slow
def test_head_lost_and_restarted_then_resume_finishes_bitwise(cluster, seeded):
    """The head's host lost mid-launch (every process on it killed, the driver's too) and Ray started on it again:
    the workers' raylets have lost their GCS and are started again too; `soma resume` on the head finishes the
    campaign bitwise equal to the unfaulted run, each GPU-second record once."""
    camp = seeded / "head"
    shutil.copytree(seeded / "seeded", camp)
    driver = launch_on(cluster, "head", camp)
    try:
        first_checkpoint(cluster, camp)
        t0 = time.monotonic()
        cluster.restart("head")  # the driver (on the head's host) goes with it
        assert driver.wait(timeout=30) != 0
        cluster.ensure_healthy()
        print(f"\nhead restarted, workers rejoined in {time.monotonic() - t0:.1f} s")
    finally:
        if driver.poll() is None:
            driver.kill()
    t0 = time.monotonic()
    out = soma_on(cluster, "head", "resume", str(camp))
    assert out.returncode == 0, out.stderr[-3000:]
    print(f"resume finished in {time.monotonic() - t0:.1f} s")
    hist = history(Store(str(camp)))
    assert all(hist[j].state == "finished" and hist[j].failures == 0 for j in EXPERTS)
    assert_bitwise(camp, seeded / "ref")
    raw = [json.loads(line)["id"] for line in (camp / "ledger/ledger.jsonl").read_text().splitlines()]
    assert len(raw) == len(set(raw))
    cfg = micro_config(**SECTIONS)
    mine, ref = Ledger(Store(str(camp))).totals(), Ledger(Store(str(seeded / "ref"))).totals()
    # work done past the last checkpoint by the killed driver's actors is billed at most once more (wasted)
    slack = 2 * cfg.spsa.n_pert * cfg.train.chunk_updates * cfg.n_experts
    trained, reference = mine.forwards["expert_training"], ref.forwards["expert_training"]
    assert reference <= trained <= reference + slack


@pytest.mark.slow
def test_driver_host_cut_longer_than_the_lease_then_resume_takes_over(cluster, seeded):
    """The driver runs on a worker's host, cut off mid-launch for longer than the lease's ttl. It still reaches
    the campaign (the filesystem is shared, as a store reachable from both sides would be), so it keeps renewing
    the lease: `soma resume --take-over` on the head is refused while it lives, never running beside it. Ray ends
    the cut driver once it has lost the GCS (CUT_DRIVER_RAY); then the resume takes over at once and finishes
    bitwise, with nothing counted against an expert."""
    camp = seeded / "drvcut"
    shutil.copytree(seeded / "seeded", camp)
    lease = {"SOMA_LEASE_TTL_S": str(LEASE_TTL_S)}
    driver = launch_on(cluster, "w1", camp, **lease, **CUT_DRIVER_RAY)
    try:
        wait_for(lambda: expert_events(camp, "checkpointed"), 300, "a first checkpoint")
        cut_at = time.time()
        cluster.partition("w1")
        early = soma_on(cluster, "head", "resume", str(camp), "--take-over", **lease)
        print(f"\nresume --take-over {time.time() - cut_at:.1f} s into the cut: exit {early.returncode}")
        rc = driver.wait(timeout=600)
        ended = time.time() - cut_at
        print(f"the cut driver exited {rc} after {ended:.1f} s")
        t0 = time.monotonic()
        out = soma_on(cluster, "head", "resume", str(camp), "--take-over", **lease)
        print(f"resume --take-over after it: exit {out.returncode} in {time.monotonic() - t0:.1f} s")
    finally:
        if driver.poll() is None:
            driver.kill()
        cluster.heal("w1")
    assert early.returncode == 2 and "renew" in early.stderr, early.stderr[-2000:]
    assert rc != 0 and ended < 120  # Ray's defaults: 181 s
    assert out.returncode == 0, out.stderr[-3000:]
    assert [e for e in expert_events(camp, "failed") if e.get("counted")] == []
    hist = history(Store(str(camp)))
    assert all(hist[j].state == "finished" and hist[j].failures == 0 for j in EXPERTS)
    assert_bitwise(camp, seeded / "ref")
    raw = [json.loads(line)["id"] for line in (camp / "ledger/ledger.jsonl").read_text().splitlines()]
    assert len(raw) == len(set(raw))


@pytest.fixture(scope="module")
def s3host(hosts):
    """moto_server on a host of its own (S3_IP), with a bucket `soma`."""
    host = hosts.add_host("s3")
    assert host.ip == S3_IP
    server = host.popen(
        moto_server_bin(), "-H", S3_IP, "-p", "5000", stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
    )
    mkdir = (
        "import s3fs, sys\n"
        "fs = s3fs.S3FileSystem(key='test', secret='test', client_kwargs={'endpoint_url': sys.argv[1]})\n"
        "fs.mkdir('soma')"
    )
    env = hosts.hosts["head"].environ(**S3_ENV)
    try:
        wait_for(
            lambda: hosts.hosts["head"].run(sys.executable, "-c", mkdir, S3_ENV["SOMA_S3_ENDPOINT"], env=env,
                                            capture_output=True, timeout=60).returncode == 0,
            60, "the S3 server",
        )  # fmt: skip
        yield host
    finally:
        server.kill()
        server.wait(timeout=10)


def inspect_on_s3(c: Cluster, url: str, ref: Path) -> dict:
    """Read the campaign at `url` on the head's host (only it reaches S3): the experts whose final checkpoint is
    not bitwise the reference's, the failed events' (cause, counted, job), each expert's counted failures, state
    and the addresses its attempts started on, the training forwards billed, and whether each ledger record is
    there once."""
    code = (
        "import json, sys, torch\n"
        "from pipelines.common import open_store\n"
        "from soma_cluster.checkpoint import load_checkpoint\n"
        "from soma_cluster.events import history\n"
        "from soma_cluster.ledger import Ledger\n"
        "from soma_cluster.storage import Store\n"
        "s, r = open_store(sys.argv[1]), Store(sys.argv[2])\n"
        "differ = []\n"
        f"for job in {EXPERTS!r}:\n"
        "    a, b = (load_checkpoint(x, 'experts/' + job).tensors for x in (s, r))\n"
        "    differ += [job] if a.keys() != b.keys() or not all(torch.equal(a[k], b[k]) for k in a) else []\n"
        "h = history(s)\n"
        f"jobs = {EXPERTS!r}\n"
        "failed = [[e.get('cause'), e.get('counted'), e['job']] for j in jobs for e in h[j].events"
        " if e['event'] == 'failed']\n"
        "ids = [rec['id'] for rec in Ledger(s).records()]\n"
        "print(json.dumps({'differ': differ, 'failed': failed, 'failures': {j: h[j].failures for j in jobs},"
        " 'started_on': {j: [e.get('node_ip') for e in h[j].events if e['event'] == 'started'] for j in jobs},"
        " 'states': {j: str(h[j].state.value) for j in jobs}, 'ids_once': len(ids) == len(set(ids)),"
        " 'forwards': Ledger(s).totals().forwards['expert_training']}))\n"
    )
    out = c.hosts["head"].run(sys.executable, "-c", code, url, str(ref), env=c.hosts["head"].environ(**S3_ENV),
                              capture_output=True, text=True, timeout=120, cwd=REPO)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("victim,block_s", [("w1", 40.0), ("head", 20.0)], ids=["worker", "driver"])
def test_storage_unreachable_from_one_host(cluster, s3host, seeded, text_corpus, victim, block_s):
    """The campaign on S3 (a server on a host of its own); mid-launch one host loses its route to it for up to
    `block_s`. A worker: the expert there fails with `storage_unreachable`, not counted, and is retried (on either
    worker) until it runs. The driver's host (for less than the lease's ttl): its writes wait the outage out. Either
    way the campaign finishes bitwise equal to the unfaulted run on a filesystem, nothing counted."""
    from soma_cluster.config import to_yaml_text

    cfg_file = seeded / "s3.yaml"
    cfg_file.write_text(to_yaml_text(micro_config(corpus={"source": str(text_corpus)}, **SECTIONS)))
    url = f"s3://soma/{victim}"
    out = soma_on(cluster, "head", "prepare", url, "--config", str(cfg_file), address=False, **S3_ENV)
    assert out.returncode == 0, out.stderr[-3000:]
    out = soma_on(cluster, "head", "seed", url, **S3_ENV)
    assert out.returncode == 0, out.stderr[-3000:]
    log = seeded / f"s3-{victim}-driver.log"
    with open(log, "w") as fh:
        driver = cluster.hosts["head"].popen(
            sys.executable, "-m", "pipelines.cli", "launch", url, "--address", cluster.address, "--no-progress",
            stdout=fh, stderr=subprocess.STDOUT, cwd=REPO, env=cluster.hosts["head"].environ(**S3_ENV),
        )  # fmt: skip
    try:
        # the events file is on S3, out of this host's reach: the driver's log says where the launch is. A worker
        # is cut as the experts launch ("launching 2 experts"), before one there could have finished; the driver
        # once its loop runs (its first "[soma ...]" line): an outage past SOMA_S3_TIMEOUT_S before that, in the
        # launch's preparations, is waited out too (docs/scheduling.md, tests/test_s3_preparations.py)
        mark = "[soma " if victim == "head" else "launching"
        wait_for(lambda: mark in log.read_text() or driver.poll() is not None, 300, "the launch")
        cut_at = time.monotonic()
        cluster.block(victim, "s3")
        while driver.poll() is None and time.monotonic() - cut_at < block_s:  # bounded
            time.sleep(0.5)
        cluster.clear(victim)
        blocked = time.monotonic() - cut_at
        rc = driver.wait(timeout=900)
        print(f"\nS3 unreachable from {victim} for {blocked:.1f} s; launch exit {rc}")
    finally:
        if driver.poll() is None:
            driver.kill()
        cluster.clear(victim)
    assert rc == 0, log.read_text()[-3000:]
    seen = inspect_on_s3(cluster, url, seeded / "ref")
    print(seen)
    assert seen["differ"] == [] and seen["ids_once"]
    assert set(seen["states"].values()) == {"finished"} and set(seen["failures"].values()) == {0}
    assert all(cause == "storage_unreachable" and not counted for cause, counted, _ in seen["failed"])
    assert seen["failed"] or victim == "head"
    assert seen["forwards"] == Ledger(Store(str(seeded / "ref"))).totals().forwards["expert_training"]


@pytest.mark.slow
def test_lossy_links_during_prepare_on_ray_data(cluster, tmp_path, text_corpus):
    """`soma prepare --address` (Ray Data on the cluster's CPUs) while both workers drop 10% of their packets each
    way: it finishes, and its router, shards and test windows are file for file the local engine's."""
    from test_prepare_ray import campaign_digests, engine_config

    from soma_cluster.config import to_yaml_text

    part_bytes = sum(f.stat().st_size for f in text_corpus.iterdir()) // 6  # several parts, so several nodes read
    local = Store(str(tmp_path / "prep-local"))
    prepare(local, engine_config(str(text_corpus), "local", part_bytes))
    cfg_file = tmp_path / "prep-ray.yaml"
    cfg_file.write_text(to_yaml_text(engine_config(str(text_corpus), "ray", part_bytes)))
    for w in ("w1", "w2"):
        cluster.lossy(w, 10)
    try:
        t0 = time.monotonic()
        out = cluster.hosts["head"].run(
            sys.executable, "-m", "pipelines.cli", "prepare", str(tmp_path / "prep-ray"), "--config", str(cfg_file),
            "--address", cluster.address, capture_output=True, text=True, timeout=600, cwd=REPO,
        )  # fmt: skip
        took = time.monotonic() - t0
    finally:
        for w in ("w1", "w2"):
            cluster.clear(w)
    assert out.returncode == 0, out.stderr[-3000:]
    read = [ln for ln in out.stderr.splitlines() + out.stdout.splitlines() if ln.startswith("read ") and " on " in ln]
    print(f"\nprepare on Ray Data over lossy links: {took:.1f} s; {read}")
    a, b = campaign_digests(local), campaign_digests(Store(str(tmp_path / "prep-ray")))
    assert a == b and len(a) > 5
