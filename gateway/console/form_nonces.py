"""Single-use forms: a form that makes a secret works once, however often it is posted.

A new API key's secret is shown in the answer to the POST that makes it (nothing keeps it to
show later), so the browser is left on that POST: a reload, a history entry or a double click
would post the form again and make a second key. So each such form (create a key, rotate a
key) carries a random nonce in a hidden field, and the gateway remembers the nonces it handed
out in a bounded in-memory map, each for `TTL_S` (oldest forgotten first beyond `CAPACITY`).

A post claims its nonce before anything is made. The first claim goes ahead; once it has made
something the nonce is kept as used, naming what it made, and every later post of it is told
that (`FormAlreadyUsed`) and makes nothing. A post whose change was refused gives its nonce
back, so the corrected form can be sent again. A nonce the map does not hold (expired, handed
out by another gateway or before a restart, made up) makes nothing either (`FormExpired`):
refusing is always safe, the page that answers carries a fresh form.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import cast

from starlette.datastructures import State
from starlette.requests import Request

NONCE_FIELD = "form_nonce"
TTL_S = 900.0
CAPACITY = 10_000
_STATE_NAME = "console_forms"


class FormExpired(Exception):
    """The form's nonce is unknown here (too old, another gateway's, made up): nothing ran."""


class FormAlreadyUsed(Exception):
    """The form was posted before; `made` names what that post made (None: still running)."""

    def __init__(self, made: str | None) -> None:
        super().__init__(made or "in progress")
        self.made = made


@dataclass(slots=True)
class _Entry:
    scope: str  # what the form does, to whom: a nonce works for its own form only
    since: float
    claimed: bool = False
    made: str | None = None


@dataclass(slots=True)
class Claim:
    """A claimed nonce; set `made` once the post has made something (then the nonce is used)."""

    made: str | None = None


class OneTimeForms:
    """The nonces handed out to single-use forms; every method is safe from any thread."""

    def __init__(
        self,
        capacity: int = CAPACITY,
        ttl_s: float = TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._capacity = capacity
        self._ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # oldest `since` first
        self._lock = threading.Lock()

    def issue(self, scope: str) -> str:
        """A fresh nonce for one form whose action is `scope`."""
        nonce = secrets.token_urlsafe(18)
        with self._lock:
            self._forget_old()
            self._entries[nonce] = _Entry(scope, self._clock())
            while len(self._entries) > self._capacity:
                self._entries.popitem(last=False)
        return nonce

    @contextmanager
    def single_use(self, nonce: str, scope: str) -> Iterator[Claim]:
        """Run the body once for this nonce: raises `FormAlreadyUsed` or `FormExpired` instead.

        The nonce is used up if the body set `Claim.made`; if it did not (a refused change) or
        raised, the nonce is given back and the form may be posted again.
        """
        self._claim(nonce, scope)
        claim = Claim()
        try:
            yield claim
        finally:
            self._settle(nonce, claim.made)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def _claim(self, nonce: str, scope: str) -> None:
        with self._lock:
            self._forget_old()
            entry = self._entries.get(nonce)
            if entry is None or entry.scope != scope:
                raise FormExpired(scope)
            if entry.claimed:
                raise FormAlreadyUsed(entry.made)
            entry.claimed = True

    def _settle(self, nonce: str, made: str | None) -> None:
        with self._lock:
            entry = self._entries.get(nonce)
            if entry is None:
                return
            if made is None:
                entry.claimed = False
                return
            # Remembered as used for a full TTL from now: a reload minutes later is still told.
            entry.made, entry.since = made, self._clock()
            self._entries.move_to_end(nonce)

    def _forget_old(self) -> None:
        horizon = self._clock() - self._ttl_s
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if oldest.since > horizon:
                return
            self._entries.popitem(last=False)


def install_forms(app_state: State) -> None:
    """Give the app its map of single-use form nonces (one per gateway process)."""
    setattr(app_state, _STATE_NAME, OneTimeForms())


def one_time_forms(request: Request) -> OneTimeForms:
    """This gateway's single-use form nonces."""
    return cast(OneTimeForms, getattr(request.app.state, _STATE_NAME))
