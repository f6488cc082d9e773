"""docs/config.md, generated from the pydantic models in soma_cluster/config.py so it cannot drift from them.

    python -m soma_cluster.configdoc          # rewrite docs/config.md
    python -m soma_cluster.configdoc --check  # exit 1 if docs/config.md differs (tests/test_docs.py does the same)

A field's text is its `Field(description=...)` when it has one, else the comment beside it or the comment
block just above it in config.py; a section's text is its class docstring. Nothing here needs Ray.
"""

from __future__ import annotations

import inspect
import io
import re
import sys
import tokenize
import types
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from soma_cluster import schema
from soma_cluster.config import CampaignConfig, preset_names, resolve

COMMAND = "python -m soma_cluster.configdoc"
DEFAULT_PATH = Path(__file__).resolve().parents[1] / "docs" / "config.md"

# Text for fields that config.py leaves without a comment or description. tests/test_docs.py checks that every key
# names a real field and that none shadows text config.py now has: move a note into config.py and drop it here.
NOTES = {
    "name": "campaign name, shown in reports, status and metrics (no control characters)",
    "preset": "the preset the config was resolved from (set by `--preset`)",
    "n_experts": "N, the number of experts and shards (`-n`); expert-0000 .. expert-9999 sort as numbers",
    "seed": "the campaign's random seed: test split, router sample, inits, probes, bootstrap (numpy and "
    "scikit-learn take [0, 2^32))",
    "router.max_features": "TF-IDF vocabulary size",
    "router.min_df": "chunks a term must occur in to enter the vocabulary",
    "router.svd_dim": "dimensions the TF-IDF vectors are reduced to (truncated SVD) before clustering",
    "router.temperature": "T of the softmax weighting",
    "router.kmeans_iters": "iterations of the (balanced) spherical k-means",
    "model.head": "shared_frozen: every expert uses the seed model's tied byte embedding (256 x embed_dim), frozen"
    " (needs d == embed_dim); own: every expert trains its own head (wide experts)",
    "shards.seq_bytes": "bytes per packed training sequence",
    "shards.val_fraction": "share of each shard's sequences kept for expert validation",
    "shards.rows_per_file": "rows per Arrow file of a shard",
    "spsa.n_pert": "probes per update (each evaluated at +eps and -eps)",
    "spsa.batch": "training windows per probe evaluation",
    "spsa.accum": "micro-batches whose estimates are averaged into one update",
    "spsa.eps": "perturbation scale of the probes (halved with lr)",
    "spsa.lr": "Adam learning rate (halved after `patience` updates without improvement)",
    "spsa.weight_decay": "L2 term added to the estimated gradient",
    "spsa.beta1": "Adam first-moment decay",
    "spsa.beta2": "Adam second-moment decay",
    "spsa.adam_eps": "Adam denominator epsilon",
    "spsa.floor": "lr below which an expert that stopped improving ends `converged`",
    "eggroll.rank": "r, the rank of each perturbation",
    "eggroll.sigma": "perturbation scale (halves with lr)",
    "bptt.lr": "Adam learning rate",
    "seed_stage.updates": "updates of the seed model (N = 1, whole corpus) that every expert starts from",
    "seed_stage.eps": "the seed stage's SPSA perturbation scale",
    "seed_stage.lr": "the seed stage's learning rate",
    "train.checkpoint_every": "updates between checkpoints (and at the target)",
    "train.val_every": "updates between expert-validation losses",
    "train.val_batches": "batches of `spsa.batch` windows per expert-validation loss",
    "budget.expert_gpu_hours": "cap per expert (null: none); the worker stops before a chunk that would pass it",
    "budget.campaign_gpu_hours": "cap on the whole campaign, seed included (null: none)",
    "retry.backoff_max_s": "cap on a retry's backoff",
    "retry.heartbeat_timeout_s": "a worker silent this long is treated as hung: killed and retried",
    "eval.window_bytes": "bytes per test window (the paper's 1,025: 256 of context, 768 predictions scored)",
    "eval.bootstrap": "resamples of the paired document bootstrap behind every 95% interval",
    "eval.batch": "windows per evaluation pass",
}

_FIELD_LINE = re.compile(r"^    (\w+)\s*:")  # a field of a section class, at one indent


def _comments(cls: type) -> dict[str, str]:
    """Field name -> the comment block above its line plus the comment at its end, read from the class source."""
    source = inspect.getsource(cls)
    trailing: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            trailing[tok.start[0]] = tok.string.lstrip("#").strip()
    out: dict[str, str] = {}
    block: list[str] = []
    for number, line in enumerate(source.splitlines(), start=1):
        stripped = line.strip()
        if stripped.startswith("#"):
            block.append(stripped.lstrip("#").strip())
            continue
        match = _FIELD_LINE.match(line)
        if match:
            parts = [*block, trailing.get(number, "")]
            out[match.group(1)] = " ".join(p for p in parts if p)
        block = []
    return out


def _linked(text: str) -> str:
    """config.py's comments name pages as docs/X.md (read from the repository root); this page lives in docs/."""
    return re.sub(r"\bdocs/([\w-]+\.md)", r"[\1](\1)", text)


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return "string" if all(isinstance(a, str) for a in typing.get_args(annotation)) else "literal"
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in typing.get_args(annotation))
    if origin is dict:
        return "mapping"
    names = {int: "int", float: "float", str: "string", bool: "bool"}
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _allowed(info: FieldInfo) -> str:
    """Enumerated values and numeric bounds, e.g. '`uniform`, `softmax`' or '> 0, < 0.5'."""
    annotation = info.annotation
    if typing.get_origin(annotation) is Literal:
        return ", ".join(f"`{a}`" for a in typing.get_args(annotation))
    symbols = {">=": "≥", "<=": "≤"}
    return ", ".join(f"{symbols.get(op, op)} {_number(value)}" for op, value in schema.bounds(info))


def _number(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if isinstance(value, int) and abs(value) >= 10_000:
        return f"{value:_}"
    return repr(value)


def _default(info: FieldInfo) -> str:
    if info.default_factory is not None:
        value = info.default_factory()
    elif info.default is PydanticUndefined:
        return "required"
    else:
        value = info.default
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, dict):
        return "`{}`" if not value else f"`{value}`"
    return f"`{_number(value)}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _table(rows: list[tuple[str, str, str, str, str]]) -> list[str]:
    out = ["| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
    out += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return out


def _row(path: str, info: FieldInfo, comment: str) -> tuple[str, str, str, str, str]:
    text = info.description or comment or NOTES.get(path, "")
    return (f"`{path}`", _type_name(info.annotation), _default(info), _allowed(info), _linked(text))


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _presets() -> list[str]:
    """One column per preset, one row per key that some preset sets to other than its default."""
    names = preset_names()
    default = _flatten(CampaignConfig().model_dump(mode="json"))
    resolved = {n: _flatten(resolve(n).model_dump(mode="json")) for n in names}
    keys = [k for k in default if k != "preset" and any(resolved[n][k] != default[k] for n in names)]
    out = [
        "## Presets",
        "",
        "A preset is a YAML file in `soma_cluster/presets/` (`soma presets` lists them with their sizes). Every key",
        "a preset sets to other than its default; all other keys keep the defaults above.",
        "",
        "| key | default | " + " | ".join(f"`{n}`" for n in names) + " |",
        "|---|---|" + "---|" * len(names),
    ]
    for key in keys:
        cells = [_scalar(default[key]), *(_scalar(resolved[n][key]) for n in names)]
        out.append(f"| `{key}` | " + " | ".join(cells) + " |")
    return [*out, ""]


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    return _number(value) if isinstance(value, int | float) else str(value)


def render() -> str:
    """The whole of docs/config.md."""
    top = CampaignConfig.model_fields
    sections = {k: f for k, f in top.items() if inspect.isclass(f.annotation) and issubclass(f.annotation, BaseModel)}
    scalars = [(k, f) for k, f in top.items() if k not in sections]
    top_comments = _comments(CampaignConfig)
    out = [
        "# Configuration reference",
        "",
        f"<!-- Generated from soma_cluster/config.py by `{COMMAND}`; do not edit by hand. -->",
        "",
        "A campaign's settings are layered: the defaults below ← a preset (`--preset`, YAML under",
        "`soma_cluster/presets/`) ← a YAML file (`--config FILE.yaml`, same shape as a preset) ← `--set key=value`",
        "overrides, whose key is the dotted path in the first column (`--set spsa.n_pert=16`, values read as YAML",
        "scalars). The resolved config is validated (every bound below; unknown keys are refused), frozen, and",
        "written once to the campaign's `campaign.yaml`, which every later command reads and refuses if edited",
        "([cli.md](cli.md#campaignyaml-is-not-to-be-edited)). Checks across sections (e.g. `spsa.seq_len` ≤",
        "`shards.seq_bytes`, `model.head=shared_frozen` needs `model.d == model.embed_dim`) are in",
        "`CampaignConfig._consistent`.",
        "",
        f"Regenerate this page after changing a model: `{COMMAND}`.",
        "",
        "## Campaign",
        "",
        *_table([_row(k, f, top_comments.get(k, "")) for k, f in scalars]),
        "",
    ]
    for key, info in sections.items():
        cls = info.annotation
        out += [f"## `{key}`", ""]
        doc = inspect.getdoc(cls)
        if doc and cls.__doc__ is not None and "__doc__" in vars(cls):
            out += [_linked(" ".join(doc.split())), ""]
        comments = _comments(cls)
        rows = [_row(f"{key}.{name}", field, comments.get(name, "")) for name, field in cls.model_fields.items()]
        out += [*_table(rows), ""]
    out += _presets()
    return "\n".join(out).rstrip("\n") + "\n"


def main(argv: list[str]) -> int:
    check = "--check" in argv
    paths = [a for a in argv if not a.startswith("-")]
    path = Path(paths[0]) if paths else DEFAULT_PATH
    text = render()
    if check:
        if not path.exists() or path.read_text() != text:
            print(f"{path} is out of date; regenerate it with `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    path.write_text(text)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
