"""The worked example of DESIGN.md at cache-manager level: exactly 208,896 fresh tokens."""

from __future__ import annotations

import random

from engine.cache.budget import PUBLIC_OWNER
from engine.cache.scope import Public, Segment, User
from engine.cache.stats import snapshot
from tests.support.cache import make_manager, request

PREFIX_TOKENS = 4096
SUFFIX_TOKENS = 2048
REQUESTS = 100


def test_shared_system_prompt_leaves_exactly_208896_fresh_tokens() -> None:
    rng = random.Random(0)
    manager = make_manager(num_blocks=1024, block_size=16)
    prefix = [rng.randrange(32000) for _ in range(PREFIX_TOKENS)]
    public = Public("default")

    def serve(tenant: str, tokens: list[int]) -> int:
        private = User(tenant, "u")
        segments = [Segment(0, PREFIX_TOKENS, public)]
        if len(tokens) > PREFIX_TOKENS:
            segments.append(Segment(PREFIX_TOKENS, len(tokens), private))
        req = request(tenant, tokens, private, segments=segments)
        hit = manager.match(req)
        fresh = len(tokens) - hit.cached_tokens
        assert manager.admit(hit, fresh) is None
        manager.commit(req.request_id, len(tokens))
        manager.free(req.request_id)
        manager.end_step()
        return fresh

    fresh_tokens = serve("warm-up", prefix)
    for index in range(REQUESTS):
        suffix = [rng.randrange(32000) for _ in range(SUFFIX_TOKENS)]
        fresh_tokens += serve(f"tenant-{index}", prefix + suffix)

    assert fresh_tokens == 208_896
    stats = snapshot(manager)
    tenants = [stats for owner, stats in stats.owners.items() if owner is not PUBLIC_OWNER]
    cached = sum(owner.counters.cached_tokens for owner in tenants)
    assert cached == REQUESTS * PREFIX_TOKENS == 409_600
    assert stats.prompt_tokens - cached == fresh_tokens
    public = stats.owners[PUBLIC_OWNER]
    assert public.cached_blocks == PREFIX_TOKENS // 16
    # The public budget's reuse: every request's prompt tokens in public blocks, and those
    # read from its cache (all but the warm-up's).
    assert public.counters.prompt_tokens == (REQUESTS + 1) * PREFIX_TOKENS
    assert public.counters.cached_tokens == REQUESTS * PREFIX_TOKENS
    assert round(public.counters.reuse, 4) == round(100 / 101, 4)
