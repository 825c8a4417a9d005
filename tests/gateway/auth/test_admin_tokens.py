"""AdminTokens: a token it issues checks out; one that is expired past the leeway, not yet
valid, signed another way or missing a claim does not."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jwt
import pytest

from gateway.auth.admin_tokens import ALGORITHM, AUDIENCE, AdminTokens, InvalidToken

# Long enough for HS512 too, so that refusing HS512 is about the algorithm, not the key.
SECRET = "unit-test-jwt-secret-" + "x" * 48
LEEWAY_S = 30
TOKENS = AdminTokens(secret=SECRET, issuer="prefixgate", ttl_s=900, leeway_s=LEEWAY_S)

OPERATOR_ID = "5b0c2a0e-8c39-4d5e-9a7e-0f6f0d1c2b3a"


def _claims(**changes: Any) -> dict[str, Any]:
    """Claims as `issue` writes them, valid now, with `changes` applied (None removes one)."""
    now = int(time.time())
    claims: dict[str, Any] = {
        "iss": "prefixgate",
        "aud": AUDIENCE,
        "sub": "2f1c6a52-0d4e-4a8e-9a41-6b0f3c7f1d10",
        "jti": "a-token-id",
        "iat": now,
        "nbf": now,
        "exp": now + 900,
    }
    claims.update(changes)
    return {name: value for name, value in claims.items() if value is not None}


def _sign(claims: dict[str, Any], secret: str = SECRET, algorithm: str = ALGORITHM) -> str:
    return jwt.encode(claims, secret, algorithm=algorithm)


def test_an_issued_token_checks_out_with_its_subject_and_id() -> None:
    before = int(time.time())
    issued = TOKENS.issue(OPERATOR_ID)
    claims = TOKENS.check(issued.token)
    assert (claims.subject, claims.jti) == (OPERATOR_ID, issued.jti)
    assert jwt.get_unverified_header(issued.token)["alg"] == "HS256"
    assert before + 900 <= issued.expires_at.timestamp() <= int(time.time()) + 900
    assert TOKENS.issue(OPERATOR_ID).jti != issued.jti  # every session has its own id


def test_a_hand_signed_token_with_the_same_claims_checks_out() -> None:
    # The control for every refusal below: only the one changed thing makes them fail.
    assert TOKENS.check(_sign(_claims())).jti == "a-token-id"


def test_expired_by_less_than_the_leeway_passes_by_more_fails() -> None:
    now = int(time.time())
    within = _claims(iat=now - 3600, nbf=now - 3600, exp=now - (LEEWAY_S - 10))
    assert TOKENS.check(_sign(within)).subject
    beyond = _claims(iat=now - 3600, nbf=now - 3600, exp=now - (LEEWAY_S + 10))
    with pytest.raises(InvalidToken, match="expired"):
        TOKENS.check(_sign(beyond))


def test_a_token_not_yet_valid_fails() -> None:
    now = int(time.time())
    with pytest.raises(InvalidToken):
        TOKENS.check(_sign(_claims(nbf=now + LEEWAY_S + 60)))
    with pytest.raises(InvalidToken):  # issued in the future is as suspicious
        TOKENS.check(_sign(_claims(iat=now + LEEWAY_S + 60, nbf=now)))


def test_the_algorithm_is_pinned_to_hs256() -> None:
    with pytest.raises(InvalidToken):
        TOKENS.check(_sign(_claims(), algorithm="HS512"))  # the right secret, another algorithm
    with pytest.raises(InvalidToken):
        TOKENS.check(jwt.encode(_claims(), None, algorithm="none"))
    _header, payload, signature = _sign(_claims()).split(".")
    with pytest.raises(InvalidToken):  # a valid HS256 signature under a header that says none
        TOKENS.check(".".join([_none_header(), payload, signature]))


def _none_header() -> str:
    return jwt.utils.base64url_encode(b'{"alg":"none","typ":"JWT"}').decode()


# Each token is made when its test runs: made at collection, its claims would expire when the
# suite reaches this file more than 15 minutes later, and it would fail for another reason.
@pytest.mark.parametrize(
    ("what", "token"),
    [
        ("wrong secret", lambda: _sign(_claims(), secret="another-secret-of-at-least-32-bytes!")),
        ("wrong audience", lambda: _sign(_claims(aud="prefixgate-inference"))),
        ("wrong issuer", lambda: _sign(_claims(iss="someone-else"))),
        ("id too long", lambda: _sign(_claims(jti="x" * 65))),
        ("garbage", lambda: "not-a-token"),
        ("empty", lambda: ""),
    ],
)
def test_a_token_not_meant_for_us_fails(what: str, token: Callable[[], str]) -> None:
    with pytest.raises(InvalidToken, match="invalid admin token"):
        TOKENS.check(token())


@pytest.mark.parametrize("claim", ["exp", "iat", "nbf", "iss", "aud", "sub", "jti"])
def test_every_claim_is_required(claim: str) -> None:
    with pytest.raises(InvalidToken):
        TOKENS.check(_sign(_claims(**{claim: None})))


@pytest.mark.parametrize(
    ("claim", "value"),
    [("jti", "\ud800"), ("jti", "has space"), ("sub", "operator-1"), ("sub", 7)],
)
def test_a_signed_token_with_claims_we_never_issue_is_refused(claim: str, value: object) -> None:
    claims = {**jwt.decode(TOKENS.issue(OPERATOR_ID).token, options={"verify_signature": False})}
    claims[claim] = value
    with pytest.raises(InvalidToken):
        TOKENS.check(_sign(claims))
