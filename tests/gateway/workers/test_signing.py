"""A gateway's signature covers the whole request it sends, holds for MAX_AGE_S around the
worker's clock, and is accepted once."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.workers.signing import MAX_AGE_S, RequestSigner, action_view, generation_view

KEY = "a signing key of at least thirty-two characters"
NOW = 1_800_000_000.0
BODY: dict[str, Any] = {
    "request_id": "r1",
    "tenant_id": "acme",
    "prompt_token_ids": [1, 2, 3],
    "segments": [{"start": 0, "end": 3, "scope": {"kind": "tenant", "tenant_id": "acme"}}],
    "sampling": {"max_tokens": 1, "temperature": 0.0},
    "n": 1,
    "grammar": None,
}


def view(body: dict[str, Any] = BODY) -> dict[str, Any]:
    return generation_view(body, "fingerprint")


def test_a_signature_is_accepted_once_and_then_refused_as_replayed() -> None:
    gateway, worker = RequestSigner(KEY), RequestSigner(KEY)
    header = gateway.sign(view(), now=NOW)
    assert worker.verify(view(), header, now=NOW + 1) is None
    assert worker.verify(view(), header, now=NOW + 2) == "replayed"
    # Another worker has not seen it (a gateway's failover sends the same request there).
    assert RequestSigner(KEY).verify(view(), header, now=NOW + 2) is None


@pytest.mark.parametrize(
    "changed",
    [
        {**BODY, "sampling": {"max_tokens": 4096, "temperature": 0.0}},
        {**BODY, "n": 8},
        {**BODY, "grammar": 'root ::= "x"'},
        {**BODY, "prompt_token_ids": [1, 2, 4]},
        {**BODY, "tenant_id": "other"},
    ],
)
def test_any_change_to_the_request_breaks_its_signature(changed: dict[str, Any]) -> None:
    header = RequestSigner(KEY).sign(view(), now=NOW)
    assert RequestSigner(KEY).verify(view(changed), header, now=NOW) == "mismatch"


def test_a_signature_holds_only_within_max_age_of_the_workers_clock() -> None:
    gateway = RequestSigner(KEY)
    old = gateway.sign(view(), now=NOW - MAX_AGE_S - 1)
    ahead = gateway.sign(view(), now=NOW + MAX_AGE_S + 1)
    assert RequestSigner(KEY).verify(view(), old, now=NOW) == "stale"
    assert RequestSigner(KEY).verify(view(), ahead, now=NOW) == "stale"
    # The time is signed too: moving it forward breaks the signature, not the clock check.
    moved = old.replace(f"t={int(NOW - MAX_AGE_S - 1)}", f"t={int(NOW)}")
    assert RequestSigner(KEY).verify(view(), moved, now=NOW) == "mismatch"


@pytest.mark.parametrize(
    "header",
    [None, "", "0" * 64, "t=;s=ab", "t=12x;s=ab", "s=ab", "t=1;s=ab", f"t=1;n={'Z' * 32};s=ab"],
)
def test_a_missing_or_malformed_signature_is_refused(header: str | None) -> None:
    assert RequestSigner(KEY).verify(view(), header, now=NOW) == "missing"


def test_another_key_signs_nothing_here() -> None:
    header = RequestSigner("another key, also thirty-two characters").sign(view(), now=NOW)
    assert RequestSigner(KEY).verify(view(), header, now=NOW) == "mismatch"


def test_the_same_action_signed_twice_in_one_second_is_two_signatures() -> None:
    """Two gateways catching a returning worker up send it the same budgets in the same
    second: the second is not a replay of the first."""
    budgets = action_view("budgets", {"acme": {"quota_blocks": 8, "reserved_blocks": 0}})
    first = RequestSigner(KEY).sign(budgets, now=NOW)
    second = RequestSigner(KEY).sign(budgets, now=NOW)
    worker = RequestSigner(KEY)
    assert first != second
    assert worker.verify(budgets, first, now=NOW) is None
    assert worker.verify(budgets, second, now=NOW) is None
