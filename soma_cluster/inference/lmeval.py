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
(generation's sampling seed, default 1234).

The model reads UTF-8 bytes; lm-eval's "tokens" are bytes here. The scores are RoutedLM's
(soma_cluster/inference/lm.py):

- **loglikelihood** (context, continuation): -RoutedLM.score(continuation, prefix=context).nats, the windows and
  routes of soma eval (a window is routed by its own first router.prefix_bytes bytes, so with a context shorter
  than that the router also reads the continuation's first bytes). is_greedy is exact: every continuation byte is
  the argmax of the very distribution that scored it (same window, same route).
- **loglikelihood_rolling** (text,): the whole text's log-likelihood, every byte of it counted.
- **generate_until** (context, gen_kwargs): RoutedLM.generate, greedy (top_k=1) unless do_sample is true with a
  temperature > 0; cut at the first `until` string; decoded with errors="replace".

**The first byte.** A soma model has no start token: the first byte of a text has no prediction. Where lm-eval
asks for one (the first continuation byte after an empty context, the first byte of a rolling text) it is given
the uniform probability 1/256, log(1/256) = -5.545 nats, so bits_per_byte and byte_perplexity are averages over
every byte of the documents, as lm-eval divides them. That byte never counts against is_greedy (under the uniform
distribution every byte ties for the most likely).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

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

from soma_cluster.ensemble import route_windows
from soma_cluster.errors import SomaError
from soma_cluster.inference.lm import RoutedLM, as_bytes, windows_of
from soma_cluster.model import BodyState, embed

log = logging.getLogger(__name__)

FIRST_BYTE_LOGPROB = -math.log(256)  # the unpredicted first byte of a text: uniform (module docstring)
DEFAULT_BATCH = 64
DEFAULT_MAX_BYTES = 256
TIME_BLOCK = 256  # positions per block when is_greedy reads a window: (rows, block, 256) probabilities at a time


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
        seed: int = 1234,
    ):
        super().__init__()
        if not pretrained:
            raise SomaError("model_args needs pretrained=DIR: a campaign or a `soma export` directory")
        if device is not None and str(device).startswith("cuda") and not torch.cuda.is_available():
            # lm-eval's command line passes device cuda:0 unless told otherwise; like its hf model, fall back
            log.warning("device %s: CUDA is not available here; soma runs on the CPU", device)
            device = "cpu"
        self.lm = RoutedLM.load(str(pretrained), device=device, step=None if step is None else int(step))
        self._device = self.lm.device
        self.batch_size = _positive_int("batch_size", batch_size, DEFAULT_BATCH)
        self.max_bytes = _positive_int("max_bytes", max_bytes, None)
        self.seed = int(seed)

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
            lls = self._logprobs(chunk)
            greedy = self._greedy(chunk)
            for req, ll, g in zip(requests[a : a + self.batch_size], lls, greedy, strict=True):
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
            lls = self._logprobs([(b"", t) for t in chunk])
            for req, ll in zip(requests[a : a + self.batch_size], lls, strict=True):
                self.cache_hook.add_partial("loglikelihood_rolling", req.args, ll)
                out.append(ll)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Requests grouped by their sampling options and generated a batch at a time; a batch that samples is
        seeded with `seed` plus its first request's index, so a run repeats."""
        plans = [self._plan(r.args[1] if len(r.args) > 1 else {}) for r in requests]
        groups: dict[tuple, list[int]] = {}
        for i, (_, key) in enumerate(plans):
            groups.setdefault(key, []).append(i)
        out: list[str | None] = [None] * len(requests)
        bar = tqdm(total=len(requests), desc="soma generate_until", disable=self._quiet(disable_tqdm))
        for (max_bytes, temperature, top_k), rows in groups.items():
            for a in range(0, len(rows), self.batch_size):
                batch = rows[a : a + self.batch_size]
                samples = self.lm.generate(
                    [as_bytes(requests[i].args[0]) for i in batch],
                    max_bytes=max_bytes,
                    temperature=temperature,
                    top_k=top_k,
                    seed=(self.seed + batch[0]) % 2**63,
                )
                for i, sample in zip(batch, samples, strict=True):
                    text = cut(sample, plans[i][0]).decode("utf-8", errors="replace")
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                    out[i] = text
                bar.update(len(batch))
        bar.close()
        return out  # type: ignore[return-value]

    # -- scores --------------------------------------------------------------------------------------------------
    def _logprobs(self, pairs: Sequence[tuple[bytes, bytes]]) -> list[float]:
        """log p(continuation | context) per pair: RoutedLM's scores, plus log(1/256) for a continuation's first byte
        when the context is empty (it has no prediction)."""
        scores = self.lm.score_many([c for _, c in pairs], prefix=[x for x, _ in pairs])
        out = []
        for (ctx, cont), s in zip(pairs, scores, strict=True):
            unpredicted = int(bool(cont) and not ctx)
            assert s.scored_bytes == len(cont) - unpredicted, (s.scored_bytes, len(ctx), len(cont))
            out.append(0.0 - s.nats + unpredicted * FIRST_BYTE_LOGPROB)  # 0.0 - 0.0: no "-0.0" for nothing scored
        return out

    def _greedy(self, pairs: Sequence[tuple[bytes, bytes]]) -> list[bool]:
        """Whether each continuation is what greedy decoding gives: every scored byte the argmax of the distribution
        that scored it. RoutedLM.score reads a text in windows, each routed by its own first bytes; the same windows
        (windows_of) and routes here, their full next-byte distributions read instead of the target's."""
        window, stride = self.lm.window_bytes, self.lm.stride
        jobs: list[tuple[int, bytes, int]] = []  # (pair, window's bytes, index of its first scored prediction)
        for i, (ctx, cont) in enumerate(pairs):
            if cont:
                jobs += [(i, data, first) for data, first, _ in windows_of([ctx + cont], window, stride, len(ctx))]
        greedy = [True] * len(pairs)
        for a in range(0, len(jobs), self.batch_size):
            part = jobs[a : a + self.batch_size]
            best = self._argmax([data for _, data, _ in part])
            for (i, data, first), top in zip(part, best, strict=True):
                target = np.frombuffer(data, dtype=np.uint8)[first + 1 :]
                if not np.array_equal(top[first : len(data) - 1], target):
                    greedy[i] = False
        return greedy

    @torch.no_grad()
    def _argmax(self, windows: list[bytes]) -> list[np.ndarray]:
        """The most likely next byte after each position of each window (len - 1 of them), under the window's route:
        p = sum_k w_k softmax(h_k E_k^T), as RoutedLM mixes. Windows are padded at the end to the longest (the LSTM
        is causal: padding changes no earlier position); each routes on its own bytes."""
        lm = self.lm
        top, weights = route_windows(lm.router, [w[: lm.router.cfg.prefix_bytes] for w in windows])
        n, k = top.shape
        units = [int(u) for u in top.reshape(-1)]
        bodies = torch.stack([lm._model(u)[0] for u in units])  # (n*k, M): row r is window r // k's slot r % k
        heads = torch.stack([lm._model(u)[1] for u in units])  # (n*k, 256, e)
        t = max(len(w) for w in windows) - 1
        x = np.zeros((n, t), dtype=np.uint8)
        for i, w in enumerate(windows):
            x[i, : len(w) - 1] = np.frombuffer(w[:-1], dtype=np.uint8)
        xs = torch.from_numpy(x).to(lm.device).repeat_interleave(k, dim=0)[:, None]  # (n*k, 1, t)
        w = torch.as_tensor(weights, dtype=torch.float32, device=lm.device).view(n, k, 1, 1)
        state = BodyState(lm.config.model, bodies, 1)
        best = []
        for t0 in range(0, t, TIME_BLOCK):
            h = state.advance(embed(heads, xs[..., t0 : t0 + TIME_BLOCK], n * k))[:, :, 0]  # (n*k, Tb, e)
            probs = torch.softmax(torch.bmm(h, heads.transpose(1, 2)), dim=-1)  # (n*k, Tb, 256)
            best.append((probs.view(n, k, *probs.shape[1:]) * w).sum(dim=1).argmax(dim=-1))  # (n, Tb)
        cols = torch.cat(best, dim=1).cpu().numpy()
        return [cols[i, : len(wb) - 1] for i, wb in enumerate(windows)]

    # -- generation options ----------------------------------------------------------------------------------------
    def _plan(self, gen_kwargs: dict) -> tuple[list[bytes], tuple[int, float, int | None]]:
        """A request's gen_kwargs -> (stop strings as bytes, (max_bytes, temperature, top_k))."""
        kwargs = normalize_gen_kwargs(dict(gen_kwargs or {}), self.max_bytes or DEFAULT_MAX_BYTES)
        until = [as_bytes(s) for s in handle_stop_sequences(kwargs.pop("until", None), eos=None) if s]
        max_bytes = self.max_bytes or int(kwargs.pop("max_gen_toks"))
        temperature = float(kwargs.pop("temperature", 0.0) or 0.0)
        top_k = kwargs.pop("top_k", None)
        if kwargs.pop("do_sample", False) and temperature > 0:
            return until, (max_bytes, temperature, None if top_k in (None, 0, 256) else int(top_k))
        return until, (max_bytes, 1.0, 1)  # greedy: the most likely byte at every step

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
        }


def cut(sample: bytes, until: Sequence[bytes]) -> bytes:
    """The sample up to the earliest stop string in it (the stop string left out), or all of it."""
    ends = [i for s in until if (i := sample.find(s)) >= 0]
    return sample[: min(ends)] if ends else sample


def main() -> None:
    """lm-eval's command line with the "soma" model registered: python -m soma_cluster.inference.lmeval --model soma"""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
