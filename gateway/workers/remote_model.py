"""One model as a routing gateway serves it (`RemoteModel`), and the KV pool of some workers
as the gateway reads it (`RemotePool`).

A `RemoteModel` has the face the gateway's request path uses of an in-process engine
(`generate`, `max_model_len`, `grammars`, `pool`, `drop_public_prefix`), over the workers of
one model of a `RemoteEngine` (remote_engine.py; dispatch.py routes and fails over among them).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from engine.cache.kv_spec import KVSpec
from engine.model.loader import LoadedModel
from engine.request import GenerationDelta, GenerationRequest
from engine.structured.compile_limits import CompileLimits
from engine.structured.grammar import Grammars

_KV_DTYPES = frozenset({"bfloat16", "float32", "float16"})


class Workers(Protocol):
    """What models and pools call back into: the `RemoteEngine` that builds them."""

    def routable_states(
        self, fingerprint: str | None = None
    ) -> list[tuple[LoadedModel | None, dict[str, Any]]]: ...

    def known_models(self, fingerprint: str | None = None) -> list[LoadedModel]: ...

    def generate(
        self, request: GenerationRequest, fingerprint: str
    ) -> AsyncIterator[GenerationDelta]: ...

    def drop_public_prefix(
        self, namespace: str, token_ids: Any, fingerprint: str | None = None
    ) -> int: ...


class RemotePool:
    """What the gateway reads of "the pool" of some workers (one model's, or all): the KV
    layout, and the blocks a quota may use.

    A quota holds in each worker's pool, so the blocks it can use are the smallest worker's.
    Across models the layout is the one with the largest blocks (the most a block can weigh).
    """

    def __init__(self, engine: Workers, fingerprint: str | None = None) -> None:
        self._engine = engine
        self._fingerprint = fingerprint

    def _states(self) -> list[dict[str, Any]]:
        return [state for _, state in self._engine.routable_states(self._fingerprint)]

    @property
    def num_blocks(self) -> int:
        sizes = [int(state["stats"]["num_blocks"]) for state in self._states()]
        return min(sizes) if sizes else 0

    @property
    def spec(self) -> KVSpec:
        specs = [
            _spec(loaded, state)
            for loaded, state in self._engine.routable_states(self._fingerprint)
            if loaded is not None
        ]
        if not specs:  # nothing in routing: the layout of a model it knows, else a nominal one
            known = self._engine.known_models(self._fingerprint)
            return _spec(known[0], {}) if known else KVSpec(1, 1, 1, _dtype("float32"), 16)
        return max(specs, key=lambda spec: spec.bytes_per_block)


def _spec(loaded: LoadedModel, state: dict[str, Any]) -> KVSpec:
    describe = state.get("describe", {})
    block_size = int(state.get("block_size", 16))
    return KVSpec(
        loaded.num_layers,
        loaded.num_kv_heads,
        loaded.head_dim,
        _dtype(str(describe.get("kv_dtype", "float32"))),
        block_size,
    )


def _dtype(name: str) -> Any:
    import torch

    return getattr(torch, name if name in _KV_DTYPES else "float32")


class RemoteModel:
    """One model as a routing gateway serves it: its shape and tokenizer, and its workers.

    It has the face the gateway's request path uses of an in-process engine (`generate`,
    `max_model_len`, `grammars`, `pool`), so a request is prepared the same way whichever
    serves it.
    """

    def __init__(self, engine: Workers, loaded: LoadedModel, limits: CompileLimits) -> None:
        self._engine = engine
        self.loaded = loaded
        self.name = loaded.name
        self.fingerprint = loaded.fingerprint
        self.grammars = Grammars(loaded.tokenizer, loaded.vocab_size, loaded.eos_token_ids, limits)
        self.pool = RemotePool(engine, loaded.fingerprint)

    @property
    def max_model_len(self) -> int:
        """The shortest context among its workers in routing (its config's, with none)."""
        lengths = [
            int(state["max_model_len"])
            for _, state in self._engine.routable_states(self.fingerprint)
            if state.get("max_model_len")
        ]
        return min(lengths or [self.loaded.max_model_len])

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]:
        return self._engine.generate(request, self.fingerprint)

    def drop_public_prefix(self, namespace: str, token_ids: Any) -> int:
        """Drop a withdrawn prefix's public blocks on this model's workers."""
        return self._engine.drop_public_prefix(namespace, token_ids, self.fingerprint)
