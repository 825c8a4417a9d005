"""The sharing policy a running gateway plans with, kept in step with the registered prefixes.

The policy file is read once at start-up; the public-prefix registry is rebuilt whenever the
enabled prefixes for the served model change (an admin registered, disabled or removed one,
in this process or another), and requests plan with whichever policy is current.
"""

from __future__ import annotations

import logging

from engine.model.loader import LoadedModel
from policies.config import PolicyConfig
from policies.planner import SharingPolicy
from policies.registry import RegisteredPrefix, build_registry
from tenancy import prefixes
from tenancy.store import Store

logger = logging.getLogger(__name__)
# A registered prefix as the registry takes it: (namespace, name, system prompt text).
_Entries = tuple[tuple[str, str, str], ...]


class SharingPolicyHolder:
    """The current sharing policy; its registry is rebuilt when registered prefixes change."""

    def __init__(self, config: PolicyConfig, loaded: LoadedModel, model: str, block_size: int):
        self._config = config
        self._loaded = loaded
        self._model = model
        self._block_size = block_size
        self._entries: _Entries | None = None
        # Each enabled prefix's database id, by (namespace, name): what its data key is under.
        self._ids: dict[tuple[str, str], str] = {}
        self.current = self._build(())

    @property
    def min_public_blocks(self) -> int:
        """Whole blocks a registered prefix needs before it is shared."""
        return self._config.min_public_blocks

    def refresh(self, store: Store) -> bool:
        """Reload enabled prefixes for the served model; returns whether anything changed."""
        with store.transaction() as session:
            rows = prefixes.list_prefixes(session, self._model, enabled_only=True)
            entries = tuple((row.namespace, row.name, row.text) for row in rows)
            self._ids = {(row.namespace, row.name): str(row.id) for row in rows}
        if entries == self._entries:
            return False
        if self._loaded.tokenizer is None:
            entries = ()  # without a chat template nothing can be matched
        self.current = self._build(entries)
        self._entries = entries
        return True

    def prefix_ids(self) -> set[str]:
        """The database ids of the enabled prefixes."""
        return set(self._ids.values())

    def prefix_id(self, prefix: RegisteredPrefix) -> str | None:
        """The database id of a registered prefix a plan matched (None: no longer enabled)."""
        return self._ids.get((prefix.namespace, prefix.name))

    def _build(self, entries: _Entries) -> SharingPolicy:
        min_blocks = self._config.min_public_blocks
        tokenizer = self._loaded.tokenizer
        registry = build_registry(self._model, entries, tokenizer, self._block_size, min_blocks)
        for prefix in registry.too_short:
            logger.warning(
                "public prefix %s/%s is shorter than %d blocks and is not shared",
                prefix.namespace,
                prefix.name,
                min_blocks,
            )
        return SharingPolicy(self._config, registry)
