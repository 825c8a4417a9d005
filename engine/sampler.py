"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

from dataclasses import dataclass

import torch


class InvalidSampling(ValueError):
    """A sampling parameter is out of range; `param` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop. Temperature 0 means greedy."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise InvalidSampling("max_tokens", "max_tokens must be at least 1")
        if not 0.0 <= self.temperature <= 2.0:
            raise InvalidSampling("temperature", "temperature must be between 0 and 2")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidSampling("top_p", "top_p must be greater than 0 and at most 1")
        if self.top_k < 0:
            raise InvalidSampling("top_k", "top_k must not be negative (0 disables it)")
        if any(not text for text in self.stop):
            raise InvalidSampling("stop", "stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """A per-request random generator: seeded requests are reproducible on their own."""
    if params.greedy:
        return None
    generator = torch.Generator(device=device)
    if params.seed is not None:
        generator.manual_seed(params.seed)
    else:
        generator.seed()
    return generator


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> list[int]:
    """One token per row of `logits` ([rows, vocab], float32)."""
    tokens = logits.argmax(dim=-1).tolist()
    for row, (row_params, generator) in enumerate(zip(params, generators, strict=True)):
        if row_params.greedy:
            continue
        tokens[row] = _sample_row(logits[row], row_params, generator)
    return [int(token) for token in tokens]


def _sample_row(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> int:
    scores = logits / params.temperature
    if params.top_k and params.top_k < scores.shape[-1]:
        threshold = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < threshold, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        probabilities = sorted_scores.softmax(dim=-1)
        # Keep the smallest set whose mass reaches top_p (always at least the best token).
        outside = probabilities.cumsum(dim=-1) - probabilities >= params.top_p
        sorted_scores = sorted_scores.masked_fill(outside, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(0, order, sorted_scores)
    probabilities = scores.softmax(dim=-1)
    return int(torch.multinomial(probabilities, 1, generator=generator).item())
