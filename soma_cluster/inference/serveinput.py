"""What `soma serve` accepts, decided without Ray: the application's settings and the HTTP requests' bodies.

The Serve application (pipelines/serve_app.py) validates every request body here before it routes anything, and
answers a bad one with a 4xx whose JSON names the field:

    {"error": "max_bytes: Input should be less than or equal to 4096", "field": "max_bytes"}

400: the body is empty, not UTF-8, not JSON, or JSON but not an object; 413: the body or its documents are over
the limits of ServeSettings; 422: a field is missing, given twice, unknown, of the wrong type, out of range, too
short (a document needs 2 bytes), not base64 under encoding base64, or a lone surrogate that stands for no byte.
Each message says which of these it is. docs/serving.md lists the endpoints.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from enum import IntEnum, StrEnum
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    model_validator,
)

from soma_cluster.errors import SomaError
from soma_cluster.inference.generation import MAX_BYTES, GenerationConfig

APP_NAME = "soma"  # the Serve application's name (serve status, serve delete, a Serve config file)
ROUTE_PREFIX = "/"


class Status(IntEnum):
    """The HTTP statuses the application answers with, besides 200."""

    BAD_JSON = 400
    TOO_LARGE = 413
    INVALID = 422
    UNAVAILABLE = 503  # retry: Retry-After says when (back-pressure, replicas being replaced or updated)


class Encoding(StrEnum):
    UTF8 = "utf-8"  # JSON strings, encoded as UTF-8 (a lone surrogate \\udc80-\\udcff as the byte it escapes)
    BASE64 = "base64"  # any bytes (a byte model reads any), as standard base64


def _path(value: object) -> str:
    """A path as the command line gives it: any str, one that is not UTF-8 (surrogate escapes) included."""
    if not isinstance(value, str):
        raise ValueError(f"a path or URL (a string), not {type(value).__name__}")
    if not value.strip():
        raise ValueError("empty; give a campaign or an export directory (or an s3:// URL)")
    return value


class ServeSettings(BaseModel):
    """The Serve application's settings: `soma serve`'s options, or `args:` of a Serve config file
    (deploy/kuberay/rayservice.yaml). Only `source` is required."""

    model_config = ConfigDict(extra="forbid")

    source: Annotated[str, PlainValidator(_path)]  # a campaign directory or a `soma export`, local or s3://
    step: Annotated[StrictInt, Field(ge=0)] | None = None  # a campaign's checkpoints of this step (default: newest)
    replicas: Annotated[StrictInt, Field(ge=1, le=4096)] = 1  # expert replicas (each holds every expert)
    max_replicas: Annotated[StrictInt, Field(ge=1, le=4096)] | None = None  # set: autoscale replicas..max_replicas
    target_ongoing_requests: Annotated[StrictInt, Field(ge=1, le=1 << 16)] = 16  # per replica, what autoscaling aims at
    router_replicas: Annotated[StrictInt, Field(ge=1, le=4096)] = 1  # HTTP ingress replicas (route requests)
    gpus_per_replica: Annotated[float, Field(ge=0, le=64, allow_inf_nan=False)] = 0.0  # of an expert replica
    cpus_per_replica: Annotated[float, Field(ge=0, le=1024, allow_inf_nan=False)] = 1.0  # of an expert replica
    router_cpus: Annotated[float, Field(ge=0, le=1024, allow_inf_nan=False)] = 0.5  # of a router replica
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: CUDA where the replica has a GPU, else the CPU
    threads: Annotated[StrictInt, Field(ge=1, le=1024)] | None = None  # torch threads of a replica (none: per op)
    stream_interval_s: Annotated[float, Field(ge=0, le=10, allow_inf_nan=False)] = 0.05  # between a stream's pieces
    max_batch_windows: Annotated[StrictInt, Field(ge=1, le=1 << 16)] = 256  # windows in one pass of a replica
    batch_wait_s: Annotated[float, Field(ge=0, le=10, allow_inf_nan=False)] = 0.005  # wait to fill a pass
    max_ongoing_requests: Annotated[StrictInt, Field(ge=1, le=1 << 16)] = 64  # per replica, in progress
    max_queued_requests: Annotated[StrictInt, Field(ge=1, le=1 << 20)] = 256  # per caller, then 503
    retry_after_s: Annotated[StrictInt, Field(ge=1, le=3600)] = 1  # the Retry-After of a 503
    max_request_bytes: Annotated[StrictInt, Field(ge=1024, le=1 << 30)] = 4 << 20  # a body, and its documents
    max_documents: Annotated[StrictInt, Field(ge=1, le=1 << 20)] = 1024  # texts in one score request
    max_generate_bytes: Annotated[StrictInt, Field(ge=1, le=MAX_BYTES)] = 4096  # max_bytes of a generate request

    @model_validator(mode="after")
    def _replicas_in_order(self) -> "ServeSettings":
        if self.max_replicas is not None and self.max_replicas < self.replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) is below replicas ({self.replicas})")
        if self.device == "cuda" and self.gpus_per_replica == 0:  # Ray hides every GPU from an actor that asks none
            raise ValueError("device cuda needs gpus_per_replica above 0 (Ray gives a replica a GPU only if it asks)")
        return self

    def memory_bound_bytes(self) -> int:
        """Request bytes a router replica can hold at once (ongoing and queued bodies): the bound that keeps a
        flood of large requests from exhausting memory; the rest get a 503."""
        return (self.max_ongoing_requests + self.max_queued_requests) * self.max_request_bytes


def settings(args: dict) -> ServeSettings:
    """ServeSettings from a dict (a Serve config's args), or one SomaError line naming the field."""
    if not isinstance(args, dict):
        raise SomaError(f"soma serve: the application's args must be a mapping, not {type(args).__name__}")
    try:
        return ServeSettings.model_validate(args)
    except ValidationError as exc:
        raise SomaError(f"soma serve: {first_error(exc)[0]}") from None


def with_overrides(base: dict, overrides: list[str]) -> ServeSettings:
    """`soma serve`'s options and its `--set KEY=VALUE` (any ServeSettings field, the value read as YAML)."""
    import yaml

    args = dict(base)
    for item in overrides:
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise SomaError(f"--set {item!r}: write KEY=VALUE, e.g. --set max_generate_bytes=8192")
        if key not in ServeSettings.model_fields or key == "source":
            known = ", ".join(k for k in ServeSettings.model_fields if k != "source")
            raise SomaError(f"--set {key}: not a setting of soma serve; the settings are {known}")
        try:
            args[key] = yaml.safe_load(value) if value.strip() else None
        except yaml.YAMLError:
            args[key] = value
    return settings(args)


Text = StrictStr


class ScoreRequest(BaseModel):
    """POST /v1/score: `text` (one document) or `texts` (several), each optionally after a `prefix` that is read
    and routed on but not scored; `per_byte` adds each scored byte's nats, `routes` every segment's route."""

    model_config = ConfigDict(extra="forbid")

    text: Text | None = None
    texts: list[Text] | None = None
    prefix: Text | list[Text] = ""
    per_byte: StrictBool = False
    routes: StrictBool = False
    encoding: Encoding = Encoding.UTF8


@dataclass(frozen=True)
class ScoreInput:
    """A checked score request: its documents and prefixes as bytes, and what its answer lists."""

    docs: list[bytes]
    prefixes: list[bytes]
    per_byte: bool = False
    routes: bool = False


class GenerateRequest(GenerationConfig):
    """POST /v1/generate: bytes sampled after `prompt` (soma_cluster.inference.lm: the route is fixed on the prompt),
    under the options of a GenerationConfig (its fields, defaults and bounds, inherited: max_bytes, temperature,
    top_k, seed). `stream` (default) sends the bytes as they are drawn (application/octet-stream); else one JSON
    object."""

    prompt: Text = ""
    stream: StrictBool = True
    encoding: Encoding = Encoding.UTF8

    def generation(self) -> GenerationConfig:
        """The request's decoding options alone."""
        return GenerationConfig(**{name: getattr(self, name) for name in GenerationConfig.model_fields})


class RequestError(Exception):
    """A request refused before any work: its status, one line, and the field it names (None: the body)."""

    def __init__(self, status: Status, message: str, field: str | None = None):
        super().__init__(message)
        self.status, self.message, self.field = status, message, field

    def body(self) -> dict:
        return {"error": self.message, "field": self.field}


def first_error(exc: ValidationError) -> tuple[str, str | None]:
    """pydantic's first complaint as one line, and the dotted field it names ('texts.3')."""
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"] if not _type_tag(p)) or None
    msg = " ".join(str(err["msg"]).split()).removeprefix("Value error, ")
    return (f"{where}: {msg}" if where else msg), where


_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _type_tag(part) -> bool:
    """A union member pydantic puts in an error's location ('prefix.list[str].0'): not a field's name."""
    return isinstance(part, str) and (part in _TAGS or "[" in part or part.startswith(("function-", "constrained-")))


BASE64_ALPHABET = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")


def decode(text: str, encoding: Encoding, field: str) -> bytes:
    """A field's bytes: standard base64, or the JSON string as UTF-8 (a lone surrogate \\udc80-\\udcff as the byte
    it escapes, as RoutedLM reads a str); one RequestError naming what is wrong, else."""
    if encoding is Encoding.BASE64:
        try:
            return base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise RequestError(Status.INVALID, f"{field}: not base64: {_not_base64(text)}", field) from None
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError as exc:
        raise RequestError(
            Status.INVALID,
            f"{field}: a lone surrogate \\u{ord(text[exc.start]):04x} at character {exc.start} is not text (only "
            "\\udc80-\\udcff, standing for the bytes 0x80-0xff, are read); send bytes as base64 (encoding base64)",
            field,
        ) from None


def _not_base64(text: str) -> str:
    """Why `text` is not standard base64, for its error line."""
    for i, c in enumerate(text):
        if c in BASE64_ALPHABET or c == "=":
            continue
        if c in "-_":
            return f"{c!r} at character {i} is of the URL-safe alphabet; encode with standard base64 ('+' and '/')"
        if c.isspace():
            return f"a space or line break at character {i}; send it without them"
        return f"{c!r} at character {i} is not a base64 character (A-Z, a-z, 0-9, '+', '/', '=' at the end)"
    if "=" in text.rstrip("="):
        return "'=' inside it; padding goes only at the end"
    return f"{len(text)} characters, not a multiple of 4: its padding ('=') is missing or it is cut short"


def _documents(req: ScoreRequest) -> tuple[list[str], str]:
    """The request's documents as given, and the field they came in; `null` is a field left out."""
    if req.text is not None and req.texts is not None:
        raise RequestError(
            Status.INVALID, "text and texts: give one of them (text: one document, texts: a list)", "text"
        )
    if req.texts is not None:
        return req.texts, "texts"
    if req.text is not None:
        return [req.text], "text"
    given = sorted(f for f in ("text", "texts") if f in req.model_fields_set)  # explicitly null
    if given:
        raise RequestError(
            Status.INVALID, f"{given[0]}: null; give text (a string) or texts (a list of strings)", given[0]
        )
    raise RequestError(Status.INVALID, "text: missing; give text (one document) or texts (a list of documents)", "text")


def parse_score(body: bytes, limits: ServeSettings) -> ScoreInput:
    """A score request's documents and prefixes as bytes, per_byte and routes; RequestError on anything else."""
    req = _parse(ScoreRequest, body)
    raw, field = _documents(req)
    many = field == "texts"
    if not raw:
        raise RequestError(Status.INVALID, "texts: the list is empty; give at least one document", "texts")
    if len(raw) > limits.max_documents:
        raise RequestError(
            Status.TOO_LARGE, f"texts: {len(raw)} documents, over the limit of {limits.max_documents}", "texts"
        )
    docs = [decode(t, req.encoding, f"{field}.{i}" if many else field) for i, t in enumerate(raw)]
    if isinstance(req.prefix, list):
        if len(req.prefix) != len(docs):
            n, m = len(req.prefix), len(docs)
            raise RequestError(
                Status.INVALID,
                f"prefix: {n} prefix{'es' if n != 1 else ''} for {m} text{'s' if m != 1 else ''}; give one per text, "
                "or one string for all",
                "prefix",
            )
        pre = [decode(p, req.encoding, f"prefix.{i}") for i, p in enumerate(req.prefix)]
    else:
        pre = [decode(req.prefix, req.encoding, "prefix")] * len(docs)
    for i, (p, d) in enumerate(zip(pre, docs, strict=True)):
        where = f"{field}.{i}" if many else field
        if not d:
            why = "the prefix is not scored" if p else "a document needs 2 bytes to score one"
            raise RequestError(Status.INVALID, f"{where}: empty ({why})", where)
        if len(p) + len(d) < 2:  # nothing to predict: the first byte has no prediction
            raise RequestError(
                Status.INVALID,
                f"{where}: 1 byte, and a document needs 2 to score one (its first byte has no prediction); give a "
                "longer text, or a prefix before it",
                where,
            )
    total = sum(len(d) + len(p) for d, p in zip(docs, pre, strict=True))
    if total > limits.max_request_bytes:
        raise RequestError(
            Status.TOO_LARGE,
            f"{field}: {total} bytes, over the limit of {limits.max_request_bytes}; split the request",
            field,
        )
    return ScoreInput(docs, pre, req.per_byte, req.routes)


def parse_generate(body: bytes, limits: ServeSettings) -> tuple[GenerateRequest, bytes]:
    """A generate request and its prompt as bytes; RequestError on anything else (max_bytes over the server's
    max_generate_bytes too, a limit below GenerationConfig's own)."""
    req = _parse(GenerateRequest, body)
    if req.max_bytes > limits.max_generate_bytes:
        raise RequestError(
            Status.INVALID, f"max_bytes: {req.max_bytes}, over the limit of {limits.max_generate_bytes}", "max_bytes"
        )
    prompt = decode(req.prompt, req.encoding, "prompt")
    if len(prompt) > limits.max_request_bytes:
        raise RequestError(Status.TOO_LARGE, f"prompt: over the limit of {limits.max_request_bytes} bytes", "prompt")
    return req, prompt


class _Repeated(Exception):
    def __init__(self, key: str):
        self.key = key


def _no_repeats(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object whose keys are each given once (JSON parsers keep the last of a repeated one, silently)."""
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise _Repeated(key)
        out[key] = value
    return out


_JSON_TYPES = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean"}


def _parse(model: type[BaseModel], body: bytes):
    """The body as `model`: UTF-8 JSON text holding one object (Python's json, which reads the lone surrogate escapes
    that decode() gives meaning to), then the model's own validation."""
    if not body.strip():
        raise RequestError(Status.BAD_JSON, "the body is empty; send a JSON object")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestError(
            Status.BAD_JSON,
            f"the body is not UTF-8 (byte 0x{body[exc.start]:02x} at offset {exc.start}); JSON is UTF-8 text: send "
            "other bytes as base64 (encoding base64)",
        ) from None
    try:
        doc = json.loads(text, object_pairs_hook=_no_repeats)
    except json.JSONDecodeError as exc:
        raise RequestError(
            Status.BAD_JSON, f"the body is not JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
        ) from None
    except RecursionError:
        raise RequestError(Status.BAD_JSON, "the body is not a JSON object (it nests too deeply to read)") from None
    except _Repeated as exc:
        raise RequestError(Status.INVALID, f"{exc.key}: given twice; give each field once", exc.key) from None
    if not isinstance(doc, dict):
        what = "null" if doc is None else _JSON_TYPES.get(type(doc), type(doc).__name__)
        raise RequestError(
            Status.BAD_JSON, f'the body is {what}, not a JSON object; send an object, e.g. {{"text": ...}}'
        )
    try:
        return model.model_validate(doc)
    except ValidationError as exc:
        msg, where = first_error(exc)
        err = exc.errors()[0]
        if err["type"] == "extra_forbidden":
            msg = f"{where}: not a field of this request; its fields are {', '.join(model.model_fields)}"
        elif err.get("input") is None or isinstance(err.get("input"), bool):  # said as JSON says it, not Python
            msg = msg.replace(f": {err.get('input')!r} ", f": {json.dumps(err.get('input'))} ", 1)
        raise RequestError(Status.INVALID, msg, where) from None
