"""The config schema as data: every leaf field of the pydantic models by its dotted path, and the values it
allows in words. The CLI's error lines, docs/config.md and the generated input tests read it from here, so a
field added to soma_cluster/config.py is described and tested without more code."""

from __future__ import annotations

import types
import typing
from collections.abc import Iterator
from typing import Any, Literal

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo

_SYMBOLS = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}


def leaves(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, FieldInfo]]:
    """(dotted path, field) of every setting, sections walked depth first in declaration order."""
    for name, info in model.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from leaves(annotation, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", info


def field_at(model: type[BaseModel], path: str) -> FieldInfo | None:
    """The field a dotted path names (None: no such setting)."""
    return dict(leaves(model)).get(path)


def bounds(info: FieldInfo) -> list[tuple[str, Any]]:
    """Numeric bounds as (operator, value), e.g. [('>=', 1), ('<=', 4096)]."""
    found = []
    for meta in info.metadata:
        if isinstance(meta, annotated_types.BaseMetadata):
            for attr, symbol in _SYMBOLS.items():
                value = getattr(meta, attr, None)
                if value is not None:
                    found.append((symbol, value))
    return found


def _kinds(annotation: Any) -> tuple[list[Any], bool]:
    """The annotation's member types and whether null is allowed."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        return [a for a in args if a is not type(None)], type(None) in args
    return [annotation], False


def number(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10_000:
        return f"{value:_}"
    return repr(value)


def allowed(info: FieldInfo) -> str:
    """What a field takes, in words: 'an integer >= 1 and <= 4096', 'one of uniform, softmax', ..."""
    kinds, nullable = _kinds(info.annotation)
    kind = kinds[0]
    if typing.get_origin(kind) is Literal:
        text = "one of " + ", ".join(str(a) for a in typing.get_args(kind))
    elif kind is bool:
        text = "true or false"
    elif kind in (int, float):
        noun = "an integer" if kind is int else "a finite number"
        text = f"{noun} " + " and ".join(f"{op} {number(v)}" for op, v in bounds(info)) if bounds(info) else noun
    elif kind is str:
        text = "a non-empty string" if info.metadata else "a string"
    elif typing.get_origin(kind) is dict:
        text = "a mapping"
    elif typing.get_origin(kind) is list:
        (item,) = typing.get_args(kind)
        members = typing.get_args(item) if typing.get_origin(item) is Literal else ()
        text = f"a list of {', '.join(map(str, members))} (or one name, or names with commas)" if members else "a list"
    else:
        text = getattr(kind, "__name__", str(kind))
    return f"{text}, or null" if nullable else text


def nearest(model: type[BaseModel], path: str) -> str | None:
    """The setting a mistyped dotted path most likely meant (None: nothing close)."""
    import difflib

    paths = [p for p, _ in leaves(model)]
    paths += sorted({p.rsplit(".", 1)[0] for p in paths if "." in p})  # the sections too
    if path.lower() in paths:  # SPSA.n_pert
        return path.lower()
    found = difflib.get_close_matches(path.lower(), paths, n=1, cutoff=0.6)
    return found[0] if found else None
