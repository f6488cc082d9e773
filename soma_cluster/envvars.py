"""Every environment variable soma reads or the docs name, typed like a config field: its kind, bounds and meaning.

`check_environment()` reads them all once, before a command takes a lease or starts anything (pipelines/cli.py), and
refuses a bad value with one line naming the variable and the fix: a value that means nothing (nan, inf, a negative
time, garbage, an empty string where a number or a switch is expected) is never silently ignored. The reference
table in docs/env.md is generated from REGISTRY (`python -m soma_cluster.envvars`; tests/test_env_inputs.py checks
it, and generates the bad values of every entry)."""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from enum import StrEnum
from typing import Mapping

from soma_cluster.errors import SomaError


class EnvKind(StrEnum):
    SECONDS = "seconds"  # a finite number of seconds within [low, high]
    SWITCH = "switch"  # 0 or 1
    NAMES = "names"  # comma-separated names from `choices` (empty: none)
    URL = "url"  # http:// or https://
    PATH = "path"  # a local directory (made if missing)
    TEXT = "text"  # handed on as it is (another tool's, or free text)


@dataclass(frozen=True)
class EnvVar:
    name: str
    kind: EnvKind
    doc: str
    default: str = ""  # as the table shows it; "" for unset
    low: float | None = None  # SECONDS: inclusive bounds
    high: float | None = None
    choices: tuple[str, ...] = ()  # NAMES
    owner: str = "soma"  # the tool that defines it; soma reads another's only as that tool does

    def parse(self, raw: str) -> object:
        """The value of `raw`, or SomaError: one line naming the variable, what is wrong and the fix."""
        bad = f"{self.name}={raw!r}"
        if self.kind is EnvKind.SECONDS:
            try:
                value = float(raw)
            except ValueError:
                value = math.nan
            if not (math.isfinite(value) and self.low <= value <= self.high):
                raise SomaError(
                    f"{bad}: give {self.doc.rstrip('.').lower()} in seconds, from {self.low:g} to {self.high:g} "
                    f"(default {self.default}), or unset it"
                )
            return value
        if self.kind is EnvKind.SWITCH:
            if raw not in ("0", "1"):
                raise SomaError(
                    f"{bad}: set it to 1 or 0 ({self.doc.rstrip('.')}; default {self.default}), or unset it"
                )
            return raw == "1"
        if self.kind is EnvKind.NAMES:
            names = [n.strip() for n in raw.split(",")]
            unknown = [n for n in names if n not in self.choices]
            if raw.strip() and unknown:
                shown = ", ".join(n or "''" for n in unknown)
                raise SomaError(f"{self.name} names {shown}; choose from {', '.join(self.choices)} (comma-separated)")
            return tuple(dict.fromkeys(n for n in names if n))
        if self.kind is EnvKind.URL:
            if not raw.startswith(("http://", "https://")) or len(raw.split("://", 1)[1].strip("/")) == 0:
                raise SomaError(
                    f"{bad} is not an http:// or https:// URL; set it to one (e.g. http://HOST:PORT), or unset it"
                )
            return raw
        if self.kind is EnvKind.PATH:
            if not raw.strip() or "\0" in raw:
                raise SomaError(
                    f"{bad} names no directory; set it to a directory ({self.doc.rstrip('.')}), or unset it"
                )
            if os.path.lexists(raw) and not os.path.isdir(raw):
                raise SomaError(f"{bad} is not a directory; name a directory (or a new path), or unset it")
            return raw
        return raw


def _s(name: str, doc: str, default: float, low: float, high: float) -> EnvVar:
    return EnvVar(name, EnvKind.SECONDS, doc, f"{default:g}", low, high)


REGISTRY: tuple[EnvVar, ...] = (
    _s("SOMA_LEASE_TTL_S", "The driver lease's lifetime", 30, 3, 86400),
    _s("SOMA_S3_TIMEOUT_S", "How long one storage call retries an object store it cannot reach", 15, 0.1, 86400),
    _s(
        "SOMA_METRICS_HOLD_S",
        "How long a campaign's last metrics stay on Ray's endpoint after its driver",
        900,
        0,
        604800,
    ),
    EnvVar(
        "SOMA_S3_ENDPOINT",
        EnvKind.URL,
        "The S3 endpoint of s3:// campaigns (first of it, AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL).",
    ),
    EnvVar("AWS_ENDPOINT_URL_S3", EnvKind.URL, "The S3 endpoint, when SOMA_S3_ENDPOINT is unset.", owner="botocore"),
    EnvVar("AWS_ENDPOINT_URL", EnvKind.URL, "The endpoint, when neither of the above is set.", owner="botocore"),
    EnvVar(
        "SOMA_TRACKING_BACKENDS",
        EnvKind.NAMES,
        "The trackers of a campaign whose tracking.backends is empty.",
        choices=("mlflow", "tensorboard"),
    ),
    EnvVar("SOMA_TF32", EnvKind.SWITCH, "TF32 matmuls on a CUDA GPU.", "0"),
    EnvVar("SOMA_FUSED", EnvKind.SWITCH, "The fused C kernels (0: torch only).", "1"),
    EnvVar("SOMA_KEEP_RAY_LOGS", EnvKind.SWITCH, "Keep a local Ray's directory (its logs) after the command.", "0"),
    EnvVar(
        "SOMA_RAY_DIR",
        EnvKind.TEXT,
        "Set by soma in a local Ray's processes (its directory), so its watchdog finds them; not for users to set.",
    ),
    EnvVar("SOMA_KERNEL_CACHE", EnvKind.PATH, "Where the fused kernels are built.", "~/.cache/soma_cluster"),
    EnvVar("SOMA_TASK_TIMES", EnvKind.PATH, "Where each Ray prepare task records its times (benchmarks)."),
    EnvVar(
        "TMPDIR", EnvKind.PATH, "The temp directory (checked to exist when a command needs it).", "/tmp", owner="Python"
    ),
    EnvVar("MLFLOW_TRACKING_URI", EnvKind.URL, "The MLflow server, when tracking.mlflow_uri is unset.", owner="MLflow"),
    EnvVar(
        "MLFLOW_EXPERIMENT_NAME",
        EnvKind.TEXT,
        "The MLflow experiment, when tracking.experiment is unset.",
        owner="MLflow",
    ),
    EnvVar("MLFLOW_TRACKING_USERNAME", EnvKind.TEXT, "MLflow server credentials.", owner="MLflow"),
    EnvVar("MLFLOW_TRACKING_TOKEN", EnvKind.TEXT, "MLflow server credentials.", owner="MLflow"),
    EnvVar(
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES", EnvKind.TEXT, "MLflow's retries (soma sets 0 unless set).", owner="MLflow"
    ),
    EnvVar(
        "TENSORBOARD_LOGDIR",
        EnvKind.TEXT,
        "TensorBoard's log dir, when tracking.tensorboard_dir is unset.",
        owner="TensorBoard",
    ),
    EnvVar(
        "RAY_ADDRESS",
        EnvKind.TEXT,
        "The Ray cluster, when --address is not given (checked by each command).",
        owner="Ray",
    ),
    EnvVar("RAY_AUTH_MODE", EnvKind.TEXT, "Ray's token authentication (token) or none.", owner="Ray"),
    EnvVar("RAY_AUTH_TOKEN", EnvKind.TEXT, "Ray's token, with RAY_AUTH_MODE=token.", owner="Ray"),
    EnvVar(
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", EnvKind.TEXT, "Tests and the demo: Ray on 127.0.0.1 only.", owner="Ray"
    ),
    EnvVar(
        "AWS_ACCESS_KEY_ID", EnvKind.TEXT, "S3 credentials (never read by soma: botocore finds them).", owner="botocore"
    ),
    EnvVar("AWS_SECRET_ACCESS_KEY", EnvKind.TEXT, "S3 credentials (as above).", owner="botocore"),
    EnvVar("AWS_SESSION_TOKEN", EnvKind.TEXT, "S3 credentials (as above).", owner="botocore"),
    EnvVar("AWS_PROFILE", EnvKind.TEXT, "S3 credentials (as above).", owner="botocore"),
)
BY_NAME = {v.name: v for v in REGISTRY}
# read only by the test suite (CONTRIBUTING.md names them), never by a command
TEST_ONLY = ("SOMA_SLOW", "SOMA_TEST_MLFLOW", "SOMA_TEST_SETUP_DELAY_S", "SOMA_TEST_STORE_UNREACHABLE")


def value(name: str, environ: Mapping[str, str] | None = None) -> object | None:
    """The parsed value of the registered `name`, None when unset (an empty list/text counts as unset; an empty
    number or switch is refused)."""
    raw = (os.environ if environ is None else environ).get(name)
    var = BY_NAME[name]
    if raw is None or (raw == "" and var.kind in (EnvKind.NAMES, EnvKind.TEXT)):
        return None
    return var.parse(raw)


def check_environment(environ: Mapping[str, str] | None = None) -> None:
    """Parse every registered variable that is set: the first bad one is refused (SomaError, one line)."""
    for var in REGISTRY:
        value(var.name, environ)


def table() -> str:
    """docs/env.md's table."""
    rows = ["| variable | kind | default | meaning | defined by |", "|---|---|---|---|---|"]
    for v in REGISTRY:
        kind = f"{v.kind} {v.low:g}..{v.high:g}" if v.kind is EnvKind.SECONDS else str(v.kind)
        if v.choices:
            kind += f" ({', '.join(v.choices)})"
        rows.append(f"| `{v.name}` | {kind} | {v.default or 'unset'} | {v.doc} | {v.owner} |")
    return "\n".join(rows) + "\n"


HEADER = """# Environment variables

Generated from `soma_cluster/envvars.py` by `python -m soma_cluster.envvars` (tests/test_env_inputs.py checks it).
Every command parses all of them before it takes a campaign's lease or starts anything, and refuses a bad value
with one `error:` line naming the variable (exit 2): nan, inf, a negative or out-of-range time, garbage, or an
empty string where a number or a switch is expected. Another tool's variable (`defined by`) is handed to that
tool as it is; soma checks the ones whose form it relies on (the URLs).

"""

if __name__ == "__main__":
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "env.md")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(HEADER + table())
    print(path, file=sys.stderr)
