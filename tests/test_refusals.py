"""A refusal touches nothing, the driver lease included: every command, with every bad value of every option and
argument, against a real trained campaign (the session's `trained`, copied), leaves every file and directory under
the test's root as it was: the same names, bytes and modification times (so a lease taken and released, a
directory made and removed again, or a revision written and then refused all fail).

The bad values are generated: the numeric options' (test_command_targets.OPTION_CASES), the option pairs given
wrongly, a single-value option given twice, and bad_values() below, a table of the values each option and argument
refuses for what they mean (an expert that does not exist, a step with no checkpoint, a corpus that is not there). A
command, option or argument added to pipelines/cli.py without a row there (or a reason in FREE) fails
`test_every_option_and_argument_has_bad_values`. Every case runs in this process (typer's runner): no process
start, no Ray, a few milliseconds each."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from conftest import soma_here
from support.ports import free_port
from test_command_targets import (
    COMMANDS,
    GROUP,
    OPTION_CASES,
    PAIR_CASES,
    _given,
    changed,
    single_value_options,
    snapshot,
)

from pipelines.cli_harness import OPTION_PAIRS

DOCS = Path(__file__).resolve().parent.parent / "docs"

# options and arguments with no value that is wrong on its own, and why
FREE = {
    "--json": "a flag: the output's form",
    "--no-progress": "a flag: the output's form",
    "--take-over": "a flag: waits for a lease that lapses, refuses one renewed (test_driver_lease.py)",
    "--recalibrate": "a flag: times the model again",
    "--require-all": "a flag: on a complete campaign there is nothing to refuse (test_partial.py refuses a partial)",
    "--watch": "a flag; its partners' bad values are OPTION_PAIRS'",
    "--all": "a flag of soma status: how many rows it lists",
    "--lines": "a flag: how the inputs split into documents",
    "--detach": "a flag of soma serve",
    "--dry-run": "a flag of soma serve",
    "--retry-failed": "a flag; the experts it names are resume's EXPERTS (BAD), a seed that did not fail is a no-op",
    "--warm": "a flag; a warm fork that cannot be is refused by its --set (BAD)",
    "--prompt": "any text is a prompt",
    "--host": "any name is tried by Serve itself (docs/serving.md)",
    "--per-byte": "a flag of soma score: what each record lists",
    "--routes": "a flag of soma score: what each record lists",
}


@dataclass(frozen=True)
class Bad:
    """One bad input: `args` replace an argument's value (`param` an argument) or are added (an option); `env` is
    set (None: unset) for the run."""

    command: str
    param: str
    args: tuple[str, ...]
    env: dict = field(default_factory=dict, hash=False, compare=False)

    @property
    def id(self) -> str:
        unset = "".join(f" without {k}" for k, v in self.env.items() if v is None)
        return f"{self.command}:{self.param}={' '.join(self.args)[:40]}{unset}"


# a Ray Client and a dashboard address where nothing listens: soma serve takes both forms and probes them (another
# suite's Ray on this host may hold 10001 or 8265), every other command refuses them by their text
_CLOSED = free_port()
_CUDA = torch.cuda.is_available()
BAD_ADDRESSES = (f"ray://127.0.0.1:{_CLOSED}", "127.0.0.1:99999", f"http://127.0.0.1:{_CLOSED}", "a b:6379")


def bad_values() -> list[Bad]:
    """What each option and argument refuses for what it means; {camp} is the trained campaign, {root} the test's
    root (a missing path under it, e.g.)."""
    rows: dict[tuple[str, str], list[tuple[str, ...]]] = {
        ("prepare", "--preset"): [("--preset", "nope")],
        ("prepare", "--config"): [("--config", "{root}/missing.yaml"), ("--config", "{root}/bad.yaml")],
        ("prepare", "--set"): [("--set", "nope=1"), ("--set", "n_experts=0"), ("--set", "spsa.n_pert=abc")],
        ("prepare", "--corpus"): [
            ("--corpus", ""),
            ("--corpus", "{root}/missing-corpus"),
            ("--corpus", "{root}/empty"),
        ],
        ("prepare", "--experts"): [("--experts", "0"), ("--experts", "-3")],
        ("resume", "experts"): [
            ("--retry-failed", "expert-9999"),
            ("--retry-failed", "abc"),
            ("--retry-failed", "expert-0000"),  # it did not fail
        ],
        ("resume", "--retrain"): [("--retrain", "expert-9999"), ("--retrain", "abc"), ("--retrain", "-1")],
        ("resume", "--from-step"): [
            ("--retrain", "expert-0000", "--from-step", "7"),
            ("--retrain", "0", "--from-step", "999"),
        ],
        ("resume", "--set"): [
            ("--set", "nope=1"),
            ("--set", "n_experts=4"),  # not revisable
            ("--set", "budget.campaign_gpu_hours=-1"),
            ("--retrain", "expert-0000", "--set", "budget.campaign_gpu_hours=0.000000001"),  # already spent
        ],
        ("eval", "--compare"): [("--compare", "{root}/missing"), ("--compare", "{root}/empty")],
        ("eval", "--text"): [("--text", "{root}/missing.txt"), ("--text", "{root}/empty")],
        ("eval", "--stride"): [("--text", "{root}/missing.txt", "--stride", "0")],
        ("compare", "--baseline"): [("--baseline", "{root}/elsewhere")],
        ("status", "--interval"): [("--watch", "--interval", "0")],
        ("status", "--count"): [("--watch", "--count", "-1")],
        ("status", "--wait"): [("--watch", "--wait", "0")],
        ("status", "--state"): [("--state", "bogus"), ("--state", "15-12")],
        ("status", "--expert"): [("--expert", "15-12"), ("--expert", "9999")],  # 9999: past the campaign's experts
        ("plan", "--gpus"): [("--gpus", "0"), ("--gpus", "-2")],
        ("plan", "--wait"): [("--wait", "5")],  # without a cluster
        ("demo", "--preset"): [("--preset", "nope")],
        ("demo", "--set"): [("--set", "nope=1"), ("--set", "n_experts=0")],
        ("fork", "--set"): [
            ("--set", "nope=1"),
            ("--set", "n_experts=5"),  # fixed by the data a fork shares
            ("--warm", "--set", "train.method=bptt"),  # a warm fork keeps its parent's method
        ],
        ("experiment", "name"): [("nope",)],
        ("experiment", "--scale"): [("--scale", "huge")],
        ("experiment", "--set"): [("--set", "nope=1")],
        ("report", "--readme"): [
            ("--readme", "{root}/missing.md"),
            ("--readme", "{root}/empty"),
            ("--readme", "{root}/latin1.md"),
        ],
        ("track", "--backend"): [("--backend", "nope")],  # and mlflow without a tracking URI, below
        ("set", "changes"): [
            ("nope=1",),
            ("n_experts=4",),
            ("budget.campaign_gpu_hours=-1",),
            ("train.updates",),
            ("train.updates=abc",),
        ],
        ("set", "--wait"): [("--wait", "0")],
        ("score", "inputs"): [("{root}/missing.txt",)],
        ("score", "--step"): [("--step", "999")],
        ("score", "--device"): [("--device", "nope"), ("--device", "cuda:99")],
        ("sample", "--prompt-file"): [("--prompt-file", "{root}/missing.txt")],
        ("sample", "--step"): [("--step", "999")],
        ("sample", "--device"): [("--device", "nope")],
        ("export", "--dtype"): [("--dtype", "float8")],
        ("export", "--license"): [("--license", "MIT License"), ("--license", ""), ("--license", "mit\nx: 1")],
        ("serve", "--set"): [
            ("--set", "nope=1"),
            ("--set", "device=cuda"),  # without a GPU per replica
            *([("--set", "device=cuda", "--gpus-per-replica", "1")] if not _CUDA else []),  # a local Ray, no CUDA
            ("--set", "cpus_per_replica=1024"),  # more than a local Ray has: it would wait forever
        ],
        ("serve", "--gpus-per-replica"): [("--gpus-per-replica", "64")],  # the campaign's local Ray has 4
        ("serve", "--step"): [("--step", "999", "--dry-run"), ("--step", "999")],
    }
    for command in ("prepare", "seed", "launch", "resume", "plan", "demo", "experiment", "serve"):
        rows[(command, "--address")] = [("--address", a) for a in BAD_ADDRESSES]
    for command in ("seed", "launch", "resume"):
        rows[(command, "--log-every")] = [("--log-every", "0")]
    out = [Bad(c, p, args) for (c, p), many in rows.items() for args in many]
    return out + [Bad("track", "--backend", ("--backend", "mlflow"), {"MLFLOW_TRACKING_URI": None})]


# numeric options' generic bad values, already checked against a missing directory in test_command_targets.py,
# are run here once each per option (not every value): the campaign they are refused against is a real one
def generic_cases() -> list[Bad]:
    seen, out = set(), []
    for command, option, value in OPTION_CASES:
        if (command, option) not in seen and value in ("nan", "-1"):
            seen.add((command, option))
            out.append(Bad(command, option, (f"{option}={value}",)))
    for p in OPTION_PAIRS:
        bad = _given(p.command, p.option) + ([] if p.needs else _given(p.command, p.other))
        out.append(Bad(p.command, p.option, tuple(bad)))
    for command, option in single_value_options():
        out.append(Bad(command, option, (option, "1", f"{option}=1")))
    return out


CASES = bad_values() + generic_cases()
# refusals that still come too late, each with the issue that moves it earlier
LATE: dict[tuple[str, tuple[str, ...]], str] = {}


def _params(command: str) -> list:
    return [p for p in GROUP.commands[command].params if p.name != "help"]


def _name(p) -> str:
    return p.name if p.param_type_name == "argument" else max(p.opts, key=len)


def test_every_option_and_argument_has_bad_values():
    """A new option (or argument) needs its row in bad_values(), or a reason in FREE: a command's every input is
    refused before anything is written, and this table is where that is checked."""
    covered = {(b.command, b.param) for b in CASES}
    targets = {"campaign", "parent", "directory", "directories", "campaigns"}  # test_command_targets.py's table
    missing = [
        f"soma {c} {_name(p)}"
        for c in COMMANDS
        for p in _params(c)
        if _name(p) not in FREE and p.name not in targets and (c, _name(p)) not in covered
    ]
    assert not missing, f"no bad values for {missing}: add them to bad_values() (or a reason to FREE)"
    assert len(PAIR_CASES) == len(OPTION_PAIRS)


@dataclass(frozen=True)
class Place:
    root: Path
    camp: Path  # a trained campaign whose lease was taken and released (generation 3)
    other: Path  # a second one, for soma compare
    experiment: Path  # an experiment's directory (docs/results/summed), for soma report
    fresh: Path  # a new campaign's path: it must not be made


@pytest.fixture(scope="module")
def place(tmp_path_factory, trained) -> Place:
    root = tmp_path_factory.mktemp("refusals")
    camp, other, exp = root / "camp", root / "other", root / "experiment"
    shutil.copytree(trained.camp, camp, symlinks=True)
    shutil.copytree(trained.camp, other, symlinks=True)
    shutil.copytree(DOCS / "results" / "summed", exp)
    (root / "empty").mkdir()
    (root / "bad.yaml").write_text("spsa: {n_pert: [\n")
    (root / "latin1.md").write_bytes("r\xe9sum\xe9\n".encode("latin-1"))
    (root / "README.md").write_text("# readme\n")
    return Place(root, camp, other, exp, root / "fresh" / "new")


def argv(place: Place, bad: Bad) -> list[str]:
    """The command on good targets (the trained campaign; a new path where the command makes one) with `bad`."""
    good = {
        "campaign": str(place.fresh if bad.command in ("prepare", "demo", "fork") else place.camp),
        "parent": str(place.camp),
        "campaigns": [str(place.camp), str(place.other)],
        "directory": str(place.fresh),
        "directories": str(place.experiment),
        "name": "variance",
        "changes": "budget.campaign_gpu_hours=2",
    }
    fill = {"root": str(place.root), "camp": str(place.camp)}
    extra = [a.format(**fill) for a in bad.args]
    out = [bad.command]
    for p in _params(bad.command):
        if p.param_type_name != "argument":
            continue
        if p.name == bad.param:
            out += extra
            extra = []
        elif p.name in good:
            value = good[p.name]
            out += value if isinstance(value, list) else [value]
    return out + extra


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(b, marks=pytest.mark.xfail(reason=LATE[(b.command, b.args)], strict=True))
        if (b.command, b.args) in LATE
        else b
        for b in CASES
    ],
    ids=[b.id for b in CASES],
)
def test_a_refusal_touches_nothing(bad, place, monkeypatch):
    for key, value in bad.env.items():
        if value is None:
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, value)
    line = argv(place, bad)
    before = snapshot(place.root)
    result = soma_here(*line)
    errors = [x for x in result.stderr.splitlines() if x.startswith("error:")]
    assert result.returncode == 2 and len(errors) == 1, (line, result.returncode, result.stderr[-1500:])
    assert not changed(before, snapshot(place.root)), (line, errors, changed(before, snapshot(place.root)))
