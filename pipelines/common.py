"""Shared driver plumbing: open a campaign directory, the console, progress bars, the heap under a long loop."""

from __future__ import annotations

import gc
import os
import sys
from contextlib import contextmanager
from typing import Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Column
from rich.text import Text

from soma_cluster.campaignfile import CONFIG_FILE as CONFIG
from soma_cluster.campaignfile import load_campaign_config
from soma_cluster.config import CampaignConfig, to_yaml_text
from soma_cluster.errors import SomaError
from soma_cluster.lease import LEASE_FILES
from soma_cluster.revisions import config_in_force
from soma_cluster.storage import Store, storage_options_from_env
from soma_cluster.targets import occupied

console = Console(stderr=True, highlight=False)  # logs and progress: stderr
out = Console(highlight=False, soft_wrap=True)  # data (tables, results, JSON): stdout, so `soma status X > f` holds it


def emit_json(obj, lines: bool = False) -> None:
    """A command's --json result: one JSON document on stdout, nothing else there; `lines`: one document per line
    (JSON Lines: `soma status --watch --json` streams one per refresh)."""
    import json

    sys.stdout.write(json.dumps(obj, indent=None if lines else 1, sort_keys=False, default=str) + "\n")
    sys.stdout.flush()


def open_store(url: str, storage_options: dict | None = None) -> Store:
    """The campaign at `url`; without explicit options, an s3:// endpoint comes from the environment
    (SOMA_S3_ENDPOINT / AWS_ENDPOINT_URL) and credentials from botocore's usual chain."""
    if not url.strip() or (url.strip("/") == "" and url.startswith("/")):
        raise SomaError(
            f"{url!r} is {'empty' if not url.strip() else 'the root directory'}, not a campaign: pass the directory "
            "that soma prepare made (or a new path for one)"
        )
    store = Store(url, storage_options_from_env(url) if storage_options is None else storage_options)
    if store.local and os.path.lexists(store.root) and not os.path.isdir(store.root):
        raise SomaError(
            f"{store.root} is a file; a campaign (or an experiment) is a directory: pass the directory that "
            "soma prepare (soma experiment) made, or a new path for it"
        )
    return store


def load_config(store: Store) -> CampaignConfig:
    """The config in force: campaign.yaml with its revisions (soma set; soma_cluster/revisions.py)."""
    return config_in_force(store)


def claim_campaign(store: Store, cfg: CampaignConfig, write: bool = True) -> bool:
    """Bind the directory to this config. True if it was already bound to the same config;
    an empty or absent directory is claimed (unless write=False: only checked, its bucket included);
    anything else is refused, never overwritten. An edited campaign.yaml is refused (load_config)."""
    if store.exists(CONFIG):
        existing = load_campaign_config(store)  # what it was prepared with (revisions change it later)
        if existing.digest() != cfg.digest():
            raise SomaError(
                f"{store.url} already holds a different campaign ({existing.name}, preset {existing.preset}); "
                "use a new campaign URL for this config, or continue that one (soma status / soma resume URL)"
            )
        return True
    if names := contents(store):
        raise occupied(store.url, names, CONFIG)
    store.require_bucket()  # s3://: a missing bucket is found before any data is read, not at the first write
    if write:
        store.write_new(CONFIG, to_yaml_text(cfg).encode())
    return False


def contents(store: Store) -> list[str]:
    """The names at the campaign's root, less the driver lease's files (a lease taken on an empty directory does not
    make it a campaign)."""
    return [n for n in store.listdir("") if n not in LEASE_FILES]


class InfoColumn(TimeRemainingColumn):
    """A task's `info` field where it has one (the driver's: its ETA, soma_cluster/eta.py, and newest losses), else
    rich's own time remaining (prepare's parts)."""

    def render(self, task) -> Text:
        return Text(str(task.fields["info"])) if "info" in task.fields else super().render(task)


@contextmanager
def progress(enabled: bool = True, fit: bool = False) -> Iterator[Progress]:
    """Progress bars on stderr; `fit`: as wide as the terminal and no wider, the bar taking what the other columns
    leave (their `info` is the caller's to keep short: info_room)."""
    # fitted: the text columns never wrap (their text is kept short) and the bar takes the columns they leave
    bar = Progress(
        TextColumn("{task.description}", table_column=Column(no_wrap=True) if fit else None),
        BarColumn(bar_width=None if fit else 40, table_column=Column(ratio=1) if fit else None),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        InfoColumn(table_column=Column(no_wrap=True) if fit else None),
        console=console,
        disable=not enabled,
        transient=False,
        expand=fit,
    )
    with bar:
        yield bar


MIN_BAR = 10  # columns a fitted bar keeps, however long the text beside it


def info_room(width: int, descriptions: list[str], largest_total: int) -> int:
    """Columns left for a fitted progress display's `info` (progress(fit=True)) at `width`: what the description,
    the bar (MIN_BAR), M/N, the elapsed time and the gaps between them leave."""
    used = max(map(len, descriptions), default=0) + MIN_BAR + 2 * len(str(largest_total)) + 1 + len("10:00:00")
    return max(0, width - used - 4)  # 4: one space between each of the five columns


def fit_info(candidates: list[str], room: int) -> str:
    """The first (most informative) of `candidates` that fits in `room` columns; '' when none does."""
    return next((c for c in candidates if len(c) <= room), "")


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Around a long loop: what the process holds when it begins (the libraries it imported: torch, Ray, pyarrow,
    the trackers; a resumed campaign's history) is left out of the garbage collector's full passes meanwhile.
    Each full pass otherwise walks all of it, ~0.25 s on a loaded 2-core host (benchmarks/bench_driver_scale.py
    measures these pauses), and stalls the loop while it runs. Given back to the collector at the end: garbage
    among those objects is then collected as before."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
