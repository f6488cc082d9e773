"""Real hosts on one machine: a Ray head and worker "hosts", each in a network namespace of its own, on a bridge
that lives in a namespace of its own too. Private addresses (10.77.0.0/24), no default route, no NAT:
nothing in here can reach, or be reached from, any address outside these namespaces.

Each host has its own network stack (`eth0`, `lo`, its own ports), so Ray's fixed ports do not clash and a link
can be cut or degraded like a real one. The filesystem is shared: a campaign under /tmp is visible from every
host (a partition that also cuts storage needs an S3 server in a namespace of its own: `Cluster.add_host`).

Everything is started by `ip netns exec` and stopped by pid (`ip netns pids NS`), never with Ray's own stop
command. Needs root, iproute2 (`ip`, `tc`) and, for loss, nftables (`nft`); `missing()` says what is absent, and
`make netns` installs it where it can.

Fault helpers: `partition(host)` / `heal(host)` (link down / up), `lossy(host, percent)` (nftables `numgen random`
drops, both ways), `slow(host, rate)` (a tc tbf bandwidth cap), `clear(host)`, `restart(host)` (every process in
the host killed, Ray started again: a new node).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

SUBNET = "10.77.0"
GCS_PORT = 6379
PREFIX = "somat"  # every namespace this module makes is named somat-<owner pid>-<tag>-<host>
REPO = str(Path(__file__).resolve().parents[2])
RAY = str(Path(sys.executable).with_name("ray"))
START_TIMEOUT_S = 120.0  # `ray start` takes 10-20 s per node on a loaded 2-core host; three at once longer

# Ray's health checks, set on the head: a partitioned node's checks time out, so it is declared dead after about
# threshold * (period + timeout). Ray's defaults (3000 ms, 10000 ms, 5) gave 64 s; these (4 * 2.5 s) 9.2-9.8 s.
# docs/scheduling.md says what an operator should set and what it costs in false deaths.
FAST_HEALTH_CHECK = {
    "RAY_health_check_initial_delay_ms": "1000",
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "1500",
    "RAY_health_check_failure_threshold": "4",
}


def missing() -> str | None:
    """Why this machine cannot run the namespaces (a skip reason), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc", "nft"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (make netns installs iproute2 and nftables)"
    probe = f"{PREFIX}-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()[:200]}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def sh(*argv: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip()[:500]}")
    return proc


def ns_pids(ns: str) -> list[int]:
    out = sh("ip", "netns", "pids", ns, check=False).stdout.split()
    return [int(p) for p in out if p.isdigit()]


def kill_ns(ns: str, timeout: float = 10.0) -> None:
    """SIGKILL every process in `ns` (ours: nothing else runs in a namespace this module made), until none is left."""
    deadline = time.monotonic() + timeout
    while (pids := ns_pids(ns)) and time.monotonic() < deadline:  # bounded in time
        for pid in pids:
            try:
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def sweep_orphans() -> None:
    """Namespaces an earlier test process of this module left behind (it was SIGKILLed before its finally): those
    whose owner pid is gone. Namespaces of a live process, another helper's included, are left alone."""
    for name in sh("ip", "netns", "list", check=False).stdout.split():
        parts = name.split("-")
        if len(parts) >= 4 and parts[0] == PREFIX and parts[1].isdigit() and not Path(f"/proc/{parts[1]}").exists():
            kill_ns(name)
            sh("ip", "netns", "del", name, check=False)


@dataclass
class Host:
    name: str  # head, w1, w2 ... (short: it names the bridge's port)
    ns: str
    ip: str
    tmp: str  # this host's Ray temp dirs: <tmp><n> for its n-th start
    starts: int = 0
    ray_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)

    def run(self, *argv: str, env: dict[str, str] | None = None, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.ns, *argv], env=env or self.environ(), **kw)

    def popen(self, *argv: str, env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", self.ns, *argv], env=env or self.environ(), **kw)

    def environ(self, **extra: str) -> dict[str, str]:
        # none of the suite's RAY_* (conftest's RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 refuses a second node)
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_") and k != "PYTHONPATH"}
        return {
            **env,
            "PYTHONPATH": REPO,  # this checkout's code on every node, not the one the venv was installed from
            "RAY_AUTH_MODE": "disabled",
            "RAY_USAGE_STATS_ENABLED": "0",
            **self.env,
            **extra,
        }


class Cluster:
    """`workers` Ray worker hosts (each `--num-cpus 1 --num-gpus 1`, logical GPUs) around a head (`--num-cpus 1
    --num-gpus 0`), each in its own namespace. Use as a context manager: whatever happens, every process is killed
    and every namespace (with its veths and the bridge) deleted on exit."""

    def __init__(
        self, workers: int = 2, head_env: dict[str, str] | None = None, worker_env: dict[str, str] | None = None
    ):
        tag = uuid.uuid4().hex[:6]
        self.prefix = f"{PREFIX}-{os.getpid()}-{tag}"
        self.root = tempfile.mkdtemp(prefix=f"soma-ns-{tag}-", dir="/tmp")  # short: Ray's socket paths
        self.bridge_ns = f"{self.prefix}-br"
        self.hosts: dict[str, Host] = {}
        self.head_env = {**FAST_HEALTH_CHECK, **(head_env or {})}
        self.n_workers, self.worker_env = workers, dict(worker_env or {})
        self.made: list[str] = []

    @property
    def address(self) -> str:
        return f"{self.hosts['head'].ip}:{GCS_PORT}"

    # -- network ------------------------------------------------------------------------------------------------
    def _make_bridge(self) -> None:
        sh("ip", "netns", "add", self.bridge_ns)
        self.made.append(self.bridge_ns)
        sh("ip", "-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.bridge_ns, "link", "set", "br0", "up")

    def add_host(self, name: str, **host_kw) -> Host:
        """A namespace with `eth0` on the bridge and the next address: a host (Ray's, or a server's)."""
        ip = f"{SUBNET}.{len(self.hosts) + 1}"
        host = Host(name, f"{self.prefix}-{name}", ip, f"{self.root}/{name}", **host_kw)
        sh("ip", "netns", "add", host.ns)
        self.made.append(host.ns)
        port = f"v-{name}"
        sh("ip", "link", "add", "eth0", "netns", host.ns, "type", "veth", "peer", "name", port, "netns", self.bridge_ns)
        sh("ip", "-n", self.bridge_ns, "link", "set", port, "master", "br0", "up")
        sh("ip", "-n", host.ns, "addr", "add", f"{ip}/24", "dev", "eth0")
        sh("ip", "-n", host.ns, "link", "set", "eth0", "up")
        sh("ip", "-n", host.ns, "link", "set", "lo", "up")
        self.hosts[name] = host
        return host

    # -- Ray ----------------------------------------------------------------------------------------------------
    def _ray_start(self, host: Host) -> subprocess.Popen:
        if host.name == "head":
            role = ["--head", f"--port={GCS_PORT}", "--include-dashboard=false", "--num-cpus=1", "--num-gpus=0"]
        else:
            role = [f"--address={self.address}", "--num-cpus=1", "--num-gpus=1"]
        # a fresh temp dir per start: `ray start --head` refuses a temp dir whose last cluster's address it finds
        # in use by any gcs_server on the machine (a killed one not yet reaped counts)
        host.starts += 1
        with open(f"{self.root}/{host.name}-start.log", "a") as log:  # the child keeps its own copy of the fd
            return host.popen(
                RAY, "start", *role, f"--node-ip-address={host.ip}", f"--temp-dir={host.tmp}{host.starts}",
                "--disable-usage-stats", *host.ray_args, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
            )  # fmt: skip

    def _wait_started(self, procs: dict[str, subprocess.Popen]) -> None:
        for name, proc in procs.items():
            try:
                rc = proc.wait(timeout=START_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = "timeout"
            if rc != 0:
                log = Path(f"{self.root}/{name}-start.log").read_text()[-2000:]
                raise RuntimeError(f"ray start on {name} failed ({rc}): {log}")

    def start(self) -> "Cluster":
        sweep_orphans()
        self._make_bridge()
        head = self.add_host("head", env=self.head_env)
        workers = [self.add_host(f"w{i + 1}", env=self.worker_env) for i in range(self.n_workers)]
        self._wait_started({"head": self._ray_start(head)})
        self._wait_started({w.name: self._ray_start(w) for w in workers})  # at once: each start is mostly waiting
        self.wait_nodes(lambda ns: sum(n["alive"] for n in ns) == len(self.ray_hosts()), "every node alive")
        return self

    def nodes(self) -> list[dict]:
        """Every node the GCS knows ({id, ip, alive, head}), asked from the head's namespace."""
        code = (
            "import json; from ray._raylet import GcsClient\n"
            f"c = GcsClient(address={self.address!r})\n"
            "print(json.dumps([{'id': n.node_id.hex(), 'ip': n.node_manager_address, 'alive': n.state == 0,"
            " 'head': n.is_head_node} for n in c.get_all_node_info(timeout=10).values()]))"
        )
        proc = self.hosts["head"].run(sys.executable, "-c", code, capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            raise RuntimeError(f"reading the nodes failed: {proc.stderr[-1000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])

    def wait_nodes(self, pred, what: str, timeout: float = START_TIMEOUT_S) -> list[dict]:
        deadline = time.monotonic() + timeout
        while True:  # bounded in time
            nodes = self.nodes()
            if pred(nodes):
                return nodes
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}: {nodes}")
            time.sleep(1.0)

    def host_at(self, ip: str) -> str | None:
        """The host (name) with address `ip`."""
        return next((h.name for h in self.hosts.values() if h.ip == ip), None)

    def raylet_running(self, name: str) -> bool:
        return any(_comm(pid) == "raylet" for pid in ns_pids(self.hosts[name].ns))

    def restart(self, name: str) -> None:
        """Kill every process on the host, then start Ray on it again: it joins as a new node."""
        host = self.hosts[name]
        kill_ns(host.ns)
        self._wait_started({name: self._ray_start(host)})

    def ensure_healthy(self) -> None:
        """Every link up and clean, and a live Ray node on every Ray host (restarting those without one): a case
        starts from a whole cluster, whatever the case before it left."""
        for name in self.hosts:
            self.heal(name)
            self.clear(name)
        alive = {n["ip"] for n in self.nodes() if n["alive"]}
        for name in [h for h in self.ray_hosts() if self.hosts[h].ip not in alive]:
            self.restart(name)
        self.wait_nodes(lambda ns: sum(n["alive"] for n in ns) == len(self.ray_hosts()), "every node alive")

    def ray_hosts(self) -> list[str]:
        return ["head", *(f"w{i + 1}" for i in range(self.n_workers))]

    # -- faults ---------------------------------------------------------------------------------------------
    def partition(self, name: str) -> None:
        """Cut the host off the network (its link down): its peers see silence, it sees an unreachable network."""
        sh("ip", "-n", self.hosts[name].ns, "link", "set", "eth0", "down")

    def heal(self, name: str) -> None:
        ns = self.hosts[name].ns
        sh("ip", "-n", ns, "link", "set", "eth0", "up")
        sh("ip", "-n", ns, "addr", "replace", f"{self.hosts[name].ip}/24", "dev", "eth0")

    def lossy(self, name: str, percent: int) -> None:
        """Drop `percent`% of the host's packets, each way, at random (nftables numgen; the kernel has no netem)."""
        ns = self.hosts[name].ns
        rules = (
            "table inet soma_loss {\n"
            f" chain in {{ type filter hook input priority 0; numgen random mod 100 < {percent} drop; }}\n"
            f" chain out {{ type filter hook output priority 0; numgen random mod 100 < {percent} drop; }}\n"
            "}\n"
        )
        subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=rules, text=True, check=True)

    def slow(self, name: str, rate: str = "1mbit") -> None:
        """Cap the host's outgoing bandwidth (tc tbf) at `rate`."""
        sh("tc", "-n", self.hosts[name].ns, "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", rate,
           "burst", "32kbit", "latency", "400ms")  # fmt: skip

    def block(self, name: str, peer: str) -> None:
        """Drop every packet between host `name` and host `peer` (both ways, in `name`'s namespace): only that path
        is cut, as when one node loses its route to the storage."""
        rules = (
            "table inet soma_block {\n"
            f" chain in {{ type filter hook input priority 0; ip saddr {self.hosts[peer].ip} drop; }}\n"
            f" chain out {{ type filter hook output priority 0; ip daddr {self.hosts[peer].ip} drop; }}\n"
            "}\n"
        )
        subprocess.run(
            ["ip", "netns", "exec", self.hosts[name].ns, "nft", "-f", "-"], input=rules, text=True, check=True
        )

    def clear(self, name: str) -> None:
        """Undo lossy(), block() and slow()."""
        ns = self.hosts[name].ns
        for table in ("soma_loss", "soma_block"):
            sh("ip", "netns", "exec", ns, "nft", "delete", "table", "inet", table, check=False)
        sh("tc", "-n", ns, "qdisc", "del", "dev", "eth0", "root", check=False)

    # -- teardown -----------------------------------------------------------------------------------------------
    def stop(self) -> None:
        for ns in reversed(self.made):  # every process first (a raylet outlives its GCS otherwise), then the links
            kill_ns(ns)
        for ns in reversed(self.made):
            sh("ip", "netns", "del", ns, check=False)  # deletes its veth ends; the bridge goes with its namespace
        self.made.clear()
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "Cluster":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()
