"""The `soma` command line: thin wiring over the pipelines. Bad input exits 2 with one line."""
from __future__ import annotations

import sys
import time
from typing import Callable, Optional

import typer

from pipelines.common import console, load_config, open_store
from soma_cluster.config import CampaignConfig, parse_overrides, preset_names, resolve
from soma_cluster.errors import JobsFailed, SomaError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="SOMA-style sharded zero-order pretraining campaigns on Ray.")

PresetOpt = typer.Option("tiny", "--preset", "-p", help="preset name (soma_cluster/presets/*.yaml)")
ConfigOpt = typer.Option(None, "--config", "-c", help="YAML file layered over the preset")
SetOpt = typer.Option(None, "--set", "-s", help="override, e.g. --set spsa.n_pert=16 (repeatable)")
CorpusOpt = typer.Option(None, "--corpus", help="corpus path or s3:// URL (default: the built-in corpus)")
ExpertsOpt = typer.Option(None, "--experts", "-n", help="number of experts N")
AddressOpt = typer.Option(None, "--address", help="Ray cluster address (default: RAY_ADDRESS, else a local Ray)")
QuietOpt = typer.Option(False, "--no-progress", help="no progress bars")


def _run(fn: Callable[[], None]) -> None:
    """Exit codes: 0 the command really succeeded; 2 bad input (one `error:` line naming the thing and the fix);
    3 a campaign ran but jobs failed permanently (their retries spent); 1 a bug (a traceback)."""
    try:
        fn()
    except SomaError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise typer.Exit(2) from None
    except JobsFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise typer.Exit(JobsFailed.exit_code) from None


def _config(preset: str, config: Optional[str], sets: Optional[list[str]], corpus: Optional[str], experts: Optional[int]) -> CampaignConfig:
    overrides = parse_overrides(sets or [])
    if corpus is not None:
        if not corpus.strip():
            raise SomaError("--corpus is empty; pass a corpus directory, file or s3:// URL (or leave it out: built-in corpus)")
        overrides.setdefault("corpus", {})["source"] = corpus
    if experts is not None:
        if experts < 1:
            raise SomaError(f"--experts/-n {experts}: a campaign needs at least 1 expert; pass e.g. -n 4")
        overrides["n_experts"] = experts
    return resolve(preset, overrides, config)


@app.command()
def prepare(campaign: str, preset: str = PresetOpt, config: Optional[str] = ConfigOpt, set: Optional[list[str]] = SetOpt,
            corpus: Optional[str] = CorpusOpt, experts: Optional[int] = ExpertsOpt) -> None:
    """Build the corpus, fit the router and write one Arrow shard per expert under CAMPAIGN."""
    def go() -> None:
        from pipelines.prepare import prepare as run
        run(open_store(campaign), _config(preset, config, set, corpus, experts))
    _run(go)


@app.command()
def seed(campaign: str, address: Optional[str] = AddressOpt, no_progress: bool = QuietOpt) -> None:
    """Train the seed model (N = 1) on the whole corpus."""
    def go() -> None:
        from pipelines.raysession import ray_session
        from pipelines.seed import train_seed
        store = open_store(campaign)
        cfg = load_config(store)
        with ray_session(cfg, address):
            train_seed(store, cfg, not no_progress)
    _run(go)


def _launch(campaign: str, address: Optional[str], no_progress: bool) -> None:
    from pipelines.campaign import launch as run
    from pipelines.raysession import ray_session
    store = open_store(campaign)
    cfg = load_config(store)
    with ray_session(cfg, address):
        run(store, cfg, not no_progress)


@app.command()
def launch(campaign: str, address: Optional[str] = AddressOpt, no_progress: bool = QuietOpt) -> None:
    """Train one expert actor per shard; finished experts are never retrained."""
    _run(lambda: _launch(campaign, address, no_progress))


@app.command()
def resume(campaign: str, address: Optional[str] = AddressOpt, no_progress: bool = QuietOpt) -> None:
    """Rebuild the campaign state from CAMPAIGN and finish it (after a driver crash)."""
    _run(lambda: _launch(campaign, address, no_progress))


@app.command("eval")
def evaluate(campaign: str,
             compare: Optional[str] = typer.Option(None, "--compare", help="another campaign: its ensemble on the same windows, paired"),
             text: Optional[str] = typer.Option(None, "--text", help="long-document mode on this text corpus (dir/.txt/.jsonl/.parquet, s3://)"),
             stride: int = typer.Option(768, "--stride", help="window stride in long-document mode")) -> None:
    """Evaluate the routed ensemble (and the seed) on the held-out test windows, or on --text documents."""
    def go() -> None:
        from pipelines.evaluate import evaluate as run
        from pipelines.evaluate import evaluate_text
        store = open_store(campaign)
        cfg = load_config(store)
        if text is not None:
            t = evaluate_text(store, cfg, text, stride)
            console.print(f"long-document mode: ensemble {t['ensemble']['nats_per_byte']:.4f} nats/byte, seed "
                          f"{t['seed']['nats_per_byte']:.4f} on {t['scored_bytes']:,} bytes; report: {t['report']}")
            return
        other = None
        if compare is not None:
            other_store = open_store(compare)
            other = (other_store, load_config(other_store))
        m = run(store, cfg, other)
        if other is not None:
            d = m["compare"]["this_minus_other"]
            console.print(f"this minus {compare}: {d['nats_per_byte']:+.4f} nats/byte [{d['ci95'][0]:+.4f}, {d['ci95'][1]:+.4f}]")
        console.print(f"ensemble {m['ensemble']['nats_per_byte']:.4f} nats/byte, seed {m['seed']['nats_per_byte']:.4f}, "
                      f"uniform {m['uniform']['nats_per_byte']:.4f}; report: {store.url}/eval/report.md")
    _run(go)


@app.command()
def status(campaign: str) -> None:
    """Show every job's state, step, expert-val loss, GPU-hours and retries."""
    def go() -> None:
        from pipelines.status import status_table
        store = open_store(campaign)
        console.print(status_table(store, load_config(store)))
    _run(go)


@app.command()
def demo(campaign: str = typer.Argument("runs/demo"), preset: str = PresetOpt, set: Optional[list[str]] = SetOpt,
         address: Optional[str] = AddressOpt) -> None:
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
        run_prepare(store, cfg)
        with ray_session(cfg, address):
            train_seed(store, cfg)
            run_launch(store, cfg)
        m = run_eval(store, cfg)
        console.print(f"demo finished in {time.monotonic() - t0:.0f} s: ensemble {m['ensemble']['nats_per_byte']:.4f} nats/byte "
                      f"vs seed {m['seed']['nats_per_byte']:.4f} vs uniform {m['uniform']['nats_per_byte']:.4f}")
        console.print(f"report: {store.url}/eval/report.md")
    _run(go)


@app.command()
def fork(parent: str, campaign: str, set: Optional[list[str]] = SetOpt) -> None:
    """A new campaign sharing PARENT's data and seed model, with training-side overrides (e.g. train.method=bptt)."""
    def go() -> None:
        from pipelines.fork import fork as run
        from soma_cluster.config import merge_trees, validated
        parent_store = open_store(parent)
        tree = merge_trees(load_config(parent_store).model_dump(mode="json"), parse_overrides(set or []))
        run(parent_store, open_store(campaign), validated(tree, "fork overrides"))
    _run(go)


@app.command()
def experiment(name: str = typer.Argument(..., help="variance, summed, zo-compare or scaling (soma_cluster/presets/experiments)"),
               directory: str = typer.Argument(..., help="where its campaigns, results.json and report.md go"),
               scale: str = typer.Option("small", "--scale", help="small (2 CPU cores, <= 30 min) or paper (a GPU cluster)"),
               set: Optional[list[str]] = SetOpt, address: Optional[str] = AddressOpt, no_progress: bool = QuietOpt) -> None:
    """Run one of the paper's comparisons: every arm a campaign (prepare or fork, seed, launch, eval), then a report."""
    def go() -> None:
        from pipelines.experiment import run_experiment
        res = run_experiment(name, directory, scale, set or [], address, not no_progress)
        console.print(f"experiment {res['experiment']} ({res['scale']}) finished in {res['wall_seconds']:.0f} s; report: {directory.rstrip('/')}/report.md")
    _run(go)


@app.command()
def report(directories: list[str] = typer.Argument(..., help="experiment directories (each holds results.json)"),
           readme: Optional[str] = typer.Option(None, "--readme", help="rewrite this README's results section from them")) -> None:
    """Re-render each experiment's report.md and figures from its results.json; optionally the README's results."""
    def go() -> None:
        from pipelines.report import readme_section, update_readme, write_report
        done = []
        for d in directories:
            store = open_store(d)
            res = store.read_json("results.json")
            console.print(f"report: {write_report(store, res)}")
            done.append((store.url, res))
        if readme:
            update_readme(readme, readme_section(done))
            console.print(f"{readme}: results section rewritten from {len(done)} experiment(s)")
    _run(go)


@app.command()
def presets() -> None:
    """List the presets and the experiments."""
    from soma_cluster.experiments import experiment_names
    for name in preset_names():
        print(name)
    for name in experiment_names():
        print(f"experiment {name}")


if __name__ == "__main__":
    app()
