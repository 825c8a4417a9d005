"""Fault isolation for one step's forward pass: find the chunks whose input makes it raise.

Re-running part of a step is safe because a step has no shared state to spoil:
- each chunk belongs to a different sequence, and attention reads only that sequence's blocks,
  so whether a chunk computes does not depend on which other chunks share the batch;
- a forward pass writes each chunk's K/V to the slots of its own positions, and writing them
  again from the same tokens and context gives the same values (idempotent);
- the model runner records nothing (computed positions, counters) until the forward returns,
  and the engine commits blocks and advances sequences only after that.

So when a batched forward raises, the batch is split in halves and each half run again, down
to single chunks: a chunk that still raises alone is a culprit, every other chunk gets the
logits it would have had. One culprit among n chunks costs about 2 log2(n) extra forwards.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.model.runner import Chunk

# Runs chunks in one forward pass; returns one logits row per chunk that needs logits.
Forward = Callable[[list[Chunk]], torch.Tensor]


@dataclass(slots=True)
class IsolatedStep:
    """The step's logits for the chunks that ran, and why each failing chunk failed."""

    # Rows of the surviving chunks that need logits, in chunk order.
    logit_rows: list[torch.Tensor] = field(default_factory=list)
    # Chunk index -> the exception its forward raised when it ran alone.
    failed: dict[int, Exception] = field(default_factory=dict)

    def logits(self) -> torch.Tensor | None:
        """The surviving rows as one [rows, vocab] tensor (None when no chunk needs logits)."""
        if not self.logit_rows:
            return None
        if len(self.logit_rows) == 1:
            return self.logit_rows[0]
        return torch.cat(self.logit_rows)


def run_isolated(forward: Forward, chunks: list[Chunk]) -> IsolatedStep:
    """Run `chunks` in one forward pass; if it raises, bisect to fail only the culprits."""
    step = IsolatedStep()
    _run(forward, chunks, 0, step)
    return step


def _run(forward: Forward, chunks: list[Chunk], offset: int, step: IsolatedStep) -> None:
    try:
        step.logit_rows.append(forward(chunks))
        return
    except Exception as error:  # judged below: the batch's fault, or one chunk's
        if len(chunks) == 1:
            step.failed[offset] = error
            return
    middle = len(chunks) // 2
    _run(forward, chunks[:middle], offset, step)
    _run(forward, chunks[middle:], offset + middle, step)
