"""The model runner: one forward pass over a packed batch of sequence chunks.

It computes only the positions it is given, at their true positions, and records which prompt
positions each request had computed: the prompt positions never computed are what the request
reports as cached (I6), even when preemption made it recompute some of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from engine.attention.paged import ATTENTION_NAME, AttentionBackend, PagedBatch
from engine.kernels.cpu.fused import fuse_elementwise
from engine.kernels.cpu.linear import (
    MatrixLinear,
    PackedLinear,
    gather_packed_weights,
    pack_linears,
)
from engine.kernels.cpu.logits import fp32_logits
from engine.model.cpu_decoder import llama_decoder


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
    # Logits at every position of the chunk (for prompt logprobs), not only the last.
    all_logits: bool = False
    # Chunks of one share group (the engine's: their tenant) may read the blocks their tables
    # share together while decoding; None never does (see PagedBatch.share_groups).
    share_group: str | None = None

    @property
    def num_logit_rows(self) -> int:
        """Rows of logits the chunk gets back from `ModelRunner.run`."""
        return len(self.token_ids) if self.all_logits else int(self.needs_logits)


class ModelRunner:
    """Runs a transformers causal LM on the paged KV cache."""

    def __init__(
        self, model: PreTrainedModel, kv_cache: torch.Tensor, backend: AttentionBackend
    ) -> None:
        model.config._attn_implementation = ATTENTION_NAME
        self.fp32_logits = fp32_logits(model)  # before packing, which would take the head too
        fuse_elementwise(model)
        # PrefixGate's own forward where the model is a plain Llama on the CPU, else
        # transformers' with our attention function.
        self.decoder = llama_decoder(model)
        forward: torch.nn.Module = self.decoder if self.decoder is not None else model
        pack_linears(forward)
        gather_packed_weights(forward)
        # Whether every projection, the LM head too, sums in one order whatever else is in
        # the step (engine/kernels/cpu/linear.py).
        kinds = {type(module) for module in forward.modules()}
        self.matrix_linears = MatrixLinear in kinds and not kinds & {torch.nn.Linear, PackedLinear}
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

        The logits rows follow the order of the chunks, `num_logit_rows` each: the last
        token's row for a chunk that `needs_logits`, every token's for one with `all_logits`.
        """
        batch, input_ids, positions, logit_rows = self._batch(chunks)
        if self.decoder is not None:
            logits: torch.Tensor = self.decoder(input_ids, positions, logit_rows, batch)
        else:
            output = self.model(
                input_ids=input_ids[None],
                position_ids=positions[None],
                use_cache=False,
                logits_to_keep=logit_rows,
                paged_batch=batch,
            )
            logits = output.logits[0]
        # Recorded only now: a forward that raised computed nothing, and may be run again.
        for chunk in chunks:
            self.computed_tokens += len(chunk.token_ids)
            self._mark_prompt_positions(chunk)
        return logits.float()

    def _batch(
        self, chunks: list[Chunk]
    ) -> tuple[PagedBatch, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step's packed inputs and paged layout, built on the host with a few tensor ops
        for the whole batch and copied to the device in one transfer: (batch, input ids,
        positions, rows whose logits are kept)."""
        block_size = self.block_size
        query_lens = [len(chunk.token_ids) for chunk in chunks]
        context_lens = [
            chunk.start + count for chunk, count in zip(chunks, query_lens, strict=True)
        ]
        lengths = torch.tensor(query_lens)
        query_starts = torch.zeros(len(chunks) + 1, dtype=torch.long)
        torch.cumsum(lengths, 0, out=query_starts[1:])
        # Rows are padded with the sequence's own first block, never another's: a kernel or a
        # masked gather only ever reads the sequence's own memory.
        max_blocks = max(len(chunk.block_ids) for chunk in chunks)
        tables = torch.tensor(
            [
                chunk.block_ids + chunk.block_ids[:1] * (max_blocks - len(chunk.block_ids))
                for chunk in chunks
            ]
        )
        sequence_of_token = torch.repeat_interleave(torch.arange(len(chunks)), lengths)
        first_positions = torch.tensor([chunk.start for chunk in chunks]) - query_starts[:-1]
        positions = torch.arange(int(query_starts[-1])) + first_positions[sequence_of_token]
        blocks = tables[sequence_of_token, positions // block_size]
        slots = blocks * block_size + positions % block_size
        needs_logits = torch.tensor([chunk.needs_logits for chunk in chunks])
        logit_rows = (query_starts[1:] - 1)[needs_logits]
        if any(chunk.all_logits for chunk in chunks):
            kept = torch.zeros(int(query_starts[-1]), dtype=torch.bool)
            kept[logit_rows] = True
            for index, chunk in enumerate(chunks):
                if chunk.all_logits:
                    kept[query_starts[index] : query_starts[index + 1]] = True
            logit_rows = kept.nonzero()[:, 0]
        input_ids = torch.tensor([token for chunk in chunks for token in chunk.token_ids])
        groups: dict[str, int] = {}
        share_groups = torch.tensor(
            [
                -1
                if chunk.share_group is None
                else groups.setdefault(chunk.share_group, len(groups))
                for chunk in chunks
            ]
        )
        prompt_chunks = torch.tensor([int(chunk.prompt_positions > 0) for chunk in chunks])
        parts = (
            slots,
            input_ids,
            positions,
            logit_rows,
            query_starts,
            torch.tensor(context_lens),
            share_groups,
            prompt_chunks,
            tables.view(-1),
        )
        staged = torch.cat(parts)
        if self.device.type == "cuda":
            staged = staged.pin_memory()
        on_device = torch.split(staged.to(self.device, non_blocking=True), [len(p) for p in parts])
        slots, input_ids, positions, logit_rows = on_device[:4]
        starts, contexts, shares, prompts, table = (part.to(torch.int32) for part in on_device[4:])
        batch = PagedBatch(
            kv_cache=self.kv_cache,
            slot_mapping=slots,
            query_lens=query_lens,
            context_lens=context_lens,
            block_tables=table.view(len(chunks), max_blocks),
            query_starts=starts,
            context_lens_tensor=contexts,
            backend=self.backend,
            share_groups=shares,
            prompt_chunks=prompts,
        )
        return batch, input_ids, positions, logit_rows

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
