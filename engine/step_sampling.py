"""A step's logits into what its requests get: next tokens, their logprobs, prompt logprobs.

Pure functions of the logits and the sequences; the engine decides what to do with the results.
"""

from __future__ import annotations

from collections import abc

import torch

from engine.errors import RequestFailed
from engine.model.runner import Chunk
from engine.sampling.sampler import (
    TokenLogprobs,
    chosen_logprobs,
    raw_logprobs,
    sample,
    scored_logprobs,
)
from engine.scheduler import ScheduledChunk
from engine.sequence import Sequence
from engine.structured.grammar import mask_logits


def sample_next(
    logits: torch.Tensor | None, sampled: list[Sequence]
) -> tuple[list[int | RequestFailed], list[TokenLogprobs | None]]:
    """Each sequence's next token (or its failure) and, where asked for, its logprobs; row r
    of `logits` is `sampled[r]`'s."""
    if logits is None or not sampled:
        return [], []
    params = [sequence.request.sampling for sequence in sampled]
    counts = [output_counts(sequence, logits) for sequence in sampled]
    raw = raw_logprobs(logits, params)  # before `sample` changes the logits
    grammars = [sequence.grammar for sequence in sampled]
    generators = [sequence.generator for sequence in sampled]
    constrain = (lambda rows: mask_logits(rows, grammars)) if any(grammars) else None
    tokens = sample(logits, params, generators, counts, constrain)
    return tokens, chosen_logprobs(raw, params, tokens)


def output_counts(sequence: Sequence, logits: torch.Tensor) -> torch.Tensor | None:
    """A penalized request's generated-token counts, made at its first sampled token; the
    engine adds each token it appends."""
    if not sequence.request.sampling.penalized:
        return None
    if sequence.output_counts is None:
        generated = torch.tensor(sequence.token_ids[sequence.prompt_len :], dtype=torch.long)
        counts = torch.bincount(generated, minlength=logits.shape[-1]).float()
        sequence.output_counts = counts.to(logits.device)
    return sequence.output_counts


def take_prompt_logprobs(
    scheduled: list[ScheduledChunk],
    chunks: list[Chunk],
    failed: abc.Container[int],
    logits: torch.Tensor | None,
) -> torch.Tensor | None:
    """Record prompt logprobs from the chunks that returned logits at every position; returns
    the rows left to sample from (each sampling chunk's last)."""
    if logits is None:
        return None
    offset, sample_rows = 0, []
    for index, (item, chunk) in enumerate(zip(scheduled, chunks, strict=True)):
        if index in failed:
            continue
        rows = logits[offset : offset + chunk.num_logit_rows]
        if chunk.all_logits:
            record_prompt_logprobs(item.sequence, chunk, rows)
        offset += chunk.num_logit_rows
        if chunk.needs_logits:
            sample_rows.append(offset - 1)
    return logits[sample_rows] if sample_rows else None


def record_prompt_logprobs(sequence: Sequence, chunk: Chunk, rows: torch.Tensor) -> None:
    """Row r is position `chunk.start + r`, which predicts the prompt token after it;
    positions already recorded (before a preemption) are skipped."""
    first = len(sequence.prompt_logprobs) - chunk.start
    last = min(len(chunk.token_ids), sequence.prompt_len - 1 - chunk.start)
    if first < 0 or first >= last:
        return
    targets = sequence.token_ids[chunk.start + first + 1 : chunk.start + last + 1]
    k = sequence.request.prompt_logprobs or 0
    sequence.prompt_logprobs += scored_logprobs(rows[first:last], targets, k)
