"""Environment variables as inputs, generated from the registry (soma_cluster/envvars.py) as tests/test_config_inputs.py
generates the config's: every variable with every bad value of its kind is one `error:` line naming it; every
variable the docs name is registered; docs/env.md is the registry's table; and a bad value is refused before the
command takes the lease or starts anything."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from conftest import assert_one_line_error, soma

from soma_cluster.envvars import BY_NAME, HEADER, REGISTRY, TEST_ONLY, EnvKind, check_environment, table, value
from soma_cluster.errors import SomaError

ROOT = Path(__file__).resolve().parent.parent
BAD = {
    EnvKind.SECONDS: ["nan", "inf", "-inf", "-1", "", " ", "soon", "1e999", "0x10"],
    EnvKind.SWITCH: ["", "2", "yes", "true", "-1", "nan", " 1"],
    EnvKind.NAMES: ["nosuch", "mlflow,,", "mlflow, wandb"],
    EnvKind.URL: ["", "garbage", "localhost:9000", "ftp://host", "http://"],
    EnvKind.PATH: ["", "   ", "/etc/hostname"],
}


def cells():
    for var in REGISTRY:
        for raw in BAD.get(var.kind, []):
            yield pytest.param(var.name, raw, id=f"{var.name}={raw!r}")
        if var.kind is EnvKind.SECONDS:
            yield pytest.param(var.name, f"{var.low - 1}", id=f"{var.name}=below")
            yield pytest.param(var.name, f"{var.high * 2}", id=f"{var.name}=above")


@pytest.mark.parametrize(("name", "raw"), list(cells()))
def test_every_bad_value_is_one_line_naming_the_variable(name, raw):
    with pytest.raises(SomaError) as err:
        check_environment({name: raw})
    text = str(err.value)
    assert name in text and "\n" not in text, text


@pytest.mark.parametrize("var", REGISTRY, ids=lambda v: v.name)
def test_every_variable_takes_its_default_and_a_good_value(var):
    good = {
        EnvKind.SECONDS: var.default,
        EnvKind.SWITCH: var.default or "1",
        EnvKind.NAMES: ",".join(var.choices),
        EnvKind.URL: "http://127.0.0.1:9000",
        EnvKind.PATH: "/tmp",
        EnvKind.TEXT: "anything",
    }[var.kind]
    check_environment({var.name: good})
    assert value(var.name, {}) is None  # unset: the caller's default


def test_every_variable_the_docs_name_is_registered():
    named = set()
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        named |= set(re.findall(r"\b((?:SOMA|RAY|AWS|MLFLOW|TENSORBOARD)_[A-Z0-9_]+|TMPDIR)\b", path.read_text()))
    missing = sorted(n for n in named - set(BY_NAME) - set(TEST_ONLY))
    assert not missing, f"named in the docs, not in soma_cluster/envvars.py's REGISTRY: {missing}"


def test_docs_env_table_is_the_registry():
    assert (ROOT / "docs" / "env.md").read_text() == HEADER + table(), (
        "docs/env.md is stale: run python -m soma_cluster.envvars"
    )


def test_a_bad_variable_is_refused_before_the_lease_is_taken(trained_campaign, tmp_path):
    """The issue's case: a bad SOMA_TRACKING_BACKENDS was refused 12 s into a launch, after the lease was rewritten."""
    import shutil

    camp = tmp_path / "c"
    shutil.copytree(trained_campaign, camp)
    lease = (camp / "driver-lease.json").read_bytes()
    for env in ({"SOMA_TRACKING_BACKENDS": "wandb"}, {"SOMA_LEASE_TTL_S": "nan"}, {"SOMA_TF32": "yes"}):
        t0 = time.monotonic()
        proc = soma("resume", str(camp), "--no-progress", env=env)
        took = time.monotonic() - t0
        assert_one_line_error(proc, next(iter(env)))
        assert (camp / "driver-lease.json").read_bytes() == lease  # untouched
        print(f"{env}: refused in {took:.1f} s")
