"""The models a gateway serves, by the id clients send in `model`.

A gateway without workers serves one model, with the engine in its own process. A gateway with
workers serves every model a worker of it is in routing for (gateway/workers/models.py), and
each request goes only to workers of its own model (gateway/workers/dispatch.py). Either
way a request is prepared against its `ServedModel`: that model's tokenizer and chat template,
its context length, its grammars, and its own public-prefix registry (a registered prefix is
registered for one model: the same text is other tokens, other keys, in another).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from engine.model.loader import LoadedModel
from engine.request import GenerationDelta, GenerationRequest
from engine.structured.grammar import Grammars
from gateway.runtime.seal_keys import SealKeyCache
from gateway.runtime.sharing import SharingPolicyHolder
from gateway.settings import Settings
from policies.config import PolicyConfig
from tenancy.store import Store

logger = logging.getLogger(__name__)


class ModelEngine(Protocol):
    """What the request path uses of the engine of one model (in this process, or workers)."""

    grammars: Grammars
    pool: Any  # its KV layout (`spec`) and size (`num_blocks`)

    @property
    def max_model_len(self) -> int: ...

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]: ...

    def drop_public_prefix(self, namespace: str, token_ids: Sequence[int]) -> int: ...


class WorkersModel(ModelEngine, Protocol):
    """One model of a routing gateway's workers: its engine, its name and its shape."""

    name: str
    loaded: LoadedModel  # its tokenizer, chat template and shape, read from a worker


class WorkersModels(Protocol):
    """The models a routing gateway's workers serve (gateway/workers/remote_engine.py)."""

    def models(self) -> Mapping[str, WorkersModel]:
        """Every model with a worker in routing, by name."""

    def knows(self, fingerprint: str) -> bool:
        """Whether a worker it knows serves the model of `fingerprint`."""


@dataclass
class ServedModel:
    """One model a client may name, and everything its requests are prepared with."""

    name: str
    loaded: LoadedModel  # its tokenizer, chat template and shape
    engine: ModelEngine
    sharing: SharingPolicyHolder
    max_prompt_tokens_setting: int | None

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt it takes: the setting, else its context length less one."""
        return self.max_prompt_tokens_setting or self.engine.max_model_len - 1


class ServedModels:
    """The models served now: a fixed one, or those of the workers in routing."""

    def __init__(
        self,
        settings: Settings,
        policy: PolicyConfig,
        store: Store,
        local: ServedModel | None = None,
        remote: WorkersModels | None = None,
    ) -> None:
        self._settings = settings
        self._policy = policy
        self._store = store
        self._local = local
        self._remote = remote
        self._by_identity: dict[tuple[str, str], ServedModel] = {}  # by name and fingerprint
        self._lock = threading.Lock()
        # Data keys of a second KV tier, whose prefix keys follow the registries (None: none).
        self.seal_keys: SealKeyCache | None = None

    @classmethod
    def one(
        cls,
        settings: Settings,
        policy: PolicyConfig,
        store: Store,
        name: str,
        loaded: LoadedModel,
        engine: ModelEngine,
    ) -> ServedModels:
        """A gateway's own engine, serving one model under `name`."""
        sharing = SharingPolicyHolder(policy, loaded, name, settings.block_size)
        sharing.refresh(store)
        model = ServedModel(name, loaded, engine, sharing, settings.max_prompt_tokens)
        return cls(settings, policy, store, local=model)

    def get(self, name: str) -> ServedModel | None:
        """The model clients call `name`, if it is served now."""
        if self._local is not None:
            return self._local if name == self._local.name else None
        assert self._remote is not None
        remote = self._remote.models().get(name)
        return None if remote is None else self._served(remote.name, remote.loaded, remote)

    def all(self) -> list[ServedModel]:
        """Every model served now, by name."""
        if self._local is not None:
            return [self._local]
        assert self._remote is not None
        return [
            self._served(name, remote.loaded, remote)
            for name, remote in self._remote.models().items()
        ]

    def names(self) -> list[str]:
        return [model.name for model in self.all()]

    @property
    def min_public_blocks(self) -> int:
        """Whole blocks a registered prefix needs before it is shared (the policy's)."""
        return self._policy.min_public_blocks

    def default_name(self) -> str | None:
        """The model a request or a registration that names none means: the one served, when
        exactly one is."""
        names = self.names()
        return names[0] if len(names) == 1 else None

    def refresh_registries(self) -> None:
        """Rebuild each served model's public-prefix registry if its prefixes changed.

        Blocking (the database, tokenizers): run it off the event loop.
        """
        for model in self.all():
            model.sharing.refresh(self._store)
        if self.seal_keys is not None:  # a deleted prefix's key is not kept in memory
            enabled = {i for model in self.all() for i in model.sharing.prefix_ids()}
            self.seal_keys.forget_prefixes_except(enabled)
        if self._remote is not None:
            remote = self._remote
            with self._lock:  # forget the models no known worker serves any more
                for identity in [key for key in self._by_identity if not remote.knows(key[1])]:
                    del self._by_identity[identity]

    def _served(self, name: str, loaded: LoadedModel, engine: ModelEngine) -> ServedModel:
        """The `ServedModel` of a workers' model, made (and its registry loaded) the first time
        it is asked for. Its registry is loaded outside the lock; a database that does not
        answer then leaves it empty (nothing public is shared) until the next refresh."""
        identity = (name, loaded.fingerprint)
        with self._lock:
            model = self._by_identity.get(identity)
        if model is not None:
            return model
        sharing = SharingPolicyHolder(self._policy, loaded, name, self._settings.block_size)
        try:
            sharing.refresh(self._store)
        except Exception:  # the registry refresh loop retries every `registry_refresh_s`
            logger.warning("public prefixes of %s not loaded yet", name, exc_info=True)
        made = ServedModel(name, loaded, engine, sharing, self._settings.max_prompt_tokens)
        with self._lock:
            return self._by_identity.setdefault(identity, made)
