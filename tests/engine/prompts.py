"""Seeded random prompts for the model tests, and batches of requests sharing a public prefix."""

from __future__ import annotations

import torch

from engine.cache.scope import Public, Segment, User
from engine.request import GenerationRequest
from tests.support.models import VOCAB, make_request

SUFFIX_TOKENS = 20


def tokens(seed: int, count: int, vocab: int = VOCAB) -> list[int]:
    """`count` random token ids below `vocab`; the same seed gives the same ids."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (count,), generator=generator).tolist()


def shared_prefix_requests(
    prefix: list[int],
    namespace: str,
    tenants: list[str],
    count: int,
    max_tokens: int,
    id_prefix: str,
) -> list[GenerationRequest]:
    """`count` requests that share `prefix`, public in `namespace`, and then part ways.

    Each one adds 20 tokens of its own, private to user "u" of the next tenant in turn.
    """
    requests = []
    for index in range(count):
        tenant = tenants[index % len(tenants)]
        start, end = len(prefix), len(prefix) + SUFFIX_TOKENS
        segments = [Segment(0, start, Public(namespace)), Segment(start, end, User(tenant, "u"))]
        prompt = prefix + tokens(10 + index, SUFFIX_TOKENS)
        request = make_request(
            f"{id_prefix}{index}", prompt, tenant, "u", max_tokens, segments=segments
        )
        requests.append(request)
    return requests
