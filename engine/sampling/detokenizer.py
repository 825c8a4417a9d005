"""Incremental detokenization with stop strings that never leak into the stream."""

from __future__ import annotations

from collections import abc
from typing import Any

# Prompt tokens to decode with the first output tokens, so word boundaries come out right.
_CONTEXT_TOKENS = 6


class Detokenizer:
    """Turns one sequence's output tokens into text deltas, stopping at stop strings.

    Text that might be the beginning of a stop string is held back until it is not; a stop
    string and everything after it is never released.
    """

    def __init__(
        self, tokenizer: Any, prompt_ids: abc.Sequence[int], stop: abc.Sequence[str]
    ) -> None:
        self._tokenizer = tokenizer
        self._ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = tuple(stop)
        self.text = ""
        self._released = 0
        self.stopped = False

    def add(self, token_id: int) -> str:
        """Feed one output token; returns the text that is now safe to release."""
        if self.stopped:
            return ""
        self.text += self._decode_next(token_id)
        for stop in self._stop:
            index = self.text.find(stop, max(0, self._released - len(stop) + 1))
            if index != -1:
                self.text = self.text[:index]
                self.stopped = True
                return self._release(len(self.text))
        return self._release(len(self.text) - self._held_back())

    def flush(self) -> str:
        """Release whatever was held back (the sequence ended for another reason)."""
        return self._release(len(self.text))

    def _release(self, end: int) -> str:
        if end <= self._released:
            return ""
        delta = self.text[self._released : end]
        self._released = end
        return delta

    def _held_back(self) -> int:
        """Length of the longest tail of the text that begins some stop string."""
        longest = 0
        for stop in self._stop:
            for size in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:size]):
                    longest = size
                    break
        return longest

    def _decode_next(self, token_id: int) -> str:
        self._ids.append(token_id)
        decode = self._tokenizer.decode
        before = decode(
            self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=True
        )
        after = decode(self._ids[self._prefix_offset :], skip_special_tokens=True)
        # An incomplete UTF-8 sequence decodes to U+FFFD: wait for the next token.
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return str(after[len(before) :])
