"""The `soma` command line: one function per command, each wiring its options to a flow in pipelines/. The harness
they share (bad input as one line, exit codes, shared options) is pipelines/cli_harness.py."""

from __future__ import annotations

import sys
import time
from typing import Optional

import typer

from pipelines.campaign_lease import hold, refuse_held
from pipelines.cli_harness import (
    AddressOpt,
    ConfigOpt,
    CorpusOpt,
    DeviceOpt,
    ExpertsOpt,
    GenerationOpt,
    JsonOpt,
    LogEveryOpt,
    OneLineErrors,
    PresetOpt,
    QuietOpt,
    RetryFailedOpt,
    SetOpt,
    StepOpt,
    TakeOverOpt,
    ThreadsOpt,
    check_every_command,
    check_jobs,
    check_positive,
    check_scale,
    check_states,
    checked_address,
    config_from_options,
    generation_config,
    given_on_command_line,
    print_version,
    run_command,
)
from pipelines.common import claim_campaign, emit_json, load_config, open_store, out
from soma_cluster.config import preset_names, resolve
from soma_cluster.errors import SomaError

app = typer.Typer(
    cls=OneLineErrors,
    add_completion=False,
    no_args_is_help=True,
    help="SOMA-style sharded zero-order pretraining campaigns on Ray. "
    "Data (tables, results, --json) goes to stdout; logs and progress to stderr.",
)


@app.callback()
def main(
    version: bool = typer.Option(
        False, "--version", callback=print_version, is_eager=True, help="print the versions and exit"
    ),
) -> None:
    """SOMA-style sharded zero-order pretraining campaigns on Ray."""


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
        store, cfg = open_store(campaign), config_from_options(preset, config, set, corpus, experts)
        addr = checked_address(address)  # a wrong address is refused before anything is written
        claim_campaign(store, cfg, write=False)  # another campaign's directory is refused before its lease is touched
        refuse_held(store, "soma prepare", take_over)
        from pipelines.prepare import check_prepare
        from pipelines.prepare import prepare as run  # torch and scikit-learn: a second, after what refuses at once

        check_prepare(store, cfg)  # a corpus that is not there, a tracker that cannot work: before the lease

        with hold(store, "soma prepare", take_over):
            run(store, cfg, addr.text or None)

    run_command(go)


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
        from pipelines.seed import require_prepared, train_seed
        from soma_cluster.checkpoint import training_bytes

        store = open_store(campaign)
        cfg = load_config(store)
        refuse_held(store, "soma seed", take_over)  # a prepare still running is why there are no shards yet
        addr = checked_address(address)  # the command's own arguments before the campaign's state
        require_prepared(store)  # an interrupted prepare: refused before the lease and Ray
        with (
            hold(store, "soma seed", take_over, training_bytes(cfg, 1)),
            ray_session(cfg, addr),
        ):  # checked before Ray
            train_seed(store, cfg, not no_progress, log_every, retry_failed)

    run_command(go)


@app.command()
def launch(
    campaign: str,
    address: Optional[str] = AddressOpt,
    no_progress: bool = QuietOpt,
    log_every: float = LogEveryOpt,
    take_over: bool = TakeOverOpt,
) -> None:
    """Train one expert actor per shard; finished experts are never retrained."""

    def go() -> None:
        from pipelines.campaign import launch_command

        launch_command(campaign, address, not no_progress, log_every, "soma launch", take_over)

    run_command(go)


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

    def go() -> None:  # EXPERTS without --retry-failed: cli_harness.OPTION_PAIRS
        from pipelines.campaign import launch_command

        launch_command(
            campaign,
            address,
            not no_progress,
            log_every,
            "soma resume",
            take_over,
            list(experts or []) if retry_failed else None,
            list(retrain or []),
            from_step,
            list(set or []),
        )

    run_command(go)


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
        store = open_store(campaign)
        cfg = load_config(store)
        from pipelines.evaluate import evaluate_for, show_evaluation  # checks every input, then the place, then works

        doc = evaluate_for(store, cfg, text, stride, require_all, compare)
        if as_json:
            return emit_json(doc)
        show_evaluation(store, doc, compare)

    run_command(go)


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
        stores = [open_store(c) for c in campaigns]
        loaded = [(s, load_config(s)) for s in stores]  # every target checked before any is evaluated
        if len(campaigns) < 2:
            raise SomaError(
                f"soma compare needs two campaigns or more, got {len(campaigns)}; name the others too "
                f"(soma eval {campaigns[0]} evaluates one)"
            )
        from pipelines.compare import compare as run  # torch: after the targets are checked
        from pipelines.compare import table
        from soma_cluster.breakdown import pick_baseline

        m = run(loaded, pick_baseline(campaigns, [s.url for s in stores], baseline))
        if as_json:
            return emit_json({"schema": 1, **m})
        out.print(table(m), markup=False)

    run_command(go)


@app.command()
def status(
    campaign: str,
    as_json: bool = JsonOpt,
    watch: bool = typer.Option(
        False, "--watch", "-w", help="refresh until the driver's last snapshot (or --count refreshes)"
    ),
    interval: float = typer.Option(
        5.0, "--interval", callback=check_positive, help="seconds between refreshes with --watch"
    ),
    count: int = typer.Option(
        0, "--count", min=0, help="with --watch, stop after this many refreshes (0: until the campaign's driver ends)"
    ),
    wait: float = typer.Option(
        300.0,
        "--wait",
        callback=check_positive,
        help="with --watch, seconds to wait for a driver to start (a job just submitted, a cluster coming up)",
    ),
    every: bool = typer.Option(False, "--all", "-a", help="list every job, not the one-screen summary"),
    state: Optional[str] = typer.Option(
        None,
        "--state",
        "-t",
        callback=check_states,
        help="list the jobs in these states: a comma list (e.g. failed,retrying; aliases failed, ended, active, all)",
    ),
    expert: Optional[str] = typer.Option(
        None,
        "--expert",
        "-e",
        callback=check_jobs,
        help="list these jobs: a comma list of expert numbers, ranges and names (e.g. 7,12-15,expert-0020,seed)",
    ),
) -> None:
    """The campaign on one screen at any N: counts by state (the seed apart), GPU-hours and dollars, updates done and
    the ETA, and the experts that need attention (failed, retrying, silent, over budget, slow), from the snapshot the
    driver writes. --all, --state and --expert list jobs (state, step/target, losses, GPU-hours, budget left,
    retries, device, node, last error); --json gives every field."""

    def go() -> None:
        from pipelines.status import Selection, show_status
        from soma_cluster.statusview import parse_jobs, parse_states

        sel = Selection(
            states=parse_states(state) if state is not None else None,
            jobs=parse_jobs(expert) if expert is not None else None,
            every=every,
        )
        show_status(open_store(campaign), as_json, watch, interval, count, wait, sel)

    run_command(go)


@app.command()
def plan(
    campaign: str,
    gpus: Optional[float] = typer.Option(
        None,
        "--gpus",
        callback=check_positive,
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
        callback=check_positive,
        help="on a cluster: seconds to wait for a worker to hold an actor's resources for the calibration",
    ),
    as_json: bool = JsonOpt,
) -> None:
    """Predict GPU-hours by category, wall time on --gpus GPUs and which experts a budget stops (and at what step),
    from the config and a calibration timed on the real model and shards (on a worker of the cluster with
    --address or RAY_ADDRESS, else here); written to CAMPAIGN/plan/."""

    def go() -> None:
        from pipelines.plan import plan_for, render
        from soma_cluster.ledger import hours_unit

        if gpus is not None and gpus <= 0:
            raise SomaError(f"--gpus {gpus:g}: plan for a positive number of GPUs, e.g. --gpus 8")
        store = open_store(campaign)
        cfg = load_config(store)
        p = plan_for(store, cfg, gpus, recalibrate, address, wait, given_on_command_line("wait"))
        if as_json:
            return emit_json(p)
        out.print(render(p, hours_unit({p["calibration"]["device"]: 1.0})), markup=False)

    run_command(go)


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
        from pipelines.demo import demo as run
        from pipelines.demo import summary_lines

        t0 = time.monotonic()
        store = open_store(campaign)
        cfg = config_from_options(preset, None, set, None, None)
        m = run(store, cfg, checked_address(address), take_over)
        for line in summary_lines({**m, "n_experts": cfg.n_experts}, time.monotonic() - t0):
            out.print(line, markup=False)
        out.print(f"report: {store.url}/eval/report.md")

    run_command(go)


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
        from pipelines.fork import fork_command

        fork_command(parent, campaign, list(set or []), warm)

    run_command(go)


@app.command()
def experiment(
    name: str = typer.Argument(..., help="variance, summed, zo-compare or scaling (soma_cluster/presets/experiments)"),
    directory: str = typer.Argument(..., help="where its campaigns, results.json and report.md go"),
    scale: str = typer.Option(
        "small", "--scale", callback=check_scale, help="small (2 CPU cores, <= 30 min) or paper (a GPU cluster)"
    ),
    set: Optional[list[str]] = SetOpt,
    address: Optional[str] = AddressOpt,
    no_progress: bool = QuietOpt,
) -> None:
    """Run one of the paper's comparisons: every arm a campaign (prepare or fork, seed, launch, eval), then a report."""

    def go() -> None:
        from pipelines.experiment import run_experiment

        addr = checked_address(address)
        res = run_experiment(  # the directory is checked (kind, then room) before any arm is prepared or Ray starts
            name, directory, scale, set or [], addr.text or None, not no_progress
        )
        out.print(
            f"experiment {res['experiment']} ({res['scale']}) finished in {res['wall_seconds']:.0f} s; "
            f"report: {directory.rstrip('/')}/report.md"
        )

    run_command(go)


@app.command()
def report(
    directories: list[str] = typer.Argument(..., help="experiment directories (each holds results.json)"),
    readme: Optional[str] = typer.Option(None, "--readme", help="rewrite this README's results section from them"),
) -> None:
    """Re-render each experiment's report.md and figures from its results.json; optionally the README's results."""

    def go() -> None:
        from pipelines.report import read_results, readme_section, update_readme, write_report

        stores = [open_store(d) for d in directories]
        results = read_results(stores, readme)  # every input checked and read before any report is rewritten
        done = []
        for store, res in zip(stores, results, strict=True):
            out.print(f"report: {write_report(store, res)}")
            done.append((store.url, res))
        if readme:
            update_readme(readme, readme_section(done))
            out.print(f"{readme}: results section rewritten from {len(done)} experiment(s)")

    run_command(go)


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
        from pipelines.track import backfill, backfill_target
        from soma_cluster.trackpoints import Backend

        for b in backend or []:
            if b not in tuple(Backend):
                raise SomaError(f"--backend {b!r}: choose one of {', '.join(Backend)}")
        store = open_store(campaign)
        cfg = load_config(store)
        refuse_held(store, "soma track", take_over)
        backfill_target(store, cfg, list(backend or []))  # a tracker that cannot be reached from here: before the lease
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

    run_command(go)


@app.command()
def presets(as_json: bool = JsonOpt) -> None:
    """List the presets and the experiments."""

    def go() -> None:
        from soma_cluster.experimentspecs import experiment_names

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

    run_command(go)


@app.command("set")
def set_(
    campaign: str,
    changes: list[str] = typer.Argument(..., metavar="KEY=VALUE ...", help="e.g. budget.campaign_gpu_hours=2.0"),
    wait: Optional[float] = typer.Option(
        None, "--wait", callback=check_positive, help="with a driver running: wait this many seconds for it to apply"
    ),
    as_json: bool = JsonOpt,
) -> None:
    """Change a campaign's budgets, retries, concurrency or train.updates, running or not: a new revision of its
    config, applied by the running driver at its next look (within 1.5 s of its loop's time; longer on a loaded host,
    --wait waits for it), else by the next soma resume. Ended experts the change lets train on continue from their
    latest checkpoint (docs/cli.md, "Changing a campaign")."""

    def go() -> None:
        from pipelines.revision_pickup import say_applied, set_config

        store = open_store(campaign)
        load_config(store)  # not a campaign (or a damaged revision): refused before anything is written
        r = set_config(store, list(changes), wait)
        if as_json:
            return emit_json(r)
        say_applied(store, r, wait)

    run_command(go)


@app.command()
def score(
    campaign: str,
    inputs: Optional[list[str]] = typer.Argument(
        None, metavar="[FILE ...|-]", help="files, directories (their files) or - (standard input); none: stdin"
    ),
    lines: bool = typer.Option(False, "--lines", help="each line of an input is a document"),
    per_byte: bool = typer.Option(False, "--per-byte", help="list each scored byte's nats in each record"),
    routes: bool = typer.Option(False, "--routes", help="list every segment's route in each record (json.md)"),
    step: Optional[int] = StepOpt,
    device: Optional[str] = DeviceOpt,
    threads: Optional[int] = ThreadsOpt,
) -> None:
    """Score documents with the routed ensemble (a campaign or a soma export): one JSON line per document on stdout
    (bytes, scored_bytes, nats, nats/byte, bits/byte, windows, experts, and the routing that produced them), any
    length (docs/inference.md)."""

    def go() -> None:
        from pipelines.inference import Listed
        from pipelines.inference import score as run

        t = run(campaign, list(inputs or []), lines, device, step, Listed(per_byte, routes), threads)
        per = f": {t['nats'] / t['scored_bytes']:.4f} nats/byte" if t["scored_bytes"] else ""
        print(
            f"scored {t['documents']} document(s), {t['scored_bytes']:,} of {t['bytes']:,} bytes{per}", file=sys.stderr
        )

    run_command(go, "the documents scored before it are on stdout; nothing was written anywhere else")


@app.command()
def sample(
    campaign: str,
    prompt: Optional[list[str]] = typer.Option(None, "--prompt", help="the text to continue (repeatable: a batch)"),
    prompt_file: Optional[str] = typer.Option(None, "--prompt-file", help="a file (or -) whose bytes are the prompt"),
    max_bytes: int = GenerationOpt("max_bytes"),
    temperature: float = GenerationOpt("temperature"),
    top_k: Optional[int] = GenerationOpt("top_k"),
    seed: Optional[int] = GenerationOpt("seed"),
    as_json: bool = typer.Option(False, "--json", help="one JSON line per prompt (text, base64, route)"),
    step: Optional[int] = StepOpt,
    device: Optional[str] = DeviceOpt,
    threads: Optional[int] = ThreadsOpt,
) -> None:
    """Generate bytes after a prompt with the routed ensemble (a campaign or a soma export), streamed to stdout as
    they are drawn; the route is fixed on the prompt (docs/inference.md)."""

    def go() -> None:
        open_store(campaign)  # a wrong target is named before a prompt is read
        from pipelines.inference import load, prompts, sample

        config = generation_config(max_bytes=max_bytes, temperature=temperature, top_k=top_k, seed=seed)
        texts = prompts(list(prompt or []), prompt_file)
        lm = load(campaign, device, step, threads)
        sample(lm, texts, config, as_json, sys.stdout.write_bytes)

    run_command(go, "the bytes drawn before it are on stdout; nothing was written anywhere else")


@app.command()
def export(
    campaign: str,
    directory: str,
    dtype: str = typer.Option("float32", "--dtype", help="weights as float32, float16 or bfloat16"),
    license: str = typer.Option(
        "other", "--license", help="the model card's license (a Hugging Face identifier: apache-2.0, mit, ...)"
    ),
    as_json: bool = JsonOpt,
) -> None:
    """Write the routed ensemble as a self-contained DIRECTORY (weights in safetensors, router, config, model card)
    that soma score, soma sample and RoutedLM.load read without the campaign and without Ray."""

    def go() -> None:
        from pipelines.inference import export_campaign

        r = export_campaign(campaign, directory, dtype, license)
        if as_json:
            return emit_json({"schema": 1, **r})
        subs = f"; the seed model stands in for {', '.join(r['substituted'])}" if r["substituted"] else ""
        out.print(
            f"exported {r['experts']} experts ({r['dtype']}) to {r['export']}: {r['bytes'] / 1e6:.2f} MB, "
            f"{100 * r['ratio']:.0f}% of the {r['checkpoint_bytes'] / 1e6:.2f} MB of checkpoints it came from{subs}",
            markup=False,
            soft_wrap=True,
        )

    run_command(go, "no export was made (what was staged is removed); run the same command again")


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
        from pipelines.serve import absolute, serve_campaign
        from pipelines.serve import as_json as served_json
        from soma_cluster.inference.serveinput import with_overrides

        base = {"source": absolute(campaign), "replicas": replicas, "gpus_per_replica": gpus, "step": step}
        settings = with_overrides(base, list(overrides or []))
        if dry_run:
            from pipelines.serve import print_serve_config

            return print_serve_config(settings, host, port, as_json)

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

    run_command(go, "the application was removed; nothing was written")


check_every_command(app)

if __name__ == "__main__":
    app()
