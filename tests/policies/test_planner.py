"""Sharing-policy rules, with token ids made up in the test (no tokenizer needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.cache.scope import NO_CACHE, Public, Segment, Tenant, User, block_scopes
from policies.config import PolicyConfig, PolicyFileError, load_policy
from policies.planner import PlanSubject, SharingPolicy, TenantPolicy
from policies.registry import PublicPrefixRegistry, RegisteredPrefix
from policies.templates import MessageSpan

BLOCK = 4
MODEL = "m"
SYSTEM = tuple(range(100, 118))  # 18 tokens: four whole blocks and two more
ALICE = PlanSubject("t1", "alice")


def policy(
    min_blocks: int = 2, allow_tenant_sharing: bool = True, *prefixes: RegisteredPrefix
) -> SharingPolicy:
    config = PolicyConfig(min_public_blocks=min_blocks, allow_tenant_sharing=allow_tenant_sharing)
    registry = PublicPrefixRegistry(BLOCK, min_blocks)
    for prefix in prefixes or (RegisteredPrefix(MODEL, "default", "sys", SYSTEM),):
        registry.add(prefix)
    return SharingPolicy(config, registry)


def test_registered_leading_tokens_are_public_in_whole_blocks() -> None:
    plan = policy().plan(ALICE, TenantPolicy(), MODEL, [*SYSTEM, 1, 2, 3])
    assert plan.segments == [
        Segment(0, 16, Public("default")),
        Segment(16, 21, User("t1", "alice")),
    ]
    assert plan.tail_scope == User("t1", "alice") and plan.public_tokens == 16


def test_a_prompt_differing_by_one_token_is_entirely_private() -> None:
    altered = [*SYSTEM[:7], 999, *SYSTEM[8:], 1, 2]
    plan = policy().plan(ALICE, TenantPolicy(), MODEL, altered)
    assert plan.segments == [Segment(0, len(altered), User("t1", "alice"))]


def test_a_registered_prefix_is_public_only_at_the_start_of_the_prompt() -> None:
    plan = policy().plan(ALICE, TenantPolicy(), MODEL, [7, *SYSTEM, 1])
    assert plan.public is None


def test_a_tenant_without_public_prefixes_or_another_model_gets_no_public_prefix() -> None:
    prompt = [*SYSTEM, 1]
    assert (
        policy().plan(ALICE, TenantPolicy(may_use_public_prefixes=False), MODEL, prompt).public
        is None
    )
    assert policy().plan(ALICE, TenantPolicy(), "other-model", prompt).public is None


def test_prefix_shorter_than_the_minimum_is_not_shared() -> None:
    plan = policy(5).plan(ALICE, TenantPolicy(), MODEL, [*SYSTEM, 1])  # 4 whole blocks < 5
    assert plan.public is None and len(policy(5).registry.too_short) == 1


def test_tenant_sharing_widens_the_tail_to_the_tenant_only_when_the_policy_allows() -> None:
    tenant_wide = TenantPolicy(sharing_mode="tenant")
    assert policy().plan(ALICE, tenant_wide, MODEL, [1, 2]).tail_scope == Tenant("t1")
    locked = policy(2, False)
    assert locked.plan(ALICE, tenant_wide, MODEL, [1, 2]).tail_scope == User("t1", "alice")


def test_a_no_cache_request_plans_every_token_as_no_cache() -> None:
    plan = policy().plan(ALICE, TenantPolicy(), MODEL, [*SYSTEM, 1], no_cache=True)
    assert plan.segments == [Segment(0, 19, NO_CACHE)] and plan.tail_scope == NO_CACHE


def test_first_message_must_be_the_system_prompt() -> None:
    spans = [MessageSpan("user", 0, 19)]
    assert policy().plan(ALICE, TenantPolicy(), MODEL, [*SYSTEM, 1], spans).public is None


def test_longest_of_several_registered_prefixes_wins() -> None:
    short = RegisteredPrefix(MODEL, "default", "short", SYSTEM[:10])
    long = RegisteredPrefix(MODEL, "default", "long", SYSTEM)
    plan = policy(2, True, short, long).plan(ALICE, TenantPolicy(), MODEL, [*SYSTEM, 5])
    assert plan.public == long


def test_policy_file_errors_name_the_field(tmp_path: Path) -> None:
    assert load_policy().min_public_blocks >= 1
    bad = tmp_path / "policy.yaml"
    bad.write_text("min_public_blocks: 0\n")
    with pytest.raises(PolicyFileError, match="field `min_public_blocks`"):
        load_policy(bad)
    bad.write_text("namespaces: []\n")
    with pytest.raises(PolicyFileError, match="field `namespaces`"):
        load_policy(bad)
    bad.write_text("allow_tenant_sharing: true\nsurprise: 1\n")
    with pytest.raises(PolicyFileError, match="field `surprise`"):
        load_policy(bad)
    with pytest.raises(PolicyFileError, match="cannot read"):
        load_policy(tmp_path / "missing.yaml")


tokens = st.lists(st.integers(0, 30), min_size=1, max_size=40)


@settings(max_examples=300, deadline=None)
@given(
    registered=st.lists(tokens, min_size=1, max_size=4),
    chosen=st.integers(0, 3),
    keep=st.integers(0, 40),
    tail=st.lists(st.integers(0, 30), max_size=20),
    min_blocks=st.integers(1, 3),
)
def test_no_private_token_ever_lands_in_a_public_block(
    registered: list[list[int]], chosen: int, keep: int, tail: list[int], min_blocks: int
) -> None:
    prefixes = [
        RegisteredPrefix(MODEL, "default", f"p{i}", tuple(t)) for i, t in enumerate(registered)
    ]
    sharing = policy(min_blocks, True, *prefixes)
    # A prompt that starts with (part of) some registered prefix, then anything.
    prompt = list(registered[chosen % len(registered)][:keep]) + tail
    if not prompt:
        return
    plan = sharing.plan(ALICE, TenantPolicy(), MODEL, prompt)
    scopes = block_scopes(plan.segments, len(prompt), BLOCK, plan.tail_scope)
    for index, scope in enumerate(scopes):
        if not isinstance(scope, Public):
            assert all(not isinstance(s, Public) for s in scopes[index:]), "public after private"
            continue
        block_tokens = prompt[index * BLOCK : (index + 1) * BLOCK]
        assert len(block_tokens) == BLOCK, "a partial block cannot be public"
        # Every token of a public block belongs to a registered prefix the prompt starts with.
        end = (index + 1) * BLOCK
        assert any(
            len(p.token_ids) >= end and tuple(prompt[:end]) == p.token_ids[:end] for p in prefixes
        )
