"""The model runner: one forward pass over a packed batch of sequence chunks.

It computes only the positions it is given, at their true positions, and records which prompt
positions each request had computed: the prompt positions never computed are what the request
reports as cached (I6), even when preemption made it recompute some of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from engine.attention import ATTENTION_NAME, AttentionBackend, PagedBatch


@dataclass(frozen=True, slots=True)
class Chunk:
    """Tokens of one sequence to compute in this step, starting at position `start`."""

    request_id: str
    token_ids: list[int]
    start: int
    block_ids: list[int]
    # Prompt positions in this chunk (the rest are generated tokens being fed back).
    prompt_positions: int
    needs_logits: bool


class ModelRunner:
    """Runs a transformers causal LM on the paged KV cache."""

    def __init__(
        self, model: PreTrainedModel, kv_cache: torch.Tensor, backend: AttentionBackend
    ) -> None:
        model.config._attn_implementation = ATTENTION_NAME
        self.model = model.eval()  # type: ignore[no-untyped-call]
        self.kv_cache = kv_cache
        self.backend = backend
        self.block_size = int(kv_cache.shape[3])
        self.device = kv_cache.device
        self.computed_tokens = 0
        # One byte per prompt position, 1 once the model has computed it.
        self._prompt_positions: dict[str, bytearray] = {}

    @torch.inference_mode()
    def run(self, chunks: list[Chunk]) -> torch.Tensor:
        """Compute all chunks in one forward pass; returns logits of chunks that need them.

        The logits rows follow the order of the chunks with `needs_logits`, one row each, for
        the chunk's last token.
        """
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logit_rows: list[int] = []
        query_lens, context_lens = [], []
        block_size = self.block_size
        for chunk in chunks:
            count = len(chunk.token_ids)
            input_ids += chunk.token_ids
            chunk_positions = range(chunk.start, chunk.start + count)
            positions += chunk_positions
            slots += [
                chunk.block_ids[position // block_size] * block_size + position % block_size
                for position in chunk_positions
            ]
            query_lens.append(count)
            context_lens.append(chunk.start + count)
            if chunk.needs_logits:
                logit_rows.append(len(input_ids) - 1)
        max_blocks = max(len(chunk.block_ids) for chunk in chunks)
        # Rows are padded with the sequence's own first block, never another's: padded slots
        # are masked out, but a masked NaN still poisons attention (NaN + -inf is NaN), so a
        # sequence must only ever read its own memory.
        tables = torch.tensor(
            [
                chunk.block_ids + chunk.block_ids[:1] * (max_blocks - len(chunk.block_ids))
                for chunk in chunks
            ],
            dtype=torch.long,
        )
        batch = PagedBatch(
            kv_cache=self.kv_cache,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            query_lens=query_lens,
            context_lens=context_lens,
            block_tables=tables.to(self.device),
            backend=self.backend,
        )
        output = self.model(
            input_ids=torch.tensor([input_ids], device=self.device),
            position_ids=torch.tensor([positions], device=self.device),
            use_cache=False,
            logits_to_keep=torch.tensor(logit_rows, dtype=torch.long, device=self.device),
            paged_batch=batch,
        )
        logits: torch.Tensor = output.logits[0]
        # Recorded only now: a forward that raised computed nothing, and may be run again.
        for chunk in chunks:
            self.computed_tokens += len(chunk.token_ids)
            self._mark_prompt_positions(chunk)
        return logits.float()

    def _mark_prompt_positions(self, chunk: Chunk) -> None:
        if chunk.prompt_positions <= 0:
            return
        marks = self._prompt_positions.setdefault(chunk.request_id, bytearray())
        end = chunk.start + chunk.prompt_positions
        if len(marks) < end:
            marks.extend(bytes(end - len(marks)))
        marks[chunk.start : end] = b"\x01" * chunk.prompt_positions

    def pop_computed_prompt_positions(self, request_id: str) -> int:
        """How many distinct prompt positions of a request the model computed; stops tracking it."""
        return self._prompt_positions.pop(request_id, bytearray()).count(1)
