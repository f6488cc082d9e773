"""Every command on every wrong target, generated from the CLI's command list.

A command's positional arguments that name a directory (campaign, parent, directory, directories) are each given
every kind of wrong target: a missing path, a file, an empty directory, a directory of foreign files, another
command's directory (an experiment's for a campaign command, a campaign's for `soma report`), and a campaign at an
earlier stage than the command needs. Each must be refused with exit 2 and one `error:` line that names the soma
command that would make it right, with nothing written. A command added to pipelines/cli.py is covered by the next
run: its arguments are found by name."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import typing
from pathlib import Path

import pytest
import typer.main
from typer.testing import CliRunner

from pipelines.cli import app
from pipelines.cli_harness import LIST_CHECKS, OPTION_PAIRS, Checked, shown
from soma_cluster.snapshot import fmt_span
from soma_cluster.storage import Store

GROUP = typer.main.get_command(app)
COMMANDS = sorted(GROUP.commands)
DIRECTORY_ARGS = {"campaign", "parent", "directory", "directories", "campaigns"}
# (command, argument) that make a new directory: a missing or empty one is what they want, not a wrong target
MAKES = {
    ("prepare", "campaign"),
    ("demo", "campaign"),
    ("experiment", "directory"),
    ("fork", "campaign"),
    ("export", "directory"),
}
# arguments that are not directories, with a valid value
OTHER_ARGS = {"name": "variance", "changes": "budget.campaign_gpu_hours=2"}
NAMES_A_COMMAND = re.compile(rf"\bsoma ({'|'.join(COMMANDS)})\b")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, micro_yaml) -> Path:
    camp = tmp_path_factory.mktemp("prepared") / "camp"
    result = CliRunner().invoke(app, ["prepare", str(camp), "--config", micro_yaml], env={"RAY_ADDRESS": ""})
    assert result.exit_code == 0, result.stderr[-2000:]
    return camp


def targets(root: Path, prepared: Path) -> dict[str, Path]:
    """Every kind of wrong target, made for real under root."""
    kinds = {
        "missing": root / "missing" / "camp",
        "file": root / "file.txt",
        "empty": root / "empty",
        "foreign": root / "foreign",
        "experiment-dir": root / "experiment",
        "prepared-only": root / "prepared",
        "interrupted-prepare": root / "interrupted",
        "non-utf8-missing": root / b"caf\xe9-missing".decode("utf-8", "surrogateescape"),
    }
    kinds["file"].write_text("not a campaign\n")
    kinds["empty"].mkdir()
    kinds["foreign"].mkdir()
    (kinds["foreign"] / "notes.txt").write_text("someone's files\n")
    exp = Store(str(kinds["experiment-dir"]))
    # another experiment's directory (the variance one is what the table's experiment command would continue)
    exp.write_json("experiment.json", {"experiment": "zo-compare", "scale": "small", "overrides": []})
    (kinds["experiment-dir"] / "s0").mkdir()
    # a campaign soma prepare made, before its seed: too early for launch, eval, fork
    shutil.copytree(prepared, kinds["prepared-only"])
    # a prepare killed before it finished: its config and lease, no shards
    kinds["interrupted-prepare"].mkdir()
    for name in ("campaign.yaml", "driver-lease.json"):
        shutil.copy2(prepared / name, kinds["interrupted-prepare"] / name)
    return kinds


def cases() -> list[tuple[str, str, str]]:
    """(command, argument, target kind) for every directory argument of every command and every wrong kind."""
    out = []
    for name in COMMANDS:
        for param in GROUP.commands[name].params:
            if param.param_type_name != "argument" or param.name not in DIRECTORY_ARGS:
                continue
            for kind in KINDS:
                if (name, param.name) in MAKES and kind in ("missing", "empty", "non-utf8-missing"):
                    continue  # a new directory is what it makes
                if kind == "prepared-only" and not _needs_more_than_prepare(name, param.name):
                    continue
                if kind == "interrupted-prepare" and not _needs_a_finished_prepare(name, param.name):
                    continue
                out.append((name, param.name, kind))
    return out


KINDS = (
    "missing",
    "file",
    "empty",
    "foreign",
    "experiment-dir",
    "prepared-only",
    "interrupted-prepare",
    "non-utf8-missing",
)


def _needs_a_finished_prepare(command: str, argument: str) -> bool:
    """Commands that need the shards (`soma seed`), or more: an interrupted prepare is refused, naming the command."""
    return (command, argument) == ("seed", "campaign") or _needs_more_than_prepare(command, argument)


def _needs_more_than_prepare(command: str, argument: str) -> bool:
    """Commands whose target must be further along than `soma prepare` leaves it (or something else entirely)."""
    return (command, argument) in {
        ("launch", "campaign"),
        ("resume", "campaign"),
        ("eval", "campaign"),
        ("fork", "parent"),
        ("report", "directories"),
        ("experiment", "directory"),
        ("demo", "campaign"),  # a different campaign's directory (demo's preset is not this config)
        ("score", "campaign"),  # the trained ensemble: a seed at least
        ("sample", "campaign"),
        ("export", "campaign"),
        ("compare", "campaigns"),  # trained ensembles (and two of them)
    }


def argv_for(command: str, argument: str, target: str, good: dict[str, str]) -> list[str]:
    args = []
    for param in GROUP.commands[command].params:
        if param.param_type_name != "argument":
            continue
        if param.name == argument:
            args.append(target)
        elif param.name in DIRECTORY_ARGS:
            args.append(good[param.name])
        elif param.name in OTHER_ARGS:
            args.append(OTHER_ARGS[param.name])
        elif param.required:
            pytest.fail(f"soma {command}: argument {param.name} has no value in this test; add it to OTHER_ARGS")
    return [command, *args]


def snapshot(root: Path) -> dict[str, tuple]:
    """Every file's and directory's kind, modification time (ns) and bytes under root, root included: a refusal
    leaves all of it as it was (a lease taken and released, or a directory made and removed, changes it)."""
    out = {".": ("dir", root.stat().st_mtime_ns, None)}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            data = p.read_bytes() if p.is_file() and not p.is_symlink() else None
            out[str(p.relative_to(root))] = ("dir" if p.is_dir() else "file", st.st_mtime_ns, data)
    return out


def changed(before: dict, after: dict) -> list[str]:
    """The paths whose kind, time or bytes differ (or that came or went)."""
    return sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))


CASES = cases()


def test_the_table_covers_every_command_with_a_directory_argument():
    covered = {c for c, _, _ in CASES}
    with_dirs = {
        n
        for n in COMMANDS
        if any(p.name in DIRECTORY_ARGS for p in GROUP.commands[n].params if p.param_type_name == "argument")
    }
    assert covered == with_dirs and len(CASES) >= 50, (covered, with_dirs, len(CASES))


@pytest.fixture(scope="module")
def wrong(tmp_path_factory, prepared) -> tuple[Path, dict[str, Path]]:
    """The wrong targets, made once: every case must leave them as they are (each checks it did)."""
    root = tmp_path_factory.mktemp("targets")
    return root, targets(root, prepared)


@pytest.mark.parametrize("command,argument,kind", CASES, ids=[f"{c}:{a}={k}" for c, a, k in CASES])
def test_wrong_target_names_the_command_that_makes_it_right(command, argument, kind, wrong):
    tmp_path, kinds = wrong
    fresh = tmp_path / "fresh" / "new"
    # the other directory arguments get a valid value: a new path for the one a command makes, else the campaign
    good = {"campaign": str(fresh), "parent": str(kinds["prepared-only"]), "directory": str(fresh)}
    argv = argv_for(command, argument, str(kinds[kind]), good)
    before = snapshot(tmp_path)
    result = CliRunner().invoke(app, argv, env={"COLUMNS": "300", "RAY_ADDRESS": ""})
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.exit_code == 2 and len(errors) == 1, (argv, result.stderr[-1500:], result.exception)
    assert NAMES_A_COMMAND.search(errors[0]), errors[0]
    assert not changed(before, snapshot(tmp_path)), (argv, changed(before, snapshot(tmp_path)))


def test_a_non_utf8_target_is_named_in_a_real_process(tmp_path):
    """In a real process stdout is strict UTF-8: a name that is not must still come out as one readable line."""
    bad = tmp_path / b"caf\xe9".decode("utf-8", "surrogateescape")
    bad.mkdir()
    for argv in (["status", str(bad)], ["eval", str(bad), "--json"], ["report", str(bad)]):
        proc = subprocess.run(
            [sys.executable, "-m", "pipelines.cli", *argv], capture_output=True, timeout=120, env=_env()
        )
        err = proc.stderr.decode("utf-8", "replace")
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert proc.returncode == 2 and len(lines) == 1, (argv, err[-1500:])
        assert "caf" in lines[0] and "Traceback" not in err, lines[0]


def _env() -> dict[str, str]:
    import os

    return {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled", "RAY_ADDRESS": ""}


def numeric_options() -> list[tuple[str, str, type, bool]]:
    """(command, --option, int or float, whether 0 is allowed) for every numeric option of every command, from the
    type hints and the option's bounds."""
    found = []
    for name in COMMANDS:
        command = GROUP.commands[name]
        hints = typing.get_type_hints(command.callback)
        for param in command.params:
            kind = next(
                (k for k in typing.get_args(hints[param.name]) or (hints[param.name],) if k in (int, float)), None
            )
            if param.param_type_name == "option" and kind is not None:
                zero_ok = getattr(param, "min", None) == 0 and not getattr(param, "min_open", False)
                found.append((name, max(param.opts, key=len), kind, zero_ok))
    return found


OPTION_CASES = [
    (command, option, value)
    for command, option, kind, zero_ok in numeric_options()
    for value in ["nan", "inf", "-inf", "-1", "abc", "", "1e400"]
    + (["1.5"] if kind is int else [] if zero_ok else ["0"])
]


def test_every_numeric_option_is_in_the_table():
    assert {(c, o) for c, o, _, _ in numeric_options()} >= {
        ("status", "--count"),
        ("eval", "--stride"),
        ("plan", "--gpus"),
    }


@pytest.mark.parametrize("command,option,value", OPTION_CASES, ids=[f"{c}{o}={v}" for c, o, v in OPTION_CASES])
def test_bad_option_value_is_one_line_naming_the_option(command, option, value, tmp_path):
    argv = argv_for(command, "", str(tmp_path / "camp"), {k: str(tmp_path / k) for k in DIRECTORY_ARGS})
    result = CliRunner().invoke(app, [*argv, f"{option}={value}"], env={"COLUMNS": "300", "RAY_ADDRESS": ""})
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.exit_code == 2 and len(errors) == 1, (argv, value, result.stderr[-1500:], result.exception)
    assert option in errors[0] and "Traceback" not in result.stderr, errors[0]
    assert not any(tmp_path.iterdir()), argv  # refused before anything was made


def list_options() -> list[tuple[str, str, object]]:
    """(command, --option, its checker) for every option of every command that takes a comma list: those whose
    callback is one of cli_harness.LIST_CHECKS (typer wraps a callback: the checker is its __wrapped__)."""
    return [
        (name, max(p.opts, key=len), check)
        for name in COMMANDS
        for p in GROUP.commands[name].params
        if p.param_type_name == "option" and (check := getattr(p.callback, "__wrapped__", None)) in LIST_CHECKS
    ]


LIST_CASES = [(command, option, value) for command, option, check in list_options() for value in LIST_CHECKS[check]]


def test_every_list_option_is_in_the_table():
    assert {(c, o) for c, o, _ in list_options()} >= {("status", "--state"), ("status", "--expert")}


@pytest.mark.parametrize("command,option,value", LIST_CASES, ids=[f"{c}{o}={v}" for c, o, v in LIST_CASES])
def test_bad_list_value_is_one_line_naming_the_option(command, option, value, tmp_path):
    """A comma list with a word that is no state, no expert, a range backwards: refused before anything is read."""
    argv = argv_for(command, "", str(tmp_path / "camp"), {k: str(tmp_path / k) for k in DIRECTORY_ARGS})
    result = CliRunner().invoke(app, [*argv, f"{option}={value}"], env={"COLUMNS": "300", "RAY_ADDRESS": ""})
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.exit_code == 2 and len(errors) == 1, (argv, value, result.stderr[-1500:], result.exception)
    assert option in errors[0] and "e.g." in errors[0] and "Traceback" not in result.stderr, errors[0]
    assert not any(tmp_path.iterdir()), argv


@pytest.mark.parametrize(
    "redirect,code,line",
    [
        (">/dev/full", 2, "error: cannot write to standard output"),
        (">&-", 2, "error: standard output is closed"),
        ("| head -c 0", 141, None),  # a reader gone: as SIGPIPE would end the command, and silently
    ],
    ids=["full-disk", "closed", "reader-gone"],
)
def test_stdout_that_cannot_be_written_is_not_a_silent_success(redirect, code, line, prepared):
    """Data goes to stdout: where it cannot go, the exit code says so (and a traceback never does)."""
    cmd = f"{sys.executable} -m pipelines.cli status {prepared} --json {redirect}; echo rc=${{PIPESTATUS[0]}} >&2"
    if not redirect.startswith("|"):
        cmd = f"{sys.executable} -m pipelines.cli status {prepared} --json {redirect}; echo rc=$? >&2"
    proc = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120, env=_env())
    assert f"rc={code}" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-1500:]
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert errors == [] if line is None else len(errors) == 1 and errors[0].startswith(line), proc.stderr


def test_commands_refuse_a_target_inside_another_and_check_every_directory_first(tmp_path, prepared):
    runner = CliRunner()
    child = runner.invoke(app, ["fork", str(prepared), str(prepared / "shards" / "child")], env={"RAY_ADDRESS": ""})
    assert child.exit_code == 2 and "outside its parent" in child.stderr, child.stderr
    # soma report: a bad directory after a good one is found before the good one's report is rewritten
    good = Store(str(tmp_path / "good"))
    good.write_json("experiment.json", {"experiment": "summed", "scale": "small", "overrides": []})
    bad = tmp_path / "bad"
    bad.mkdir()
    before = snapshot(tmp_path)
    result = runner.invoke(app, ["report", str(tmp_path / "good"), str(bad)], env={"RAY_ADDRESS": ""})
    assert result.exit_code == 2 and "results.json" in result.stderr and snapshot(tmp_path) == before
    result = runner.invoke(app, ["report", str(tmp_path / "good"), "--readme", str(tmp_path / "no.md")])
    assert result.exit_code == 2 and "--readme" in result.stderr and snapshot(tmp_path) == before


# -- inputs that only make sense together, or not at all ----------------------------------------------------------
SAMPLE = {"text": "DOCS", "compare": "OTHER", "corpus": "CORPUS", "experts": "3"}  # any value: refused before use


def _given(command: str, name: str) -> list[str]:
    """How the user gives one input of an OptionPair: a flag, an option with a value, an argument, a --set item."""
    if name.startswith("set:"):
        return ["--set", f"{name[4:]}=4"]
    param = next(p for p in GROUP.commands[command].params if p.name == name)
    if param.param_type_name == "argument":
        return [SAMPLE.get(name, "x")]
    opt = max(param.opts, key=len)
    return [opt] if param.is_flag else [opt, SAMPLE.get(name, "2")]


PAIR_CASES = [(p.command, p.option, p.other, p.needs) for p in OPTION_PAIRS]


def test_every_command_checks_its_inputs_and_every_pair_names_real_inputs():
    assert all(isinstance(GROUP.commands[c], Checked) for c in COMMANDS), COMMANDS
    for command, option, other, _ in PAIR_CASES:
        _given(command, option), _given(command, other)  # raises StopIteration for a name the command lacks
    assert {(c, o) for c, o, _, _ in PAIR_CASES} >= {("eval", "stride"), ("status", "wait"), ("eval", "compare")}


@pytest.mark.parametrize("command,option,other,needs", PAIR_CASES, ids=[f"{c}:{o}+{x}" for c, o, x, _ in PAIR_CASES])
def test_an_input_without_its_partner_or_with_its_contradiction_is_one_line(command, option, other, needs, tmp_path):
    """needs: the option alone is refused naming both, and with its partner passes the check; contradicts: both
    together are refused naming both, and either alone passes it. Refused before anything is read or written."""
    argv = argv_for(command, "", str(tmp_path / "camp"), {k: str(tmp_path / k) for k in DIRECTORY_ARGS})
    bad = _given(command, option) + ([] if needs else _given(command, other))
    result = CliRunner().invoke(app, [*argv, *bad], env={"COLUMNS": "300", "RAY_ADDRESS": ""})
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.exit_code == 2 and len(errors) == 1, (bad, result.stderr[-1500:], result.exception)
    word = "has no effect without" if needs else "contradict"
    a, b = (shown(GROUP.commands[command], n) for n in (option, other))
    assert word in errors[0] and a in errors[0] and b in errors[0], errors[0]
    assert not any(tmp_path.iterdir()), bad
    # the check lets the right use through (a file as every directory stops the command right after it)
    (tmp_path / "file").write_text("not a directory\n")
    argv = argv_for(command, "", str(tmp_path / "file"), {k: str(tmp_path / "file") for k in DIRECTORY_ARGS})
    good = _given(command, option) + (_given(command, other) if needs else [])
    result = CliRunner().invoke(app, [*argv, *good], env={"COLUMNS": "300", "RAY_ADDRESS": ""})
    assert result.exit_code == 2 and word not in result.stderr and "is a file" in result.stderr, result.stderr


SECTION_SETS = [
    (p.command, p.option, p.other[4:]) for p in OPTION_PAIRS if p.other.startswith("set:") and "." in p.other
]


@pytest.mark.parametrize("command,option,key", SECTION_SETS, ids=[f"{c}:{o}+{k}" for c, o, k in SECTION_SETS])
def test_a_contradiction_through_the_setting_s_section_is_refused_too(command, option, key, tmp_path):
    """`--corpus A --set 'corpus={source: B}'` sets corpus.source twice as surely as `--set corpus.source=B`:
    refused naming both, not decided silently for one of them."""
    section, field = key.split(".", 1)
    argv = argv_for(command, "", str(tmp_path / "camp"), {k: str(tmp_path / k) for k in DIRECTORY_ARGS})
    bad = _given(command, option) + ["--set", f"{section}={{{field}: 4}}"]
    result = CliRunner().invoke(app, [*argv, *bad], env={"COLUMNS": "300", "RAY_ADDRESS": ""})
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.exit_code == 2 and len(errors) == 1 and "contradict" in errors[0], (bad, result.stderr[-1500:])
    assert not any(tmp_path.iterdir()), bad


def single_value_options() -> list[tuple[str, str]]:
    return [
        (name, max(p.opts, key=len))
        for name in COMMANDS
        for p in GROUP.commands[name].params
        if p.param_type_name == "option" and not (p.multiple or p.is_flag or p.count)
    ]


@pytest.mark.parametrize("command,option", single_value_options(), ids=[f"{c}{o}" for c, o in single_value_options()])
def test_a_single_value_option_given_twice_is_one_line(command, option, tmp_path):
    """click keeps the last silently: `--config a.yaml --config b.yaml` would drop a.yaml without a word."""
    argv = argv_for(command, "", str(tmp_path / "camp"), {k: str(tmp_path / k) for k in DIRECTORY_ARGS})
    result = CliRunner().invoke(app, [*argv, option, "1", f"{option}=1"], env={"COLUMNS": "300", "RAY_ADDRESS": ""})
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.exit_code == 2 and len(errors) == 1, (command, option, result.stderr[-1500:])
    assert option in errors[0] and "given 2 times" in errors[0], errors[0]
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("command,option", single_value_options(), ids=[f"{c}{o}" for c, o in single_value_options()])
def test_help_is_given_whatever_else_the_line_holds(command, option, tmp_path):
    """`soma prepare X -n 2 -n 3 --help`: the user asked how the command is used; an error that says to run
    --help would not answer."""
    argv = argv_for(command, "", str(tmp_path / "camp"), {k: str(tmp_path / k) for k in DIRECTORY_ARGS})
    result = CliRunner().invoke(app, [*argv, option, "1", f"{option}=1", "--help"], env={"COLUMNS": "300"})
    assert result.exit_code == 0 and "Usage:" in result.stdout and option in result.stdout, result.stderr[-500:]
    assert not any(tmp_path.iterdir())


def test_plan_wait_without_a_cluster_is_refused(prepared, tmp_path):
    camp = tmp_path / "camp"
    shutil.copytree(prepared, camp)
    result = CliRunner().invoke(app, ["plan", str(camp), "--wait", "5"], env={"COLUMNS": "300", "RAY_ADDRESS": ""})
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.exit_code == 2 and len(errors) == 1 and "--wait 5 has no effect without a Ray cluster" in errors[0]
    assert not (camp / "plan").exists(), result.stderr


def test_watch_wait_is_shown_in_human_units(tmp_path):
    """A week's --wait reads '7 d', not 604800 s (the watch of a campaign not prepared yet says it at once)."""
    assert [fmt_span(s) for s in (0.5, 45, 90, 300, 7500, 86_370, 90_000, 604_800)] == [
        "0.5 s", "45 s", "1 min 30 s", "5 min", "2 h 5 min", "1 d", "1 d 1 h", "7 d"
    ]  # fmt: skip
    argv = [sys.executable, "-m", "pipelines.cli", "status", str(tmp_path / "c"), "--watch", "--wait", "604800"]
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, env=_env())
    timer = threading.Timer(60, proc.kill)  # bounded: the line comes after the imports, in seconds
    timer.start()
    try:
        line = proc.stderr.readline()
    finally:
        timer.cancel()
        proc.kill()
        proc.wait(timeout=30)
        proc.stderr.close()
    assert "is not prepared yet; waiting up to 7 d for it" in line, line
