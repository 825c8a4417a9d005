"""A worker's cached block keys as a log of additions and removals, for its gateways.

A gateway asks for what changed since the sequence number it last saw; a gateway that is new,
too far behind, or that saw another process (an `epoch` it does not know) gets the whole set.
Keys never travel as themselves: a block key is an unkeyed hash of the model's root, the
scope and the token ids, so anyone who read it (a stolen gateway certificate and worker secret
reach /internal/v1/state) could check a guessed private prompt offline, block by block. What a
worker publishes, and what routing compares, is a keyed digest of each key (`KeyDigest`:
BLAKE2b under a key derived from the gateways' signing key), `KEY_PREFIX_BYTES` long, in hex.
Without the signing key the published set says how many blocks a worker holds, never which
text. Routing only ranks workers, so a rare collision costs at most one less well placed
request, never a wrong cache hit (the worker's cache still checks the whole key and the tokens).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

KEY_PREFIX_BYTES = 8
# How many batches of changes are kept for gateways that ask for changes only.
_KEPT_CHANGES = 256
# Derives the digest's key from the signing key: the two uses never share a key.
_DIGEST_DOMAIN = b"prefixgate-published-block-keys-v1"


class KeyDigest:
    """What a worker publishes of a block key and routing compares: a keyed digest, which
    only the holders of the signing key (gateways and workers) can compute for a guess."""

    __slots__ = ("_key",)

    def __init__(self, signing_key: str) -> None:
        self._key = hmac.new(signing_key.encode(), _DIGEST_DOMAIN, hashlib.sha256).digest()

    def __call__(self, key: bytes) -> str:
        # Keyed BLAKE2b: a MAC in one C call, cheap enough for every block of every request.
        return hashlib.blake2b(key, digest_size=KEY_PREFIX_BYTES, key=self._key).hexdigest()


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

    def __init__(
        self,
        read_keys: Callable[[], Iterable[bytes]],
        digest: KeyDigest,
        min_interval_s: float = 0.2,
    ) -> None:
        self._read_keys = read_keys
        self._digest = digest
        self._min_interval_s = min_interval_s
        self.epoch = secrets.token_hex(8)  # a new process is a new key history
        self._lock = threading.Lock()
        self._keys: set[str] = set()
        # Each cached key's digest, computed once while it stays cached (a pool holds many).
        self._digests: dict[bytes, str] = {}
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
        held = set(self._read_keys())
        for key in self._digests.keys() - held:
            del self._digests[key]
        for key in held - self._digests.keys():
            self._digests[key] = self._digest(key)
        current = set(self._digests.values())
        plus, minus = sorted(current - self._keys), sorted(self._keys - current)
        if plus or minus:
            self._seq += 1
            self._changes.append((self._seq, plus, minus))
            self._keys = current
