"""Checking an operator's credentials under the login rules: one home for every check of a
password (a login, the current password of a password change, removing a second factor).

In order: the source's attempts per minute (this gateway's memory), then, in the database
every gateway shares, the wait of the (name, source) pair after its earlier failures
(tenancy/login_failures.py); then the check itself holds one of the process's password-hashing
slots. A failed guess counts against its pair; anything else clears it. Nothing here depends
on whether the name exists, so a refusal confirms no name.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TypeVar

from sqlalchemy.orm import Session

from gateway.auth.login_throttle import PasswordChecksBusy, login_source
from gateway.errors import APIError
from gateway.state import GatewayState
from tenancy import login_failures

T = TypeVar("T")


class CheckRefused(Exception):
    """The check did not run: `reason` for the audit event, `error` for the caller."""

    def __init__(self, reason: str, error: APIError) -> None:
        super().__init__(reason)
        self.reason = reason
        self.error = error


def wrong_credentials(message: str, param: str) -> APIError:
    """The answer to a wrong password (or code) checked for a caller already signed in: a 400
    naming the field, coded `invalid_credentials` as a failed login is. Not a 401: the session
    is fine, and a client (the console) that reads a 401 as "log in again" must not drop it."""
    return APIError.invalid(message, param, "invalid_credentials")


def guarded_check(
    state: GatewayState,
    username: str,
    source_ip: str | None,
    check: Callable[[Session], T],
    failed_guess: Callable[[T], bool],
) -> T:
    """Run `check` (in one transaction) unless the source or the (username, source) pair must
    wait; count its outcome against the pair. Raises CheckRefused when it did not run."""
    source = login_source(source_ip)
    wait = state.login_throttle.admit(source)
    if wait is not None:
        error = APIError.rate_limited(
            "too many login attempts from this address; try again later",
            wait,
            code="too_many_login_attempts",
        )
        raise CheckRefused("throttled_source", error)
    pair = login_failures.pair_key(state.settings.secret("key_hash_secret"), username, source)
    delays = state.settings.admin_login_delays()
    try:
        with state.login_throttle.password_check(), state.store.transaction() as session:
            pending = login_failures.wait_before_attempt(session, pair, delays)
            if pending is not None:
                seconds = max(1, math.ceil(pending.total_seconds()))
                error = APIError.rate_limited(
                    "too many failed logins with this name from this address; "
                    "wait as long as Retry-After says before trying again",
                    seconds,
                    code="too_many_login_attempts",
                )
                raise CheckRefused("throttled", error)
            result = check(session)
            if failed_guess(result):
                login_failures.record_failure(session, pair)
            else:
                login_failures.clear(session, pair)
                state.login_throttle.succeeded(source)
    except PasswordChecksBusy as busy:
        error = APIError.overloaded("too many password checks at once; retry shortly", 2)
        raise CheckRefused("busy", error) from busy
    return result
