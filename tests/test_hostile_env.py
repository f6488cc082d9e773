"""The hostile-environment matrix: every command of the CLI (read from the CLI itself) x every disk condition.

Each cell copies one micro campaign (the session's `trained_campaign`) into a place that has the
condition, runs the command there and asserts: the exit code; for a refused cell exactly one `error:` line that
names the condition, no traceback and no file of the place changed (a tree hash before/after); for a sample of
refused cells, the same command succeeding once the condition is lifted. Conditions live in CONDITIONS (add a
"second driver" there); commands in COMMANDS, which must name every command the CLI has.

Needs root for the mounts (tmpfs, read-only bind); skipped with the reason where mounting is refused.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import pytest
import typer.main
import yaml
from conftest import MICRO, assert_one_line_error, fill_up

ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled", "COLUMNS": "200"}


def run(
    *args: str, env: dict | None = None, timeout: int = 300, drop: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    """The CLI in a subprocess; `drop`: prefixes of variables left out of this process's environment."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(drop)} if drop else dict(os.environ)
    return subprocess.run(
        [sys.executable, "-m", "pipelines.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**base, **ENV, **(env or {})},
    )


def micro_sets() -> list[str]:
    """MICRO as --set overrides (demo and experiment take no --config)."""
    out = []
    for key, value in MICRO.items():
        if key == "name":
            continue
        items = value.items() if isinstance(value, dict) else [(None, value)]
        for sub, v in items:
            out += ["--set", f"{key}.{sub}={v}" if sub else f"{key}={v}"]
    return out


# -- mounts ---------------------------------------------------------------------------------------------------
def _mount(*args: str) -> None:
    proc = subprocess.run(["mount", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"mount {' '.join(args)} refused ({proc.stderr.strip()[:120]}): the disk columns need root")


def _umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)


def tree_hash(root: Path) -> str:
    """Every path and file content under root (the filler included)."""
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in sorted(os.walk(root)):
        dirnames.sort()
        h.update(os.path.relpath(dirpath, root).encode() + b"\0")
        for name in sorted(filenames):
            path = Path(dirpath) / name
            h.update(name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()


# -- the world every cell copies from -------------------------------------------------------------------------
@dataclass
class World:
    root: Path
    config: Path  # MICRO as YAML
    camp: Path  # prepared, seeded, launched
    experiment: Path  # an experiment directory with results.json (for report)


@pytest.fixture(scope="module")
def world(tmp_path_factory, trained_campaign) -> World:
    """The session's trained micro campaign (prepared, seeded and launched by the CLI in its own processes; cells
    copy it), MICRO as a config file for the commands that prepare, and an experiment directory."""
    root = tmp_path_factory.mktemp("hostile")
    config = root / "micro.yaml"
    config.write_text(yaml.safe_dump(MICRO))
    return World(root, config, trained_campaign, _experiment_dir(root / "exp"))


def _experiment_dir(path: Path) -> Path:
    """A variance experiment's results.json, measured here on the fixed separable objective (a second or so):
    what `soma report` re-renders."""
    from pipelines.report import write_report
    from soma_cluster.experimentspecs import load_spec
    from soma_cluster.storage import Store
    from soma_cluster.variance import separable_ratio

    spec = load_spec("variance")
    fixed = [separable_ratio(256, n, 200, probe, 0).as_dict() for probe in ("rademacher", "ternary") for n in (2, 4)]
    res = {
        "experiment": spec.name,
        "title": spec.title,
        "question": spec.question,
        "kind": spec.kind,
        "scale": "small",
        "overrides": [],
        "reference": spec.reference,
        "seeds": {"0": {"fixed": fixed, "fixed_seconds": 0.0}},
        "expect": [e.model_dump() for e in spec.expect],
        "wall_seconds": 0.0,
    }
    store = Store(str(path))
    store.write_json("results.json", res)
    write_report(store, res)
    return path


# -- places: where a cell's campaign lives, under one condition -----------------------------------------------
@dataclass
class Place:
    dir: Path  # holds camp/ and exp/ (copies); new campaigns go to dir/new
    env: dict = field(default_factory=dict)
    fix: Callable[[], None] = lambda: None  # lifts the condition
    refuses_writes: bool = False  # writing commands must be refused (one line, exit 2)
    refuses_drivers: bool = False  # commands that take the campaign's driver lease must be refused
    needle: str = ""  # what the refusal says

    @property
    def camp(self) -> str:
        return str(self.dir / "camp")

    @property
    def new(self) -> str:
        return str(self.dir / "new")

    @property
    def exp(self) -> str:
        return str(self.dir / "exp")


def _populate(world: World, target: Path) -> None:
    shutil.copytree(world.camp, target / "camp", symlinks=True)
    shutil.copytree(world.experiment, target / "exp", symlinks=True)


@contextmanager
def separate_fs(world: World, cell: Path) -> Iterator[Place]:
    """The campaign on a tmpfs of its own: another filesystem than the temp dir's (issue 27's EXDEV)."""
    mnt = cell / "mnt"
    mnt.mkdir(parents=True)
    _mount("-t", "tmpfs", "-o", "size=96m", "tmpfs", str(mnt))
    try:
        _populate(world, mnt)
        yield Place(mnt)
    finally:
        _umount(mnt)


@contextmanager
def full_disk(world: World, cell: Path) -> Iterator[Place]:
    """The campaign's filesystem full (a tmpfs just larger than the copies, then filled up)."""
    mnt = cell / "mnt"
    mnt.mkdir(parents=True)
    _mount("-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mnt))
    try:
        _populate(world, mnt)
        fill_up(mnt)
        yield Place(mnt, fix=lambda: os.unlink(mnt / "filler"), refuses_writes=True, needle="no space left")
    finally:
        _umount(mnt)


@contextmanager
def read_only(world: World, cell: Path) -> Iterator[Place]:
    """The campaign on a read-only bind mount (a campaign shared read-only, a snapshot)."""
    src, mnt = cell / "src", cell / "mnt"
    src.mkdir(parents=True)
    mnt.mkdir()
    _populate(world, src)
    _mount("--bind", str(src), str(mnt))
    try:
        _mount("-o", "remount,bind,ro", str(mnt))
        yield Place(mnt, fix=lambda: _mount("-o", "remount,bind,rw", str(mnt)), refuses_writes=True, needle="read-only")
    finally:
        _umount(mnt)


@contextmanager
def full_tmp(world: World, cell: Path) -> Iterator[Place]:
    """TMPDIR on a full tmpfs: a local campaign needs no temp space (it stages in itself), so everything works."""
    tmp, home = cell / "tmp", cell / "home"
    tmp.mkdir(parents=True)
    home.mkdir()
    _mount("-t", "tmpfs", "-o", "size=1m", "tmpfs", str(tmp))
    try:
        fill_up(tmp)
        _populate(world, home)
        yield Place(home, env={"TMPDIR": str(tmp)})
    finally:
        _umount(tmp)


HOLDER = """
import sys, time
from soma_cluster.lease import Lease
from soma_cluster.storage import Store, storage_options_from_env
for url in sys.argv[1:]:
    Lease(Store(url, storage_options_from_env(url)), "soma launch (another operator)", ttl_s=3600.0).acquire()
print("held", flush=True)
time.sleep(900)
"""


def hold_elsewhere(*urls: str) -> subprocess.Popen:
    """Another live driver (its own process) holding the leases of `urls`; a long ttl, so it renews none while a cell
    runs and the tree hash holds."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, *urls], stdout=subprocess.PIPE, text=True, env={**os.environ, **ENV}
    )
    if proc.stdout.readline().strip() != "held":
        proc.kill()
        raise AssertionError("the holder process did not take the leases")
    return proc


@contextmanager
def second_driver(world: World, cell: Path) -> Iterator[Place]:
    """Another driver holds the campaign (and the new campaign's directory): a second shell, a job system retrying.
    Lifted by killing it (a holder gone from this host is taken over at once)."""
    home = cell / "home"
    home.mkdir(parents=True)
    _populate(world, home)
    holder = hold_elsewhere(str(home / "camp"), str(home / "new"))

    def fix() -> None:
        holder.kill()
        holder.wait(30)

    try:
        yield Place(home, fix=fix, refuses_drivers=True, needle="another driver")
    finally:
        holder.kill()
        holder.wait(30)


CONDITIONS: dict[str, Callable[[World, Path], contextmanager]] = {
    "separate_fs": separate_fs,
    "full_disk": full_disk,
    "read_only": read_only,
    "full_tmp": full_tmp,
    "second_driver": second_driver,
}


# -- the commands ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Invocation:
    args: Callable[[Place, World], list[str]]
    writes: bool  # a command that writes is refused where writes are (reading ones run)
    slow: bool = False  # a successful run takes minutes here: only with SOMA_SLOW=1
    drives: bool = False  # takes the campaign's driver lease: refused while another driver holds it


COMMANDS: dict[str, Invocation] = {
    "prepare": Invocation(lambda p, w: ["prepare", p.new, "--config", str(w.config)], True, drives=True),
    "seed": Invocation(lambda p, w: ["seed", p.camp, "--no-progress"], True, drives=True),
    "launch": Invocation(lambda p, w: ["launch", p.camp, "--no-progress"], True, drives=True),
    "resume": Invocation(lambda p, w: ["resume", p.camp, "--no-progress"], True, drives=True),
    "eval": Invocation(lambda p, w: ["eval", p.camp], True),
    "status": Invocation(lambda p, w: ["status", p.camp], False),
    "plan": Invocation(lambda p, w: ["plan", p.camp, "--gpus", "2"], True),
    "demo": Invocation(lambda p, w: ["demo", p.new, *micro_sets()], True, drives=True),
    "fork": Invocation(
        lambda p, w: ["fork", p.camp, p.new, "--set", "train.method=bptt", "--set", "train.updates=6"],
        True,
        drives=True,
    ),
    "experiment": Invocation(
        lambda p, w: ["experiment", "variance", p.new, "--no-progress", *micro_sets()], True, slow=True
    ),
    "report": Invocation(lambda p, w: ["report", p.exp], True),
    # a TensorBoard backfill into the campaign (its tensorboard/ directory): writes, under the campaign's lease
    "track": Invocation(lambda p, w: ["track", p.camp, "--backend", "tensorboard"], True, drives=True),
    "presets": Invocation(lambda p, w: ["presets"], False),
    # the trained ensemble used (docs/inference.md): reading it writes nothing; an export writes a new directory
    "score": Invocation(lambda p, w: ["score", p.camp, str(w.config)], False),
    "sample": Invocation(lambda p, w: ["sample", p.camp, "--prompt", "ab", "--max-bytes", "5", "--json"], False),
    # the new directory is refused where another driver holds its lease (it may be preparing a campaign there)
    "export": Invocation(lambda p, w: ["export", p.camp, p.new], True, drives=True),
    # two campaigns' ensembles on the same windows, paired (here the campaign with itself): reads, writes nothing
    "compare": Invocation(lambda p, w: ["compare", p.camp, p.camp, "--json"], False),
    # serving reads the ensemble once; the dry run checks it and prints the Serve config without starting Ray
    # (tests/test_serve.py serves for real)
    "serve": Invocation(lambda p, w: ["serve", p.camp, "--dry-run"], False),
    # a revision of the config: written beside a running driver (it applies it), so no lease is taken
    "set": Invocation(lambda p, w: ["set", p.camp, "budget.campaign_gpu_hours=5"], True),
}
# refused cells rerun once their condition is lifted (cheap commands; prepare is the real end to end)
FIX_SAMPLE = {("prepare", "full_disk"), ("report", "full_disk"), ("fork", "read_only"), ("fork", "second_driver")}
# Successful runs that cost the most and add least to the file's 4-minute budget, run with SOMA_SLOW=1: a demo is
# a whole campaign (~40 s loaded; its prepare is prepare's, run for real on the tmpfs); seed/resume start a Ray
# (~15 s loaded) to find nothing to do, as launch (kept in both columns) does
SLOW_CELLS = {
    ("demo", "separate_fs"),
    ("demo", "full_tmp"),
    ("seed", "separate_fs"),
    ("seed", "full_tmp"),
    ("resume", "separate_fs"),
    ("resume", "full_tmp"),
    ("eval", "second_driver"),
    ("plan", "second_driver"),
    # the trained ensemble's commands where nothing is refused: another filesystem and a full TMPDIR change nothing
    # for them (tests/test_export.py runs them on tmpfs mounts, full and empty, with the CLI in process)
    ("score", "separate_fs"),
    ("score", "full_tmp"),
    ("sample", "separate_fs"),
    ("sample", "full_tmp"),
    ("export", "full_tmp"),
    ("set", "full_tmp"),
    ("compare", "separate_fs"),
    ("compare", "full_tmp"),
}


def cli_commands() -> set[str]:
    import pipelines.cli

    return set(typer.main.get_command(pipelines.cli.app).commands)


def test_every_cli_command_has_an_entry():
    assert cli_commands() == set(COMMANDS), "add the new command to COMMANDS (how to invoke it, whether it writes)"


def in_the_short_matrix(command: str, condition: str, commands: list[str]) -> bool:
    """make test runs half the matrix, as a checkerboard over the sorted commands and CONDITIONS: each command meets
    either {separate_fs, read_only, second_driver} or {full_disk, full_tmp}, so every command that writes is refused
    once (read_only or full_disk) and succeeds once (separate_fs or full_tmp), and every condition meets half the
    commands. The refusals are one check per condition shared by the commands (Store.check_writable, the lease);
    the other half, about 100 s on 2 cores, runs with SOMA_SLOW=1. FIX_SAMPLE's cells always run."""
    square = commands.index(command) + list(CONDITIONS).index(condition)
    return square % 2 == 0 or (command, condition) in FIX_SAMPLE


def _cells():
    commands = sorted(cli_commands())
    for command in commands:
        for condition in CONDITIONS:
            marks = []
            inv = COMMANDS.get(command)
            if inv is not None and (
                (inv.slow and condition in ("separate_fs", "full_tmp", "second_driver"))
                or (command, condition) in SLOW_CELLS
                or not in_the_short_matrix(command, condition, commands)
            ):
                marks.append(pytest.mark.slow)
            yield pytest.param(command, condition, marks=marks, id=f"{command}-{condition}")


def check_cell(world: World, tmp_path: Path, command: str, condition: str) -> None:
    """One cell: the command run under the condition, in a place of its own under tmp_path."""
    inv = COMMANDS[command]
    with CONDITIONS[condition](world, tmp_path) as place:
        args = inv.args(place, world)
        before = tree_hash(place.dir)
        proc = run(*args, env=place.env, timeout=600)
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
        if (inv.writes and place.refuses_writes) or (inv.drives and place.refuses_drivers):
            assert_one_line_error(proc, place.needle, str(place.dir))
            assert tree_hash(place.dir) == before, "a refused command changed the campaign"
            assert place.refuses_drivers or not os.path.exists(place.new), "a refused command left a half-made campaign"
            if (command, condition) in FIX_SAMPLE:
                place.fix()
                again = run(*args, env=place.env, timeout=600)
                assert again.returncode == 0, again.stderr[-3000:]
        else:
            assert proc.returncode == 0, proc.stderr[-3000:]
            staged = [str(p) for p in place.dir.rglob(".*") if p.name.startswith((".soma-", ".tmp-"))]
            assert not staged, f"staging left behind: {staged}"
            if not inv.writes:
                assert tree_hash(place.dir) == before, "a reading command wrote"


@pytest.fixture(scope="module")
def matrix(world, tmp_path_factory, request) -> dict[tuple[str, str], BaseException | None]:
    """Every selected cell, run ahead two at a time: a cell is mostly a process start and a command's imports, and its
    place (mounts, holder process, files) is its own. What each one raised (an assertion, pytest.skip where mounting
    is refused), for its test to raise."""
    cells = [
        (item.callspec.params["command"], item.callspec.params["condition"])
        for item in request.session.items
        if item.module is request.module and item.originalname == "test_cell" and not item.get_closest_marker("skip")
    ]
    root = tmp_path_factory.mktemp("cells")

    def one(cell: tuple[str, str]) -> BaseException | None:
        try:
            check_cell(world, root / "-".join(cell), *cell)
        except BaseException as exc:  # noqa: BLE001 (handed to the cell's test, which raises it)
            return exc
        return None

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(cells, pool.map(one, cells), strict=True))


@pytest.mark.parametrize("command,condition", list(_cells()))
def test_cell(matrix, command, condition):
    if (raised := matrix[(command, condition)]) is not None:
        raise raised


# -- the S3 store: the temp dir is where its uploads start ----------------------------------------------------
def test_s3_campaign_with_a_full_temp_dir(world, tmp_path, s3):  # noqa: F811
    """prepare to s3:// stages its uploads in the temp dir: a full one is refused before any data is read and
    the prefix stays empty; once TMPDIR has room it prepares, and status reads it with the temp dir full again.
    A missing TMPDIR is named. (The shard cache's fallback: tests/test_diskerrors.py.)"""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    _mount("-t", "tmpfs", "-o", "size=1m", "tmpfs", str(tmp))
    env = {**s3.env(), "TMPDIR": str(tmp)}
    camp = s3.url("hostile/camp")

    def s3run(*args, **kw):
        return run(*args, env={**env, **kw}, drop=("AWS_", "SOMA_S3_"))

    try:
        fill_up(tmp)
        refused = s3run("prepare", camp, "--config", str(world.config))
        assert_one_line_error(refused, str(tmp), "no space left", "TMPDIR")
        assert "Traceback" not in refused.stderr and not s3.objects("hostile/camp")
        roomy = tmp_path / "roomy"
        roomy.mkdir()
        proc = s3run("prepare", camp, "--config", str(world.config), TMPDIR=str(roomy))  # fixed: TMPDIR with room
        assert proc.returncode == 0, proc.stderr[-3000:]
        proc = s3run("status", camp)
        assert proc.returncode == 0 and "expert-0001" in proc.stdout and "Traceback" not in proc.stderr, proc.stderr[
            -3000:
        ]
        missing = s3run(
            "prepare", s3.url("hostile/other"), "--config", str(world.config), TMPDIR=str(tmp_path / "absent")
        )
        assert_one_line_error(missing, str(tmp_path / "absent"), "TMPDIR")
        assert not s3.objects("hostile/other")
    finally:
        _umount(tmp)


def test_s3_campaign_held_by_another_driver(world, s3):  # noqa: F811
    """On S3 the lease is a conditional PUT: a second driver of an s3:// campaign is refused before Ray starts or
    anything is written, and takes over once the holder is gone."""
    camp = s3.url("hostile/held")
    s3.fs().pipe_file(f"{s3.bucket}/hostile/held/campaign.yaml", (world.camp / "campaign.yaml").read_bytes())
    env = s3.env()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, camp], stdout=subprocess.PIPE, text=True, env={**os.environ, **ENV, **env}
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        before = s3.objects("hostile/held")
        for command in ("launch", "seed", "resume"):
            proc = run(command, camp, "--no-progress", env=env, drop=("AWS_", "SOMA_S3_"))
            assert_one_line_error(proc, "another driver", f"pid {holder.pid}")
            assert "Traceback" not in proc.stderr
        assert s3.objects("hostile/held") == before
    finally:
        holder.kill()
        holder.wait(30)


from support.s3server import s3  # noqa: E402,F401  (fixture)
