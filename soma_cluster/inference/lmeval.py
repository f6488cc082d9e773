"""A soma ensemble as a model of EleutherAI's lm-evaluation-harness (the `lmeval` extra, docs/inference.md).

    pip install 'soma-cluster[lmeval]'
    python -m soma_cluster.inference.lmeval --model soma --model_args pretrained=runs/demo --tasks TASKS \
        [--include_path DIR]

or from Python, once this module is imported (importing it registers the model name "soma"):

    import lm_eval, soma_cluster.inference.lmeval
    lm_eval.simple_evaluate(model="soma", model_args="pretrained=runs/demo", tasks=[...])

model_args: `pretrained` (a campaign, local or s3://, or a `soma export` directory), `device` (cpu, cuda, cuda:N;
default CUDA when there is one), `batch_size` (requests per pass, default 64), `max_bytes` (bytes generated per
generate_until request: it overrides the tasks' max_gen_toks, which count a subword model's tokens of about 4
bytes each; without it, max_gen_toks is read as bytes), `step` (a campaign's checkpoints of that step), `seed`
(generation's sampling seed, default 1234). max_bytes and seed are GenerationConfig's options, with its bounds.

The model reads UTF-8 bytes; lm-eval's "tokens" are bytes here. Every request is built on RoutedLM (lm.py):

- **loglikelihood** (context, continuation): -RoutedLM.score(continuation, prefix=context).nats: the continuation
  routed on the context alone (scoring.Rule, causal/1), so every choice of a question is scored under one route and
  the one-byte continuations of a context are one distribution. is_greedy is exact: every continuation byte is the
  argmax of the very distribution that scored it (the forward's, same segment, same route: the score's record).
- **loglikelihood_rolling** (text,): the whole text's log-likelihood, every byte of it counted (its first bytes
  re-routed as they are read, as any document without a prefix).
- **generate_until** (context, gen_kwargs): RoutedLM.generate under the GenerationConfig the gen_kwargs map onto
  (generation_of): greedy (top_k=1) unless do_sample is true with a temperature other than 0, else its temperature
  and top_k as given, checked by GenerationConfig's bounds; cut at the first `until` string; decoded with
  errors="replace".

**The first byte.** A soma model has no start token: the first byte of a text has no prediction. Where lm-eval
asks for one (the first continuation byte after an empty context, the first byte of a rolling text) it is given
the uniform probability 1/256, log(1/256) = -5.545 nats, so bits_per_byte and byte_perplexity are averages over
every byte of the documents, as lm-eval divides them. That byte never counts against is_greedy (under the uniform
distribution every byte ties for the most likely).

The results' `config` names what produced them (get_model_info): the source, experts, top-k, steps, the seed's
stand-ins, the ensemble's digest and the routing rule.
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Sequence
from typing import Any

try:
    # lm_eval.models first: lm-eval fills its model registry from it only while the registry is empty, so
    # registering "soma" before it would hide the harness's own models (hf, vllm, ...) in this process
    import lm_eval.models  # noqa: F401
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs
    from lm_eval.utils import simple_parse_args_string
except ImportError as exc:  # only users of the extra import this module
    raise ImportError(
        f"soma_cluster.inference.lmeval needs EleutherAI's lm-evaluation-harness ({exc}): "
        "pip install 'soma-cluster[lmeval]'"
    ) from exc

import numpy as np
import torch
from tqdm import tqdm

from soma_cluster.errors import SomaError
from soma_cluster.inference.generation import GenerationConfig, resolve
from soma_cluster.inference.lm import RoutedLM
from soma_cluster.inference.routing import Route, Routes
from soma_cluster.inference.scoring import RoutedSegment, Score, as_bytes

log = logging.getLogger(__name__)

FIRST_BYTE_LOGPROB = -math.log(256)  # the unpredicted first byte of a text: uniform (module docstring)
DEFAULT_BATCH = 64
DEFAULT_MAX_BYTES = GenerationConfig.model_fields["max_bytes"].default
DEFAULT_SEED = 1234
# lm-eval's gen_kwargs speak Hugging Face's words: 0 turns these off (greedy decoding; no top-k cut)
OFF_WHEN_ZERO = ("temperature", "top_k")


def _positive_int(name: str, value, default: int | None) -> int | None:
    if value is None or (name == "batch_size" and str(value).startswith("auto")):
        return default  # lm-eval's "auto" batch size: there is no memory probe here, the default serves
    try:
        out = int(value)
    except (TypeError, ValueError):
        out = 0
    if isinstance(value, bool) or out < 1 or out != float(value):
        raise SomaError(f"{name}={value!r}: pass a whole number >= 1")
    return out


@register_model("soma")
class SomaLM(LM):
    """lm-eval's LM interface over a RoutedLM (module docstring: model_args, scores, the first byte)."""

    def __init__(
        self,
        pretrained: str,
        device: str | None = None,
        batch_size: int | str | None = None,
        max_batch_size: int | None = None,  # lm-eval passes it along with batch_size; nothing to size here
        max_bytes: int | None = None,
        step: int | None = None,
        seed: int | None = DEFAULT_SEED,
    ):
        super().__init__()
        if not pretrained:
            raise SomaError("model_args needs pretrained=DIR: a campaign or a `soma export` directory")
        if device is not None and str(device).startswith("cuda") and not torch.cuda.is_available():
            # lm-eval's command line passes device cuda:0 unless told otherwise; like its hf model, fall back
            log.warning("device %s: CUDA is not available here; soma runs on the CPU", device)
            device = "cpu"
        self.batch_size = _positive_int("batch_size", batch_size, DEFAULT_BATCH)
        generation_of({}, max_bytes, seed)  # model_args that GenerationConfig refuses: refused before anything loads
        self.max_bytes, self.seed = max_bytes, seed
        self.lm = RoutedLM.load(str(pretrained), device=device, step=None if step is None else int(step))
        self._device = self.lm.device

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> SomaLM:
        """As LM's, except that model_args win over the harness's own settings: its command line passes
        device=cuda:0 and batch_size=1 unless told otherwise, which LM's would refuse beside model_args' own
        ("got multiple values for keyword argument")."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        return cls(**arg_dict, **extra)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> SomaLM:
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    # -- lm-eval's three requests -------------------------------------------------------------------------------
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [(as_bytes(r.args[0]), as_bytes(r.args[1])) for r in requests]
        out: list[tuple[float, bool]] = []
        for a in tqdm(
            range(0, len(pairs), self.batch_size), desc="soma loglikelihood", disable=self._quiet(disable_tqdm)
        ):
            chunk = pairs[a : a + self.batch_size]
            scores = self._scores(chunk, routes=True)
            greedy = self._greedy(chunk, scores)
            for req, (ll, _), g in zip(requests[a : a + self.batch_size], scores, greedy, strict=True):
                self.cache_hook.add_partial("loglikelihood", req.args, (ll, g))
                out.append((ll, g))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        texts = [as_bytes(r.args[0]) for r in requests]
        out: list[float] = []
        for a in tqdm(
            range(0, len(texts), self.batch_size), desc="soma loglikelihood_rolling", disable=self._quiet(disable_tqdm)
        ):
            chunk = texts[a : a + self.batch_size]
            lls = [ll for ll, _ in self._scores([(b"", t) for t in chunk])]
            for req, ll in zip(requests[a : a + self.batch_size], lls, strict=True):
                self.cache_hook.add_partial("loglikelihood_rolling", req.args, ll)
                out.append(ll)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Requests grouped by their GenerationConfig and generated a batch at a time; a batch that samples is
        seeded with `seed` plus its first request's index, so a run repeats."""
        plans = [generation_of(r.args[1] if len(r.args) > 1 else {}, self.max_bytes, self.seed) for r in requests]
        groups: dict[GenerationConfig, list[int]] = {}
        for i, (_, config) in enumerate(plans):
            groups.setdefault(config, []).append(i)
        out: list[str | None] = [None] * len(requests)
        bar = tqdm(total=len(requests), desc="soma generate_until", disable=self._quiet(disable_tqdm))
        for config, rows in groups.items():
            for a in range(0, len(rows), self.batch_size):
                batch = rows[a : a + self.batch_size]
                seed = None if config.seed is None else (config.seed + batch[0]) % 2**63
                samples = self.lm.generate([as_bytes(requests[i].args[0]) for i in batch], config, seed=seed)
                for i, sample in zip(batch, samples, strict=True):
                    text = cut(sample, plans[i][0]).decode("utf-8", errors="replace")
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                    out[i] = text
                bar.update(len(batch))
        bar.close()
        return out  # type: ignore[return-value]

    # -- scores --------------------------------------------------------------------------------------------------
    def _scores(self, pairs: Sequence[tuple[bytes, bytes]], routes: bool = False) -> list[tuple[float, Score]]:
        """log p(continuation | context) per pair, and its Score: RoutedLM's, plus log(1/256) for a continuation's
        first byte when the context is empty (it has no prediction)."""
        scores = self.lm.score_many([c for _, c in pairs], prefix=[x for x, _ in pairs], routes=routes)
        out = []
        for (ctx, cont), s in zip(pairs, scores, strict=True):
            unpredicted = int(bool(cont) and not ctx)
            assert s.scored_bytes == len(cont) - unpredicted, (s.scored_bytes, len(ctx), len(cont))
            out.append((0.0 - s.nats + unpredicted * FIRST_BYTE_LOGPROB, s))  # 0.0 - 0.0: no "-0.0" for nothing
        return out

    def _greedy(self, pairs: Sequence[tuple[bytes, bytes]], scores: Sequence[tuple[float, Score]]) -> list[bool]:
        """Whether each continuation is what greedy decoding gives: every scored byte the argmax of the distribution
        that scored it. The same segments and routes as its Score (Score.routes), the forward's every-byte
        distributions read instead of the target's."""
        jobs: list[tuple[int, bytes, RoutedSegment]] = []  # (pair, the segment's bytes, the segment and its route)
        for i, ((ctx, cont), (_, s)) in enumerate(zip(pairs, scores, strict=True)):
            doc = ctx + cont
            jobs += [(i, doc[r.segment.start : r.segment.end], r) for r in s.routes or ()]
        greedy = [True] * len(pairs)
        for a in range(0, len(jobs), self.batch_size):
            part = jobs[a : a + self.batch_size]
            routes = Routes.of([Route(r.experts, r.weights) for _, _, r in part])
            dists = self.lm.forward([data for _, data, _ in part], routes, every_byte=True)  # each (len - 1, 256)
            for (i, data, r), logp in zip(part, dists, strict=True):
                first = r.segment.first
                target = np.frombuffer(data, dtype=np.uint8)[first + 1 :]
                if not np.array_equal(logp[first:].argmax(axis=-1), target):
                    greedy[i] = False
        return greedy

    # -- what lm-eval asks of a model ------------------------------------------------------------------------------
    def _quiet(self, disable_tqdm: bool) -> bool:
        return disable_tqdm or self.rank != 0

    def get_model_info(self) -> dict:
        """Written into lm-eval's results under "config"."""
        return {
            "soma_source": self.lm.source,
            "soma_experts": self.lm.n_experts,
            "soma_top_k": self.lm.router.cfg.top_k,
            "soma_steps": {str(e): s for e, s in sorted(self.lm.steps.items())},
            "soma_seed_fallback": list(self.lm.seed_fallback),
            "soma_ensemble_digest": self.lm.digest,
            "soma_routing": {
                **self.lm.rule.as_dict(),
                "loglikelihood": "the route is chosen from the context alone (its first prefix_bytes), once, and "
                "scores every choice's bytes of that window; an empty context and loglikelihood_rolling texts: "
                "re-routed as the text is read (growing)",
                "first_byte_logprob": FIRST_BYTE_LOGPROB,
            },
        }


def cut(sample: bytes, until: Sequence[bytes]) -> bytes:
    """The sample up to the earliest stop string in it (the stop string left out), or all of it."""
    ends = [i for s in until if (i := sample.find(s)) >= 0]
    return sample[: min(ends)] if ends else sample


def _off(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and value == 0


def generation_of(
    gen_kwargs: dict | None, max_bytes: int | None = None, seed: int | None = DEFAULT_SEED
) -> tuple[list[bytes], GenerationConfig]:
    """A request's gen_kwargs (lm-eval's normalize_gen_kwargs: until, max_gen_toks or its aliases, do_sample,
    temperature, top_k) and the model_args max_bytes and seed -> its stop strings as bytes and its GenerationConfig.
    Greedy (top_k=1) unless do_sample with a temperature other than 0; a temperature or top_k of 0 is Hugging
    Face's "off" (OFF_WHEN_ZERO). Every other value goes to GenerationConfig as given: one SomaError naming it."""
    try:
        kwargs = normalize_gen_kwargs(dict(gen_kwargs or {}), DEFAULT_MAX_BYTES)
    except (TypeError, ValueError) as exc:  # lm-eval's own int() and float() of max_gen_toks and temperature
        raise SomaError(f"gen_kwargs {gen_kwargs!r}: {exc}") from None
    until = [as_bytes(s) for s in handle_stop_sequences(kwargs.pop("until", None), eos=None) if s]
    options: dict[str, Any] = {"max_bytes": kwargs.pop("max_gen_toks") if max_bytes is None else max_bytes}
    options["seed"] = seed
    given = {"temperature": kwargs.pop("temperature", 0.0), "top_k": kwargs.pop("top_k", None)}
    off = {name for name in OFF_WHEN_ZERO if _off(given[name])}
    if not kwargs.pop("do_sample", False) or "temperature" in off:
        options["top_k"] = 1  # greedy: the most likely byte at every step
    else:
        options.update(temperature=given["temperature"], top_k=None if "top_k" in off else given["top_k"])
    return until, resolve(None, options)


def main() -> None:
    """lm-eval's command line with the "soma" model registered: python -m soma_cluster.inference.lmeval --model soma"""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
