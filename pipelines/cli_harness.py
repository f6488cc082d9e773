"""The `soma` command line's harness, apart from the commands (pipelines/cli.py): one `error:` line and exit 2
for bad usage, a standard output whose write failures are told apart from storage errors, the option pairs and
repeats every command checks, the options commands share, and `run_command`, which maps what a command raises to
its exit code."""

from __future__ import annotations

import errno
import os
import re
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

import typer
import typer.core
from typer._click.core import ParameterSource
from typer._click.exceptions import ClickException, NoArgsIsHelpError, UsageError  # typer 0.29's click
from typer._click.globals import get_current_context

from pipelines import CLI_PROCESS
from pipelines.common import out
from pipelines.stopping import STOP, Stopped
from soma_cluster import schema
from soma_cluster.config import CampaignConfig, parse_overrides, preset_names, resolve, versions
from soma_cluster.diskerrors import storage_error
from soma_cluster.envvars import check_environment
from soma_cluster.errors import JobsFailed, SomaError, StoppedByEnvironment
from soma_cluster.inference import generation
from soma_cluster.jobs import STATES
from soma_cluster.lease import LeaseLost
from soma_cluster.statusview import ALIASES, parse_jobs, parse_states

if TYPE_CHECKING:
    from pipelines.rayaddress import Address


class OneLineErrors(typer.core.TyperGroup):
    """Bad usage (an unknown option, a value of the wrong type, a missing argument) is bad input like any other:
    one `error:` line naming it and where the options are listed, exit 2, not typer's usage box."""

    def main(self, *args, standalone_mode: bool = True, **kwargs):
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        if sys.stdout is None:  # started with stdout closed (>&-): its data would be lost without a word
            print("error: standard output is closed; redirect it (> FILE, or > /dev/null to discard)", file=sys.stderr)
            sys.exit(2)
        sys.stdout = Output(sys.stdout)
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
            sys.stdout.flush()  # a full disk or a closed pipe behind stdout shows here, not at exit
        except OutputFailed as exc:
            code = 141 if exc.errno == errno.EPIPE else 2  # a reader that stopped (| head): as SIGPIPE would end us
            if code == 2:
                print(f"error: cannot write to standard output ({exc.strerror}); check where it goes", file=sys.stderr)
        except NoArgsIsHelpError as exc:  # `soma` or `soma CMD` alone: the help, as typer shows it
            print(exc.ctx.get_help())
            sys.exit(exc.exit_code)
        except ClickException as exc:
            path = exc.ctx.command_path if getattr(exc, "ctx", None) is not None else "soma"
            message = " ".join(exc.format_message().split()).rstrip(".")
            print(f"error: {message}; {path} --help lists the arguments and options", file=sys.stderr)
            sys.exit(2)
        except typer.Abort:  # Ctrl-C at a prompt or EOF on stdin
            print("stopped", file=sys.stderr)
            sys.exit(130)
        sys.exit(code if isinstance(code, int) else 0)


class OutputFailed(Exception):
    """Standard output could not be written (a full disk, a reader gone): not a campaign's storage error."""

    def __init__(self, exc: OSError):
        super().__init__(str(exc))
        self.errno, self.strerror = exc.errno, exc.strerror


class Output:
    """sys.stdout, whose write failures are told apart from the campaign's own storage errors; after one, stdout
    goes to /dev/null so the interpreter's exit flush is quiet."""

    def __init__(self, stream):
        self._stream = stream

    def __getattr__(self, name):
        return getattr(self._stream, name)

    def _failed(self, exc: OSError) -> OutputFailed:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, self._stream.fileno())
        os.close(null)
        return OutputFailed(exc)

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as exc:
            raise self._failed(exc) from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as exc:
            raise self._failed(exc) from None

    def write_bytes(self, data: bytes) -> None:
        """Raw bytes (soma sample's output need not be UTF-8), after any text already written, flushed at once."""
        try:
            self._stream.flush()
            self._stream.buffer.write(data)
            self._stream.buffer.flush()
        except OSError as exc:
            raise self._failed(exc) from None


@dataclass(frozen=True)
class OptionPair:
    """Two inputs of one command that only make sense together (needs: `option` has no effect without `other`) or
    not at all (they contradict). A name is a parameter's (`stride`, `retry_failed`) or `set:KEY` for a --set item
    of that key; each pair given wrongly is one `error:` line naming both, exit 2, before the command runs."""

    command: str
    option: str
    other: str
    needs: bool
    why: str  # what the option does (needs) or why both cannot hold (contradicts)


OPTION_PAIRS = (
    OptionPair("eval", "stride", "text", True, "it is the window stride of long-document mode"),
    OptionPair("eval", "compare", "text", False, "--compare pairs the test windows, --text scores other documents"),
    OptionPair("status", "interval", "watch", True, "it is the time between refreshes"),
    OptionPair("status", "count", "watch", True, "it stops the refreshes"),
    OptionPair("status", "wait", "watch", True, "it is how long a watch waits for a driver"),
    OptionPair("resume", "experts", "retry_failed", True, "naming experts says which failed ones to reopen"),
    OptionPair("resume", "from_step", "retrain", True, "it is the checkpoint the retrained experts start from"),
    OptionPair("prepare", "corpus", "set:corpus.source", False, "both set corpus.source"),
    OptionPair("prepare", "experts", "set:n_experts", False, "both set n_experts"),
    OptionPair("sample", "prompt", "prompt_file", False, "both give the prompt"),
)


def shown(command: typer.core.TyperCommand, name: str) -> str:
    """An input as the user writes it: --stride, --experts/-n, EXPERTS, --set n_experts=..."""
    if name.startswith("set:"):
        return f"--set {name[4:]}=..."
    param = next(p for p in command.params if p.name == name)
    if param.param_type_name == "argument":
        return name.upper()
    return written(param)


def written(param) -> str:
    """An option as its help lists it, long name first: --experts/-n."""
    return "/".join(sorted(param.opts, key=len, reverse=True))


def given(ctx: typer.Context, name: str) -> bool:
    if name.startswith("set:"):  # a --set item of that key, or of its section holding it (corpus={source: X})
        return any(sets_key(item, name[4:]) for item in ctx.params.get("set") or [])
    given = ctx.get_parameter_source(name) is ParameterSource.COMMANDLINE
    return given and ctx.params.get(name) not in (None, (), [])  # an argument of nargs=-1 given no value: ()


def sets_key(item: str, dotted: str) -> bool:
    """Whether one --set item sets `dotted`, read as the command will read it (spaces around the key allowed)."""
    try:
        node = parse_overrides([item])
    except SomaError:  # malformed: the command's own parse says so, in its one line
        return False
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def check_pairs(ctx: typer.Context) -> None:
    for pair in OPTION_PAIRS:
        if pair.command != ctx.info_name or not given(ctx, pair.option):
            continue
        a, b = shown(ctx.command, pair.option), shown(ctx.command, pair.other)
        if pair.needs and not given(ctx, pair.other):
            raise UsageError(f"{a} has no effect without {b} ({pair.why}); pass {b} too, or leave out {a}", ctx)
        if not pair.needs and given(ctx, pair.other):
            raise UsageError(f"{a} and {b} contradict ({pair.why}); pass one of them", ctx)


def check_repeats(command: typer.core.TyperCommand, ctx: typer.Context, args: list[str]) -> None:
    """An option that takes one value, given twice: click keeps the last silently, so the first (a --config file,
    a --preset) would be dropped without a word."""
    _, _, order = command.make_parser(ctx).parse_args(args=list(args))  # every occurrence, in order
    for param in {id(p): p for p in order}.values():
        single = param.param_type_name == "option" and not (param.multiple or param.is_flag or param.count)
        if single and (n := sum(p is param for p in order)) > 1:
            raise UsageError(f"{written(param)} given {n} times; pass it once (only the last would count)", ctx)


class Checked(typer.core.TyperCommand):
    """Every command: a single-value option given twice, and the OPTION_PAIRS given wrongly, are bad usage."""

    def parse_args(self, ctx, args):
        # no arguments at all, or --help among them (asked for, it is given, as click gives it past other errors)
        if args and not set(args) & set(ctx.help_option_names):
            check_repeats(self, ctx, args)
        return super().parse_args(ctx, args)

    def invoke(self, ctx):
        check_pairs(ctx)
        return super().invoke(ctx)


def check_every_command(app: typer.Typer) -> None:
    """Every command registered on `app`, one added later included, checks its inputs (Checked)."""
    for info in app.registered_commands:
        info.cls = Checked


def given_on_command_line(name: str) -> bool:
    """Whether the running command's option `name` was typed, not left at its default."""
    return get_current_context().get_parameter_source(name) is ParameterSource.COMMANDLINE


SCALES = ("small", "paper")


def bad_option(message: str) -> None:
    """Bad input found while parsing options: the same one `error:` line and exit 2 as every other bad input."""
    print(f"error: {message}", file=sys.stderr)
    raise typer.Exit(2)


def check_preset(value: str) -> str:
    if value not in preset_names():
        bad_option(
            f"--preset {value!r} is not a preset; choose one of {', '.join(preset_names())} (soma presets lists them)"
        )
    return value


def check_scale(value: str) -> str:
    if value not in SCALES:
        bad_option(f"--scale {value!r}: choose one of {', '.join(SCALES)}")
    return value


def check_experts(value: Optional[int]) -> Optional[int]:
    limit = dict(schema.bounds(CampaignConfig.model_fields["n_experts"]))["<="]
    if value is not None and not 1 <= value <= limit:
        bad_option(f"--experts/-n {value}: a campaign needs at least 1 expert (and at most {limit:_}); pass e.g. -n 4")
    return value


MAX_SECONDS = 604_800.0  # a week: a longer interval or wait is a typo (and past it timestamps overflow)
MAX_GPUS = 100_000.0


def check_positive(param: typer.CallbackParam, value: Optional[float]) -> Optional[float]:
    """Seconds (or, for --gpus, GPUs): positive and at most a week (100,000 GPUs); NaN and infinity refused."""
    top = MAX_GPUS if param.name == "gpus" else MAX_SECONDS
    if value is not None and not (0 < value <= top):  # NaN fails every comparison
        bad_option(f"{param.opts[0]} {value:g}: pass a positive number up to {top:,.0f}")
    return value


def print_version(value: bool) -> None:
    if value:
        v = versions()
        out.print(
            f"soma-cluster {v['soma-cluster']} (torch {v['torch']}, ray {v['ray']}, python {v['python']})", markup=False
        )
        raise typer.Exit(0)


PresetOpt = typer.Option(
    "tiny",
    "--preset",
    "-p",
    callback=check_preset,
    help=f"preset: {', '.join(preset_names())} (soma_cluster/presets/*.yaml)",
)
ConfigOpt = typer.Option(
    None, "--config", "-c", help="YAML file layered over the preset; - (or a pipe, a FIFO) reads it from standard input"
)
SetOpt = typer.Option(None, "--set", "-s", help="override, e.g. --set spsa.n_pert=16 (repeatable)")
CorpusOpt = typer.Option(None, "--corpus", help="corpus path or s3:// URL (default: the built-in corpus)")
ExpertsOpt = typer.Option(None, "--experts", "-n", callback=check_experts, help="number of experts N (at least 1)")
AddressOpt = typer.Option(
    None,
    "--address",
    help="Ray cluster: the head's GCS HOST:PORT (6379 by default) or auto (default: RAY_ADDRESS, else a local Ray)",
)


def checked_address(address: str | None) -> Address:
    """--address, else RAY_ADDRESS, checked (form, then a bounded probe) before a command writes anything."""
    from pipelines.rayaddress import ray_address

    return ray_address(address)


QuietOpt = typer.Option(
    False,
    "--no-progress",
    help="no progress bars: one summary line every --log-every seconds (also when stderr is not a terminal)",
)
LogEveryOpt = typer.Option(
    30.0, "--log-every", callback=check_positive, help="seconds between summary lines without a progress bar"
)
JsonOpt = typer.Option(False, "--json", help="print one JSON document on stdout (schema in docs/json.md)")
TakeOverOpt = typer.Option(
    False,
    "--take-over",
    help="if another driver holds the campaign, wait for its lease to lapse "
    "(SOMA_LEASE_TTL_S, 30 s by default) and take over; a driver that still renews it is never displaced",
)
RetryFailedOpt = typer.Option(
    False,
    "--retry-failed",
    help="first reopen the jobs that ended failed_permanently (all, or the "
    "EXPERTS named) from their newest valid checkpoint, with their retries given back",
)


def run_command(fn: Callable[[], None], stopped: str | None = None) -> None:
    """`stopped`: what a stop by a signal leaves, for a command that holds no lease. Exit codes: 0 the command really
    succeeded; 2 bad input (one `error:` line naming the thing and the fix);
    3 a campaign ran but jobs failed permanently (their retries spent); 4 the campaign was stopped by its
    environment (disk full, read-only, storage unreachable, nodes lost, out of memory: fix it, then soma resume) or
    this driver lost it to another driver (its lease lapsed); 130 / 143 stopped by SIGINT / SIGTERM (final status
    written, lease released: soma resume continues); 1 a bug (a traceback)."""
    STOP.install()
    try:
        check_environment()  # every variable soma reads, before a lease is taken or anything starts
        fn()
        if STOP.requested is not None:  # it came while the finished command was cleaning up: the work is done
            print(
                f"soma: {Stopped(STOP.requested).name} arrived as the command was finishing; its work is complete",
                file=sys.stderr,
            )
    except LeaseLost as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise typer.Exit(LeaseLost.exit_code) from None
    except SomaError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise typer.Exit(2) from None
    except (JobsFailed, StoppedByEnvironment) as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise typer.Exit(exc.exit_code) from None
    except Stopped as exc:
        print(
            f"stopped: {exc.name}; "
            + (
                stopped
                or "what was done is kept and the campaign's lease released; run the same command again to continue "
                "(soma resume for a launch)"
            ),
            file=sys.stderr,
        )
        raise typer.Exit(exc.exit_code) from None
    except OSError as exc:
        # the last resort for an environment condition no check foresaw (a disk filling up mid-command, a
        # directory removed under it): one line naming the path, never a traceback. Other OSErrors are bugs.
        err = storage_error(exc)
        if err is None:
            raise
        print(f"error: {err}", file=sys.stderr)
        raise typer.Exit(2) from None
    finally:
        STOP.finish(exiting=CLI_PROCESS)


def config_from_options(
    preset: str, config: Optional[str], sets: Optional[list[str]], corpus: Optional[str], experts: Optional[int]
) -> CampaignConfig:
    overrides = parse_overrides(sets or [])
    if corpus is not None:
        if not corpus.strip():
            raise SomaError(
                "--corpus is empty; pass a corpus directory, file or s3:// URL (or leave it out: built-in corpus)"
            )
        overrides.setdefault("corpus", {})["source"] = corpus
    if experts is not None:
        if experts < 1:
            raise SomaError(f"--experts/-n {experts}: a campaign needs at least 1 expert; pass e.g. -n 4")
        overrides["n_experts"] = experts
    return resolve(preset, overrides, config)


StepOpt = typer.Option(
    None, "--step", min=0, help="a campaign's checkpoints of this step (default: each expert's latest)"
)
DeviceOpt = typer.Option(None, "--device", help="torch device: cpu, cuda or cuda:N (default: cuda when available)")
ThreadsOpt = typer.Option(
    None,
    "--threads",
    min=1,
    max=1024,
    help="torch intra-op threads (default: chosen per op from its size and the free cores; docs/performance.md)",
)


def check_states(value: Optional[str]) -> Optional[str]:
    """--state: a comma list of job states or their aliases (soma_cluster/statusview.py), as squeue's --states."""
    if value is not None:
        try:
            parse_states(value)
        except ValueError as exc:
            bad_option(
                f"--state/-t: {exc}; pass a comma list of {', '.join(STATES)}, or {', '.join(ALIASES)} "
                "(e.g. --state failed,retrying)"
            )
    return value


def check_jobs(value: Optional[str]) -> Optional[str]:
    """--expert: a comma list of expert numbers, ranges lo-hi, names (expert-0007) and `seed`; whether each is one of
    the campaign's is checked once its config is read."""
    if value is not None:
        try:
            parse_jobs(value)
        except ValueError as exc:
            bad_option(f"--expert/-e: {exc}; pass e.g. --expert 7,12-15 (or expert-0007, or seed)")
    return value


# the options that take a comma list, with values each must refuse (tests/test_command_targets.py gives them all)
LIST_CHECKS = {
    check_states: ("", ",", "bogus", "running,bogus", "fail", "3"),
    check_jobs: ("", ",", "x", "7,,8", "-1", "7-", "15-12", "expert-", "1e3", "seed-1", "3.5"),
}


def check_generation(param: typer.CallbackParam, value):
    """A decoding option, checked by GenerationConfig's own bounds (one set for every door: generation.py)."""
    try:
        generation.resolve(None, {param.name: value})
    except SomaError:
        bad_option(f"{max(param.opts, key=len)}: {generation.refusal(param.name, value)}")
    return value


def GenerationOpt(name: str):  # noqa: N802 - an option, named like typer.Option
    """The option of one GenerationConfig field (--max-bytes for max_bytes): its default, help and bounds are the
    field's, its text read as the field's kind of number (a whole number is digits: '2.0' is not one, as 2.0 is not
    one for generate()), so the command line accepts what generate() and the HTTP API accept."""
    field = generation.GenerationConfig.model_fields[name]
    lo, lo_open, hi = generation.bounds(name)
    whole = generation.kind(name) is int

    def parse(text: str):
        if not isinstance(text, str):  # the default, passed through
            return text
        try:
            if whole and not re.fullmatch(r"\s*[+-]?\d+\s*", text):
                raise ValueError(text)
            return int(text) if whole else float(text)
        except ValueError:
            raise typer.BadParameter(generation.refusal(name, text)) from None

    span = f" [{lo:g}{'<' if lo_open else '<='}x<={hi:g}]"  # as click shows a range; an open one it cannot check
    return typer.Option(
        field.default,
        "--" + name.replace("_", "-"),
        min=lo if whole and not lo_open else None,  # for --help and the tables of bad values; check_generation checks
        max=hi if whole else None,
        parser=parse,
        callback=check_generation,
        help=field.description + ("" if whole else span),
    )


def generation_config(**values) -> generation.GenerationConfig:
    """The decoding options as the command's GenerationConfig (each already checked by its option)."""
    return generation.resolve(None, values)
