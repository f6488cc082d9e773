"""Every decoding option in one place: `GenerationConfig`, its defaults and its one set of bounds.

    from soma_cluster.inference import GenerationConfig

    cfg = GenerationConfig(temperature=0.8, top_k=40, seed=0)    # the rest at their defaults
    lm.generate("Once upon", cfg)                                # or lm.generate("Once upon", temperature=0.8, ...)
    lm.generate("Once upon", cfg, max_bytes=50)                  # keyword overrides of a config

Every door that takes decoding options is built from it, so they accept and refuse the same values
(tests/test_generation.py checks it, case by case, from the fields below):

- Python: `RoutedLM.generate` and `stream` take a config and keyword overrides (`resolve`);
- the command line: `soma sample`'s `--max-bytes`, `--temperature`, `--top-k`, `--seed` (pipelines/cli_harness.py
  `GenerationOpt`: the option's default, help and bounds are the field's);
- HTTP: `POST /v1/generate`'s body (`serveinput.GenerateRequest` is this model plus the prompt and the encoding);
- lm-eval: a task's `gen_kwargs` and the model_args `max_bytes` and `seed` (`lmeval.generation_of`).

As Hugging Face's GenerationConfig keeps every knob of `generate`, a new knob is a field here, and each door has it.
Imports nothing heavy (no torch): the command line builds its options from it at start.
"""

from __future__ import annotations

import math
import numbers
from typing import Annotated, Any, get_args, get_origin

import annotated_types
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, ValidationInfo

from soma_cluster.errors import SomaError

MAX_BYTES = 10_000_000  # bytes one call may generate (a server caps it lower: ServeSettings.max_generate_bytes)
# a cap on a knob, not on the arithmetic (sampling runs in FP64): at 1000, bytes of any p > 1e-300 are drawn within a
# factor 2 of each other, all but uniform
MAX_TEMPERATURE = 1000.0
HINTS = {"temperature": " (a top_k of 1 samples greedily)", "top_k": ", or none for all bytes", "seed": ", or none"}


def _number(value: Any, info: ValidationInfo) -> Any:
    """A field's value checked against its type and bounds, with one message for every door: whole numbers for int
    fields and real ones for float fields (numpy's too; never a bool or a string, not even '10')."""
    if value is None and optional(info.field_name):
        return None
    lo, lo_open, hi = bounds(info.field_name)
    whole = kind(info.field_name) is int
    kind_ok = isinstance(value, numbers.Integral if whole else numbers.Real) and not isinstance(value, bool)
    number = (int(value) if whole else float(value)) if kind_ok else None
    if number is None or not ((lo < number) if lo_open else (lo <= number)) or not number <= hi:  # NaN fails each
        raise ValueError(refusal(info.field_name, value))
    return number


def refusal(name: str, value: Any) -> str:
    """Why a value of an option is refused, the same words at every door: '0 is not a number > 0 and ...'."""
    return f"{value!r} is not {describe(name)}"


def _checked(kind: type, **bounds_: Any) -> Any:
    return Annotated[kind, BeforeValidator(_number), Field(**bounds_)]


class GenerationConfig(BaseModel):
    """How bytes are drawn after a prompt (soma_cluster/inference/lm.py, "Generation"): p = sum_k w_k
    softmax(logits_k) over the prompt's route, then p^(1/temperature), the top_k likeliest bytes, renormalised, and
    a draw from a generator seeded with `seed`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_bytes: _checked(int, ge=0, le=MAX_BYTES) = Field(256, description="bytes to generate")
    temperature: _checked(float, gt=0, le=MAX_TEMPERATURE) = Field(
        1.0, description="p^(1/temperature): below 1 sharper, above 1 flatter; 1 samples as trained"
    )
    top_k: _checked(int, ge=1, le=256) | None = Field(
        None, description="sample among the k likeliest bytes (1: greedy; none: all 256)"
    )
    seed: _checked(int, ge=0, le=2**63 - 1) | None = Field(
        None, description="the sampling generator's seed: the same seed, the same bytes (none: a fresh one)"
    )

    @classmethod
    def greedy(cls, max_bytes: int = 256) -> GenerationConfig:
        """The likeliest byte at every step (top_k=1, no randomness)."""
        return resolve(None, {"max_bytes": max_bytes, "top_k": 1})

    def replace(self, **overrides: Any) -> GenerationConfig:
        """A copy with `overrides` (each checked, as the constructor checks): SomaError naming a bad one."""
        return resolve(self, overrides)


def resolve(config: GenerationConfig | None, overrides: dict[str, Any]) -> GenerationConfig:
    """`config` (default: GenerationConfig()) with keyword `overrides`, as generate() and stream() take them; one
    SomaError line naming the option and what it accepts, else."""
    if config is not None and not isinstance(config, GenerationConfig):
        raise TypeError(
            f"config must be a GenerationConfig, not {type(config).__name__}; pass options as keywords "
            "(max_bytes=..., temperature=...)"
        )
    unknown = sorted(set(overrides) - set(GenerationConfig.model_fields))
    if unknown:
        raise SomaError(f"{unknown[0]}: not a generation option; the options are {', '.join(names())}")
    values = {**(config.model_dump() if config is not None else {}), **overrides}
    try:
        return GenerationConfig(**values)
    except ValidationError as exc:
        raise SomaError(problem(exc)) from None


def problem(exc: ValidationError) -> str:
    """A GenerationConfig's first complaint as one line naming the option: 'temperature: 0 is not a number > 0 ...'."""
    err = exc.errors()[0]
    name = ".".join(str(p) for p in err["loc"][:1])
    msg = " ".join(str(err["msg"]).split()).removeprefix("Value error, ")
    return f"{name}: {msg}" if name else msg


def names() -> list[str]:
    return list(GenerationConfig.model_fields)


def kind(name: str) -> type:
    """int or float: what a field holds (inside an Optional too)."""
    annotation = GenerationConfig.model_fields[name].annotation
    for a in (annotation, *get_args(annotation)):
        base = get_args(a)[0] if get_origin(a) is Annotated else a
        if base in (int, float):
            return base
    raise TypeError(f"{name}: a generation option is a number")


def optional(name: str) -> bool:
    """Whether a field may be None (it says 'none' is a value: the option left out)."""
    return type(None) in get_args(GenerationConfig.model_fields[name].annotation)


def bounds(name: str) -> tuple[float, bool, float]:
    """(low, whether low itself is refused, high) of a field, read from its Field(ge=, gt=, le=)."""
    lo, lo_open, hi = -math.inf, False, math.inf
    for m in _metadata(name):
        if isinstance(m, annotated_types.Ge):
            lo = m.ge
        elif isinstance(m, annotated_types.Gt):
            lo, lo_open = m.gt, True
        elif isinstance(m, annotated_types.Le):
            hi = m.le
    return lo, lo_open, hi


def _metadata(name: str) -> list:
    """The constraints of a field, inside an Optional too (pydantic keeps those on the union's member)."""
    field = GenerationConfig.model_fields[name]
    found = list(field.metadata)
    for arg in getattr(field.annotation, "__args__", ()):
        found += [m for a in getattr(arg, "__metadata__", ()) for m in (a.metadata if hasattr(a, "metadata") else [a])]
    return found


def describe(name: str) -> str:
    """What a field accepts, in words: 'a number > 0 and at most 1000 (a top_k of 1 samples greedily)'."""
    lo, lo_open, hi = bounds(name)
    whole = kind(name) is int
    fmt = (lambda v: "2**63 - 1" if v == 2**63 - 1 else f"{int(v):,}") if whole else (lambda v: f"{v:g}")
    low = f"> {fmt(lo)}" if lo_open else f">= {fmt(lo)}"
    return f"{'a whole number' if whole else 'a number'} {low} and at most {fmt(hi)}{HINTS.get(name, '')}"
