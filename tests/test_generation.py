"""One GenerationConfig behind every door that takes decoding options: Python (generate, stream), the command line
(soma sample), HTTP (POST /v1/generate's body) and lm-eval (gen_kwargs, model_args) accept and refuse the same
values. The cases are generated from the config's fields and their bounds (each bound, the number just past it,
NaN, infinities, a bool, a string, None, a number of the other kind), not listed by hand: a new field, or a new
bound, is covered as it is added."""

from __future__ import annotations

import inspect
import json
import math

import pytest
from conftest import soma_here

from soma_cluster.errors import SomaError
from soma_cluster.inference.generation import GenerationConfig, bounds, kind, names, optional, resolve
from soma_cluster.inference.lm import RoutedLM
from soma_cluster.inference.serveinput import GenerateRequest, RequestError, ServeSettings, parse_generate

try:
    from soma_cluster.inference import lmeval
except ImportError:  # the lmeval extra is not installed: that door is not tried
    lmeval = None

NOT_SAID = None  # a door that cannot say a value (the command line's None is an option left out)


def values(name: str) -> list:
    """Every case of a field: its bounds and just past them, a middle value, and the values of the wrong kind."""
    lo, lo_open, hi = bounds(name)
    if kind(name) is int:
        lo, hi = int(lo), int(hi)
        out = [lo, hi, (lo + hi) // 2, lo - 1, hi + 1, float(lo), float(hi)]
    else:
        inside = math.nextafter(lo, math.inf) if lo_open else lo
        outside = lo if lo_open else math.nextafter(lo, -math.inf)
        out = [inside, outside, hi, math.nextafter(hi, math.inf), (lo + hi) / 2, int(hi), -hi]
        out += [math.nan, math.inf, -math.inf]
    return out + [True, False, "abc", None]


CASES = [(name, v) for name in names() for v in values(name)]


def accepted_by_the_config(name: str, value) -> bool:
    try:
        resolve(None, {name: value})
    except SomaError:
        return False
    return True


# -- the doors: each returns True (accepted), False (refused) or NOT_SAID ----------------------------------------------
def python_door(lm: RoutedLM, name: str, value) -> bool:
    try:
        lm.stream("x", **{name: value})  # checked now, before the first byte; nothing is drawn here
    except SomaError:
        return False
    return True


def cli_door(name: str, value) -> bool | None:
    if value is None:
        return NOT_SAID
    option = "--" + name.replace("_", "-")
    text = repr(value) if isinstance(value, float) else str(value)
    r = soma_here("sample", "/nonexistent/campaign", f"{option}={text}", "--prompt", "x")
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2 and len(errors) == 1, (option, text, r.stderr)
    return option not in errors[0]  # accepted: the command went on, to refuse the campaign that is not there


def http_door(name: str, value) -> bool:
    limits = ServeSettings(source="x", max_generate_bytes=bounds("max_bytes")[2])  # the server's cap at its widest
    try:
        parse_generate(json.dumps({name: value}).encode(), limits)
    except RequestError:
        return False
    return True


def lmeval_door(name: str, value) -> bool | None:
    if lmeval is None:
        return NOT_SAID
    model_args = name in ("max_bytes", "seed")  # lm-eval's model_args; the rest come in a task's gen_kwargs
    if model_args and value is None and not optional(name):
        return NOT_SAID  # max_bytes=None is max_bytes not given: the task's max_gen_toks then
    try:
        if model_args:
            lmeval.generation_of({"do_sample": True, "temperature": 1.0}, **{name: value})
        else:
            lmeval.generation_of({"do_sample": True, "temperature": 1.0, name: value})
    except SomaError:
        return False
    return True


@pytest.fixture(scope="module")
def lm(trained_campaign) -> RoutedLM:
    return RoutedLM.load(trained_campaign, device="cpu")


@pytest.mark.parametrize("name,value", CASES, ids=[f"{n}={v!r}" for n, v in CASES])
def test_every_door_accepts_and_refuses_the_same_values(lm, name, value):
    want = accepted_by_the_config(name, value)
    doors = {"python": python_door(lm, name, value), "cli": cli_door(name, value), "http": http_door(name, value)}
    doors["lmeval"] = lmeval_door(name, value)
    if lmeval is not None and name in lmeval.OFF_WHEN_ZERO and value == 0 and not isinstance(value, bool):
        assert doors.pop("lmeval") is True  # lm-eval's gen_kwargs speak Hugging Face's words: 0 is "off"
    said = {door: ok for door, ok in doors.items() if ok is not NOT_SAID}
    assert said == dict.fromkeys(said, want), (name, value, want, said)


def test_the_cases_reach_both_sides_of_every_bound():
    for name in names():
        lo, lo_open, hi = bounds(name)
        verdicts = {repr(v): accepted_by_the_config(name, v) for v in values(name)}
        assert True in verdicts.values() and False in verdicts.values(), (name, verdicts)
        assert accepted_by_the_config(name, hi) and not accepted_by_the_config(name, hi + 1)
        assert accepted_by_the_config(name, lo) is not lo_open
        assert accepted_by_the_config(name, None) is optional(name)
        assert not accepted_by_the_config(name, True) and not accepted_by_the_config(name, "1")


def test_the_http_body_and_the_command_line_are_built_from_the_config():
    """The request's decoding fields are the config's (inherited: same defaults and bounds), and soma sample has an
    option per field with the field's default."""
    from pipelines.cli import app

    assert issubclass(GenerateRequest, GenerationConfig)
    schema, request = GenerationConfig.model_json_schema(), GenerateRequest.model_json_schema()
    assert {n: request["properties"][n] for n in names()} == schema["properties"]
    sample = next(c for c in app.registered_commands if c.callback.__name__ == "sample")
    params = inspect.signature(sample.callback).parameters
    for name in names():
        assert params[name].default.default == GenerationConfig.model_fields[name].default, name


def test_generate_refuses_what_stream_refuses_before_any_work(lm):
    for name, value in CASES:
        if not accepted_by_the_config(name, value):
            with pytest.raises(SomaError, match=f"^{name}: "):
                lm.generate(["a", "b"], **{name: value})
    with pytest.raises(SomaError, match="colour: not a generation option"):
        lm.generate("x", colour=1)
    with pytest.raises(TypeError, match="GenerationConfig"):
        lm.generate("x", 12)  # the old positional max_bytes: a config is passed, or keywords


def test_a_config_and_its_overrides_give_the_keywords_bytes(lm):
    cfg = GenerationConfig(max_bytes=24, temperature=0.7, top_k=30, seed=5)
    want = lm.generate("Once", max_bytes=24, temperature=0.7, top_k=30, seed=5)
    assert lm.generate("Once", cfg) == want == b"".join(lm.stream("Once", cfg))
    assert lm.generate("Once", cfg.replace(max_bytes=8)) == lm.generate("Once", cfg, max_bytes=8) == want[:8]
    assert cfg.replace(top_k=None).top_k is None and cfg.top_k == 30  # frozen: replace makes a copy
    with pytest.raises(ValueError):
        GenerationConfig(temperature=0)  # pydantic's own error from the constructor
    assert GenerationConfig.greedy(5) == GenerationConfig(max_bytes=5, top_k=1)


@pytest.mark.skipif(lmeval is None, reason="the lmeval extra is not installed: pip install 'soma-cluster[lmeval]'")
def test_lmeval_model_args_are_refused_before_anything_loads():
    for args in ({"max_bytes": -1}, {"seed": -1}, {"seed": 1.5}, {"max_bytes": True}):
        with pytest.raises(SomaError, match=f"^{next(iter(args))}: "):
            lmeval.SomaLM(pretrained="/nonexistent/campaign", **args)
    until, cfg = lmeval.generation_of({"until": ["\n"], "max_gen_toks": 12, "do_sample": False, "temperature": 5})
    assert until == [b"\n"] and cfg == GenerationConfig(max_bytes=12, top_k=1, seed=lmeval.DEFAULT_SEED)
    _, cfg = lmeval.generation_of({"do_sample": True, "temperature": 0.5, "top_k": 0}, max_bytes=7, seed=None)
    assert cfg == GenerationConfig(max_bytes=7, temperature=0.5, top_k=None, seed=None)
