"""The data keys requests carry to the second KV tier: unwrapped once, kept in memory.

Each tenant's blocks are sealed in the tier under the tenant's data key, and a public prefix's
blocks under that prefix's (tenancy/seal_keys.py keeps them wrapped by the deployment's master
key). A request's keys are read here before it reaches the engine: from memory after the first
request, from the database (made there on first use) before it. A deleted tenant's or prefix's
key is forgotten as soon as this gateway hears of the deletion, and the database no longer has
it, so nothing can read that owner's tier entries again (crypto-shredding).
"""

from __future__ import annotations

import logging
import threading
import uuid

from engine.cache.cache_request import SealKeys
from engine.cache.tier.sealing import SealKey
from tenancy import seal_keys
from tenancy.errors import NotFound
from tenancy.store import Store

logger = logging.getLogger(__name__)


class SealKeyCache:
    """Tenants' and public prefixes' data keys, by id, for the requests of this gateway."""

    def __init__(self, store: Store, master_key: bytes) -> None:
        self._store = store
        self._master_key = master_key
        self._tenants: dict[str, SealKey] = {}
        self._prefixes: dict[str, SealKey] = {}
        # Deleted tenants: a key being read while its tenant was deleted is not kept.
        self._deleted: set[str] = set()
        self._lock = threading.Lock()

    def for_request(self, tenant_id: str, prefix_id: str | None) -> SealKeys | None:
        """The keys of a request of `tenant_id` whose public span matched `prefix_id` (None:
        none); None when the tenant's key cannot be had (the tenant was just deleted, or the
        stored key does not unwrap): the request is served without the tier. Blocking on a
        first use (a database read): call it off the event loop."""
        try:
            tenant = self._tenants.get(tenant_id) or self._load(tenant_id, None)
        except (NotFound, seal_keys.DataKeyUnreadable) as error:
            logger.warning("no tier for a request of tenant %s: %s", tenant_id, error)
            return None
        public = None
        if prefix_id is not None:
            try:
                public = self._prefixes.get(prefix_id) or self._load(None, prefix_id)
            except (NotFound, seal_keys.DataKeyUnreadable) as error:  # deleted meanwhile
                logger.warning("public blocks of prefix %s not sealed: %s", prefix_id, error)
        return SealKeys(tenant, public)

    def forget_tenant(self, tenant_id: str) -> None:
        with self._lock:
            self._tenants.pop(tenant_id, None)
            self._deleted.add(tenant_id)

    def forget_prefixes_except(self, prefix_ids: set[str]) -> None:
        """Forget every prefix key but those of the prefixes still enabled."""
        with self._lock:
            for prefix_id in set(self._prefixes) - prefix_ids:
                del self._prefixes[prefix_id]

    def _load(self, tenant_id: str | None, prefix_id: str | None) -> SealKey:
        with self._store.transaction() as session:
            if tenant_id is not None:
                data_key = seal_keys.tenant_data_key(
                    session, self._master_key, uuid.UUID(tenant_id)
                )
            else:
                assert prefix_id is not None
                data_key = seal_keys.prefix_data_key(
                    session, self._master_key, uuid.UUID(prefix_id)
                )
        key = SealKey(data_key.key_id, data_key.secret)
        with self._lock:
            if tenant_id is not None and tenant_id not in self._deleted:
                self._tenants[tenant_id] = key
            elif prefix_id is not None:
                self._prefixes[prefix_id] = key
        return key
