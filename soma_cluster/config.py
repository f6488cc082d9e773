"""Campaign configuration as data: pydantic models, defaults <- YAML preset <- overrides.

The resolved model is dumped to `<campaign>/campaign.yaml` once and is the only source of
truth afterwards (workers and `soma resume` read it back from there).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
import platform
import re
import typing
from importlib import resources
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from soma_cluster import schema
from soma_cluster.configinput import ConfigText, read_config
from soma_cluster.errors import SomaError
from soma_cluster.formats import FormatSetting
from soma_cluster.globs import compile_glob
from soma_cluster.textsources import NAMED_SOURCES


class _Section(BaseModel):
    # NaN and infinity are refused in every float field (pydantic's own check): no setting means either
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        # YAML reads `true` as a bool, and pydantic would take it as 1 for an int or float field
        annotation = cls.model_fields[info.field_name].annotation
        if isinstance(value, bool) and _numeric(annotation):
            raise ValueError("a number is needed, not true/false")
        texts = str in (typing.get_args(annotation) or (annotation,))
        if texts and isinstance(value, str) and value and not value.strip():
            raise ValueError("String should not be blank")  # a path, a column or a name of spaces only
        return value


def _numeric(annotation: Any) -> bool:
    args = typing.get_args(annotation) or (annotation,)
    return any(a in (int, float) for a in args)


# a source label's length at most (it is a table cell): a longer label of a row is cut, of a pattern refused
SOURCE_LABEL_CHARS = 200


class CorpusConfig(_Section):
    # "builtin" (fixed text shipped with soma: the same bytes on every machine), "machine" (this machine's own
    # text: Python's docs and sources, man and info pages, package docs), a local path or an s3:// URL (a file or a
    # directory; formats in docs/prepare.md; a directory named builtin or machine: ./builtin)
    source: str = Field("builtin", min_length=1)
    max_bytes: int = Field(64_000_000, gt=0, le=2**50)  # cap on corpus bytes read
    text_field: str = Field("text", min_length=1)  # JSONL / Parquet column holding the text
    # a plain-text file longer than this is cut into documents of at most this many bytes, at a blank line in
    # the second half of each (else at a character boundary): one big file then has a held-out test set
    document_bytes: int = Field(256_000, ge=4096, le=1 << 30)
    # "auto": each file in the format its name says (docs/prepare.md); a format's name (soma_cluster.formats.FORMATS:
    # text, text.gz, jsonl, jsonl.gz, parquet, arrow, ...) reads every file in it, whatever its name
    format: FormatSetting = "auto"
    test_fraction: float = Field(0.02, ge=0.0, lt=0.5)  # documents held out for the test set
    storage_options: dict[str, Any] = Field(default_factory=dict)  # fsspec options for an s3:// corpus
    # Sources: the name each document is reported under (loss per source, the source x expert tables), never part of
    # the data (docs/prepare.md, "Sources"). Without these settings, a file's first folder under the corpus root, or
    # its file type (txt, pm, jsonl) for a file directly under it. Here: glob pattern -> label, matched on the path
    # relative to the corpus root with git's rules ('*.pm', 'perl/**', 'man[1-8]'), the first match wins; a file no
    # pattern matches keeps its folder's name
    source_patterns: dict[str, str] = Field(default_factory=dict)
    # a table (.csv, .jsonl, .parquet; a local path or s3://) with each file's `path` relative to the corpus root and
    # its label in corpus.source_column ("source" when that is null); a file it does not list falls back to the
    # patterns, then to its folder
    source_manifest: str | None = Field(None, min_length=1)
    # the column holding the labels: the manifest's, or without a manifest each JSONL, Parquet or Arrow row's own (text;
    # null or empty: the file's label); null: no row labels
    source_column: str | None = Field(None, min_length=1)

    @field_validator("source_patterns", mode="before")
    @classmethod
    def _dotted(cls, patterns: Any) -> Any:
        # --set corpus.source_patterns.*.pm=perl is split at each ".": {"*": {"pm": "perl"}}
        nested = [k for k, v in patterns.items() if isinstance(v, dict)] if isinstance(patterns, dict) else []
        if nested:
            raise ValueError(
                f"pattern {nested[0]!r} has a mapping for its label: a --set key is cut at each '.', so give a pattern "
                "with a dot as YAML, --set 'corpus.source_patterns={\"*.pm\": perl}'"
            )
        return patterns

    @field_validator("source_patterns")
    @classmethod
    def _patterns(cls, patterns: dict[str, str]) -> dict[str, str]:
        for pattern, label in patterns.items():
            compile_glob(pattern)  # a ValueError naming the pattern and how to write it
            if not label.strip() or len(label) > SOURCE_LABEL_CHARS:
                raise ValueError(
                    f"pattern {pattern!r} has the label {label[:40]!r}; a label is 1 to {SOURCE_LABEL_CHARS} "
                    "characters, not blank"
                )
        return patterns

    @model_validator(mode="after")
    def _sources_of_a_user_corpus(self) -> "CorpusConfig":
        labelled = [k for k in ("source_patterns", "source_manifest", "source_column") if getattr(self, k)]
        if labelled and self.source in NAMED_SOURCES:
            raise ValueError(
                f"corpus.{labelled[0]} labels the files of a corpus directory, and corpus.source={self.source} names "
                "its own sources; point corpus.source at a directory (--corpus PATH), or leave out "
                + ", ".join(f"corpus.{k}" for k in labelled)
            )
        if self.source_column is not None and self.source_manifest is None and self.source_column == self.text_field:
            raise ValueError(
                f"corpus.source_column={self.source_column!r} is corpus.text_field: each document would be its own "
                "source; name the column that holds the labels"
            )
        return self

    @model_validator(mode="after")
    def _no_credentials(self) -> "CorpusConfig":
        # the resolved config is saved to campaign.yaml: credentials belong in the environment
        found = sorted(_credential_keys(self.storage_options))
        if found:
            raise ValueError(
                f"corpus.storage_options must not hold credentials ({', '.join(found)}): the config is saved "
                "to campaign.yaml; set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) in the environment"
            )
        return self


_CREDENTIAL_KEYS = {
    "key",
    "secret",
    "token",
    "password",
    "session_token",
    "aws_access_key_id",
    "aws_secret_access_key",
    "aws_session_token",
    "access_key",
    "secret_key",
}


def _credential_keys(options: Any, prefix: str = "") -> set[str]:
    """Names (never values) of credential-like keys anywhere in nested storage options."""
    out: set[str] = set()
    if isinstance(options, dict):
        for k, v in options.items():
            name = f"{prefix}{k}"
            if str(k).lower() in _CREDENTIAL_KEYS:
                out.add(name)
            out |= _credential_keys(v, f"{name}.")
    return out


class RouterConfig(_Section):
    max_features: int = Field(50_000, gt=0, le=10_000_000)
    min_df: int = Field(5, ge=1, le=1_000_000)
    svd_dim: int = Field(128, ge=2, le=4096)
    sample_chunks: int = Field(400_000, gt=0, le=100_000_000)  # chunks the vectorizer, SVD and k-means are fit on
    prefix_bytes: int = Field(256, gt=0, le=2**20)  # bytes of a window the router reads at inference
    # experts a window is routed to, the top min(top_k, N) scores; null: the default for N, round(N / 64) from 1 to 4
    # (routing.md, "Choosing top-k"); top_k >= N mixes every expert with equal weight: a uniform mixture, no routing
    top_k: int | None = Field(None, ge=1, le=10_000)
    weighting: Literal["uniform", "softmax"] = "uniform"  # softmax(-d^2/T) is c-BTM's option
    temperature: float = Field(0.1, gt=0.0, le=1000.0)
    kmeans_iters: int = Field(20, ge=1, le=100_000)
    # balanced: argmax(similarity - offset), offsets fitted so every expert gets an equal share (refitted over
    # all train sequences by prepare); nearest: the paper's nearest centroid. Shards and routing use the same rule
    rule: Literal["balanced", "nearest"] = "balanced"
    # TF-IDF terms. words: words of 2+ letters (scikit-learn's default, c-BTM's recipe); layout: also 1-letter words,
    # runs of punctuation and a newline with the indentation after it, which tell code, markup, man pages and prose
    # apart (docs/routing.md). A router saved before this setting existed loads as words
    tokens: Literal["words", "layout"] = "layout"
    # max |size/mean - 1| of a fitted cluster (balanced: of a shard too)
    balance_tolerance: float = Field(0.05, ge=0.0, le=10.0)
    # the balanced rule's offsets are refitted on this many train sequences of lowest key (all of them when there are
    # fewer): their embeddings sit in the driver's memory (544 bytes each at svd_dim 128)
    refit_rows: int = Field(1_000_000, gt=0, le=2**40)

    def k(self, n_experts: int) -> int:
        """The experts each window is routed to at N = n_experts: top_k (or its default for N), at most N."""
        return min(self.top_k if self.top_k is not None else default_top_k(n_experts), n_experts)

    def resolved(self, n_experts: int) -> "RouterConfig":
        """This config with top_k set to what it means at N = n_experts (the router saves it so)."""
        return self.model_copy(update={"top_k": self.k(n_experts)})


TOP_K_PER_EXPERTS = 64  # the default top_k routes each window to one expert per 64 experts...
TOP_K_MAX = 4  # ...and at most 4: the paper's top-4 of 256


def default_top_k(n_experts: int) -> int:
    """router.top_k's default: round(N / 64) experts, at least 1 and at most 4 (1 up to N = 95, 2 from 96, 4 from
    224; the paper's 4 at N = 256). Never N for N >= 2: top-N is a uniform mixture and routes nothing. Measured:
    docs/routing.md, "Choosing top-k"."""
    return max(1, min(TOP_K_MAX, round(n_experts / TOP_K_PER_EXPERTS)))


EVAL_WINDOWS_MIN = 2048  # eval.max_windows's default: at least this many test windows...
EVAL_WINDOWS_PER_EXPERT = 32  # ...and enough that each expert is routed about this many at an even load


def default_eval_windows(n_experts: int, k: int) -> int:
    """eval.max_windows's default: max(2048, 32 N / k) windows, so that at an even load (each window routed to k of
    N experts) every expert sees about 32 or more: 2048 up to N = 64 k, 8192 at N = 1024 with k = 4."""
    return max(EVAL_WINDOWS_MIN, -(-EVAL_WINDOWS_PER_EXPERT * n_experts // max(k, 1)))


class ShardConfig(_Section):
    seq_bytes: int = Field(1024, ge=16, le=2**24)
    val_fraction: float = Field(0.01, gt=0.0, lt=0.5)
    rows_per_file: int = Field(65_536, gt=0, le=2**30)
    min_train_seqs: int = Field(16, ge=1, le=2**30)  # an expert with fewer is an error, not a silent no-op


class PrepareConfig(_Section):
    # local: the driver reads, embeds and writes everything itself; ray: Ray Data tasks on the cluster's CPU
    # workers do it; auto: ray when a Ray address is given (--address or RAY_ADDRESS), else local. Both give
    # the same router, shards and test windows (docs/prepare.md)
    engine: Literal["auto", "local", "ray"] = "auto"
    # corpus files grouped into parts of about this many bytes on disk
    part_bytes: int = Field(64_000_000, gt=0, le=2**40)
    workers: int = Field(0, ge=0, le=100_000)  # Ray engine: CPU workers at most (0: as many as the cluster grants)


class ModelConfig(_Section):
    d: int = Field(32, ge=4, le=65_536)  # body width
    depth: int = Field(2, ge=1, le=1024)  # residual blocks (LSTM + MLP each)
    embed_dim: int = Field(32, ge=4, le=65_536)  # tied byte embedding width (E is 256 x embed_dim)
    head: Literal["shared_frozen", "own"] = "shared_frozen"


class SPSAConfig(_Section):
    n_pert: int = Field(64, ge=1, le=2**20)
    batch: int = Field(64, ge=1, le=2**20)
    seq_len: int = Field(1024, ge=2, le=2**24)  # bytes per training window (<= shards.seq_bytes)
    accum: int = Field(1, ge=1, le=2**20)
    eps: float = Field(1e-3, gt=0.0, le=1.0)
    lr: float = Field(1e-3, gt=0.0, le=10.0)
    weight_decay: float = Field(1e-4, ge=0.0, le=1.0)
    beta1: float = Field(0.9, ge=0.0, lt=1.0)
    beta2: float = Field(0.999, ge=0.0, lt=1.0)
    adam_eps: float = Field(1e-8, gt=0.0, le=1.0)
    patience: int = Field(1000, ge=1, le=10**9)  # updates without expert-val improvement before halving
    floor: float = Field(1e-5, gt=0.0, le=10.0)
    pert_chunk: int = Field(32, ge=1, le=2**20)  # probes per batched pass (2 x pert_chunk copies; memory knob)
    compile: bool = False  # fuse the LSTM step with torch.compile (needs a C++ compiler on CPU)
    time_block: int = Field(8, ge=1, le=2**24)  # steps every layer advances at once: keeps activations cache-sized
    # independent: each expert's estimate uses its own loss only (SOMA). summed: the control of the paper's
    # baselines (docs/results.md), every expert updated with the SUM of all experts' losses under one joint probe
    # (needs all N experts in one actor: resources.experts_per_actor = n_experts); same starts, data, probes and
    # update counts
    objective: Literal["independent", "summed"] = "independent"


class EggrollConfig(_Section):
    """EGGROLL (low-rank antithetic ES): per matrix E = A B^T / sqrt(r), A (a x r), B (b x r) Gaussian;
    population 2 n_pert (antithetic +-sigma), z-scored fitness. sigma starts at spsa.eps's place in the
    schedule (it halves with lr)."""

    rank: int = Field(1, ge=1, le=4096)
    sigma: float = Field(1e-3, gt=0.0, le=1.0)


class BPTTConfig(_Section):
    """The honest reference: exact gradients by backpropagation through time (autograd) and Adam."""

    lr: float = Field(2e-3, gt=0.0, le=10.0)
    grad_clip: float = Field(1.0, ge=0.0, le=1e6)  # global norm clip per expert; 0 = off


class SeedStageConfig(_Section):
    updates: int = Field(1000, ge=0, le=10**9)
    eps: float = Field(2.5e-3, gt=0.0, le=1.0)
    lr: float = Field(2.5e-3, gt=0.0, le=10.0)


class TrainConfig(_Section):
    # how the expert stage trains the bodies: SOMA's SPSA, or one of the paper's baselines (docs/results.md) (the
    # seed stage is always SPSA with the delta-rule decoder)
    method: Literal["spsa", "eggroll", "bptt"] = "spsa"
    updates: int = Field(1000, ge=1, le=10**9)  # updates per expert
    chunk_updates: int = Field(10, ge=1, le=10**9)  # updates between heartbeats (and budget checks)
    checkpoint_every: int = Field(100, ge=1, le=10**9)
    val_every: int = Field(50, ge=1, le=10**9)
    val_batches: int = Field(2, ge=1, le=10**6)
    threads: int = Field(1, ge=1, le=1024)  # torch intra-op threads per worker on CPU


class ResourcesConfig(_Section):
    num_gpus: float = Field(1.0, ge=0.0001, le=1024.0)  # per expert actor: 1, 0.5, 0.125 ...
    num_cpus: float = Field(0.0, ge=0.0, le=1024.0)  # stated explicitly: Ray's default of 1 CPU starves small hosts
    local_gpus: int = Field(4, ge=1, le=4096)  # logical GPUs of a local Ray started when no address is given
    placement: Literal["pack", "spread"] = "pack"  # pack: fill a node's GPUs first; spread: one node after another
    # G small experts trained by one actor in shared batched passes (the engine's expert axis); num_gpus and
    # num_cpus are then per actor, and the actor's GPU-seconds are split evenly among the experts it trains
    experts_per_actor: int = Field(1, ge=1, le=10_000)
    # an actor whose experts all ended cleanly takes the next pending ones instead of a new actor being
    # started (saves the actor start per expert; retries always get a fresh actor)
    reuse_actors: bool = False
    # actors kept requested beyond what the cluster's GPUs hold now, waiting in Ray's queue where an
    # autoscaler (the launcher's, KubeRay's) sees them and adds nodes. None: every job that can start is
    # requested at once (the cluster grows to the campaign's width); with reuse_actors, None means 0, so
    # that freed actors take the remaining jobs. 0: only what fits now (a fixed cluster never grows)
    max_pending: int | None = Field(None, ge=0, le=1_000_000)
    # actors queued or running at once, at most; None: what the GPUs and max_pending allow. `soma set` changes it on a
    # running campaign: lowering it stops no running actor, fewer start as they end
    max_actors: int | None = Field(None, ge=1, le=1_000_000)
    # a GPU share whose actor finds no CUDA device is an error naming the node, unless this is set: then
    # it trains on the CPU and its ledger records say so ("logical GPU-hours on cpu")
    allow_cpu: bool = False

    @field_validator("num_cpus")
    @classmethod
    def _ray_precision(cls, value: float) -> float:
        if 0 < value < 0.0001:  # Ray counts resources in units of 0.0001
            raise ValueError("Ray cannot request less than 0.0001 of a resource (0 is allowed)")
        return value


class BudgetConfig(_Section):
    expert_gpu_hours: float | None = Field(None, gt=0.0, le=1e6)
    campaign_gpu_hours: float | None = Field(None, gt=0.0, le=1e8)
    # caps in US dollars, enforced like the GPU-hour caps (the tighter one binds): the dollars each ledger record cost
    # at the price it was written with; a job's GPU-seconds left are its dollars left at the price in force now
    expert_usd: float | None = Field(None, gt=0.0, le=1e9)  # US dollars one expert may spend (needs prices)
    campaign_usd: float | None = Field(None, gt=0.0, le=1e11)  # US dollars the whole campaign may spend
    grace_gpu_seconds: float = Field(30.0, ge=0.0, le=86_400.0)  # overrun past a cap before the driver kills the actor
    pool_policy: Literal["none", "even", "improving"] = "none"  # who gets an ended expert's unspent budget


class GpuPrice(_Section):
    on_demand: float = Field(gt=0.0, le=10_000.0)  # USD per GPU-hour of an on-demand instance
    spot: float | None = Field(None, gt=0.0, le=10_000.0)  # USD per GPU-hour of a spot (preemptible) one


class PricesConfig(_Section):
    # USD per GPU-hour of each accelerator type, e.g. {H100: {on_demand: 4.0, spot: 1.6}} (docs/cli.md, "Dollars");
    # empty: the ledger is in GPU-hours only. Each ledger record keeps the price it was written with
    gpu: dict[str, GpuPrice] = Field(default_factory=dict)
    accelerator: str | None = Field(None, min_length=1)  # the type this campaign's GPU workers have: a key of gpu
    spot: bool = False  # its GPU workers are spot instances: their spot price applies
    # USD per hour of a GPU share held on a CPU (logical GPUs of a local Ray, resources.allow_cpu): a CPU node's price
    cpu_hour: float | None = Field(None, gt=0.0, le=10_000.0)

    @model_validator(mode="after")
    def _known(self) -> "PricesConfig":
        if self.accelerator is not None and self.accelerator not in self.gpu:
            known = ", ".join(sorted(self.gpu)) or "none"
            raise ValueError(
                f"prices.accelerator {self.accelerator!r} is not in the price table prices.gpu (it has {known}); "
                f"add it, e.g. --set 'prices.gpu={{{self.accelerator}: {{on_demand: 4.0}}}}'"
            )
        if self.spot and self.accelerator is None:
            raise ValueError("prices.spot is true but no prices.accelerator says whose spot price applies; set it")
        if self.spot and self.accelerator is not None and self.gpu[self.accelerator].spot is None:
            raise ValueError(f"prices.spot is true but prices.gpu.{self.accelerator} has no spot price; give one")
        return self


class RetryConfig(_Section):
    max_retries: int = Field(3, ge=0, le=1000)  # failures per job; preemptions and driver losses do not count
    backoff_s: float = Field(1.0, ge=0.0, le=86_400.0)  # the k-th retry waits backoff_s x 2^k, capped, with jitter
    backoff_max_s: float = Field(300.0, ge=0.0, le=604_800.0)
    heartbeat_timeout_s: float = Field(600.0, gt=0.0, le=604_800.0)
    # SIGTERM (a spot notice, a node drain, a KubeRay scale-down) gives a worker this long to checkpoint and
    # exit; keep it under the platform's own grace (Kubernetes' terminationGracePeriodSeconds: 30 s default)
    preemption_grace_s: float = Field(20.0, gt=0.0, le=3600.0)
    # a retry that lands on the node of an actor the driver killed (a hang) waits up to this long for that
    # process to be gone, so two processes never hold the same device's memory at once
    kill_wait_s: float = Field(30.0, ge=0.0, le=3600.0)
    # an infrastructure failure (disk full, read-only, storage unreachable, node lost, out of memory: see
    # soma_cluster/failures.py) spends no retry: the expert is retried with backoff while the condition lasts, for
    # at most this long (seconds, from its first such failure since its last checkpoint); then the campaign stops
    # (exit 4) for the operator to fix it and `soma resume`. 0 stops at the first one
    infra_wait_s: float = Field(600.0, ge=0.0, le=604_800.0)


class EvalConfig(_Section):
    window_bytes: int = Field(1025, ge=3, le=2**24)
    context_bytes: int = Field(256, ge=1, le=2**24)  # predictions before this index are not scored
    # test windows evaluated at most (evenly spaced over the test set); null: max(2048, 32 N / top_k), so that each
    # expert is routed about 32 or more at an even load
    max_windows: int | None = Field(None, ge=1, le=10**8)
    bootstrap: int = Field(10_000, ge=100, le=10**7)
    batch: int = Field(32, ge=1, le=2**16)


class TrackingConfig(_Section):
    # experiment trackers the driver feeds (docs/tracking.md): views of the campaign directory, never its record;
    # left out of the config's digest, like prepare.engine: how a campaign is watched is not what it is
    backends: list[Literal["mlflow", "tensorboard"]] = Field(default_factory=list)  # empty: no tracking
    # unset: MLFLOW_TRACKING_URI from the environment (a value set here wins over it)
    mlflow_uri: str | None = Field(None, min_length=1)
    # unset: MLFLOW_EXPERIMENT_NAME from the environment, else the campaign's name
    experiment: str | None = Field(None, min_length=1)
    # a local directory; unset: TENSORBOARD_LOGDIR from the environment, else <campaign>/tensorboard (a local campaign)
    tensorboard_dir: str | None = Field(None, min_length=1)
    # records held for a slow tracker; past it they are dropped, counted
    queue_points: int = Field(20_000, ge=1, le=10_000_000)
    retries: int = Field(2, ge=0, le=100)  # tries of a failed batch after the first, before it is dropped (counted)
    timeout_s: float = Field(10.0, gt=0.0, le=3600.0)  # one call to the tracker, at most
    # at a stage's end, how long the driver waits for the queue to empty
    drain_s: float = Field(30.0, ge=0.0, le=3600.0)

    @field_validator("backends", mode="before")
    @classmethod
    def _one_or_a_list(cls, v: Any) -> Any:
        # `--set tracking.backends=mlflow` (or "mlflow,tensorboard") reads as the list it means
        return [b.strip() for b in v.split(",") if b.strip()] if isinstance(v, str) else v


class CampaignConfig(_Section):
    name: str = Field("campaign", min_length=1, max_length=200, pattern=r"^[^\x00-\x1f\x7f]+$")
    preset: str = Field("custom", min_length=1)
    n_experts: int = Field(4, ge=1, le=10_000)
    seed: int = Field(0, ge=0, le=2**32 - 1)
    corpus: CorpusConfig = CorpusConfig()
    router: RouterConfig = RouterConfig()
    shards: ShardConfig = ShardConfig()
    prepare: PrepareConfig = PrepareConfig()
    model: ModelConfig = ModelConfig()
    spsa: SPSAConfig = SPSAConfig()
    eggroll: EggrollConfig = EggrollConfig()
    bptt: BPTTConfig = BPTTConfig()
    seed_stage: SeedStageConfig = SeedStageConfig()
    train: TrainConfig = TrainConfig()
    resources: ResourcesConfig = ResourcesConfig()
    budget: BudgetConfig = BudgetConfig()
    prices: PricesConfig = PricesConfig()
    retry: RetryConfig = RetryConfig()
    eval: EvalConfig = EvalConfig()
    tracking: TrackingConfig = TrackingConfig()

    @model_validator(mode="after")
    def _consistent(self) -> "CampaignConfig":
        if self.spsa.seq_len > self.shards.seq_bytes:
            raise ValueError(f"spsa.seq_len {self.spsa.seq_len} exceeds shards.seq_bytes {self.shards.seq_bytes}")
        if self.eval.context_bytes >= self.eval.window_bytes - 1:
            raise ValueError("eval.context_bytes must leave predictions to score inside eval.window_bytes")
        if self.model.head == "shared_frozen" and self.model.d != self.model.embed_dim:
            raise ValueError("model.head shared_frozen needs d == embed_dim; wide experts keep their own head")
        priced = self.prices.accelerator is not None or self.prices.cpu_hour is not None
        if (self.budget.expert_usd is not None or self.budget.campaign_usd is not None) and not priced:
            raise ValueError(
                "a budget in dollars (budget.expert_usd, budget.campaign_usd) needs a price: set prices.gpu and "
                "prices.accelerator (or prices.cpu_hour for GPU shares held on a CPU)"
            )
        if self.spsa.objective == "summed":
            if self.train.method != "spsa":
                raise ValueError("spsa.objective summed is the SPSA control; set train.method spsa")
            if self.resources.experts_per_actor != self.n_experts:
                raise ValueError(
                    "spsa.objective summed couples all experts: "
                    f"set resources.experts_per_actor={self.n_experts} (= n_experts)"
                )
        return self

    def top_k(self) -> int:
        """Experts each window is routed to: router.top_k, or its default for n_experts, at most n_experts."""
        return self.router.k(self.n_experts)

    def eval_windows(self) -> int:
        """Test windows an evaluation scores at most: eval.max_windows, or its default for n_experts and top_k."""
        if self.eval.max_windows is not None:
            return self.eval.max_windows
        return default_eval_windows(self.n_experts, self.top_k())

    def digest(self) -> str:
        """A stable hash of the resolved config: tells 'same campaign' from 'a different one'. How prepare runs
        (engine, workers) is left out: every engine makes the same campaign; so is how it is tracked, and what its
        compute costs (prices)."""
        blob = json.dumps(
            self.model_dump(mode="json", exclude={"prepare": {"engine", "workers"}, "tracking": True, "prices": True}),
            sort_keys=True,
        ).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def preset_names() -> list[str]:
    root = resources.files("soma_cluster") / "presets"
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".yaml"))


def preset_tree(name: str) -> dict[str, Any]:
    tree = _preset_file(name)
    if tree is None:
        raise SomaError(f"unknown preset {name!r}; choose one of {', '.join(preset_names())}")
    return copy.deepcopy(tree)  # the caller's to change


@functools.cache
def _preset_file(name: str) -> dict[str, Any] | None:
    """A preset file of the package, parsed once per process (a config resolves it two or three times)."""
    path = resources.files("soma_cluster") / "presets" / f"{name}.yaml"
    return (yaml.safe_load(path.read_text()) or {}) if path.is_file() else None


def setting_origin(cfg: CampaignConfig, dotted: str) -> str:
    """Where a resolved setting's value came from, in words for an error line: "preset tiny" when the preset file
    gives that value, "the default" when it is the field's default, else "set in the config or --set"."""
    value: Any = cfg
    for key in dotted.split("."):
        value = getattr(value, key)
    preset: Any = preset_tree(cfg.preset) if cfg.preset in preset_names() else {}
    for key in dotted.split("."):
        preset = preset.get(key, _MISSING) if isinstance(preset, dict) else _MISSING
    if preset is not _MISSING and preset == value:
        return f"preset {cfg.preset}"
    info = schema.field_at(CampaignConfig, dotted)
    if info is not None and info.default == value:
        return "the default"
    return "set in the config or --set"


_MISSING = object()


def set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise SomaError(f"override {dotted!r}: {key!r} is not a section; use section.field=value")
    node[keys[-1]] = value


class _UniqueKeys(yaml.SafeLoader):
    """YAML's safe loader that refuses a key given twice in one mapping (plain YAML keeps the last silently). A
    merge key (`<<: *anchor`, as configs kept in a ConfigMap or CI file share settings) is YAML's own: the keys it
    brings in may be set again beside it (that is what it is for), so only the mapping's own keys are checked."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # no constructor of its own: the base class flattens it
                continue
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice (line {key_node.start_mark.line + 1})", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep)


def _leaves(value: Any, path: tuple[str, ...]) -> list[tuple[str, ...]]:
    """The settings one --set item sets: its key, or each key under it when its value is a mapping."""
    if isinstance(value, dict) and value:
        return [leaf for k, v in value.items() for leaf in _leaves(v, (*path, str(k)))]
    return [path]


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """`["spsa.n_pert=16", "corpus.source=/data"]` -> nested dict; values are parsed as YAML scalars. A setting
    given by two items (`n_experts=8 ... n_experts=4`, `spsa.lr=1` and `spsa={lr: 2}`) is refused: only the last
    would count, as for an option given twice; a section's mapping and another of its fields merge."""
    tree: dict[str, Any] = {}
    given: dict[tuple[str, ...], str] = {}  # each setting set so far -> the item that set it
    for item in items:
        one = _parse_override(item)
        for leaf in _leaves(one, ()):
            for path, first in given.items():
                if path[: len(leaf)] == leaf or leaf[: len(path)] == path:  # the same, or one inside the other
                    key = ".".join(max(path, leaf, key=len))
                    raise SomaError(
                        f"--set {key} is given twice ({first!r}, then {item!r}); pass it once (only the last would "
                        f"count)"
                    )
            given[leaf] = item
        tree = merge_trees(tree, one)
    return tree


def _parse_override(item: str) -> dict[str, Any]:
    """One --set item as a tree: `spsa.n_pert=16` -> {"spsa": {"n_pert": 16}}."""
    tree: dict[str, Any] = {}
    if "=" not in item:
        raise SomaError(f"override {item!r} is not key=value; write e.g. --set spsa.n_pert=16")
    key, raw = item.split("=", 1)
    if not all(part.strip() for part in key.split(".")):
        raise SomaError(f"override {item!r} has no setting name before '='; write e.g. --set spsa.n_pert=16")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise SomaError(
            f"--set {key.strip()}: the value {raw!r} is not a YAML scalar ({_yaml_problem(exc)}); quote it as a "
            f"string: --set '{key.strip()}=\"{raw}\"'"
        ) from None
    set_dotted(tree, key.strip(), value)
    return tree


def _yaml_problem(exc: yaml.YAMLError, text: str = "") -> str:
    """A YAML error in a few words with where it is: 'found unexpected end of stream at line 2, column 1'."""
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    mark = getattr(exc, "problem_mark", None)
    if mark is not None:
        return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"
    if isinstance(exc, yaml.reader.ReaderError) and text:  # a character YAML refuses (NUL, a control): a position
        at = exc.position
        return f"{problem} at line {text.count(chr(10), 0, at) + 1}, column {at - text.rfind(chr(10), 0, at)}"
    return problem


def merge_trees(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        out[key] = merge_trees(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def validated(tree: dict[str, Any], origin: str) -> CampaignConfig:
    try:
        return CampaignConfig.model_validate(tree)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = list(first["loc"])
        while loc and isinstance(loc[-1], int):  # an item of a list setting: the setting is named
            loc.pop()
        where = ".".join(str(p) for p in loc) or "config"
        info = schema.field_at(CampaignConfig, where)
        section = CampaignConfig.model_fields.get(where)
        if info is None and first["type"] == "value_error" and section is not None:  # a section's own rule
            raise SomaError(f"{origin}: {first['msg'].removeprefix('Value error, ')}") from None
        if info is None and section is not None and isinstance(section.annotation, type):
            example = next(iter(section.annotation.model_fields))
            raise SomaError(
                f"{origin}: {where} is a section, not a setting; set its fields, e.g. --set {where}.{example}=VALUE "
                f"(docs/config.md lists them)"
            ) from None
        if first["type"] == "extra_forbidden":
            guess = schema.nearest(CampaignConfig, where)
            hint = f"did you mean {guess}? " if guess else ""
            raise SomaError(
                f"{origin}: {where} is not a setting; {hint}the settings are listed in docs/config.md"
            ) from None
        if info is None and first["type"] == "value_error":  # a rule that spans fields: its message names them
            raise SomaError(f"{origin}: {first['msg'].removeprefix('Value error, ')}") from None
        if info is None:  # inside a mapping setting (prices.gpu.H100.on_demand): the path, the rule, the value
            raise SomaError(f"{origin}: {where}: {first['msg']} (got {_shown(first.get('input'))})") from None
        raise SomaError(
            f"{origin}: {where}: {first['msg'].removeprefix('Value error, ')} (got {_shown(first.get('input'))}); "
            f"set {where} to {schema.allowed(info)}"
        ) from None


def _shown(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("\n...").strip()
    return text if len(text) <= 60 else text[:57] + "..."


def resolve(
    preset: str = "tiny", overrides: dict[str, Any] | None = None, config_file: str | None = None
) -> CampaignConfig:
    """Defaults <- preset file <- optional user YAML <- key=value overrides."""
    tree = preset_tree(preset)
    tree["preset"] = preset
    origin = f"preset {preset}"
    if config_file is not None:
        source = read_config(config_file)
        tree, origin = merge_trees(tree, _user_tree(source)), source.label
    if overrides:
        tree, origin = merge_trees(tree, overrides), "overrides"
    return _absolute_logdir(validated(tree, origin))


def _absolute_logdir(cfg: CampaignConfig) -> CampaignConfig:
    """A new campaign's tracking.tensorboard_dir is absolute: campaign.yaml keeps it, and every later command (a
    resume from another directory, soma track, a Ray job) would resolve a relative one, or a literal ~, from its
    own working directory, splitting the run. (A campaign.yaml written before this check loads as it is.)"""
    logdir = cfg.tracking.tensorboard_dir
    if logdir is None or "://" in logdir or os.path.isabs(logdir):  # a URL is refused, with its fix, by tracking
        return cfg
    example = os.path.abspath(os.path.expanduser(logdir))
    raise SomaError(
        f"tracking.tensorboard_dir {logdir!r} is not an absolute path; campaign.yaml keeps it, and each later command "
        f"would resolve it from its own working directory{' (~ is not expanded)' if logdir.startswith('~') else ''}: "
        f"pass an absolute one, e.g. --set tracking.tensorboard_dir={example}"
    )


def _user_tree(source: ConfigText) -> dict[str, Any]:
    """--config's settings: UTF-8 YAML (a BOM allowed, CRLF or LF), one mapping of sections, no key twice."""
    label = source.label
    try:
        text = source.raw.decode("utf-8")
        user = yaml.load(text, Loader=_UniqueKeys)  # a SafeLoader
    except UnicodeDecodeError as exc:
        raise SomaError(f"{label} is not UTF-8 text (byte {exc.start}); save it as UTF-8 YAML") from None
    except yaml.YAMLError as exc:
        raise SomaError(f"{label} is not valid YAML ({_yaml_problem(exc, text)}); fix its syntax") from None
    if user is None:  # empty or comments only: almost surely not what was meant
        raise SomaError(
            f"{label} is empty (no settings); write the sections to change in it "
            f"(e.g. spsa: {{n_pert: 16}}, as in soma_cluster/presets/tiny.yaml) or leave out --config"
        )
    if not isinstance(user, dict):
        raise SomaError(f"{label} must hold a mapping of sections; see soma_cluster/presets/")
    return user


# campaign.yaml carries, in comment lines, the sha256 of the config it was written with and a short one per
# top-level key, so that a hand edit is refused (naming what changed) instead of run against shards, a
# router and checkpoints made for the original. A campaign.yaml without them (written before they
# existed) loads unchecked, as it always did.
_DIGEST = re.compile(r"^# config-sha256: ([0-9a-f]{64})[ \t]*$", re.M)
_KEY_DIGESTS = re.compile(r"^# key-sha256: (.*)$", re.M)


def _sha(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def from_yaml_text(text: str, origin: str) -> CampaignConfig:
    try:
        tree = yaml.safe_load(text)
    except yaml.YAMLError:
        raise SomaError(f"{origin} is not valid YAML; restore it from a backup or start a new campaign") from None
    if not isinstance(tree, dict):
        raise SomaError(f"{origin} does not hold a campaign config; restore it or start a new campaign")
    recorded = _DIGEST.search(text)
    if recorded and _sha(tree) != recorded.group(1):
        raise SomaError(
            f"{origin} was edited after the campaign was prepared ({_edited(text, tree)}), but its router, shards "
            f"and checkpoints were made for the config recorded in it; undo the edit, or put new settings in a "
            f"new campaign (soma prepare NEW_URL --set KEY=VALUE, or soma fork for training-side settings)"
        )
    return validated(tree, origin)


def _edited(text: str, tree: dict[str, Any]) -> str:
    """Which top-level keys differ from those recorded, e.g. 'n_experts changed'."""
    line = _KEY_DIGESTS.search(text)
    was = dict(p.split("=", 1) for p in line.group(1).split()) if line else {}
    changed = sorted(k for k in set(was) | set(tree) if was.get(k) != (_sha(tree[k])[:8] if k in tree else None))
    return f"{', '.join(changed)} changed" if line and changed else "it no longer matches its config-sha256"


def versions() -> dict[str, str]:
    """What made a campaign: soma-cluster, torch, ray and Python versions (from package metadata: nothing imported)."""
    from importlib import metadata

    def of(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "not installed"

    return {
        "soma-cluster": of("soma-cluster"),
        "torch": of("torch"),
        "ray": of("ray"),
        "python": platform.python_version(),
    }


_VERSIONS = re.compile(r"^# versions: (.*)$", re.M)


def recorded_versions(text: str) -> dict[str, str]:
    """The versions line of a campaign.yaml ({} for one written before it existed)."""
    line = _VERSIONS.search(text)
    return dict(p.split("=", 1) for p in line.group(1).split()) if line else {}


def to_yaml_text(cfg: CampaignConfig) -> str:
    body = yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
    tree = yaml.safe_load(body)  # the digests are of what a reader will load back
    keys = " ".join(f"{k}={_sha(v)[:8]}" for k, v in tree.items())
    made_by = " ".join(f"{k}={v.replace(' ', '_')}" for k, v in versions().items())
    return (
        "# The resolved config of this campaign, written once when it was created. Every soma command checks it\n"
        "# against the digests below and refuses an edited copy: its router, shards and checkpoints were made for it.\n"
        f"# config-sha256: {_sha(tree)}\n# key-sha256: {keys}\n# versions: {made_by}\n{body}"
    )
