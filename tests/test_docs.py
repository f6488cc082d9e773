"""The docs cannot drift: docs/config.md is what the config models generate, every relative link in the
Markdown resolves, every `soma` command has its section in docs/cli.md, and nothing names a file a clone lacks."""

import re
import subprocess
from pathlib import Path

import typer

from pipelines.cli import app
from soma_cluster import configdoc
from soma_cluster.config import CampaignConfig

ROOT = Path(__file__).resolve().parents[1]
MARKDOWN = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def test_config_reference_is_generated_from_the_models():
    path = ROOT / "docs" / "config.md"
    assert path.exists() and path.read_text() == configdoc.render(), (
        f"docs/config.md is out of date with soma_cluster/config.py; regenerate it with `{configdoc.COMMAND}`"
    )


def dotted_fields(model=CampaignConfig, prefix: str = "") -> list[str]:
    out = []
    for name, info in model.model_fields.items():
        sub = info.annotation
        if isinstance(sub, type) and issubclass(sub, CampaignConfig.__mro__[1]) and sub is not model:
            out += dotted_fields(sub, f"{prefix}{name}.")
        else:
            out.append(f"{prefix}{name}")
    return out


def test_every_field_is_in_the_reference_with_some_text():
    text = configdoc.render()
    fields = dotted_fields()
    assert len(fields) > 80
    for path in fields:
        row = next((line for line in text.splitlines() if line.startswith(f"| `{path}` |")), None)
        assert row is not None, f"{path} missing from docs/config.md"
        meaning = re.split(r"(?<!\\)\|", row)[-2].strip()  # the last cell (an escaped \| is text)
        assert meaning, f"{path}: no text; give it a comment in config.py"


def test_notes_name_real_fields_and_never_shadow_config_py():
    comments = {}
    for path in dotted_fields():
        section, _, name = path.rpartition(".")
        model = CampaignConfig.model_fields[section].annotation if section else CampaignConfig
        comments[path] = configdoc._comments(model).get(name, "") or model.model_fields[name].description
    stale = sorted(set(configdoc.NOTES) - set(comments))
    assert not stale, f"configdoc.NOTES names fields that do not exist: {stale}"
    shadowed = sorted(k for k in configdoc.NOTES if comments[k])
    assert not shadowed, f"config.py now documents {shadowed}; drop them from configdoc.NOTES"


def test_configdoc_check_mode_tells_stale_from_current(tmp_path, capsys):
    path = tmp_path / "config.md"
    path.write_text("# stale\n")
    assert configdoc.main(["--check", str(path)]) == 1
    assert configdoc.COMMAND in capsys.readouterr().err
    assert configdoc.main([str(path)]) == 0 and configdoc.main(["--check", str(path)]) == 0


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {slug(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def test_every_relative_link_resolves():
    broken = []
    for md in MARKDOWN:
        text = re.sub(r"```.*?```", "", md.read_text(), flags=re.S)
        for match in LINK.finditer(text):
            target = match.group(1) or match.group(2)
            if re.match(r"[a-z]+:", target):
                continue  # http(s):, mailto:
            file, _, anchor = target.partition("#")
            dest = (md.parent / file).resolve() if file else md
            where = f"{md.relative_to(ROOT)}: {target}"
            if not dest.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{where} (no heading #{anchor} in {dest.relative_to(ROOT)})")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_every_cli_command_has_a_section_in_docs_cli():
    text = (ROOT / "docs" / "cli.md").read_text()
    commands = sorted(typer.main.get_command(app).commands)
    missing = [c for c in commands if f"### `soma {c}`" not in text]
    assert not missing, f"docs/cli.md has no '### `soma NAME`' section for {missing}"


def tracked_texts() -> dict[str, str]:
    """Every file git tracks that reads as text (this test file aside: it names what it looks for)."""
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    out = {}
    for name in filter(None, (n.decode() for n in names)):
        path = ROOT / name
        if name == "tests/test_docs.py" or not path.is_file():
            continue
        try:
            out[name] = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # binary
    return out


def test_nothing_names_a_file_a_clone_lacks():
    # every tracked text file: the code's comments and docstrings, the Markdown, the eval report, the CLI's help
    texts = tracked_texts()
    assert "README.md" in texts and "soma_cluster/jobs.py" in texts
    found = [f"{name}: {m}" for name, t in texts.items() for m in re.findall(r"\bSPEC\b|\.\./shared", t)]
    assert not found, found


def test_readme_stays_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 100, f"README.md has {len(lines)} lines; reference belongs in docs/"
    assert "make demo" in "\n".join(lines) and "make test" in "\n".join(lines)


# -- a value the docs give for a name is the code's ----------------------------------------------------------
NAMED_VALUE = re.compile(r"`([A-Za-z_][\w.]*)` \((\d[\d,]*(?:\.\d+)?) ?(ms|s|min|h)?\)")
UNITS = {"": 1.0, "ms": 0.001, "s": 1.0, "min": 60.0, "h": 3600.0}
SOURCES = [*sorted((ROOT / "soma_cluster").glob("*.py")), *sorted((ROOT / "pipelines").glob("*.py"))]


def value_of(name: str) -> float:
    """What the code holds for `name`: an environment variable's default (soma_cluster/envvars.py), a config field's
    default, or a module constant (NAME = ... in soma_cluster/ or pipelines/)."""
    import importlib

    from soma_cluster import schema
    from soma_cluster.envvars import BY_NAME

    if name in BY_NAME:
        return float(BY_NAME[name].default)
    if "." in name:
        field = schema.field_at(CampaignConfig, name)
        assert field is not None, f"{name} is not a setting"
        return float(field.default)
    owners = [p for p in SOURCES if re.search(rf"^{name}\b[^=\n]*=", p.read_text(), flags=re.M)]
    assert len(owners) == 1, f"{name}: defined in {[str(p.relative_to(ROOT)) for p in owners]}"
    module = ".".join(owners[0].relative_to(ROOT).with_suffix("").parts)
    return float(getattr(importlib.import_module(module), name))


def test_every_value_the_docs_give_for_a_name_is_the_code_s():
    """`POLL_S` (0.5 s), `retry.infra_wait_s` (600 s), `SOMA_LEASE_TTL_S` (30 s): a promise stated with the name of
    what bounds it stays true when the code changes that value, or this fails naming both."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for name, number, unit in NAMED_VALUE.findall(path.read_text()):
            if not (name.isupper() or "." in name) or name.endswith((".md", ".py", ".yaml", ".json")):
                continue
            said = float(number.replace(",", "")) * UNITS[unit]
            found.append((path.name, name, said))
            assert abs(value_of(name) - said) <= 1e-9 * max(1.0, said), f"{path.name}: {name} is {value_of(name)}"
    assert {n for _, n, _ in found} >= {"APPLY_BOUND_S", "REVISION_POLL_S", "POLL_S", "PROBE_S", "KILL_WAIT_S"}, found
