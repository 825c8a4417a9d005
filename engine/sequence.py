"""One request's life inside the engine: its tokens, progress and output."""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.cache.cache_request import CacheRequest, KeyChain
from engine.request import CacheSources, GenerationDelta, GenerationRequest, Timings, Usage
from engine.sampling.detokenizer import Detokenizer
from engine.sampling.sampler import MIN_SEED, SEED_LIMIT, TokenLogprobs, make_generator
from engine.structured.grammar import GrammarState

# Receives deltas, and at most one exception, from the engine thread.
Sink = Callable[[GenerationDelta | Exception], None]


class Status(enum.Enum):
    """Where a sequence is: in the engine's inbox, waiting, running, or done."""

    SUBMITTED = "submitted"  # in the engine's inbox: the scheduler has not taken it yet
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


def cache_request(request: GenerationRequest) -> CacheRequest:
    """What the cache manager is told of a request: its prompt, scopes and budget."""
    return CacheRequest(
        request_id=request.request_id,
        tenant_id=request.tenant_id,
        prompt_token_ids=list(request.prompt_token_ids),
        segments=request.prompt_segments(),
        tail_scope=request.tail_scope,
        budget=request.budget,
        seal_keys=request.seal_keys,
    )


def choice_request(request: GenerationRequest, index: int) -> GenerationRequest:
    """Choice `index` of a request for n choices: its own id and, if seeded, its own seed."""
    if index == 0:
        return request
    sampling = request.sampling
    if sampling.seed is not None:  # seed + index, wrapped into the seed range
        seed = (sampling.seed - MIN_SEED + index) % (SEED_LIMIT - MIN_SEED) + MIN_SEED
        sampling = dataclasses.replace(sampling, seed=seed)
    return dataclasses.replace(
        request, request_id=f"{request.request_id}#{index}", sampling=sampling, n=1
    )


@dataclass(slots=True, eq=False)
class Sequence:
    """A request being served: prompt plus generated tokens, and how much KV is computed."""

    request: GenerationRequest
    sink: Sink
    token_ids: list[int]
    prompt_len: int
    generator: torch.Generator | None
    detokenizer: Detokenizer | None
    # What the cache manager is told of it, and its tokens' keys, kept for its whole life so
    # that no admission attempt hashes a block twice (generated tokens join the chain).
    cache_request: CacheRequest
    key_chain: KeyChain
    status: Status = Status.SUBMITTED
    num_computed: int = 0
    arrival: float = field(default_factory=time.monotonic)
    arrived_wall: float = field(default_factory=time.time)
    admitted_wall: float | None = None
    first_token_wall: float | None = None
    waiting_since: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    # How often each token was generated, kept only for requests with penalties.
    output_counts: torch.Tensor | None = None
    # Where the output stands in its grammar, for structured outputs.
    grammar: GrammarState | None = None
    # Which of the request's n choices this is; choice 0 computes the prompt.
    index: int = 0
    # Choice 0 of n > 1: the other choices, until they fork off its computed prompt.
    forks: list[Sequence] = field(default_factory=list)
    # Every choice of the request (n > 1), so that cancelling one cancels them all.
    choices: list[Sequence] = field(default_factory=list)
    # Prompt logprobs (when asked for), for prompt tokens 1.. as their positions are computed.
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)

    @classmethod
    def create(
        cls,
        request: GenerationRequest,
        sink: Sink,
        cache: tuple[CacheRequest, KeyChain],
        tokenizer: Any,
        device: torch.device,
        stop_token_ids: Collection[int] = (),
    ) -> Sequence:
        """The request's sequence; for n > 1 also its other choices, waiting in `forks`.

        `cache` is what `validation.validate` made of the request for the cache manager;
        each other choice gets a copy under its own id.
        """
        as_cache, chain = cache
        sequences = []
        for index in range(request.n):
            choice = choice_request(request, index)
            if index:  # the request's own, under the choice's id
                cache = dataclasses.replace(as_cache, request_id=choice.request_id), chain.copy()
            sequence = cls._choice(choice, sink, cache, tokenizer, device, stop_token_ids)
            sequence.index = index
            sequences.append(sequence)
        if request.n > 1:
            sequences[0].forks = sequences[1:]
            for sequence in sequences:
                sequence.choices = sequences
        return sequences[0]

    @classmethod
    def _choice(
        cls,
        request: GenerationRequest,
        sink: Sink,
        cache: tuple[CacheRequest, KeyChain],
        tokenizer: Any,
        device: torch.device,
        stop_token_ids: Collection[int],
    ) -> Sequence:
        prompt = list(request.prompt_token_ids)
        stop = request.sampling.stop
        detokenizer = Detokenizer(tokenizer, prompt, stop) if tokenizer is not None else None
        generator = make_generator(request.sampling, device)
        sequence = cls(request, sink, prompt, len(prompt), generator, detokenizer, *cache)
        if request.grammar is not None:
            sequence.grammar = GrammarState(request.grammar, list(stop_token_ids))
        return sequence

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    def append(
        self,
        token: int,
        eos_token_ids: Collection[int],
        max_model_len: int,
        logprobs: TokenLogprobs | None = None,
    ) -> GenerationDelta:
        """Add a sampled token (and its logprobs, if asked for); returns its delta, with
        `finish_reason` set if it ends here."""
        params = self.request.sampling
        self.token_ids.append(token)
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
            self.first_token_wall = time.time()
        finish = None
        text = ""
        if token in params.stop_token_ids or (not params.ignore_eos and token in eos_token_ids):
            finish = "stop"
        elif self.detokenizer is not None:
            text = self.detokenizer.add(token)
            if self.detokenizer.stopped:
                finish = "stop"
        if finish is None and (
            len(self.output_ids) >= params.max_tokens or self.num_tokens >= max_model_len
        ):
            finish = "length"
        if finish is not None and self.detokenizer is not None and not self.detokenizer.stopped:
            text += self.detokenizer.flush()
        prompt_logprobs = None
        if len(self.output_ids) == 1 and self.request.prompt_logprobs is not None:
            prompt_logprobs = self.prompt_logprobs
        return GenerationDelta(
            text,
            [token],
            finish,
            logprobs=[logprobs] if logprobs else None,
            prompt_logprobs=prompt_logprobs,
            index=self.index,
        )

    @property
    def wants_prompt_logits(self) -> bool:
        """Whether its next chunk must return logits at every position: prompt logprobs are
        asked for and some are still missing."""
        wanted = self.request.prompt_logprobs is not None
        return wanted and len(self.prompt_logprobs) < self.prompt_len - 1

    @property
    def reuses_cache(self) -> bool:
        """Whether its admission may hit cached blocks: a request for prompt logprobs reuses
        none until it has them all."""
        return not self.wants_prompt_logits

    def usage(self, computed_prompt_positions: int, block_size: int) -> Usage:
        """OpenAI usage; cached tokens are prompt positions the model never computed (I6).

        Choices after the first count only their output: the prompt is counted once.
        """
        if self.index:
            return Usage(0, 0, len(self.output_ids))
        cached = max(0, self.prompt_len - computed_prompt_positions)
        sources = CacheSources.of(self.cache_request.ledger, block_size)
        return Usage(self.prompt_len, cached, len(self.output_ids), sources)

    def final_delta(self, delta: GenerationDelta, usage: Usage) -> GenerationDelta:
        """The finishing `delta` with the request's usage and the times of its phases."""
        now = time.time()
        timings = Timings(
            self.arrived_wall, self.admitted_wall or now, self.first_token_wall or now, now
        )
        return dataclasses.replace(delta, usage=usage, timings=timings)
