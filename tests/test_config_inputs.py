"""Every setting with every bad value of its type, generated from the config schema and the CLI's command list.

Nothing here names a field: the table is built by walking the pydantic models (soma_cluster/schema.py), so a
field added to soma_cluster/config.py is covered by the next run. Each case goes through the real CLI (typer's
runner: the same entry point as `soma`, without a new interpreter per case) and must be refused before anything
is read or written: exit 2, one `error:` line naming the field and what it takes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import typing
from pathlib import Path

import pytest
import typer.main
import yaml
from typer.testing import CliRunner

from pipelines.cli import app
from soma_cluster import schema
from soma_cluster.config import CampaignConfig, parse_overrides, resolve, set_dotted, to_yaml_text
from soma_cluster.configinput import STDIN_LABEL, read_config
from soma_cluster.errors import SomaError

LEAVES = list(schema.leaves(CampaignConfig))
WRONG_TYPES = ["[1, 2]", "{a: 1}"]  # a list and a mapping, as YAML writes them after --set KEY=


def _below(op: str, bound, kind) -> object:
    if op == ">":
        return bound
    if kind is int:
        return bound - 1
    return bound - max(abs(bound) / 2, 1e-3) if bound > 0 else bound - 1.0


def _above(op: str, bound, kind) -> object:
    if op == "<":
        return bound
    return bound + 1 if kind is int else bound * 2 + 1.0


def bad_values(info) -> list[tuple[str, str]]:
    """(label, the text after --set KEY=) for one field: out of range both ways, NaN and infinities, a fraction for
    an integer, a bool for a number, empty and wrong types, an unknown enum member."""
    kinds, _ = schema._kinds(info.annotation)
    kind = kinds[0]
    cases: list[tuple[str, str]] = [(f"type-{i}", v) for i, v in enumerate(WRONG_TYPES)]
    if kind in (int, float):
        for op, bound in schema.bounds(info):
            value = _below(op, bound, kind) if op in (">", ">=") else _above(op, bound, kind)
            cases.append((f"outside-{op}{bound}", repr(value) if kind is float else str(value)))
        cases += [("nan", ".nan"), ("inf", ".inf"), ("-inf", "-.inf"), ("1e400", "1e400"), ("bool", "true")]
        cases += [("empty", "''"), ("word", "abc"), ("huge", str(10**30))]
        if kind is int:
            cases += [("fraction", "1.5")]
    elif typing.get_origin(kind) is typing.Literal:
        cases += [("unknown-member", "no-such-choice"), ("empty", "''"), ("number", "7")]
    elif kind is bool:
        cases += [("word", "maybe"), ("number", "2")]
    elif kind is str:
        cases += [("empty", "''"), ("blank", "'   '"), ("number", "7")]
    elif typing.get_origin(kind) is dict:
        cases = [("list", "[1, 2]"), ("word", "abc"), ("number", "7")]
    return cases


CASES = [(path, label, value) for path, info in LEAVES for label, value in bad_values(info)]


def test_every_number_is_bounded_both_ways_and_every_string_is_non_empty():
    """What makes 'negative', 'zero' and 'huge' refusable for each field is its declared range: one per field."""
    loose = []
    for path, info in LEAVES:
        kind = schema._kinds(info.annotation)[0][0]
        ops = {op for op, _ in schema.bounds(info)}
        if kind in (int, float) and not (ops & {">", ">="} and ops & {"<", "<="}):
            loose.append(path)
        if kind is str and not info.metadata:
            loose.append(path)
    assert not loose, f"settings without a declared range: {loose}"
    assert len(CASES) >= 8 * len(LEAVES), len(CASES)


def test_the_range_edges_are_accepted():
    """Each bound itself (where inclusive) is a valid setting: the range refuses only what is outside it."""
    for path, info in LEAVES:
        for op, bound in schema.bounds(info):
            if op in (">=", "<="):
                try:
                    resolve("tiny", _tree(path, bound))
                except SomaError as exc:  # only a rule spanning fields may refuse an edge, naming the other field
                    assert path.split(".")[-1] in str(exc) and f"set {path} to" not in str(exc), (path, bound, exc)


def _tree(path: str, value) -> dict:
    """{section: {field: value}} for a dotted path, as --set builds it."""
    tree: dict = {}
    set_dotted(tree, path, value)
    return tree


def set_commands() -> dict[str, list[str]]:
    """Every command with a --set option, and the positional arguments it needs besides."""
    group = typer.main.get_command(app)
    found = {}
    for name, command in group.commands.items():
        params = {p.name: p for p in command.params}
        if "set" in params:
            found[name] = [p.name for p in command.params if p.param_type_name == "argument"]
    return found


@pytest.fixture(scope="module")
def parent(tmp_path_factory) -> Path:
    """A campaign directory that `soma fork` can read the config of (nothing else is needed before the refusal)."""
    root = tmp_path_factory.mktemp("parent") / "camp"
    root.mkdir()
    (root / "campaign.yaml").write_text(to_yaml_text(resolve("tiny")))
    return root


def _argv(command: str, case: Path, parent: Path, extra: list[str]) -> list[str]:
    target = str(case / "new")
    positional = {
        "prepare": [target],
        "demo": [target],
        "fork": [str(parent), target],
        "experiment": ["variance", target],
        "resume": [str(parent)],  # --set revises the config of a campaign that exists, checked before anything runs
    }
    return [command, *positional[command], *extra]


def _tree_of(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def refuse(argv: list[str], case: Path, path: str, stdin: bytes | None = None) -> str:
    before = _tree_of(case)
    result = CliRunner().invoke(app, argv, input=stdin, env={"COLUMNS": "300", "RAY_ADDRESS": ""})
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.exit_code == 2 and len(errors) == 1, (argv, result.stderr[-1500:], result.exception)
    assert path in errors[0], (path, errors[0])
    assert _tree_of(case) == before, argv  # nothing written, not even the campaign directory
    return errors[0]


SET_COMMANDS = sorted(set_commands())


def test_every_command_with_set_is_in_the_rotation():
    assert {"prepare", "demo", "fork", "experiment"} <= set(SET_COMMANDS), SET_COMMANDS


@pytest.mark.parametrize("path,label,value", CASES, ids=[f"{p}={lbl}" for p, lbl, _ in CASES])
def test_bad_setting_is_refused_by_every_command_that_takes_set(path, label, value, tmp_path, parent):
    """Through soma prepare, through one more --set command in turn (each sees a quarter of the table: the
    commands share the parsing, so this finds a command that skips it at a quarter of the cost), and, for every
    other case (half of each field's values), in a --config file."""
    line = refuse(_argv("prepare", tmp_path, parent, ["--set", f"{path}={value}"]), tmp_path, path)
    assert f"set {path} to " in line, line  # what the field takes
    other = [c for c in SET_COMMANDS if c != "prepare"][CASES.index((path, label, value)) % (len(SET_COMMANDS) - 1)]
    refuse(_argv(other, tmp_path, parent, ["--set", f"{path}={value}"]), tmp_path, path)
    if CASES.index((path, label, value)) % 2:
        return  # the --config form for every other case: it shares the validation with --set
    cfg = tmp_path.parent / f"{tmp_path.name}.yaml"
    cfg.write_text(yaml.safe_dump(_tree(path, yaml.safe_load(value))))
    refuse(_argv("prepare", tmp_path, parent, ["--config", str(cfg)]), tmp_path, path)


UNKNOWN = [f"{path}x" for path, _ in LEAVES[::7]] + ["nosuchsection.field", "spsa.n_pert.deeper"]


@pytest.mark.parametrize("key", UNKNOWN)
def test_unknown_key_is_refused_with_the_nearest_setting(key, tmp_path, parent):
    line = refuse(_argv("prepare", tmp_path, parent, ["--set", f"{key}=1"]), tmp_path, key.split(".")[0])
    assert "not a setting" in line or "is not a section" in line or "set spsa.n_pert to" in line, line


# a --config file's own malformations (its values are the table above): name -> bytes
CONFIG_FILES = {
    "duplicate-key": b"n_experts: 4\nn_experts: 5\n",
    "not-utf8": b"\xff\xfename: x\n",
    "utf16": "n_experts: 4\n".encode("utf-16"),
    "section-as-list": b"spsa: [1, 2]\n",
    "section-as-scalar": b"router: 5\n",
    "top-level-list": b"- a\n- b\n",
    "top-level-scalar": b"42\n",
    "empty": b"",
    "comments-only": b"# nothing\n",
    "bad-syntax": b"spsa: {n_pert: 4\n",
    "tab-indent": b"spsa:\n\tn_pert: 4\n",
    "binary-tag": b"spsa:\n  lr: !!binary aGVsbG8=\n",
    "python-tag": b"spsa: !!python/object:os.system {}\n",
    "deep-unknown": b"spsa:\n  n_pert:\n    deeper: 1\n",
}
SET_KEYS = ["=5", ".=5", "spsa..lr=1", "spsa.=1", " =1", "spsa", "spsa=5", "corpus=abc", "n_experts.x=1"]


@pytest.mark.parametrize("name", sorted(CONFIG_FILES))
def test_malformed_config_file_is_one_line(name, tmp_path, parent):
    """As a file, and the same bytes on standard input (`--config -`): the same checks, the same one line."""
    cfg = tmp_path.parent / f"{tmp_path.name}-{name}.yaml"
    cfg.write_bytes(CONFIG_FILES[name])
    line = refuse(_argv("prepare", tmp_path, parent, ["--config", str(cfg)]), tmp_path, str(cfg))
    assert "Traceback" not in line
    piped = refuse(_argv("prepare", tmp_path, parent, ["--config", "-"]), tmp_path, STDIN_LABEL, CONFIG_FILES[name])
    assert piped.replace(STDIN_LABEL, "X") == line.replace(f"config file {cfg}", "X"), (piped, line)


@pytest.mark.parametrize("item", SET_KEYS)
def test_malformed_set_item_is_one_line(item, tmp_path, parent):
    line = refuse(_argv("prepare", tmp_path, parent, ["--set", item]), tmp_path, "")
    assert "--set" in line or "override" in line, line


# one setting given by two --set items: only the last would count, as for an option given twice
SET_TWICE = [
    (["n_experts=8", "n_experts=4"], "n_experts"),
    (["spsa.n_pert=2", " spsa.n_pert =2"], "spsa.n_pert"),
    (["spsa.n_pert=2", "spsa={n_pert: 4, batch: 8}"], "spsa.n_pert"),
    (["spsa={lr: 0.1}", "spsa.lr=0.2"], "spsa.lr"),
    (["spsa.n_pert=2", "spsa=5"], "spsa.n_pert"),
]


@pytest.mark.parametrize("items,key", SET_TWICE, ids=[" ".join(i) for i, _ in SET_TWICE])
def test_a_setting_given_by_two_set_items_is_one_line(items, key, tmp_path, parent):
    command = SET_COMMANDS[SET_TWICE.index((items, key)) % len(SET_COMMANDS)]  # the parsing is shared: one each
    argv = _argv(command, tmp_path, parent, [a for item in items for a in ("--set", item)])
    line = refuse(argv, tmp_path, f"--set {key} is given twice")
    assert repr(items[0]) in line and repr(items[1]) in line, line


def test_a_section_s_mapping_and_another_of_its_fields_merge_in_either_order():
    """`spsa.n_pert=2` then `spsa={batch: 8}` used to drop n_pert (the mapping replaced the section)."""
    for items in (["spsa.n_pert=2", "spsa={batch: 8}"], ["spsa={batch: 8}", "spsa.n_pert=2"]):
        cfg = resolve("tiny", parse_overrides(items))
        assert (cfg.spsa.n_pert, cfg.spsa.batch) == (2, 8), items


# --config from a stream, through the real CLI in its own process (a real pipe, FIFO, terminal or closed stdin):
# id -> (a bash line in which {soma} is `python -m pipelines.cli prepare CAMPAIGN`, what the one error line says)
STREAMS = {
    "closed": ("{soma} --config - <&-", ["--config - (standard input): standard input is closed"]),
    "dev-stdin-closed": ("{soma} --config /dev/stdin <&-", ["config file /dev/stdin: standard input is closed"]),
    "empty-pipe": ("printf '' | {soma} --config -", ["--config - (standard input) is empty"]),
    "dev-null": ("{soma} --config - < /dev/null", ["--config - (standard input) is empty"]),
    "bom-crlf": (
        r"printf '\xef\xbb\xbfspsa:\r\n  n_pert: -3\r\n' | {soma} --config -",
        ["--config - (standard input): spsa.n_pert", "got -3"],
    ),
    "nul-byte": (r"printf 'spsa:\n  n_pert: 4\x00\n' | {soma} --config -", ["#x0000", "at line 2, column 12"]),
    "duplicate-key-crlf": (r"printf 'n_experts: 4\r\nn_experts: 5\r\n' | {soma} --config -", ["appears twice"]),
    "bad-syntax-line": (r"printf 'spsa:\n  n_pert: [4\n' | {soma} --config -", ["not valid YAML", "line 3"]),
    "100MB-stream": ("head -c 100000000 /dev/zero | {soma} --config -", ["(standard input) holds over 1,048,576"]),
    "dev-zero": ("{soma} --config /dev/zero", ["config file /dev/zero holds over", "1 MiB"]),
    "with-set": ("printf 'n_experts: 3\\n' | {soma} --config - --set n_experts=0", ["overrides: n_experts"]),
    "dev-stdin-pipe": ("printf 'n_experts: 0\\n' | {soma} --config /dev/stdin", ["config file /dev/stdin: n_experts"]),
    "dev-stdin-file": ("{soma} --config /dev/stdin < {dir}/zero.yaml", ["config file /dev/stdin: n_experts"]),
    "process-substitution": ("{soma} --config <(printf 'n_experts: 0\\n')", ["config file /dev/fd/", "n_experts"]),
    "proc-self-fd": ("{soma} --config /proc/self/fd/7 7< <(printf 'n_experts: 0\\n')", ["/proc/self/fd/7: n_experts"]),
    "fifo-late-writer": (
        "mkfifo {dir}/f; (sleep 1; printf 'n_experts: 0\\n' > {dir}/f) >/dev/null 2>&1 & {soma} --config {dir}/f",
        ["config file {dir}/f: n_experts"],
    ),
    "given-twice": ("printf 'n_experts: 3\\n' | {soma} --config - --config -", ["--config/-c given 2 times"]),
    "file-then-stdin": ("{soma} -c {dir}/zero.yaml --config - < /dev/null", ["--config/-c given 2 times"]),
    "directory": ("{soma} --config {dir}", ["config file {dir} is a directory"]),
    # YAML merge keys (`<<: *anchor`) are YAML's own: merged values are checked, a key beside `<<` overrides its
    # value (no "twice"), and a mapping's own key given twice is still refused
    "merge-key-merged": (r"printf 'spsa:\n  <<: {{n_pert: -3}}\n' | {soma} --config -", ["spsa.n_pert", "got -3"]),
    "merge-key-override": (
        r"printf 'seed_stage: &s {{updates: 6}}\ntrain:\n  <<: *s\n  updates: -3\n' | {soma} --config -",
        ["train.updates", "got -3"],
    ),
    "merge-key-twice": (r"printf 'spsa:\n  <<: {{lr: 1}}\n  batch: 4\n  batch: 5\n' | {soma} --config -", ["twice"]),
    "utf16-pipe": ("printf '\\xff\\xfen\\x00' | {soma} --config -", ["(standard input) is not UTF-8 text (byte 0)"]),
}


def _env() -> dict[str, str]:
    return {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled", "RAY_ADDRESS": ""}


@pytest.mark.parametrize("case", sorted(STREAMS))
def test_config_from_a_stream_is_checked_as_a_file_is(case, tmp_path):
    shell, needles = STREAMS[case]
    (tmp_path / "zero.yaml").write_text("n_experts: 0\n")
    soma = f"{sys.executable} -m pipelines.cli prepare {tmp_path / 'camp'}"
    t0 = time.monotonic()
    proc = subprocess.run(
        ["bash", "-c", shell.format(soma=soma, dir=tmp_path)], capture_output=True, text=True, timeout=120, env=_env()
    )
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1, (case, proc.returncode, proc.stderr[-1500:])
    for needle in needles:
        assert needle.format(dir=tmp_path) in errors[0], (case, errors[0])
    assert "Traceback" not in proc.stderr and not (tmp_path / "camp").exists(), case
    assert time.monotonic() - t0 < 60, case  # a 100 MB stream is cut at the cap, not read to its end


def test_a_terminal_or_a_socket_on_stdin_is_one_line_not_a_hang(tmp_path):
    """`--config -` at an interactive shell would wait for typing forever: refused at once. A socket as stdin (a
    service manager's) is read as a pipe is with `-`; /dev/stdin cannot reopen it and says so."""
    primary, tty = os.openpty()
    try:
        for arg in ("-", "/dev/stdin"):
            argv = [sys.executable, "-m", "pipelines.cli", "prepare", str(tmp_path / "c"), "--config", arg]
            proc = subprocess.run(argv, stdin=tty, capture_output=True, text=True, timeout=60, env=_env())
            errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
            assert proc.returncode == 2 and len(errors) == 1 and "is a terminal" in errors[0], proc.stderr[-1500:]
    finally:
        os.close(primary)
        os.close(tty)
    for arg, needle in (("-", "--config - (standard input): n_experts"), ("/dev/stdin", "is a socket")):
        ours, theirs = socket.socketpair()
        with ours, theirs:
            ours.sendall(b"n_experts: 0\n")
            ours.shutdown(socket.SHUT_WR)
            argv = [sys.executable, "-m", "pipelines.cli", "prepare", str(tmp_path / "c"), "--config", arg]
            proc = subprocess.run(argv, stdin=theirs, capture_output=True, text=True, timeout=60, env=_env())
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode == 2 and len(errors) == 1 and needle in errors[0], (arg, proc.stderr[-1500:])
    assert not (tmp_path / "c").exists()


def test_a_stream_that_gives_nothing_is_refused_after_the_idle_time(tmp_path):
    """A FIFO no writer opens, or a pipe whose writer never writes nor closes: one line after idle_s, no hang."""
    os.mkfifo(tmp_path / "fifo")
    r, w = os.pipe()
    try:
        os.write(w, b"n_experts: 4\n")  # some bytes, then a writer that stays open
        for path in (str(tmp_path / "fifo"), f"/proc/self/fd/{r}"):
            t0 = time.monotonic()
            with pytest.raises(SomaError, match="nothing arrived for 0.3 s") as exc:
                read_config(path, idle_s=0.3)
            assert 0.25 < time.monotonic() - t0 < 10 and path in str(exc.value), exc.value
    finally:
        os.close(r)
        os.close(w)


def test_a_piped_config_is_recorded_as_the_file_would_be(tmp_path, micro_yaml):
    """The campaign records the resolved config (campaign.yaml), whichever way it came: the same bytes as the file
    makes, and the file, a pipe and /dev/stdin each find the campaign already prepared for their config."""
    camp = tmp_path / "camp"
    text = Path(micro_yaml).read_bytes()
    argv = [sys.executable, "-m", "pipelines.cli", "prepare", str(camp)]
    proc = subprocess.run([*argv, "--config", "-"], input=text, capture_output=True, timeout=300, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (camp / "campaign.yaml").read_text() == to_yaml_text(resolve("tiny", None, micro_yaml))
    before = (camp / "campaign.yaml").read_bytes()
    windows = b"\xef\xbb\xbf" + text.replace(b"\n", b"\r\n")  # a BOM and CRLF: the same settings
    for config, stdin in ((micro_yaml, None), ("/dev/stdin", text), ("-", windows)):
        proc = subprocess.run([*argv, "--config", config], input=stdin, capture_output=True, timeout=300, env=_env())
        said = b" ".join(proc.stderr.split())
        assert proc.returncode == 0 and b"already prepared for this config" in said, proc.stderr[-3000:]
    assert (camp / "campaign.yaml").read_bytes() == before
