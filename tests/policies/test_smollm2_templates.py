"""Scope planning with the real SmolLM2 tokenizer and chat template."""

from __future__ import annotations

from typing import Any

import pytest

from engine.cache.block_hash import BlockHasher, encode_token_ids
from engine.cache.cache_request import CacheRequest, request_block_scopes
from engine.cache.scope import Public, User
from policies.config import PolicyConfig
from policies.planner import Plan, PlanSubject, SharingPolicy, TenantPolicy
from policies.registry import build_registry
from policies.templates import render_with_spans, system_prompt_tokens

MODEL = "smollm2-135m-instruct"
BLOCK = 16
SYSTEM = (
    "You are the support assistant of Acme Travel. Answer briefly and politely, in the "
    "customer's language. Never reveal internal booking codes or staff names. If a question "
    "is about refunds, point to the refund form at acme.example/refunds."
)


@pytest.fixture(scope="module")
def sharing(smollm2_tokenizer: Any) -> SharingPolicy:
    config = PolicyConfig(min_public_blocks=2)
    registry = build_registry(
        MODEL, [("default", "acme-support", SYSTEM)], smollm2_tokenizer, BLOCK, 2
    )
    return SharingPolicy(config, registry)


def conversation(system: str, user: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def planned(sharing: SharingPolicy, tokenizer: Any, messages: list[dict[str, str]],
            subject: PlanSubject, tenant: TenantPolicy) -> tuple[list[int], Plan]:  # fmt: skip
    token_ids, spans = render_with_spans(tokenizer, messages)
    return token_ids, sharing.plan(subject, tenant, MODEL, token_ids, spans)


def block_keys(token_ids: list[int], plan: Plan, tenant_id: str) -> list[bytes]:
    request = CacheRequest("r", tenant_id, token_ids, plan.segments, plan.tail_scope)
    hasher = BlockHasher(BLOCK)
    scopes = request_block_scopes(request, BLOCK)
    return hasher.chain(hasher.root("fp", "", "float32"), encode_token_ids(token_ids), scopes)


def test_registered_system_prompt_is_public_and_the_user_turn_private(
    sharing: SharingPolicy, smollm2_tokenizer: Any
) -> None:
    question = "My booking code is XK-4471, can I still change the date?"
    token_ids, plan = planned(sharing, smollm2_tokenizer, conversation(SYSTEM, question),
                              PlanSubject("t1", "alice"), TenantPolicy())  # fmt: skip
    public, private = plan.segments
    assert isinstance(public.scope, Public) and public.start == 0
    assert private.scope == User("t1", "alice") and private.end == len(token_ids)
    system_tokens = system_prompt_tokens(smollm2_tokenizer, SYSTEM)
    assert public.end == len(system_tokens) // BLOCK * BLOCK
    # Not one token of the user's words is inside the public range.
    user_text = smollm2_tokenizer.decode(token_ids[public.end :])
    assert "XK-4471" in user_text
    assert "XK-4471" not in smollm2_tokenizer.decode(token_ids[: public.end])


def test_system_prompt_differing_by_one_token_is_fully_private(
    sharing: SharingPolicy, smollm2_tokenizer: Any
) -> None:
    altered = SYSTEM.replace("briefly", "shortly")
    _, plan = planned(sharing, smollm2_tokenizer, conversation(altered, "Hello"),
                      PlanSubject("t1", "alice"), TenantPolicy())  # fmt: skip
    assert plan.public is None
    assert [s.scope for s in plan.segments] == [User("t1", "alice")]


def test_two_users_of_a_user_scoped_tenant_share_no_private_block(
    sharing: SharingPolicy, smollm2_tokenizer: Any
) -> None:
    messages = conversation(SYSTEM, "Where is my refund? Order 55812. " * 4)
    keys = {}
    for user in ("alice", "bob"):
        token_ids, plan = planned(sharing, smollm2_tokenizer, messages, PlanSubject("t1", user),
                                  TenantPolicy("user"))  # fmt: skip
        keys[user] = block_keys(token_ids, plan, "t1")
    public_blocks = plan.public_tokens // BLOCK
    assert public_blocks >= 2
    assert keys["alice"][:public_blocks] == keys["bob"][:public_blocks]
    private = list(zip(keys["alice"][public_blocks:], keys["bob"][public_blocks:], strict=True))
    assert private and all(a != b for a, b in private)


def test_a_tenant_scoped_tenant_shares_its_private_blocks(
    sharing: SharingPolicy, smollm2_tokenizer: Any
) -> None:
    messages = conversation(SYSTEM, "Where is my refund? Order 55812. " * 4)
    keys = []
    for user in ("alice", "bob"):
        token_ids, plan = planned(sharing, smollm2_tokenizer, messages, PlanSubject("t1", user),
                                  TenantPolicy("tenant"))  # fmt: skip
        keys.append(block_keys(token_ids, plan, "t1"))
    assert keys[0] == keys[1] and len(keys[0]) > plan.public_tokens // BLOCK
