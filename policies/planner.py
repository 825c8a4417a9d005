"""Per-request scope planning: which token ranges are public, private, or not cached.

Rules:
- only a request's *leading* tokens that exactly equal an enabled, registered public prefix for
  this model are public, and only for tenants allowed to use public prefixes, and only in
  whole blocks, at least `min_public_blocks` of them;
- everything else is private: `User(tenant, user)` by default, `Tenant(tenant)` when the tenant
  chose tenant-wide sharing and the policy allows it;
- a request may ask for no caching at all.
A block holding any private token is private, and once the chain turns private it stays so:
the public segment always starts at 0 and ends on a block boundary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.cache.scope import NO_CACHE, CacheScope, Public, Segment, Tenant, User
from policies.config import PolicyConfig
from policies.registry import PublicPrefixRegistry, RegisteredPrefix
from policies.templates import MessageSpan


@dataclass(frozen=True, slots=True)
class PlanSubject:
    """Whose request is planned: the tenant (from the API key) and the end user inside it."""

    tenant_id: str
    user_id: str


@dataclass(frozen=True, slots=True)
class TenantPolicy:
    """What the tenant chose: how widely its private blocks are shared, and public prefixes."""

    sharing_mode: str = "user"  # or "tenant"
    may_use_public_prefixes: bool = True


@dataclass(frozen=True, slots=True)
class Plan:
    """The scopes of one request's tokens: segments tiling the prompt, and its tail's scope."""

    segments: list[Segment]
    tail_scope: CacheScope  # for generated tokens
    public: RegisteredPrefix | None = None

    @property
    def public_tokens(self) -> int:
        """How many leading tokens are shared publicly."""
        return sum(s.end - s.start for s in self.segments if isinstance(s.scope, Public))


class SharingPolicy:
    """The policy file plus the registry, for one block size."""

    def __init__(self, config: PolicyConfig, registry: PublicPrefixRegistry) -> None:
        if registry.min_blocks != config.min_public_blocks:
            raise ValueError("registry and policy disagree on the minimum public length")
        self.config = config
        self.registry = registry

    def private_scope(self, subject: PlanSubject, tenant: TenantPolicy) -> CacheScope:
        """The scope of the subject's private blocks: its user's, or its tenant's if shared."""
        if tenant.sharing_mode == "tenant" and self.config.allow_tenant_sharing:
            return Tenant(subject.tenant_id)
        return User(subject.tenant_id, subject.user_id)

    def plan(
        self,
        subject: PlanSubject,
        tenant: TenantPolicy,
        model: str,
        token_ids: Sequence[int],
        spans: Sequence[MessageSpan] = (),
        no_cache: bool = False,
    ) -> Plan:
        """Segments tiling `token_ids`, each with the scope its blocks may be shared under."""
        total = len(token_ids)
        if total == 0:
            raise ValueError("cannot plan an empty prompt")
        if no_cache:
            return Plan([Segment(0, total, NO_CACHE)], NO_CACHE)
        private = self.private_scope(subject, tenant)
        public = self._public_match(tenant, model, token_ids, spans)
        if public is None:
            return Plan([Segment(0, total, private)], private)
        block = self.registry.block_size
        public_end = min(len(public.token_ids), total) // block * block
        if public_end < self.config.min_public_blocks * block:
            return Plan([Segment(0, total, private)], private)
        segments = [Segment(0, public_end, Public(public.namespace))]
        if public_end < total:
            segments.append(Segment(public_end, total, private))
        return Plan(segments, private, public)

    def _public_match(
        self,
        tenant: TenantPolicy,
        model: str,
        token_ids: Sequence[int],
        spans: Sequence[MessageSpan],
    ) -> RegisteredPrefix | None:
        if not tenant.may_use_public_prefixes:
            return None
        if spans and spans[0].role != "system":
            return None
        return self.registry.match(model, token_ids, self.config.namespaces)
