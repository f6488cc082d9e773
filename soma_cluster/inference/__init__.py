"""Using what a campaign trained: the routed ensemble as a language model over bytes (docs/inference.md).

    from soma_cluster.inference import GenerationConfig, RoutedLM

    lm = RoutedLM.load("runs/demo")   # a campaign (local or s3://) or a `soma export` directory

The modules, lowest first (each imports only those before it, and the flat core below):

    generation  GenerationConfig: every decoding option, its default and bounds (no torch)
    scoring     soma eval's windows of a document, the bytes each route reads (causal/1), and a document's Score
                and its record from its segments' nats (no torch)
    export      `soma export`'s directory: written, and read back checked
    routing     Route, Routes, Routing (the router without the experts), and open_source, the one loader
    threads     how many torch threads a piece of inference runs on (chosen per op, or set)
    lm          RoutedLM: the forward, scoring, generation (batched by distinct expert)
    batching    Batcher: continuous batching, streams joining and leaving a running batch (soma serve's)
    serveinput  what `soma serve` accepts: its settings and the HTTP requests' bodies
    servestate  what `soma serve` reads of Serve's status while it deploys: running, waiting, or why it failed
    lmeval      the model "soma" of EleutherAI's lm-evaluation-harness (the optional `lmeval` extra)

Nothing below this package imports it (tests/test_layering.py checks it). The names here are imported when first
used, so that the command line's start and `soma serve`'s settings do not pay for torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from soma_cluster.inference.generation import GenerationConfig
    from soma_cluster.inference.lm import RoutedLM
    from soma_cluster.inference.routing import Route, Routes, Routing
    from soma_cluster.inference.scoring import Score

PUBLIC = {
    "GenerationConfig": "generation",
    "RoutedLM": "lm",
    "Route": "routing",
    "Routes": "routing",
    "Routing": "routing",
    "Score": "scoring",
}
__all__ = ["GenerationConfig", "Route", "RoutedLM", "Routes", "Routing", "Score"]  # PUBLIC's keys


def __getattr__(name: str):
    if name not in PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{PUBLIC[name]}"), name)
