"""The same requests through transformers' own `generate`, with no reuse between requests."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from engine.request import GenerationRequest


@dataclass(frozen=True)
class BaselineResult:
    seconds: float
    output_tokens: int


def sdpa_copy(model: PreTrainedModel) -> PreTrainedModel:
    """The same weights with transformers' sdpa attention and its own KV cache."""
    config = copy.deepcopy(model.config)
    config._attn_implementation = "sdpa"
    reference = type(model)(config)
    reference.load_state_dict(model.state_dict())
    reference.eval()
    return reference


@torch.inference_mode()
def run_hf(
    model: PreTrainedModel, requests: list[GenerationRequest], batch_size: int
) -> BaselineResult:
    """Greedy `generate` in batches of equal-length prompts (left-padded when they differ)."""
    reference = sdpa_copy(model)
    started = time.perf_counter()
    output_tokens = 0
    for first in range(0, len(requests), batch_size):
        batch = requests[first : first + batch_size]
        longest = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.zeros((len(batch), longest), dtype=torch.long)
        mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for row, request in enumerate(batch):
            prompt = list(request.prompt_token_ids)
            ids[row, longest - len(prompt) :] = torch.tensor(prompt)
            mask[row, longest - len(prompt) :] = 1
        new_tokens = max(r.sampling.max_tokens for r in batch)
        output = reference.generate(  # type: ignore[operator]
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        output_tokens += (output.shape[1] - longest) * len(batch)
    return BaselineResult(time.perf_counter() - started, output_tokens)
