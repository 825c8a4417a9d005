"""The console's session cookie and its CSRF tokens.

After login the operator's admin JWT lives in the cookie `pg_admin`: HttpOnly (no script reads
it), SameSite=Strict (no other site's page sends it), Path=/admin, Secure when the console was
reached over https, and it lasts as long as the token. Each page resolves the operator from it
(`caller_from_token`), so a logout, a disabled account or an expired token ends the session at
once.

Every form carries a CSRF token. For a session it is an HMAC of the session's token id (`jti`)
under the deployment's JWT secret: it needs no storage, differs per session, and cannot be
computed by anyone who has neither the secret nor the session. The login form has no session
yet, so it uses a double submit: a random nonce in the HttpOnly cookie `pg_login`, and the
HMAC of that nonce in the form; a page of another site can neither read nor set the cookie.

What a form did travels to the next page in the cookie `pg_flash` (a redirect-after-POST's
flash, see `pages.Redirect`), not in its address: a reload or a copied address shows no stale
"saved" message. It holds codes and ids, never a secret, lives a minute at most, and carries
an HMAC under the JWT secret: a cookie set by anyone else (a sibling site, say) is ignored.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from collections.abc import Mapping
from datetime import UTC, datetime
from urllib.parse import parse_qsl, urlencode

from starlette.requests import Request
from starlette.responses import Response

SESSION_COOKIE = "pg_admin"
LOGIN_COOKIE = "pg_login"
FLASH_COOKIE = "pg_flash"
COOKIE_PATH = "/admin"
LOGIN_COOKIE_MAX_AGE_S = 3600
FLASH_COOKIE_MAX_AGE_S = 60  # the page after the redirect reads it at once
_SESSION_PURPOSE = b"prefixgate-console-csrf\x00"
_LOGIN_PURPOSE = b"prefixgate-console-login\x00"
_FLASH_PURPOSE = b"prefixgate-console-flash\x00"


def session_csrf(secret: str, jti: str) -> str:
    """The CSRF token of the session with token id `jti`."""
    return _mac(secret, _SESSION_PURPOSE, jti)


def login_csrf(secret: str, nonce: str) -> str:
    """The login form's CSRF token for the nonce in its cookie."""
    return _mac(secret, _LOGIN_PURPOSE, nonce)


def token_matches(expected: str, presented: str | None) -> bool:
    """Whether the presented token is the expected one (constant time)."""
    if not presented:
        return False
    return hmac.compare_digest(expected.encode(), presented.encode("utf-8", "replace"))


def new_login_nonce() -> str:
    return secrets.token_urlsafe(24)


def set_session_cookie(
    request: Request, response: Response, token: str, expires_at: datetime
) -> None:
    """Put the session token in the cookie, for as long as the token lives."""
    max_age = max(0, int((expires_at - datetime.now(UTC)).total_seconds()))
    _set(request, response, SESSION_COOKIE, token, max_age)


def clear_session_cookie(request: Request, response: Response) -> None:
    _set(request, response, SESSION_COOKIE, "", 0)


def set_login_cookie(request: Request, response: Response, nonce: str) -> None:
    _set(request, response, LOGIN_COOKIE, nonce, LOGIN_COOKIE_MAX_AGE_S)


def clear_login_cookie(request: Request, response: Response) -> None:
    _set(request, response, LOGIN_COOKIE, "", 0)


def set_flash_cookie(
    request: Request, response: Response, secret: str, flash: Mapping[str, str]
) -> None:
    """Carry `flash` (short text values by name) to the next page the browser shows."""
    encoded = base64.urlsafe_b64encode(urlencode(flash).encode()).decode().rstrip("=")
    signed = f"{encoded}.{_mac(secret, _FLASH_PURPOSE, encoded)}"
    _set(request, response, FLASH_COOKIE, signed, FLASH_COOKIE_MAX_AGE_S)


def clear_flash_cookie(request: Request, response: Response) -> None:
    _set(request, response, FLASH_COOKIE, "", 0)


def flash_cookie(request: Request, secret: str) -> dict[str, str]:
    """The flash in the request's cookie (empty if none, or if it is not one of ours)."""
    encoded, _, mac = request.cookies.get(FLASH_COOKIE, "").partition(".")
    if not token_matches(_mac(secret, _FLASH_PURPOSE, encoded), mac):
        return {}
    try:
        text = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode()
    except ValueError:  # binascii.Error and UnicodeDecodeError are ValueErrors
        return {}
    return dict(parse_qsl(text))


def _set(request: Request, response: Response, name: str, value: str, max_age: int) -> None:
    response.set_cookie(
        name,
        value,
        max_age=max_age,
        path=COOKIE_PATH,
        secure=request.url.scheme == "https",
        httponly=True,
        samesite="strict",
    )


def _mac(secret: str, purpose: bytes, value: str) -> str:
    return hmac.new(secret.encode(), purpose + value.encode(), hashlib.sha256).hexdigest()
