"""Continuous batching: streams that join a running batch at a step boundary and leave it when done, each drawing
its bytes exactly as RoutedLM.stream draws them alone (`soma serve`'s expert replicas run one per replica).

    batcher = Batcher(lm)
    a = batcher.join([b"Once upon"], [GenerationConfig(max_bytes=100, seed=1)])      # keys, in order
    for key, byte, done in batcher.step(): ...       # one byte of every stream in the batch
    b = batcher.join([b"def "], [GenerationConfig(max_bytes=5, seed=2)])             # joins at the next step
    batcher.leave(a)                                                                 # a client gone

The scheduling is the one vLLM's and Text Generation Inference's routers use for decoding (vllm/core/scheduler.py,
text-generation-inference's router/src/infer.rs): one loop per replica; between two steps, the requests that
arrived are prefilled together and concatenated to the running batch, and those that finished or whose client went
away are filtered out of it; every step then decodes one token of every request in the batch. There is no paged KV
cache here: a stream's whole state is its experts' LSTM states (O(1) in its length), kept per row of a Decoding.

Each request has its own GenerationConfig and its own torch generator seeded with its seed, and its byte is drawn
from its own row of the mixture with them: what stream() draws for it alone, whoever shares the batch (the
mixture's float32 sums may round differently in a batch of another shape; a draw changes only where it falls within
that rounding of a boundary between two bytes, which tests/test_inference_speed.py has not seen happen).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from soma_cluster.inference.generation import GenerationConfig
from soma_cluster.inference.lm import Decoding, RoutedLM, generator, sample_each
from soma_cluster.inference.routing import Route, Routes


@dataclass
class Stream:
    """One request in the running batch: its options, its generator and the bytes it has drawn."""

    key: int
    config: GenerationConfig
    gen: torch.Generator
    drawn: int = 0

    @property
    def done(self) -> bool:
        return self.drawn >= self.config.max_bytes


class Batcher:
    """The running batch of one model: `join` and `leave` between steps, `step` draws a byte for every stream."""

    def __init__(self, lm: RoutedLM):
        self.lm = lm
        self.streams: list[Stream] = []  # in the Decoding's prompt order
        self.decoding: Decoding | None = None
        self._keys = itertools.count()

    def __len__(self) -> int:
        return len(self.streams)

    @torch.no_grad()
    def join(
        self, prompts: Sequence[bytes], configs: Sequence[GenerationConfig], routes: Sequence[Route] | None = None
    ) -> list[int]:
        """Streams for these prompts (each kept as generation keeps it; routed on it, or under the route given),
        prefilled together and added to the batch; their keys. A stream of max_bytes 0 is done at once: it is
        given a key and never drawn from."""
        if len(configs) != len(prompts) or (routes is not None and len(routes) != len(prompts)):
            raise ValueError(f"{len(prompts)} prompts, {len(configs)} configs and {len(routes or ())} routes")
        keys = [next(self._keys) for _ in prompts]
        live = [i for i, c in enumerate(configs) if c.max_bytes > 0]
        if not live:
            return keys
        kept = [self.lm.prompt_kept(prompts[i]) for i in live]
        given = None if routes is None else Routes.concat([self.lm._given(routes[i]) for i in live])
        new = self.lm.prefill(kept, given)
        if self.decoding is None:
            self.decoding = new
        else:
            self.decoding.join(new)
        self.streams += [Stream(keys[i], configs[i], generator(self.lm.device, configs[i].seed)) for i in live]
        return keys

    def leave(self, keys: Sequence[int]) -> None:
        """These streams leave the batch (their clients went away); keys not in it are ignored."""
        gone = set(keys)
        if any(s.key in gone for s in self.streams):
            self._keep([i for i, s in enumerate(self.streams) if s.key not in gone])

    def _keep(self, rows: list[int]) -> None:
        self.streams = [self.streams[i] for i in rows]
        if not self.streams:
            self.decoding = None
        else:
            self.decoding.keep(rows)

    @torch.no_grad()
    def step(self) -> list[tuple[int, int, bool]]:
        """One byte for every stream: (key, byte, whether it was the stream's last). Finished streams leave; the
        others read their byte, ready for the next step."""
        if not self.streams:
            return []
        with self.lm.threading.using(len(self.streams)):  # rows of 256: one thread
            logp = self.decoding.logprobs()
            drawn = sample_each(logp, [s.config for s in self.streams], [s.gen for s in self.streams])
        out = []
        for s, b in zip(self.streams, drawn, strict=True):
            s.drawn += 1
            out.append((s.key, b, s.done))
        going = [i for i, s in enumerate(self.streams) if not s.done]
        if len(going) < len(self.streams):
            self._keep(going)
        if self.streams:
            self.decoding.advance(torch.tensor([drawn[i] for i in going], dtype=torch.long))
        return out
