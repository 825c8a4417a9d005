"""Admin session tokens: short-lived JWTs signed with the deployment's JWT secret (PyJWT).

The algorithm is pinned (HS256: a token saying `alg: none` or RS256 is refused), and the
expiry, not-before, issuer and audience are checked with a small leeway for clock skew. A
token carries the operator's id and a token id (`jti`); the database decides whether that
session is still open (logout and disabled accounts revoke it) and what role it holds now.
"""

from __future__ import annotations

import re
import secrets
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime

import jwt

ALGORITHM = "HS256"
AUDIENCE = "prefixgate-admin"
_REQUIRED = ["exp", "iat", "nbf", "iss", "aud", "sub", "jti"]
_JTI = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class InvalidToken(Exception):
    """The token is malformed, wrongly signed, expired or not meant for us; says which."""


@dataclass(frozen=True, slots=True)
class IssuedToken:
    token: str
    jti: str
    expires_at: datetime


@dataclass(frozen=True, slots=True)
class TokenClaims:
    subject: str  # the operator's id
    jti: str


@dataclass(frozen=True, slots=True)
class AdminTokens:
    """Issues and checks admin tokens under one secret, issuer and lifetime."""

    secret: str
    issuer: str
    ttl_s: int
    leeway_s: int

    def issue(self, subject: str) -> IssuedToken:
        now = int(time.time())
        jti = secrets.token_urlsafe(24)
        claims = {
            "iss": self.issuer,
            "aud": AUDIENCE,
            "sub": subject,
            "jti": jti,
            "iat": now,
            "nbf": now,
            "exp": now + self.ttl_s,
        }
        token = jwt.encode(claims, self.secret, algorithm=ALGORITHM)
        return IssuedToken(token, jti, datetime.fromtimestamp(now + self.ttl_s, UTC))

    def check(self, token: str) -> TokenClaims:
        """The claims of a valid token; raises InvalidToken saying what is wrong."""
        try:
            claims = jwt.decode(
                token,
                self.secret,
                algorithms=[ALGORITHM],
                audience=AUDIENCE,
                issuer=self.issuer,
                leeway=self.leeway_s,
                options={"require": _REQUIRED},
            )
        except jwt.ExpiredSignatureError as error:
            raise InvalidToken("the admin token has expired; log in again") from error
        except jwt.InvalidTokenError as error:
            raise InvalidToken("invalid admin token") from error
        subject, jti = claims["sub"], claims["jti"]
        # Only what `issue` makes: an operator's uuid and a URL-safe token id.
        if not isinstance(jti, str) or not _JTI.match(jti) or not _is_uuid(subject):
            raise InvalidToken("invalid admin token")
        return TokenClaims(subject, jti)


def _is_uuid(value: object) -> bool:
    if not isinstance(value, str) or len(value) != 36:
        return False
    try:
        uuid.UUID(value)
    except ValueError:
        return False
    return True
