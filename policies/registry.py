"""The public-prefix registry: admin-registered system prompts as token ids, matched fast.

Entries are indexed by (model, the bytes of their first block of token ids), so matching a
request costs one dictionary lookup on its first block and then one comparison per candidate
(usually one), never a scan over every registered text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.cache.block_hash import encode_token_ids
from policies.templates import system_prompt_tokens


@dataclass(frozen=True, slots=True)
class RegisteredPrefix:
    """An admin-registered system prompt as token ids, for one model and namespace."""

    model: str
    namespace: str
    name: str
    token_ids: tuple[int, ...]


def _first_block(token_ids: Sequence[int], block_size: int) -> bytes:
    return encode_token_ids(token_ids[:block_size])


@dataclass
class PublicPrefixRegistry:
    """Registered prefixes long enough to share (at least `min_blocks` whole blocks)."""

    block_size: int
    min_blocks: int
    _index: dict[tuple[str, bytes], list[RegisteredPrefix]] = field(default_factory=dict)
    too_short: list[RegisteredPrefix] = field(default_factory=list)

    def add(self, prefix: RegisteredPrefix) -> bool:
        """Index a prefix; returns False (and remembers it) if it is too short to share."""
        if len(prefix.token_ids) < self.min_blocks * self.block_size:
            self.too_short.append(prefix)
            return False
        key = (prefix.model, _first_block(prefix.token_ids, self.block_size))
        entries = self._index.setdefault(key, [])
        entries.append(prefix)
        entries.sort(key=lambda entry: len(entry.token_ids), reverse=True)
        return True

    def __len__(self) -> int:
        return sum(len(entries) for entries in self._index.values())

    def match(
        self, model: str, token_ids: Sequence[int], namespaces: Sequence[str]
    ) -> RegisteredPrefix | None:
        """The longest registered prefix that the request's leading tokens equal exactly."""
        if len(token_ids) < self.block_size:
            return None
        candidates = self._index.get((model, _first_block(token_ids, self.block_size)), ())
        for candidate in candidates:  # longest first
            length = len(candidate.token_ids)
            if candidate.namespace not in namespaces or length > len(token_ids):
                continue
            if tuple(token_ids[:length]) == candidate.token_ids:
                return candidate
        return None


def build_registry(
    model: str,
    entries: Sequence[tuple[str, str, str]],
    tokenizer: object,
    block_size: int,
    min_blocks: int,
) -> PublicPrefixRegistry:
    """A registry for one model from (namespace, name, system prompt text) entries."""
    registry = PublicPrefixRegistry(block_size, min_blocks)
    for namespace, name, text in entries:
        tokens = tuple(system_prompt_tokens(tokenizer, text))
        registry.add(RegisteredPrefix(model, namespace, name, tokens))
    return registry
