"""A worker's cached block keys as a log of additions and removals, for its gateways.

A gateway asks for what changed since the sequence number it last saw; a gateway that is new,
too far behind, or that saw another process (an `epoch` it does not know) gets the whole set.
Keys travel as the first `KEY_PREFIX_BYTES` bytes in hex: routing only ranks workers, so a
rare collision costs at most one less well placed request, never a wrong cache hit (the
worker's cache still checks the whole key and the tokens).
"""

from __future__ import annotations

import secrets
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

KEY_PREFIX_BYTES = 8
# How many batches of changes are kept for gateways that ask for changes only.
_KEPT_CHANGES = 256


def short_key(key: bytes) -> str:
    """The part of a block key that routing uses."""
    return key[:KEY_PREFIX_BYTES].hex()


@dataclass(frozen=True, slots=True)
class KeyUpdate:
    """What a gateway applies: either the whole set (`full`) or changes since its `since`."""

    epoch: str
    seq: int
    full: bool
    added: list[str]
    removed: list[str]


class KeyLog:
    """Turns snapshots of the cached keys into numbered batches of changes."""

    def __init__(self, read_keys: Callable[[], Iterable[bytes]], min_interval_s: float = 0.2):
        self._read_keys = read_keys
        self._min_interval_s = min_interval_s
        self.epoch = secrets.token_hex(8)  # a new process is a new key history
        self._lock = threading.Lock()
        self._keys: set[str] = set()
        self._seq = 0
        self._changes: deque[tuple[int, list[str], list[str]]] = deque(maxlen=_KEPT_CHANGES)
        self._read_at = float("-inf")

    def update(self, epoch: str | None, since: int, now: float) -> KeyUpdate:
        """What changed after `since` in `epoch` (the whole set if that cannot be told)."""
        with self._lock:
            if now - self._read_at >= self._min_interval_s:
                self._refresh()
                self._read_at = now
            oldest = self._changes[0][0] if self._changes else self._seq + 1
            if epoch != self.epoch or since > self._seq or since < oldest - 1:
                return KeyUpdate(self.epoch, self._seq, True, sorted(self._keys), [])
            added: list[str] = []
            removed: list[str] = []
            for seq, plus, minus in self._changes:
                if seq > since:
                    added += plus
                    removed += minus
            return KeyUpdate(self.epoch, self._seq, False, added, removed)

    def _refresh(self) -> None:
        current = {short_key(key) for key in self._read_keys()}
        plus, minus = sorted(current - self._keys), sorted(self._keys - current)
        if plus or minus:
            self._seq += 1
            self._changes.append((self._seq, plus, minus))
            self._keys = current
