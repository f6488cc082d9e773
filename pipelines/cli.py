"""The `soma` command line: thin wiring over the pipelines. Bad input exits 2 with one line."""

from __future__ import annotations

import errno
import os
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

from pipelines.stopping import STOP, Stopped

# this process is the `soma` command (not a test or a notebook importing it): it owns SIGINT and SIGTERM from here on,
# and a signal while it still imports (seconds on a loaded host) ends it with one line, exit 128 + n
CLI_PROCESS = __name__ == "__main__" or os.path.basename(sys.argv[0]) == "soma"
if CLI_PROCESS:
    STOP.install(early=True)

import typer  # noqa: E402
import typer.core  # noqa: E402
from typer._click.core import ParameterSource  # noqa: E402
from typer._click.exceptions import ClickException, NoArgsIsHelpError, UsageError  # noqa: E402  (typer 0.29's click)
from typer._click.globals import get_current_context  # noqa: E402

from pipelines.campaign_lease import hold  # noqa: E402
from pipelines.common import claim_campaign, emit_json, load_config, open_store, out  # noqa: E402
from soma_cluster import schema  # noqa: E402
from soma_cluster.campaignfile import load_campaign_config  # noqa: E402
from soma_cluster.config import CampaignConfig, parse_overrides, preset_names, resolve, versions  # noqa: E402
from soma_cluster.diskerrors import storage_error  # noqa: E402
from soma_cluster.envvars import check_environment  # noqa: E402
from soma_cluster.errors import JobsFailed, SomaError, StoppedByEnvironment  # noqa: E402
from soma_cluster.lease import LeaseLost  # noqa: E402

if TYPE_CHECKING:
    from pipelines.rayaddress import Address


class _OneLineErrors(typer.core.TyperGroup):
    """Bad usage (an unknown option, a value of the wrong type, a missing argument) is bad input like any other:
    one `error:` line naming it and where the options are listed, exit 2, not typer's usage box."""

    def main(self, *args, standalone_mode: bool = True, **kwargs):
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        if sys.stdout is None:  # started with stdout closed (>&-): its data would be lost without a word
            print("error: standard output is closed; redirect it (> FILE, or > /dev/null to discard)", file=sys.stderr)
            sys.exit(2)
        sys.stdout = _Output(sys.stdout)
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


class _Output:
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


def _shown(command: typer.core.TyperCommand, name: str) -> str:
    """An input as the user writes it: --stride, --experts/-n, EXPERTS, --set n_experts=..."""
    if name.startswith("set:"):
        return f"--set {name[4:]}=..."
    param = next(p for p in command.params if p.name == name)
    if param.param_type_name == "argument":
        return name.upper()
    return _written(param)


def _written(param) -> str:
    """An option as its help lists it, long name first: --experts/-n."""
    return "/".join(sorted(param.opts, key=len, reverse=True))


def _given(ctx: typer.Context, name: str) -> bool:
    if name.startswith("set:"):  # a --set item of that key, or of its section holding it (corpus={source: X})
        return any(_sets(item, name[4:]) for item in ctx.params.get("set") or [])
    given = ctx.get_parameter_source(name) is ParameterSource.COMMANDLINE
    return given and ctx.params.get(name) not in (None, (), [])  # an argument of nargs=-1 given no value: ()


def _sets(item: str, dotted: str) -> bool:
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


def _check_pairs(ctx: typer.Context) -> None:
    for pair in OPTION_PAIRS:
        if pair.command != ctx.info_name or not _given(ctx, pair.option):
            continue
        a, b = _shown(ctx.command, pair.option), _shown(ctx.command, pair.other)
        if pair.needs and not _given(ctx, pair.other):
            raise UsageError(f"{a} has no effect without {b} ({pair.why}); pass {b} too, or leave out {a}", ctx)
        if not pair.needs and _given(ctx, pair.other):
            raise UsageError(f"{a} and {b} contradict ({pair.why}); pass one of them", ctx)


def _check_repeats(command: typer.core.TyperCommand, ctx: typer.Context, args: list[str]) -> None:
    """An option that takes one value, given twice: click keeps the last silently, so the first (a --config file,
    a --preset) would be dropped without a word."""
    _, _, order = command.make_parser(ctx).parse_args(args=list(args))  # every occurrence, in order
    for param in {id(p): p for p in order}.values():
        single = param.param_type_name == "option" and not (param.multiple or param.is_flag or param.count)
        if single and (n := sum(p is param for p in order)) > 1:
            raise UsageError(f"{_written(param)} given {n} times; pass it once (only the last would count)", ctx)


class _Checked(typer.core.TyperCommand):
    """Every command: a single-value option given twice, and the OPTION_PAIRS given wrongly, are bad usage."""

    def parse_args(self, ctx, args):
        # no arguments at all, or --help among them (asked for, it is given, as click gives it past other errors)
        if args and not set(args) & set(ctx.help_option_names):
            _check_repeats(self, ctx, args)
        return super().parse_args(ctx, args)

    def invoke(self, ctx):
        _check_pairs(ctx)
        return super().invoke(ctx)


app = typer.Typer(
    cls=_OneLineErrors,
    add_completion=False,
    no_args_is_help=True,
    help="SOMA-style sharded zero-order pretraining campaigns on Ray. "
    "Data (tables, results, --json) goes to stdout; logs and progress to stderr.",
)

SCALES = ("small", "paper")


def _bad(message: str) -> None:
    """Bad input found while parsing options: the same one `error:` line and exit 2 as every other bad input."""
    print(f"error: {message}", file=sys.stderr)
    raise typer.Exit(2)


def _check_preset(value: str) -> str:
    if value not in preset_names():
        _bad(f"--preset {value!r} is not a preset; choose one of {', '.join(preset_names())} (soma presets lists them)")
    return value


def _check_scale(value: str) -> str:
    if value not in SCALES:
        _bad(f"--scale {value!r}: choose one of {', '.join(SCALES)}")
    return value


def _check_experts(value: Optional[int]) -> Optional[int]:
    limit = dict(schema.bounds(CampaignConfig.model_fields["n_experts"]))["<="]
    if value is not None and not 1 <= value <= limit:
        _bad(f"--experts/-n {value}: a campaign needs at least 1 expert (and at most {limit:_}); pass e.g. -n 4")
    return value


MAX_SECONDS = 604_800.0  # a week: a longer interval or wait is a typo (and past it timestamps overflow)
MAX_GPUS = 100_000.0


def _check_positive(param: typer.CallbackParam, value: Optional[float]) -> Optional[float]:
    """Seconds (or, for --gpus, GPUs): positive and at most a week (100,000 GPUs); NaN and infinity refused."""
    top = MAX_GPUS if param.name == "gpus" else MAX_SECONDS
    if value is not None and not (0 < value <= top):  # NaN fails every comparison
        _bad(f"{param.opts[0]} {value:g}: pass a positive number up to {top:,.0f}")
    return value


def _version(value: bool) -> None:
    if value:
        v = versions()
        out.print(
            f"soma-cluster {v['soma-cluster']} (torch {v['torch']}, ray {v['ray']}, python {v['python']})", markup=False
        )
        raise typer.Exit(0)


@app.callback()
def main(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="print the versions and exit"
    ),
) -> None:
    """SOMA-style sharded zero-order pretraining campaigns on Ray."""


PresetOpt = typer.Option(
    "tiny",
    "--preset",
    "-p",
    callback=_check_preset,
    help=f"preset: {', '.join(preset_names())} (soma_cluster/presets/*.yaml)",
)
ConfigOpt = typer.Option(
    None, "--config", "-c", help="YAML file layered over the preset; - (or a pipe, a FIFO) reads it from standard input"
)
SetOpt = typer.Option(None, "--set", "-s", help="override, e.g. --set spsa.n_pert=16 (repeatable)")
CorpusOpt = typer.Option(None, "--corpus", help="corpus path or s3:// URL (default: the built-in corpus)")
ExpertsOpt = typer.Option(None, "--experts", "-n", callback=_check_experts, help="number of experts N (at least 1)")
AddressOpt = typer.Option(
    None,
    "--address",
    help="Ray cluster: the head's GCS HOST:PORT (6379 by default) or auto (default: RAY_ADDRESS, else a local Ray)",
)


def _address(address: str | None) -> Address:
    """--address, else RAY_ADDRESS, checked (form, then a bounded probe) before a command writes anything."""
    from pipelines.rayaddress import ray_address

    return ray_address(address)


QuietOpt = typer.Option(
    False,
    "--no-progress",
    help="no progress bars: one summary line every --log-every seconds (also when stderr is not a terminal)",
)
LogEveryOpt = typer.Option(
    30.0, "--log-every", callback=_check_positive, help="seconds between summary lines without a progress bar"
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


def _run(fn: Callable[[], None], stopped: str | None = None) -> None:
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


def _config(
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


@app.command()
def prepare(
    campaign: str,
    preset: str = PresetOpt,
    config: Optional[str] = ConfigOpt,
    set: Optional[list[str]] = SetOpt,
    corpus: Optional[str] = CorpusOpt,
    experts: Optional[int] = ExpertsOpt,
    address: Optional[str] = AddressOpt,
    take_over: bool = TakeOverOpt,
) -> None:
    """Build the corpus, fit the router and write one Arrow shard per expert under CAMPAIGN (prepare.engine=ray, the
    default with --address: on the cluster's CPU workers with Ray Data)."""

    def go() -> None:
        from pipelines.prepare import prepare as run

        store, cfg = open_store(campaign), _config(preset, config, set, corpus, experts)
        addr = _address(address)  # a wrong address is refused before anything is written
        claim_campaign(store, cfg, write=False)  # another campaign's directory is refused before its lease is touched
        with hold(store, "soma prepare", take_over):
            run(store, cfg, addr.text or None)

    _run(go)


@app.command()
def seed(
    campaign: str,
    address: Optional[str] = AddressOpt,
    no_progress: bool = QuietOpt,
    log_every: float = LogEveryOpt,
    take_over: bool = TakeOverOpt,
    retry_failed: bool = typer.Option(
        False, "--retry-failed", help="first reopen the seed if it ended failed_permanently"
    ),
) -> None:
    """Train the seed model (N = 1) on the whole corpus."""

    def go() -> None:
        from pipelines.raysession import ray_session
        from pipelines.seed import train_seed
        from soma_cluster.checkpoint import training_bytes

        store = open_store(campaign)
        cfg = load_config(store)
        addr = _address(address)
        with (
            hold(store, "soma seed", take_over, training_bytes(cfg, 1)),
            ray_session(cfg, addr),
        ):  # checked before Ray
            train_seed(store, cfg, not no_progress, log_every, retry_failed)

    _run(go)


def _launch(
    campaign: str,
    address: Optional[str],
    no_progress: bool,
    log_every: float,
    command: str,
    take_over: bool,
    retry_failed: list[str] | None = None,
    retrain: list[str] | None = None,
    from_step: int | None = None,
    sets: list[str] | None = None,
) -> None:
    from pipelines.campaign import launch as run
    from pipelines.raysession import ray_session
    from soma_cluster.checkpoint import training_bytes
    from soma_cluster.events import history
    from soma_cluster.failures import expert_names, select_failed
    from soma_cluster.jobs import expert_jobs
    from soma_cluster.revisions import check, record

    store = open_store(campaign)
    cfg = load_config(store)
    names = [j.name for j in expert_jobs(cfg.n_experts)]
    if retry_failed:  # named experts are checked before Ray starts: one that did not fail is bad input
        select_failed({n: h.state for n, h in history(store).items()}, names, retry_failed)
    if retrain:
        expert_names(retrain, names)
    if sets:
        check(cfg, list(sets), driver_running=False, origin="--set")  # refused before the lease is touched
    addr = _address(address)
    # the place and its room are checked (hold) before Ray starts or any expert is queued
    with hold(store, command, take_over, training_bytes(cfg, cfg.n_experts)):
        if sets:  # a revision, as soma set would write it, once this command holds the campaign
            rev = record(store, load_campaign_config(store), list(sets), driver_running=False)
            print(f"revision {rev.rev}: {rev.line()}", file=sys.stderr)
            cfg = load_config(store)
        with ray_session(cfg, addr):
            run(store, cfg, not no_progress, log_every, retry_failed, retrain, from_step)


@app.command()
def launch(
    campaign: str,
    address: Optional[str] = AddressOpt,
    no_progress: bool = QuietOpt,
    log_every: float = LogEveryOpt,
    take_over: bool = TakeOverOpt,
) -> None:
    """Train one expert actor per shard; finished experts are never retrained."""
    _run(lambda: _launch(campaign, address, no_progress, log_every, "soma launch", take_over))


@app.command()
def resume(
    campaign: str,
    experts: Optional[list[str]] = typer.Argument(
        None,
        help="with --retry-failed: the experts to reopen "
        "(expert-0003 or 3; default: every one that failed permanently)",
    ),
    retry_failed: bool = RetryFailedOpt,
    retrain: Optional[list[str]] = typer.Option(
        None, "--retrain", help="train this expert again, from the seed or --from-step (repeatable: expert-0003 or 3)"
    ),
    from_step: Optional[int] = typer.Option(
        None, "--from-step", min=0, help="with --retrain: from the experts' checkpoints of this step"
    ),
    set: Optional[list[str]] = typer.Option(
        None, "--set", "-s", help="a revision of the config first, as soma set writes it (repeatable)"
    ),
    address: Optional[str] = AddressOpt,
    no_progress: bool = QuietOpt,
    log_every: float = LogEveryOpt,
    take_over: bool = TakeOverOpt,
) -> None:
    """Rebuild the campaign state from CAMPAIGN and finish it (after a driver crash, or a stop for its environment:
    exit 4). With --retry-failed, experts that failed permanently are reopened first (after their cause is fixed);
    with --retrain, the named experts train again (from the seed or --from-step); --set revises the config first."""

    def go() -> None:  # EXPERTS without --retry-failed: OPTION_PAIRS
        _launch(
            campaign,
            address,
            no_progress,
            log_every,
            "soma resume",
            take_over,
            list(experts or []) if retry_failed else None,
            list(retrain or []),
            from_step,
            list(set or []),
        )

    _run(go)


@app.command("eval")
def evaluate(
    campaign: str,
    compare: Optional[str] = typer.Option(
        None, "--compare", help="another campaign: its ensemble on the same windows, paired"
    ),
    text: Optional[str] = typer.Option(
        None, "--text", help="long-document mode on this text corpus (dir/.txt/.jsonl/.parquet, s3://)"
    ),
    stride: int = typer.Option(768, "--stride", min=1, help="window stride in long-document mode (bytes, >= 1)"),
    require_all: bool = typer.Option(
        False,
        "--require-all",
        help="refuse (exit 2) a partial campaign instead of "
        "evaluating its experts without a checkpoint as the seed model",
    ),
    as_json: bool = JsonOpt,
) -> None:
    """Evaluate the routed ensemble (and the seed) on the held-out test windows, or on --text documents. An expert
    with no checkpoint (budget_exhausted at step 0, failed_permanently, never launched) is evaluated as the seed
    model under the same routing, and listed."""

    def go() -> None:
        from pipelines.evaluate import evaluate as run
        from pipelines.evaluate import evaluate_text

        store = open_store(campaign)
        cfg = load_config(store)
        store.check_writable()  # the report is written at the end: fail before evaluating
        if text is not None:
            t = evaluate_text(store, cfg, text, stride, require_all)
            if as_json:
                return emit_json({"schema": 1, "mode": "text", **t})
            _say_in_progress(t)
            _say_substituted(t["substituted"])
            out.print(
                f"long-document mode: ensemble {t['ensemble']['nats_per_byte']:.4f} nats/byte, seed "
                f"{t['seed']['nats_per_byte']:.4f} on {t['scored_bytes']:,} bytes; report: {t['report']}"
            )
            return
        other = None
        if compare is not None:
            other_store = open_store(compare)
            other = (other_store, load_config(other_store))
        m = run(store, cfg, other, require_all)
        if as_json:
            return emit_json({"schema": 1, "mode": "windows", "report": f"{store.url}/eval/report.md", **m})
        _say_in_progress(m)
        _say_substituted(m["substituted"], m.get("compare", {}).get("substituted", []), compare)
        if other is not None:
            d = m["compare"]["this_minus_other"]
            out.print(
                f"this minus {compare}: {d['nats_per_byte']:+.4f} nats/byte [{d['ci95'][0]:+.4f}, {d['ci95'][1]:+.4f}]"
            )
        out.print(
            f"ensemble {m['ensemble']['nats_per_byte']:.4f} nats/byte, seed {m['seed']['nats_per_byte']:.4f}, "
            f"uniform {m['uniform']['nats_per_byte']:.4f}; report: {store.url}/eval/report.md"
        )

    _run(go)


@app.command()
def compare(
    campaigns: list[str] = typer.Argument(..., help="two campaigns or more, with the same test windows"),
    baseline: Optional[str] = typer.Option(
        None, "--baseline", help="the campaign the others are paired against (default: the first)"
    ),
    as_json: bool = JsonOpt,
) -> None:
    """Several campaigns' routed ensembles on the same test windows: each one's loss and its paired difference from
    a baseline campaign, as a table (or --json). Campaigns with other test windows are refused; nothing is written."""

    def go() -> None:
        from pipelines.compare import compare as run
        from pipelines.compare import table
        from soma_cluster.breakdown import pick_baseline

        stores = [open_store(c) for c in campaigns]
        loaded = [(s, load_config(s)) for s in stores]  # every target checked before any is evaluated
        if len(campaigns) < 2:
            raise SomaError(
                f"soma compare needs two campaigns or more, got {len(campaigns)}; name the others too "
                f"(soma eval {campaigns[0]} evaluates one)"
            )
        m = run(loaded, pick_baseline(campaigns, [s.url for s in stores], baseline))
        if as_json:
            return emit_json({"schema": 1, **m})
        out.print(table(m), markup=False)

    _run(go)


def _say_in_progress(m: dict) -> None:
    """A campaign evaluated while it trains says so beside the numbers (stdout: it qualifies them)."""
    running, driver = m.get("in_progress") or [], m.get("driver_running")
    if running or driver:
        out.print(
            f"campaign still in training: {len(running)} expert(s) not ended, evaluated at their latest checkpoint "
            "(or as the seed model where they have none)"
            + (f": {', '.join(x['expert'] + ' (' + x['state'] + ')' for x in running[:8])}" if running else "")
            + (f"; {driver} holds it" if driver else ""),
            markup=False,
            soft_wrap=True,
        )


def _say_substituted(mine: list[dict], theirs: list[dict] = (), compare: Optional[str] = None) -> None:
    """A partial campaign's result says so beside the numbers (stdout: it qualifies them)."""
    for subs, whose in ((mine, ""), (theirs, f" of {compare}")):
        if subs:
            out.print(
                f"seed model stands in for {len(subs)} expert(s){whose} with no checkpoint: "
                + ", ".join(f"{s['expert']} ({s['end']}, {s['routed_windows']} windows)" for s in subs),
                markup=False,
                soft_wrap=True,
            )


@app.command()
def status(
    campaign: str,
    as_json: bool = JsonOpt,
    watch: bool = typer.Option(
        False, "--watch", "-w", help="refresh until the driver's last snapshot (or --count refreshes)"
    ),
    interval: float = typer.Option(
        5.0, "--interval", callback=_check_positive, help="seconds between refreshes with --watch"
    ),
    count: int = typer.Option(
        0, "--count", min=0, help="with --watch, stop after this many refreshes (0: until the campaign's driver ends)"
    ),
    wait: float = typer.Option(
        300.0,
        "--wait",
        callback=_check_positive,
        help="with --watch, seconds to wait for a driver to start (a job just submitted, a cluster coming up)",
    ),
) -> None:
    """Every job's state, step/target, expert-val loss, GPU-hours, budget left, retries, node, device and last error,
    with counts by state, GPU-hours by category and an ETA (from the snapshot the driver writes)."""

    def go() -> None:
        from pipelines.status import Watch, load_status, print_full, render, table_width, watch_step
        from soma_cluster.campaignfile import CONFIG_FILE
        from soma_cluster.snapshot import fmt_span

        store = open_store(campaign)
        if watch and not store.exists(CONFIG_FILE):  # a job that starts with soma prepare: watch from its start
            print(f"soma: {store.url} is not prepared yet; waiting up to {fmt_span(wait)} for it", file=sys.stderr)
            deadline = time.monotonic() + wait
            while not store.exists(CONFIG_FILE) and time.monotonic() < deadline:  # bounded by --wait
                time.sleep(min(interval, 5.0))
        cfg = load_config(store)
        shown, since = 0, time.time()
        idle_since, told = since, False
        while True:
            snap = load_status(store, cfg)
            if as_json:
                emit_json(snap, lines=watch)
            else:
                if watch and out.is_terminal:
                    out.clear()
                width = table_width(out)
                print_full(out, render(snap, width), width)
            shown += 1
            if not watch or (count and shown >= count):
                return
            now = time.time()
            step = watch_step(snap, since, idle_since, now, wait)
            if step is Watch.RUNNING:
                idle_since, told = now, False
            elif step is Watch.WAITING and not told:
                print(f"soma: no driver runs {store.url} now; waiting up to {fmt_span(wait)} for one", file=sys.stderr)
                told = True
            if step is Watch.NO_DRIVER:
                print(
                    f"soma: no driver took {store.url} in {fmt_span(wait)}; start one (soma launch / soma resume "
                    f"{store.url}) or watch longer (--wait)",
                    file=sys.stderr,
                )
            if step not in (Watch.RUNNING, Watch.WAITING):
                return
            time.sleep(interval)

    _run(go)


@app.command()
def plan(
    campaign: str,
    gpus: Optional[float] = typer.Option(
        None,
        "--gpus",
        callback=_check_positive,
        help="GPUs to plan for (default: the cluster's GPUs with --address/RAY_ADDRESS, else resources.local_gpus)",
    ),
    recalibrate: bool = typer.Option(
        False, "--recalibrate", help="time the model again (else plan/calibration.json is reused)"
    ),
    address: Optional[str] = typer.Option(
        None,
        "--address",
        help="Ray cluster whose worker times the calibration (default: RAY_ADDRESS, else this process)",
    ),
    wait: float = typer.Option(
        900.0,
        "--wait",
        callback=_check_positive,
        help="on a cluster: seconds to wait for a worker to hold an actor's resources for the calibration",
    ),
    as_json: bool = JsonOpt,
) -> None:
    """Predict GPU-hours by category, wall time on --gpus GPUs and which experts a budget stops (and at what step),
    from the config and a calibration timed on the real model and shards (on a worker of the cluster with
    --address or RAY_ADDRESS, else here); written to CAMPAIGN/plan/."""

    def go() -> None:
        from pipelines.plan import plan as run
        from pipelines.plan import render
        from soma_cluster.checkpoint import training_bytes
        from soma_cluster.ledger import hours_unit

        if gpus is not None and gpus <= 0:
            raise SomaError(f"--gpus {gpus:g}: plan for a positive number of GPUs, e.g. --gpus 8")
        store = open_store(campaign)
        cfg = load_config(store)
        store.check_writable(training_bytes(cfg, 1))  # plan/ is written; the calibration writes a checkpoint
        if gpus is not None and gpus < cfg.resources.num_gpus:
            raise SomaError(
                f"--gpus {gpus:g} cannot hold one actor of resources.num_gpus={cfg.resources.num_gpus}; "
                "pass at least that"
            )
        addr = _address(address)
        remote = addr.text
        if not addr.remote and get_current_context().get_parameter_source("wait") is ParameterSource.COMMANDLINE:
            raise SomaError(
                f"--wait {wait:g} has no effect without a Ray cluster (it waits for a worker of one to time the "
                "calibration); pass --address HOST:PORT (or set RAY_ADDRESS), or leave out --wait"
            )
        if addr.remote:
            from pipelines.raysession import ray_session

            with ray_session(cfg, addr):
                import ray

                planned = gpus if gpus is not None else float(ray.cluster_resources().get("GPU", 0.0))
                if planned < cfg.resources.num_gpus:
                    raise SomaError(
                        f"the cluster at {remote} has {planned:g} GPUs now (an autoscaling one may start with none); "
                        f"pass --gpus K, the GPUs the campaign will run on"
                    )
                p = run(store, cfg, planned, recalibrate, cluster_wait_s=wait)
        else:
            p = run(store, cfg, gpus, recalibrate)
        if as_json:
            return emit_json(p)
        out.print(render(p, hours_unit({p["calibration"]["device"]: 1.0})), markup=False)

    _run(go)


@app.command()
def demo(
    campaign: str = typer.Argument("runs/demo"),
    preset: str = PresetOpt,
    set: Optional[list[str]] = SetOpt,
    address: Optional[str] = AddressOpt,
    take_over: bool = TakeOverOpt,
) -> None:
    """prepare -> seed -> launch -> eval on a preset (tiny by default), then print where the report is."""

    def go() -> None:
        from pipelines.campaign import launch as run_launch
        from pipelines.evaluate import evaluate as run_eval
        from pipelines.prepare import prepare as run_prepare
        from pipelines.raysession import ray_session
        from pipelines.seed import train_seed

        t0 = time.monotonic()
        store = open_store(campaign)
        cfg = _config(preset, None, set, None, None)
        addr = _address(address)
        with hold(store, "soma demo", take_over):
            run_prepare(store, cfg, addr.text or None)
            with ray_session(cfg, addr):
                train_seed(store, cfg)
                run_launch(store, cfg)
            m = run_eval(store, cfg)
        out.print(
            f"demo finished in {time.monotonic() - t0:.0f} s: ensemble {m['ensemble']['nats_per_byte']:.4f} nats/byte "
            f"vs seed {m['seed']['nats_per_byte']:.4f} vs uniform {m['uniform']['nats_per_byte']:.4f}"
        )
        out.print(f"report: {store.url}/eval/report.md")

    _run(go)


@app.command()
def fork(
    parent: str,
    campaign: str,
    set: Optional[list[str]] = SetOpt,
    warm: bool = typer.Option(
        False, "--warm", help="start the experts from PARENT's latest checkpoints, not the seed (train on from there)"
    ),
) -> None:
    """A new campaign sharing PARENT's data and seed model, with training-side overrides (e.g. train.method=bptt);
    --warm: its experts train on from where PARENT's stopped."""

    def go() -> None:
        from pipelines.fork import fork as run
        from soma_cluster.config import merge_trees, validated

        parent_store = open_store(parent)
        child = open_store(campaign)
        if parent_store.local and child.local:
            a, b = os.path.realpath(parent_store.root), os.path.realpath(child.root)
            if b == a or b.startswith(a + os.sep) or a.startswith(b + os.sep):
                raise SomaError(
                    f"soma fork {parent} {campaign}: the new campaign must lie outside its parent (and hold no "
                    "part of it); pass a new directory beside it"
                )
        child.check_writable()
        tree = merge_trees(load_config(parent_store).model_dump(mode="json"), parse_overrides(set or []))
        run(parent_store, child, validated(tree, "fork overrides"), warm)

    _run(go)


@app.command()
def experiment(
    name: str = typer.Argument(..., help="variance, summed, zo-compare or scaling (soma_cluster/presets/experiments)"),
    directory: str = typer.Argument(..., help="where its campaigns, results.json and report.md go"),
    scale: str = typer.Option(
        "small", "--scale", callback=_check_scale, help="small (2 CPU cores, <= 30 min) or paper (a GPU cluster)"
    ),
    set: Optional[list[str]] = SetOpt,
    address: Optional[str] = AddressOpt,
    no_progress: bool = QuietOpt,
) -> None:
    """Run one of the paper's comparisons: every arm a campaign (prepare or fork, seed, launch, eval), then a report."""

    def go() -> None:
        from pipelines.experiment import run_experiment

        addr = _address(address)
        open_store(directory).check_writable()  # before any arm is prepared or Ray starts
        res = run_experiment(name, directory, scale, set or [], addr.text or None, not no_progress)
        out.print(
            f"experiment {res['experiment']} ({res['scale']}) finished in {res['wall_seconds']:.0f} s; "
            f"report: {directory.rstrip('/')}/report.md"
        )

    _run(go)


@app.command()
def report(
    directories: list[str] = typer.Argument(..., help="experiment directories (each holds results.json)"),
    readme: Optional[str] = typer.Option(None, "--readme", help="rewrite this README's results section from them"),
) -> None:
    """Re-render each experiment's report.md and figures from its results.json; optionally the README's results."""

    def go() -> None:
        from pipelines.report import readme_section, update_readme, write_report
        from soma_cluster.diskerrors import require_writable_dir
        from soma_cluster.targets import EXPERIMENT_FILE, RESULTS_FILE, not_an_experiment

        stores = [open_store(d) for d in directories]
        if readme:
            if not os.path.isfile(readme):
                raise SomaError(
                    f"--readme {readme} is not a file; pass the README whose results section to rewrite "
                    "(it must exist and hold one)"
                )
            require_writable_dir(os.path.dirname(os.path.abspath(readme)), what="the README's directory")
        results = []
        for store in stores:  # every directory is checked and read before any report is rewritten
            store.check_writable()
            if not store.exists(RESULTS_FILE):
                marker = store.read_json(EXPERIMENT_FILE) if store.exists(EXPERIMENT_FILE) else {}
                raise not_an_experiment(store.url, store.listdir(""), marker.get("experiment"))
            results.append(store.read_json(RESULTS_FILE))
        done = []
        for store, res in zip(stores, results, strict=True):
            out.print(f"report: {write_report(store, res)}")
            done.append((store.url, res))
        if readme:
            update_readme(readme, readme_section(done))
            out.print(f"{readme}: results section rewritten from {len(done)} experiment(s)")

    _run(go)


@app.command()
def track(
    campaign: str,
    backend: Optional[list[str]] = typer.Option(
        None,
        "--backend",
        "-b",
        help="mlflow or tensorboard (repeatable; default: the campaign's tracking.backends, else "
        "SOMA_TRACKING_BACKENDS)",
    ),
    take_over: bool = TakeOverOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Backfill the campaign's experiment trackers (MLflow, TensorBoard) from its record: events, ledger, config and
    eval; only what a tracker lacks is sent (running it twice sends nothing more). Targets: docs/tracking.md."""

    def go() -> None:
        from pipelines.track import backfill
        from soma_cluster.tracking import Backend

        for b in backend or []:
            if b not in tuple(Backend):
                raise SomaError(f"--backend {b!r}: choose one of {', '.join(Backend)}")
        store = open_store(campaign)
        cfg = load_config(store)
        with hold(store, "soma track", take_over):
            done = backfill(store, cfg, list(backend or []))
        if as_json:
            return emit_json(done)
        for name, r in done["backends"].items():
            out.print(
                f"{name} ({r['where']}): sent {r['points']} points, {r['metrics']} of them metrics, "
                f"to {len(r['runs'])} runs",
                markup=False,
            )

    _run(go)


@app.command()
def presets(as_json: bool = JsonOpt) -> None:
    """List the presets and the experiments."""

    def go() -> None:
        from soma_cluster.experiments import experiment_names

        if as_json:
            rows = []
            for name in preset_names():
                cfg = resolve(name)
                rows.append(
                    {
                        "name": name,
                        "n_experts": cfg.n_experts,
                        "d": cfg.model.d,
                        "n_pert": cfg.spsa.n_pert,
                        "batch": cfg.spsa.batch,
                        "seq_len": cfg.spsa.seq_len,
                        "updates": cfg.train.updates,
                        "num_gpus": cfg.resources.num_gpus,
                        "experts_per_actor": cfg.resources.experts_per_actor,
                        "expert_gpu_hours": cfg.budget.expert_gpu_hours,
                        "campaign_gpu_hours": cfg.budget.campaign_gpu_hours,
                    }
                )
            return emit_json({"schema": 1, "presets": rows, "experiments": experiment_names()})
        from soma_cluster.model import campaign_param_count

        for name in preset_names():
            c = resolve(name)
            out.print(
                f"{name}: N = {c.n_experts} experts, d = {c.model.d}, "
                f"{campaign_param_count(c.model, c.n_experts):,} parameters, {c.train.updates} updates of "
                f"{c.spsa.n_pert} probes x batch {c.spsa.batch} x {c.spsa.seq_len} bytes, "
                f"{c.resources.num_gpus:g} GPU per actor",
                markup=False,
                soft_wrap=True,
            )
        for name in experiment_names():
            out.print(f"experiment {name}", markup=False)

    _run(go)


@app.command("set")
def set_(
    campaign: str,
    changes: list[str] = typer.Argument(..., metavar="KEY=VALUE ...", help="e.g. budget.campaign_gpu_hours=2.0"),
    wait: Optional[float] = typer.Option(
        None, "--wait", callback=_check_positive, help="with a driver running: wait this many seconds for it to apply"
    ),
    as_json: bool = JsonOpt,
) -> None:
    """Change a campaign's budgets, retries, concurrency or train.updates, running or not: a new revision of its
    config, applied by the running driver within a second (else by the next soma resume). Ended experts the change
    lets train on continue from their latest checkpoint (docs/cli.md, "Changing a campaign")."""

    def go() -> None:
        from pipelines.revise import set_config

        store = open_store(campaign)
        load_config(store)  # not a campaign (or a damaged revision): refused before anything is written
        r = set_config(store, list(changes), wait)
        if as_json:
            return emit_json(r)
        rev = r["revision"]
        out.print(f"revision {rev['rev']} of {store.url}: {_changed(rev)} (by {rev['by']})", markup=False)
        n = len(r["reopens"])
        trains = f"; {n} ended expert(s) will train on from their latest checkpoint" if n else ""
        if r["driver"] is None:
            out.print(f"no driver holds the campaign: soma resume {store.url} applies it{trains}", markup=False)
        elif r["applied"]:
            out.print(f"applied by {r['driver']} after {r['applied_after_s']:.1f} s{trains}", markup=False)
        elif r["applied"] is False:
            raise SomaError(
                f"{r['driver']} did not apply revision {rev['rev']} within --wait {wait:g} s; it is recorded, and the "
                f"driver (or the next soma resume {store.url}) applies it"
            )
        else:
            out.print(
                f"{r['driver']} applies it within a second (or, if it ends first, soma resume){trains}", markup=False
            )

    _run(go)


def _changed(rev: dict) -> str:
    return ", ".join(f"{k} {rev['was'].get(k)} -> {v}" for k, v in rev["set"].items())


StepOpt = typer.Option(
    None, "--step", min=0, help="a campaign's checkpoints of this step (default: each expert's latest)"
)
DeviceOpt = typer.Option(None, "--device", help="torch device: cpu, cuda or cuda:N (default: cuda when available)")


def _check_temperature(value: float) -> float:
    if not 0 < value <= 1000:  # NaN fails every comparison
        _bad(f"--temperature {value!r}: pass a number > 0 and at most 1000 (--top-k 1 samples greedily)")
    return value


@app.command()
def score(
    campaign: str,
    inputs: Optional[list[str]] = typer.Argument(
        None, metavar="[FILE ...|-]", help="files, directories (their files) or - (standard input); none: stdin"
    ),
    lines: bool = typer.Option(False, "--lines", help="each line of an input is a document"),
    step: Optional[int] = StepOpt,
    device: Optional[str] = DeviceOpt,
) -> None:
    """Score documents with the routed ensemble (a campaign or a soma export): one JSON line per document on stdout
    (bytes, scored_bytes, nats, nats/byte, bits/byte, windows, experts), any length (docs/inference.md)."""

    def go() -> None:
        from pipelines.inference import score as run

        t = run(campaign, list(inputs or []), lines, device, step)
        per = f": {t['nats'] / t['scored_bytes']:.4f} nats/byte" if t["scored_bytes"] else ""
        print(
            f"scored {t['documents']} document(s), {t['scored_bytes']:,} of {t['bytes']:,} bytes{per}", file=sys.stderr
        )

    _run(go, "the documents scored before it are on stdout; nothing was written anywhere else")


@app.command()
def sample(
    campaign: str,
    prompt: Optional[list[str]] = typer.Option(None, "--prompt", help="the text to continue (repeatable: a batch)"),
    prompt_file: Optional[str] = typer.Option(None, "--prompt-file", help="a file (or -) whose bytes are the prompt"),
    max_bytes: int = typer.Option(256, "--max-bytes", min=0, max=10_000_000, help="bytes to generate"),
    temperature: float = typer.Option(1.0, "--temperature", callback=_check_temperature, help="> 0; 1: as trained"),
    top_k: Optional[int] = typer.Option(None, "--top-k", min=1, max=256, help="sample among the k likeliest bytes"),
    seed: Optional[int] = typer.Option(None, "--seed", min=0, max=2**63 - 1, help="random seed (default: fresh)"),
    as_json: bool = typer.Option(False, "--json", help="one JSON line per prompt (text, base64, route)"),
    step: Optional[int] = StepOpt,
    device: Optional[str] = DeviceOpt,
) -> None:
    """Generate bytes after a prompt with the routed ensemble (a campaign or a soma export), streamed to stdout as
    they are drawn; the route is fixed on the prompt (docs/inference.md)."""

    def go() -> None:
        from pipelines.inference import load, prompts, sample

        open_store(campaign)  # a wrong target is named before a prompt is read
        texts = prompts(list(prompt or []), prompt_file)
        lm = load(campaign, device, step)
        sample(lm, texts, max_bytes, temperature, top_k, seed, as_json, sys.stdout.write_bytes)

    _run(go, "the bytes drawn before it are on stdout; nothing was written anywhere else")


@app.command()
def export(
    campaign: str,
    directory: str,
    dtype: str = typer.Option("float32", "--dtype", help="weights as float32, float16 or bfloat16"),
    as_json: bool = JsonOpt,
) -> None:
    """Write the routed ensemble as a self-contained DIRECTORY (weights in safetensors, router, config, model card)
    that soma score, soma sample and RoutedLM.load read without the campaign and without Ray."""

    def go() -> None:
        from pipelines.inference import export_campaign

        r = export_campaign(campaign, directory, dtype)
        if as_json:
            return emit_json({"schema": 1, **r})
        subs = f"; the seed model stands in for {', '.join(r['substituted'])}" if r["substituted"] else ""
        out.print(
            f"exported {r['experts']} experts ({r['dtype']}) to {r['export']}: {r['bytes'] / 1e6:.2f} MB, "
            f"{100 * r['ratio']:.0f}% of the {r['checkpoint_bytes'] / 1e6:.2f} MB of checkpoints it came from{subs}",
            markup=False,
            soft_wrap=True,
        )

    _run(go, "no export was made (what was staged is removed); run the same command again")


@app.command()
def serve(
    campaign: str,
    address: Optional[str] = AddressOpt,
    host: str = typer.Option("127.0.0.1", "--host", help="the HTTP address Serve's proxies listen on"),
    port: int = typer.Option(8000, "--port", min=1, max=65535, help="the HTTP port Serve's proxies listen on"),
    replicas: int = typer.Option(1, "--replicas", min=1, max=4096, help="expert replicas (each holds every expert)"),
    gpus: float = typer.Option(0.0, "--gpus-per-replica", min=0, max=64, help="GPUs of an expert replica"),
    step: Optional[int] = StepOpt,
    detach: bool = typer.Option(False, "--detach", help="deploy and exit; the application stays on the cluster"),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="check the source and settings, print the Serve config file that deploys them, exit"
    ),
    overrides: Optional[list[str]] = typer.Option(
        None, "--set", "-s", help="any setting of the application (docs/serving.md), e.g. --set max_batch_windows=512"
    ),
    as_json: bool = JsonOpt,
) -> None:
    """Serve the routed ensemble (a campaign or a soma export) over HTTP on Ray Serve: POST /v1/score and
    /v1/generate, GET /healthz (docs/serving.md). Without --detach, serves until SIGINT/SIGTERM."""

    def go() -> None:
        from pipelines.serve import as_json as served_json
        from pipelines.serve import serve_campaign
        from soma_cluster.serving import with_overrides

        base = {"source": campaign, "replicas": replicas, "gpus_per_replica": gpus, "step": step}
        settings = with_overrides(base, list(overrides or []))
        if dry_run:
            import yaml

            from pipelines.serve import checked_source, serve_config

            routing = checked_source(settings)
            doc = serve_config(settings, host, port)
            if as_json:
                return emit_json({"schema": 1, **doc})
            sys.stdout.write(yaml.safe_dump(doc, sort_keys=False))
            print(f"{routing.source}: {routing.config.n_experts} experts; the config above deploys it", file=sys.stderr)
            return

        def show(served) -> None:
            if as_json:
                emit_json(served_json(served))
            else:
                print(served.url, flush=True)
            print(
                f"serving {served.source} ({served.n_experts} experts, {served.replicas} replica(s)) at {served.url}"
                + ("; it stays deployed (serve delete soma removes it)" if served.detached else "; Ctrl-C stops"),
                file=sys.stderr,
                flush=True,
            )

        serve_campaign(settings, address, host, port, detach, show)

    _run(go, "the application was removed; nothing was written")


for _info in app.registered_commands:  # every command, one added later included, checks its inputs (_Checked)
    _info.cls = _Checked

if __name__ == "__main__":
    app()
