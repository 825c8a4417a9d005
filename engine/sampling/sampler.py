"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, per-request seeds,
OpenAI's frequency and presence penalties and logit bias, and log probabilities.

Penalties and biases change the logits of the whole batch in a few tensor operations (no loop
over the vocabulary), before greedy or random choice. Log probabilities are the model's own:
`log_softmax` of its logits before penalties, bias, temperature or top-p (what vLLM calls raw
logprobs), for the sampled token and the k likeliest. The sampler judges each row alone: a row
whose logits or probabilities are not finite becomes that request's `RequestFailed`, never an
exception that would fail the whole batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.errors import RequestFailed
from engine.kernels.cpu.logits import argmax_finite

# Logits are float32 and scaled by 1 / temperature. Below 1e-2 (the floor vLLM clamps to) the
# scale stops being a meaningful sharpening and starts overflowing: 1e-300 even rounds to 0.0
# in float32, so every logit becomes +-inf and the softmax NaN. Greedy is temperature 0.
MIN_TEMPERATURE = 1e-2
# top_p is compared with float32 probability mass: a positive value below float32's smallest
# normal number rounds to 0 (or a subnormal) and would select nothing.
MIN_TOP_P = float(torch.finfo(torch.float32).tiny)
# What torch.Generator.manual_seed accepts: a signed or unsigned 64-bit integer.
MIN_SEED, SEED_LIMIT = -(2**63), 2**64
PENALTY_LIMIT = 2.0  # OpenAI's range for frequency and presence penalties: [-2, 2]
BIAS_LIMIT = 100.0  # and for a logit bias: [-100, 100]
MAX_LOGIT_BIAS = 1024  # entries per request
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs


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
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    # None: no log probabilities; k >= 0: each sampled token's, and the k likeliest tokens'.
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise InvalidSampling("max_tokens", "max_tokens must be at least 1")
        temperature = self.temperature
        if not (temperature == 0.0 or MIN_TEMPERATURE <= temperature <= 2.0):
            raise InvalidSampling(
                "temperature", f"temperature must be 0 (greedy) or between {MIN_TEMPERATURE} and 2"
            )
        if not (math.isfinite(self.top_p) and MIN_TOP_P <= self.top_p <= 1.0):
            raise InvalidSampling("top_p", "top_p must be greater than 0 and at most 1")
        if self.top_k < 0:
            raise InvalidSampling("top_k", "top_k must not be negative (0 disables it)")
        if any(not text for text in self.stop):
            raise InvalidSampling("stop", "stop strings must not be empty")
        seed = self.seed
        if seed is not None and not (isinstance(seed, int) and MIN_SEED <= seed < SEED_LIMIT):
            raise InvalidSampling("seed", "seed must be a 64-bit integer in [-2**63, 2**64)")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -PENALTY_LIMIT <= value <= PENALTY_LIMIT):
                raise InvalidSampling(name, f"{name} must be between -2 and 2")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            message = f"logit_bias may have at most {MAX_LOGIT_BIAS} entries"
            raise InvalidSampling("logit_bias", message)
        for token, bias in self.logit_bias:
            if token < 0:
                raise InvalidSampling("logit_bias", f"token id {token} is negative")
            if not (math.isfinite(bias) and -BIAS_LIMIT <= bias <= BIAS_LIMIT):
                message = f"the bias for token {token} must be between -100 and 100"
                raise InvalidSampling("logit_bias", message)

        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            message = f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}"
            raise InvalidSampling("top_logprobs", message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether choices depend on how often each token was generated so far."""
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


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


@torch.inference_mode()  # the runner's logits are inference tensors, changed in place here
def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    counts: list[torch.Tensor | None] | None = None,
    constrain: Callable[[torch.Tensor], None] | None = None,
) -> list[int | RequestFailed]:
    """One token per row of `logits` ([rows, vocab], float32), or that row's own failure.

    `counts[row]` ([vocab]) says how often the row's request generated each token so far; it
    is needed where the row's params are `penalized`. `constrain` masks, in place, the tokens
    some rows may not take (structured outputs). `logits` may be changed in place.
    """
    best, finite_rows = argmax_finite(logits)
    finite = finite_rows.tolist()
    if constrain is not None:
        constrain(logits)
    adjusted = adjust_logits(logits, params, counts or [None] * len(params))
    if constrain is not None or adjusted:
        best = argmax_finite(logits)[0]
    tokens: list[int | RequestFailed] = [int(token) for token in best.tolist()]
    for row, (row_params, generator) in enumerate(zip(params, generators, strict=True)):
        if not finite[row]:
            tokens[row] = RequestFailed("the model produced non-finite logits for this request")
        elif not row_params.greedy:
            tokens[row] = _sample_row(logits[row], row_params, generator)
    return tokens


def _sample_row(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> int | RequestFailed:
    scores = logits / params.temperature
    if params.top_k and params.top_k < scores.shape[-1]:
        threshold = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < threshold, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        probabilities = sorted_scores.softmax(dim=-1)
        # Keep the smallest set whose mass reaches top_p, and always the best token.
        outside = probabilities.cumsum(dim=-1) - probabilities >= params.top_p
        outside[0] = False
        sorted_scores = sorted_scores.masked_fill(outside, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(0, order, sorted_scores)
    probabilities = scores.softmax(dim=-1)
    if not bool(torch.isfinite(probabilities).all()):
        return RequestFailed("sampling produced non-finite probabilities for this request")
    return int(torch.multinomial(probabilities, 1, generator=generator).item())


def adjust_logits(
    logits: torch.Tensor, params: list[SamplingParams], counts: list[torch.Tensor | None]
) -> bool:
    """OpenAI's penalties and logit bias, in place, for every row that has them:
    `logit[j] -= count[j] * frequency_penalty + (count[j] > 0) * presence_penalty`, then
    `logit[j] += bias[j]`. Returns whether any row had them."""
    device = logits.device
    penalized = [row for row, row_params in enumerate(params) if row_params.penalized]
    if penalized:
        rows = torch.tensor(penalized, device=device)
        generated = torch.stack([_counts(counts[row], row) for row in penalized])
        frequency = [params[row].frequency_penalty for row in penalized]
        presence = [params[row].presence_penalty for row in penalized]
        penalty = generated * torch.tensor(frequency, device=device)[:, None]
        penalty += (generated > 0) * torch.tensor(presence, device=device)[:, None]
        logits.index_put_((rows,), logits[rows] - penalty)
    biased = [
        (row, token, bias)
        for row, row_params in enumerate(params)
        for token, bias in row_params.logit_bias
    ]
    if biased:
        rows_, tokens, biases = zip(*biased, strict=True)
        index = (torch.tensor(rows_, device=device), torch.tensor(tokens, device=device))
        logits.index_put_(index, torch.tensor(biases, device=device), accumulate=True)
    return bool(penalized or biased)


def _counts(counts: torch.Tensor | None, row: int) -> torch.Tensor:
    if counts is None:
        raise ValueError(f"row {row} has penalties but no token counts")
    return counts


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """A sampled token's log probability and the `k` likeliest tokens' (id, logprob)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True, slots=True)
class RawLogprobs:
    """The model's log probabilities for the rows that asked for them, taken before
    `sample` changes the logits."""

    rows: list[int]
    values: torch.Tensor  # [len(rows), vocab]
    top_ids: torch.Tensor  # [len(rows), k_max]
    top_values: torch.Tensor


def raw_logprobs(logits: torch.Tensor, params: list[SamplingParams]) -> RawLogprobs | None:
    """`log_softmax` of the rows whose params ask for logprobs, with their top k (one topk for
    the batch, at the largest k asked)."""
    rows = [row for row, row_params in enumerate(params) if row_params.logprobs is not None]
    if not rows:
        return None
    values = torch.log_softmax(logits[rows].float(), dim=-1)
    k_max = max(params[row].logprobs or 0 for row in rows)
    top_values, top_ids = torch.topk(values, k_max, dim=-1)
    return RawLogprobs(rows, values, top_ids, top_values)


def scored_logprobs(logits: torch.Tensor, tokens: list[int], k: int) -> list[TokenLogprobs]:
    """Each row's log probability of the given token, with the row's k likeliest tokens:
    logprobs of tokens the model was given rather than sampled (a prompt's)."""
    params = [SamplingParams(logprobs=k)] * len(tokens)
    chosen = chosen_logprobs(raw_logprobs(logits, params), params, list(tokens))
    return [item for item in chosen if item is not None]


def chosen_logprobs(
    raw: RawLogprobs | None, params: list[SamplingParams], tokens: list[int | RequestFailed]
) -> list[TokenLogprobs | None]:
    """Each row's `TokenLogprobs` for the token it sampled (None where it asked for none)."""
    chosen: list[TokenLogprobs | None] = [None] * len(tokens)
    if raw is None:
        return chosen
    picked = [tokens[row] if isinstance(tokens[row], int) else 0 for row in raw.rows]
    index = torch.tensor(picked, device=raw.values.device)[:, None]
    sampled = raw.values.gather(1, index)[:, 0].tolist()
    top_ids, top_values = raw.top_ids.tolist(), raw.top_values.tolist()
    for position, row in enumerate(raw.rows):
        token = tokens[row]
        if isinstance(token, int):
            k = params[row].logprobs or 0
            top = tuple(zip(top_ids[position][:k], top_values[position][:k], strict=True))
            chosen[row] = TokenLogprobs(token, sampled[position], top)
    return chosen
